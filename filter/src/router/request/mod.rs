//! One request through the router: its routing headers, its decision, and
//! its booking from the decision to the end of the response.
//!
//! The decision runs in three steps: [`decide::prepare`] (view, settle,
//! template), [`decide::decide`] (gather once, place) and
//! [`Request::apply`] (headers, report, booking, clock). The first two
//! produce an owned [`Decision`], so a request can pause on a callout and
//! finish when the answer arrives ([`Stage::Prefilling`]).
//!
//! A disaggregated request ([`decide::Split`]) books both legs, calls its
//! prefill worker from its own context, and on the answer goes on to the
//! decode worker with the prefill's transfer parameters in its body; a
//! failed leg is tried once on the runner-up, then prefilled on the decode
//! worker or answered 503, as the model says. An SGLang request sends
//! both legs at once, one body with its bootstrap room, and drains the
//! prefill's answer ([`legs`]; answers judged in [`prefill`]).

mod decide;
mod legs;
mod prefill;
mod stopwatch;

use super::{Booking, RouterState};
use crate::config::{OnStale, ms};
use crate::host;
use crate::manifest::Manifest;
use crate::metrics::inc;
use crate::reply::Reply;
use decide::{Decision, Routing, Target};
use kvgate_core::DEFAULT_TENANT;
use kvgate_core::booking::{Event, Key, Timing};
use kvgate_core::header::ATTEMPT_COUNT;
use kvgate_core::plan::local::Release;
use kvgate_core::plan::request::{Endpoint, parse};
use kvgate_core::state::Protocol;
use legs::{Draining, Leg};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;
use stopwatch::{Phase, Stopwatch};

/// Where a request is in its life; the callbacks move it on.
#[derive(Debug, Default)]
enum Stage {
    /// Not decided yet: headers seen, the body being buffered (or a
    /// request the router does not route).
    #[default]
    Reading,
    /// Paused on its prefill leg, callout `token`.
    Prefilling { token: u32, leg: Box<Leg> },
    /// Sent on to a worker.
    Routed,
    /// Answered by the filter itself.
    Replied,
}

pub struct Request {
    state: Rc<RefCell<RouterState>>,
    endpoint: Option<Endpoint>,
    manifest: Manifest,
    stage: Stage,
    model: String,
    /// From the configured tenant header; `default` when absent.
    tenant: String,
    booking: Option<Booking>,
    /// A disaggregated request's prefill leg, until it answers.
    prefill_booking: Option<Booking>,
    /// An SGLang prefill callout whose answer is drained: the request went
    /// on to its decode worker beside it.
    draining: Option<Draining>,
    fallback: Option<Target>,
    /// What the served-by response header says: engines name no worker.
    served_by: Option<String>,
    /// When it was routed and first answered, for the planner.
    clock: Option<Clock>,
    /// The request body's size so far, as the last body callback said:
    /// an HTTP/2 request that ends with trailers is decided at them.
    body_seen: usize,
    /// Failed open (no fresh state): not decided, but its body is still
    /// read whole and scrubbed of transfer fields before Envoy's own
    /// balancing sends it on.
    failed_open: bool,
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
            stage: Stage::Reading,
            model: String::new(),
            tenant: String::new(),
            booking: None,
            prefill_booking: None,
            draining: None,
            fallback: None,
            served_by: None,
            clock: None,
            body_seen: 0,
            failed_open: false,
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
        self.stage = Stage::Replied;
        Action::Pause
    }

    /// Decides where the whole buffered body goes, and applies it.
    fn route(&mut self, body_size: usize) -> Action {
        let Some(endpoint) = self.endpoint else {
            return Action::Continue;
        };
        let mut clock = {
            let mut st = self.state.borrow_mut();
            st.decisions = st.decisions.wrapping_add(1);
            Stopwatch::start(st.decisions, st.config.phase_timing_every)
        };
        let body = host::request_body(body_size).unwrap_or_default();
        let mut req = match parse(endpoint, &body) {
            Ok(r) => r,
            Err(e) => return self.reply(&Reply::bad_request(&e.0)),
        };
        self.model.clone_from(&req.model);
        let decision = {
            let mut st = self.state.borrow_mut();
            if decide::prepare(&mut st, &mut req, &body, &self.manifest).is_none() {
                drop(st);
                return self.reply(&Reply::stale());
            }
            clock.mark(Phase::Parsed);
            decide::decide(
                &mut st,
                &req,
                &self.tenant,
                &body,
                &self.manifest,
                &mut clock,
            )
        };
        let action = self.apply(decision, &body);
        clock.finish(&self.state.borrow().metrics);
        action
    }

    /// Acts on a decision: a route's headers, report, booking and clock,
    /// a disaggregated request's prefill leg, or the local reply. `body`
    /// is the client's.
    fn apply(&mut self, decision: Decision, body: &[u8]) -> Action {
        match decision {
            Decision::Route(r) => {
                let scrub = r.disaggregated;
                self.route_to(r);
                if scrub {
                    self.mint_request_id();
                    self.send_whole(body);
                }
                Action::Continue
            }
            Decision::Split(s) if s.protocol == Protocol::Sglang => self.split_sglang(*s, body),
            Decision::Split(s) => self.split(*s, body),
            Decision::Reply(r) => self.reply(&r),
        }
    }

    fn route_to(&mut self, r: Routing) {
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let Routing {
            model,
            first,
            fallback,
            set_rank,
            report,
            isl_tokens,
            output_tokens,
            disaggregated: _,
        } = r;
        // Envoy's override-host balancer tries the list in order.
        let destination = match &fallback {
            Some(f) => format!("{},{}", first.endpoint, f.endpoint),
            None => first.endpoint.clone(),
        };
        self.stage = Stage::Routed;
        self.model = model;
        let c = &st.config;
        if !c.served_by_header.is_empty() {
            self.served_by = Some(first.served_by());
        }
        let mut ok = host::set_request_header(&c.destination_header, &destination).is_ok();
        // Without a rank to name, the header stays as the request headers
        // left it: scrubbed of any client's copy.
        if set_rank {
            ok &= host::set_request_header(&c.rank_header, &first.rank.to_string()).is_ok();
        }
        if !ok {
            host::log(LogLevel::Error, "kvgate: could not set routing headers");
        }
        inc(st.metrics.routed);
        if let Some(record) = report {
            st.report(&record);
        }
        self.booking = Some(st.book(
            &self.model,
            first.slot,
            first.prefill_tokens,
            first.decode_blocks,
        ));
        self.clock = Some(Clock {
            routed_us: host::now_us(),
            first_byte_us: None,
            isl_tokens,
            output_tokens,
        });
        self.fallback = fallback;
    }
}

