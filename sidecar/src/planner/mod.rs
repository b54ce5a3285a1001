//! The planner: how many replicas each model needs, from what the gateway
//! sees (Dynamo's planner design, in kvgate's terms).
//!
//! Two loops per model, as in the seed:
//!
//! * **load** (fast, every `load_interval_ms`): per worker, online
//!   regressions ([`regress`], kept per worker and per role in [`fits`])
//!   turn the load on it now into an estimated TTFT and ITL. Scale up by
//!   one when *every* worker's estimate is over its SLA, down by one when
//!   every worker's is under SLA × sensitivity.
//! * **throughput** (slow, every `throughput_interval_ms`): predictors
//!   ([`predict`]) forecast the next interval's requests, ISL and OSL;
//!   capacity per replica ([`capacity`]) turns them into a lower bound.
//!   The load loop may go above it, never below.
//!
//! At most one step per interval, and none while the last decision is
//! pending (the orchestrator has not reported it done, and its timeout has
//! not passed): the seed's pending-desired guard. Everything is clamped to
//! `[min_replicas, max_replicas]`. This module is pure: the sidecar feeds
//! it observations and clocks, and carries out what it decides.

pub mod capacity;
pub mod fits;
pub mod predict;
pub mod regress;

use crate::config::PlannerConfig;
use fits::Fits;
use kvgate_core::Role;
use kvgate_core::booking::Timing;
use kvgate_core::plan::Leg;
use predict::Predictor;
use regress::Line;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Why the planner wants what it wants (an enum metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Not enough observations for an estimate yet.
    WarmingUp,
    /// Every worker's estimate is over the SLA.
    ScaleUp,
    /// Every worker's estimate is under SLA × sensitivity.
    ScaleDown,
    /// Within the band, or workers disagree.
    Hold,
    /// The last decision is not done yet.
    Pending,
    /// The throughput loop's lower bound holds replicas up.
    Floor,
    /// min or max replicas.
    Bound,
}

impl Reason {
    pub const ALL: [Reason; 7] = [
        Reason::WarmingUp,
        Reason::ScaleUp,
        Reason::ScaleDown,
        Reason::Hold,
        Reason::Pending,
        Reason::Floor,
        Reason::Bound,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::WarmingUp => "warming_up",
            Reason::ScaleUp => "scale_up",
            Reason::ScaleDown => "scale_down",
            Reason::Hold => "hold",
            Reason::Pending => "pending",
            Reason::Floor => "floor",
            Reason::Bound => "bound",
        }
    }
}

/// A worker's load now, as the load loop weighs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerLoad {
    pub worker_id: u64,
    /// Whose pooled fits stand in for a worker without its own.
    pub role: Role,
    /// Prompt tokens routed there and not yet answered.
    pub prefill_tokens: f64,
    /// KV tokens of the requests running there.
    pub decode_kv_tokens: f64,
}

/// A worker's estimated latency at its load now.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub worker_id: u64,
    pub ttft_ms: Option<f64>,
    pub itl_ms: Option<f64>,
}

/// Regression inputs are in thousands of tokens: coefficients of similar
/// size keep the least squares well conditioned.
const KTOK: f64 = 1000.0;

/// A leg's end, as the planner learns from it: where it was served, the
/// load it met there, and how it went. A request served whole is one leg;
/// a disaggregated one a prefill leg and a decode leg, each booked on its
/// own worker and ending on its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LegEnd {
    pub worker: u64,
    /// The worker's role when the leg was booked.
    pub role: Role,
    /// Prompt tokens in flight on its rank when it was routed (its own
    /// included).
    pub prefill_tokens: f64,
    /// KV tokens booked on its rank then.
    pub decode_kv_tokens: f64,
    /// Its own prompt tokens booked as not cached there.
    pub uncached: u64,
    /// What the gateway measured; its `leg` says what was computed.
    pub timing: Timing,
}

/// Whether a leg's times are the engine's: a failed leg's are its
/// failure's. Status 0 is unknown (a filter of a release before leg
/// records, or a reset) and is taken as served, as every end was before
/// statuses.
pub fn served(t: &Timing) -> bool {
    t.status == 0 || (200..300).contains(&t.status)
}

impl LegEnd {
    /// It computed the prompt: its first byte is prefill's.
    fn prefilled(&self) -> bool {
        matches!(self.timing.leg, Leg::Whole | Leg::Prefill)
    }

    /// It produced the answer: its tokens after the first are decode's,
    /// and its end is the request's.
    fn answered(&self) -> bool {
        matches!(self.timing.leg, Leg::Whole | Leg::Decode)
    }
}

