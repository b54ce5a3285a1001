//! The engine's batch control (`POST /v1/admin/batch`, the seed's §4), the
//! GPUs' dcgm-exporter page, and the plant's test controls.
//!
//! Batch control semantics, as the seed proposes them for vLLM:
//! `max_num_seqs` changes how many sequences each rank runs at once
//! (running work is not touched: new work waits until fewer run);
//! `force_evict` moves that many running sequences back to waiting, chosen
//! by `policy`, and they resume where they stopped once there is room;
//! `target_temp_c` alone evicts down to the batch whose steady temperature
//! stays under it and sets `max_num_seqs` to that batch; `dry_run` answers
//! and changes nothing. `estimated_watts_saved` is per worker: evicted
//! sequences × watts per sequence × GPUs of the group.

use crate::api::Sim;
use crate::engine::EvictPolicy;
use crate::thermal::PlantChange;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::Ordering;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchControl {
    max_num_seqs: Option<u32>,
    force_evict: Option<u32>,
    target_temp_c: Option<f64>,
    #[serde(default)]
    policy: EvictPolicy,
    #[serde(default)]
    dry_run: bool,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status == StatusCode::UNAUTHORIZED {
        "authentication_error"
    } else {
        "invalid_request_error"
    };
    (
        status,
        [("content-type", "application/json")],
        json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}})
            .to_string(),
    )
        .into_response()
}

fn json_ok(v: serde_json::Value) -> Response {
    ([("content-type", "application/json")], v.to_string()).into_response()
}

pub async fn batch(State(sim): State<Arc<Sim>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(token) = &sim.admin_token {
        let given = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(token.as_str()) {
            return error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        }
    }
    let c: BatchControl = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid body: {e}")),
    };
    if c.max_num_seqs == Some(0) {
        return error(StatusCode::BAD_REQUEST, "max_num_seqs must be at least 1");
    }
    if let Some(t) = c.target_temp_c
        && !(t.is_finite() && t <= 95.0)
    {
        return error(StatusCode::BAD_REQUEST, "target_temp_c must be at most 95");
    }
    let ranks = sim.ranks.len().max(1) as u32;
    let previous = sim.running();
    // The per-rank batch asked for: explicit, or what the target allows.
    let per_rank = c.max_num_seqs.or_else(|| {
        c.target_temp_c
            .map(|t| (sim.plant.seqs_for(t) / ranks).max(1))
    });
    let to_evict = match (c.force_evict, c.target_temp_c) {
        (Some(n), _) => n,
        (None, Some(_)) => {
            previous.saturating_sub(per_rank.unwrap_or(u32::MAX).saturating_mul(ranks))
        }
        (None, None) => 0,
    };
    let gpus = sim.plant.gpus().len() as f64;
    let w_per_seq = sim.plant.params().w_per_seq;
    if c.dry_run {
        let evicted = to_evict.min(previous);
        let new_max =
            per_rank.unwrap_or_else(|| sim.ranks.first().map_or(0, |r| r.max_num_seqs() as u32));
        return json_ok(json!({
            "previous_running": previous,
            "new_running": previous - evicted,
            "evicted_request_ids": Vec::<String>::new(),
            "estimated_watts_saved": f64::from(evicted) * w_per_seq * gpus,
            "new_max_num_seqs": new_max,
        }));
    }
    let mut set = None;
    if let Some(n) = per_rank {
        for r in &sim.ranks {
            set = Some(r.set_max_num_seqs(n as usize) as u32);
        }
    }
    // Evict across ranks, the fullest first, one at a time.
    let mut evicted: Vec<String> = Vec::new();
    for _ in 0..to_evict {
        let Some(r) = sim
            .ranks
            .iter()
            .filter(|r| r.running.load(Ordering::Relaxed) > 0)
            .max_by_key(|r| r.running.load(Ordering::Relaxed))
        else {
            break;
        };
        for id in r.evict(1, c.policy) {
            evicted.push(format!("sim-{}-{}", r.index, id));
        }
    }
    let new_max = set.unwrap_or_else(|| sim.ranks.first().map_or(0, |r| r.max_num_seqs() as u32));
    tracing::info!(
        previous,
        evicted = evicted.len(),
        max_num_seqs = new_max,
        "batch control"
    );
    json_ok(json!({
        "previous_running": previous,
        "new_running": sim.running(),
        "estimated_watts_saved": evicted.len() as f64 * w_per_seq * gpus,
        "evicted_request_ids": evicted,
        "new_max_num_seqs": new_max,
    }))
}

pub async fn dcgm(State(sim): State<Arc<Sim>>) -> Response {
    match sim.plant.dcgm_page() {
        Some(page) => ([("content-type", "text/plain; version=0.0.4")], page).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "exporter down\n").into_response(),
    }
}

pub async fn thermal_state(State(sim): State<Arc<Sim>>) -> Response {
    let p = sim.plant.params();
    json_ok(json!({
        "gpus": sim.plant.gpus(),
        "running": sim.running(),
        "waiting": sim.ranks.iter().map(|r| r.waiting.load(Ordering::Relaxed)).sum::<u32>(),
        "max_num_seqs": sim.ranks.first().map_or(0, |r| r.max_num_seqs()),
        "clock_factor": sim.plant.clock_factor(),
        "ambient_c": p.ambient_c,
        "r_c_per_w": p.r_c_per_w,
    }))
}

pub async fn thermal_change(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    let c: PlantChange = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid body: {e}")),
    };
    match sim.plant.apply(&c) {
        Ok(()) => thermal_state(State(sim)).await,
        Err(e) => error(StatusCode::BAD_REQUEST, e),
    }
}
