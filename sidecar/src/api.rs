//! The sidecar's HTTP API.
//!
//! * `GET /v1/snapshot?after=V&epoch=E&wait_ms=M` — the long poll Envoy's
//!   snapshot service uses (see `docs/architecture.md`).
//! * `GET /v1/state` — the current snapshot as JSON, for people and tests.
//! * `POST/GET /workers`, `PATCH/DELETE /workers/{id}` — the catalog.
//! * `GET /health`, `GET /ready`, `GET /metrics`.

use crate::Sidecar;
use crate::config::WorkerSpec;
use crate::fleet::{FleetError, WorkerEntry};
use crate::publish;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// The longest a long poll is held, whatever the client asks.
pub const MAX_WAIT: Duration = Duration::from_secs(10);

pub fn router(sc: Arc<Sidecar>) -> Router {
    Router::new()
        .route("/v1/snapshot", get(snapshot))
        .route("/v1/state", get(state))
        .route("/v1/routed", axum::routing::post(routed))
        .route("/workers", get(list_workers).post(add_worker))
        .route(
            "/workers/{id}",
            get(get_worker).patch(patch_worker).delete(delete_worker),
        )
        .route(
            "/health",
            get(|| async { json_response(StatusCode::OK, json!({"status": "ok"})) }),
        )
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(sc)
}

fn json_response(status: StatusCode, body: Value) -> Response {
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    json_response(status, json!({"error": message.to_string()}))
}

fn fleet_error(e: FleetError) -> Response {
    let status = match e {
        FleetError::Duplicate(_) => StatusCode::CONFLICT,
        FleetError::UnknownWorker(_) | FleetError::UnknownModel(_) => StatusCode::NOT_FOUND,
        FleetError::Invalid(_) => StatusCode::BAD_REQUEST,
        FleetError::SlotsExhausted => StatusCode::INSUFFICIENT_STORAGE,
    };
    error(status, e)
}

/// A worker as the API shows it: its registration plus its status.
pub fn worker_json(w: &WorkerEntry) -> Value {
    let mut v = serde_json::to_value(&w.spec).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.insert(
            "status".into(),
            serde_json::to_value(&w.health).unwrap_or(Value::Null),
        );
        o.insert("slots".into(), json!(w.slots));
    }
    v
}

#[derive(Debug, Deserialize)]
struct PollQuery {
    #[serde(default)]
    after: u64,
    #[serde(default)]
    epoch: u64,
    #[serde(default)]
    wait_ms: u64,
}

async fn snapshot(State(sc): State<Arc<Sidecar>>, Query(q): Query<PollQuery>) -> Response {
    let wait = Duration::from_millis(q.wait_ms).min(MAX_WAIT);
    let deadline = tokio::time::Instant::now() + wait;
    let mut rx = sc.versions.subscribe();
    loop {
        rx.borrow_and_update();
        if let Some(frame) = publish::frame(
            &sc.versions,
            &sc.store,
            Some(&sc.plane.log),
            q.after,
            q.epoch,
        ) {
            sc.metrics
                .snapshot_polls
                .with_label_values(&["changed"])
                .inc();
            let mut r = (
                StatusCode::OK,
                [("content-type", "application/octet-stream")],
                frame,
            )
                .into_response();
            version_headers(&mut r, &sc);
            return r;
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            sc.metrics
                .snapshot_polls
                .with_label_values(&["timeout"])
                .inc();
            let mut r = StatusCode::NO_CONTENT.into_response();
            version_headers(&mut r, &sc);
            return r;
        }
    }
}

fn version_headers(r: &mut Response, sc: &Sidecar) {
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&sc.versions.current().to_string()) {
        h.insert("x-kvgate-version", v);
    }
    if let Ok(v) = HeaderValue::from_str(&sc.versions.epoch.to_string()) {
        h.insert("x-kvgate-epoch", v);
    }
}

async fn state(State(sc): State<Arc<Sidecar>>) -> Response {
    let s = sc.store.snapshot();
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
                // Token prompts use the engines' events when the model's
                // workers publish them; text prompts always use the index
                // learned from routing decisions.
                "mode": if m.shard_count > 0 { "precise for token prompts, approximate for text" } else { "approximate" },
                "workers": m.workers.iter().map(|w| json!({
                    "worker_id": w.id,
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
        json!({"version": s.version, "built_at_ms": s.built_at_ms, "epoch": sc.versions.epoch, "models": models}),
    )
}

/// Routing decisions from the filter, for the approximate index.
async fn routed(State(sc): State<Arc<Sidecar>>, body: Bytes) -> Response {
    match kvgate_core::approx::Routed::decode_all(&body) {
        Ok(records) => {
            sc.learn(&records);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, e),
    }
}

async fn list_workers(State(sc): State<Arc<Sidecar>>) -> Response {
    let f = sc.fleet();
    let workers: Vec<Value> = f.workers.values().map(worker_json).collect();
    json_response(StatusCode::OK, json!({"workers": workers}))
}

async fn get_worker(State(sc): State<Arc<Sidecar>>, Path(id): Path<u64>) -> Response {
    match sc.fleet().workers.get(&id) {
        Some(w) => json_response(StatusCode::OK, worker_json(w)),
        None => fleet_error(FleetError::UnknownWorker(id)),
    }
}

async fn add_worker(State(sc): State<Arc<Sidecar>>, body: Bytes) -> Response {
    let spec: WorkerSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid worker: {e}")),
    };
    match sc.add_worker(spec) {
        Ok(v) => json_response(StatusCode::CREATED, v),
        Err(e) => fleet_error(e),
    }
}

async fn patch_worker(
    State(sc): State<Arc<Sidecar>>,
    Path(id): Path<u64>,
    body: Bytes,
) -> Response {
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
    };
    match sc.patch_worker(id, &patch) {
        Ok(v) => json_response(StatusCode::OK, v),
        Err(e) => fleet_error(e),
    }
}

async fn delete_worker(State(sc): State<Arc<Sidecar>>, Path(id): Path<u64>) -> Response {
    match sc.remove_worker(id) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => fleet_error(e),
    }
}

async fn ready(State(sc): State<Arc<Sidecar>>) -> Response {
    let f = sc.fleet();
    if f.up_count() > 0 {
        return json_response(
            StatusCode::OK,
            json!({"status": "ready", "workers_up": f.up_count()}),
        );
    }
    let why: Vec<Value> = f
        .workers
        .values()
        .map(|w| {
            json!({
                "worker_id": w.spec.worker_id,
                "reason": w.health.last_error.clone().unwrap_or_else(|| "no successful metrics scrape yet".into()),
            })
        })
        .collect();
    json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({"status": "not ready", "reason": "no schedulable worker", "workers": why}),
    )
}

async fn metrics(State(sc): State<Arc<Sidecar>>) -> Response {
    (
        StatusCode::OK,
        [("content-type", "text/plain; version=0.0.4")],
        sc.metrics.render(),
    )
        .into_response()
}
