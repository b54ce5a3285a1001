//! The HTTP listeners' accept loop, in place of `axum::serve`, which
//! neither caps connections nor closes a silent one: thousands of idle or
//! slowloris sockets used to take every file descriptor, starving the
//! sidecar's own scrapes, GPU readings and sockets.
//!
//! Each listener holds at most `max_connections`. At the cap a new
//! connection takes the slot of the one that has waited longest for a
//! request head, or is closed at once when every connection has a request
//! in flight (counted, logged now and then), so the descriptors inbound
//! clients hold stay bounded and a flood of silent sockets cannot shut
//! out new clients. The last `reserved_connections` slots serve only
//! probes and token holders ([`slots`]). A per-connection watchdog closes
//! a connection whose request head is late (`header_read_timeout`), one
//! kept alive with no request, or one with a request in flight and no
//! byte moving either way (`idle_timeout`, longer than any long poll).
//! Request bodies are read under the listener's byte budget and
//! `body_timeout` ([`body`]).

mod activity;
mod body;
mod slots;

use super::auth::bears;
use super::error;
use crate::config::ListenerLimits;
use crate::metrics::ListenerSeries;
use activity::{Activity, Expiry, InFlight};
use axum::Router;
use axum::http::header::{CONNECTION, RETRY_AFTER};
use axum::http::{HeaderValue, StatusCode};
use body::BodyBudget;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use slots::{Slot, Slots};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// A refusal is logged at most this often; the counter has the rest.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);
/// Pause after a failed accept (out of descriptors, mostly), so the loop
/// does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// What the kubelet and Prometheus call: served on the reserved share.
const PROBES: [&str; 3] = ["/health", "/ready", "/metrics"];

/// Serves `app` on `listener` within `limits` until `shutdown` resolves,
/// then lets the open connections finish. `name` labels its series and
/// logs; `token` is the control token, whose holders are served on the
/// reserved share of the cap and read bodies under a budget of their own.
pub async fn serve(
    listener: TcpListener,
    name: &'static str,
    app: Router,
    limits: ListenerLimits,
    token: Option<String>,
    series: ListenerSeries,
    shutdown: impl Future<Output = ()> + Send,
) {
    let slots = Arc::new(Slots::new(&limits, series.clone()));
    let gate = Arc::new(Gate {
        token,
        bodies: BodyBudget::new(limits.body_budget_bytes, limits.body_timeout, &series),
        limits,
        series: series.clone(),
    });
    tracing::debug!(
        listener = name,
        max_connections = limits.max_connections,
        reserved = slots.reserved(),
        body_budget_bytes = limits.body_budget_bytes,
        "listener slots"
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut refusals = RefusalLog::default();
    let mut accept_errors = RefusalLog::default();
    let app = TowerToHyperService::new(app);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    if let Some(n) = accept_errors.due() {
                        tracing::warn!(listener = name, error = %e, failures = n, "cannot accept a connection");
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let activity = Arc::new(Activity::new());
        let Some(slot) = slots.admit(activity.clone()) else {
            // Dropping the stream closes it: the descriptor is back at once.
            drop(stream);
            series.refused.inc();
            if let Some(n) = refusals.due() {
                tracing::warn!(
                    listener = name,
                    %peer,
                    max_connections = limits.max_connections,
                    refused = n,
                    "connection refused: the listener is at max_connections, each with a request in flight"
                );
            }
            continue;
        };
        // Long-poll answers and bookings are small writes; Nagle would hold
        // them for the peer's delayed ACK.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
        }
        let (app, gate, stop) = (app.clone(), gate.clone(), stop_rx.clone());
        tokio::spawn(async move {
            connection(stream, app, activity, &slot, gate, stop).await;
            drop(slot);
        });
    }
    let _ = stop_tx.send(true);
    slots.drained().await;
}

/// What every connection and request on a listener is held to.
struct Gate {
    token: Option<String>,
    bodies: BodyBudget,
    limits: ListenerLimits,
    series: ListenerSeries,
}

impl Gate {
    fn holds_token(&self, req: &hyper::Request<Incoming>) -> bool {
        self.token
            .as_deref()
            .is_some_and(|t| bears(t, req.headers()))
    }
}

