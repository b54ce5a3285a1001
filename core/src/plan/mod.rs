//! The decision for one request, from its body to a placement or a
//! rejection: the one selection pipeline both front doors use (the filter
//! in Envoy, the sidecar's selection API).
//!
//! ```text
//! request::parse ─► gather (once) ─► place (Policy + terms, per Ask) ─► Plan
//!                     ▲ shards (caller's)     ▲ snapshot + local::LocalBookings
//! ```
//!
//! On a disaggregated model ([`ModelState::disaggregated`]) the gathered
//! overlap is placed twice: the decode worker first (its own cached
//! prefix decides whether the prompt needs a prefill leg at all, by the
//! model's [`Conditional`](crate::disagg::Conditional) rule), then, unless
//! it computes the prompt itself, the prefill worker ([`Prefill`]).
//!
//! The caller supplies what differs between hosts: the snapshot (with its
//! own not-yet-counted bookings applied by [`local::LocalBookings`]), the
//! index shards through a [`ShardSource`], and any extra cost [`Term`]s. The
//! result says everything the caller acts on: the worker and rank, the load
//! to book there, the runner-up to retry on, the prefix record to report,
//! or why the request is refused.

pub mod local;
pub mod overlap;
mod pull;
pub mod request;
pub mod retry;
pub mod select;

#[cfg(test)]
pub(crate) mod fixtures;
#[cfg(test)]
mod pull_tests;
#[cfg(test)]
mod split_tests;

use crate::approx::{ChunkKind, Routed};
use crate::disagg::pull::{Kind, Placed};
use crate::state::{
    Disaggregation, ModelState, OnPrefillFailure, Policy, Protocol, Role, Snapshot,
};
use request::Parsed;
use select::{Decision, RequestShape, select_with_runner_up};

pub use overlap::ShardSource;
pub use select::{Choice, Leg, Overlap, Term};

/// What to do with a request.
#[derive(Debug, Clone, PartialEq)]
#[expect(
    clippy::large_enum_variant,
    reason = "a plan is returned and consumed at once, never stored; boxing the route would \
              allocate on every request of the filter"
)]
pub enum Plan<'a> {
    Route(Route<'a>),
    Reject(Rejection),
}

/// Why a request is refused without reaching a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// No model or adapter of that name.
    UnknownModel,
    /// The model is known but none of the tenant's workers is up.
    NoWorkers,
    /// Every rank of the tenant's workers is over a busy threshold. The
    /// hint is the snapshot's estimate, 0 when it has none.
    AllBusy { retry_after_s: u32 },
    /// Every rank is busy or its worker at its thermal cap, and at least
    /// one worker is capped. The hint is the snapshot's, as for `AllBusy`.
    Thermal { retry_after_s: u32 },
    /// Every rank that would take it is predicted to miss the request's
    /// latency targets. The hint is the snapshot's, as for `AllBusy`.
    SloUnattainable { retry_after_s: u32 },
}

/// A routed request.
#[derive(Debug, Clone, PartialEq)]
pub struct Route<'a> {
    /// The model the fleet knows the request by: the base model when the
    /// request names an adapter. Bookings and reports go under this name.
    pub model: &'a ModelState,
    /// The worker the client's request goes to: on a disaggregated model,
    /// the decode worker. Its placement books what that worker computes:
    /// with a remote prefill, the decode blocks only (until the stream
    /// ends); with a local one, the prompt too.
    pub first: Placement<'a>,
    /// The cheapest candidate on another worker that the same routing
    /// headers suit: where a retry goes if the first refuses. Booked as
    /// `first` would be (a decode worker, on a disaggregated model).
    pub fallback: Option<Placement<'a>>,
    /// The worker has several ranks: the rank must be named to it.
    pub set_rank: bool,
    /// The request's prefix chunks for the routed-prefix index, when the
    /// engines' events cannot yet show where it went. On a disaggregated
    /// model, under the decode worker: it keeps the blocks, the prefill
    /// worker hands them over.
    pub report: Option<Routed>,
    /// On a disaggregated model, where the prompt is computed; `None` on a
    /// model served whole. The model's
    /// [`disaggregation`](ModelState::disaggregation) says how to send the
    /// legs.
    pub prefill: Option<Prefill<'a>>,
    /// On a model that pulls ([`ModelState::pulls`]), which of its three
    /// placements this is: a pull is a remote prefill on the holder.
    pub pull: Option<Placed>,
}

