//! Worker selection: which (worker, data-parallel rank) serves a request.
//!
//! The cost is Dynamo's current overlap-credit form (see `docs/selection.md`):
//!
//! ```text
//! raw_prefill   = (isl_tokens + active_prefill_tokens) / block_size
//! credit        = overlap_credit * device + host_weight * host + disk_weight * disk
//! prefill       = max(0, raw_prefill - credit)
//! new_blocks    = max(1, ceil(isl_tokens / block_size) - device)
//! logit         = prefill_load_scale * prefill
//!               + active_decode_blocks + new_blocks
//!               + decode_active_request_weight * running
//! ```
//!
//! `new_blocks` is what the request adds to the rank's resident blocks: as
//! in Dynamo, a prefix already resident there is not counted again. It is
//! also what the filter books for the request, so the cost and the load it
//! later sees agree.
//!
//! The lowest logit wins. With no KV overlap known (every overlap zero) this
//! reduces to "least loaded", which is the foundation policy; overlap from KV
//! events plugs in through [`Overlap`] without changing callers.
//!
//! Busy ranks are never candidates. Ties at temperature 0 are broken by the
//! caller's `tie_break` value rather than by worker order, so an idle fleet
//! spreads a burst of identical requests instead of piling them onto the
//! first worker, while the result stays a pure function of the inputs.

use crate::busy::rank_busy;
use crate::state::{ModelState, Policy, RankLoad, Role, Slo, WorkerState};

/// What the selector needs to know about the request itself.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RequestShape {
    /// Input sequence length in tokens (estimated for text prompts).
    pub isl_tokens: u64,
    /// Spreads ties; any per-request value (a counter, a hash) works.
    pub tie_break: u64,
    /// A uniform sample in [0, 1) used only when temperature > 0, so core
    /// needs no random source of its own.
    pub sample: f64,
    /// The busy thresholds the request is judged by, as a multiple of the
    /// model's ([`super::Ask::thresholds_scale`]): above 1 a busy rank
    /// within them may take it, under 1 a rank over them may not.
    pub thresholds_scale: Option<f64>,
    /// Which part of the request is placed: the workers whose role serves
    /// it are the candidates.
    pub leg: Leg,
    /// The request's latency targets: a rank whose worker's fits predict
    /// a miss is no candidate; one without a usable fit is ("unknown").
    pub slo: Option<Slo>,
}

/// What a placement is for: a whole request, or one leg of a
/// disaggregated one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Leg {
    /// Prompt and answer on one worker, of any role: a model served whole.
    #[default]
    Whole,
    /// The prompt: prefill and both workers.
    Prefill,
    /// The answer: decode and both workers.
    Decode,
}

impl Leg {
    /// Every leg, in code order.
    pub const ALL: [Leg; 3] = [Leg::Whole, Leg::Prefill, Leg::Decode];

    /// Its code in booking records.
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<Leg> {
        Leg::ALL.get(usize::from(code)).copied()
    }

    /// Its name, as metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Whole => "whole",
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
        }
    }

    /// Whether a worker of `role` may take this leg.
    pub fn takes(self, role: Role) -> bool {
        match self {
            Leg::Whole => true,
            Leg::Prefill => role.prefills(),
            Leg::Decode => role.decodes(),
        }
    }
}

/// Leading blocks of the request a rank already holds, per storage tier.
/// Tiers are cumulative as in Mooncake: `host` counts blocks present on the
/// device *or* host, and so on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overlap {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
}

/// An extra term of the cost, beside the load and cache terms of
/// [`Policy::logit`] (Dynamo's `WorkerScorer` idea): state the formula does
/// not know, such as a hot GPU or a worker the planner is draining, makes
/// a candidate dearer here. Costs are in the logit's unit, blocks.
pub trait Term {
    fn cost(&self, worker: &WorkerState, rank: &RankLoad) -> f64;
}

/// The outcome of selection for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision<'a> {
    Route(Choice<'a>),
    /// Workers exist and every one of them is busy: shed with 503.
    AllBusy,
    /// Every worker is busy or at its thermal cap, and at least one is
    /// capped: shed with 503, the fleet is too hot to take more.
    AllHot,
    /// Some rank would take the request, and every such rank is predicted
    /// to miss its latency targets.
    SloUnattainable,
    /// The model is known but no worker is up.
    NoWorkers,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice<'a> {
    pub worker: &'a WorkerState,
    pub rank: &'a RankLoad,
    pub logit: f64,
    pub overlap: Overlap,
    /// The request's time to first token there, as the worker's fit
    /// predicts it; `None` without a usable fit.
    pub ttft_ms: Option<f64>,
}

