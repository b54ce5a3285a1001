//! The snapshot service root: a singleton VM on Envoy's main thread that
//! long-polls the sidecar and writes what it gets into shared data, and
//! forwards what the router VMs queue (routing decisions, load bookings) to
//! the sidecar.

use crate::config::{Config, ms};
use crate::host;
use crate::manifest;
use crate::metrics::{ServiceMetrics, inc, record};
use crate::poller::Poller;
use kvgate_core::admit::ledger;
use proxy_wasm::types::LogLevel;
use std::time::Duration;

pub struct Service {
    pub config: Config,
    poller: Poller,
    metrics: ServiceMetrics,
    /// The poll in flight; other callouts are reports.
    poll_token: Option<u32>,
    queue: Option<u32>,
    bookings_queue: Option<u32>,
    /// The bookings batch in flight. One at a time keeps each VM's events
    /// in order at the sidecar (a request never ends before it is booked).
    bookings_token: Option<u32>,
    /// The routing-decision batch in flight. One at a time turns a busy
    /// second's thousands of wake-ups into a few requests to the sidecar.
    routed_token: Option<u32>,
    /// `Bearer <token>` when the sidecar requires one.
    authorization: Option<String>,
    /// The next poll asks for an immediate answer: a lease just taken
    /// over, when the manifest's freshness may be running out.
    prompt: bool,
    unauthorized: Unauthorized,
}

/// How often, at most, the sidecar refusing this filter's token is logged
/// again while it goes on.
const UNAUTHORIZED_LOG_EVERY_MS: u64 = 60_000;

/// Reports refused 401/403 by the sidecar. Without this, a filter whose
/// `sidecar_token` does not match the sidecar's control token routes and
/// sheds without its own bookings, and nothing but a counter says so: the
/// first refusal is logged at once, later ones once a minute at most, so
/// that a refusal per batch does not flood Envoy's log.
#[derive(Debug, Default)]
struct Unauthorized {
    /// When the last warning was logged.
    logged_at_ms: Option<u64>,
    /// Refusals since then, not yet logged.
    unlogged: u64,
}

impl Unauthorized {
    /// Counts a refusal at `now_ms`; the number of refusals to report when
    /// a warning is due.
    fn refused(&mut self, now_ms: u64) -> Option<u64> {
        self.unlogged = self.unlogged.saturating_add(1);
        let due = self
            .logged_at_ms
            .is_none_or(|at| now_ms.saturating_sub(at) >= UNAUTHORIZED_LOG_EVERY_MS);
        if !due {
            return None;
        }
        self.logged_at_ms = Some(now_ms);
        Some(std::mem::take(&mut self.unlogged))
    }
}

fn register(name: &str) -> Option<u32> {
    match host::register_queue(name) {
        Ok(q) => Some(q),
        Err(s) => {
            host::log(
                LogLevel::Warn,
                &format!("kvgate: cannot register queue {name}: {s:?}"),
            );
            None
        }
    }
}

impl Service {
    pub fn new(config: Config) -> Service {
        Self::with_poller(config, Poller::default(), false)
    }

    /// Takes over from the root that held the poller lease: carries on
    /// from the manifest it left, and registers the queues again so that
    /// their notifications now wake this root.
    pub fn take_over(config: Config) -> Service {
        let manifest = crate::manifest::Manifest::read(&crate::host::Abi).unwrap_or_default();
        Self::with_poller(config, Poller::resume(manifest), true)
    }

    fn with_poller(config: Config, poller: Poller, prompt: bool) -> Service {
        Service {
            authorization: config.sidecar_token.as_ref().map(|t| format!("Bearer {t}")),
            config,
            poller,
            prompt,
            metrics: ServiceMetrics::define(),
            poll_token: None,
            queue: register(host::ROUTED_QUEUE),
            bookings_queue: register(host::BOOKINGS_QUEUE),
            bookings_token: None,
            routed_token: None,
            unauthorized: Unauthorized::default(),
        }
    }

