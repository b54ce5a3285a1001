//! Whole-index reads: `GET /dump` and the reset frame of `GET
//! /v1/snapshot` (a new reader, or one from another epoch). Each is a copy
//! of the whole index, hundreds of MB on a large fleet, and it lives as
//! long as its client takes to read it: a dozen slow readers used to hold
//! a copy each.
//!
//! So a copy is encoded once into [`Bytes`] and each reader is sent
//! slices of it. The latest copy is served again while it is younger than
//! `server.full_read_reuse_ms` (under ingest the index changes every few
//! milliseconds, so one copy per version would share nothing), and
//! readers arriving while one is built wait for it. Readers are capped at
//! `server.max_full_reads` at once, and so are the copies they hold:
//! readers spaced wider than the reuse age each used to get a copy of
//! their own, so once `server.max_full_read_copies` are alive a new
//! reader is sent the newest of them, however old (it catches up as from
//! any reused copy), instead of a new one. Readers with the control token
//! (Envoy's polls, recovering peers) have caps of the same size, and
//! copies, to themselves, so that anyone else filling theirs, or holding
//! an old copy by reading it slowly, can neither lock the gateway out nor
//! keep it on stale state. One reader over a cap is answered 503 with
//! `Retry-After`, counted, and logged the first time.

use super::error;
use crate::config::Server;
use crate::metrics::ListenerMetrics;
use axum::body::Body as AxumBody;
use axum::http::StatusCode;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use prometheus::{IntCounter, IntGauge};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// What a connection is handed at a time: a slice of the shared copy, so
/// that what one reader's connection buffers stays small however slowly
/// it reads.
const CHUNK: usize = 64 << 10;
/// A copy reaches a reader that reads in well under a second.
const RETRY_AFTER_S: u32 = 1;

/// Which whole-index copy a read takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whole {
    /// `GET /dump`, the recovery format.
    Dump,
    /// The reset frame of `GET /v1/snapshot`.
    SnapshotReset,
}

impl Whole {
    const ALL: [Whole; 2] = [Whole::Dump, Whole::SnapshotReset];

    fn label(self) -> &'static str {
        match self {
            Whole::Dump => "dump",
            Whole::SnapshotReset => "snapshot_reset",
        }
    }

    fn index(self) -> usize {
        match self {
            Whole::Dump => 0,
            Whole::SnapshotReset => 1,
        }
    }
}

/// The latest copy of one kind for one class of readers, and when the
/// state it holds was taken.
struct Latest {
    taken: Instant,
    generation: u64,
    copy: Arc<Copy>,
}

/// One encoded copy of the index; the gauge of copies alive counts it
/// until the last reader and the cache let go.
struct Copy {
    bytes: Bytes,
    alive: IntGauge,
}

impl Drop for Copy {
    fn drop(&mut self) {
        self.alive.dec();
    }
}

/// What a reader is sent: the copy's bytes, holding the copy alive as
/// long as any slice of them is.
struct Held(Arc<Copy>);

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes
    }
}

impl Copy {
    fn handle(self: &Arc<Copy>) -> Bytes {
        Bytes::from_owner(Held(self.clone()))
    }
}

/// One class of readers' copies of one kind.
#[derive(Default)]
struct Copies {
    latest: Option<Latest>,
    /// Every copy made for the class, oldest first, while it lives.
    alive: Vec<Weak<Copy>>,
}

/// One kind's copies, per class of readers (without the control token,
/// with it), and its series.
struct Slot {
    classes: [Mutex<Copies>; 2],
    generations: AtomicU64,
    open: IntGauge,
    refused: IntCounter,
    copies: IntCounter,
    alive: IntGauge,
}

/// Shares whole-index copies between readers and caps the readers and
/// the copies.
pub struct FullReads {
    reuse: Duration,
    max_readers: u32,
    max_copies: usize,
    /// Places for readers without the control token, and for those with it.
    readers: [Arc<Semaphore>; 2],
    slots: [Arc<Slot>; 2],
    warned: AtomicBool,
}

/// A reader's place among those its cap counts, given back when its
/// answer is sent or dropped.
pub(super) struct Place {
    what: Whole,
    class: usize,
    _permit: OwnedSemaphorePermit,
}

/// A reader over `server.max_full_reads`.
#[derive(Debug, thiserror::Error)]
#[error("{max} whole-index reads are being sent already (server.max_full_reads); retry shortly")]
pub(super) struct Busy {
    max: u32,
}

impl IntoResponse for Busy {
    fn into_response(self) -> Response {
        let mut r = error(StatusCode::SERVICE_UNAVAILABLE, &self);
        r.headers_mut().insert(RETRY_AFTER, RETRY_AFTER_S.into());
        r
    }
}