/// Blocks a request of `isl_tokens` adds to a rank whose device already
/// holds its first `device_blocks`: the cached prefix is shared, not
/// duplicated. At least one, so every request carries some weight.
pub fn new_blocks(isl_tokens: u64, block_size: u32, device_blocks: u32) -> u64 {
    isl_tokens
        .div_ceil(u64::from(block_size.max(1)))
        .saturating_sub(u64::from(device_blocks))
        .max(1)
}

impl Policy {
    /// The logit of placing `req` on `rank` given its overlap: what
    /// computing its prompt costs there, and what holding its answer does.
    pub fn logit(
        &self,
        req: &RequestShape,
        block_size: u32,
        rank: &RankLoad,
        overlap: Overlap,
    ) -> f64 {
        self.prefill_cost(req, block_size, rank, overlap)
            + self.decode_cost(req, block_size, rank, overlap)
    }

    /// The logit's prefill term: the rank's queue and the prompt's
    /// uncached part, its cached prefix credited.
    pub fn prefill_cost(
        &self,
        req: &RequestShape,
        block_size: u32,
        rank: &RankLoad,
        overlap: Overlap,
    ) -> f64 {
        let bs = f64::from(block_size.max(1));
        let raw_prefill = (req.isl_tokens as f64 + rank.active_prefill_tokens as f64) / bs;
        // Host and disk are cumulative tiers; credit each block once, at the
        // fastest tier that holds it.
        let device = f64::from(overlap.device);
        let host_only = f64::from(overlap.host.saturating_sub(overlap.device));
        let disk_only = f64::from(
            overlap
                .disk
                .saturating_sub(overlap.host.max(overlap.device)),
        );
        let credit = self.overlap_credit * device
            + self.host_weight * host_only
            + self.disk_weight * disk_only;
        self.prefill_load_scale * (raw_prefill - credit).max(0.0)
    }

    /// The logit's decode terms: the rank's resident decode blocks and
    /// running requests, and the blocks the request adds.
    pub fn decode_cost(
        &self,
        req: &RequestShape,
        block_size: u32,
        rank: &RankLoad,
        overlap: Overlap,
    ) -> f64 {
        let added = new_blocks(req.isl_tokens, block_size, overlap.device) as f64;
        rank.active_decode_blocks as f64
            + added
            + self.decode_active_request_weight * f64::from(rank.running)
    }
}

/// Selects a rank for `req` among the non-busy ranks of the model's
/// workers in `tenant`; other tenants' workers are not candidates, and do
/// not count towards "all busy".
///
/// `overlap` reports each candidate's cached prefix; pass `|_, _| Overlap::default()`
/// when nothing is known.
pub fn select<'a>(
    model: &'a ModelState,
    tenant: &str,
    req: &RequestShape,
    policy: &Policy,
    overlap: impl FnMut(&WorkerState, &RankLoad) -> Overlap,
) -> Decision<'a> {
    select_with_runner_up(model, tenant, req, policy, &[], overlap).0
}