impl Request {
    /// The whole body is in: decided, or (failed open) scrubbed and let
    /// through to Envoy's own balancing.
    fn complete(&mut self, body_size: usize) -> Action {
        if !self.failed_open {
            return self.route(body_size);
        }
        self.stage = Stage::Routed;
        let body = host::request_body(body_size).unwrap_or_default();
        self.send_whole(&body);
        Action::Continue
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
            self.served_by = Some(fb.served_by());
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

impl Context for Request {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(leg) = self.draining.take_if(|d| d.token == token_id) {
            self.drained(leg);
            return;
        }
        if !matches!(&self.stage, Stage::Prefilling { token, .. } if *token == token_id) {
            return;
        }
        let Stage::Prefilling { leg, .. } = std::mem::take(&mut self.stage) else {
            return;
        };
        self.stage = Stage::Routed;
        // A local reply ends the stream by itself, and a new try waits for
        // its own answer; a route goes on.
        if matches!(self.prefill_answered(*leg, body_size), Action::Continue)
            && let Err(status) = host::resume_request()
        {
            host::log(
                LogLevel::Error,
                &format!("kvgate: resuming the request failed: {status:?}"),
            );
        }
    }
}

impl Drop for Request {
    /// The backstop: a context Envoy deletes without a log callback still
    /// releases what it booked.
    fn drop(&mut self) {
        self.orphan_prefill();
        self.release_prefill();
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
            let mut st = self.state.borrow_mut();
            st.release_orphans();
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
        self.manifest = Manifest::read().unwrap_or_default();
        if !self.manifest.is_fresh(host::now_ms(), stale_after) {
            return match on_stale {
                OnStale::FailClosed => self.reply(&Reply::stale()),
                OnStale::FailOpen => {
                    inc(self.state.borrow().metrics.failed_open);
                    self.failed_open = true;
                    let _ = host::set_request_header(&cfg_fallback, "stale");
                    if let Err(s) = host::clear_route_cache() {
                        host::log(
                            LogLevel::Warn,
                            &format!("kvgate: clear_route_cache failed: {s:?}"),
                        );
                    }
                    // The body is read whole all the same: without state
                    // the filter cannot tell a disaggregated model, so it
                    // scrubs every body of transfer fields.
                    if end_of_stream {
                        Action::Continue
                    } else {
                        Action::Pause
                    }
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
        if matches!(self.stage, Stage::Routed) {
            self.count_upstream_failure();
        }
        // A client gone during the prefill leg: its answer will find no
        // context (Envoy does not cancel the callout), so the decode
        // booking ends here and the prefill's at the leg's deadline.
        self.orphan_prefill();
        self.release_prefill();
        self.release(true);
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.endpoint.is_none() || !matches!(self.stage, Stage::Reading) {
            return Action::Continue;
        }
        let limit = self.state.borrow().config.max_body_bytes;
        if body_size > limit {
            return self.reply(&Reply::too_large(limit));
        }
        self.body_seen = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.complete(body_size)
    }

    /// HTTP/2 trailers end a request whose last body callback did not:
    /// without this the SDK's default would let Envoy forward the
    /// buffered body undecided. The body read so far is all of it.
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.endpoint.is_none() || !matches!(self.stage, Stage::Reading) {
            return Action::Continue;
        }
        inc(self.state.borrow().metrics.trailers);
        self.complete(self.body_seen)
    }
}
