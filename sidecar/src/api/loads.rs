//! Inspection: `GET /loads`, `POST /potential_loads`, `POST /overlap_scores`.
//! All read the fleet with its load as the ledger holds it now.

use super::Selection;
use super::ledger_view::{fresh, fresh_model, within_bound};
use super::select::prompt;
use super::views::{
    self, LoadsView, ModelLoadView, OverlapRowView, OverlapScoresView, PotentialLoadView,
    PotentialLoadsView, RankLoadView, SelectRequest,
};
use super::{error, json_response};
use crate::publish::SnapshotStore;
use crate::sources::bookings::Bookings;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use kvgate_core::ModelState;
use kvgate_core::plan::overlap::{self, Cached};
use kvgate_core::plan::select::new_blocks;
use parking_lot::Mutex;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LoadsQuery {
    model_name: Option<String>,
    tenant_id: Option<String>,
}

pub(super) async fn loads(
    State(store): State<Arc<SnapshotStore>>,
    State(ledger): State<Arc<Mutex<Bookings>>>,
    Query(q): Query<LoadsQuery>,
) -> Response {
    let snap = store.snapshot();
    let models: Vec<ModelState> = {
        let ledger = ledger.lock();
        snap.models
            .iter()
            .filter(|m| q.model_name.as_ref().is_none_or(|n| *n == m.name))
            .map(|m| fresh(m, &ledger))
            .collect()
    };
    let mut out: BTreeMap<(String, String), Vec<RankLoadView>> = BTreeMap::new();
    for m in &models {
        for w in &m.workers {
            if q.tenant_id.as_ref().is_some_and(|t| *t != w.tenant) {
                continue;
            }
            let rows = out.entry((m.name.clone(), w.tenant.clone())).or_default();
            rows.extend(w.ranks.iter().map(|r| RankLoadView {
                worker_id: w.id,
                dp_rank: r.rank,
                active_prefill_tokens: r.active_prefill_tokens,
                active_decode_blocks: r.active_decode_blocks,
                kv_used_blocks: r.kv_used_blocks,
                kv_total_blocks: r.kv_total_blocks,
                running: r.running,
                waiting: r.waiting,
                busy: r.busy,
            }));
        }
    }
    json_response(
        StatusCode::OK,
        &LoadsView {
            models: out
                .into_iter()
                .map(|((model_name, tenant_id), workers)| ModelLoadView {
                    model_name,
                    tenant_id,
                    workers,
                })
                .collect(),
        },
    )
}

/// The prompt of a `/potential_loads` or `/overlap_scores` request, its
/// model as of now, and its overlap there.
fn looked_up(
    sc: &Selection,
    body: &[u8],
) -> Result<(SelectRequest, ModelState, Cached, u64), (StatusCode, String)> {
    let req: SelectRequest = views::parse(body)
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("invalid request: {e}")))?;
    let snap = sc.store.snapshot();
    within_bound(sc, &snap, &req.model_name, req.prompt.isl_tokens, None)
        .map_err(|m| (StatusCode::BAD_REQUEST, m))?;
    let model = fresh_model(&snap, &req.model_name, &sc.ledger.lock()).ok_or_else(|| {
        (
            StatusCode::NOT_FOUND,
            format!("model {:?} is not served here", req.model_name),
        )
    })?;
    let parsed =
        prompt(&req.model_name, &req.prompt, &model).map_err(|m| (StatusCode::BAD_REQUEST, m))?;
    let log = &sc.shards;
    let (cached, _) = overlap::gather(&model, &parsed, &req.tenant_id, &mut |k: &str| log.read(k));
    Ok((req, model, cached, parsed.isl_tokens))
}

/// Each rank's load if the prompt were placed there: its booked load plus
/// what the prompt would book, as `/select_and_reserve` would book it.
pub(super) async fn potential_loads(State(sc): State<Arc<Selection>>, body: Bytes) -> Response {
    let (req, model, cached, isl) = match looked_up(&sc, &body) {
        Ok(x) => x,
        Err((status, m)) => return error(status, m),
    };
    let mut loads = Vec::new();
    for w in model.workers.iter().filter(|w| w.tenant == req.tenant_id) {
        let bs = u64::from(w.block_size.max(1));
        for r in &w.ranks {
            let device = cached.of(w, r.slot).device;
            loads.push(PotentialLoadView {
                worker_id: w.id,
                dp_rank: r.rank,
                potential_prefill_tokens: r
                    .active_prefill_tokens
                    .saturating_add(isl.saturating_sub(u64::from(device) * bs)),
                potential_decode_blocks: r.active_decode_blocks.saturating_add(new_blocks(
                    isl,
                    w.block_size,
                    device,
                )),
            });
        }
    }
    json_response(
        StatusCode::OK,
        &PotentialLoadsView {
            model_name: req.model_name,
            tenant_id: req.tenant_id,
            loads,
        },
    )
}

/// Matched tokens per rank and tier, as the engines' events report them.
pub(super) async fn overlap_scores(State(sc): State<Arc<Selection>>, body: Bytes) -> Response {
    let (req, model, cached, _) = match looked_up(&sc, &body) {
        Ok(x) => x,
        Err((status, m)) => return error(status, m),
    };
    let block_size = model.workers.first().map_or(0, |w| w.block_size);
    let mut scores = Vec::new();
    for w in model.workers.iter().filter(|w| w.tenant == req.tenant_id) {
        let tokens = |blocks: u32| u64::from(blocks) * u64::from(w.block_size);
        for r in &w.ranks {
            let o = cached.reported(r.slot);
            scores.push(OverlapRowView {
                worker_id: w.id,
                dp_rank: r.rank,
                longest_matched: tokens(o.device.max(o.host).max(o.disk)),
                gpu: tokens(o.device),
                cpu: tokens(o.host),
                disk: tokens(o.disk),
            });
        }
    }
    json_response(
        StatusCode::OK,
        &OverlapScoresView {
            model_name: req.model_name,
            tenant_id: req.tenant_id,
            block_size,
            scores,
        },
    )
}
