//! The sidecar's HTTP API.
//!
//! * `GET /v1/snapshot?after=V&epoch=E&wait_ms=M` — the long poll Envoy's
//!   snapshot service uses (see `docs/architecture.md`).
//! * `GET /v1/state` — the current snapshot as JSON, for people and tests.
//! * `GET /dump` — the prefix index in a recovery format (binary), for a
//!   peer starting up with `[indexer] peers`; on both listeners.
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
//! `/dump`, `/health`, `/ready`, `/metrics`) stays open.
//!
//! The selection API has a listener of its own ([`selection_router`],
//! `[selection] listen`): `POST /select`, Dynamo's selection request (where
//! the filter would place a prompt, without booking it), with `/dump`,
//! `/health` and `/ready`.
//!
//! Each resource has its module; the bodies they answer are types in
//! [`views`]. A new resource is a new module beside them, registered in
//! [`router`].

mod auth;
mod discovery;
mod dump;
mod poll;
mod probes;
mod reports;
mod select;
mod state;
pub mod status;
mod thresholds;
pub mod views;
mod workers;

use crate::Sidecar;
use crate::fleet::FleetError;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use std::sync::Arc;
use views::{ErrorView, HealthView};

pub fn router(sc: Arc<Sidecar>) -> Router {
    let token = axum::middleware::from_fn_with_state(sc.clone(), auth::require_token);
    Router::new()
        .route("/v1/snapshot", get(poll::snapshot))
        .route("/v1/state", get(state::state))
        .route("/dump", get(dump::dump))
        .route(
            "/v1/routed",
            axum::routing::post(reports::routed).route_layer(token.clone()),
        )
        .route(
            "/v1/bookings",
            axum::routing::post(reports::bookings).route_layer(token.clone()),
        )
        .route(
            "/v3/discovery:endpoints",
            axum::routing::post(discovery::endpoints),
        )
        .merge(
            Router::new()
                .route(
                    "/busy_threshold",
                    get(thresholds::get_thresholds).post(thresholds::post_thresholds),
                )
                .route(
                    "/workers",
                    get(workers::list_workers).post(workers::add_worker),
                )
                .route(
                    "/workers/{id}",
                    get(workers::get_worker)
                        .patch(workers::patch_worker)
                        .delete(workers::delete_worker),
                )
                .route_layer(axum::middleware::from_fn_with_state(
                    sc.clone(),
                    auth::require_token,
                )),
        )
        .route("/health", get(health))
        .route("/ready", get(probes::ready))
        .route("/metrics", get(probes::metrics))
        .with_state(sc)
}

/// The selection API, for runtimes without Envoy.
pub fn selection_router(sc: Arc<Sidecar>) -> Router {
    Router::new()
        .route("/select", axum::routing::post(select::select))
        .route("/dump", get(dump::dump))
        .route("/health", get(health))
        .route("/ready", get(probes::ready))
        .with_state(sc)
}

async fn health() -> Response {
    json_response(
        StatusCode::OK,
        &HealthView {
            status: "ok".into(),
        },
    )
}

fn json_response(status: StatusCode, body: &impl Serialize) -> Response {
    match serde_json::to_string(body) {
        Ok(text) => (status, [("content-type", "application/json")], text).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "answer does not serialize");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    json_response(
        status,
        &ErrorView {
            error: message.to_string(),
        },
    )
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
