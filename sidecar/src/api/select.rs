//! `POST /select`: Dynamo's selection API, answered by the same
//! `kvgate_core::plan` the filter runs in Envoy, over the snapshot and
//! index shards this sidecar publishes.

use super::views::{OverlapView, SelectRequest, SelectionView};
use super::{error, json_response};
use crate::Sidecar;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvgate_core::hash::sequence_hashes;
use kvgate_core::plan::request::{Parsed, estimate_tokens};
use kvgate_core::plan::{self, Choice, Plan, Rejection, ShardSource, overlap};
use kvgate_core::{ModelState, Snapshot};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Spreads ties between selections, as each filter VM's counter does.
static TIE_BREAK: AtomicU64 = AtomicU64::new(0);

pub(super) async fn select(State(sc): State<Arc<Sidecar>>, body: Bytes) -> Response {
    let req: SelectRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid selection: {e}")),
    };
    let snap = sc.store().snapshot();
    let tie = TIE_BREAK.fetch_add(1, Ordering::Relaxed);
    let log = &sc.plane().log;
    match selection(&snap, &req, tie, &mut |k: &str| log.read(k)) {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(Refused::BadRequest(m)) => error(StatusCode::BAD_REQUEST, m),
        Err(Refused::Plan(Rejection::UnknownModel)) => error(
            StatusCode::NOT_FOUND,
            format!("model {:?} is not served here", req.model_name),
        ),
        Err(Refused::Plan(Rejection::NoWorkers)) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "model {:?} has no schedulable worker for tenant {:?}",
                req.model_name, req.tenant_id
            ),
        ),
        Err(Refused::Plan(Rejection::AllBusy { retry_after_s })) => {
            let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "all workers are busy");
            if retry_after_s > 0
                && let Ok(v) = retry_after_s.to_string().parse()
            {
                r.headers_mut().insert("retry-after", v);
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

/// Places `req` the way the filter would, and describes the placement.
fn selection(
    snap: &Snapshot,
    req: &SelectRequest,
    tie_break: u64,
    shards: &mut impl ShardSource,
) -> Result<SelectionView, Refused> {
    let model = snap
        .model(&req.model_name)
        .ok_or(Refused::Plan(Rejection::UnknownModel))?;
    let parsed = prompt(req, model).map_err(Refused::BadRequest)?;
    // A selection is not a routing decision: nothing to report.
    let (cached, _) = overlap::gather(model, &parsed, &req.tenant_id, shards);
    let route = match plan::place(
        model,
        &parsed,
        &req.tenant_id,
        tie_break,
        &cached,
        None,
        &[],
    ) {
        Plan::Route(r) => r,
        Plan::Reject(r) => return Err(Refused::Plan(r)),
    };
    let first = &route.first;
    let worker = first.choice.worker;
    Ok(SelectionView {
        selection_id: req.selection_id.clone(),
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
    })
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
fn prompt(req: &SelectRequest, model: &ModelState) -> Result<Parsed, String> {
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
        model: req.model_name.clone(),
        tokens: None,
        text: None,
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

#[cfg(test)]
mod tests;
