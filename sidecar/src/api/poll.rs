//! `GET /v1/snapshot`: the long poll of Envoy's snapshot service.
//!
//! A reset frame (a new reader, or one from another epoch) is the whole
//! index: it is shared between readers and capped as `/dump` is
//! (`full_read`). A reader that catches up from a reused one, a moment
//! older than the current state, gets the rest with its next poll.

use super::Backend;
use super::auth::holds_token;
use super::error;
use super::full_read::Whole;
use crate::publish;
use axum::extract::Query;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
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
    headers: HeaderMap,
) -> Response {
    if publish::frame::is_reset(sc.versions(), q.after, q.epoch) {
        return reset(sc, &headers).await;
    }
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
            answered(&*sc);
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

/// A reset frame, from the shared copy.
async fn reset(sc: Arc<dyn Backend>, headers: &HeaderMap) -> Response {
    let reads = sc.full_reads();
    let place = match reads.admit(Whole::SnapshotReset, holds_token(&*sc, headers)) {
        Ok(p) => p,
        Err(busy) => return busy.into_response(),
    };
    let build = || {
        let sc = sc.clone();
        async move {
            // Encoding the whole index takes long enough to keep off the
            // runtime's threads.
            tokio::task::spawn_blocking(move || {
                publish::frame::frame(sc.versions(), sc.store(), Some(sc.shards()), 0, 0)
                    .map(Bytes::from)
                    .unwrap_or_default()
            })
            .await
            .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e))
        }
    };
    match reads.copy(&place, build).await {
        Ok(frame) => {
            answered(&*sc);
            let mut r = reads.respond(place, frame);
            version_headers(&mut r, &*sc);
            r
        }
        Err(r) => r,
    }
}

fn answered(sc: &dyn Backend) {
    sc.metrics()
        .snapshot
        .polls
        .with_label_values(&["changed"])
        .inc();
    sc.polled();
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