    /// Counts a report the sidecar refused for its token, and says what to
    /// set when a warning is due.
    fn check_refusal(&mut self, path: &str, status: Option<&str>) {
        let Some(code @ ("401" | "403")) = status else {
            return;
        };
        let Some(n) = self.unauthorized.refused(host::now_ms()) else {
            return;
        };
        let fix = if self.authorization.is_some() {
            "sidecar_token in the plugin configuration does not match the sidecar's control token: set it to the same value"
        } else {
            "the sidecar requires a control token: set sidecar_token in the plugin configuration to the sidecar's control token"
        };
        host::log(
            LogLevel::Warn,
            &format!(
                "kvgate: the sidecar refused {n} report(s) with {code} (latest: {path}); {fix}. Until then routing and shedding run without this gateway's bookings"
            ),
        );
    }

    /// Sends the queued booking events in one request, unless one is in
    /// flight (its answer sends the next).
    pub fn send_bookings(&mut self) {
        let Some(queue) = self.bookings_queue else {
            return;
        };
        if self.bookings_token.is_some() {
            return;
        }
        let Some(sent) = self.post_queued(queue, 1 << 18, "/v1/bookings") else {
            return;
        };
        match sent {
            Ok(token) => {
                self.bookings_token = Some(token);
                inc(self.metrics.booking_batches);
            }
            // Dropped: the sidecar's expiry cleans up what this loses.
            Err(_) => inc(self.metrics.booking_batch_errors),
        }
    }

    pub fn on_queue_ready(&mut self, queue: u32) {
        if Some(queue) == self.bookings_queue {
            self.send_bookings();
        } else if Some(queue) == self.queue {
            self.send_routed();
        }
    }

    /// Forwards queued routing decisions to the sidecar in one request,
    /// unless one is in flight (its answer sends the next). Best effort: a
    /// lost batch only delays what the routed-prefix index learns.
    fn send_routed(&mut self) {
        let Some(queue) = self.queue else {
            return;
        };
        if self.routed_token.is_some() {
            return;
        }
        // Bounded per request; the rest goes with the next one.
        match self.post_queued(queue, 1 << 20, "/v1/routed") {
            None => {}
            Some(Ok(token)) => {
                self.routed_token = Some(token);
                inc(self.metrics.reports);
            }
            Some(Err(_)) => inc(self.metrics.report_errors),
        }
    }

    /// Dequeues up to about `limit` bytes of records and posts them to the
    /// sidecar at `path` in one request; `None` when the queue was empty.
    fn post_queued(
        &self,
        queue: u32,
        limit: usize,
        path: &str,
    ) -> Option<Result<u32, host::Fault>> {
        let mut body = Vec::new();
        while body.len() < limit {
            match host::dequeue(queue) {
                Some(item) => body.extend_from_slice(&item),
                None => break,
            }
        }
        if body.is_empty() {
            return None;
        }
        let c = &self.config;
        Some(host::dispatch_post(
            &c.sidecar_cluster,
            &c.sidecar_authority,
            path,
            self.authorization.as_deref(),
            &body,
            Duration::from_secs(2),
        ))
    }