/// [`select`], plus the cheapest candidate on another worker than the
/// chosen one: where a request goes if its worker refuses the connection.
/// Found in the same pass, so it costs no second search.
pub fn select_with_runner_up<'a>(
    model: &'a ModelState,
    tenant: &str,
    req: &RequestShape,
    policy: &Policy,
    terms: &[&dyn Term],
    mut overlap: impl FnMut(&WorkerState, &RankLoad) -> Overlap,
) -> (Decision<'a>, Option<Choice<'a>>) {
    let mut any_rank = false;
    let mut capped = false;
    // Ranks that would never meet the request's targets, and ranks that
    // might (busy, capped, loaded, or meeting them).
    let mut slo_missed = false;
    let mut might = false;
    let mut runner_up: Option<Choice<'a>> = None;
    let mut best: Option<Choice<'a>> = None;
    let mut ties: u64 = 0;
    // Candidates are kept only for sampling; temperature 0 never allocates.
    let mut pool: Vec<Choice<'a>> = Vec::new();
    let sampling = policy.temperature > 0.0;
    // Only a scaled request judges busy here; the published flags already
    // follow each worker's role.
    let split = req.thresholds_scale.is_some() && model.disaggregated();
    let request_bound = model
        .thresholds
        .scaled(req.thresholds_scale.unwrap_or(1.0))
        .active_decode_requests;
    for worker in model
        .workers
        .iter()
        .filter(|w| w.tenant == tenant && req.leg.takes(w.role))
    {
        // Being drained: it finishes what it has and takes nothing new.
        if worker.draining {
            any_rank |= !worker.ranks.is_empty();
            continue;
        }
        let at_cap = worker.thermal.at_cap();
        capped |= at_cap && !worker.ranks.is_empty();
        // A decode worker at its bound on requests takes no more.
        let full = req.leg != Leg::Prefill
            && request_bound.is_some_and(|b| u64::from(worker.thermal.in_flight) >= b);
        let heat = 1.0 + policy.thermal_weight * worker.thermal.heat.clamp(0.0, 1.0);
        for rank in &worker.ranks {
            any_rank = true;
            let ov = overlap(worker, rank);
            let (ttft_ms, meets) = predicted(req, worker, rank, ov);
            // A rank that would not meet the request's targets even idle
            // is no candidate now or later.
            if meets == Meets::Never {
                slo_missed = true;
                continue;
            }
            might = true;
            // Busy for this request: over a threshold, at the worker's cap
            // or bound, or too loaded to meet its targets until its queue
            // drains.
            if at_cap
                || full
                || meets == Meets::Loaded
                || busy_for(model, worker, rank, req.thresholds_scale, split)
            {
                continue;
            }
            let logit = (policy.logit(req, worker.block_size, rank, ov)
                + terms.iter().map(|t| t.cost(worker, rank)).sum::<f64>())
                * heat;
            let choice = Choice {
                worker,
                rank,
                logit,
                overlap: ov,
                ttft_ms,
            };
            if sampling {
                pool.push(choice);
                continue;
            }
            match best {
                Some(b) if logit == b.logit => {
                    // Reservoir-style: the k-th tie replaces the current pick
                    // when the tie-break lands on it, which spreads ties
                    // uniformly over tie_break values.
                    ties += 1;
                    if mix(req.tie_break, ties).is_multiple_of(ties + 1) {
                        runner_up = demoted(b, runner_up, &choice);
                        best = Some(choice);
                    } else {
                        runner_up = cheaper_elsewhere(&b, runner_up, choice);
                    }
                }
                Some(b) if logit > b.logit => {
                    runner_up = cheaper_elsewhere(&b, runner_up, choice);
                }
                _ => {
                    if let Some(b) = best {
                        runner_up = demoted(b, runner_up, &choice);
                    }
                    best = Some(choice);
                    ties = 0;
                }
            }
        }
    }
    if sampling {
        best = sample(&pool, policy.temperature, req.sample);
        runner_up = best.and_then(|b| {
            pool.iter()
                .filter(|c| !std::ptr::eq(c.worker, b.worker))
                .min_by(|x, y| x.logit.total_cmp(&y.logit))
                .copied()
        });
    }
    let decision = match best {
        Some(c) => Decision::Route(c),
        None if capped => Decision::AllHot,
        None if slo_missed && !might => Decision::SloUnattainable,
        None if any_rank => Decision::AllBusy,
        None => Decision::NoWorkers,
    };
    (decision, runner_up)
}

/// What a rank's latency fits say of a request's targets there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Meets {
    /// Predicted to meet them, or nothing can be predicted.
    Yes,
    /// Not at the rank's load now, but when its queue drains: it is busy
    /// for this request, which may wait for it.
    Loaded,
    /// Not even idle: waiting for it does not help.
    Never,
}

/// The request's predicted time to first token on `rank` (its leg
/// computes the prompt there), and whether the rank is predicted to meet
/// the request's targets: TTFT for a leg that computes the prompt, ITL for
/// one that generates the answer. A target of 0, or a prediction the fit
/// cannot make, is no reason to refuse.
fn predicted(
    req: &RequestShape,
    worker: &WorkerState,
    rank: &RankLoad,
    ov: Overlap,
) -> (Option<f64>, Meets) {
    let Some(fits) = &worker.fits else {
        return (None, Meets::Yes);
    };
    let bs = u64::from(worker.block_size.max(1));
    let uncached = req
        .isl_tokens
        .saturating_sub(u64::from(ov.device).saturating_mul(bs));
    let prompt = req.leg != Leg::Decode;
    let ttft = fits.ttft_ms(rank, uncached).filter(|_| prompt);
    let Some(slo) = req.slo else {
        return (ttft, Meets::Yes);
    };
    let idle = RankLoad::default();
    let meets = |r: &RankLoad, t: Option<f64>| {
        let ttft_ok = slo.ttft_ms == 0 || t.is_none_or(|t| t <= f64::from(slo.ttft_ms));
        let itl_ok = slo.itl_ms == 0
            || req.leg == Leg::Prefill
            || fits
                .itl_ms(r, worker.block_size)
                .is_none_or(|i| i <= f64::from(slo.itl_ms));
        ttft_ok && itl_ok
    };
    let verdict = if meets(rank, ttft) {
        Meets::Yes
    } else if meets(&idle, fits.ttft_ms(&idle, uncached).filter(|_| prompt)) {
        Meets::Loaded
    } else {
        Meets::Never
    };
    (ttft, verdict)
}

