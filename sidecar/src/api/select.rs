//! `POST /select` and `/select_and_reserve`: Dynamo's selection API,
//! answered by the same `kvgate_core::plan` the filter runs in Envoy, over
//! the index shards this sidecar publishes and the fleet with its load as
//! the ledger holds it now (see `ledger_view`). [`route`] is the
//! same path for a front door that routes an OpenAI body itself.

use super::Backend;
use super::ledger_view::{fresh_model, ledger_refusal, valid_reservation_id, within_bound};
use super::views::{self, LegView, OverlapView, Prompt, SelectRequest, SelectionView, SplitView};
use super::{error, json_response};
use crate::fleet::RankId;
use crate::sources::bookings::Load;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvgate_core::ModelState;
use kvgate_core::hash::sequence_hashes;
use kvgate_core::header;
use kvgate_core::plan::overlap::Cached;
use kvgate_core::plan::request::{Parsed, estimate_tokens};
use kvgate_core::plan::{
    self, Ask, Choice, Gathered, Placement, Plan, Prefill, Rejection, Route, ShardSource,
};
use kvgate_core::reply::Reason;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Spreads ties between selections, as each filter VM's counter does.
static TIE_BREAK: AtomicU64 = AtomicU64::new(0);

/// `POST /select`: where the prompt would go, booking nothing.
pub(super) async fn select(State(sc): State<Arc<dyn Backend>>, body: Bytes) -> Response {
    choose(&*sc, &body, false)
}

/// `POST /select_and_reserve`: the selection, booked in the same step, so
/// that concurrent calls see each other's load.
pub(super) async fn select_and_reserve(
    State(sc): State<Arc<dyn Backend>>,
    body: Bytes,
) -> Response {
    choose(&*sc, &body, true)
}

fn choose(sc: &dyn Backend, body: &[u8], reserve: bool) -> Response {
    let mut req: SelectRequest = match views::parse(body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid selection: {e}")),
    };
    if reserve {
        let id = req.reservation_id.get_or_insert_with(new_reservation_id);
        if let Err(m) = valid_reservation_id(id) {
            return error(StatusCode::BAD_REQUEST, m);
        }
    } else {
        // A selection books nothing: an id would suggest it did.
        req.reservation_id = None;
    }
    let snap = sc.store().snapshot();
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
    let log = sc.shards();
    // Held from the view to the booking when reserving: two concurrent
    // reservations must not both see the same idle rank.
    let mut ledger = sc.bookings();
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
        slot: s.slot,
        prefill_tokens: s.view.effective_prefill_tokens,
        decode_blocks: s.decode_blocks + output,
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
    if let Err(e) = sc.reserve(&mut ledger, &id, &s.rank, load) {
        return ledger_refusal(e);
    }
    if let Some(split) = s.view.disaggregation.as_mut() {
        split.decode.decode_blocks += output;
        split.decode.reservation_id = Some(id.clone());
    }
    if let Some((leg_id, rank, load)) = prefill {
        if let Err(e) = sc.reserve(&mut ledger, &leg_id, &rank, load) {
            // Nothing of a refused call stays booked.
            drop(ledger);
            let _ = sc.free_reservation(&id);
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
    match r {
        Refused::BadRequest(m) => error(StatusCode::BAD_REQUEST, m),
        Refused::Plan(Rejection::UnknownModel) => error(
            StatusCode::NOT_FOUND,
            format!("model {:?} is not served here", req.model_name),
        ),
        Refused::Plan(Rejection::NoWorkers) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "model {:?} has no schedulable worker for tenant {:?}",
                req.model_name, req.tenant_id
            ),
        ),
        Refused::Plan(
            rejection @ (Rejection::AllBusy { retry_after_s }
            | Rejection::Thermal { retry_after_s }),
        ) => {
            let message = match rejection {
                Rejection::Thermal { .. } => "all workers are busy or at their thermal cap",
                _ => "all workers are busy",
            };
            let mut r = error(StatusCode::SERVICE_UNAVAILABLE, message);
            if let Rejection::Thermal { .. } = rejection {
                r.headers_mut().insert(
                    header::REASON,
                    axum::http::HeaderValue::from_static(Reason::Thermal.as_str()),
                );
            }
            if retry_after_s > 0
                && let Ok(v) = retry_after_s.to_string().parse()
            {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            r.into_response()
        }
    }
}

/// Why a selection has no worker.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refused {
    BadRequest(String),
    Plan(Rejection),
}

