//! The planner: how many replicas each model needs, from what the gateway
//! sees (Dynamo's planner design, in kvgate's terms).
//!
//! A model is planned as one pool ([`pool`]) of all its workers, or, with
//! a disaggregated model, as a prefill pool and a decode pool sized apart.
//! Two loops per model, as in the seed:
//!
//! * **load** (fast, every `load_interval_ms`): per worker, online
//!   regressions ([`regress`], kept per worker and per role in [`fits`])
//!   turn the load on it now into an estimated TTFT and ITL. Per pool:
//!   scale up by one when *every* worker's estimate is over its SLA, down
//!   by one when every worker's is under SLA × sensitivity. A prefill
//!   pool is judged by TTFT, a decode pool by ITL, an aggregated pool by
//!   both.
//! * **throughput** (slow, every `throughput_interval_ms`): predictors
//!   ([`predict`]) forecast the next interval's requests, ISL and OSL;
//!   capacity per replica of each pool ([`capacity`] from a profile, else
//!   the fits) turns them into each pool's lower bound. The load loop may
//!   go above it, never below.
//!
//! At most one step per pool and interval, and none while the pool's last
//! decision is pending (the orchestrator has not reported it done, and its
//! timeout has not passed): the seed's pending-desired guard, which only
//! the throughput floor may pass. Everything is clamped to each pool's
//! bounds and to the power budget. This module is pure: the sidecar feeds
//! it observations and clocks, and carries out what it decides.

pub mod capacity;
pub mod fits;
pub mod pool;
pub mod predict;
pub mod regress;

use crate::config::PlannerConfig;
use fits::{Fits, Latency};
use kvgate_core::Role;
use kvgate_core::booking::Timing;
use kvgate_core::plan::Leg;
use pool::{Pending, Pool, PoolTick, Verdict};
use predict::Predictor;
use regress::Line;
use serde::{Deserialize, Serialize};
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
    /// The power budget holds replicas down.
    Power,
}

impl Reason {
    pub const ALL: [Reason; 8] = [
        Reason::WarmingUp,
        Reason::ScaleUp,
        Reason::ScaleDown,
        Reason::Hold,
        Reason::Pending,
        Reason::Floor,
        Reason::Bound,
        Reason::Power,
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
            Reason::Power => "power",
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
    /// The pool it counts in.
    pub pool: Role,
    pub ttft_ms: Option<f64>,
    pub itl_ms: Option<f64>,
}

/// Regression inputs are in thousands of tokens: coefficients of similar
/// size keep the least squares well conditioned. The fits are published
/// to routers, which predict in the same unit.
const KTOK: f64 = kvgate_core::fit::KTOK;

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
    /// When the sidecar heard of its end: its fits' latest sample.
    pub at: Instant,
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

/// A power budget as one tick applies it: what the model may draw, and
/// what one replica of each pool draws (`None`: not measured, nor
/// configured).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PowerInput {
    pub budget_w: Option<f64>,
    /// By [`Role::code`].
    pub replica_w: [Option<f64>; 3],
}

/// The budget's part in a tick, for the decision and the status view.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PowerView {
    pub budget_w: f64,
    /// What the planned replicas would draw, at each pool's measured draw
    /// per replica; `None` while a pool's draw is unknown.
    pub planned_w: Option<f64>,
    /// The budget held a pool below what its load asked for.
    pub binding: bool,
    /// With the budget binding: the share of the predicted request rate
    /// the planned replicas serve within the SLA, by their capacity.
    pub expected_sla_attainment: Option<f64>,
}

/// One pool's capacity per replica at the predicted shape: from the
/// profile, from the live fits, and how far the fits drift from it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    pub role: Role,
    pub profile_rps: Option<f64>,
    pub learned_rps: Option<f64>,
    /// learned ÷ profile − 1.
    pub drift: Option<f64>,
}

impl Capacity {
    /// What the floor uses: the profile when there is one.
    pub fn rps(&self) -> Option<f64> {
        self.profile_rps.or(self.learned_rps).filter(|c| *c > 0.0)
    }
}

