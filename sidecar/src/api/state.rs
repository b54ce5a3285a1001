//! `GET /v1/state`: the current snapshot as JSON, for people and tests.

use super::json_response;
use crate::Sidecar;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

pub(super) async fn state(State(sc): State<Arc<Sidecar>>) -> Response {
    let s = sc.store().snapshot();
    let models: Vec<Value> = s
        .models
        .iter()
        .map(|m| {
            json!({
                "name": m.name,
                "thresholds": {
                    "active_decode_blocks_threshold": m.thresholds.active_decode_blocks,
                    "active_prefill_tokens_threshold": m.thresholds.active_prefill_tokens,
                    "active_prefill_tokens_threshold_frac": m.thresholds.active_prefill_tokens_frac,
                },
                "shard_count": m.shard_count,
                "retry_after_s": m.retry_after_s,
                // Token prompts use the engines' events when the model's
                // workers publish them; text prompts always use the index
                // learned from routing decisions.
                "mode": if m.shard_count > 0 { "precise for token prompts, approximate for text" } else { "approximate" },
                "workers": m.workers.iter().map(|w| json!({
                    "worker_id": w.id,
                    "tenant_id": w.tenant,
                    "endpoint": w.endpoint,
                    "block_size": w.block_size,
                    "ranks": w.ranks.iter().map(|r| json!({
                        "dp_rank": r.rank,
                        "slot": r.slot,
                        "active_prefill_tokens": r.active_prefill_tokens,
                        "active_decode_blocks": r.active_decode_blocks,
                        "kv_used_blocks": r.kv_used_blocks,
                        "kv_total_blocks": r.kv_total_blocks,
                        "max_num_batched_tokens": r.max_num_batched_tokens,
                        "running": r.running,
                        "waiting": r.waiting,
                        "busy": r.busy,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json_response(
        StatusCode::OK,
        json!({"version": s.version, "built_at_ms": s.built_at_ms, "epoch": sc.versions().epoch, "models": models}),
    )
}
