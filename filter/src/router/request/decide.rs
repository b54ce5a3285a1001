//! The first two steps of a request's decision: prepare (the view of the
//! fleet, the VM's own bookings settled into it, the prompt rendered) and
//! decide (the prompt's overlap gathered once, placed as often as the
//! request needs, and dispatched by `kvgate_core::dispatch`, which owns
//! every rule after placement). What they decide is owned, not borrowed
//! from the snapshot: it can be applied at once or once a callout has
//! answered.

use super::super::RouterState;
use super::super::gates::Gate;
use super::super::retry as router_retry;
use super::stopwatch::{Phase, Stopwatch};
use crate::config::Config;
use crate::host::Host;
use crate::manifest::Manifest;
use crate::reply::{Reason, Reply};
use kvgate_core::approx::Routed;
use kvgate_core::dispatch::{self, Body, Dispatch, Door, Refusal, Split, Whole, WholeWhy};
use kvgate_core::plan::request::Parsed;
use kvgate_core::plan::{self, Ask, Plan, Rejection, retry};
use kvgate_core::text::skeleton::Path;

/// What the router does with a request.
#[derive(Debug)]
pub(super) enum Decision {
    Whole(Box<Whole>, Facts),
    /// A disaggregated request whose prompt is prefilled on another worker
    /// first.
    Split(Box<Split>, Facts),
    Reply(Reply),
    /// No worker may take it now, and its class may be held: the hint a
    /// shed would carry.
    Full(u32),
}

/// What a request is decided from.
#[derive(Clone, Copy)]
pub(super) struct Inputs<'a> {
    pub req: &'a Parsed,
    /// From the configured tenant header.
    pub tenant: &'a str,
    /// Whose share of the load it counts against (admission's account).
    pub account: &'a str,
    pub body: &'a [u8],
    /// What the request read at its headers.
    pub manifest: &'a Manifest,
    pub admit: &'a Admit,
}

/// What admission asks of a request's decision.
#[derive(Debug, Clone, Copy)]
pub(super) struct Admit {
    /// The thresholds its class is placed against (`None`: the flags).
    pub scale: Option<f64>,
    /// Those of a retry holding its ticket; `None`: retries off.
    pub retry_scale: Option<f64>,
    /// Its class may be held rather than shed.
    pub may_hold: bool,
    /// The class, for its latency targets; `None`: no admission, placed
    /// by cost alone.
    pub class: Option<usize>,
}

impl Admit {
    /// For a request of `class` (an index into the admission classes;
    /// without admission, today's rules).
    pub fn of(c: &Config, class: usize) -> Admit {
        let headroom = (c.retry_headroom_pct > 0).then(|| f64::from(c.retry_headroom_pct) / 100.0);
        match &c.admission {
            None => Admit {
                scale: None,
                retry_scale: headroom.map(|h| 1.0 + h),
                may_hold: false,
                class: None,
            },
            Some(a) => Admit {
                scale: a.thresholds_scale(class, None),
                retry_scale: headroom.map(|h| a.thresholds_scale(class, Some(h)).unwrap_or(1.0)),
                may_hold: a.classes.get(class).is_some_and(|k| k.hold_ms > 0),
                class: Some(class),
            },
        }
    }
}

/// What a routed request carries beside its dispatch: its report and
/// what its timing needs.
#[derive(Debug)]
pub(super) struct Facts {
    /// The prompt's prefix chunks for the routed-prefix index.
    pub report: Option<Routed>,
    pub isl_tokens: u32,
    pub output_tokens: u32,
    /// The slot its decode worker must give it, where the model bounds a
    /// decode worker's requests.
    pub gate: Option<Gate>,
}

