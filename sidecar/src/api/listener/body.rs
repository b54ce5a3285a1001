//! Request bodies under a listener's byte budget and a deadline.
//!
//! Every route buffers its body whole (`Bytes` extractors, 2 MiB at most),
//! and nothing bounded the bodies being read at once: 1024 connections
//! each sending a 2 MB body at 32 KiB/s kept moving bytes, so no timeout
//! fired, and held 2.3 GB. So the listener reads each body into one
//! buffer of its own, grown as bytes arrive and paid for from the
//! listener's budget (by capacity, which is what the allocator holds);
//! a body that would pass the budget is refused 503, one not whole within
//! `body_timeout` of its head 408, and either way its buffer is dropped
//! at once. The route is handed the body as one frame. Requests with the
//! control token pay from a budget of their own, so that nobody without
//! it can shut out the filter's bookings.

use super::super::error;
use crate::metrics::ListenerSeries;
use axum::http::header::{CONNECTION, RETRY_AFTER};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use prometheus::{IntCounter, IntGauge};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

/// The largest body any route takes: axum's default limit, which every
/// route keeps.
pub(super) const MAX_BODY: usize = 2 << 20;
/// A buffer's first size when the body declares no length: most bodies
/// (selections, bookings) fit.
const FIRST_BUFFER: usize = 16 << 10;
/// What each body holds without paying from the budget: a small body
/// (a selection, a booking batch) is never refused for want of budget,
/// whatever slow bodies hold. At most `max_connections` of these are
/// held at once (16 MiB at the default 1024).
pub(super) const FREE_BYTES: usize = FIRST_BUFFER;
/// A body over the budget is asked to come back shortly.
const RETRY_AFTER_S: u32 = 1;

/// One listener's budgets, and what it counts.
pub(super) struct BodyBudget {
    /// Bytes for requests without the control token, and with it.
    pools: [Arc<Semaphore>; 2],
    budget: u64,
    timeout: Duration,
    held: IntGauge,
    refused: Refusals,
}

#[derive(Clone)]
struct Refusals {
    budget: IntCounter,
    timeout: IntCounter,
    too_large: IntCounter,
}

impl BodyBudget {
    pub(super) fn new(budget: u64, timeout: Duration, series: &ListenerSeries) -> BodyBudget {
        let permits = usize::try_from(budget)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        BodyBudget {
            pools: [(); 2].map(|()| Arc::new(Semaphore::new(permits))),
            budget,
            timeout,
            held: series.body_bytes.clone(),
            refused: Refusals {
                budget: series.refused_body_budget.clone(),
                timeout: series.refused_body_timeout.clone(),
                too_large: series.refused_body_too_large.clone(),
            },
        }
    }

    /// `body` as the route reads it, paid for from the budget of its
    /// class; the verdict says, once the route has answered, whether the
    /// body was refused and the answer is to be replaced.
    pub(super) fn wrap(&self, body: Incoming, holds_token: bool) -> (Budgeted, Verdict) {
        let verdict = Verdict(Arc::new(AtomicU8::new(Refusal::None as u8)));
        let declared = body.size_hint().exact();
        let body = Budgeted {
            inner: body,
            pool: self.pools[usize::from(holds_token)].clone(),
            budget: self.budget,
            permit: None,
            buf: Vec::new(),
            declared,
            deadline: Box::pin(tokio::time::sleep(self.timeout)),
            done: false,
            held: self.held.clone(),
            refused: self.refused.clone(),
            verdict: verdict.clone(),
        };
        (body, verdict)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Refusal {
    None = 0,
    Budget = 1,
    Timeout = 2,
    TooLarge = 3,
}

/// Why a body was refused, if it was; shared between the body and the
/// request's answer.
#[derive(Clone)]
pub(super) struct Verdict(Arc<AtomicU8>);

impl Verdict {
    fn set(&self, r: Refusal) {
        self.0.store(r as u8, Ordering::Relaxed);
    }

    fn get(&self) -> Refusal {
        match self.0.load(Ordering::Relaxed) {
            1 => Refusal::Budget,
            2 => Refusal::Timeout,
            3 => Refusal::TooLarge,
            _ => Refusal::None,
        }
    }

    /// The route's answer, or, for a refused body, the answer saying why
    /// (the route saw only a failed read); the connection is closed after
    /// it, since the rest of the body is still on the socket.
    pub(super) fn answer(&self, route: Response) -> Response {
        let (status, message) = match self.get() {
            Refusal::None => return route,
            Refusal::Budget => (
                StatusCode::SERVICE_UNAVAILABLE,
                "the listener holds its body_budget_bytes of request bodies being read; retry shortly",
            ),
            Refusal::Timeout => (
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive within body_timeout_ms of its head",
            ),
            Refusal::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "the request body is over the 2 MiB limit or the listener's body_budget_bytes",
            ),
        };
        let mut r = error(status, message);
        if status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(RETRY_AFTER, RETRY_AFTER_S.into());
        }
        r.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
        r
    }
}