/// One interval's traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub requests: u64,
    pub isl_sum: u64,
    pub osl_sum: u64,
    pub cached_sum: u64,
    pub shed: u64,
}

impl Interval {
    /// Prompt tokens served from cache, of all prompt tokens.
    pub fn kv_hit_rate(&self) -> f64 {
        if self.isl_sum == 0 {
            0.0
        } else {
            self.cached_sum as f64 / self.isl_sum as f64
        }
    }
}

/// A decision waiting for the orchestrator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pending {
    pub id: u64,
    pub from: u32,
    pub to: u32,
    pub since: Instant,
}

/// What one tick concluded, for metrics, the status view and the plots.
#[derive(Debug, Clone, PartialEq)]
pub struct Tick {
    pub desired: u32,
    pub lower_bound: u32,
    pub reason: Reason,
    pub estimates: Vec<Estimate>,
    /// Whether `desired` changed: a decision to issue.
    pub changed: bool,
}

pub struct ModelPlanner {
    pub cfg: PlannerConfig,
    /// TTFT against prompt tokens in flight.
    ttft: Fits,
    /// ITL against KV tokens in flight.
    itl: Fits,
    interval: Interval,
    predictors: [Box<dyn Predictor + Send>; 3],
    /// The last prediction of (requests, ISL, OSL) per interval.
    pub predicted: Option<[f64; 3]>,
    /// The last closed interval's traffic (its KV hit rate, sheds).
    pub observed: Option<Interval>,
    pub floor: u32,
    pub desired: u32,
    pub pending: Option<Pending>,
    pub reason: Reason,
    /// Observed times from a decision to its worker being ready.
    startups: Vec<Duration>,
    pub last: Option<Tick>,
}

impl ModelPlanner {
    /// A planner for a model that has `ready` replicas now.
    pub fn new(cfg: PlannerConfig, ready: u32) -> ModelPlanner {
        let season = cfg.season_intervals;
        let kind = cfg.predictor;
        let desired = ready.clamp(cfg.min_replicas, cfg.max_replicas);
        ModelPlanner {
            predictors: [
                predict::build(kind, season),
                predict::build(kind, season),
                predict::build(kind, season),
            ],
            floor: cfg.min_replicas,
            cfg,
            ttft: Fits::default(),
            itl: Fits::default(),
            interval: Interval::default(),
            predicted: None,
            observed: None,
            desired,
            pending: None,
            reason: Reason::WarmingUp,
            startups: Vec::new(),
            last: None,
        }
    }

    /// A leg's end. What the leg computed decides what it teaches:
    ///
    /// * the prompt (a whole request, a prefill leg): a TTFT sample
    ///   against the prompt tokens in flight where it ran, and the
    ///   prompt's cached tokens there;
    /// * the answer (a whole request, a decode leg): an ITL sample against
    ///   the KV tokens in flight, and the request's shape, once per
    ///   request. A decode leg's first byte waits on the KV transfer, not
    ///   on prefill compute: it is no TTFT sample.
    ///
    /// A failed leg still counts as traffic, never as a latency.
    pub fn observe_end(&mut self, end: &LegEnd) {
        let t = &end.timing;
        let isl = u64::from(t.isl_tokens);
        if end.answered() {
            self.observe_request(isl, u64::from(t.output_tokens));
        }
        // A decode leg books no prompt where it runs (the prompt arrives
        // with the transfer): its uncached count says nothing of the cache.
        if end.prefilled() {
            self.observe_prompt(isl, isl.saturating_sub(end.uncached));
        }
        // No first byte, no latency: a zero would pull the fits down.
        if !served(t) || t.first_byte_us == 0 {
            return;
        }
        if end.prefilled() {
            let ttft_ms = f64::from(t.first_byte_us) / 1000.0;
            self.observe_ttft(end.worker, end.role, end.prefill_tokens, ttft_ms);
        }
        if end.answered() && t.output_tokens >= 2 && t.total_us > t.first_byte_us {
            let itl =
                f64::from(t.total_us - t.first_byte_us) / 1000.0 / f64::from(t.output_tokens - 1);
            self.observe_itl(end.worker, end.role, end.decode_kv_tokens, itl);
        }
    }

    /// A first token on `worker` (of `role`): `prefill_tokens` were in
    /// flight there (its own included) when it was routed.
    pub fn observe_ttft(&mut self, worker: u64, role: Role, prefill_tokens: f64, ttft_ms: f64) {
        self.ttft.add(worker, role, prefill_tokens / KTOK, ttft_ms);
    }

