//! `POST /select` and `/select_and_reserve`: Dynamo's selection API,
//! answered by the same `kvgate_core::plan` the filter runs in Envoy, over
//! the index shards this sidecar publishes and the fleet with its load as
//! the ledger holds it now (see `ledger_view`), and rendered from the same
//! `kvgate_core::dispatch` (its client sends both legs it names). [`route`]
//! is the same path for a front door that routes an OpenAI body itself.

use super::Selection;
use super::ledger_view::{fresh_model, ledger_refusal, valid_reservation_id, within_bound};
use super::views::{
    self, LegView, OverlapView, PlacementView, Prompt, SelectRequest, SelectionView, SplitView,
};
use super::{error, json_response};
use crate::fleet::RankId;
use crate::metrics::{Metrics, SelectionMetrics};
use crate::sources::bookings::Load;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kvgate_core::ModelState;
use kvgate_core::dispatch::{Dispatch, Door, Refusal, Target, WholeWhy, dispatch};
use kvgate_core::hash::sequence_hashes;
use kvgate_core::header;
use kvgate_core::plan::overlap::Cached;
use kvgate_core::plan::request::{Parsed, estimate_tokens};
use kvgate_core::plan::{
    self, Ask, Choice, Gathered, Placement, Plan, Prefill, Rejection, ShardSource,
};
use kvgate_core::reply::{Reason, Reply};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Spreads ties between selections, as each filter VM's counter does.
static TIE_BREAK: AtomicU64 = AtomicU64::new(0);

/// `POST /select`: where the prompt would go, booking nothing.
pub(super) async fn select(
    State(sc): State<Arc<Selection>>,
    State(metrics): State<Arc<Metrics>>,
    body: Bytes,
) -> Response {
    choose(&sc, &metrics.selection, &body, false)
}

/// `POST /select_and_reserve`: the selection, booked in the same step, so
/// that concurrent calls see each other's load.
pub(super) async fn select_and_reserve(
    State(sc): State<Arc<Selection>>,
    State(metrics): State<Arc<Metrics>>,
    body: Bytes,
) -> Response {
    choose(&sc, &metrics.selection, &body, true)
}

fn choose(sc: &Selection, metrics: &SelectionMetrics, body: &[u8], reserve: bool) -> Response {
    let mut req: SelectRequest = match views::parse(body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid selection: {e}")),
    };
    // Counted per request that set them, whatever it is answered: a
    // client relying on one is visible before it looks at an answer.
    for field in req.not_applied() {
        metrics.fields_ignored.with_label_values(&[field]).inc();
    }
    if reserve {
        let id = req.reservation_id.get_or_insert_with(new_reservation_id);
        if let Err(m) = valid_reservation_id(id) {
            return error(StatusCode::BAD_REQUEST, m);
        }
    } else {
        // A selection books nothing: an id would suggest it did.
        req.reservation_id = None;
    }
    let snap = sc.store.snapshot();
    if let Err(m) = within_bound(
        sc,
        &snap,
        &req.model_name,
        req.prompt.isl_tokens,
        req.expected_output_tokens,
    ) {
        return error(StatusCode::BAD_REQUEST, m);
    }
    let tie = TIE_BREAK.fetch_add(1, Ordering::Relaxed);
    let log = &sc.shards;
    // Held from the view to the booking when reserving: two concurrent
    // reservations must not both see the same idle rank.
    let mut ledger = sc.ledger.lock();
    let Some(mut model) = fresh_model(&snap, &req.model_name, &ledger) else {
        return refused(&req, Refused::Plan(Rejection::UnknownModel));
    };
    restrict(&mut model, &req);
    if !reserve {
        drop(ledger);
        return match selection(&model, &req, tie, &mut |k: &str| log.read(k)) {
            Ok(s) => json_response(StatusCode::OK, &s.view),
            Err(r) => refused(&req, r),
        };
    }
    let mut s = match selection(&model, &req, tie, &mut |k: &str| log.read(k)) {
        Ok(s) => s,
        Err(r) => return refused(&req, r),
    };
    let id = s.view.reservation_id.clone().unwrap_or_default();
    let output = output_blocks(req.expected_output_tokens, s.view.block_size);
    let load = Load {
        decode_blocks: s.load.decode_blocks + output,
        ..s.load
    };
    // The prefill leg is booked on its own worker under its own id, so
    // that the client frees it when the leg answers.
    let prefill = match s.prefill.take() {
        Some((rank, load)) => {
            let leg_id = prefill_reservation_id(&id);
            if let Err(m) = valid_reservation_id(&leg_id) {
                return error(StatusCode::BAD_REQUEST, m);
            }
            Some((leg_id, rank, load))
        }
        None => None,
    };
    if let Err(e) = sc
        .reservations
        .reserve(&mut ledger, &id, &s.rank, &req.tenant_id, load)
    {
        return ledger_refusal(e);
    }
    if let Some(split) = s.view.disaggregation.as_mut() {
        split.decode.decode_blocks += output;
        split.decode.reservation_id = Some(id.clone());
    }
    if let Some((leg_id, rank, load)) = prefill {
        if let Err(e) = sc
            .reservations
            .reserve(&mut ledger, &leg_id, &rank, &req.tenant_id, load)
        {
            // Nothing of a refused call stays booked.
            drop(ledger);
            let _ = sc.reservations.free(&id);
            return ledger_refusal(e);
        }
        if let Some(leg) = s
            .view
            .disaggregation
            .as_mut()
            .and_then(|d| d.prefill.as_mut())
        {
            leg.reservation_id = Some(leg_id);
        }
    }
    json_response(StatusCode::OK, &s.view)
}