/// Brings the VM's view up to the manifest's snapshot version (the
/// root's tick usually has), and renders a text prompt (parsed from
/// `body`) with its model's template. `None`: no snapshot to decide from.
pub(super) fn prepare(
    h: &impl Host,
    st: &mut RouterState,
    req: &mut Parsed,
    body: &[u8],
    manifest: &Manifest,
) -> Option<()> {
    st.refresh_view(h, manifest);
    let snap = st.view.snapshot.as_ref()?;
    if req.tokens.is_none()
        && let Some(m) = snap.model(&req.model)
        && m.prompt_template != 0
    {
        let rendered = st
            .templates
            .get(h, &m.name, m.prompt_template)
            .map(|r| req.render(r, body, h.now_ms() / 1000));
        match rendered {
            Some(Ok(path)) => {
                h.count(st.metrics.rendered);
                if path == Some(Path::Skeleton) {
                    h.count(st.metrics.assembled);
                }
            }
            _ => h.count(st.metrics.render_errors),
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
    h: &impl Host,
    st: &mut RouterState,
    r: &Inputs<'_>,
    clock: &mut Stopwatch,
) -> Decision {
    let Inputs {
        req,
        tenant,
        account,
        body,
        manifest,
        admit,
    } = *r;
    st.tie_break = st.tie_break.wrapping_add(1);
    let mut ask = Ask {
        tie_break: st.tie_break,
        thresholds_scale: admit.scale,
        slo: None,
        one_upstream: false,
    };
    let Some(snap) = st.view.snapshot.as_ref() else {
        return Decision::Reply(Reply::stale());
    };
    let shed_status = st
        .config
        .admission
        .as_ref()
        .map_or(503, |a| a.shed_status(&req.model));
    let mut retry_scale = admit.retry_scale;
    if let (Some(a), Some(class), Some(m)) =
        (&st.config.admission, admit.class, snap.model(&req.model))
    {
        ask.slo = a.slo(class, m.slo);
        // A tenant over its share of the model's booked load is kept out
        // of the reserve band as well: near saturation the room left goes
        // to the tenants under theirs.
        if st.over_share(&m.name, account) {
            let narrow = |s: Option<f64>| Some(s.unwrap_or(1.0) * a.unreserved());
            ask.thresholds_scale = narrow(ask.thresholds_scale);
            retry_scale = retry_scale.and_then(|r| narrow(Some(r)));
        }
    }
    // What its class and share leave it, before any retry's headroom.
    let narrowed = ask.thresholds_scale;
    let mut shards = st.shards.source(manifest, |k: &str| h.get_shared(k));
    let gathered = plan::gather(snap, req, tenant, &mut shards);
    clock.mark(h, Phase::Gathered);
    let place = |ask: &Ask| match &gathered {
        Ok(g) => g.place(req, tenant, ask, &[]),
        Err(r) => Plan::Reject(*r),
    };
    let mut planned = place(&ask);
    // Every worker is busy: a retry that holds its ticket may go ahead of
    // new work; anything else is shed with a place in the queue, or held.
    let mut ticket = None;
    if matches!(planned, Plan::Reject(Rejection::AllBusy { .. }))
        && let Some(scale) = retry_scale
    {
        let hash = retry::ticket_hash(tenant, body);
        if router_retry::redeem(h, hash, h.now_ms()) {
            ask.thresholds_scale = Some(scale);
            planned = place(&ask);
            if matches!(planned, Plan::Route(_)) {
                h.count(st.metrics.retry_admitted);
            }
        }
        ticket = Some(hash);
    }
    clock.mark(h, Phase::Selected);
    let client = Body {
        len: body.len(),
        max: st.config.max_body_bytes,
        isl_tokens: req.isl_tokens,
    };
    let dispatched = dispatch::dispatch(&planned, Door::CALLOUT, Some(client));
    // A class without the critical reserve (or a tenant over its share)
    // refused where one with it would have been placed: shed (or held)
    // for priority.
    let for_priority = narrowed.is_some_and(|s| s < 1.0)
        && matches!(planned, Plan::Reject(Rejection::AllBusy { .. }))
        && matches!(
            place(&Ask {
                thresholds_scale: None,
                ..ask
            }),
            Plan::Route(_)
        );
    let gate = gate_of(snap, &dispatched, narrowed);
    // The plan is spent: its report moves on with the request.
    let facts = Facts {
        report: match planned {
            Plan::Route(r) => r.report,
            Plan::Reject(_) => None,
        },
        isl_tokens: u32::try_from(req.isl_tokens).unwrap_or(u32::MAX),
        output_tokens: req
            .max_tokens
            .map_or(0, |m| u32::try_from(m).unwrap_or(u32::MAX)),
        gate,
    };
    let m = &st.metrics;
    match dispatched {
        Dispatch::Whole(w) => {
            match w.why {
                Some(WholeWhy::Local(_)) => h.count(m.prefill_local),
                Some(WholeWhy::NoRoom) => h.count(m.prefill_failed),
                _ => {}
            }
            if let Some(p) = &w.pull {
                m.placed(h, p);
            }
            Decision::Whole(Box::new(w), facts)
        }
        Dispatch::Split(s) => {
            // A pull is counted when its prefill leg answers: as a pull,
            // or as the recompute it became.
            h.count(m.prefill_remote);
            Decision::Split(Box::new(s), facts)
        }
        Dispatch::Refuse(Refusal::Unservable(reply)) => {
            h.count(m.prefill_failed);
            Decision::Reply(reply)
        }
        Dispatch::Refuse(Refusal::Plan(
            Rejection::AllBusy { retry_after_s } | Rejection::Thermal { retry_after_s },
        )) if admit.may_hold => Decision::Full(if retry_after_s > 0 {
            retry_after_s
        } else {
            st.config.retry_after_s
        }),
        Dispatch::Refuse(Refusal::Plan(Rejection::AllBusy { retry_after_s })) if for_priority => {
            let hint = if retry_after_s > 0 {
                retry_after_s
            } else {
                st.config.retry_after_s
            };
            Decision::Reply(Reply::shed(shed_status, Reason::PriorityShed, hint))
        }
        Dispatch::Refuse(Refusal::Plan(r)) => Decision::Reply(
            match (r, ticket) {
                (Rejection::AllBusy { retry_after_s }, Some(hash)) => {
                    router_retry::shed(h, &st.config, snap, &req.model, hash, retry_after_s)
                }
                (r, _) => Reply::rejected(r, &req.model, st.config.retry_after_s),
            }
            .with_shed_status(shed_status),
        ),
    }
}

/// The slot a dispatched request needs on its decode worker: where the
/// model bounds a decode worker's requests, at its class's share.
fn gate_of(snap: &kvgate_core::Snapshot, d: &Dispatch, scale: Option<f64>) -> Option<Gate> {
    let (model, target) = match d {
        Dispatch::Whole(w) => (&w.model, &w.target),
        Dispatch::Split(s) => (&s.model, &s.decode),
        Dispatch::Refuse(_) => return None,
    };
    let bound = snap
        .model(model)?
        .thresholds
        .scaled(scale.unwrap_or(1.0))
        .active_decode_requests?;
    Some(Gate {
        model: model.clone(),
        worker: target.worker_id,
        bound,
    })
}
