//! `GET /v1/snapshot`: the long poll of Envoy's snapshot service.

use super::Backend;
use crate::publish;
use axum::extract::Query;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvgate_core::header;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;

/// The longest a long poll is held, whatever the client asks.
const MAX_WAIT: Duration = Duration::from_secs(10);
// The listeners' idle timeout is validated against the longest poll.
const _: () = assert!(MAX_WAIT.as_secs() <= crate::config::LONGEST_LONG_POLL.as_secs());

#[derive(Debug, Deserialize)]
pub(super) struct PollQuery {
    #[serde(default)]
    after: u64,
    #[serde(default)]
    epoch: u64,
    #[serde(default)]
    wait_ms: u64,
}

pub(super) async fn snapshot(
    State(sc): State<Arc<dyn Backend>>,
    Query(q): Query<PollQuery>,
) -> Response {
    let wait = Duration::from_millis(q.wait_ms).min(MAX_WAIT);
    let deadline = tokio::time::Instant::now() + wait;
    let mut rx = sc.versions().subscribe();
    loop {
        rx.borrow_and_update();
        if let Some(frame) = publish::frame::frame(
            sc.versions(),
            sc.store(),
            Some(sc.shards()),
            q.after,
            q.epoch,
        ) {
            sc.metrics()
                .snapshot
                .polls
                .with_label_values(&["changed"])
                .inc();
            sc.polled();
            let mut r = (
                StatusCode::OK,
                [("content-type", "application/octet-stream")],
                frame,
            )
                .into_response();
            version_headers(&mut r, &*sc);
            return r;
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            sc.metrics()
                .snapshot
                .polls
                .with_label_values(&["timeout"])
                .inc();
            sc.polled();
            let mut r = StatusCode::NO_CONTENT.into_response();
            version_headers(&mut r, &*sc);
            return r;
        }
    }
}

fn version_headers(r: &mut Response, sc: &dyn Backend) {
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&sc.versions().current().to_string()) {
        h.insert(header::VERSION, v);
    }
    if let Ok(v) = HeaderValue::from_str(&sc.versions().epoch.to_string()) {
        h.insert(header::EPOCH, v);
    }
}
