//! The first two steps of a request's decision: prepare (the view of the
//! fleet, the VM's own bookings settled into it, the prompt rendered) and
//! decide (the prompt's overlap gathered once, then placed as often as
//! the request needs). What they decide is owned, not borrowed from the
//! snapshot: it can be applied at once or once a callout has answered.

use super::super::RouterState;
use super::super::retry as router_retry;
use super::stopwatch::{Phase, Stopwatch};
use crate::host;
use crate::manifest::Manifest;
use crate::metrics::inc;
use crate::reply::Reply;
use kvgate_core::approx::Routed;
use kvgate_core::plan::request::Parsed;
use kvgate_core::plan::{self, Ask, Placement, Plan, Prefill, Rejection, retry};
use kvgate_core::state::{OnPrefillFailure, Protocol, Role};
use kvgate_core::text::skeleton::Path;

/// What the router does with a request.
#[derive(Debug)]
pub(super) enum Decision {
    Route(Routing),
    /// A disaggregated request whose prompt is prefilled on another worker
    /// first ([`Split`]).
    Split(Box<Split>),
    Reply(Reply),
}

/// A routed request: where it goes, and what it books and reports there.
#[derive(Debug)]
pub(super) struct Routing {
    /// The model the fleet knows it by: bookings and reports, a retry's
    /// included, go under the base model.
    pub model: String,
    pub first: Target,
    /// Where Envoy retries when the first worker refuses the connection.
    pub fallback: Option<Target>,
    /// The worker has several ranks: the rank header names the target's.
    pub set_rank: bool,
    /// The prompt's prefix chunks for the routed-prefix index.
    pub report: Option<Routed>,
    pub isl_tokens: u32,
    pub output_tokens: u32,
    /// The model has disaggregation settings (split now or not): the
    /// body the worker gets carries no transfer parameters but kvgate's,
    /// and the request id is kvgate's.
    pub disaggregated: bool,
}

/// A disaggregated request: the decode leg is the client's request, sent
/// on once the prefill leg has answered (vLLM's NIXL), or at once beside
/// it (SGLang).
#[derive(Debug)]
pub(super) struct Split {
    pub decode: Routing,
    pub prefill: PrefillPlan,
    pub protocol: Protocol,
}

/// Where and how a disaggregated request's prompt is prefilled.
#[derive(Debug, Clone)]
pub(super) struct PrefillPlan {
    pub first: Target,
    /// Tried once when `first` fails, within the same time budget.
    pub runner_up: Option<Target>,
    /// What the decode worker computes if no prefill leg succeeds and
    /// the model says to prefill there.
    pub local_prefill_tokens: u64,
    pub on_failure: OnPrefillFailure,
    /// One budget for every try of the leg.
    pub timeout_ms: u64,
}

/// A worker and rank, and the load a request books there.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub endpoint: String,
    pub worker_id: u64,
    pub rank: u32,
    pub slot: u16,
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// The worker has several ranks: the rank header names the target's.
    pub names_rank: bool,
    /// The rank's place among the worker's ranks, and their number: an
    /// SGLang worker serves a request on `bootstrap_room % dp_size`.
    pub dp_index: u32,
    pub dp_size: u32,
    pub role: Role,
    /// Its SGLang bootstrap server's port, on the endpoint's host.
    pub bootstrap_port: u16,
}

impl Target {
    fn new(p: &Placement<'_>) -> Target {
        let w = p.choice.worker;
        Target {
            endpoint: p.choice.worker.endpoint.clone(),
            worker_id: p.choice.worker.id,
            rank: p.choice.rank.rank,
            slot: p.choice.rank.slot,
            prefill_tokens: p.prefill_tokens,
            decode_blocks: p.decode_blocks,
            names_rank: p.names_rank(),
            dp_index: w
                .ranks
                .iter()
                .position(|r| std::ptr::eq(r, p.choice.rank))
                .and_then(|i| u32::try_from(i).ok())
                .unwrap_or(0),
            dp_size: u32::try_from(w.ranks.len()).unwrap_or(u32::MAX),
            role: w.role,
            bootstrap_port: w.bootstrap_port(),
        }
    }

    /// The served-by header's value.
    pub fn served_by(&self) -> String {
        format!("worker_id={}; dp_rank={}", self.worker_id, self.rank)
    }
}

/// Brings the VM's view up to the manifest's snapshot version (the
/// root's tick usually has), and renders a text prompt (parsed from
/// `body`) with its model's template. `None`: no snapshot to decide from.
pub(super) fn prepare(
    st: &mut RouterState,
    req: &mut Parsed,
    body: &[u8],
    manifest: &Manifest,
) -> Option<()> {
    st.refresh_view(manifest);
    let snap = st.view.snapshot.as_ref()?;
    if req.tokens.is_none()
        && let Some(m) = snap.model(&req.model)
        && m.prompt_template != 0
    {
        let rendered = st
            .templates
            .get(&m.name, m.prompt_template)
            .map(|r| req.render(r, body, host::now_ms() / 1000));
        match rendered {
            Some(Ok(path)) => {
                inc(st.metrics.rendered);
                if path == Some(Path::Skeleton) {
                    inc(st.metrics.assembled);
                }
            }
            _ => inc(st.metrics.render_errors),
        }
    }
    Some(())
}

