//! A small parser for the Prometheus text exposition format, and the
//! extraction of the engine load signals kvgate routes on.
//!
//! Only what a scrape of vLLM or SGLang needs: samples with labels, values
//! including `NaN` and `±Inf`, optional timestamps. Comments are skipped. A
//! malformed line is counted and skipped, never fatal: one odd metric from
//! an engine upgrade must not take a worker out of rotation.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Default)]
pub struct Parsed {
    pub samples: Vec<Sample>,
    pub malformed_lines: usize,
}

pub fn parse(text: &str) -> Parsed {
    let mut out = Parsed::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_line(line) {
            Some(s) => out.samples.push(s),
            None => out.malformed_lines += 1,
        }
    }
    out
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let (ls, after) = parse_labels(r)?;
        labels = ls;
        rest = after;
    }
    let mut parts = rest.split_whitespace();
    let value = parse_value(parts.next()?)?;
    if let Some(ts) = parts.next() {
        ts.parse::<i64>().ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Parses `k="v",...}` and returns the rest after the closing brace.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(r) = s.strip_prefix('}') {
            return Some((out, r));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_string();
        if key.is_empty() {
            return None;
        }
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        out.push((key, value));
        s = s[end + 1..].trim_start();
        if let Some(r) = s.strip_prefix(',') {
            s = r;
        }
    }
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => v.parse().ok(),
    }
}

/// The load signals [`extract`] reads. A page carrying none of them is not
/// an engine's (a node_exporter, a proxy's own page, a wrong port), and
/// routing on it would take the worker for idle: its scrape fails instead.
pub const LOAD_METRICS: &[&str] = &[
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
];

/// Whether the page carries at least one of [`LOAD_METRICS`].
pub fn is_engine_page(parsed: &Parsed) -> bool {
    parsed
        .samples
        .iter()
        .any(|s| LOAD_METRICS.contains(&s.name.as_str()))
}

/// Engine load of one DP rank as scraped.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankMetrics {
    pub running: u32,
    pub waiting: u32,
    /// Fraction 0–1 of KV blocks in use.
    pub kv_usage: f64,
    pub kv_total_blocks: u64,
    pub block_size: u32,
    pub max_num_batched_tokens: u64,
}

impl RankMetrics {
    pub fn kv_used_blocks(&self) -> u64 {
        (self.kv_usage.clamp(0.0, 1.0) * self.kv_total_blocks as f64).round() as u64
    }
}

fn finite_u64(v: f64) -> u64 {
    if v.is_finite() && v > 0.0 {
        v.round().min(u64::MAX as f64) as u64
    } else {
        0
    }
}

fn finite_u32(v: f64) -> u32 {
    if v.is_finite() && v > 0.0 {
        v.round().min(u32::MAX as f64) as u32
    } else {
        0
    }
}

/// Per-rank load from a scrape of vLLM (current and deprecated names) or
/// SGLang. The rank is the `engine` label (vLLM's DP engine index), or the
/// `dp_rank` label (SGLang's), relative to `start_rank` when the engine
/// numbers ranks globally; samples without one belong to rank 0.
///
/// `block_size` is the worker's configured block size: SGLang reports its
/// capacity in tokens (or pages of its own `--page-size`), and the busy
/// rule compares it with bookings counted in kvgate blocks, so it is
/// converted to those.
pub fn extract(
    parsed: &Parsed,
    dp_size: u32,
    start_rank: u32,
    block_size: u32,
) -> Vec<RankMetrics> {
    let mut ranks: BTreeMap<u32, RankMetrics> = BTreeMap::new();
    // SGLang capacity per rank, in tokens: `num_pages × page_size` (0.5.11
    // on, as gauges or as `cache_config_info` labels) when published, else
    // `max_total_num_tokens` (every 0.5.x).
    let mut sglang_pages: BTreeMap<u32, (u64, u32)> = BTreeMap::new();
    let mut sglang_tokens: BTreeMap<u32, u64> = BTreeMap::new();
    for s in &parsed.samples {
        let label = s.label("engine").or_else(|| s.label("dp_rank"));
        let rank = match label.and_then(|l| l.parse::<u32>().ok()) {
            None => 0,
            Some(r) if r < dp_size => r,
            Some(r) if (start_rank..start_rank.saturating_add(dp_size)).contains(&r) => {
                r - start_rank
            }
            Some(_) => continue,
        };
        let m = ranks.entry(rank).or_default();
        match s.name.as_str() {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                m.running = finite_u32(s.value)
            }
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                m.waiting = finite_u32(s.value)
            }
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" if s.value.is_finite() => {
                m.kv_usage = s.value
            }
            // The deprecated name only counts when the current one is absent.
            "vllm:gpu_cache_usage_perc" if s.value.is_finite() && m.kv_usage == 0.0 => {
                m.kv_usage = s.value
            }
            "vllm:cache_config_info" => {
                if let Some(n) = s.label("num_gpu_blocks").and_then(|v| v.parse().ok()) {
                    m.kv_total_blocks = n;
                }
                if let Some(b) = s.label("block_size").and_then(|v| v.parse().ok()) {
                    m.block_size = b;
                }
                if let Some(b) = s
                    .label("max_num_batched_tokens")
                    .and_then(|v| v.parse().ok())
                {
                    m.max_num_batched_tokens = b;
                }
            }
            "sglang:max_total_num_tokens" => {
                sglang_tokens.insert(rank, finite_u64(s.value));
            }
            "sglang:num_pages" => sglang_pages.entry(rank).or_default().0 = finite_u64(s.value),
            "sglang:page_size" => sglang_pages.entry(rank).or_default().1 = finite_u32(s.value),
            "sglang:cache_config_info" => {
                let p = sglang_pages.entry(rank).or_default();
                if let Some(n) = s.label("num_pages").and_then(|v| v.parse().ok()) {
                    p.0 = n;
                }
                if let Some(b) = s.label("page_size").and_then(|v| v.parse().ok()) {
                    p.1 = b;
                }
            }
            _ => {}
        }
    }
    for (rank, m) in &mut ranks {
        let (pages, page_size) = sglang_pages.get(rank).copied().unwrap_or_default();
        let tokens = if pages > 0 && page_size > 0 {
            pages.saturating_mul(u64::from(page_size))
        } else {
            sglang_tokens.get(rank).copied().unwrap_or(0)
        };
        if tokens == 0 {
            continue;
        }
        if page_size > 0 {
            m.block_size = page_size;
        }
        let bs = if block_size > 0 {
            block_size
        } else {
            page_size.max(1)
        };
        m.kv_total_blocks = tokens / u64::from(bs);
    }
    (0..dp_size)
        .map(|r| ranks.get(&r).copied().unwrap_or_default())
        .collect()
}

#[cfg(test)]
mod tests;
