//! What a connection has been doing, written by its I/O and its requests
//! and read by its watchdog and by the eviction of waiting connections.

use crate::config::ListenerLimits;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expiry {
    Header,
    Idle,
}

const NEVER: u64 = u64::MAX;

/// A connection's activity, in milliseconds since it opened.
pub(super) struct Activity {
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
    /// Woken when the listener closes this connection to make room.
    evicted: Notify,
}

impl Activity {
    pub(super) fn new() -> Activity {
        Activity {
            opened: Instant::now(),
            last_io: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            waiting_since: AtomicU64::new(0),
            head_started: AtomicU64::new(NEVER),
            evicted: Notify::new(),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(NEVER - 1)
    }

    pub(super) fn read(&self) {
        let now = self.now();
        self.last_io.store(now, Ordering::Relaxed);
        let _ =
            self.head_started
                .compare_exchange(NEVER, now, Ordering::Relaxed, Ordering::Relaxed);
    }

    pub(super) fn wrote(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
    }

    /// Since when the connection has waited for a request head, or `None`
    /// while a request is in flight: only a waiting connection may be
    /// closed to make room, never one with work under way.
    pub(super) fn waiting_since(&self) -> Option<Instant> {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let ms = self.waiting_since.load(Ordering::Relaxed);
        Some(self.opened + Duration::from_millis(ms))
    }

    /// Asks the connection to close.
    pub(super) fn evict(&self) {
        self.evicted.notify_one();
    }

    /// Resolves once the connection is asked to close.
    pub(super) async fn evicted(&self) {
        self.evicted.notified().await;
    }

    pub(super) fn expired(&self, limits: &ListenerLimits) -> Option<Expiry> {
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
pub(super) struct InFlight(Arc<Activity>);

impl InFlight {
    pub(super) fn begin(a: Arc<Activity>) -> InFlight {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ListenerLimits {
        ListenerLimits {
            header_read_timeout: Duration::from_millis(100),
            idle_timeout: Duration::from_millis(1000),
            max_connections: 8,
            reserved_connections: 0,
            body_budget_bytes: 1 << 20,
            body_timeout: Duration::from_millis(100),
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
    fn only_a_connection_without_a_request_in_flight_is_waiting() {
        let a = Arc::new(Activity::new());
        assert_eq!(a.waiting_since(), Some(a.opened));
        let g = InFlight::begin(a.clone());
        assert_eq!(a.waiting_since(), None);
        drop(g);
        assert!(a.waiting_since().is_some_and(|t| t >= a.opened));
    }
}
