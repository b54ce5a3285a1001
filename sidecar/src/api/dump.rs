//! `GET /dump`: the prefix index in the recovery format of
//! `sources::kv::dump`, for a peer starting up (`[indexer] peers`).
//!
//! The index thread only copies its tables; the sort and the encoding run
//! on a blocking thread, so ingest waits for the copy alone. The encoded
//! dump is shared between readers (`full_read`). With a control token the
//! route requires it: a dump tells what every engine caches. A sidecar
//! still recovering answers 503: its index is not what it will be, and the
//! peer asking goes on to its next peer.

use super::auth::holds_token;
use super::error;
use super::full_read::{FullReads, Whole};
use crate::config::Config;
use crate::sources::kv::dump;
use crate::sources::kv::plane::{DumpUnavailable, Plane};
use axum::extract::State;
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Instant;

pub(super) async fn dump(
    State(reads): State<Arc<FullReads>>,
    State(config): State<Arc<Config>>,
    State(plane): State<Arc<Plane>>,
    headers: HeaderMap,
) -> Response {
    let place = match reads.admit(Whole::Dump, holds_token(&config, &headers)) {
        Ok(p) => p,
        Err(busy) => return busy.into_response(),
    };
    match reads.copy(&place, || encode(&plane)).await {
        Ok(bytes) => reads.respond(place, bytes),
        Err(r) => r,
    }
}

/// A new dump of the index, or the answer saying why there is none.
async fn encode(plane: &Plane) -> Result<Bytes, Response> {
    let started = Instant::now();
    let snapshot = match plane.dump().await {
        Ok(d) => d,
        Err(e @ DumpUnavailable::Recovering) => {
            let mut r = error(StatusCode::SERVICE_UNAVAILABLE, e);
            r.headers_mut().insert(RETRY_AFTER, 1.into());
            return Err(r);
        }
        Err(e @ DumpUnavailable::NoAnswer) => {
            return Err(error(StatusCode::SERVICE_UNAVAILABLE, e));
        }
    };
    let copied = started.elapsed();
    let blocks = snapshot.blocks();
    let bytes = tokio::task::spawn_blocking(move || dump::encode(snapshot))
        .await
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e))?;
    tracing::debug!(
        blocks,
        bytes = bytes.len(),
        copy_ms = copied.as_secs_f64() * 1e3,
        total_ms = started.elapsed().as_secs_f64() * 1e3,
        "index dumped"
    );
    Ok(Bytes::from(bytes))
}