/// Where a disaggregated request's prompt is computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Prefill<'a> {
    /// On a prefill worker, before the decode leg.
    Remote(PrefillLeg<'a>),
    /// On the decode worker ([`Route::first`], which books the prompt):
    /// the request is sent to it whole, with no prefill leg.
    Local(LocalReason),
}

/// The prefill leg of a disaggregated request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillLeg<'a> {
    /// Where the leg goes. Its placement books the uncached prompt as
    /// prefill tokens, until the leg answers, and no decode blocks: the
    /// blocks leave with the transfer (the engine's KV usage shows them
    /// meanwhile).
    pub first: Placement<'a>,
    /// Where the leg is tried once more if `first` fails: the cheapest
    /// prefill candidate on another worker than `first` and the decode
    /// worker; booked the same way.
    pub runner_up: Option<Placement<'a>>,
    /// The prompt tokens the decode worker computes if the leg fails and
    /// the model's `on_prefill_failure` is `local`: what to add to its
    /// booking then.
    pub local_prefill_tokens: u64,
}

/// Why a disaggregated request has no prefill leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalReason {
    /// The conditional rule: the decode worker holds enough of the prompt
    /// that computing the rest costs less than a transfer.
    Conditional,
    /// The cheapest prefill candidate is the decode worker itself (a
    /// `both` worker): there is nothing to transfer.
    SameWorker,
    /// No prefill worker is free, and the model's `on_prefill_failure`
    /// is `local`.
    NoPrefillWorker,
}

impl LocalReason {
    pub fn as_str(self) -> &'static str {
        match self {
            LocalReason::Conditional => "conditional",
            LocalReason::SameWorker => "same_worker",
            LocalReason::NoPrefillWorker => "no_prefill_worker",
        }
    }
}

/// A chosen candidate and the load the request books there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement<'a> {
    /// The worker, rank, overlap and cost selection found.
    pub choice: Choice<'a>,
    /// The load the request adds there: its prompt minus the resident
    /// prefix, and the blocks it adds.
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
}

impl Placement<'_> {
    /// Its worker has several ranks: the rank must be named to it.
    pub fn names_rank(&self) -> bool {
        self.choice.worker.ranks.len() > 1
    }
}

/// How one placement of a gathered request is asked for: what may differ
/// between two placements of the same request, never read from its body.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ask {
    /// Spreads ties and seeds sampling; any per-request value works.
    pub tie_break: u64,
    /// The busy thresholds this request is judged by, as a multiple of
    /// the model's: above 1 a retry holding its ticket (see [`retry`]),
    /// under 1 a class that may not use the share reserved for critical
    /// work (see [`crate::admit`]); `None`: the published busy flags.
    pub thresholds_scale: Option<f64>,
    /// The request's latency targets (its class's or its model's); `None`:
    /// placed by cost alone.
    pub slo: Option<crate::state::Slo>,
    /// The front door sends one upstream request and makes no prefill
    /// leg (the ext_proc server): no pull is considered.
    pub one_upstream: bool,
}

/// A request's overlap with every rank's cache, read from the index once:
/// each [`Gathered::place`] after that reads no shard and hashes nothing.
#[derive(Debug, Clone)]
pub struct Gathered<'a> {
    /// The model the fleet knows the request by (the base model when the
    /// request names an adapter).
    pub model: &'a ModelState,
    pub cached: overlap::Cached,
    /// The chunks to report for the routed-prefix index if routed.
    report: Option<(ChunkKind, Vec<u64>)>,
}

