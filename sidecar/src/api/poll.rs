//! `GET /v1/snapshot`: the long poll of Envoy's snapshot service.
//!
//! A reset frame (a new reader, or one from another epoch) is the whole
//! index: it is shared between readers and capped as `/dump` is
//! (`full_read`). A reader that catches up from a reused one, a moment
//! older than the current state, gets the rest with its next poll.

use super::Handles;
use super::auth::holds_token;
use super::error;
use super::full_read::{FullReads, Whole};
use crate::clock::now_ms;
use crate::config::Config;
use crate::metrics::SnapshotMetrics;
use crate::publish::{self, ShardLog, SnapshotStore, Versions};
use axum::extract::{FromRef, Query, State};
use axum::http::StatusCode;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvgate_core::header;
use serde::Deserialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The longest a long poll is held, whatever the client asks.
const MAX_WAIT: Duration = Duration::from_secs(10);
// The listeners' idle timeout is validated against the longest poll.
const _: () = assert!(MAX_WAIT.as_secs() <= crate::config::LONGEST_LONG_POLL.as_secs());

/// When a gateway's long poll was last answered: `/metrics` tells how
/// long Envoy has gone without hearing from the sidecar.
#[derive(Debug, Clone)]
pub struct LastPoll(Arc<AtomicU64>);

impl LastPoll {
    /// Answered now, as far as a sidecar starting up can tell.
    pub(crate) fn now() -> LastPoll {
        LastPoll(Arc::new(AtomicU64::new(now_ms())))
    }

    fn answered(&self) {
        self.0.store(now_ms(), Ordering::Relaxed);
    }

    pub(super) fn age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.0.load(Ordering::Relaxed)))
    }
}

/// What a long poll reads (what is published; the token, as holders get
/// reset frames of their own) and where it counts its answers.
#[derive(Clone)]
pub(super) struct Poll {
    versions: Arc<Versions>,
    store: Arc<SnapshotStore>,
    shards: Arc<ShardLog>,
    full_reads: Arc<FullReads>,
    config: Arc<Config>,
    metrics: Arc<SnapshotMetrics>,
    last: LastPoll,
}

impl FromRef<Handles> for Poll {
    fn from_ref(h: &Handles) -> Poll {
        Poll {
            versions: FromRef::from_ref(h),
            store: FromRef::from_ref(h),
            shards: FromRef::from_ref(h),
            full_reads: FromRef::from_ref(h),
            config: FromRef::from_ref(h),
            metrics: FromRef::from_ref(h),
            last: FromRef::from_ref(h),
        }
    }
}

impl Poll {
    fn frame(&self, after: u64, epoch: u64) -> Option<Vec<u8>> {
        publish::frame::frame(
            &self.versions,
            &self.store,
            Some(&self.shards),
            after,
            epoch,
        )
    }

    fn answered(&self, result: &str) {
        self.metrics.polls.with_label_values(&[result]).inc();
        self.last.answered();
    }

    fn version_headers(&self, r: &mut Response) {
        let h = r.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&self.versions.current().to_string()) {
            h.insert(header::VERSION, v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.versions.epoch.to_string()) {
            h.insert(header::EPOCH, v);
        }
    }
}

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
    State(p): State<Poll>,
    Query(q): Query<PollQuery>,
    headers: HeaderMap,
) -> Response {
    if publish::frame::is_reset(&p.versions, q.after, q.epoch) {
        return reset(p, &headers).await;
    }
    let wait = Duration::from_millis(q.wait_ms).min(MAX_WAIT);
    let deadline = tokio::time::Instant::now() + wait;
    let mut rx = p.versions.subscribe();
    loop {
        rx.borrow_and_update();
        if let Some(frame) = p.frame(q.after, q.epoch) {
            p.answered("changed");
            let mut r = (
                StatusCode::OK,
                [("content-type", "application/octet-stream")],
                frame,
            )
                .into_response();
            p.version_headers(&mut r);
            return r;
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            p.answered("timeout");
            let mut r = StatusCode::NO_CONTENT.into_response();
            p.version_headers(&mut r);
            return r;
        }
    }
}

/// A reset frame, from the shared copy.
async fn reset(p: Poll, headers: &HeaderMap) -> Response {
    let reads = &p.full_reads;
    let place = match reads.admit(Whole::SnapshotReset, holds_token(&p.config, headers)) {
        Ok(place) => place,
        Err(busy) => return busy.into_response(),
    };
    let build = || {
        let p = p.clone();
        async move {
            // Encoding the whole index takes long enough to keep off the
            // runtime's threads.
            tokio::task::spawn_blocking(move || p.frame(0, 0).map(Bytes::from).unwrap_or_default())
                .await
                .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e))
        }
    };
    match reads.copy(&place, build).await {
        Ok(frame) => {
            p.answered("changed");
            let mut r = reads.respond(place, frame);
            p.version_headers(&mut r);
            r
        }
        Err(r) => r,
    }
}
