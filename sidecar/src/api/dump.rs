//! `GET /dump`: the prefix index in the recovery format of
//! `sources::kv::dump`, for a peer starting up (`[indexer] peers`).
//!
//! The index thread only copies its tables; the sort and the encoding run
//! on a blocking thread, so ingest waits for the copy alone. A sidecar
//! still recovering answers 503: its index is not what it will be, and the
//! peer asking goes on to its next peer.

use super::Backend;
use super::error;
use crate::sources::kv::dump;
use crate::sources::kv::plane::DumpUnavailable;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Instant;

pub(super) async fn dump(State(sc): State<Arc<dyn Backend>>) -> Response {
    let _turn = sc.dump_turn().lock().await;
    let started = Instant::now();
    let snapshot = match sc.plane().dump().await {
        Ok(d) => d,
        Err(e @ DumpUnavailable::Recovering) => {
            let mut r = error(StatusCode::SERVICE_UNAVAILABLE, e);
            r.headers_mut().insert(RETRY_AFTER, 1.into());
            return r;
        }
        Err(e @ DumpUnavailable::NoAnswer) => return error(StatusCode::SERVICE_UNAVAILABLE, e),
    };
    let copied = started.elapsed();
    let blocks = snapshot.blocks();
    let bytes = match tokio::task::spawn_blocking(move || dump::encode(snapshot)).await {
        Ok(b) => b,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    tracing::debug!(
        blocks,
        bytes = bytes.len(),
        copy_ms = copied.as_secs_f64() * 1e3,
        total_ms = started.elapsed().as_secs_f64() * 1e3,
        "index dumped"
    );
    (
        StatusCode::OK,
        [(CONTENT_TYPE, "application/octet-stream")],
        bytes,
    )
        .into_response()
}
