//! The legs of a disaggregated request: the prefill callout, what its
//! answer makes of the client's request (vLLM's NIXL protocol), and
//! SGLang's two legs sent at once. The decision's seam is in the parent
//! module; what a prefill answer means is judged in [`super::prefill`].

use super::decide::{PrefillPlan, Split, Target};
use super::prefill::{self, Verdict};
use super::{Request, Stage};
use crate::host;
use crate::metrics::{inc, record};
use crate::reply::Reply;
use kvgate_core::disagg::{self, nixl, sglang};
use kvgate_core::header;
use kvgate_core::state::OnPrefillFailure;
use proxy_wasm::types::{Action, LogLevel};
use std::borrow::Cow;
use std::time::Duration;

/// A second try of a prefill leg needs at least this share (one in ten)
/// of the leg's time budget left.
const MIN_RETRY_SHARE: u64 = 10;

/// A prefill leg in flight: what the answer is applied to.
#[derive(Debug)]
pub(super) struct Leg {
    plan: PrefillPlan,
    /// The worker the callout went to.
    at: Target,
    /// The client's body, which the decode leg is made from.
    client: Vec<u8>,
    /// The path both legs are sent to.
    path: String,
    request_id: String,
    /// The client's `authorization`, for workers that check an API key.
    authorization: Option<String>,
    /// When the leg's one budget runs out, and when this try started.
    deadline_us: u64,
    sent_us: u64,
    retried: bool,
}

/// An SGLang prefill leg in flight beside its decode leg.
#[derive(Debug)]
pub(super) struct Draining {
    pub(super) token: u32,
    endpoint: String,
    request_id: String,
    room: u64,
    sent_us: u64,
    /// When Envoy ends the callout if the worker has not answered.
    deadline_us: u64,
}

impl Request {
    /// Books both legs of a disaggregated request, with the request routed
    /// to its decode worker, and sends the prefill leg; the request waits
    /// for its answer.
    pub(super) fn split(&mut self, s: Split, body: &[u8]) -> Action {
        let Split {
            decode, prefill, ..
        } = s;
        let growth = disagg::decode_growth(u64::from(decode.isl_tokens));
        self.route_to(decode);
        let path = host::request_header(":path").unwrap_or_default();
        let authorization = host::request_header("authorization");
        let request_id = self.mint_request_id();
        let now = host::now_us();
        let leg = Leg {
            at: prefill.first.clone(),
            deadline_us: now.saturating_add(prefill.timeout_ms.saturating_mul(1000)),
            plan: prefill,
            client: body.to_vec(),
            path,
            request_id,
            authorization,
            sent_us: now,
            retried: false,
        };
        // A decode body that would pass the buffer Envoy is configured
        // for is not worth a prefill leg (nor two, with the runner-up).
        let limit = self.state.borrow().config.max_body_bytes;
        if body.len().saturating_add(growth) > limit.saturating_add(disagg::DECODE_HEADROOM_BYTES) {
            return self.no_room(leg);
        }
        self.send_prefill(leg)
    }

    /// The id both legs carry, set on the request for the decode worker,
    /// and on every other request to a disaggregated model's workers: the
    /// engines key the KV handoff by it, so kvgate chooses it. A client's
    /// own is logged beside it, never passed on.
    pub(super) fn mint_request_id(&mut self) -> String {
        let request_id = prefill::request_id(host::random_u64);
        if let Some(client_id) = host::request_header(header::REQUEST_ID) {
            host::log(
                LogLevel::Debug,
                &format!("kvgate: request {client_id} is disaggregated as {request_id}"),
            );
        }
        let _ = host::set_request_header(header::REQUEST_ID, &request_id);
        request_id
    }