/// The answer to a request on a reserved slot that is neither a probe nor
/// a token holder's.
fn reserved_only() -> axum::response::Response {
    let mut r = error(
        StatusCode::SERVICE_UNAVAILABLE,
        "the listener is at max_connections but for the slots kept for probes and the control token's holders; retry shortly",
    );
    r.headers_mut().insert(RETRY_AFTER, 1.into());
    r.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Serves one connection until it ends, times out, is evicted or the
/// listener stops.
async fn connection(
    stream: TcpStream,
    app: TowerToHyperService<Router>,
    activity: Arc<Activity>,
    slot: &Slot,
    gate: Arc<Gate>,
    mut stop: watch::Receiver<bool>,
) {
    let (limits, series) = (gate.limits, gate.series.clone());
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let reserved = slot.reserved;
    let svc = {
        let activity = activity.clone();
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let guard = InFlight::begin(activity.clone());
            let holds_token = gate.holds_token(&req);
            let refused = reserved && !holds_token && !PROBES.contains(&req.uri().path());
            let gate = gate.clone();
            let app = app.clone();
            async move {
                let resp = if refused {
                    gate.series.refused_reserved.inc();
                    reserved_only()
                } else {
                    let (parts, body) = req.into_parts();
                    let (body, verdict) = gate.bodies.wrap(body, holds_token);
                    let req = hyper::Request::from_parts(parts, axum::body::Body::new(body));
                    let resp = hyper::service::Service::call(&app, req).await?;
                    verdict.answer(resp)
                };
                Ok::<_, Infallible>(resp.map(|body| GuardedBody {
                    body,
                    _guard: guard,
                }))
            }
        })
    };
    let builder = auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection_with_upgrades(io, svc);
    tokio::pin!(conn);
    let tick = (limits.header_read_timeout.min(limits.idle_timeout) / 4)
        .clamp(Duration::from_millis(5), Duration::from_secs(1));
    let mut stopping = *stop.borrow();
    if stopping {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            () = tokio::time::sleep(tick) => {
                match activity.expired(&limits) {
                    Some(Expiry::Header) => series.header_timeouts.inc(),
                    Some(Expiry::Idle) => series.idle_timeouts.inc(),
                    None => continue,
                }
                // Dropping the connection closes the socket; a client this
                // slow gets no graceful goodbye.
                return;
            }
            // Its slot is a newer connection's already (counted there).
            () = activity.evicted() => return,
            r = stop.changed(), if !stopping => {
                stopping = true;
                if r.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// A response body that holds its request in flight until hyper has
/// written it all (or dropped it).
struct GuardedBody {
    body: axum::body::Body,
    _guard: InFlight,
}

impl Body for GuardedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The accepted socket, noting when bytes move.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Logs the first event, then at most once per [`REFUSAL_LOG_EVERY`].
#[derive(Default)]
struct RefusalLog {
    last: Option<Instant>,
    since: u64,
}

impl RefusalLog {
    /// Counts an event; the count since the last log when this one is due.
    fn due(&mut self) -> Option<u64> {
        self.since += 1;
        let now = Instant::now();
        if self.last.is_some_and(|t| now < t + REFUSAL_LOG_EVERY) {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since))
    }
}

/// The soft limit on open files, read from `/proc/self/limits` (the
/// sidecar forbids the `unsafe` a `getrlimit` call needs).
pub fn open_files_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    parse_open_files_limit(&text)
}

fn parse_open_files_limit(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The largest cap a listener gets under a soft file limit of `nofile`:
/// a quarter, so that two listeners at their caps leave half the
/// descriptors to the sidecar's own sockets and files.
pub fn cap_for_file_limit(configured: u32, nofile: Option<u64>) -> u32 {
    match nofile {
        Some(n) => configured.min(u32::try_from(n / 4).unwrap_or(u32::MAX).max(1)),
        None => configured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_a_quarter_of_the_file_limit_at_most() {
        assert_eq!(cap_for_file_limit(1024, Some(1024)), 256);
        assert_eq!(cap_for_file_limit(1024, Some(1 << 20)), 1024);
        assert_eq!(cap_for_file_limit(1024, Some(2)), 1);
        assert_eq!(cap_for_file_limit(1024, None), 1024);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             63335                63335                processes \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_open_files_limit(limits), Some(1024));
    }

    #[test]
    fn refusals_are_logged_first_then_rate_limited() {
        let mut l = RefusalLog::default();
        assert_eq!(l.due(), Some(1));
        assert_eq!(l.due(), None);
        assert_eq!(l.due(), None);
    }
}