    /// Starts a poll if none is in flight and no backoff is pending.
    pub fn poll(&mut self) {
        let now = host::now_ms();
        if !self.poller.due(now) {
            return;
        }
        let c = &self.config;
        let wait = if self.prompt { 0 } else { ms(c.poll_wait) };
        let path = self.poller.path(wait);
        // The call's own timeout leaves the sidecar time to answer a full wait.
        let timeout = c.poll_wait + Duration::from_secs(2);
        // With the token a reset frame counts under the sidecar's cap on
        // whole-index readers that hold it, which no one else can fill.
        match host::dispatch_get(
            &c.sidecar_cluster,
            &c.sidecar_authority,
            &path,
            self.authorization.as_deref(),
            timeout,
        ) {
            Ok(token) => {
                self.poll_token = Some(token);
                self.prompt = false;
                self.poller.sent();
                inc(self.metrics.polls);
            }
            Err(status) => {
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "kvgate: cannot poll cluster {:?}: {status:?}",
                        c.sidecar_cluster
                    ),
                );
                inc(self.metrics.poll_errors);
                self.poller.failed(now, ms(c.poll_backoff));
            }
        }
    }

    pub fn on_response(&mut self, token: u32, body_size: usize) {
        if Some(token) == self.bookings_token {
            self.bookings_token = None;
            let status = host::call_response_header(":status");
            if status.as_deref() != Some("204") {
                inc(self.metrics.booking_batch_errors);
                self.check_refusal("/v1/bookings", status.as_deref());
            }
            self.send_bookings();
            return;
        }
        if Some(token) == self.routed_token {
            self.routed_token = None;
            let status = host::call_response_header(":status");
            if status.as_deref() != Some("204") {
                inc(self.metrics.report_errors);
                self.check_refusal("/v1/routed", status.as_deref());
            }
            self.send_routed();
            return;
        }
        if Some(token) != self.poll_token {
            return;
        }
        self.poll_token = None;
        let now = host::now_ms();
        let status = host::call_response_header(":status");
        match status.as_deref() {
            Some("200") => {
                let body = host::call_response_body(body_size).unwrap_or_default();
                match self.poller.changed(now, &body) {
                    Ok(writes) => self.write(writes),
                    Err(e) => {
                        host::log(
                            LogLevel::Error,
                            &format!("kvgate: rejecting sidecar update: {e:?}"),
                        );
                        inc(self.metrics.decode_errors);
                        self.poller.failed(now, ms(self.config.poll_backoff));
                    }
                }
            }
            Some("204") => {
                let epoch = host::call_response_header(kvgate_core::header::EPOCH)
                    .and_then(|e| e.parse().ok());
                let writes = self.poller.no_change(now, epoch);
                self.write(writes);
            }
            other => {
                host::log(
                    LogLevel::Warn,
                    &format!("kvgate: sidecar poll failed (status {other:?}); backing off"),
                );
                inc(self.metrics.poll_errors);
                self.poller.failed(now, ms(self.config.poll_backoff));
            }
        }
        self.poll();
    }

    fn write(&mut self, writes: Vec<(String, Vec<u8>)>) {
        if let Some((_, snapshot)) = writes.iter().find(|(k, _)| k == manifest::SNAPSHOT_KEY) {
            create_ledgers(snapshot);
        }
        for (key, value) in writes {
            if let Err(status) = host::set_shared(&key, &value) {
                host::log(
                    LogLevel::Error,
                    &format!("kvgate: writing shared data {key:?} failed: {status:?}"),
                );
            }
        }
        record(
            self.metrics.snapshot_version,
            self.poller.manifest().snapshot_version,
        );
    }
}

/// Creates the count of requests in flight per decode worker
/// (`kvgate_core::admit::ledger`) of every model the snapshot bounds, if
/// missing, before the snapshot that names the bound is published. Only
/// this root creates them, the router VMs only rewrite them: a write to a
/// missing key is not checked by compare-and-swap, so two VMs creating it
/// at once could each overwrite the other's first slot.
fn create_ledgers(snapshot: &[u8]) {
    let Ok(snap) = kvgate_core::Snapshot::decode(snapshot) else {
        return;
    };
    for m in snap
        .models
        .iter()
        .filter(|m| m.thresholds.active_decode_requests.is_some())
    {
        let key = ledger::key(&m.name);
        if host::get_shared_cas(&key).1.is_none()
            && let Err(status) = host::set_shared(&key, &[])
        {
            host::log(
                LogLevel::Error,
                &format!("kvgate: creating shared data {key:?} failed: {status:?}"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_refusal_is_logged_then_once_a_minute() {
        let mut u = Unauthorized::default();
        assert_eq!(u.refused(1_000), Some(1));
        assert_eq!(u.refused(2_000), None);
        assert_eq!(u.refused(60_999), None);
        assert_eq!(u.refused(61_000), Some(3), "the ones held back are counted");
        assert_eq!(u.refused(61_001), None);
    }
}
