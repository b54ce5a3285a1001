//! Figures several benchmarks take alike from their outcomes and results:
//! admitted requests' latency percentiles, medians and spreads of
//! repeated runs, the filter's histograms read from Envoy, and plot points
//! read back from a result's JSON.

use anyhow::{Context, Result};
use kvgate_load::Outcome;
use kvgate_load::summary::percentile;
use kvgate_stack::{Stack, http};
use serde_json::{Value, json};

/// The `p`th percentile of sorted microseconds, in milliseconds; 0 when
/// there are none, so an empty run reads as no figure rather than failing
/// the report.
pub fn ms(sorted_us: &[u64], p: f64) -> f64 {
    percentile(sorted_us, p).unwrap_or(0) as f64 / 1000.0
}

/// Admitted (200) requests' times to first token, sorted, in µs.
pub fn admitted_ttft_us(outcomes: &[Outcome]) -> Vec<u64> {
    sorted(admitted(outcomes).filter_map(|o| o.ttft_us))
}

/// Admitted (200) requests' whole latencies, sorted, in µs.
pub fn admitted_latency_us(outcomes: &[Outcome]) -> Vec<u64> {
    sorted(admitted(outcomes).map(|o| o.latency_us))
}

fn admitted(outcomes: &[Outcome]) -> impl Iterator<Item = &Outcome> {
    outcomes.iter().filter(|o| o.status == 200)
}

fn sorted(v: impl Iterator<Item = u64>) -> Vec<u64> {
    let mut v: Vec<u64> = v.collect();
    v.sort_unstable();
    v
}

/// A result's series, a JSON array of `[x, y]` pairs, as plot points;
/// anything else in it is skipped.
pub fn points(v: &Value) -> Vec<(f64, f64)> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
        .collect()
}

/// The middle of repeated runs' figures (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Highest minus lowest of repeated runs' figures.
pub fn spread(v: &[f64]) -> f64 {
    let (lo, hi) = v
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
    if v.is_empty() { 0.0 } else { hi - lo }
}

/// A filter histogram's detailed buckets (`lower`, `width`, count), all
/// recorded since Envoy started.
pub fn histogram_buckets(stack: &Stack, name: &str) -> Result<Vec<(f64, f64, u64)>> {
    let (_, body) = http::get(
        &stack.admin_addr(),
        &format!("/stats?filter=wasmcustom\\.{name}$&histogram_buckets=detailed"),
    )?;
    let text = String::from_utf8_lossy(&body);
    // "  totals=7,0.1:1, 8,0.1:304, ...": lower,width:count.
    let totals = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("totals="))
        .unwrap_or_default();
    let mut out = Vec::new();
    for b in totals.split(", ").filter(|b| !b.is_empty()) {
        let parsed = b.split_once(':').and_then(|(range, n)| {
            let (lower, width) = range.split_once(',')?;
            Some((lower.parse().ok()?, width.parse().ok()?, n.parse().ok()?))
        });
        out.push(parsed.with_context(|| format!("histogram bucket {b:?} of {name}"))?);
    }
    Ok(out)
}

/// Percentiles of what a histogram recorded between two readings of
/// [`histogram_buckets`]: a measured window without the warm-up before it.
/// Linear within a bucket, as Envoy's own summary.
pub fn percentiles_between(
    before: &[(f64, f64, u64)],
    after: &[(f64, f64, u64)],
    ps: &[f64],
) -> Value {
    let mut window: Vec<(f64, f64, u64)> = after
        .iter()
        .map(|&(lower, width, n)| {
            let old = before
                .iter()
                .find(|b| b.0 == lower && b.1 == width)
                .map_or(0, |b| b.2);
            (lower, width, n.saturating_sub(old))
        })
        .filter(|b| b.2 > 0)
        .collect();
    window.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: u64 = window.iter().map(|b| b.2).sum();
    let mut out = serde_json::Map::new();
    out.insert("count".into(), json!(total));
    for &p in ps {
        let target = p / 100.0 * total as f64;
        let mut seen = 0.0;
        let mut value = f64::NAN;
        for &(lower, width, n) in &window {
            if seen + n as f64 >= target {
                value = lower + width * ((target - seen) / n as f64).clamp(0.0, 1.0);
                break;
            }
            seen += n as f64;
        }
        out.insert(format!("P{p}"), json!(value));
    }
    Value::Object(out)
}