impl<'a> Gathered<'a> {
    /// Looks `req` up in `model`'s index shards ([`overlap::gather`]).
    pub fn new(
        model: &'a ModelState,
        req: &Parsed,
        tenant: &str,
        shards: &mut impl ShardSource,
    ) -> Gathered<'a> {
        let (cached, report) = overlap::gather(model, req, tenant, shards);
        Gathered {
            model,
            cached,
            report,
        }
    }

    /// Keeps no prefix record: for a caller that places without routing
    /// (a selection that books nothing).
    pub fn without_report(mut self) -> Gathered<'a> {
        self.report = None;
        self
    }

    /// Decides where `req` goes, as `ask` says, from the gathered overlap:
    /// one placement on a model served whole, two on a disaggregated one.
    pub fn place(&self, req: &Parsed, tenant: &str, ask: &Ask, terms: &[&dyn Term]) -> Plan<'a> {
        let model = self.model;
        let split = model.disaggregation.filter(|_| model.disaggregated());
        let Some(d) = split else {
            return match self.choose(req, tenant, ask, terms, Leg::Whole, &model.policy) {
                Ok((first, runner_up)) => match model.pulls().filter(|_| !ask.one_upstream) {
                    Some(p) => self.pulled(req, tenant, ask, terms, p, first, runner_up),
                    None => Plan::Route(self.route(req, first, runner_up, None)),
                },
                Err(r) => Plan::Reject(r),
            };
        };
        // The decode worker first: what it holds decides whether the
        // prompt needs a prefill leg at all.
        let decode_policy = decode_policy(&model.policy, &d);
        let (decode, decode_runner_up) =
            match self.choose(req, tenant, ask, terms, Leg::Decode, &decode_policy) {
                Ok(c) => c,
                Err(r) => return Plan::Reject(r),
            };
        let bs = u64::from(decode.worker.block_size.max(1));
        let held = u64::from(decode.overlap.device) * bs;
        // Only a worker that can compute a prompt takes the conditional
        // rule's local prefill: an SGLang decode worker serves nothing
        // without a bootstrap room, so its request is split however
        // little of the prompt is left.
        let computes = d.protocol != Protocol::Sglang || decode.worker.role == Role::Both;
        let prefill = if computes && d.conditional.local(req.isl_tokens, held) {
            Prefill::Local(LocalReason::Conditional)
        } else {
            match self.choose(req, tenant, ask, terms, Leg::Prefill, &model.policy) {
                Ok((p, _)) if std::ptr::eq(p.worker, decode.worker) => {
                    Prefill::Local(LocalReason::SameWorker)
                }
                Ok((p, runner_up)) => Prefill::Remote(PrefillLeg {
                    first: prefill_placement(req, p),
                    runner_up: runner_up
                        .filter(|r| !std::ptr::eq(r.worker, decode.worker))
                        .map(|r| prefill_placement(req, r)),
                    local_prefill_tokens: placement(req, decode).prefill_tokens,
                }),
                Err(_) if d.on_prefill_failure == OnPrefillFailure::Local => {
                    Prefill::Local(LocalReason::NoPrefillWorker)
                }
                Err(r) => return Plan::Reject(r),
            }
        };
        Plan::Route(self.route(req, decode, decode_runner_up, Some(prefill)))
    }

    /// A model that pulls: the best whole placement (`first`, today's
    /// choice between the holder and a recompute) against the cheapest
    /// pull, by one cost ([`crate::disagg::pull`]).
    #[expect(
        clippy::too_many_arguments,
        reason = "a placement's inputs, each named where it is used; a struct would only rename them"
    )]
    fn pulled(
        &self,
        req: &Parsed,
        tenant: &str,
        ask: &Ask,
        terms: &[&dyn Term],
        pull: &crate::disagg::pull::Pull,
        first: Choice<'a>,
        runner_up: Option<Choice<'a>>,
    ) -> Plan<'a> {
        let shape = self.shape(req, ask, Leg::Whole);
        let found = pull::find(self, pull, tenant, &shape, ask, terms);
        let quoted = found.best.filter(|q| {
            crate::disagg::pull::choose(first.logit, Some(&q.quote))
                && ask.slo.is_none_or(|slo| {
                    slo.ttft_ms == 0
                        || q.decoder
                            .ttft_ms
                            .is_none_or(|t| t <= f64::from(slo.ttft_ms))
                })
        });
        let Some(q) = quoted else {
            let recomputed = found.longest.saturating_sub(first.overlap.device);
            let kind = if recomputed > 0 {
                Kind::Recompute
            } else {
                Kind::Holder
            };
            let mut route = self.route(req, first, runner_up, None);
            let blocks = u64::from(recomputed);
            route.pull = Some(Placed {
                kind,
                blocks,
                reused: blocks,
                transfer_ms: 0.0,
            });
            return Plan::Route(route);
        };
        // Envoy retries the decode leg (its body names the holder's
        // blocks) on another `both` worker, which pulls them as well.
        let fallback = [Some(first), runner_up].into_iter().flatten().find(|c| {
            !std::ptr::eq(c.worker, q.decoder.worker)
                && !std::ptr::eq(c.worker, q.holder.worker)
                && c.worker.role == Role::Both
        });
        let leg = PrefillLeg {
            first: prefill_placement(req, q.holder),
            runner_up: None,
            local_prefill_tokens: placement(req, q.decoder).prefill_tokens,
        };
        let mut route = self.route(req, q.decoder, fallback, Some(Prefill::Remote(leg)));
        route.pull = Some(Placed {
            kind: Kind::Pull,
            blocks: q.quote.moved_blocks,
            reused: q.quote.reused_blocks,
            transfer_ms: q.quote.transfer_ms,
        });
        Plan::Route(route)
    }

    /// The cheapest candidate for `leg` and the cheapest on another
    /// worker, or why there is none.
    fn choose(
        &self,
        req: &Parsed,
        tenant: &str,
        ask: &Ask,
        terms: &[&dyn Term],
        leg: Leg,
        policy: &Policy,
    ) -> Result<(Choice<'a>, Option<Choice<'a>>), Rejection> {
        let model = self.model;
        let shape = self.shape(req, ask, leg);
        let cached = &self.cached;
        let (decision, runner_up) =
            select_with_runner_up(model, tenant, &shape, policy, terms, |w, r| {
                cached.of(w, r.slot)
            });
        // A leg is refused for want of its own pool: its pool's hint,
        // where the sidecar gives one.
        let pool = match leg {
            Leg::Whole => 0,
            Leg::Prefill => model.retry_after_by_pool_s[0],
            Leg::Decode => model.retry_after_by_pool_s[1],
        };
        let retry_after_s = if pool == 0 { model.retry_after_s } else { pool };
        match decision {
            Decision::Route(first) => Ok((first, runner_up)),
            Decision::AllBusy => Err(Rejection::AllBusy { retry_after_s }),
            Decision::AllHot => Err(Rejection::Thermal { retry_after_s }),
            Decision::SloUnattainable => Err(Rejection::SloUnattainable { retry_after_s }),
            Decision::NoWorkers => Err(Rejection::NoWorkers),
        }
    }

    fn shape(&self, req: &Parsed, ask: &Ask, leg: Leg) -> RequestShape {
        RequestShape {
            isl_tokens: req.isl_tokens,
            tie_break: ask.tie_break,
            sample: (ask.tie_break % 1_000_003) as f64 / 1_000_003.0,
            thresholds_scale: ask.thresholds_scale,
            leg,
            slo: ask.slo,
        }
    }

    /// The route to `first`: its fallback, rank header and report. With a
    /// remote prefill, `first` and its fallback compute no prompt.
    fn route(
        &self,
        req: &Parsed,
        first: Choice<'a>,
        runner_up: Option<Choice<'a>>,
        prefill: Option<Prefill<'a>>,
    ) -> Route<'a> {
        let model = self.model;
        let set_rank = first.worker.ranks.len() > 1;
        // A fallback must take the same headers: with a rank header it
        // needs a rank of that number.
        let fallback = runner_up
            .filter(|r| !set_rank || (r.worker.ranks.len() > 1 && r.rank.rank == first.rank.rank));
        let remote = matches!(prefill, Some(Prefill::Remote(_)));
        let booked = |c: Choice<'a>| {
            let p = placement(req, c);
            if remote {
                Placement {
                    prefill_tokens: 0,
                    ..p
                }
            } else {
                p
            }
        };
        Route {
            model,
            first: booked(first),
            fallback: fallback.map(booked),
            set_rank,
            report: self
                .report
                .as_ref()
                .filter(|(_, h)| !h.is_empty())
                .map(|(kind, hashes)| Routed {
                    model: model.name.clone(),
                    slot: first.rank.slot,
                    kind: *kind,
                    hashes: hashes.clone(),
                }),
            prefill,
            pull: None,
        }
    }
}