/// The reservation of a disaggregated selection's prefill leg.
fn prefill_reservation_id(id: &str) -> String {
    format!("{id}.prefill")
}

/// Leaves only the candidates the request allows: Dynamo's
/// `allowed_worker_ids` and `pinned_worker`.
fn restrict(model: &mut ModelState, req: &SelectRequest) {
    if let Some(ids) = &req.allowed_worker_ids {
        model.workers.retain(|w| ids.contains(&w.id));
    }
    if let Some(p) = req.pinned_worker {
        model.workers.retain(|w| w.id == p.worker_id);
        for w in &mut model.workers {
            w.ranks.retain(|r| r.rank == p.dp_rank);
        }
        model.workers.retain(|w| !w.ranks.is_empty());
    }
}

/// Blocks an expected output adds to a request's decode load.
pub(super) fn output_blocks(expected_output_tokens: Option<u64>, block_size: u32) -> u64 {
    expected_output_tokens.map_or(0, |t| t.div_ceil(u64::from(block_size.max(1))))
}

/// A reservation id for a client that gave none: random, so that ids
/// from several sidecars do not collide.
pub(super) fn new_reservation_id() -> String {
    format!("kvgate-{:032x}", rand::random::<u128>())
}

fn refused(req: &SelectRequest, r: Refused) -> Response {
    let status = r.status();
    match r {
        Refused::BadRequest(m) => error(status, m),
        Refused::Plan(Rejection::UnknownModel) => error(
            status,
            format!("model {:?} is not served here", req.model_name),
        ),
        Refused::Plan(Rejection::NoWorkers) => error(
            status,
            format!(
                "model {:?} has no schedulable worker for tenant {:?}",
                req.model_name, req.tenant_id
            ),
        ),
        Refused::Plan(
            rejection @ (Rejection::AllBusy { retry_after_s }
            | Rejection::Thermal { retry_after_s }
            | Rejection::SloUnattainable { retry_after_s }),
        ) => {
            let (message, reason) = match rejection {
                Rejection::Thermal { .. } => (
                    "all workers are busy or at their thermal cap",
                    Some(Reason::Thermal),
                ),
                Rejection::SloUnattainable { .. } => (
                    "no worker is predicted to meet the request's latency targets",
                    Some(Reason::SloUnattainable),
                ),
                _ => ("all workers are busy", None),
            };
            let mut r = error(status, message);
            if let Some(reason) = reason {
                r.headers_mut()
                    .insert(header::REASON, HeaderValue::from_static(reason.as_str()));
            }
            if retry_after_s > 0
                && let Ok(v) = retry_after_s.to_string().parse()
            {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            r.into_response()
        }
        Refused::Unservable(reply) => {
            // The filter's reply, in this API's error shape: its message
            // and the reason header every door sends.
            let message = serde_json::from_str::<serde_json::Value>(&reply.body)
                .ok()
                .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                .unwrap_or_else(|| reply.reason.as_str().to_string());
            let mut r = error(status, message);
            r.headers_mut().insert(
                header::REASON,
                HeaderValue::from_static(reply.reason.as_str()),
            );
            if let Some(v) = reply.retry_after_s.and_then(|s| s.to_string().parse().ok()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            r
        }
    }
}

/// Why a selection has no worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The prompt was given wrongly.
    BadRequest(String),
    /// The plan found no worker.
    Plan(Rejection),
    /// The model's settings cannot serve the placement (an SGLang request
    /// with no prefill leg, on a worker that is not `both`): the reply the
    /// filter sends for it.
    Unservable(Reply),
}

impl Refused {
    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Refused::BadRequest(_) => StatusCode::BAD_REQUEST,
            Refused::Plan(Rejection::UnknownModel) => StatusCode::NOT_FOUND,
            Refused::Plan(_) => StatusCode::SERVICE_UNAVAILABLE,
            Refused::Unservable(r) => {
                StatusCode::from_u16(r.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
            }
        }
    }
}