    /// An inter-token latency on `worker` (of `role`) with
    /// `decode_kv_tokens` there.
    pub fn observe_itl(&mut self, worker: u64, role: Role, decode_kv_tokens: f64, itl_ms: f64) {
        self.itl.add(worker, role, decode_kv_tokens / KTOK, itl_ms);
    }

    /// TTFT against prompt tokens in flight, per worker and per role.
    pub fn ttft(&self) -> &Fits {
        &self.ttft
    }

    /// ITL against KV tokens in flight, per worker and per role.
    pub fn itl(&self) -> &Fits {
        &self.itl
    }

    /// A routed request, for the interval's traffic shape.
    pub fn observe_request(&mut self, isl: u64, osl: u64) {
        let i = &mut self.interval;
        i.requests += 1;
        i.isl_sum += isl;
        i.osl_sum += osl;
    }

    /// A prompt computed where `cached` of its `isl` tokens were held.
    pub fn observe_prompt(&mut self, isl: u64, cached: u64) {
        self.interval.cached_sum += cached.min(isl);
    }

    pub fn observe_shed(&mut self) {
        self.interval.shed += 1;
    }

    /// A worker left the fleet: its fits go with it.
    pub fn forget(&mut self, worker: u64) {
        self.ttft.forget(worker);
        self.itl.forget(worker);
    }

    /// Warm start: past intervals' (requests, ISL, OSL).
    pub fn warm_start(&mut self, trace: &[(f64, f64, f64)]) {
        for (n, isl, osl) in trace {
            self.predictors[0].observe(*n);
            self.predictors[1].observe(*isl);
            self.predictors[2].observe(*osl);
        }
    }

    fn estimate(&self, w: &WorkerLoad, avg_isl: f64, avg_osl: f64) -> Estimate {
        // A new request waits behind what is queued, plus its own prompt;
        // it decodes among what runs, plus its own context.
        let ttft = self
            .ttft
            .predict(w.worker_id, w.role, (w.prefill_tokens + avg_isl) / KTOK);
        let itl = self.itl.predict(
            w.worker_id,
            w.role,
            (w.decode_kv_tokens + avg_isl + avg_osl / 2.0) / KTOK,
        );
        Estimate {
            worker_id: w.worker_id,
            ttft_ms: ttft,
            itl_ms: itl,
        }
    }

    fn mean_shape(&self) -> (f64, f64) {
        match self.predicted {
            Some([_, isl, osl]) => (isl, osl),
            None => {
                let i = &self.interval;
                let n = i.requests.max(1) as f64;
                (i.isl_sum as f64 / n, i.osl_sum as f64 / n)
            }
        }
    }

    /// The pending decision is done, or has timed out.
    pub fn settle_pending(&mut self, ready: u32, now: Instant) {
        if let Some(p) = self.pending {
            let timeout = self.cfg.pending_timeout;
            let reached = if p.to >= p.from {
                ready >= p.to
            } else {
                ready <= p.to
            };
            if reached {
                if p.to > p.from {
                    self.startups.push(now.saturating_duration_since(p.since));
                    if self.startups.len() > 16 {
                        self.startups.remove(0);
                    }
                }
                self.pending = None;
            } else if now.saturating_duration_since(p.since) >= timeout {
                tracing::warn!(
                    decision = p.id,
                    "planner decision not done within its timeout: going on"
                );
                self.pending = None;
            }
        }
    }

    /// The orchestrator reports decision `id` carried out.
    pub fn complete(&mut self, id: u64, now: Instant) -> bool {
        match self.pending {
            Some(p) if p.id == id => {
                if p.to > p.from {
                    self.startups.push(now.saturating_duration_since(p.since));
                }
                self.pending = None;
                true
            }
            _ => false,
        }
    }

    /// How long a scale-up takes: the median observed, else the
    /// configured start-up time.
    pub fn startup(&self) -> Duration {
        if self.startups.is_empty() {
            return self.cfg.startup;
        }
        let mut s = self.startups.clone();
        s.sort();
        s[s.len() / 2]
    }

    /// When a pending scale-up is expected to have its worker ready.
    pub fn scale_up_eta(&self, now: Instant) -> Option<Duration> {
        let p = self.pending?;
        (p.to > p.from).then(|| (p.since + self.startup()).saturating_duration_since(now))
    }

