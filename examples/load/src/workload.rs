//! Workloads. Every builder is deterministic for a given seed.
//!
//! * [`mixed_demo`]: chat and completions, streaming and not, around a few
//!   shared system prompts — a little of everything, for the demo;
//! * [`shared_prefix`]: groups of token prompts sharing a long prefix, the
//!   shape the Gateway API Inference Extension and SGLang benchmark prefix
//!   routing with;
//! * [`mooncake`]: Mooncake FAST'25 trace lines (`timestamp`,
//!   `input_length`, `output_length`, `hash_ids`), each hash id turned into a
//!   fixed block of 512 token ids, so equal ids give equal blocks;
//! * [`load_spill`]: groups of token prompts sharing a long prefix, one
//!   group at a time arriving faster than one worker serves it, the hot
//!   group rotating: the load a holder's cache alone cannot carry.

use crate::RequestSpec;
use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::time::Duration;

fn spec(
    path: &str,
    body: serde_json::Value,
    stream: bool,
    at: Duration,
    tag: &str,
    tokens: Option<u64>,
) -> RequestSpec {
    RequestSpec {
        path: path.into(),
        body: Bytes::from(body.to_string()),
        stream,
        at,
        tag: tag.into(),
        prompt_tokens: tokens,
    }
}

const SYSTEMS: [&str; 4] = [
    "You are a careful assistant for a logistics company. Answer with exact figures and name your assumptions.",
    "You are a code reviewer. Point out bugs first, then style, and keep every remark to one sentence.",
    "You summarise support tickets for an on-call engineer: impact, suspected cause, next step.",
    "You translate product copy into plain English for a general audience without losing facts.",
];

/// `n` requests, one every `gap`.
pub fn mixed_demo(model: &str, n: usize, gap: Duration, seed: u64) -> Vec<RequestSpec> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let sys = SYSTEMS[rng.random_range(0..SYSTEMS.len())];
            let question = format!("Question {} about item {}: what changed since last week?", i, rng.random_range(0..50));
            let stream = i % 3 == 0;
            let max_tokens = rng.random_range(8..48);
            let at = gap * i as u32;
            if i % 4 == 3 {
                let tokens: Vec<u32> = (0..rng.random_range(64..256)).map(|t| 1000 + (t * 7 + i as u32 % 5) % 5000).collect();
                let n = tokens.len() as u64;
                spec(
                    "/v1/completions",
                    json!({"model": model, "prompt": tokens, "max_tokens": max_tokens, "stream": stream}),
                    stream,
                    at,
                    "completion",
                    Some(n),
                )
            } else {
                spec(
                    "/v1/chat/completions",
                    json!({"model": model, "stream": stream, "max_tokens": max_tokens,
                           "messages": [{"role": "system", "content": sys}, {"role": "user", "content": question}]}),
                    stream,
                    at,
                    "chat",
                    None,
                )
            }
        })
        .collect()
}

/// Deterministic token ids for a block.
fn block(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(100..150_000)).collect()
}

/// Parameters of [`shared_prefix`].
#[derive(Debug, Clone, Copy)]
pub struct SharedPrefix {
    pub groups: usize,
    pub per_group: usize,
    pub prefix_tokens: usize,
    pub question_tokens: usize,
    pub output_tokens: u32,
    /// Mean request rate (Poisson arrivals), requests per second.
    pub rate: f64,
}

pub fn shared_prefix(model: &str, p: SharedPrefix, seed: u64) -> Vec<RequestSpec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let prefixes: Vec<Vec<u32>> = (0..p.groups)
        .map(|g| block(seed ^ (g as u64) << 20, p.prefix_tokens))
        .collect();
    let mut order: Vec<(usize, usize)> = (0..p.groups)
        .flat_map(|g| (0..p.per_group).map(move |i| (g, i)))
        .collect();
    // Interleave groups so that prefix reuse competes with load.
    for i in (1..order.len()).rev() {
        let j = rng.random_range(0..=i);
        order.swap(i, j);
    }
    let mut t = 0.0f64;
    order
        .into_iter()
        .map(|(g, i)| {
            let mut tokens = prefixes[g].clone();
            tokens.extend(block(seed ^ 0xABCD ^ ((g * 10_000 + i) as u64), p.question_tokens));
            let n = tokens.len() as u64;
            let at = Duration::from_secs_f64(t);
            t += -(1.0 - rng.random::<f64>()).ln() / p.rate.max(1e-9);
            spec(
                "/v1/completions",
                json!({"model": model, "prompt": tokens, "max_tokens": p.output_tokens, "stream": true}),
                true,
                at,
                &format!("group-{g}"),
                Some(n),
            )
        })
        .collect()
}