/// A placement, described for the client and for the ledger.
#[derive(Debug, Clone)]
struct Selected {
    view: SelectionView,
    /// The worker the client sends its request to, and what it books.
    rank: RankId,
    load: Load,
    /// A prefill leg: its rank and the load it books.
    prefill: Option<(RankId, Load)>,
}

/// `/select`'s answer over `model` as it stands (its ranks' load already
/// the ledger's), without HTTP or the ledger: the handler's own path, for
/// a caller that holds a snapshot of its own (the conformance test, which
/// gives the filter the same one).
pub fn select_in(
    mut model: ModelState,
    req: &SelectRequest,
    tie_break: u64,
    shards: &mut impl ShardSource,
) -> Result<SelectionView, Refused> {
    restrict(&mut model, req);
    selection(&model, req, tie_break, shards).map(|s| s.view)
}

/// Places `req` the way the filter would and renders what
/// `kvgate_core::dispatch` makes of it for a client that sends both legs.
fn selection(
    model: &ModelState,
    req: &SelectRequest,
    tie_break: u64,
    shards: &mut impl ShardSource,
) -> Result<Selected, Refused> {
    let parsed = prompt(&req.model_name, &req.prompt, model).map_err(Refused::BadRequest)?;
    // A selection is not a routing decision: nothing to report.
    let scale = kvgate_core::admit::thresholds_scale(
        kvgate_core::admit::DEFAULT_RESERVE,
        req.critical(),
        None,
    );
    let ask = Ask {
        tie_break,
        thresholds_scale: scale,
        ..Ask::default()
    };
    let (plan, cached) = place_in(model, &parsed, &req.tenant_id, &ask, shards, false);
    let route = match &plan {
        Plan::Route(r) => r,
        Plan::Reject(r) => return Err(Refused::Plan(*r)),
    };
    // The client's body is its own, unseen here: no body rule applies.
    let (decode, prefill, why, pull) = match dispatch(&plan, Door::CLIENT_SENDS, None) {
        Dispatch::Whole(w) => (w.target, None, w.why, w.pull),
        Dispatch::Split(s) => (s.decode, Some(s.prefill), None, s.pull),
        Dispatch::Refuse(Refusal::Plan(r)) => return Err(Refused::Plan(r)),
        Dispatch::Refuse(Refusal::Unservable(reply)) => return Err(Refused::Unservable(reply)),
    };
    // Both legs are `route`'s placements: the decode worker its first,
    // the prefill worker its remote leg's first.
    let first = &route.first;
    let prefill_rank = match &route.prefill {
        Some(Prefill::Remote(leg)) => Some(rank_id(model, &leg.first)),
        _ => None,
    };
    let leg = |t: &Target| LegView {
        worker_id: t.worker_id,
        dp_rank: t.rank,
        endpoint: t.endpoint.clone(),
        effective_prefill_tokens: t.prefill_tokens,
        decode_blocks: t.decode_blocks,
        reservation_id: None,
    };
    let disaggregation = match (&prefill, why) {
        (Some(p), _) => Some(SplitView {
            decode: leg(&decode),
            prefill: Some(leg(p)),
            local_prefill: false,
            local_reason: None,
        }),
        // A model with no worker of a role up is not split now: answered
        // as a model served whole, as `/v1/state` shows it.
        (None, Some(why)) if why != WholeWhy::NotSplit => Some(SplitView {
            decode: leg(&decode),
            prefill: None,
            local_prefill: true,
            local_reason: Some(why.as_str().to_string()),
        }),
        _ => None,
    };
    let view = SelectionView {
        selection_id: req.selection_id.clone(),
        reservation_id: req.reservation_id.clone(),
        model_name: req.model_name.clone(),
        tenant_id: req.tenant_id.clone(),
        worker_id: decode.worker_id,
        dp_rank: decode.rank,
        endpoint: decode.endpoint.clone(),
        block_size: first.choice.worker.block_size,
        // What the events say the ranks hold; the cost also counted
        // prefixes routed moments ago, which no engine reported yet.
        overlap: reported(&first.choice, |slot| cached.reported(slot)),
        effective_prefill_tokens: decode.prefill_tokens,
        disaggregation,
        placement: pull.map(|p| PlacementView {
            kind: p.kind.as_str().to_string(),
            blocks: p.blocks,
            transfer_us: (p.transfer_ms * 1e3).round().clamp(0.0, u64::MAX as f64) as u64,
        }),
        class: if req.critical() {
            "critical"
        } else {
            "standard"
        }
        .to_string(),
        not_applied: req.not_applied().into_iter().map(str::to_string).collect(),
    };
    Ok(Selected {
        rank: rank_id(model, first),
        load: Load::from(&decode),
        prefill: prefill
            .as_ref()
            .zip(prefill_rank)
            .map(|(p, r)| (r, Load::from(p))),
        view,
    })
}