/// Why a body read failed, for the route's extractor.
#[derive(Debug, thiserror::Error)]
pub(super) enum BodyError {
    #[error("request body refused: {0:?}")]
    Refused(Refusal),
    #[error("request body: {0}")]
    Read(#[from] hyper::Error),
}

/// A request body read whole into one buffer paid for from a budget,
/// under a deadline.
pub(super) struct Budgeted {
    inner: Incoming,
    pool: Arc<Semaphore>,
    budget: u64,
    /// The budget's bytes this body holds: its buffer's capacity.
    permit: Option<OwnedSemaphorePermit>,
    buf: Vec<u8>,
    declared: Option<u64>,
    deadline: Pin<Box<Sleep>>,
    done: bool,
    held: IntGauge,
    refused: Refusals,
    verdict: Verdict,
}

impl Budgeted {
    /// The budget's bytes this body holds.
    fn paid_bytes(&self) -> usize {
        self.permit
            .as_ref()
            .map_or(0, OwnedSemaphorePermit::num_permits)
    }

    /// Gives the buffer and its bytes back.
    fn release(&mut self) {
        self.buf = Vec::new();
        if let Some(p) = self.permit.take() {
            self.held
                .sub(i64::try_from(p.num_permits()).unwrap_or(i64::MAX));
        }
    }

    fn refuse(&mut self, why: Refusal) -> BodyError {
        match why {
            Refusal::Budget => self.refused.budget.inc(),
            Refusal::Timeout => self.refused.timeout.inc(),
            Refusal::TooLarge => self.refused.too_large.inc(),
            Refusal::None => {}
        }
        self.verdict.set(why);
        self.release();
        self.done = true;
        BodyError::Refused(why)
    }

    /// Room for `more` bytes: the buffer grows by doubling (to the
    /// declared length at most), each growth past the free bytes paid
    /// for first.
    fn make_room(&mut self, more: usize) -> Result<(), Refusal> {
        let need = self.buf.len() + more;
        if need <= self.buf.capacity() {
            return Ok(());
        }
        let limit = self.declared.map_or(MAX_BODY, |d| {
            usize::try_from(d).unwrap_or(MAX_BODY).min(MAX_BODY)
        });
        if need > MAX_BODY || need as u64 > self.budget {
            return Err(Refusal::TooLarge);
        }
        let grown = (self.buf.capacity() * 2)
            .max(FIRST_BUFFER)
            .min(limit)
            .max(need);
        let extra = grown
            .saturating_sub(FREE_BYTES)
            .saturating_sub(self.paid_bytes());
        if extra > 0 {
            let more_permits = u32::try_from(extra).map_err(|_| Refusal::TooLarge)?;
            let p = self
                .pool
                .clone()
                .try_acquire_many_owned(more_permits)
                .map_err(|_| Refusal::Budget)?;
            self.held.add(i64::from(more_permits));
            match self.permit.as_mut() {
                Some(held) => held.merge(p),
                None => self.permit = Some(p),
            }
        }
        self.buf.reserve_exact(grown - self.buf.len());
        Ok(())
    }
}

impl Body for Budgeted {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        // A length over what may ever be held is refused unread.
        if this
            .declared
            .is_some_and(|d| d > MAX_BODY as u64 || d > this.budget)
        {
            return Poll::Ready(Some(Err(this.refuse(Refusal::TooLarge))));
        }
        loop {
            if this.deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Some(Err(this.refuse(Refusal::Timeout))));
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    // Trailers mean nothing to any route.
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if let Err(why) = this.make_room(data.len()) {
                        return Poll::Ready(Some(Err(this.refuse(why))));
                    }
                    this.buf.extend_from_slice(&data);
                }
                Some(Err(e)) => {
                    // The client went away or broke the framing: hyper
                    // ends the connection.
                    this.release();
                    this.done = true;
                    return Poll::Ready(Some(Err(e.into())));
                }
                None => {
                    this.done = true;
                    if this.buf.is_empty() {
                        this.release();
                        return Poll::Ready(None);
                    }
                    // The route gets the bytes; the budget pays for
                    // bodies being read, and this one is read.
                    let body = Bytes::from(std::mem::take(&mut this.buf));
                    this.release();
                    return Poll::Ready(Some(Ok(Frame::data(body))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || (self.buf.is_empty() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match self.declared {
            Some(d) if !self.done => SizeHint::with_exact(d),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for Budgeted {
    fn drop(&mut self) {
        self.release();
    }
}
