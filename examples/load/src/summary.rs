//! Summaries of a run: counts, per-worker load, latency percentiles.

use crate::Outcome;
use serde::Serialize;
use std::collections::BTreeMap;

/// Nearest-rank percentile of sorted values (`p` in 0–100).
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

fn pct(mut v: Vec<u64>) -> Option<Percentiles> {
    v.sort_unstable();
    let ms = |p| percentile(&v, p).map(|us| us as f64 / 1000.0);
    Some(Percentiles {
        p50_ms: ms(50.0)?,
        p90_ms: ms(90.0)?,
        p99_ms: ms(99.0)?,
    })
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub by_status: BTreeMap<String, usize>,
    pub by_reason: BTreeMap<String, usize>,
    pub per_worker: BTreeMap<String, usize>,
    pub ttft: Option<Percentiles>,
    pub latency: Option<Percentiles>,
    pub wall_s: f64,
    pub throughput_rps: f64,
    /// Cached prompt tokens over prompt tokens, where both are known.
    pub hit_rate: Option<f64>,
}

impl Summary {
    pub fn of(outcomes: &[Outcome]) -> Summary {
        let mut s = Summary {
            requests: outcomes.len(),
            ..Default::default()
        };
        let (mut ttft, mut lat) = (Vec::new(), Vec::new());
        let (mut cached, mut prompt) = (0u64, 0u64);
        let (mut first, mut last) = (u64::MAX, 0u64);
        for o in outcomes {
            let key = if o.status == 0 {
                "error".to_string()
            } else {
                o.status.to_string()
            };
            *s.by_status.entry(key).or_default() += 1;
            if let Some(r) = &o.reason {
                *s.by_reason.entry(r.clone()).or_default() += 1;
            }
            first = first.min(o.start_us);
            last = last.max(o.start_us + o.latency_us);
            if o.status == 200 && o.error.is_none() {
                s.ok += 1;
                lat.push(o.latency_us);
                if let Some(t) = o.ttft_us {
                    ttft.push(t);
                }
                if let Some(w) = &o.worker {
                    *s.per_worker.entry(w.clone()).or_default() += 1;
                }
                if let (Some(c), Some(p)) = (o.cached_tokens, o.prompt_tokens) {
                    cached += c;
                    prompt += p;
                }
            }
        }
        s.ttft = pct(ttft);
        s.latency = pct(lat);
        s.wall_s = if last > first {
            (last - first) as f64 / 1e6
        } else {
            0.0
        };
        s.throughput_rps = if s.wall_s > 0.0 {
            s.ok as f64 / s.wall_s
        } else {
            0.0
        };
        s.hit_rate = (prompt > 0).then(|| cached as f64 / prompt as f64);
        s
    }

    /// A plain-text table for terminals.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "requests {}  ok {}  wall {:.2} s  throughput {:.1} req/s\n",
            self.requests, self.ok, self.wall_s, self.throughput_rps
        ));
        let statuses: Vec<String> = self
            .by_status
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        out.push_str(&format!("by status     {}\n", statuses.join("  ")));
        if !self.by_reason.is_empty() {
            let reasons: Vec<String> = self
                .by_reason
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect();
            out.push_str(&format!("local replies {}\n", reasons.join("  ")));
        }
        let workers: Vec<String> = self
            .per_worker
            .iter()
            .map(|(k, v)| format!("w{k}: {v}"))
            .collect();
        out.push_str(&format!("per worker    {}\n", workers.join("  ")));
        for (name, p) in [("ttft", &self.ttft), ("latency", &self.latency)] {
            if let Some(p) = p {
                out.push_str(&format!(
                    "{name:<13} p50 {:>8.2} ms  p90 {:>8.2} ms  p99 {:>8.2} ms\n",
                    p.p50_ms, p.p90_ms, p.p99_ms
                ));
            }
        }
        if let Some(h) = self.hit_rate {
            out.push_str(&format!(
                "prefix hits   {:.1} % of prompt tokens\n",
                h * 100.0
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&[7], 90.0), Some(7));
        assert_eq!(percentile(&[], 50.0), None);
    }

    fn outcome(status: u16, worker: &str, lat: u64) -> Outcome {
        Outcome {
            tag: String::new(),
            status,
            error: None,
            ttft_us: Some(lat / 2),
            latency_us: lat,
            worker: Some(worker.into()),
            rank: None,
            cached_tokens: Some(10),
            prompt_tokens: Some(40),
            reason: (status == 503).then(|| "all_workers_busy".into()),
            retry_after_s: None,
            chunks: 1,
            itl_us: Vec::new(),
            error_body: None,
            start_us: 0,
        }
    }

    #[test]
    fn summary_counts() {
        let s = Summary::of(&[
            outcome(200, "1", 2000),
            outcome(200, "2", 4000),
            outcome(503, "", 100),
        ]);
        assert_eq!((s.requests, s.ok), (3, 2));
        assert_eq!(s.by_status["503"], 1);
        assert_eq!(s.by_reason["all_workers_busy"], 1);
        assert_eq!(s.per_worker.len(), 2);
        assert_eq!(s.latency.as_ref().unwrap().p50_ms, 2.0);
        assert_eq!(s.hit_rate, Some(0.25));
        assert!(s.render().contains("by status     200: 2  503: 1"));
    }
}