/// Whether `rank` is busy for a request judged at `scale` times the
/// model's thresholds: the published flag, unless a retry's headroom
/// lets it in (scale above 1) or a class without the critical reserve
/// finds it over its share (scale under 1).
pub(super) fn busy_for(
    model: &ModelState,
    worker: &WorkerState,
    rank: &RankLoad,
    scale: Option<f64>,
    split: bool,
) -> bool {
    let Some(scale) = scale else {
        return rank.busy;
    };
    let over = |s: f64| {
        let th = worker.role.judged_by(model.thresholds, split).scaled(s);
        rank_busy(rank, &th, &mut false).is_some()
    };
    if scale >= 1.0 {
        rank.busy && over(scale)
    } else {
        rank.busy || over(scale)
    }
}

/// The runner-up once `old` loses first place to `new`: `old` itself,
/// the cheapest of the rest, unless it is on the same worker as `new`.
fn demoted<'a>(
    old: Choice<'a>,
    runner_up: Option<Choice<'a>>,
    new: &Choice<'a>,
) -> Option<Choice<'a>> {
    if std::ptr::eq(old.worker, new.worker) {
        runner_up
    } else {
        Some(old)
    }
}

/// The runner-up after weighing `choice`, which did not take first place
/// from `best`.
fn cheaper_elsewhere<'a>(
    best: &Choice<'a>,
    runner_up: Option<Choice<'a>>,
    choice: Choice<'a>,
) -> Option<Choice<'a>> {
    let elsewhere = !std::ptr::eq(choice.worker, best.worker);
    if elsewhere && runner_up.is_none_or(|r| choice.logit < r.logit) {
        Some(choice)
    } else {
        runner_up
    }
}