    /// SGLang's two legs, sent at once: the same body, the client's with
    /// the bootstrap fields, to the prefill worker as a callout and to the
    /// decode worker as the request itself. The request never waits for
    /// the prefill (the prefill finishes only once the decode worker has
    /// joined its room); its answer is drained ([`Request::drained`]).
    ///
    /// A try Envoy cannot make (the host left the catalog) goes to the
    /// runner-up, before the decode leg is sent; with none, the request
    /// is answered 503: an SGLang decode worker cannot compute a prompt
    /// itself.
    pub(super) fn split_sglang(&mut self, s: Split, body: &[u8]) -> Action {
        let Split {
            decode,
            mut prefill,
            ..
        } = s;
        let decode_rank = sglang::Rank {
            index: decode.first.dp_index,
            size: decode.first.dp_size,
        };
        self.route_to(decode);
        let path = host::request_header(":path").unwrap_or_default();
        let authorization = host::request_header("authorization");
        let request_id = self.mint_request_id();
        let mut at = prefill.first.clone();
        loop {
            let room = {
                let mut st = self.state.borrow_mut();
                st.next_room = st.next_room.wrapping_add(1);
                let prefill_rank = sglang::Rank {
                    index: at.dp_index,
                    size: at.dp_size,
                };
                sglang::room(sglang::mix(st.next_room), prefill_rank, decode_rank)
            };
            if !room.both {
                host::log(
                    LogLevel::Info,
                    &format!(
                        "kvgate: no bootstrap room lands on both chosen ranks of {request_id}: \
                         the decode worker serves it on rank {} of its {}",
                        room.room % u64::from(decode_rank.size.max(1)),
                        decode_rank.size
                    ),
                );
            }
            let host_ip = sglang::bootstrap_host(&at.endpoint);
            let Ok(both) = sglang::body(body, host_ip, at.bootstrap_port, room.room) else {
                return self.reply(&Reply::prefill_failed(
                    "the request body cannot be rewritten",
                ));
            };
            let limit = self.state.borrow().config.max_body_bytes;
            if both.len() > limit.saturating_add(disagg::DECODE_HEADROOM_BYTES) {
                return self.reply(&Reply::prefill_failed(
                    "the body with its bootstrap fields exceeds max_body_bytes and its headroom",
                ));
            }
            let timeout = Duration::from_millis(prefill.timeout_ms.max(1));
            match self.call_prefill(
                &at,
                &path,
                &request_id,
                authorization.as_deref(),
                &both,
                timeout,
            ) {
                Ok(token) => {
                    let sent_us = host::now_us();
                    self.draining = Some(Draining {
                        token,
                        endpoint: at.endpoint.clone(),
                        request_id,
                        room: room.room,
                        sent_us,
                        deadline_us: sent_us
                            .saturating_add(prefill.timeout_ms.max(1).saturating_mul(1000)),
                    });
                    self.replace_body(&both);
                    return Action::Continue;
                }
                Err(status) => {
                    host::log(
                        LogLevel::Warn,
                        &format!(
                            "kvgate: prefill callout to {} failed: {status:?}",
                            at.endpoint
                        ),
                    );
                    self.release_prefill();
                    let Some(next) = prefill.runner_up.take() else {
                        inc(self.state.borrow().metrics.prefill_failed);
                        return self.reply(&Reply::prefill_failed(
                            "the prefill worker is not in the catalog",
                        ));
                    };
                    inc(self.state.borrow().metrics.prefill_retried);
                    at = next;
                }
            }
        }
    }

    /// Books `at`'s prefill and dispatches the callout that computes it
    /// there; a call Envoy refuses releases nothing (the caller does).
    fn call_prefill(
        &mut self,
        at: &Target,
        path: &str,
        request_id: &str,
        authorization: Option<&str>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, host::Fault> {
        let (cluster, host_header, rank_header) = {
            let mut st = self.state.borrow_mut();
            self.prefill_booking = Some(st.book(&self.model, at.slot, at.prefill_tokens, 0));
            let c = &st.config;
            (
                c.prefill_cluster.clone(),
                c.prefill_host_header.clone(),
                c.rank_header.clone(),
            )
        };
        let rank = at.rank.to_string();
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", at.endpoint.as_str()),
            ("content-type", "application/json"),
            (header::REQUEST_ID, request_id),
            (host_header.as_str(), at.endpoint.as_str()),
        ];
        if at.names_rank {
            headers.push((rank_header.as_str(), rank.as_str()));
        }
        if let Some(a) = authorization {
            headers.push(("authorization", a));
        }
        host::dispatch(&cluster, headers, Some(body), timeout)
    }

