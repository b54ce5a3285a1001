//! The sidecar's HTTP API.
//!
//! * `GET /v1/snapshot?after=V&epoch=E&wait_ms=M` — the long poll Envoy's
//!   snapshot service uses (see `docs/architecture.md`).
//! * `GET /v1/state` — the current snapshot as JSON, for people and tests.
//! * `POST /v1/routed`, `POST /v1/bookings` — what the filter reports:
//!   routing decisions for the approximate index, and load bookings.
//! * `GET/POST /busy_threshold` — shedding thresholds, in Dynamo's shapes.
//! * `POST/GET /workers`, `PATCH/DELETE /workers/{id}` — the catalog.
//! * `POST /v3/discovery:endpoints` — the catalog as Envoy's routed cluster
//!   (REST EDS, JSON).
//!
//! * `GET /health`, `GET /ready`, `GET /metrics`.
//!
//! When a token is configured (`[control] token_file` or
//! `KVGATE_CONTROL_TOKEN`), every route that changes state answers 401
//! without `Authorization: Bearer <token>`: the control API
//! (`/busy_threshold`, `/workers`) and the filter's reports
//! (`/v1/bookings`, `/v1/routed`), since a forged booking sheds every
//! request for the booking TTL and forged routing decisions steer the
//! approximate index. What only reads (`/v1/snapshot`, `/v1/state`,
//! `/health`, `/ready`, `/metrics`) stays open.

use crate::Sidecar;
use crate::config::WorkerSpec;
use crate::eds;
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
    let token = axum::middleware::from_fn_with_state(sc.clone(), require_token);
    Router::new()
        .route("/v1/snapshot", get(snapshot))
        .route("/v1/state", get(state))
        .route(
            "/v1/routed",
            axum::routing::post(routed).route_layer(token.clone()),
        )
        .route(
            "/v1/bookings",
            axum::routing::post(bookings).route_layer(token.clone()),
        )
        .route("/v3/discovery:endpoints", axum::routing::post(endpoints))
        .merge(
            Router::new()
                .route("/busy_threshold", get(get_thresholds).post(post_thresholds))
                .route("/workers", get(list_workers).post(add_worker))
                .route(
                    "/workers/{id}",
                    get(get_worker).patch(patch_worker).delete(delete_worker),
                )
                .route_layer(axum::middleware::from_fn_with_state(
                    sc.clone(),
                    require_token,
                )),
        )
        .route(
            "/health",
            get(|| async { json_response(StatusCode::OK, json!({"status": "ok"})) }),
        )
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(sc)
}

/// Refuses requests without the configured bearer token; checked before
/// the body is read.
async fn require_token(
    State(sc): State<Arc<Sidecar>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = sc.config.control.token.as_deref() else {
        return next.run(req).await;
    };
    let given = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(given.as_bytes(), token.as_bytes()) {
        return next.run(req).await;
    }
    let mut r = error(
        StatusCode::UNAUTHORIZED,
        "this endpoint requires Authorization: Bearer <the sidecar's control token>",
    );
    r.headers_mut()
        .insert("www-authenticate", HeaderValue::from_static("Bearer"));
    r
}

/// Compares without an early exit, so timing does not reveal how much of a
/// guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
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
            sc.polled();
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
            sc.polled();
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