    /// The load loop: one step at most. `ready` is the replicas serving
    /// now; `id` names the decision if this tick makes one.
    pub fn tick_load(&mut self, loads: &[WorkerLoad], ready: u32, now: Instant, id: u64) -> Tick {
        self.settle_pending(ready, now);
        let (avg_isl, avg_osl) = self.mean_shape();
        let estimates: Vec<Estimate> = loads
            .iter()
            .map(|w| self.estimate(w, avg_isl, avg_osl))
            .collect();
        let c = &self.cfg;
        let known: Vec<&Estimate> = estimates
            .iter()
            .filter(|e| e.ttft_ms.is_some() || e.itl_ms.is_some())
            .collect();
        let over = |e: &&Estimate| {
            e.ttft_ms.is_some_and(|t| t > c.ttft_ms) || e.itl_ms.is_some_and(|t| t > c.itl_ms)
        };
        let under = |e: &&Estimate| {
            e.ttft_ms.is_none_or(|t| t < c.ttft_ms * c.sensitivity)
                && e.itl_ms.is_none_or(|t| t < c.itl_ms * c.sensitivity)
        };
        let base = ready.max(1);
        let (mut want, mut reason) = if known.is_empty() || known.len() < loads.len() {
            (self.desired, Reason::WarmingUp)
        } else if known.iter().all(over) {
            (base + 1, Reason::ScaleUp)
        } else if known.iter().all(under) {
            (base.saturating_sub(1), Reason::ScaleDown)
        } else {
            (self.desired, Reason::Hold)
        };
        if want < self.floor {
            want = self.floor;
            if reason == Reason::ScaleDown || self.desired < self.floor {
                reason = Reason::Floor;
            }
        }
        let clamped = want.clamp(c.min_replicas, c.max_replicas);
        if clamped != want {
            want = clamped;
            reason = Reason::Bound;
        }
        if self.pending.is_some() {
            want = self.desired;
            reason = Reason::Pending;
        }
        let changed = want != self.desired;
        if changed {
            self.pending = Some(Pending {
                id,
                from: ready,
                to: want,
                since: now,
            });
            self.desired = want;
        }
        self.reason = reason;
        let tick = Tick {
            desired: self.desired,
            lower_bound: self.floor,
            reason,
            estimates,
            changed,
        };
        self.last = Some(tick.clone());
        tick
    }

    /// The throughput loop: closes the interval, predicts the next one and
    /// sets the lower bound. Returns the interval that closed.
    pub fn tick_throughput(&mut self, ready: u32) -> Interval {
        let closed = std::mem::take(&mut self.interval);
        self.observed = Some(closed);
        let n = closed.requests as f64;
        let secs = self.cfg.throughput_interval.as_secs_f64();
        self.predictors[0].observe(n);
        if closed.requests > 0 {
            self.predictors[1].observe(closed.isl_sum as f64 / n);
            self.predictors[2].observe(closed.osl_sum as f64 / n);
        }
        let [a, b, c] = &self.predictors;
        if let (Some(n), Some(isl), Some(osl)) = (a.predict(), b.predict(), c.predict()) {
            self.predicted = Some([n, isl, osl]);
            let rps = n / secs;
            let per_replica = capacity::per_replica(&self.cfg.profile, isl, osl)
                .or_else(|| self.learned_capacity(isl, osl));
            if let Some(cap) = per_replica.filter(|c| *c > 0.0) {
                self.floor =
                    ((rps / cap).ceil() as u32).clamp(self.cfg.min_replicas, self.cfg.max_replicas);
            }
        }
        let _ = ready;
        closed
    }

    /// Requests per second one replica takes within the SLA, from the
    /// fits: the prefill fit gives how many prompt tokens may be in flight
    /// when TTFT reaches its SLA, the decode fit how many KV tokens when
    /// ITL reaches its SLA. By Little's law a replica holding L requests
    /// that each last T seconds serves L / T per second: prefill holds a
    /// request for its TTFT, decode for OSL × ITL.
    fn learned_capacity(&self, isl: f64, osl: f64) -> Option<f64> {
        let c = &self.cfg;
        let median = |fits: &BTreeMap<u64, Line>, sla: f64| -> Option<f64> {
            let mut v: Vec<f64> = fits
                .values()
                .filter_map(|l| l.solve_for(sla))
                .map(|k| k * KTOK)
                .collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied()
        };
        let isl = isl.max(1.0);
        let prefill = median(self.ttft.workers(), c.ttft_ms)
            .map(|tokens| (tokens / isl) / (c.ttft_ms / 1000.0));
        let per_request_kv = isl + osl / 2.0;
        let decode = median(self.itl.workers(), c.itl_ms)
            .map(|tokens| (tokens / per_request_kv.max(1.0)) / (osl.max(1.0) * c.itl_ms / 1000.0));
        match (prefill, decode) {
            (Some(p), Some(d)) => Some(p.min(d)),
            (p, d) => p.or(d),
        }
    }
}

#[cfg(test)]
mod tests;
