//! The sidecar's HTTP API.
//!
//! * `GET /v1/snapshot?after=V&epoch=E&wait_ms=M` — the long poll Envoy's
//!   snapshot service uses (see `docs/architecture.md`).
//! * `GET /v1/state` — the current snapshot as JSON, for people and tests.
//! * `GET /dump` — the prefix index in a recovery format (binary), for a
//!   peer starting up with `[indexer] peers`; on both listeners. Like a
//!   reset frame of `/v1/snapshot` it is the whole index: one copy is
//!   shared between readers, and readers are capped (`full_read`).
//! * `POST /v1/routed`, `POST /v1/bookings` — what the filter reports:
//!   routing decisions for the approximate index, and load bookings.
//! * `GET/POST /busy_threshold` — shedding thresholds, in Dynamo's shapes.
//! * `GET/POST /v1/admin/thermal` — GPU heat per worker and the thermal
//!   controller's settings per model or worker (with `dry_run`).
//! * `GET /v1/planner`, `GET /v1/planner/decisions`, `POST
//!   /v1/planner/decisions/{id}/complete` — the planner's state and its
//!   decisions for orchestrators.
//! * `POST/GET /workers`, `PATCH/DELETE /workers/{id}` — the catalog.
//! * `POST /v3/discovery:endpoints` — the catalog as Envoy's routed cluster
//!   (REST EDS, JSON).
//!
//! * `GET /health`, `GET /ready`, `GET /metrics`.
//!
//! When a token is configured (`[control] token_file` or
//! `KVGATE_CONTROL_TOKEN`), every route that changes state answers 401
//! without `Authorization: Bearer <token>`: the control API
//! (`/busy_threshold`, `/v1/admin/thermal`, `/workers`) and the filter's reports
//! (`/v1/bookings`, `/v1/routed`), since a forged booking sheds every
//! request for the booking TTL and forged routing decisions steer the
//! approximate index; and `/dump`, the whole index, which kvgate's own
//! recovery sends the token for. What else only reads (`/v1/snapshot`,
//! `/v1/state`, `/health`, `/ready`, `/metrics`) stays open.
//!
//! The selection API has a listener of its own ([`selection_router`],
//! `[selection] listen`), Dynamo's standalone selection service's routes:
//! `POST /select` (where the filter would place a prompt, booking nothing),
//! `POST /select_and_reserve`, reservations and their lifecycle
//! (`/reservations...`, one ledger with the gateways' bookings), `GET
//! /loads`, `POST /potential_loads`, `POST /overlap_scores`, the catalog
//! (`/workers`), `/dump`, `/health` and `/ready`.
//!
//! Both listeners serve the replica-sync peer list
//! (`/replica_sync/peers`, `register_peer`, `deregister_peer`).
//!
//! Each resource has its module; the bodies they answer are types in
//! [`views`]. A new resource is a new module beside them, registered in
//! [`router`]. Handlers take the handles they use from the routers'
//! state, [`Handles`]: the running sidecar's parts, and traits for what
//! only its wiring can do.
//!
//! [`route`] is the selection path without HTTP, for a front door that
//! routes in another process's place (the ext_proc server).

mod auth;
mod discovery;
mod dump;
mod full_read;
mod handles;
mod ledger_view;
pub mod listener;
mod loads;
pub mod planner;
mod poll;
mod probes;
mod replica;
mod reports;
mod reserve;
mod select;
mod state;
pub mod status;
mod thermal;
mod thresholds;
pub mod views;
mod workers;

pub use full_read::FullReads;
pub use handles::{Catalog, Handles, Reports, Reservations, Selection};
pub(crate) use poll::LastPoll;
pub use select::route;

use crate::fleet::FleetError;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::Serialize;
use views::{ErrorView, HealthView};

pub fn router(handles: impl Into<Handles>) -> Router {
    let h = handles.into();
    let token = axum::middleware::from_fn_with_state(h.clone(), auth::require_token);
    Router::new()
        .route("/v1/snapshot", get(poll::snapshot))
        .route("/v1/state", get(state::state))
        .route("/dump", get(dump::dump).route_layer(token.clone()))
        .route(
            "/v1/routed",
            post(reports::routed).route_layer(token.clone()),
        )
        .route(
            "/v1/bookings",
            post(reports::bookings).route_layer(token.clone()),
        )
        .route("/v3/discovery:endpoints", post(discovery::endpoints))
        .merge(
            Router::new()
                .route(
                    "/busy_threshold",
                    get(thresholds::get_thresholds).post(thresholds::post_thresholds),
                )
                .route(
                    "/v1/admin/thermal",
                    get(thermal::get_thermal).post(thermal::post_thermal),
                )
                .route("/v1/planner", get(planner::status))
                .route("/v1/planner/decisions", get(planner::next_decision))
                .route(
                    "/v1/planner/decisions/{id}/complete",
                    post(planner::complete),
                )
                .merge(catalog())
                .route_layer(token),
        )
        .merge(replica_sync(&h))
        .route("/health", get(health))
        .route("/ready", get(probes::ready))
        .route("/metrics", get(probes::metrics))
        .with_state(h)
}

/// The selection API, for runtimes without Envoy: Dynamo's standalone
/// selection service's routes. With a control token, what changes state
/// (reservations, the catalog, peers) requires it; selections and
/// inspection stay open, as `/v1/state` does.
pub fn selection_router(handles: impl Into<Handles>) -> Router {
    let h = handles.into();
    let token = axum::middleware::from_fn_with_state(h.clone(), auth::require_token);
    Router::new()
        .route("/select", post(select::select))
        .route("/loads", get(loads::loads))
        .route("/potential_loads", post(loads::potential_loads))
        .route("/overlap_scores", post(loads::overlap_scores))
        .merge(
            Router::new()
                .route("/select_and_reserve", post(select::select_and_reserve))
                .route("/reservations", post(reserve::create))
                .route("/reservations/{id}", delete(reserve::free))
                .route(
                    "/reservations/{id}/prefill_complete",
                    post(reserve::prefill_complete),
                )
                .route(
                    "/reservations/{id}/output_block",
                    post(reserve::output_block),
                )
                .merge(catalog())
                .route_layer(token.clone()),
        )
        .merge(replica_sync(&h))
        .route("/dump", get(dump::dump).route_layer(token))
        .route("/health", get(health))
        .route("/ready", get(probes::ready))
        .with_state(h)
}

/// The worker catalog; the caller guards it.
fn catalog() -> Router<Handles> {
    Router::new()
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
}

/// Replica-sync peers, on both listeners; changes need the token.
fn replica_sync(h: &Handles) -> Router<Handles> {
    let token = axum::middleware::from_fn_with_state(h.clone(), auth::require_token);
    Router::new()
        .route("/replica_sync/peers", get(replica::peers))
        .merge(
            Router::new()
                .route("/replica_sync/register_peer", post(replica::register))
                .route("/replica_sync/deregister_peer", post(replica::deregister))
                .route_layer(token),
        )
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