/// The cost weights a decode worker is chosen by: the model's, with its
/// own cached prefix credited at the decode affinity instead of the
/// overlap credit (host and disk blocks in the policy's proportion).
fn decode_policy(policy: &Policy, d: &Disaggregation) -> Policy {
    let scale = if policy.overlap_credit > 0.0 {
        d.decode_affinity / policy.overlap_credit
    } else {
        0.0
    };
    Policy {
        overlap_credit: d.decode_affinity,
        host_weight: policy.host_weight * scale,
        disk_weight: policy.disk_weight * scale,
        ..*policy
    }
}

/// Gathers `req`'s overlap in the snapshot: the model it names, or why
/// the request is refused before any shard is read.
pub fn gather<'a>(
    snap: &'a Snapshot,
    req: &Parsed,
    tenant: &str,
    shards: &mut impl ShardSource,
) -> Result<Gathered<'a>, Rejection> {
    let model = snap.model(&req.model).ok_or(Rejection::UnknownModel)?;
    Ok(Gathered::new(model, req, tenant, shards))
}

/// Decides where `req` goes: [`gather`], then one [`Gathered::place`].
pub fn plan<'a>(
    snap: &'a Snapshot,
    req: &Parsed,
    tenant: &str,
    ask: &Ask,
    shards: &mut impl ShardSource,
    terms: &[&dyn Term],
) -> Plan<'a> {
    match gather(snap, req, tenant, shards) {
        Ok(g) => g.place(req, tenant, ask, terms),
        Err(r) => Plan::Reject(r),
    }
}