/// What one tick concluded, for metrics, the status view and the plots.
#[derive(Debug, Clone, PartialEq)]
pub struct Tick {
    /// One per pool: `both` for an aggregated model, `prefill` and
    /// `decode` for a disaggregated one.
    pub pools: Vec<PoolTick>,
    pub estimates: Vec<Estimate>,
    /// A worker moves from the first pool to the second instead of the
    /// one starting a worker and the other draining one.
    pub switch: Option<(Role, Role)>,
    pub power: Option<PowerView>,
}

impl Tick {
    /// Replicas the model should have, all pools together.
    pub fn desired(&self) -> u32 {
        self.pools.iter().map(|p| p.desired).sum()
    }

    pub fn lower_bound(&self) -> u32 {
        self.pools.iter().map(|p| p.lower_bound).sum()
    }

    /// Whether a decision is to be issued.
    pub fn changed(&self) -> bool {
        self.pools.iter().any(|p| p.changed)
    }

    /// The model's reason: a changed pool's, else the last pool's (the
    /// decode pool's, which holds the model's streams).
    pub fn reason(&self) -> Reason {
        self.pools
            .iter()
            .find(|p| p.changed)
            .or(self.pools.last())
            .map_or(Reason::WarmingUp, |p| p.reason)
    }

    pub fn pool(&self, role: Role) -> Option<&PoolTick> {
        self.pools.iter().find(|p| p.role == role)
    }
}

pub struct ModelPlanner {
    pub cfg: PlannerConfig,
    /// Planned as a prefill pool and a decode pool.
    pub disaggregated: bool,
    /// TTFT against prompt tokens in flight, ITL against KV tokens.
    latency: Latency,
    interval: Interval,
    predictors: [Box<dyn Predictor + Send>; 3],
    /// The last prediction of (requests, ISL, OSL) per interval.
    pub predicted: Option<[f64; 3]>,
    /// The last closed interval's traffic (its KV hit rate, sheds).
    pub observed: Option<Interval>,
    pub pools: Vec<Pool>,
    /// Each pool's capacity at the last prediction.
    pub capacity: Vec<Capacity>,
    pub last: Option<Tick>,
}

impl ModelPlanner {
    /// A planner for a model with `ready` replicas serving now in each
    /// pool (by [`Role::code`] of the pool).
    pub fn new(cfg: PlannerConfig, disaggregated: bool, ready: [u32; 3]) -> ModelPlanner {
        let season = cfg.season_intervals;
        let kind = cfg.predictor;
        let pools = pool::roles(disaggregated)
            .iter()
            .map(|r| Pool::new(*r, cfg.bounds(*r), ready[usize::from(r.code())]))
            .collect();
        ModelPlanner {
            predictors: [
                predict::build(kind, season),
                predict::build(kind, season),
                predict::build(kind, season),
            ],
            cfg,
            disaggregated,
            latency: Latency::default(),
            interval: Interval::default(),
            predicted: None,
            observed: None,
            pools,
            capacity: Vec::new(),
            last: None,
        }
    }

    /// The pool a worker of `role` counts in.
    pub fn pool_of(&self, role: Role) -> Role {
        pool::of(self.disaggregated, role)
    }

    pub fn pool(&self, role: Role) -> Option<&Pool> {
        self.pools.iter().find(|p| p.role == role)
    }

    /// Replicas wanted, all pools together.
    pub fn desired(&self) -> u32 {
        self.pools.iter().map(|p| p.desired).sum()
    }

    /// The throughput loop's floor, all pools together.
    pub fn floor(&self) -> u32 {
        self.pools.iter().map(|p| p.floor).sum()
    }

    /// The model's reason at the last tick.
    pub fn reason(&self) -> Reason {
        self.last.as_ref().map_or(Reason::WarmingUp, Tick::reason)
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
        self.latency.observe(end);
    }

    /// A first token on `worker` (of `role`): `prefill_tokens` were in
    /// flight there (its own included) when it was routed.
    pub fn observe_ttft(&mut self, worker: u64, role: Role, prefill_tokens: f64, ttft_ms: f64) {
        let x = prefill_tokens / KTOK;
        self.latency
            .ttft
            .add(worker, role, x, ttft_ms, Instant::now());
    }

