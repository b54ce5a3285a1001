//! The load loop's latency fits, one set per latency: each worker's own,
//! and one pooled per role from the samples of every worker of that role.
//! A worker too new for its own fit is estimated with its role's: its
//! engine is the model's and its role's, its load its own. Pooling by
//! role keeps a prefill worker's TTFT (prompts only) apart from a `both`
//! worker's, and a decode worker's ITL apart from one that also prefills:
//! what sizing each role's pool needs.
//!
//! The same fits are published per worker in the snapshot for every
//! model with an SLO, planned or not ([`Latency`]): their `x`s are
//! `kvgate_core::fit`'s, so a router predicts with what they learned on.

use super::regress::{LAMBDA, Line};
use super::{KTOK, LegEnd, served};
use kvgate_core::Role;
use kvgate_core::fit::{Fit, WorkerFits};
use std::collections::BTreeMap;
use std::time::Instant;

/// A fit and when it last took a sample.
#[derive(Debug, Clone, Default)]
struct Timed {
    line: Line,
    at: Option<Instant>,
}

impl Timed {
    fn add(&mut self, x: f64, y: f64, at: Instant) {
        let before = self.line.samples();
        self.line.add(x, y);
        if self.line.samples() > before {
            self.at = Some(at);
        }
    }
}

/// One latency fitted against one kind of load.
#[derive(Debug, Clone, Default)]
pub struct Fits {
    workers: BTreeMap<u64, Timed>,
    /// By [`Role::code`].
    roles: [Timed; 3],
}

impl Fits {
    /// A sample taken on `worker`, of `role` when the leg was booked,
    /// at `at`.
    pub fn add(&mut self, worker: u64, role: Role, x: f64, y: f64, at: Instant) {
        self.workers.entry(worker).or_default().add(x, y, at);
        self.roles[usize::from(role.code())].add(x, y, at);
    }

    /// The worker's own fit.
    pub fn worker(&self, id: u64) -> Option<&Line> {
        self.workers.get(&id).map(|t| &t.line)
    }

    /// The samples of every worker of `role`, pooled.
    pub fn role(&self, role: Role) -> &Line {
        &self.roles[usize::from(role.code())].line
    }

    /// The fit that stands for `worker`: its own once trusted, else its
    /// role's.
    fn chosen(&self, worker: u64, role: Role) -> &Timed {
        self.workers
            .get(&worker)
            .filter(|t| t.line.ready())
            .unwrap_or(&self.roles[usize::from(role.code())])
    }

    /// The estimate at `x` on `worker`: its own fit once trusted, else
    /// its role's; `None` while neither is.
    pub fn predict(&self, worker: u64, role: Role, x: f64) -> Option<f64> {
        self.chosen(worker, role).line.predict(x)
    }

    /// The fit that stands for `worker` as a router reads it, its age
    /// counted to `now`; `None` before it took any sample.
    pub fn published(&self, worker: u64, role: Role, now: Instant) -> Option<Fit> {
        let t = self.chosen(worker, role);
        let at = t.at?;
        let (a, b) = t.line.coefficients();
        let fit = Fit {
            intercept_ms: a as f32,
            slope_ms_per_ktok: b as f32,
            samples: u32::try_from(t.line.samples()).unwrap_or(u32::MAX),
            age_s: u32::try_from(now.saturating_duration_since(at).as_secs()).unwrap_or(u32::MAX),
        };
        // A coefficient past f32's range would be read as no fit anyway;
        // it is published as one of no samples, which says so.
        Some(if fit.is_finite() { fit } else { Fit::default() })
    }

    /// A worker left the fleet: its own fit goes; what it taught its
    /// role's stays, as the role's engine has not changed.
    pub fn forget(&mut self, worker: u64) {
        self.workers.remove(&worker);
    }
}

/// A model's two latency fits: TTFT against the prompt tokens in flight
/// on a rank when a request was routed (its own uncached ones included),
/// ITL against the KV tokens in flight there (its own not), both in
/// thousands of tokens, as `kvgate_core::fit` defines them.
#[derive(Debug, Clone, Default)]
pub struct Latency {
    pub ttft: Fits,
    pub itl: Fits,
    /// How far the published TTFT fit's prediction was from each sample
    /// it then learned from: what a router predicting with it got.
    ttft_error: Error,
}