impl FullReads {
    pub fn new(server: &Server, metrics: &ListenerMetrics) -> FullReads {
        let slot = |w: Whole| {
            Arc::new(Slot {
                classes: Default::default(),
                generations: AtomicU64::new(0),
                open: metrics.full_reads_open.with_label_values(&[w.label()]),
                refused: metrics.full_reads_refused.with_label_values(&[w.label()]),
                copies: metrics.full_read_copies.with_label_values(&[w.label()]),
                alive: metrics
                    .full_read_copies_alive
                    .with_label_values(&[w.label()]),
            })
        };
        FullReads {
            reuse: server.full_read_reuse,
            max_readers: server.max_full_reads,
            max_copies: server.max_full_read_copies.max(1) as usize,
            readers: [(); 2].map(|()| Arc::new(Semaphore::new(server.max_full_reads as usize))),
            slots: Whole::ALL.map(slot),
            warned: AtomicBool::new(false),
        }
    }

    fn slot(&self, what: Whole) -> &Arc<Slot> {
        &self.slots[what.index()]
    }

    /// A place for a reader, before anything is built for it, under the
    /// cap of readers with the control token when it holds it.
    pub(super) fn admit(&self, what: Whole, holds_token: bool) -> Result<Place, Busy> {
        let class = usize::from(holds_token);
        match self.readers[class].clone().try_acquire_owned() {
            Ok(permit) => Ok(Place {
                what,
                class,
                _permit: permit,
            }),
            Err(_) => {
                self.slot(what).refused.inc();
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        what = what.label(),
                        max_full_reads = self.max_readers,
                        holds_token,
                        "a whole-index read was refused: server.max_full_reads are being sent to readers like it (with the control token, or without) (counted in kvgate_sidecar_full_reads_refused_total; logged once)"
                    );
                }
                Err(Busy {
                    max: self.max_readers,
                })
            }
        }
    }

    /// The latest copy of the reader's class when it is young enough,
    /// else the newest alive when the class has `max_copies` alive, else
    /// the one `build` makes. One build at a time per kind and class;
    /// callers that arrive during it wait and share its copy when it is
    /// young enough for them.
    pub(super) async fn copy<E, F>(
        &self,
        place: &Place,
        build: impl FnOnce() -> F,
    ) -> Result<Bytes, E>
    where
        F: Future<Output = Result<Bytes, E>>,
    {
        let asked = Instant::now();
        let slot = self.slot(place.what);
        let mut copies = slot.classes[place.class].lock().await;
        if let Some(l) = copies.latest.as_ref()
            && l.taken + self.reuse >= asked
        {
            return Ok(l.copy.handle());
        }
        copies.alive.retain(|c| c.strong_count() > 0);
        if copies.alive.len() >= self.max_copies
            && let Some(newest) = copies.alive.iter().rev().find_map(Weak::upgrade)
        {
            return Ok(newest.handle());
        }
        let taken = Instant::now();
        let bytes = build().await?;
        slot.copies.inc();
        slot.alive.inc();
        let copy = Arc::new(Copy {
            bytes,
            alive: slot.alive.clone(),
        });
        copies.alive.push(Arc::downgrade(&copy));
        copies.latest = None;
        if !self.reuse.is_zero() {
            let generation = slot.generations.fetch_add(1, Ordering::Relaxed);
            copies.latest = Some(Latest {
                taken,
                generation,
                copy: copy.clone(),
            });
            // The cache lets go once the copy is too old to serve, so an
            // idle sidecar keeps no copy; readers still sending hold it.
            let (slot, class, age) = (slot.clone(), place.class, self.reuse);
            tokio::spawn(async move {
                tokio::time::sleep_until(taken + age).await;
                let mut copies = slot.classes[class].lock().await;
                if copies
                    .latest
                    .as_ref()
                    .is_some_and(|l| l.generation == generation)
                {
                    copies.latest = None;
                }
            });
        }
        Ok(copy.handle())
    }

    /// The answer sending `bytes` to a reader holding `place`.
    pub(super) fn respond(&self, place: Place, bytes: Bytes) -> Response {
        let open = self.slot(place.what).open.clone();
        open.inc();
        let body = Shared {
            rest: bytes,
            _place: place,
            open,
        };
        (
            StatusCode::OK,
            [(CONTENT_TYPE, "application/octet-stream")],
            AxumBody::new(body),
        )
            .into_response()
    }
}

/// A response body of slices of one shared copy. Its exact length is
/// known, so the answer carries a `Content-Length`.
struct Shared {
    rest: Bytes,
    _place: Place,
    open: IntGauge,
}

impl Body for Shared {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if this.rest.is_empty() {
            return Poll::Ready(None);
        }
        let n = this.rest.len().min(CHUNK);
        Poll::Ready(Some(Ok(Frame::data(this.rest.split_to(n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.rest.len() as u64)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.open.dec();
    }
}

#[cfg(test)]
mod tests;
