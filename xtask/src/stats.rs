//! Figures several benchmarks take alike from their outcomes and results:
//! admitted requests' latency percentiles, and plot points read back from
//! a result's JSON.

use kvgate_load::Outcome;
use kvgate_load::summary::percentile;
use serde_json::Value;

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
