//! The HTTP listeners' accept loop, in place of `axum::serve`, which
//! neither caps connections nor closes a silent one: thousands of idle or
//! slowloris sockets used to take every file descriptor, starving the
//! sidecar's own scrapes, GPU readings and sockets.
//!
//! Each listener holds at most `max_connections`; one more is accepted and
//! closed at once (counted, logged now and then), so the descriptors
//! inbound clients hold stay bounded. A per-connection watchdog closes a
//! connection whose request head is late (`header_read_timeout`), one kept
//! alive with no request, or one with a request in flight and no byte
//! moving either way (`idle_timeout`, longer than any long poll).

use crate::config::ListenerLimits;
use crate::metrics::ListenerSeries;
use axum::Router;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;

/// A refusal is logged at most this often; the counter has the rest.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);
/// Pause after a failed accept (out of descriptors, mostly), so the loop
/// does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `app` on `listener` within `limits` until `shutdown` resolves,
/// then lets the open connections finish. `name` labels its series and
/// logs.
pub async fn serve(
    listener: TcpListener,
    name: &'static str,
    app: Router,
    limits: ListenerLimits,
    series: ListenerSeries,
    shutdown: impl Future<Output = ()> + Send,
) {
    let cap = limits.max_connections.max(1);
    let permits = Arc::new(Semaphore::new(cap as usize));
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
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Dropping the stream closes it: the descriptor is back at once.
            drop(stream);
            series.refused.inc();
            if let Some(n) = refusals.due() {
                tracing::warn!(
                    listener = name,
                    %peer,
                    max_connections = cap,
                    refused = n,
                    "connection refused: the listener is at max_connections"
                );
            }
            continue;
        };
        // Long-poll answers and bookings are small writes; Nagle would hold
        // them for the peer's delayed ACK.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
        }
        series.open.inc();
        let (app, series, stop) = (app.clone(), series.clone(), stop_rx.clone());
        tokio::spawn(async move {
            connection(stream, app, limits, &series, stop).await;
            series.open.dec();
            drop(permit);
        });
    }
    let _ = stop_tx.send(true);
    // Every connection holds a permit until it ends.
    let _ = permits.acquire_many(cap).await;
}

/// Serves one connection until it ends, times out or the listener stops.
async fn connection(
    stream: TcpStream,
    app: TowerToHyperService<Router>,
    limits: ListenerLimits,
    series: &ListenerSeries,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let svc = {
        let activity = activity.clone();
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let guard = InFlight::begin(activity.clone());
            let fut = hyper::service::Service::call(&app, req);
            async move {
                let resp = fut.await?;
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
            r = stop.changed(), if !stopping => {
                stopping = true;
                if r.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Header,
    Idle,
}

const NEVER: u64 = u64::MAX;

/// What a connection has been doing, in milliseconds since it opened:
/// written by its I/O and its requests, read by its watchdog.
struct Activity {
    opened: Instant,
    /// The last read or write that moved bytes.
    last_io: AtomicU64,
    /// Requests in flight (HTTP/2 may have several).
    in_flight: AtomicU64,
    /// Requests begun since the connection opened.
    requests: AtomicU64,
    /// When the last request ended: the connection waits from then.
    waiting_since: AtomicU64,
    /// The first byte read since then: a request head has started.
    head_started: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            opened: Instant::now(),
            last_io: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            waiting_since: AtomicU64::new(0),
            head_started: AtomicU64::new(NEVER),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(NEVER - 1)
    }

    fn read(&self) {
        let now = self.now();
        self.last_io.store(now, Ordering::Relaxed);
        let _ =
            self.head_started
                .compare_exchange(NEVER, now, Ordering::Relaxed, Ordering::Relaxed);
    }

    fn wrote(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
    }

    fn expired(&self, limits: &ListenerLimits) -> Option<Expiry> {
        self.expired_at(self.now(), limits)
    }

    fn expired_at(&self, now: u64, limits: &ListenerLimits) -> Option<Expiry> {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(NEVER);
        let past = |since: u64, d: Duration| now.saturating_sub(since) >= ms(d);
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            // A long poll writes nothing until it answers; the idle
            // timeout outlasts the longest (validated).
            let last = self.last_io.load(Ordering::Relaxed);
            return past(last, limits.idle_timeout).then_some(Expiry::Idle);
        }
        let waiting = self.waiting_since.load(Ordering::Relaxed);
        // A fresh connection owes its first request head from the start,
        // as nginx's client_header_timeout: connecting and saying nothing
        // is how idle sockets hoard the cap.
        if self.requests.load(Ordering::Relaxed) == 0 {
            return past(waiting, limits.header_read_timeout).then_some(Expiry::Header);
        }
        match self.head_started.load(Ordering::Relaxed) {
            NEVER => past(waiting, limits.idle_timeout).then_some(Expiry::Idle),
            started => past(started, limits.header_read_timeout).then_some(Expiry::Header),
        }
    }
}

/// A request in flight on its connection, until its response body is done.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn begin(a: Arc<Activity>) -> InFlight {
        a.requests.fetch_add(1, Ordering::Relaxed);
        a.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(a)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        let now = a.now();
        a.waiting_since.store(now, Ordering::Relaxed);
        a.head_started.store(NEVER, Ordering::Relaxed);
        a.last_io.store(now, Ordering::Relaxed);
        a.in_flight.fetch_sub(1, Ordering::Relaxed);
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

    fn limits() -> ListenerLimits {
        ListenerLimits {
            header_read_timeout: Duration::from_millis(100),
            idle_timeout: Duration::from_millis(1000),
            max_connections: 8,
        }
    }

    #[test]
    fn a_fresh_connection_owes_its_head_within_the_header_timeout() {
        let a = Activity::new();
        assert_eq!(a.expired_at(99, &limits()), None);
        assert_eq!(a.expired_at(100, &limits()), Some(Expiry::Header));
    }

    #[test]
    fn a_request_in_flight_is_closed_only_when_nothing_moves_for_the_idle_timeout() {
        let a = Arc::new(Activity::new());
        let g = InFlight::begin(a.clone());
        assert_eq!(a.expired_at(999, &limits()), None);
        assert_eq!(a.expired_at(1000, &limits()), Some(Expiry::Idle));
        a.last_io.store(900, Ordering::Relaxed);
        assert_eq!(a.expired_at(1500, &limits()), None);
        drop(g);
    }

    #[test]
    fn a_kept_alive_connection_idles_until_a_head_starts() {
        let a = Arc::new(Activity::new());
        drop(InFlight::begin(a.clone()));
        let ended = a.waiting_since.load(Ordering::Relaxed);
        assert_eq!(a.expired_at(ended + 999, &limits()), None);
        assert_eq!(a.expired_at(ended + 1000, &limits()), Some(Expiry::Idle));
        a.head_started.store(ended + 10, Ordering::Relaxed);
        assert_eq!(a.expired_at(ended + 109, &limits()), None);
        assert_eq!(a.expired_at(ended + 110, &limits()), Some(Expiry::Header));
    }

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
