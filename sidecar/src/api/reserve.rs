//! Reservations, Dynamo's select-then-reserve flow: `POST /reservations`,
//! then `POST /reservations/{id}/prefill_complete`, `.../output_block`,
//! and `DELETE /reservations/{id}` when the request ends.
//!
//! Answers: 200 with the reservation as booked; 204 for the lifecycle
//! calls; 400 for a malformed body or a value out of range, 404 for an
//! unknown worker, rank or reservation, 409 for a reservation id already
//! live, 429 when the selection API's reservations fill its share of the
//! ledger (`load.caps.holders_per_origin`) and 503 when the whole ledger
//! is full (`load.caps.holders`). A refused call changes nothing in the
//! ledger.

use super::handles::{Reservations, Selection};
use super::ledger_view::{fresh_model, ledger_refusal, valid_reservation_id, within_bound};
use super::select::{new_reservation_id, output_blocks, prompt};
use super::views::{self, OutputBlockRequest, ReservationRequest, ReservationView};
use super::{error, json_response};
use crate::fleet::RankId;
use crate::sources::bookings::{LedgerError, Load};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvgate_core::ModelState;
use kvgate_core::plan::{ShardSource, overlap, select::new_blocks};
use std::sync::Arc;

pub(super) async fn create(State(sc): State<Arc<Selection>>, body: Bytes) -> Response {
    let mut req: ReservationRequest = match views::parse(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid reservation: {e}")),
    };
    let id = req
        .reservation_id
        .get_or_insert_with(new_reservation_id)
        .clone();
    if let Err(m) = valid_reservation_id(&id) {
        return error(StatusCode::BAD_REQUEST, m);
    }
    let snap = sc.store.snapshot();
    // effective_prefill_tokens is checked against the prompt's length.
    if let Err(m) = within_bound(
        &sc,
        &snap,
        &req.model_name,
        req.prompt.isl_tokens,
        req.expected_output_tokens,
    ) {
        return error(StatusCode::BAD_REQUEST, m);
    }
    let log = &sc.shards;
    let mut ledger = sc.ledger.lock();
    let Some(model) = fresh_model(&snap, &req.model_name, &ledger) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("model {:?} is not served here", req.model_name),
        );
    };
    let (rank, load) = match booking(&model, &req, &mut |k: &str| log.read(k)) {
        Ok(b) => b,
        Err((status, m)) => return error(status, m),
    };
    match sc
        .reservations
        .reserve(&mut ledger, &id, &rank, &req.tenant_id, load)
    {
        Ok(()) => json_response(
            StatusCode::OK,
            &ReservationView {
                reservation_id: id,
                model_name: rank.model,
                tenant_id: rank.tenant,
                worker_id: rank.worker_id,
                dp_rank: rank.dp_rank,
                effective_prefill_tokens: load.prefill_tokens,
                decode_blocks: load.decode_blocks,
            },
        ),
        Err(e) => ledger_refusal(e),
    }
}

/// The rank a reservation names and the load it books there: the given
/// `effective_prefill_tokens`, or else the prompt minus what the rank
/// holds on its GPU; the prompt's blocks not yet on the rank as decode
/// load, as a routed request books them.
fn booking(
    model: &ModelState,
    req: &ReservationRequest,
    shards: &mut impl ShardSource,
) -> Result<(RankId, Load), (StatusCode, String)> {
    let bad = |m: String| (StatusCode::BAD_REQUEST, m);
    let worker = model
        .workers
        .iter()
        .find(|w| w.id == req.worker_id && w.tenant == req.tenant_id)
        .ok_or_else(|| {
            (
                StatusCode::NOT_FOUND,
                format!(
                    "worker {} is not a schedulable worker of model {:?} for tenant {:?}",
                    req.worker_id, req.model_name, req.tenant_id
                ),
            )
        })?;
    let rank = match (req.dp_rank, worker.ranks.as_slice()) {
        (None, [only]) => only,
        (None, _) => {
            return Err(bad(format!(
                "worker {} has {} data-parallel ranks: give dp_rank",
                worker.id,
                worker.ranks.len()
            )));
        }
        (Some(r), ranks) => ranks.iter().find(|x| x.rank == r).ok_or_else(|| {
            (
                StatusCode::NOT_FOUND,
                format!("worker {} has no data-parallel rank {r}", worker.id),
            )
        })?,
    };
    let (isl, device_blocks) = if req.prompt.given() {
        let parsed = prompt(&req.model_name, &req.prompt, model).map_err(bad)?;
        let (cached, _) = overlap::gather(model, &parsed, &req.tenant_id, shards);
        (parsed.isl_tokens, cached.of(worker, rank.slot).device)
    } else {
        let isl = req
            .prompt
            .isl_tokens
            .filter(|n| *n > 0)
            .ok_or_else(|| bad("isl_tokens (above 0) or a prompt is required".into()))?;
        (isl, 0)
    };
    let bs = u64::from(worker.block_size.max(1));
    let prefill = match req.effective_prefill_tokens {
        Some(p) if p > isl => {
            return Err(bad(format!(
                "effective_prefill_tokens {p} is more than the input's {isl} tokens"
            )));
        }
        Some(p) => p,
        None => isl.saturating_sub(u64::from(device_blocks) * bs),
    };
    Ok((
        RankId {
            model: model.name.clone(),
            tenant: worker.tenant.clone(),
            block_size: worker.block_size,
            worker_id: worker.id,
            dp_rank: rank.rank,
        },
        Load {
            slot: rank.slot,
            prefill_tokens: prefill,
            decode_blocks: new_blocks(isl, worker.block_size, device_blocks)
                + output_blocks(req.expected_output_tokens, worker.block_size),
        },
    ))
}

pub(super) async fn prefill_complete(
    State(reservations): State<Arc<dyn Reservations>>,
    Path(id): Path<String>,
) -> Response {
    lifecycle(reservations.prefill_complete(&id))
}

pub(super) async fn output_block(
    State(reservations): State<Arc<dyn Reservations>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let req: OutputBlockRequest = if body.iter().all(u8::is_ascii_whitespace) {
        OutputBlockRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("invalid output_block: {e}"),
                );
            }
        }
    };
    if let Some(f) = req.decay_fraction
        && !(0.0..=1.0).contains(&f)
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!("decay_fraction {f} is not between 0.0 and 1.0"),
        );
    }
    lifecycle(reservations.output_block(&id, req.decay_fraction))
}

pub(super) async fn free(
    State(reservations): State<Arc<dyn Reservations>>,
    Path(id): Path<String>,
) -> Response {
    lifecycle(reservations.free(&id))
}

fn lifecycle(r: Result<(), LedgerError>) -> Response {
    match r {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => ledger_refusal(e),
    }
}
