//! `GET /health`, `GET /ready`, `GET /metrics`.

use super::json_response;
use super::poll::LastPoll;
use super::views::{NotReadyView, NotReadyWorker, ReadyView};
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::recovery::Recovering;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use std::sync::Arc;

pub(super) async fn ready(
    State(fleet): State<Arc<Mutex<Fleet>>>,
    State(recovering): State<Recovering>,
) -> Response {
    let f = fleet.lock();
    if f.up_count() > 0 && !recovering.under_way() {
        return json_response(
            StatusCode::OK,
            &ReadyView {
                status: "ready".into(),
                workers_up: f.up_count(),
            },
        );
    }
    // The workers that are not up, and why.
    let workers = f
        .workers()
        .values()
        .filter(|w| !w.health().up)
        .map(|w| NotReadyWorker {
            worker_id: w.spec().worker_id,
            reason: w
                .health()
                .last_error
                .clone()
                .unwrap_or_else(|| "no successful metrics scrape yet".into()),
        })
        .collect();
    let reason = if recovering.under_way() {
        "recovering the prefix index from [indexer] peers"
    } else {
        "no schedulable worker"
    };
    json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        &NotReadyView {
            status: "not ready".into(),
            reason: reason.into(),
            workers,
        },
    )
}

pub(super) async fn metrics(
    State(metrics): State<Arc<Metrics>>,
    State(last_poll): State<LastPoll>,
) -> Response {
    metrics.snapshot.age.set(last_poll.age().as_secs_f64());
    (
        StatusCode::OK,
        [("content-type", "text/plain; version=0.0.4")],
        metrics.render(),
    )
        .into_response()
}