/// Parameters of [`load_spill`].
#[derive(Debug, Clone, Copy)]
pub struct LoadSpill {
    pub groups: usize,
    pub prefix_tokens: usize,
    /// Each request's own tokens after its group's prefix, uniform in
    /// `[min, max]`.
    pub suffix_tokens: (usize, usize),
    pub output_tokens: u32,
    /// Mean request rate (Poisson arrivals), requests per second.
    pub rate: f64,
    /// Share of the arrivals that belong to the hot group; the rest are
    /// spread evenly over every group. 0: no group is hot.
    pub hot_share: f64,
    /// How long a group stays hot before the next one is.
    pub phase_s: f64,
    /// Arrivals stop after this long.
    pub secs: f64,
}

/// Requests of `p.groups` prefix groups; in the `k`th phase of
/// `p.phase_s` seconds group `k mod groups` is hot. A hot request is tagged
/// `hot`, any other `background`: the background keeps every group's
/// prefix cached somewhere, so a burst finds a holder rather than a cold
/// fleet.
pub fn load_spill(model: &str, p: LoadSpill, seed: u64) -> Vec<RequestSpec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let groups = p.groups.max(1);
    let prefixes: Vec<Vec<u32>> = (0..groups)
        .map(|g| block(seed ^ 0x5911 ^ ((g as u64) << 24), p.prefix_tokens))
        .collect();
    let (lo, hi) = (p.suffix_tokens.0, p.suffix_tokens.1.max(p.suffix_tokens.0));
    let mut out = Vec::new();
    let mut t = 0.0f64;
    while t < p.secs {
        let phase = (t / p.phase_s.max(1e-9)) as usize;
        let hot = rng.random::<f64>() < p.hot_share;
        let g = if hot {
            phase % groups
        } else {
            rng.random_range(0..groups)
        };
        let mut tokens = prefixes[g].clone();
        let suffix = rng.random_range(lo..=hi);
        // Drawn from the stream itself: no two requests share a suffix.
        tokens.extend((0..suffix).map(|_| rng.random_range(100..150_000u32)));
        let n = tokens.len() as u64;
        out.push(spec(
            "/v1/completions",
            json!({"model": model, "prompt": tokens, "max_tokens": p.output_tokens, "stream": true}),
            true,
            Duration::from_secs_f64(t),
            if hot { "hot" } else { "background" },
            Some(n),
        ));
        t += -(1.0 - rng.random::<f64>()).ln() / p.rate.max(1e-9);
    }
    out
}