/// Booking events from the filter. A batch that does not decode is refused
/// whole (400): its records cannot be delimited past the bad one.
async fn bookings(State(sc): State<Arc<Sidecar>>, body: Bytes) -> Response {
    match kvgate_core::booking::decode_batch(&body) {
        Ok(events) => {
            sc.metrics.booking_batches.with_label_values(&["ok"]).inc();
            sc.book(events);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => {
            sc.metrics
                .booking_batches
                .with_label_values(&["malformed"])
                .inc();
            tracing::warn!(error = %e, "malformed booking batch");
            error(StatusCode::BAD_REQUEST, e)
        }
    }
}

/// One model's thresholds in Dynamo's shape; unset thresholds are omitted.
fn thresholds_json(model: &str, t: &kvgate_core::Thresholds) -> Value {
    let mut v = json!({"model": model});
    if let Some(o) = v.as_object_mut() {
        if let Some(d) = t.active_decode_blocks {
            o.insert("active_decode_blocks_threshold".into(), json!(d));
        }
        if let Some(p) = t.active_prefill_tokens {
            o.insert("active_prefill_tokens_threshold".into(), json!(p));
        }
        if let Some(f) = t.active_prefill_tokens_frac {
            o.insert("active_prefill_tokens_threshold_frac".into(), json!(f));
        }
    }
    v
}

async fn get_thresholds(State(sc): State<Arc<Sidecar>>) -> Response {
    let f = sc.fleet();
    let all: Vec<Value> = f
        .models
        .iter()
        .map(|(name, m)| thresholds_json(name, &m.thresholds))
        .collect();
    json_response(StatusCode::OK, json!({"thresholds": all}))
}

/// `{"model": .., <threshold>: ..}`: only `model` reads that model's
/// thresholds; each threshold given is set, others are kept; `null` unsets
/// one (that condition stops shedding).
async fn post_thresholds(State(sc): State<Arc<Sidecar>>, body: Bytes) -> Response {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return error(StatusCode::BAD_REQUEST, "the body must be a JSON object"),
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
    };
    let Some(model) = body.get("model").and_then(Value::as_str) else {
        return error(StatusCode::BAD_REQUEST, "\"model\" (a string) is required");
    };
    let current = match sc.fleet().models.get(model) {
        Some(m) => m.thresholds,
        None => {
            return error(
                StatusCode::NOT_FOUND,
                format!("model {model:?} is not served here"),
            );
        }
    };
    let mut t = current;
    for (k, v) in body.as_object().into_iter().flatten() {
        let bad = |what: &str| error(StatusCode::BAD_REQUEST, format!("{k}: {what}, got {v}"));
        match k.as_str() {
            "model" => {}
            "active_decode_blocks_threshold" => match v {
                Value::Null => t.active_decode_blocks = None,
                _ => match v.as_f64() {
                    Some(x) => t.active_decode_blocks = Some(x),
                    None => return bad("expected a number within [0, 1]"),
                },
            },
            "active_prefill_tokens_threshold" => match v {
                Value::Null => t.active_prefill_tokens = None,
                _ => match v.as_u64() {
                    Some(x) => t.active_prefill_tokens = Some(x),
                    None => return bad("expected a non-negative integer"),
                },
            },
            "active_prefill_tokens_threshold_frac" => match v {
                Value::Null => t.active_prefill_tokens_frac = None,
                _ => match v.as_f64() {
                    Some(x) => t.active_prefill_tokens_frac = Some(x),
                    None => return bad("expected a number above 0"),
                },
            },
            _ => return error(StatusCode::BAD_REQUEST, format!("unknown field {k:?}")),
        }
    }
    if t != current
        && let Err(e) = sc.set_thresholds(model, t)
    {
        return fleet_error(e);
    }
    json_response(StatusCode::OK, thresholds_json(model, &t))
}

/// Envoy's REST EDS poll for the routed cluster (see [`crate::eds`]).
async fn endpoints(State(sc): State<Arc<Sidecar>>, body: Bytes) -> Response {
    let req: eds::DiscoveryRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid DiscoveryRequest: {e}"),
            );
        }
    };
    match eds::discovery_response(&sc.fleet(), &req) {
        Ok(v) => json_response(StatusCode::OK, v),
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
    sc.metrics.snapshot_age.set(sc.poll_age().as_secs_f64());
    (
        StatusCode::OK,
        [("content-type", "text/plain; version=0.0.4")],
        sc.metrics.render(),
    )
        .into_response()
}