    /// An SGLang prefill answer: its booking ends. A failure cannot be
    /// retried (the decode leg is on its way, waiting in the room), so it
    /// is counted and logged; the decode worker fails the request on its
    /// own bootstrap timeout.
    pub(super) fn drained(&mut self, leg: Draining) {
        self.release_prefill();
        let status = host::call_response_header(":status").and_then(|s| s.parse::<u16>().ok());
        let st = self.state.borrow();
        record(
            st.metrics.prefill_us,
            host::now_us().saturating_sub(leg.sent_us),
        );
        if status == Some(200) {
            return;
        }
        inc(st.metrics.prefill_failed);
        let status = status.map_or_else(|| "a reset".to_string(), |s| format!("status {s}"));
        host::log(
            LogLevel::Warn,
            &format!(
                "kvgate: SGLang prefill leg {} (room {}) on {} failed with {status}; \
                 its decode worker fails the request on its bootstrap timeout",
                leg.request_id, leg.room, leg.endpoint
            ),
        );
    }

    /// Books the leg's worker and calls it; a call Envoy cannot make (its
    /// host left the catalog) fails the leg at once.
    fn send_prefill(&mut self, mut leg: Leg) -> Action {
        let Ok(prefill_body) = nixl::prefill_body(&leg.client) else {
            return self.prefill_failed(leg, "the request body cannot be rewritten");
        };
        let now = host::now_us();
        let left_ms = leg.deadline_us.saturating_sub(now) / 1000;
        if left_ms == 0 {
            return self.prefill_failed(leg, "the prefill timeout ran out");
        }
        let timeout = Duration::from_millis(left_ms);
        let called = self.call_prefill(
            &leg.at,
            &leg.path,
            &leg.request_id,
            leg.authorization.as_deref(),
            &prefill_body,
            timeout,
        );
        match called {
            Ok(token) => {
                leg.sent_us = now;
                self.stage = Stage::Prefilling {
                    token,
                    leg: Box::new(leg),
                };
                Action::Pause
            }
            Err(status) => {
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "kvgate: prefill callout to {} failed: {status:?}",
                        leg.at.endpoint
                    ),
                );
                self.release_prefill();
                self.prefill_failed(leg, "the prefill worker is not in the catalog")
            }
        }
    }

    /// Applies a prefill leg's answer.
    pub(super) fn prefill_answered(&mut self, leg: Leg, body_size: usize) -> Action {
        self.release_prefill();
        {
            let st = self.state.borrow();
            record(
                st.metrics.prefill_us,
                host::now_us().saturating_sub(leg.sent_us),
            );
        }
        let status = host::call_response_header(":status").and_then(|s| s.parse::<u16>().ok());
        let answer = host::call_response_body(body_size).unwrap_or_default();
        match prefill::judge(status, &answer, &leg.client) {
            Verdict::Transfer(body) => {
                let limit = self.state.borrow().config.max_body_bytes;
                // Envoy must not be handed a body over its buffer limit
                // (docs/envoy-callouts.md): from this callback a 413 of
                // Envoy's own aborts the process. The transfer is lost,
                // the prompt is not; another prefill would make a body
                // as large, so none is tried.
                if body.len() > limit.saturating_add(disagg::DECODE_HEADROOM_BYTES) {
                    host::log(
                        LogLevel::Warn,
                        &format!(
                            "kvgate: the decode body of {} ({} bytes) exceeds max_body_bytes and its headroom",
                            leg.request_id,
                            body.len()
                        ),
                    );
                    return self.no_room(leg);
                }
                self.replace_body(&body);
                Action::Continue
            }
            Verdict::ClientError(status) => {
                inc(self.state.borrow().metrics.prefill_client_errors);
                self.stage = Stage::Replied;
                let content_type = host::call_response_header(header::CONTENT_TYPE)
                    .unwrap_or_else(|| "application/json".into());
                if let Err(s) = host::send_response(
                    status,
                    &[(header::CONTENT_TYPE, content_type.as_str())],
                    &answer,
                ) {
                    host::log(
                        LogLevel::Error,
                        &format!("kvgate: relaying the prefill answer failed: {s:?}"),
                    );
                }
                Action::Pause
            }
            Verdict::Failed(cause) => self.prefill_failed(leg, cause),
        }
    }

    /// A failed try: the runner-up once, within the same budget; then the
    /// decode worker prefills, or the request is answered 503.
    fn prefill_failed(&mut self, mut leg: Leg, cause: &str) -> Action {
        host::log(
            LogLevel::Warn,
            &format!(
                "kvgate: prefill leg {} on {} failed: {cause}",
                leg.request_id, leg.at.endpoint
            ),
        );
        // A try that spent (almost) all of the one budget leaves none
        // worth a second: a timed-out leg is failed, not retried for the
        // last milliseconds.
        let left_us = leg.deadline_us.saturating_sub(host::now_us());
        let worth_a_try = left_us >= leg.plan.timeout_ms.saturating_mul(1000) / MIN_RETRY_SHARE;
        if !leg.retried
            && worth_a_try
            && let Some(next) = leg.plan.runner_up.take()
        {
            inc(self.state.borrow().metrics.prefill_retried);
            leg.retried = true;
            leg.at = next;
            return self.send_prefill(leg);
        }
        self.give_up(leg, Reply::prefill_failed(cause))
    }

    /// The decode body would not fit: the decode worker computes the
    /// prompt itself at once, never after another try; where the model
    /// allows no local prefill, the client's body is too large.
    fn no_room(&mut self, leg: Leg) -> Action {
        let limit = self.state.borrow().config.max_body_bytes;
        self.give_up(leg, Reply::too_large(limit))
    }

    /// No prefill leg will be: as the model says, the decode worker
    /// computes the prompt (and books it), or the client gets `refusal`.
    fn give_up(&mut self, leg: Leg, refusal: Reply) -> Action {
        inc(self.state.borrow().metrics.prefill_failed);
        match leg.plan.on_failure {
            OnPrefillFailure::Local => {
                self.book_local_prefill(leg.plan.local_prefill_tokens);
                self.send_whole(&leg.client);
                Action::Continue
            }
            OnPrefillFailure::Fail => self.reply(&refusal),
        }
    }

    /// Adds the prompt the decode worker now computes to its booking.
    fn book_local_prefill(&mut self, tokens: u64) {
        let Some(b) = self.booking else {
            return;
        };
        let clock = self.clock.take();
        self.release(true);
        self.clock = clock;
        let mut st = self.state.borrow_mut();
        self.booking = Some(st.book(&self.model, b.slot, b.prefill + tokens, b.decode));
    }

    /// Sends the client's body to the decode worker for it to compute the
    /// prompt itself: without any transfer field of the client's
    /// (`kv_transfer_params`, SGLang's `bootstrap_*`), which would name a
    /// host for the worker to pull blocks from.
    pub(super) fn send_whole(&mut self, client: &[u8]) {
        match disagg::whole_body(client) {
            Ok(Cow::Owned(body)) => self.replace_body(&body),
            Ok(Cow::Borrowed(_)) => {}
            // Not an object: the worker refuses it as the client's error.
            Err(_) => {}
        }
    }

    /// Replaces the buffered request body and its length.
    fn replace_body(&mut self, body: &[u8]) {
        let len = body.len().to_string();
        if host::set_request_body(body).is_err()
            || host::set_request_header("content-length", &len).is_err()
        {
            host::log(
                LogLevel::Error,
                "kvgate: could not replace the request body",
            );
        }
    }

    /// Releases the prefill leg's booking, all of it: the leg answered,
    /// or was never sent.
    pub(super) fn release_prefill(&mut self) {
        let Some(b) = self.prefill_booking else {
            return;
        };
        let Ok(mut st) = self.state.try_borrow_mut() else {
            return;
        };
        self.prefill_booking = None;
        st.end_leg(b);
    }

    /// The client is gone: a prefill leg still in flight keeps running on
    /// its worker (Envoy cancels no callout), so its booking is handed to
    /// the VM until the leg's deadline instead of ending now.
    pub(super) fn orphan_prefill(&mut self) {
        let until_us = match (&self.stage, &self.draining) {
            (Stage::Prefilling { leg, .. }, _) => leg.deadline_us,
            (_, Some(d)) => d.deadline_us,
            _ => return,
        };
        let Some(b) = self.prefill_booking else {
            return;
        };
        let Ok(mut st) = self.state.try_borrow_mut() else {
            return;
        };
        self.prefill_booking = None;
        self.draining = None;
        st.orphan(b, until_us);
    }
}