/// A placement, described for the client and for the ledger.
#[derive(Debug, Clone)]
struct Selected {
    view: SelectionView,
    slot: u16,
    rank: RankId,
    decode_blocks: u64,
    /// A remote prefill leg: its rank and the load it books.
    prefill: Option<(RankId, Load)>,
}

/// Places `req` the way the filter would, and describes the placement.
fn selection(
    model: &ModelState,
    req: &SelectRequest,
    tie_break: u64,
    shards: &mut impl ShardSource,
) -> Result<Selected, Refused> {
    let parsed = prompt(&req.model_name, &req.prompt, model).map_err(Refused::BadRequest)?;
    // A selection is not a routing decision: nothing to report.
    let (route, cached) = place_in(model, &parsed, &req.tenant_id, tie_break, shards, false)
        .map_err(Refused::Plan)?;
    let first = &route.first;
    let worker = first.choice.worker;
    let view = SelectionView {
        selection_id: req.selection_id.clone(),
        reservation_id: req.reservation_id.clone(),
        model_name: req.model_name.clone(),
        tenant_id: req.tenant_id.clone(),
        worker_id: worker.id,
        dp_rank: first.choice.rank.rank,
        endpoint: worker.endpoint.clone(),
        block_size: worker.block_size,
        // What the events say the ranks hold; the cost also counted
        // prefixes routed moments ago, which no engine reported yet.
        overlap: reported(&first.choice, |slot| cached.reported(slot)),
        effective_prefill_tokens: first.prefill_tokens,
        disaggregation: route.prefill.map(|p| split_view(first, &p)),
    };
    let prefill = match &route.prefill {
        Some(Prefill::Remote(leg)) => Some((
            rank_id(model, &leg.first),
            Load {
                slot: leg.first.choice.rank.slot,
                prefill_tokens: leg.first.prefill_tokens,
                decode_blocks: leg.first.decode_blocks,
            },
        )),
        _ => None,
    };
    Ok(Selected {
        slot: first.choice.rank.slot,
        rank: rank_id(model, first),
        decode_blocks: first.decode_blocks,
        view,
        prefill,
    })
}

/// Both legs of a disaggregated placement, for the client.
fn split_view(decode: &Placement<'_>, prefill: &Prefill<'_>) -> SplitView {
    let leg = |p: &Placement<'_>| LegView {
        worker_id: p.choice.worker.id,
        dp_rank: p.choice.rank.rank,
        endpoint: p.choice.worker.endpoint.clone(),
        effective_prefill_tokens: p.prefill_tokens,
        decode_blocks: p.decode_blocks,
        reservation_id: None,
    };
    let (prefill, reason) = match prefill {
        Prefill::Remote(l) => (Some(leg(&l.first)), None),
        Prefill::Local(r) => (None, Some(r.as_str().to_string())),
    };
    SplitView {
        decode: leg(decode),
        local_prefill: prefill.is_none(),
        prefill,
        local_reason: reason,
    }
}

/// Places `parsed` in `model` as the filter would: the overlap from
/// `shards`, then `kvgate_core::plan`. With `report`, the route keeps the
/// prefix record a front door that routes sends to the routed-prefix
/// index, as the filter does; a selection keeps none.
fn place_in<'m>(
    model: &'m ModelState,
    parsed: &Parsed,
    tenant: &str,
    tie_break: u64,
    shards: &mut impl ShardSource,
    report: bool,
) -> Result<(Route<'m>, Cached), Rejection> {
    let mut gathered = Gathered::new(model, parsed, tenant, shards);
    if !report {
        gathered = gathered.without_report();
    }
    let ask = Ask {
        tie_break,
        retry_headroom: None,
    };
    match gathered.place(parsed, tenant, &ask, &[]) {
        Plan::Route(r) => Ok((r, gathered.cached)),
        Plan::Reject(r) => Err(r),
    }
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
