//! One request through the router: its routing headers, its plan, and its
//! booking from the decision to the end of the response.

use super::retry as router_retry;
use super::{Booking, RouterState};
use crate::config::{OnStale, ms};
use crate::host;
use crate::manifest::{self, Manifest};
use crate::metrics::{inc, record};
use crate::reply::Reply;
use kvgate_core::DEFAULT_TENANT;
use kvgate_core::booking::{Event, Key, Timing};
use kvgate_core::header::ATTEMPT_COUNT;
use kvgate_core::plan::local::Release;
use kvgate_core::plan::request::{Endpoint, parse};
use kvgate_core::plan::{self, Placement, Plan, Rejection, retry};
use kvgate_core::text::skeleton::Path;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;

/// The worker Envoy retries on when the chosen one refuses the connection,
/// and the load the request books there if it does.
#[derive(Debug, Clone)]
struct Fallback {
    endpoint: String,
    /// The served-by header's value if the retry lands here.
    served_by: String,
    slot: u16,
    prefill_tokens: u64,
    decode_blocks: u64,
}

/// The served-by header's value.
fn served_by(p: &Placement<'_>) -> String {
    format!(
        "worker_id={}; dp_rank={}",
        p.choice.worker.id, p.choice.rank.rank
    )
}

impl Fallback {
    fn new(p: &Placement<'_>) -> Fallback {
        Fallback {
            endpoint: p.choice.worker.endpoint.clone(),
            served_by: served_by(p),
            slot: p.choice.rank.slot,
            prefill_tokens: p.prefill_tokens,
            decode_blocks: p.decode_blocks,
        }
    }
}

pub struct Request {
    state: Rc<RefCell<RouterState>>,
    endpoint: Option<Endpoint>,
    manifest: Manifest,
    replied: bool,
    model: String,
    /// From the configured tenant header; `default` when absent.
    tenant: String,
    booking: Option<Booking>,
    fallback: Option<Fallback>,
    /// Whether the filter sent this request to a worker.
    routed: bool,
    /// What the served-by response header says: engines name no worker.
    served_by: Option<String>,
    /// When it was routed and first answered, for the planner.
    clock: Option<Clock>,
}

/// A routed request's timing, sent with its end.
#[derive(Debug, Clone, Copy)]
struct Clock {
    routed_us: u64,
    first_byte_us: Option<u64>,
    isl_tokens: u32,
    output_tokens: u32,
}

impl Clock {
    fn timing(&self, now_us: u64) -> Option<Timing> {
        let since = |t: u64| u32::try_from(t.saturating_sub(self.routed_us)).unwrap_or(u32::MAX);
        Some(Timing {
            first_byte_us: since(self.first_byte_us?),
            total_us: since(now_us),
            isl_tokens: self.isl_tokens,
            output_tokens: self.output_tokens,
        })
    }
}

impl Request {
    pub fn new(state: Rc<RefCell<RouterState>>) -> Request {
        Request {
            state,
            endpoint: None,
            manifest: Manifest::default(),
            replied: false,
            model: String::new(),
            tenant: String::new(),
            booking: None,
            fallback: None,
            routed: false,
            served_by: None,
            clock: None,
        }
    }

    fn reply(&mut self, r: &Reply) -> Action {
        let mut st = self.state.borrow_mut();
        st.metrics.rejected(r.reason);
        st.send(&Event::Rejected {
            model: self.model.clone(),
            reason: r.reason,
        });
        if let Err(status) = host::send_reply(r) {
            host::log(
                LogLevel::Error,
                &format!("kvgate: local reply failed: {status:?}"),
            );
        }
        self.replied = true;
        Action::Pause
    }