/// Gathers the prompt's overlap from the index shards once, and places
/// it: again, with the retry headroom, when every worker is busy and the
/// request holds a due ticket. `body` names the ticket, and is what a
/// disaggregated request's legs are made from; `manifest` is what the
/// request read at its headers. Call after [`prepare`] found a snapshot.
pub(super) fn decide(
    st: &mut RouterState,
    req: &Parsed,
    tenant: &str,
    body: &[u8],
    manifest: &Manifest,
    clock: &mut Stopwatch,
) -> Decision {
    st.tie_break = st.tie_break.wrapping_add(1);
    let mut ask = Ask {
        tie_break: st.tie_break,
        retry_headroom: None,
    };
    let Some(snap) = st.view.snapshot.as_ref() else {
        return Decision::Reply(Reply::stale());
    };
    let mut shards = st.shards.source(manifest, host::get_shared);
    let gathered = plan::gather(snap, req, tenant, &mut shards);
    clock.mark(Phase::Gathered);
    let place = |ask: &Ask| match &gathered {
        Ok(g) => g.place(req, tenant, ask, &[]),
        Err(r) => Plan::Reject(*r),
    };
    let mut planned = place(&ask);
    // Every worker is busy: a retry that holds its ticket may go ahead of
    // new work; anything else is shed with a place in the queue.
    let mut ticket = None;
    if matches!(planned, Plan::Reject(Rejection::AllBusy { .. }))
        && st.config.retry_headroom_pct > 0
    {
        let hash = retry::ticket_hash(tenant, body);
        if router_retry::redeem(hash, host::now_ms()) {
            ask.retry_headroom = Some(f64::from(st.config.retry_headroom_pct) / 100.0);
            planned = place(&ask);
            if matches!(planned, Plan::Route(_)) {
                inc(st.metrics.retry_admitted);
            }
        }
        ticket = Some(hash);
    }
    clock.mark(Phase::Selected);
    match planned {
        Plan::Route(route) => {
            let routing = Routing {
                model: route.model.name.clone(),
                first: Target::new(&route.first),
                fallback: route.fallback.as_ref().map(Target::new),
                set_rank: route.set_rank,
                report: route.report,
                isl_tokens: u32::try_from(req.isl_tokens).unwrap_or(u32::MAX),
                output_tokens: req
                    .max_tokens
                    .map_or(0, |m| u32::try_from(m).unwrap_or(u32::MAX)),
                // The model's settings decide, not the live split: with
                // its prefill pool down a disaggregated model is served
                // whole, and a client's transfer fields must not ride on.
                disaggregated: route.model.disaggregation.is_some(),
            };
            let settings = route.model.disaggregation;
            match (route.prefill, settings) {
                (Some(Prefill::Remote(leg)), Some(d)) => {
                    inc(st.metrics.prefill_remote);
                    Decision::Split(Box::new(Split {
                        decode: routing,
                        prefill: PrefillPlan {
                            first: Target::new(&leg.first),
                            runner_up: leg.runner_up.as_ref().map(Target::new),
                            local_prefill_tokens: leg.local_prefill_tokens,
                            on_failure: d.on_prefill_failure,
                            timeout_ms: d.prefill_timeout_ms,
                        },
                        protocol: d.protocol,
                    }))
                }
                // An SGLang worker of either role serves only a request
                // with the bootstrap room that a split provides: a decode
                // worker's engine asserts without one, and a prefill
                // worker has no decode side to hand the blocks to. Only a
                // `both` worker may take it whole. This holds whether the
                // plan chose not to split (`Local`) or could not (`None`:
                // no worker of one of the roles is up).
                (prefill, Some(d)) if d.protocol == Protocol::Sglang => {
                    let why = match prefill {
                        Some(Prefill::Local(why)) => why.as_str(),
                        _ => "no worker of the other role is up",
                    };
                    if routing.first.role != Role::Both {
                        inc(st.metrics.prefill_failed);
                        Decision::Reply(Reply::prefill_failed(&format!(
                            "no prefill worker is free for an SGLang {} worker ({why})",
                            routing.first.role.as_str()
                        )))
                    } else {
                        inc(st.metrics.prefill_local);
                        let mut routing = routing;
                        // Nor may Envoy's retry take it to one.
                        if routing
                            .fallback
                            .as_ref()
                            .is_some_and(|f| f.role != Role::Both)
                        {
                            routing.fallback = None;
                        }
                        Decision::Route(routing)
                    }
                }
                (Some(_), _) => {
                    inc(st.metrics.prefill_local);
                    Decision::Route(routing)
                }
                (None, _) => Decision::Route(routing),
            }
        }
        Plan::Reject(r) => Decision::Reply(match (r, ticket) {
            (Rejection::AllBusy { retry_after_s }, Some(hash)) => {
                router_retry::shed(&st.config, snap, &req.model, hash, retry_after_s)
            }
            (r, _) => Reply::rejected(r, &req.model, st.config.retry_after_s),
        }),
    }
}
