//! `GET /health`, `GET /ready`, `GET /metrics`.

use super::Backend;
use super::json_response;
use super::views::{NotReadyView, NotReadyWorker, ReadyView};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

pub(super) async fn ready(State(sc): State<Arc<dyn Backend>>) -> Response {
    let f = sc.fleet();
    if f.up_count() > 0 && !sc.recovering() {
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
    let reason = if sc.recovering() {
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

pub(super) async fn metrics(State(sc): State<Arc<dyn Backend>>) -> Response {
    sc.metrics().snapshot.age.set(sc.poll_age().as_secs_f64());
    (
        StatusCode::OK,
        [("content-type", "text/plain; version=0.0.4")],
        sc.metrics().render(),
    )
        .into_response()
}