    fn route(&mut self, body_size: usize) -> Action {
        let started = host::now_us();
        let Some(endpoint) = self.endpoint else {
            return Action::Continue;
        };
        let body = host::request_body(body_size).unwrap_or_default();
        let mut req = match parse(endpoint, &body) {
            Ok(r) => r,
            Err(e) => return self.reply(&Reply::bad_request(&e.0)),
        };
        self.model.clone_from(&req.model);
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let version = self.manifest.snapshot_version;
        match st
            .view
            .refresh(version, || host::get_shared(manifest::SNAPSHOT_KEY))
        {
            Ok(true) => {
                if let Some(snap) = st.view.snapshot.as_mut() {
                    st.local
                        .settle(snap, st.vm_tag, host::now_ms(), ms(st.config.stale_after));
                }
            }
            Ok(false) => {}
            Err(e) => {
                inc(st.metrics.snapshot_decode_errors);
                host::log(
                    LogLevel::Error,
                    &format!("kvgate: snapshot {version} does not decode: {e}"),
                );
            }
        }
        let Some(snap) = st.view.snapshot.as_ref() else {
            drop(guard);
            return self.reply(&Reply::stale());
        };
        if req.tokens.is_none()
            && let Some(m) = snap.model(&req.model)
            && m.prompt_template != 0
        {
            let rendered = st
                .templates
                .get(&m.name, m.prompt_template)
                .map(|r| req.render(r, host::now_ms() / 1000));
            match rendered {
                Some(Ok(path)) => {
                    inc(st.metrics.rendered);
                    if path == Some(Path::Skeleton) {
                        inc(st.metrics.assembled);
                    }
                }
                _ => inc(st.metrics.render_errors),
            }
        }
        st.tie_break = st.tie_break.wrapping_add(1);
        let selecting = host::now_us();
        let mut planned = plan::plan(
            snap,
            &req,
            &self.tenant,
            st.tie_break,
            &mut host::get_shared,
            &[],
        );
        // Every worker is busy: a retry that holds its ticket may go ahead
        // of new work; anything else is shed with a place in the queue.
        let mut ticket = None;
        if matches!(planned, Plan::Reject(Rejection::AllBusy { .. }))
            && st.config.retry_headroom_pct > 0
        {
            let hash = retry::ticket_hash(&self.tenant, &body);
            if router_retry::redeem(hash, host::now_ms()) {
                let mut again = req.clone();
                again.retry_headroom = Some(f64::from(st.config.retry_headroom_pct) / 100.0);
                planned = plan::plan(
                    snap,
                    &again,
                    &self.tenant,
                    st.tie_break,
                    &mut host::get_shared,
                    &[],
                );
                if matches!(planned, Plan::Route(_)) {
                    inc(st.metrics.retry_admitted);
                }
            }
            ticket = Some(hash);
        }
        record(
            st.metrics.selection_us,
            host::now_us().saturating_sub(selecting),
        );
        let action = match planned {
            Plan::Route(route) => {
                let first = &route.first;
                let (worker, rank) = (first.choice.worker, first.choice.rank);
                self.fallback = route.fallback.as_ref().map(Fallback::new);
                // Envoy's override-host balancer tries the list in order.
                let destination = match &self.fallback {
                    Some(f) => format!("{},{}", worker.endpoint, f.endpoint),
                    None => worker.endpoint.clone(),
                };
                self.routed = true;
                // Bookings, a retry's included, go under the base model.
                self.model.clone_from(&route.model.name);
                if !st.config.served_by_header.is_empty() {
                    self.served_by = Some(served_by(first));
                }
                let c = &st.config;
                let mut ok = host::set_request_header(&c.destination_header, &destination).is_ok();
                // Without a rank to name, the header stays as the request
                // headers left it: scrubbed of any client's copy.
                if route.set_rank {
                    ok &= host::set_request_header(&c.rank_header, &rank.rank.to_string()).is_ok();
                }
                if !ok {
                    host::log(LogLevel::Error, "kvgate: could not set routing headers");
                }
                inc(st.metrics.routed);
                let (slot, prefill, decode) =
                    (rank.slot, first.prefill_tokens, first.decode_blocks);
                if let Some(record) = route.report {
                    st.report(&record);
                }
                self.booking = Some(st.book(&self.model, slot, prefill, decode));
                self.clock = Some(Clock {
                    routed_us: host::now_us(),
                    first_byte_us: None,
                    isl_tokens: u32::try_from(req.isl_tokens).unwrap_or(u32::MAX),
                    output_tokens: req
                        .max_tokens
                        .map_or(0, |m| u32::try_from(m).unwrap_or(u32::MAX)),
                });
                None
            }
            Plan::Reject(r) => Some(match (r, ticket) {
                (Rejection::AllBusy { retry_after_s }, Some(hash)) => {
                    router_retry::shed(&st.config, snap, &req.model, hash, retry_after_s)
                }
                (r, _) => Reply::rejected(r, &req.model, st.config.retry_after_s),
            }),
        };
        record(
            st.metrics.decision_us,
            host::now_us().saturating_sub(started),
        );
        drop(guard);
        match action {
            None => Action::Continue,
            Some(r) => self.reply(&r),
        }
    }
}

impl Request {
    /// Releases the booking: its prefill at the first byte, all of it when
    /// the request ends (`done`), however it ends.
    fn release(&mut self, done: bool) {
        let Some(b) = self.booking.as_mut() else {
            return;
        };
        if !done && b.first_byte {
            return;
        }
        // Never panic on a re-entrant borrow (not expected: callbacks do
        // not nest); skipping leaves the sidecar's expiry to clean up.
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return;
        };
        let st = &mut *guard;
        let key = Key {
            vm: st.vm_tag,
            seq: b.seq,
        };
        let release = Release {
            seq: b.seq,
            slot: b.slot,
            prefill: if b.first_byte { 0 } else { b.prefill },
            decode: if done { b.decode } else { 0 },
            done,
            // The next booking this VM makes follows the release to the
            // sidecar: a snapshot that counts it counts the release.
            fence: st.next_seq + 1,
        };
        st.local
            .release(st.view.snapshot.as_mut(), release, host::now_ms());
        let now = host::now_us();
        if done {
            let timing = self.clock.take().and_then(|c| c.timing(now));
            st.send(&Event::Done { key, timing });
            self.booking = None;
        } else {
            b.first_byte = true;
            if let Some(c) = self.clock.as_mut() {
                c.first_byte_us = Some(now);
            }
            st.send(&Event::FirstByte { key });
        }
    }
}