    /// An inter-token latency on `worker` (of `role`) with
    /// `decode_kv_tokens` there.
    pub fn observe_itl(&mut self, worker: u64, role: Role, decode_kv_tokens: f64, itl_ms: f64) {
        let x = decode_kv_tokens / KTOK;
        self.latency
            .itl
            .add(worker, role, x, itl_ms, Instant::now());
    }

    /// TTFT against prompt tokens in flight, per worker and per role.
    pub fn ttft(&self) -> &Fits {
        &self.latency.ttft
    }

    /// ITL against KV tokens in flight, per worker and per role.
    pub fn itl(&self) -> &Fits {
        &self.latency.itl
    }

    /// Both fits, as the snapshot publishes them.
    pub fn latency(&self) -> &Latency {
        &self.latency
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
        self.latency.forget(worker);
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
        let ttft =
            self.latency
                .ttft
                .predict(w.worker_id, w.role, (w.prefill_tokens + avg_isl) / KTOK);
        let itl = self.latency.itl.predict(
            w.worker_id,
            w.role,
            (w.decode_kv_tokens + avg_isl + avg_osl / 2.0) / KTOK,
        );
        Estimate {
            worker_id: w.worker_id,
            pool: self.pool_of(w.role),
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

    /// Each pool's pending decision is done, or has timed out. `ready` by
    /// [`Role::code`] of the pool.
    pub fn settle_pending(&mut self, ready: [u32; 3], now: Instant) {
        let timeout = self.cfg.pending_timeout;
        for p in &mut self.pools {
            p.settle(ready[usize::from(p.role.code())], now, timeout);
        }
    }

    /// The orchestrator reports decision `id` carried out: every pool it
    /// moved may step again.
    pub fn complete(&mut self, id: u64, now: Instant) -> bool {
        let mut any = false;
        for p in &mut self.pools {
            any |= p.complete(id, now);
        }
        any
    }

    /// Whether a decision of the model's is waiting.
    pub fn pending(&self) -> Option<Pending> {
        self.pools.iter().find_map(|p| p.pending)
    }

    /// How long a scale-up takes: the median observed over the pools,
    /// else the configured start-up time.
    pub fn startup(&self) -> Duration {
        self.pools
            .iter()
            .map(|p| p.startup(self.cfg.startup))
            .max()
            .unwrap_or(self.cfg.startup)
    }

    /// When the pool of `role` expects its pending scale-up to serve.
    pub fn pool_eta(&self, role: Role, now: Instant) -> Option<Duration> {
        self.pool(role)?.scale_up_eta(now, self.cfg.startup)
    }

    /// When the soonest pending scale-up is expected to have its worker
    /// ready.
    pub fn scale_up_eta(&self, now: Instant) -> Option<Duration> {
        self.pools
            .iter()
            .filter_map(|p| p.scale_up_eta(now, self.cfg.startup))
            .min()
    }

    /// Every worker of a pool against its SLA. An aggregated pool is the
    /// seed's 2D rule: over when every TTFT or every ITL is over, under
    /// when every TTFT and every ITL is under; a prefill pool is judged by
    /// TTFT alone, a decode pool by ITL alone.
    fn verdict(&self, role: Role, estimates: &[&Estimate], sensitivity: f64) -> Verdict {
        let c = &self.cfg;
        let ttfts: Vec<Option<f64>> = estimates.iter().map(|e| e.ttft_ms).collect();
        let itls: Vec<Option<f64>> = estimates.iter().map(|e| e.itl_ms).collect();
        let all = |v: &[Option<f64>], f: &dyn Fn(f64) -> bool| {
            !v.is_empty() && v.iter().all(|x| x.is_some_and(f))
        };
        let (over, under, known) = match role {
            Role::Prefill => (
                all(&ttfts, &|t| t > c.ttft_ms),
                all(&ttfts, &|t| t < c.ttft_ms * sensitivity),
                ttfts.iter().all(Option::is_some),
            ),
            Role::Decode => (
                all(&itls, &|t| t > c.itl_ms),
                all(&itls, &|t| t < c.itl_ms * sensitivity),
                itls.iter().all(Option::is_some),
            ),
            Role::Both => {
                let none_or = |v: &[Option<f64>], sla: f64| {
                    v.iter().all(|x| x.is_none_or(|t| t < sla * sensitivity))
                };
                (
                    all(&ttfts, &|t| t > c.ttft_ms) || all(&itls, &|t| t > c.itl_ms),
                    none_or(&ttfts, c.ttft_ms) && none_or(&itls, c.itl_ms),
                    estimates
                        .iter()
                        .all(|e| e.ttft_ms.is_some() || e.itl_ms.is_some()),
                )
            }
        };
        if estimates.is_empty() || !known {
            Verdict::Unknown
        } else if over {
            Verdict::Over
        } else if under {
            Verdict::Under
        } else {
            Verdict::Between
        }
    }

    /// The load loop: one step per pool at most. `ready` is the replicas
    /// serving now per pool (by [`Role::code`]); `id` names the decision
    /// if this tick makes one; `power` is the budget the model may plan
    /// to.
    pub fn tick_load(
        &mut self,
        loads: &[WorkerLoad],
        ready: [u32; 3],
        now: Instant,
        id: u64,
        power: PowerInput,
    ) -> Tick {
        self.settle_pending(ready, now);
        for p in &mut self.pools {
            p.first_sight(ready[usize::from(p.role.code())], now);
        }
        let (avg_isl, avg_osl) = self.mean_shape();
        let estimates: Vec<Estimate> = loads
            .iter()
            .map(|w| self.estimate(w, avg_isl, avg_osl))
            .collect();
        let mut wants: Vec<(u32, Reason)> = self
            .pools
            .iter()
            .map(|p| {
                let mine: Vec<&Estimate> = estimates.iter().filter(|e| e.pool == p.role).collect();
                let mut v = self.verdict(p.role, &mine, p.bounds.sensitivity);
                if v == Verdict::Under && !self.fewer_hold(p.role, loads, avg_isl, avg_osl) {
                    v = Verdict::Between;
                }
                p.want(v, ready[usize::from(p.role.code())])
            })
            .collect();
        self.bound_total(&mut wants);
        let budget = self.apply_budget(&mut wants, power);
        let grace = self.cfg.startup;
        let mut switch = None;
        if self.cfg.role_switch
            && let [(a, ra), (b, rb)] = wants[..]
            && let [pa, pb] = &self.pools[..]
        {
            // One pool grows by one as the other shrinks by one: a
            // worker changes role instead of one starting and one going.
            if ra == Reason::ScaleUp && rb == Reason::ScaleDown && a > pa.desired && b < pb.desired
            {
                switch = Some((pb.role, pa.role));
            } else if rb == Reason::ScaleUp
                && ra == Reason::ScaleDown
                && b > pb.desired
                && a < pa.desired
            {
                switch = Some((pa.role, pb.role));
            }
        }
        let pools = self
            .pools
            .iter_mut()
            .zip(wants)
            .map(|(p, want)| {
                let r = ready[usize::from(p.role.code())];
                p.set(want, r, now, id, grace)
            })
            .collect();
        let tick = Tick {
            pools,
            estimates,
            switch,
            power: budget,
        };
        self.last = Some(tick.clone());
        tick
    }

    /// A disaggregated model's pools share its `max_replicas`: the
    /// workers it may have, all roles together. Growth past it is trimmed,
    /// pool by pool, as the power budget trims it.
    fn bound_total(&self, wants: &mut [(u32, Reason)]) {
        if self.disaggregated {
            let max = f64::from(self.cfg.max_replicas);
            self.trim_growth(wants, &|_| Some(1.0), max, Reason::Bound);
        }
    }

    /// What `wants` replicas per pool cost together at `cost` per replica
    /// of each pool's role; `None` while a pool's cost is unknown.
    fn planned(&self, wants: &[(u32, Reason)], cost: &dyn Fn(Role) -> Option<f64>) -> Option<f64> {
        self.pools
            .iter()
            .zip(wants)
            .map(|(p, (n, _))| Some(f64::from(*n) * cost(p.role)?))
            .sum()
    }

    /// Trims growth, pool by pool, to what `limit` leaves each after the
    /// other pools' plans; a pool never goes under what it already has.
    /// Whether anything was trimmed.
    fn trim_growth(
        &self,
        wants: &mut [(u32, Reason)],
        cost: &dyn Fn(Role) -> Option<f64>,
        limit: f64,
        reason: Reason,
    ) -> bool {
        let mut trimmed = false;
        for i in 0..wants.len() {
            let held = self.pools[i].desired;
            let Some(over) = self.planned(wants, cost).map(|x| x - limit) else {
                break;
            };
            if wants[i].0 > held && over > 0.0 {
                let each = cost(self.pools[i].role).unwrap_or(f64::MAX);
                let cut = (over / each).ceil() as u32;
                wants[i] = (wants[i].0.saturating_sub(cut).max(held), reason);
                trimmed = true;
            }
        }
        trimmed
    }

    /// Whether the pool of `role` would still meet its SLA with one
    /// worker fewer: each worker's estimate at its load spread over the
    /// others (× n / (n − 1)). The seed's scale-down looks at the load
    /// now only; a pool whose unloaded latency is near SLA × sensitivity
    /// then steps down, finds itself over, and steps back up.
    fn fewer_hold(&self, role: Role, loads: &[WorkerLoad], avg_isl: f64, avg_osl: f64) -> bool {
        let mine: Vec<&WorkerLoad> = loads
            .iter()
            .filter(|w| self.pool_of(w.role) == role)
            .collect();
        let n = mine.len() as f64;
        if n < 2.0 {
            return true;
        }
        let k = n / (n - 1.0);
        let c = &self.cfg;
        mine.iter().all(|w| {
            let e = self.estimate(
                &WorkerLoad {
                    prefill_tokens: w.prefill_tokens * k,
                    decode_kv_tokens: w.decode_kv_tokens * k,
                    ..**w
                },
                avg_isl,
                avg_osl,
            );
            let ttft_ok = role == Role::Decode || e.ttft_ms.is_none_or(|t| t <= c.ttft_ms);
            let itl_ok = role == Role::Prefill || e.itl_ms.is_none_or(|t| t <= c.itl_ms);
            ttft_ok && itl_ok
        })
    }

    /// Holds the pools' wants within the power budget: growth first is
    /// held back; if the planned replicas still draw more than the
    /// budget (the draw per replica rose), a pool steps down by one.
    fn apply_budget(&self, wants: &mut [(u32, Reason)], power: PowerInput) -> Option<PowerView> {
        let budget_w = power.budget_w?;
        let watts = |r: Role| power.replica_w[usize::from(r.code())];
        let draw = |wants: &[(u32, Reason)]| self.planned(wants, &watts);
        // Growth is trimmed first, to what the budget leaves it.
        let mut binding = self.trim_growth(wants, &watts, budget_w, Reason::Power);
        // Still over (the draw per replica rose): the pool whose replica
        // draws most steps down by one, within its bounds.
        if draw(wants).is_some_and(|x| x > budget_w) {
            let watts = |i: usize| watts(self.pools[i].role);
            let heaviest = (0..wants.len())
                .filter(|i| {
                    let p = &self.pools[*i];
                    wants[*i].0 > p.bounds.min_replicas && p.pending.is_none()
                })
                .max_by(|a, b| {
                    watts(*a)
                        .partial_cmp(&watts(*b))
                        .unwrap_or(std::cmp::Ordering::Equal)
                });
            if let Some(i) = heaviest {
                wants[i] = (wants[i].0 - 1, Reason::Power);
                binding = true;
            }
        }
        let expected = binding.then(|| self.expected_attainment(wants)).flatten();
        Some(PowerView {
            budget_w,
            planned_w: draw(wants),
            binding,
            expected_sla_attainment: expected,
        })
    }

    /// The share of the predicted request rate that `wants` replicas per
    /// pool serve within the SLA, by each pool's capacity: the tightest
    /// pool's.
    fn expected_attainment(&self, wants: &[(u32, Reason)]) -> Option<f64> {
        let rps = self.predicted?[0] / self.cfg.throughput_interval.as_secs_f64();
        if rps <= 0.0 {
            return Some(1.0);
        }
        self.pools
            .iter()
            .zip(wants)
            .map(|(p, (n, _))| {
                let cap = self.capacity.iter().find(|c| c.role == p.role)?.rps()?;
                Some((f64::from(*n) * cap / rps).min(1.0))
            })
            .try_fold(1.0f64, |acc, x| x.map(|x| acc.min(x)))
    }

    /// The throughput loop: closes the interval, predicts the next one and
    /// sets each pool's lower bound. Returns the interval that closed.
    pub fn tick_throughput(&mut self) -> Interval {
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
            let capacity: Vec<Capacity> = self
                .pools
                .iter()
                .map(|p| {
                    let profile = capacity::per_replica(&self.cfg.profile, p.role, isl, osl);
                    let learned = self.learned_capacity(p.role, isl, osl);
                    Capacity {
                        role: p.role,
                        profile_rps: profile,
                        learned_rps: learned,
                        drift: profile
                            .zip(learned)
                            .filter(|(p, _)| *p > 0.0)
                            .map(|(p, l)| l / p - 1.0),
                    }
                })
                .collect();
            for (p, cap) in self.pools.iter_mut().zip(&capacity) {
                if let Some(c) = cap.rps() {
                    p.floor = ((rps / c).ceil() as u32)
                        .clamp(p.bounds.min_replicas, p.bounds.max_replicas);
                }
            }
            self.capacity = capacity;
        }
        closed
    }

    /// The pool's latency with nothing in flight but one request of the
    /// mean shape, from its role's pooled fits: (TTFT, ITL). A scale-down
    /// needs every estimate under SLA × sensitivity, so a pool whose
    /// unloaded latency is above that line never scales down.
    pub fn unloaded(&self, pool: Role) -> (Option<f64>, Option<f64>) {
        let (isl, osl) = self.mean_shape();
        let roles: &[Role] = match pool {
            Role::Both => &[Role::Both],
            Role::Prefill => &[Role::Prefill],
            Role::Decode => &[Role::Decode, Role::Both],
        };
        let first = |f: &Fits, x: f64| roles.iter().find_map(|r| f.role(*r).predict(x));
        (
            first(&self.latency.ttft, isl / KTOK).filter(|_| pool != Role::Decode),
            first(&self.latency.itl, (isl + osl / 2.0) / KTOK).filter(|_| pool != Role::Prefill),
        )
    }

    /// Requests per second one worker of the pool of `role` takes within
    /// the SLA, from the fits pooled by role: the prefill fit gives how
    /// many uncached prompt tokens may be in flight when TTFT reaches its
    /// SLA, the decode fit how many KV tokens when ITL reaches its SLA. By
    /// Little's law a worker holding L requests that each last T seconds
    /// serves L / T per second: prefill holds a request for its TTFT,
    /// decode for OSL × ITL. A prefill pool is bounded by the first, a
    /// decode pool by the second, an aggregated one by both.
    fn learned_capacity(&self, role: Role, isl: f64, osl: f64) -> Option<f64> {
        let c = &self.cfg;
        // A decode pool's `both` workers decode too: their samples stand
        // in until the decode workers' own are trusted.
        let line = |fits: &Fits, own: Role| -> Option<Line> {
            let l = fits.role(own);
            if l.ready() || own == Role::Both {
                Some(l.clone())
            } else {
                Some(fits.role(Role::Both).clone())
            }
        };
        let hit = self.observed.map_or(0.0, |i| i.kv_hit_rate());
        let uncached = (isl * (1.0 - hit)).max(1.0);
        let prefill = || {
            let l = line(
                &self.latency.ttft,
                if role == Role::Both {
                    Role::Both
                } else {
                    Role::Prefill
                },
            )?;
            l.solve_for(c.ttft_ms)
                .map(|k| (k * KTOK / uncached) / (c.ttft_ms / 1000.0))
        };
        let decode = || {
            let l = line(
                &self.latency.itl,
                if role == Role::Both {
                    Role::Both
                } else {
                    Role::Decode
                },
            )?;
            let per_request_kv = (isl + osl / 2.0).max(1.0);
            l.solve_for(c.itl_ms)
                .map(|k| (k * KTOK / per_request_kv) / (osl.max(1.0) * c.itl_ms / 1000.0))
        };
        match role {
            Role::Prefill => prefill(),
            Role::Decode => decode(),
            Role::Both => match (prefill(), decode()) {
                (Some(p), Some(d)) => Some(p.min(d)),
                (p, d) => p.or(d),
            },
        }
    }
}

#[cfg(test)]
mod tests;