/// A mean absolute error in parts of the observed value, recent samples
/// weighing most (about the fits' own memory).
#[derive(Debug, Clone, Copy, Default)]
struct Error {
    mean: f64,
    samples: u64,
}

impl Error {
    fn add(&mut self, predicted: f64, observed: f64) {
        if !(observed > 0.0 && predicted.is_finite()) {
            return;
        }
        let e = (predicted - observed).abs() / observed;
        self.samples += 1;
        // An average until the window fills, then exponential, forgetting
        // at the fits' own rate.
        let w = (1.0 / self.samples as f64).max(1.0 - LAMBDA);
        self.mean += w * (e - self.mean);
    }
}

impl Latency {
    /// The latencies a leg's end teaches (see
    /// [`super::ModelPlanner::observe_end`]): a TTFT sample if it computed
    /// the prompt, an ITL sample if it produced an answer of two tokens or
    /// more; nothing if it failed or no byte came.
    pub fn observe(&mut self, end: &LegEnd) {
        let t = &end.timing;
        // No first byte, no latency: a zero would pull the fits down.
        if !served(t) || t.first_byte_us == 0 {
            return;
        }
        if end.prefilled() {
            let ttft_ms = f64::from(t.first_byte_us) / 1000.0;
            let x = end.prefill_tokens / KTOK;
            if let Some(p) = self
                .ttft
                .published(end.worker, end.role, end.at)
                .and_then(|f| f.predict(x))
            {
                self.ttft_error.add(p, ttft_ms);
            }
            self.ttft.add(
                end.worker,
                end.role,
                end.prefill_tokens / KTOK,
                ttft_ms,
                end.at,
            );
        }
        if end.answered() && t.output_tokens >= 2 && t.total_us > t.first_byte_us {
            let itl =
                f64::from(t.total_us - t.first_byte_us) / 1000.0 / f64::from(t.output_tokens - 1);
            self.itl.add(
                end.worker,
                end.role,
                end.decode_kv_tokens / KTOK,
                itl,
                end.at,
            );
        }
    }

    /// `worker`'s fits as the snapshot publishes them (of `role`, its
    /// role now): each its own once trusted, else its role's; `None`
    /// before either took a sample.
    pub fn published(&self, worker: u64, role: Role, now: Instant) -> Option<WorkerFits> {
        let ttft = self.ttft.published(worker, role, now);
        let itl = self.itl.published(worker, role, now);
        (ttft.is_some() || itl.is_some()).then(|| WorkerFits {
            ttft: ttft.unwrap_or_default(),
            itl: itl.unwrap_or_default(),
        })
    }

    /// The mean absolute error of the TTFT predictions the published fits
    /// made for the requests they then learned from, as a share of the
    /// observed TTFT; `None` before any such prediction.
    pub fn ttft_error(&self) -> Option<f64> {
        (self.ttft_error.samples > 0).then_some(self.ttft_error.mean)
    }

    /// A worker left the fleet: its fits go with it.
    pub fn forget(&mut self, worker: u64) {
        self.ttft.forget(worker);
        self.itl.forget(worker);
    }
}

#[cfg(test)]
mod error_tests {
    use super::Error;

    #[test]
    fn the_error_is_a_share_of_what_was_observed_and_recent_samples_weigh_most() {
        let mut e = Error::default();
        e.add(100.0, 100.0);
        e.add(150.0, 100.0);
        assert!(
            (e.mean - 0.25).abs() < 1e-12,
            "an average at first: {}",
            e.mean
        );
        // Nothing observed, or nothing predicted: no sample.
        e.add(10.0, 0.0);
        e.add(f64::NAN, 100.0);
        assert_eq!(e.samples, 2);
        for _ in 0..5000 {
            e.add(100.0, 100.0);
        }
        assert!(e.mean < 0.001, "old errors fade: {}", e.mean);
    }
}