impl Request {
    /// Moves the booking to the fallback worker when Envoy's retry served
    /// the request there, so load is counted where it runs.
    fn follow_retry(&mut self) {
        let Some(fb) = self.fallback.take() else {
            return;
        };
        // A first attempt that answered is the common case, and a header
        // read is several times cheaper than a property; the property
        // decides where the header is absent (not configured) or names a
        // retry.
        if host::response_header(ATTEMPT_COUNT).as_deref() == Some("1") {
            return;
        }
        let served_by = host::property(&["upstream", "address"]);
        if served_by.as_deref() != Some(fb.endpoint.as_bytes()) {
            return;
        }
        // The request's clock runs on: it was routed once, served once.
        let clock = self.clock.take();
        self.release(true);
        self.clock = clock;
        if self.served_by.is_some() {
            self.served_by = Some(fb.served_by);
        }
        let Ok(mut st) = self.state.try_borrow_mut() else {
            return;
        };
        inc(st.metrics.retried);
        self.booking = Some(st.book(&self.model, fb.slot, fb.prefill_tokens, fb.decode_blocks));
    }

    /// Counts a routed request that no worker answered (Envoy replied in
    /// OpenAI's error shape), or whose worker went away mid-response.
    fn count_upstream_failure(&self) {
        let Some(details) = host::property(&["response", "code_details"]) else {
            return;
        };
        let st = self.state.borrow();
        if details.starts_with(b"upstream_reset_after_response_started") {
            inc(st.metrics.streams_cut);
        } else if details.starts_with(b"upstream_reset_before_response_started")
            || details.starts_with(b"no_healthy_upstream")
        {
            inc(st.metrics.upstream_unavailable);
        }
    }
}

impl Context for Request {}

impl Drop for Request {
    /// The backstop: a context Envoy deletes without a log callback still
    /// releases what it booked.
    fn drop(&mut self) {
        self.release(true);
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Routing headers are ours alone: a client's copy never steers,
        // whatever the method, path or protocol, and whether or not this
        // filter routes the request.
        {
            let st = self.state.borrow();
            let c = &st.config;
            let _ = host::remove_request_header(&c.destination_header);
            let _ = host::remove_request_header(&c.rank_header);
            if host::request_header(&c.fallback_header).is_some() {
                let _ = host::remove_request_header(&c.fallback_header);
                // The route may have been matched on the client's header.
                let _ = host::clear_route_cache();
            }
        }
        let method = host::request_header(":method");
        let path = host::request_header(":path").unwrap_or_default();
        let endpoint = match method.as_deref() {
            Some("POST") => Endpoint::from_path(&path),
            _ => None,
        };
        let Some(endpoint) = endpoint else {
            return Action::Continue;
        };
        self.endpoint = Some(endpoint);
        let (cfg_fallback, cfg_tenant, stale_after, on_stale) = {
            let st = self.state.borrow();
            inc(st.metrics.requests);
            let c = &st.config;
            (
                c.fallback_header.clone(),
                c.tenant_header.clone(),
                ms(c.stale_after),
                c.on_stale,
            )
        };
        self.tenant = host::request_header(&cfg_tenant)
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| DEFAULT_TENANT.to_string());
        self.manifest = host::get_shared(manifest::KEY)
            .and_then(|b| Manifest::decode(&b))
            .unwrap_or_default();
        if !self.manifest.is_fresh(host::now_ms(), stale_after) {
            return match on_stale {
                OnStale::FailClosed => self.reply(&Reply::stale()),
                OnStale::FailOpen => {
                    inc(self.state.borrow().metrics.failed_open);
                    self.endpoint = None;
                    let _ = host::set_request_header(&cfg_fallback, "stale");
                    if let Err(s) = host::clear_route_cache() {
                        host::log(
                            LogLevel::Warn,
                            &format!("kvgate: clear_route_cache failed: {s:?}"),
                        );
                    }
                    Action::Continue
                }
            };
        }
        if end_of_stream {
            return self.reply(&Reply::bad_request("a request body is required"));
        }
        Action::Pause
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.fallback.is_some() {
            self.follow_retry();
        }
        if let Some(value) = self.served_by.take() {
            let st = self.state.borrow();
            let _ = host::set_response_header(&st.config.served_by_header, &value);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            // The whole answer is in Envoy's hands: the worker is done with
            // it. Releasing here, not at `on_log`, frees the rank before the
            // client can send its next request.
            self.release(true);
        } else if body_size > 0 {
            self.release(false);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.routed {
            self.count_upstream_failure();
        }
        self.release(true);
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.endpoint.is_none() || self.replied {
            return Action::Continue;
        }
        let limit = self.state.borrow().config.max_body_bytes;
        if body_size > limit {
            return self.reply(&Reply::too_large(limit));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.route(body_size)
    }
}