/// Places `parsed` in `model` as the filter would: the overlap from
/// `shards`, then `kvgate_core::plan`. With `report`, the route keeps the
/// prefix record a front door that routes sends to the routed-prefix
/// index, as the filter does; a selection keeps none.
fn place_in<'m>(
    model: &'m ModelState,
    parsed: &Parsed,
    tenant: &str,
    ask: &Ask,
    shards: &mut impl ShardSource,
    report: bool,
) -> (Plan<'m>, Cached) {
    let mut gathered = Gathered::new(model, parsed, tenant, shards);
    if !report {
        gathered = gathered.without_report();
    }
    let plan = gathered.place(parsed, tenant, ask, &[]);
    (plan, gathered.cached)
}

/// The ledger's name for the rank a placement chose.
fn rank_id(model: &ModelState, p: &Placement<'_>) -> RankId {
    let worker = p.choice.worker;
    RankId {
        model: model.name.clone(),
        tenant: worker.tenant.clone(),
        block_size: worker.block_size,
        worker_id: worker.id,
        dp_rank: p.choice.rank.rank,
    }
}

fn reported(c: &Choice<'_>, of: impl Fn(u16) -> plan::Overlap) -> OverlapView {
    let bs = u64::from(c.worker.block_size);
    let tokens = |blocks: u32| u64::from(blocks) * bs;
    let o = of(c.rank.slot);
    OverlapView {
        longest_matched: tokens(o.device.max(o.host).max(o.disk)),
        gpu: tokens(o.device),
        dp: c
            .worker
            .ranks
            .iter()
            .map(|r| (r.rank.to_string(), tokens(of(r.slot).device)))
            .collect(),
        cpu: tokens(o.host),
        disk: tokens(o.disk),
    }
}

/// The request's prompt, as the plan takes it.
pub(super) fn prompt(model_name: &str, req: &Prompt, model: &ModelState) -> Result<Parsed, String> {
    let given = [
        req.sequence_hashes.is_some() || req.block_hashes.is_some(),
        req.token_ids.is_some(),
        req.text.is_some(),
    ];
    if given.iter().filter(|g| **g).count() != 1 {
        return Err(
            "give the prompt one way: sequence_hashes (or block_hashes) with isl_tokens, token_ids, or text"
                .into(),
        );
    }
    let mut p = Parsed {
        model: model_name.to_string(),
        tokens: None,
        text: None,
        rendered: false,
        chat: None,
        sequence_hashes: None,
        isl_tokens: 0,
        stream: false,
        max_tokens: None,
        cache_salt: req.cache_salt.clone().filter(|s| !s.is_empty()),
    };
    if let Some(hashes) = req
        .sequence_hashes
        .clone()
        .or_else(|| req.block_hashes.as_deref().map(sequence_hashes))
    {
        if req.cache_salt.is_some() {
            return Err("cache_salt applies to token_ids and text; hashes carry their own".into());
        }
        let Some(isl) = req.isl_tokens.filter(|n| *n > 0) else {
            return Err("isl_tokens (above 0) is required with hashes".into());
        };
        let block = model.workers.first().map_or(0, |w| u64::from(w.block_size));
        let hashed = hashes.len() as u64 * block;
        if hashed > isl {
            return Err(format!(
                "{} hashed blocks of {block} tokens are more than isl_tokens {isl}",
                hashes.len()
            ));
        }
        p.sequence_hashes = Some(hashes);
        p.isl_tokens = isl;
    } else if let Some(tokens) = &req.token_ids {
        if tokens.is_empty() {
            return Err("token_ids must not be empty".into());
        }
        p.isl_tokens = req.isl_tokens.unwrap_or(tokens.len() as u64);
        p.tokens = Some(tokens.clone());
    } else if let Some(text) = &req.text {
        if text.is_empty() {
            return Err("text must not be empty".into());
        }
        p.isl_tokens = req.isl_tokens.unwrap_or_else(|| estimate_tokens(text));
        p.text = Some(text.clone());
    }
    Ok(p)
}

pub mod route;
#[cfg(test)]
mod tests;