/// The load a request books on a rank that holds `c.overlap` of it. The
/// cached prefix is already resident and shared with the requests that put
/// it there: only the new blocks add KV load, exactly what the cost charged
/// the rank. Counting the prefix again would make every request of a
/// prefix group look like a fresh load on its holder and push the group
/// away from its cache.
fn placement<'a>(req: &Parsed, c: Choice<'a>) -> Placement<'a> {
    let bs = u64::from(c.worker.block_size.max(1));
    Placement {
        choice: c,
        prefill_tokens: req
            .isl_tokens
            .saturating_sub(u64::from(c.overlap.device) * bs),
        decode_blocks: select::new_blocks(req.isl_tokens, c.worker.block_size, c.overlap.device),
    }
}

/// The load a prefill leg books on its worker: the prompt it computes,
/// and no decode blocks (they leave with the transfer).
fn prefill_placement<'a>(req: &Parsed, c: Choice<'a>) -> Placement<'a> {
    Placement {
        decode_blocks: 0,
        ..placement(req, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{CacheScope, scoped_sequence_hashes};
    use crate::shard::{Holder, TIER_DEVICE, encode, shard_of};
    use crate::state::{DEFAULT_TENANT, Policy, RankLoad};
    use crate::update::shard_key;
    use fixtures::worker;
    use request::{Endpoint, parse};
    use std::collections::HashMap;

    fn rank(rank: u32, slot: u16, decode: u64, busy: bool) -> RankLoad {
        RankLoad {
            rank,
            slot,
            active_decode_blocks: decode,
            busy,
            ..Default::default()
        }
    }

    fn snapshot() -> Snapshot {
        Snapshot {
            version: 5,
            built_at_ms: 1,
            models: vec![
                ModelState {
                    name: "m".into(),
                    workers: vec![
                        worker(1, vec![rank(0, 0, 50, false)]),
                        worker(2, vec![rank(0, 1, 10, true), rank(1, 2, 20, false)]),
                    ],
                    lora_adapters: vec!["m-lora".into()],
                    ..Default::default()
                },
                ModelState {
                    name: "empty".into(),
                    ..Default::default()
                },
                ModelState {
                    name: "busy".into(),
                    workers: vec![worker(3, vec![rank(0, 0, 0, true)])],
                    retry_after_s: 7,
                    ..Default::default()
                },
            ],
            applied: Vec::new(),
        }
    }

    fn no_shards(_: &str) -> Option<Vec<u8>> {
        None
    }

    fn run<'a>(snap: &'a Snapshot, body: &str) -> Plan<'a> {
        let req = parse(Endpoint::Completions, body.as_bytes()).unwrap();
        plan(
            snap,
            &req,
            DEFAULT_TENANT,
            &Ask::default(),
            &mut no_shards,
            &[],
        )
    }

    fn text(model: &str) -> String {
        format!(r#"{{"model":"{model}","prompt":"hello"}}"#)
    }

    fn route(p: Plan<'_>) -> Route<'_> {
        match p {
            Plan::Route(r) => r,
            other => panic!("expected a route, got {other:?}"),
        }
    }

    #[test]
    fn routes_to_the_least_loaded_free_rank() {
        let s = snapshot();
        let r = route(run(&s, &text("m")));
        assert_eq!(
            (
                r.first.choice.worker.id,
                r.first.choice.rank.rank,
                r.set_rank
            ),
            (2, 1, true)
        );
        assert_eq!(r.model.name, "m");
        assert_eq!(
            r.fallback, None,
            "worker 1 has no rank 1 to take the rank header"
        );
    }

    #[test]
    fn the_fallback_is_the_next_cheapest_worker_the_headers_suit() {
        let mut s = snapshot();
        s.models[0].workers[1].ranks.remove(0);
        let mut third = worker(9, vec![rank(0, 3, 90, false)]);
        third.endpoint = "10.0.0.9:8000".into();
        s.models[0].workers.push(third);
        let r = route(run(&s, &text("m")));
        let fb = r.fallback.expect("two other workers are free");
        assert_eq!(
            (r.first.choice.worker.id, r.set_rank, fb.choice.worker.id),
            (2, false, 1)
        );
    }

    #[test]
    fn rejections_say_why() {
        let s = snapshot();
        assert_eq!(
            run(&s, &text("nope")),
            Plan::Reject(Rejection::UnknownModel)
        );
        assert_eq!(run(&s, &text("empty")), Plan::Reject(Rejection::NoWorkers));
        assert_eq!(
            run(&s, &text("busy")),
            Plan::Reject(Rejection::AllBusy { retry_after_s: 7 })
        );
        let req = parse(Endpoint::Completions, text("m").as_bytes()).unwrap();
        assert_eq!(
            plan(&s, &req, "team-x", &Ask::default(), &mut no_shards, &[]),
            Plan::Reject(Rejection::NoWorkers),
            "another tenant's workers are not this tenant's"
        );
    }

    #[test]
    fn single_rank_workers_get_no_rank_header() {
        let mut s = snapshot();
        s.models[0].workers.remove(1);
        assert!(!route(run(&s, &text("m"))).set_rank);
    }

    #[test]
    fn the_models_policy_prices_the_candidates() {
        // Worker 1 is idle but far from the request's cache; worker 2 holds
        // nothing either, but the policy weighs running requests.
        let mut s = snapshot();
        s.models[0].workers = vec![worker(1, vec![rank(0, 0, 0, false)])];
        s.models[0].workers[0].ranks[0].running = 10;
        s.models[0]
            .workers
            .push(worker(2, vec![rank(0, 1, 5, false)]));
        assert_eq!(route(run(&s, &text("m"))).first.choice.worker.id, 1);
        s.models[0].policy = Policy {
            decode_active_request_weight: 1.0,
            ..Policy::default()
        };
        assert_eq!(route(run(&s, &text("m"))).first.choice.worker.id, 2);
    }

    /// Shards in which slot 1 holds the first `held` blocks of `tokens`.
    fn index(tokens: &[u32], held: usize, scope: CacheScope<'_>) -> HashMap<String, Vec<u8>> {
        let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
        for h in scoped_sequence_hashes(tokens, 16, scope)
            .into_iter()
            .take(held)
        {
            per_shard.entry(shard_of(h, 8)).or_default().push((
                h,
                vec![Holder {
                    slot: 1,
                    tiers: TIER_DEVICE,
                }],
            ));
        }
        per_shard
            .into_iter()
            .map(|(s, mut e)| (shard_key("m", s), encode(&mut e)))
            .collect()
    }

    fn indexed() -> Snapshot {
        let mut s = snapshot();
        s.models[0].shard_count = 8;
        s.models[0].workers = vec![
            worker(1, vec![rank(0, 0, 0, false)]),
            worker(2, vec![rank(0, 1, 0, false)]),
        ];
        s
    }

    fn tokens_body(model: &str, tokens: &[u32]) -> String {
        format!(r#"{{"model":"{model}","prompt":{tokens:?}}}"#)
    }

    #[test]
    fn a_cached_prefix_wins_and_books_only_the_new_blocks() {
        let s = indexed();
        let tokens: Vec<u32> = (0..160).collect();
        let store = index(&tokens, 6, CacheScope::default());
        let req = parse(Endpoint::Completions, tokens_body("m", &tokens).as_bytes()).unwrap();
        let mut read = |k: &str| store.get(k).cloned();
        let r = route(plan(
            &s,
            &req,
            DEFAULT_TENANT,
            &Ask::default(),
            &mut read,
            &[],
        ));
        assert_eq!(r.first.choice.worker.id, 2, "the holder of the prefix");
        assert_eq!(r.first.choice.overlap.device, 6);
        assert_eq!(r.first.prefill_tokens, 160 - 6 * 16);
        assert_eq!(r.first.decode_blocks, 10 - 6);
        let fb = r.fallback.expect("worker 1 is free");
        assert_eq!((fb.prefill_tokens, fb.decode_blocks), (160, 10));
        let report = r
            .report
            .expect("a partial holder leaves something to bridge");
        assert_eq!((report.model.as_str(), report.slot), ("m", 1));
        assert_eq!(report.kind, crate::approx::ChunkKind::Tokens);
    }

    #[test]
    fn a_rank_holding_the_whole_prompt_needs_no_report() {
        let s = indexed();
        let tokens: Vec<u32> = (0..64).collect();
        let store = index(&tokens, 4, CacheScope::default());
        let req = parse(Endpoint::Completions, tokens_body("m", &tokens).as_bytes()).unwrap();
        let mut read = |k: &str| store.get(k).cloned();
        let r = route(plan(
            &s,
            &req,
            DEFAULT_TENANT,
            &Ask::default(),
            &mut read,
            &[],
        ));
        assert_eq!(
            (r.first.choice.worker.id, r.first.choice.overlap.device),
            (2, 4)
        );
        assert_eq!(r.report, None);
    }

    #[test]
    fn an_adapter_reads_its_own_chain_and_books_under_its_base_model() {
        let s = indexed();
        let tokens: Vec<u32> = (0..64).collect();
        let adapter = CacheScope {
            lora_name: Some("m-lora"),
            cache_salt: None,
        };
        let store = index(&tokens, 4, adapter);
        let mut read = |k: &str| store.get(k).cloned();
        let req = parse(
            Endpoint::Completions,
            tokens_body("m-lora", &tokens).as_bytes(),
        )
        .unwrap();
        let r = route(plan(
            &s,
            &req,
            DEFAULT_TENANT,
            &Ask::default(),
            &mut read,
            &[],
        ));
        assert_eq!(
            (r.model.name.as_str(), r.first.choice.overlap.device),
            ("m", 4)
        );
        let base = parse(Endpoint::Completions, tokens_body("m", &tokens).as_bytes()).unwrap();
        let r = route(plan(
            &s,
            &base,
            DEFAULT_TENANT,
            &Ask::default(),
            &mut read,
            &[],
        ));
        assert_eq!(
            r.first.choice.overlap.device, 0,
            "the base model never matches adapter blocks"
        );
    }

    #[test]
    fn text_prompts_report_their_chunks() {
        let s = snapshot();
        let long = "a fairly long system prompt, repeated. ".repeat(20);
        let r = route(run(&s, &format!(r#"{{"model":"m","prompt":"{long}"}}"#)));
        let report = r.report.expect("text is reported");
        assert_eq!(report.kind, crate::approx::ChunkKind::Text);
        assert!(!report.hashes.is_empty());
        assert_eq!(
            route(run(&s, &text("m"))).report,
            None,
            "too short for one chunk"
        );
    }
}