/// splitmix64 of the tie-break and the tie index: a cheap, well-spread,
/// deterministic choice among equals.
fn mix(seed: u64, k: u64) -> u64 {
    let mut z = seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn sample<'a>(pool: &[Choice<'a>], temperature: f64, u: f64) -> Option<Choice<'a>> {
    let first = pool.first()?;
    let (mut lo, mut hi) = (first.logit, first.logit);
    for c in pool {
        lo = lo.min(c.logit);
        hi = hi.max(c.logit);
    }
    let range = if hi > lo { hi - lo } else { 1.0 };
    // Shift by the best score so exp() never overflows.
    let weights: Vec<f64> = pool
        .iter()
        .map(|c| (-(c.logit - lo) / range / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut target = u.clamp(0.0, 1.0) * total;
    for (c, w) in pool.iter().zip(&weights) {
        if target < *w {
            return Some(*c);
        }
        target -= w;
    }
    pool.last().copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::fixtures::worker;
    use crate::state::DEFAULT_TENANT;

    fn rank(rank: u32, prefill: u64, decode: u64, busy: bool) -> RankLoad {
        RankLoad {
            rank,
            active_prefill_tokens: prefill,
            active_decode_blocks: decode,
            busy,
            ..Default::default()
        }
    }

    fn model(workers: Vec<WorkerState>) -> ModelState {
        ModelState {
            name: "m".into(),
            workers,
            ..Default::default()
        }
    }

    fn pick(m: &ModelState, tie: u64) -> Option<(u64, u32)> {
        let req = RequestShape {
            isl_tokens: 100,
            tie_break: tie,
            sample: 0.0,
            ..Default::default()
        };
        match select(m, DEFAULT_TENANT, &req, &Policy::default(), |_, _| {
            Overlap::default()
        }) {
            Decision::Route(c) => Some((c.worker.id, c.rank.rank)),
            _ => None,
        }
    }

    #[test]
    fn a_request_only_sees_its_tenants_workers() {
        let mut m = model(vec![
            worker(1, vec![rank(0, 0, 0, false)]),
            worker(2, vec![rank(0, 900, 90, false)]),
            worker(3, vec![rank(0, 0, 0, true)]),
        ]);
        m.workers[0].tenant = "team-a".into();
        m.workers[2].tenant = "team-b".into();
        let req = RequestShape::default();
        let pick = |tenant: &str| match select(&m, tenant, &req, &Policy::default(), |_, _| {
            Overlap::default()
        }) {
            Decision::Route(c) => Ok(c.worker.id),
            other => Err(other),
        };
        assert_eq!(pick("team-a"), Ok(1));
        assert_eq!(pick(DEFAULT_TENANT), Ok(2), "the idle worker is team-a's");
        assert_eq!(
            pick("team-b"),
            Err(Decision::AllBusy),
            "team-b's only worker is busy, whatever the others are"
        );
        assert_eq!(pick("team-c"), Err(Decision::NoWorkers));
    }

    #[test]
    fn least_loaded_wins() {
        let m = model(vec![
            worker(1, vec![rank(0, 500, 10, false)]),
            worker(2, vec![rank(0, 0, 2, false)]),
            worker(3, vec![rank(0, 160, 0, false)]),
        ]);
        assert_eq!(pick(&m, 0), Some((2, 0)));
    }

    #[test]
    fn the_runner_up_is_the_cheapest_rank_on_another_worker() {
        let runner_up = |m: &ModelState, tie: u64| {
            let req = RequestShape {
                isl_tokens: 100,
                tie_break: tie,
                sample: 0.0,
                ..Default::default()
            };
            let (d, r) =
                select_with_runner_up(m, DEFAULT_TENANT, &req, &Policy::default(), &[], |_, _| {
                    Overlap::default()
                });
            let Decision::Route(best) = d else {
                panic!("expected a route, got {d:?}");
            };
            (best.worker.id, r.map(|c| (c.worker.id, c.rank.rank)))
        };
        // Worker 1's second rank is cheaper than worker 3, but shares the
        // chosen worker: a refused connection would refuse it too.
        let m = model(vec![
            worker(3, vec![rank(0, 300, 0, false)]),
            worker(1, vec![rank(0, 0, 0, false), rank(1, 10, 0, false)]),
            worker(2, vec![rank(0, 200, 0, false), rank(1, 0, 0, true)]),
        ]);
        assert_eq!(runner_up(&m, 0), (1, Some((2, 0))));
        // Whatever the order the candidates come in.
        let mut rev = m.clone();
        rev.workers.reverse();
        assert_eq!(runner_up(&rev, 0), (1, Some((2, 0))));
        // Equal costs: the runner-up is never on the chosen worker, for
        // every tie-break.
        let tied = model(
            (1..=3)
                .map(|id| worker(id, vec![rank(0, 0, 0, false), rank(1, 0, 0, false)]))
                .collect(),
        );
        for t in 0..200 {
            let (best, r) = runner_up(&tied, t);
            let (other, _) = r.expect("two other workers are free");
            assert_ne!(best, other, "tie-break {t}");
        }
        // A single worker has no runner-up.
        let one = model(vec![worker(
            1,
            vec![rank(0, 0, 0, false), rank(1, 0, 0, false)],
        )]);
        assert_eq!(runner_up(&one, 0), (1, None));
    }

    #[test]
    fn extra_terms_add_to_the_cost() {
        struct Hot(u64);
        impl Term for Hot {
            fn cost(&self, worker: &WorkerState, _: &RankLoad) -> f64 {
                if worker.id == self.0 { 1000.0 } else { 0.0 }
            }
        }
        let m = model(vec![
            worker(1, vec![rank(0, 0, 0, false)]),
            worker(2, vec![rank(0, 0, 50, false)]),
        ]);
        let req = RequestShape {
            isl_tokens: 100,
            ..Default::default()
        };
        let pick = |terms: &[&dyn Term]| match select_with_runner_up(
            &m,
            DEFAULT_TENANT,
            &req,
            &Policy::default(),
            terms,
            |_, _| Overlap::default(),
        ) {
            (Decision::Route(c), _) => (c.worker.id, c.logit),
            other => panic!("{other:?}"),
        };
        let (id, plain) = pick(&[]);
        assert_eq!(id, 1, "the idle worker wins on load alone");
        let hot = Hot(1);
        assert_eq!(pick(&[&hot]).0, 2, "a term can outweigh load");
        let cold = Hot(99);
        assert_eq!(pick(&[&cold]), (1, plain), "a zero term changes nothing");
    }

    fn hot(mut w: WorkerState, heat: f64, cap: u32, in_flight: u32) -> WorkerState {
        w.thermal = crate::state::Thermal {
            state: if cap > 0 {
                crate::state::ThermalState::Throttling
            } else {
                crate::state::ThermalState::Warm
            },
            heat,
            cap,
            in_flight,
        };
        w
    }

    #[test]
    fn a_warm_worker_loses_new_work_to_a_cooler_one_before_any_cap() {
        // Worker 1 is less loaded, but warm; worker 2 is cool.
        let m = model(vec![
            hot(worker(1, vec![rank(0, 0, 10, false)]), 0.5, 0, 0),
            worker(2, vec![rank(0, 0, 14, false)]),
        ]);
        assert_eq!(pick(&m, 0), Some((2, 0)), "(7 + 10) × 1.5 > 7 + 14");
        let cool = model(vec![
            hot(worker(1, vec![rank(0, 0, 10, false)]), 0.0, 0, 0),
            worker(2, vec![rank(0, 0, 14, false)]),
        ]);
        assert_eq!(pick(&cool, 0), Some((1, 0)), "heat 0 prices nothing");
        let mut off = m.clone();
        let policy = Policy {
            thermal_weight: 0.0,
            ..Policy::default()
        };
        off.policy = policy;
        let req = RequestShape {
            isl_tokens: 100,
            ..Default::default()
        };
        match select(&off, DEFAULT_TENANT, &req, &policy, |_, _| {
            Overlap::default()
        }) {
            Decision::Route(c) => assert_eq!(c.worker.id, 1, "weight 0 turns heat off"),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn a_draining_worker_takes_nothing_new() {
        let mut m = model(vec![
            worker(1, vec![rank(0, 0, 0, false)]),
            worker(2, vec![rank(0, 0, 90, false)]),
        ]);
        assert_eq!(pick(&m, 0), Some((1, 0)));
        m.workers[0].draining = true;
        assert_eq!(pick(&m, 0), Some((2, 0)), "the idle worker is draining");
        m.workers[1].draining = true;
        assert_eq!(
            select(
                &m,
                DEFAULT_TENANT,
                &RequestShape::default(),
                &Policy::default(),
                |_, _| { Overlap::default() }
            ),
            Decision::AllBusy,
            "every worker draining: shed, not 'no workers'"
        );
    }

    #[test]
    fn a_worker_at_its_cap_is_no_candidate_and_a_hot_fleet_sheds_as_thermal() {
        let m = model(vec![
            hot(worker(1, vec![rank(0, 0, 0, false)]), 1.0, 4, 4),
            worker(2, vec![rank(0, 0, 90, false)]),
        ]);
        assert_eq!(pick(&m, 0), Some((2, 0)), "the idle worker is at its cap");
        let under = model(vec![
            hot(worker(1, vec![rank(0, 0, 0, false)]), 1.0, 4, 3),
            worker(2, vec![rank(0, 0, 90, false)]),
        ]);
        assert_eq!(pick(&under, 0), Some((1, 0)), "under its cap it takes work");
        fn decide(m: &ModelState) -> Decision<'_> {
            select(
                m,
                DEFAULT_TENANT,
                &RequestShape::default(),
                &Policy::default(),
                |_, _| Overlap::default(),
            )
        }
        let all = model(vec![
            hot(worker(1, vec![rank(0, 0, 0, false)]), 1.0, 4, 9),
            worker(2, vec![rank(0, 0, 0, true)]),
        ]);
        assert_eq!(decide(&all), Decision::AllHot, "capped or busy, one capped");
        let busy = model(vec![worker(2, vec![rank(0, 0, 0, true)])]);
        assert_eq!(decide(&busy), Decision::AllBusy);
    }

    #[test]
    fn a_retry_with_its_ticket_may_use_a_busy_rank_within_the_headroom() {
        // Busy by prefill at 1000 tokens: one rank at 1200, one at 2000.
        let mut m = model(vec![
            worker(1, vec![rank(0, 2000, 0, true)]),
            worker(2, vec![rank(0, 1200, 0, true)]),
        ]);
        m.thresholds.active_prefill_tokens = Some(1000);
        let shape = |scale| RequestShape {
            thresholds_scale: scale,
            ..Default::default()
        };
        let decide = |h| {
            select(&m, DEFAULT_TENANT, &shape(h), &Policy::default(), |_, _| {
                Overlap::default()
            })
        };
        assert_eq!(decide(None), Decision::AllBusy, "new work is shed");
        match decide(Some(1.5)) {
            Decision::Route(c) => assert_eq!(c.worker.id, 2, "1200 is within 1500"),
            d => panic!("{d:?}"),
        }
        assert_eq!(decide(Some(1.1)), Decision::AllBusy, "1200 is over 1100");
    }

    /// The choice for a request of `leg` judged at `scale`, or why none.
    fn judged(m: &ModelState, leg: Leg, scale: Option<f64>) -> Result<u64, String> {
        let shape = RequestShape {
            leg,
            thresholds_scale: scale,
            ..Default::default()
        };
        match select(m, DEFAULT_TENANT, &shape, &Policy::default(), |_, _| {
            Overlap::default()
        }) {
            Decision::Route(c) => Ok(c.worker.id),
            d => Err(format!("{d:?}")),
        }
    }

    #[test]
    fn a_class_without_the_reserve_stops_short_of_the_thresholds() {
        // Not busy by the published flags, but 950 tokens is over 90 % of
        // 1000: only a class that may use the reserve takes the rank.
        let mut m = model(vec![
            worker(1, vec![rank(0, 950, 0, false)]),
            worker(2, vec![rank(0, 850, 0, false)]),
        ]);
        m.thresholds.active_prefill_tokens = Some(1000);
        let decide = |m: &ModelState, scale| judged(m, Leg::Whole, scale);
        assert_eq!(decide(&m, Some(0.9)), Ok(2), "850 is within 900");
        m.workers[1].ranks[0].active_prefill_tokens = 920;
        assert_eq!(decide(&m, Some(0.9)), Err("AllBusy".into()));
        assert!(decide(&m, None).is_ok());
        // A busy flag stays busy for a narrower class.
        m.workers[1].ranks[0].busy = true;
        m.workers[0].ranks[0].busy = true;
        assert_eq!(decide(&m, Some(0.5)), Err("AllBusy".into()));
    }

    #[test]
    fn ranks_predicted_to_miss_the_slo_are_no_candidates_and_unknown_ones_are() {
        use crate::fit::{Fit, MIN_SAMPLES, WorkerFits};
        let fit = |intercept_ms, slope_ms_per_ktok| Fit {
            intercept_ms,
            slope_ms_per_ktok,
            samples: MIN_SAMPLES,
            age_s: 1,
        };
        // Worker 1 is cheaper by cost (less load) but slow; worker 2 has
        // more load and a fast engine.
        let mut m = model(vec![
            worker(1, vec![rank(0, 100, 0, false)]),
            worker(2, vec![rank(0, 900, 0, false)]),
        ]);
        m.workers[0].fits = Some(WorkerFits {
            ttft: fit(400.0, 100.0),
            itl: fit(10.0, 0.0),
        });
        m.workers[1].fits = Some(WorkerFits {
            ttft: fit(50.0, 100.0),
            itl: fit(10.0, 0.0),
        });
        let shape = |slo| RequestShape {
            isl_tokens: 1000,
            slo,
            ..Default::default()
        };
        let pick = |m: &ModelState, slo| match select(
            m,
            DEFAULT_TENANT,
            &shape(slo),
            &Policy::default(),
            |_, _| Overlap::default(),
        ) {
            Decision::Route(c) => Ok((c.worker.id, c.ttft_ms)),
            d => Err(format!("{d:?}")),
        };
        // No targets: today's cost, with the prediction kept.
        assert_eq!(pick(&m, None), Ok((1, Some(400.0 + 100.0 * 1.1))));
        // 510 ms on worker 1 misses 300; 50 + 100 × 1.9 = 240 meets it.
        let slo = Slo {
            ttft_ms: 300,
            itl_ms: 0,
        };
        assert_eq!(pick(&m, Some(slo)), Ok((2, Some(240.0))));
        // Nobody meets 100 ms.
        let tight = Slo {
            ttft_ms: 100,
            itl_ms: 0,
        };
        assert_eq!(pick(&m, Some(tight)), Err("SloUnattainable".into()));
        // 200 ms: worker 2 misses at its load (240) but not idle (150), so
        // it is busy for this request, which may wait; worker 1 never.
        let queued = Slo {
            ttft_ms: 200,
            itl_ms: 0,
        };
        assert_eq!(pick(&m, Some(queued)), Err("AllBusy".into()));
        // An ITL target over what the fits predict changes nothing; under, refuses.
        let itl = |itl_ms| Slo { ttft_ms: 0, itl_ms };
        assert!(pick(&m, Some(itl(20))).is_ok());
        assert_eq!(pick(&m, Some(itl(5))), Err("SloUnattainable".into()));
        // A fit too young to trust is unknown: today's cost decides.
        m.workers[0].fits = Some(WorkerFits {
            ttft: Fit {
                samples: MIN_SAMPLES - 1,
                ..fit(400.0, 100.0)
            },
            itl: fit(10.0, 0.0),
        });
        assert_eq!(pick(&m, Some(slo)), Ok((1, None)));
        m.workers[1].fits = None;
        assert_eq!(
            pick(&m, Some(tight)),
            Ok((1, None)),
            "nothing known, nothing refused"
        );
    }

    #[test]
    fn a_decode_worker_at_its_request_bound_takes_no_more() {
        let mut m = model(vec![
            worker(1, vec![rank(0, 0, 0, false)]),
            worker(2, vec![rank(0, 500, 50, false)]),
        ]);
        m.thresholds.active_decode_requests = Some(4);
        m.workers[0].thermal.in_flight = 4;
        m.workers[1].thermal.in_flight = 3;
        let decide = |m: &ModelState, leg, scale| judged(m, leg, scale);
        assert_eq!(decide(&m, Leg::Whole, None), Ok(2), "the idle one is full");
        // Without the reserve a class may hold 3 of 4 (at least 1).
        assert_eq!(decide(&m, Leg::Whole, Some(0.75)), Err("AllBusy".into()));
        m.workers[1].thermal.in_flight = 4;
        assert_eq!(decide(&m, Leg::Decode, None), Err("AllBusy".into()));
        // A prefill leg holds no decode slot.
        assert!(decide(&m, Leg::Prefill, None).is_ok());
    }

    #[test]
    fn busy_ranks_are_skipped_and_all_busy_sheds() {
        let m = model(vec![
            worker(1, vec![rank(0, 0, 0, true), rank(1, 900, 90, false)]),
            worker(2, vec![rank(0, 0, 0, true)]),
        ]);
        assert_eq!(pick(&m, 0), Some((1, 1)));
        let m = model(vec![worker(1, vec![rank(0, 0, 0, true)])]);
        assert_eq!(
            select(
                &m,
                DEFAULT_TENANT,
                &RequestShape::default(),
                &Policy::default(),
                |_, _| { Overlap::default() }
            ),
            Decision::AllBusy
        );
        let m = model(vec![]);
        assert_eq!(
            select(
                &m,
                DEFAULT_TENANT,
                &RequestShape::default(),
                &Policy::default(),
                |_, _| { Overlap::default() }
            ),
            Decision::NoWorkers
        );
    }

    #[test]
    fn ties_spread_over_tie_break_values_deterministically() {
        let m = model(
            (1..=4)
                .map(|id| worker(id, vec![rank(0, 0, 0, false)]))
                .collect(),
        );
        let mut counts = [0u32; 5];
        for t in 0..4000 {
            let (id, _) = pick(&m, t).unwrap();
            counts[id as usize] += 1;
            assert_eq!(pick(&m, t), Some((id, 0)), "same input, same answer");
        }
        for &c in &counts[1..] {
            assert!((700..1300).contains(&c), "uneven spread {counts:?}");
        }
    }

    #[test]
    fn device_overlap_outweighs_small_load() {
        let m = model(vec![
            worker(1, vec![rank(0, 0, 0, false)]),
            worker(2, vec![rank(0, 32, 0, false)]),
        ]);
        let req = RequestShape {
            isl_tokens: 160,
            ..Default::default()
        };
        let d = select(&m, DEFAULT_TENANT, &req, &Policy::default(), |w, _| {
            Overlap {
                device: if w.id == 2 { 8 } else { 0 },
                host: if w.id == 2 { 8 } else { 0 },
                disk: if w.id == 2 { 8 } else { 0 },
            }
        });
        match d {
            Decision::Route(c) => {
                assert_eq!(c.worker.id, 2);
                // (160 + 32) / 16 = 12 raw, less 3 × 8 credit, floored at
                // 0, plus the 2 of the request's 10 blocks that are not
                // resident yet.
                assert_eq!(c.logit, 0.0 + 2.0);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_resident_prefix_is_not_charged_twice() {
        // Worker 1 holds a 128-block prefix and carries the 136 blocks of
        // the request that put it there (prefill done); worker 2 is idle.
        // The next request of the group adds only its 8 new blocks there.
        let m = model(vec![
            worker(1, vec![rank(0, 0, 136, false)]),
            worker(2, vec![rank(0, 0, 0, false)]),
        ]);
        let req = RequestShape {
            isl_tokens: 136 * 16,
            ..Default::default()
        };
        let d = select(&m, DEFAULT_TENANT, &req, &Policy::default(), |w, _| {
            Overlap {
                device: if w.id == 1 { 128 } else { 0 },
                ..Overlap::default()
            }
        });
        match d {
            Decision::Route(c) => {
                assert_eq!(c.worker.id, 1, "the group stays with its prefix");
                // 136 raw prefill blocks less 3 × 128 credit, floored at 0.
                assert_eq!(c.logit, 0.0 + 136.0 + 8.0);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(new_blocks(136 * 16, 16, 128), 8);
        assert_eq!(new_blocks(64, 16, 4), 1, "never less than one block");
        assert_eq!(new_blocks(65, 16, 0), 5);
    }

    #[test]
    fn host_and_disk_tiers_get_partial_credit() {
        let p = Policy::default();
        let r = rank(0, 0, 0, false);
        let req = RequestShape {
            isl_tokens: 16 * 10,
            ..Default::default()
        };
        let none = p.logit(&req, 16, &r, Overlap::default());
        let host = p.logit(
            &req,
            16,
            &r,
            Overlap {
                device: 0,
                host: 4,
                disk: 4,
            },
        );
        let disk = p.logit(
            &req,
            16,
            &r,
            Overlap {
                device: 0,
                host: 0,
                disk: 4,
            },
        );
        assert_eq!(none - host, 3.0);
        assert_eq!(none - disk, 1.0);
    }

    #[test]
    fn temperature_samples_and_prefers_low_cost() {
        let m = model(vec![
            worker(1, vec![rank(0, 0, 0, false)]),
            worker(2, vec![rank(0, 1600, 100, false)]),
        ]);
        let policy = Policy {
            temperature: 0.5,
            ..Default::default()
        };
        let mut low = 0;
        for i in 0..1000 {
            let req = RequestShape {
                isl_tokens: 16,
                tie_break: 0,
                sample: i as f64 / 1000.0,
                ..Default::default()
            };
            if let Decision::Route(c) =
                select(&m, DEFAULT_TENANT, &req, &policy, |_, _| Overlap::default())
                && c.worker.id == 1
            {
                low += 1;
            }
        }
        // softmax(0, -2) puts ~88 % on the cheaper worker.
        assert!((850..920).contains(&low), "got {low}");
    }
}