/// Turns Mooncake trace lines into requests. `block_tokens` is 512 for the
/// published traces; `limit` caps the number of requests.
pub fn mooncake(
    text: &str,
    model: &str,
    limit: usize,
    block_tokens: usize,
) -> Result<Vec<RequestSpec>, String> {
    let mut out = Vec::new();
    for (n, line) in text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(limit)
        .enumerate()
    {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: {e}", n + 1))?;
        let ts = v["timestamp"]
            .as_u64()
            .ok_or(format!("line {}: no timestamp", n + 1))?;
        let input = v["input_length"]
            .as_u64()
            .ok_or(format!("line {}: no input_length", n + 1))? as usize;
        let output = v["output_length"].as_u64().unwrap_or(1).max(1);
        let ids: Vec<u64> = v["hash_ids"]
            .as_array()
            .ok_or(format!("line {}: no hash_ids", n + 1))?
            .iter()
            .filter_map(serde_json::Value::as_u64)
            .collect();
        let mut tokens = Vec::with_capacity(input);
        for (i, id) in ids.iter().enumerate() {
            let len = if i + 1 == ids.len() {
                input.saturating_sub(block_tokens * (ids.len() - 1))
            } else {
                block_tokens
            };
            tokens.extend(block(
                0x6D6F_6F6E ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                len,
            ));
        }
        let count = tokens.len() as u64;
        out.push(spec(
            "/v1/completions",
            json!({"model": model, "prompt": tokens, "max_tokens": output, "stream": true}),
            true,
            Duration::from_millis(ts),
            "mooncake",
            Some(count),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(s: &RequestSpec) -> Vec<u32> {
        let v: serde_json::Value = serde_json::from_slice(&s.body).unwrap();
        v["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    }

    #[test]
    fn deterministic() {
        let a = mixed_demo("m", 20, Duration::from_millis(10), 7);
        let b = mixed_demo("m", 20, Duration::from_millis(10), 7);
        assert_eq!(
            a.iter().map(|s| s.body.clone()).collect::<Vec<_>>(),
            b.iter().map(|s| s.body.clone()).collect::<Vec<_>>()
        );
        assert!(a.iter().any(|s| s.stream) && a.iter().any(|s| !s.stream));
        assert!(
            a.iter().any(|s| s.path == "/v1/completions")
                && a.iter().any(|s| s.path == "/v1/chat/completions")
        );
    }

    #[test]
    fn shared_prefix_groups_share_their_prefix() {
        let p = SharedPrefix {
            groups: 3,
            per_group: 4,
            prefix_tokens: 100,
            question_tokens: 10,
            output_tokens: 5,
            rate: 100.0,
        };
        let specs = shared_prefix("m", p, 1);
        assert_eq!(specs.len(), 12);
        let g0: Vec<Vec<u32>> = specs
            .iter()
            .filter(|s| s.tag == "group-0")
            .map(prompt)
            .collect();
        assert_eq!(g0.len(), 4);
        assert!(
            g0.iter()
                .all(|t| t[..100] == g0[0][..100] && t.len() == 110)
        );
        assert_ne!(g0[0][100..], g0[1][100..]);
        let g1 = specs
            .iter()
            .find(|s| s.tag == "group-1")
            .map(prompt)
            .unwrap();
        assert_ne!(g1[..100], g0[0][..100]);
        assert!(specs.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn load_spill_rotates_a_hot_group() {
        let p = LoadSpill {
            groups: 3,
            prefix_tokens: 64,
            suffix_tokens: (8, 16),
            output_tokens: 4,
            rate: 200.0,
            hot_share: 0.8,
            phase_s: 1.0,
            secs: 3.0,
        };
        let specs = load_spill("m", p, 5);
        assert_eq!(
            specs.iter().map(|s| s.body.clone()).collect::<Vec<_>>(),
            load_spill("m", p, 5)
                .iter()
                .map(|s| s.body.clone())
                .collect::<Vec<_>>()
        );
        assert!(specs.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(specs.iter().all(|s| s.at.as_secs_f64() < 3.0));
        let hot: Vec<&RequestSpec> = specs.iter().filter(|s| s.tag == "hot").collect();
        let share = hot.len() as f64 / specs.len() as f64;
        assert!((0.7..0.9).contains(&share), "hot share {share}");
        // Each phase's hot requests share one prefix, another phase's a
        // different one.
        let prefix_of = |s: &RequestSpec| prompt(s)[..64].to_vec();
        let in_phase = |k: u64| -> Vec<Vec<u32>> {
            hot.iter()
                .filter(|s| s.at.as_secs() == k)
                .map(|s| prefix_of(s))
                .collect()
        };
        let (a, b) = (in_phase(0), in_phase(1));
        assert!(a.len() > 10 && b.len() > 10);
        assert!(a.iter().all(|x| *x == a[0]) && b.iter().all(|x| *x == b[0]));
        assert_ne!(a[0], b[0]);
        let (x, y) = (prompt(hot[0]), prompt(hot[1]));
        assert!((72..=80).contains(&x.len()));
        assert_ne!(x[64..], y[64..], "suffixes are each request's own");
        assert_eq!(
            load_spill(
                "m",
                LoadSpill {
                    hot_share: 0.0,
                    ..p
                },
                5
            )
            .iter()
            .filter(|s| s.tag == "hot")
            .count(),
            0
        );
    }

    #[test]
    fn mooncake_blocks() {
        let text = "{\"timestamp\": 0, \"input_length\": 1030, \"output_length\": 5, \"hash_ids\": [1, 2, 3]}\n\
                    {\"timestamp\": 20, \"input_length\": 600, \"output_length\": 7, \"hash_ids\": [1, 9]}\n";
        let s = mooncake(text, "m", 10, 512).unwrap();
        let (a, b) = (prompt(&s[0]), prompt(&s[1]));
        assert_eq!(a.len(), 1030, "last block holds the remainder");
        assert_eq!(b.len(), 600);
        assert_eq!(a[..512], b[..512], "equal hash ids, equal blocks");
        assert_ne!(a[512..600], b[512..600]);
        assert_eq!(s[1].at, Duration::from_millis(20));
        assert!(mooncake("{", "m", 1, 512).is_err());
    }
}