/// A closed loop's capacity: its completion rate between the first and
/// the last `concurrency` completions (the ramp-up and the drain left
/// out), from the end times of the requests that succeeded, with the
/// counts the results keep beside it.
pub fn steady_capacity(
    mut ends_us: Vec<u64>,
    requests: usize,
    concurrency: usize,
    wall_s: f64,
) -> Result<Value> {
    ends_us.sort_unstable();
    let (k1, k2) = (
        concurrency.min(ends_us.len()),
        ends_us.len().saturating_sub(concurrency),
    );
    anyhow::ensure!(
        k2 > k1 + 10,
        "capacity: only {} of {requests} requests completed",
        ends_us.len()
    );
    let rps = (k2 - k1) as f64 / ((ends_us[k2 - 1] - ends_us[k1 - 1]) as f64 / 1e6).max(1e-6);
    Ok(json!({
        "requests": requests, "ok": ends_us.len(), "concurrency": concurrency,
        "seconds": wall_s, "rps": rps,
    }))
}

/// A results file's flag list (`[[flag, value], ...]`) as the report
/// quotes it, each `` `flag value` ``.
pub fn flags(list: &Value) -> Vec<String> {
    list.as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            format!(
                "`{} {}`",
                p[0].as_str().unwrap_or(""),
                p[1].as_str().unwrap_or("")
            )
        })
        .collect()
}

/// `x` to `d` places, or a dash where there is no number.
pub fn num_or_dash(x: Option<f64>, d: usize) -> String {
    match x {
        Some(x) if x.is_finite() => crate::figures::fixed(x, d),
        _ => "—".into(),
    }
}

/// A share `x` in percent to `d` places, or a dash.
pub fn pct_or_dash(x: Option<f64>, d: usize) -> String {
    match x {
        Some(x) if x.is_finite() => format!("{} %", crate::figures::fixed(100.0 * x, d)),
        _ => "—".into(),
    }
}

/// From a run's first send to its last answer, in seconds.
pub fn span_s(outcomes: &[Outcome]) -> f64 {
    let first = outcomes.iter().map(|o| o.start_us).min().unwrap_or(0);
    let last = outcomes
        .iter()
        .map(|o| o.start_us + o.latency_us)
        .max()
        .unwrap_or(0);
    last.saturating_sub(first) as f64 / 1e6
}

/// The number at `path` of a results value, if there is one.
pub fn at(v: &Value, path: &[&str]) -> Option<f64> {
    path.iter().fold(v, |cur, p| &cur[*p]).as_f64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn outcome(status: u16, ttft_us: Option<u64>, latency_us: u64) -> Outcome {
        Outcome {
            tag: String::new(),
            status,
            error: None,
            ttft_us,
            latency_us,
            worker: None,
            rank: None,
            cached_tokens: None,
            prompt_tokens: None,
            reason: None,
            retry_after_s: None,
            chunks: 0,
            itl_us: Vec::new(),
            error_body: None,
            start_us: 0,
        }
    }

    #[test]
    fn percentiles_count_admitted_requests_only() {
        let outcomes = [
            outcome(200, Some(3000), 9000),
            outcome(503, Some(1), 1),
            outcome(200, Some(1000), 5000),
            outcome(200, None, 7000),
        ];
        let ttft = admitted_ttft_us(&outcomes);
        assert_eq!(ttft, [1000, 3000]);
        assert_eq!(ms(&ttft, 50.0), 1.0);
        assert_eq!(ms(&ttft, 99.0), 3.0);
        assert_eq!(admitted_latency_us(&outcomes), [5000, 7000, 9000]);
        assert_eq!(ms(&[], 50.0), 0.0);
    }

    #[test]
    fn points_keep_numeric_pairs() {
        let v = json!([[0, 1.5], [1, "x"], [2.5, 3], "junk"]);
        assert_eq!(points(&v), [(0.0, 1.5), (2.5, 3.0)]);
        assert!(points(&json!({"a": 1})).is_empty());
    }
}
