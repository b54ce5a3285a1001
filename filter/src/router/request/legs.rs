//! The legs of a disaggregated request, as `kvgate_core::dispatch` split
//! it: the prefill callout, what its answer makes of the client's request
//! (vLLM's NIXL protocol), and SGLang's two legs sent at once. What a
//! failed leg becomes is the dispatch's rule ([`Split::after_failure`]);
//! what a prefill answer means is judged in [`super::prefill`].

use super::super::Booking;
use super::decide::Facts;
use super::flow::{Flow, Routed, Stage, replace_body, send_whole};
use super::prefill::{self, Verdict};
use crate::host::{Fault, Host};
use crate::reply::Reply;
use kvgate_core::booking::Timing;
use kvgate_core::disagg::{self, nixl, sglang};
use kvgate_core::dispatch::{AfterFailure, Split, Target, Whole, WholeBody};
use kvgate_core::header;
use kvgate_core::plan::Leg;
use proxy_wasm::types::{Action, LogLevel};
use std::time::Duration;

/// A request paused on its prefill leg.
#[derive(Debug)]
pub(super) struct Prefilling {
    /// The callout in flight.
    token: u32,
    /// Its booking on the prefill worker, and when it was sent.
    booking: Booking,
    sent_us: u64,
    plan: LegPlan,
}

/// What a prefill try is made from, and what its answer goes on to.
#[derive(Debug)]
pub(super) struct LegPlan {
    split: Split,
    /// The worker this try goes to.
    at: Target,
    /// This is the second try.
    retried: bool,
    /// The decode leg: its headers set and its blocks booked; it is sent
    /// when the request resumes.
    decode: Routed,
    /// The client's body, which the decode leg is made from.
    client: Vec<u8>,
    /// The path both legs are sent to.
    path: String,
    request_id: String,
    /// The client's `authorization`, for workers that check an API key.
    authorization: Option<String>,
    /// When the leg's one budget runs out.
    deadline_us: u64,
}

impl Prefilling {
    pub fn token(&self) -> u32 {
        self.token
    }

    /// The prefill leg's booking and deadline, and the decode leg's
    /// booking: what a departed client leaves behind.
    pub fn into_parts(self) -> (Booking, u64, Option<Booking>) {
        (
            self.booking,
            self.plan.deadline_us,
            self.plan.decode.booking,
        )
    }
}

/// An SGLang prefill leg in flight beside its decode leg.
#[derive(Debug)]
pub(super) struct Draining {
    pub token: u32,
    pub booking: Booking,
    endpoint: String,
    request_id: String,
    room: u64,
    sent_us: u64,
    isl_tokens: u32,
    /// When Envoy ends the callout if the worker has not answered.
    pub deadline_us: u64,
}

/// What a request's legs are sent with.
struct Exchange {
    path: String,
    request_id: String,
    authorization: Option<String>,
}

impl Flow {
    /// Books both legs of a vLLM NIXL request, with the request routed to
    /// its decode worker, and sends the prefill leg; the request waits
    /// for its answer.
    pub(super) fn split(
        &mut self,
        h: &impl Host,
        s: Split,
        facts: &Facts,
        body: Vec<u8>,
    ) -> Action {
        let decode = self.route_decode(h, &s, facts);
        let ex = self.exchange(h);
        let deadline_us = h.now_us().saturating_add(s.timeout_ms.saturating_mul(1000));
        let plan = LegPlan {
            at: s.prefill.clone(),
            split: s,
            retried: false,
            decode,
            client: body,
            path: ex.path,
            request_id: ex.request_id,
            authorization: ex.authorization,
            deadline_us,
        };
        self.send_prefill(h, plan)
    }

    /// The decode leg's headers and booking: no prompt, its blocks.
    fn route_decode(&mut self, h: &impl Host, s: &Split, facts: &Facts) -> Routed {
        let decode = Whole {
            model: s.model.clone(),
            target: s.decode.clone(),
            fallback: s.decode_fallback.clone(),
            body: WholeBody::Scrubbed,
            why: None,
            pull: s.pull,
        };
        self.route_to(h, decode, facts, Leg::Decode)
    }

    fn exchange(&mut self, h: &impl Host) -> Exchange {
        Exchange {
            path: h.request_header(":path").unwrap_or_default(),
            authorization: h.request_header("authorization"),
            request_id: self.mint_request_id(h),
        }
    }

    /// SGLang's two legs, sent at once: the same body, the client's with
    /// the bootstrap fields, to the prefill worker as a callout and to the
    /// decode worker as the request itself. A callout Envoy refuses at once
    /// is tried on the runner-up: nothing has been sent yet.
    pub(super) fn split_sglang(
        &mut self,
        h: &impl Host,
        mut s: Split,
        facts: &Facts,
        body: &[u8],
    ) -> Action {
        let decode_rank = sglang::Rank {
            index: s.decode.dp_index,
            size: s.decode.dp_size,
        };
        let mut decode = self.route_decode(h, &s, facts);
        let ex = self.exchange(h);
        let mut at = s.prefill.clone();
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
                h.log(
                    LogLevel::Info,
                    &format!(
                        "kvgate: no bootstrap room lands on both chosen ranks of {}: \
                         the decode worker serves it on rank {} of its {}",
                        ex.request_id,
                        room.room % u64::from(decode_rank.size.max(1)),
                        decode_rank.size
                    ),
                );
            }
            let host_ip = sglang::bootstrap_host(&at.endpoint);
            let Ok(both) = sglang::body(body, host_ip, at.bootstrap_port, room.room) else {
                return self.refuse(
                    h,
                    decode,
                    &Reply::prefill_failed("the request body cannot be rewritten"),
                );
            };
            let limit = self.state.borrow().config.max_body_bytes;
            if both.len() > limit.saturating_add(disagg::DECODE_HEADROOM_BYTES) {
                return self.refuse(
                    h,
                    decode,
                    &Reply::prefill_failed(
                        "the body with its bootstrap fields exceeds max_body_bytes and its headroom",
                    ),
                );
            }
            let timeout = Duration::from_millis(s.timeout_ms.max(1));
            match self.call_prefill(h, &decode.model, &at, &ex, &both, timeout) {
                Ok((token, booking)) => {
                    let sent_us = h.now_us();
                    decode.draining = Some(Draining {
                        token,
                        booking,
                        endpoint: at.endpoint.clone(),
                        request_id: ex.request_id,
                        room: room.room,
                        sent_us,
                        isl_tokens: facts.isl_tokens,
                        deadline_us: sent_us
                            .saturating_add(s.timeout_ms.max(1).saturating_mul(1000)),
                    });
                    replace_body(h, &both);
                    self.stage = Stage::Routed(Box::new(decode));
                    return Action::Continue;
                }
                Err(status) => {
                    h.log(
                        LogLevel::Warn,
                        &format!(
                            "kvgate: prefill callout to {} failed: {status:?}",
                            at.endpoint
                        ),
                    );
                    let Some(next) = s.next_sglang_prefill() else {
                        h.count(self.state.borrow().metrics.prefill_failed);
                        return self.refuse(
                            h,
                            decode,
                            &Reply::prefill_failed("the prefill worker is not in the catalog"),
                        );
                    };
                    h.count(self.state.borrow().metrics.prefill_retried);
                    at = next;
                }
            }
        }
    }

    /// Books `at`'s prefill and dispatches the callout that computes it
    /// there; a call Envoy refuses releases the booking at once.
    fn call_prefill(
        &mut self,
        h: &impl Host,
        model: &str,
        at: &Target,
        ex: &Exchange,
        body: &[u8],
        timeout: Duration,
    ) -> Result<(u32, Booking), Fault> {
        let mut st = self.state.borrow_mut();
        let booking = st.book(h, model, &self.tenant, at.slot, at.prefill_tokens, 0);
        let c = &st.config;
        let rank = at.rank.to_string();
        let mut headers = vec![
            (":method", "POST"),
            (":path", ex.path.as_str()),
            (":authority", at.endpoint.as_str()),
            ("content-type", "application/json"),
            (header::REQUEST_ID, ex.request_id.as_str()),
            (c.prefill_host_header.as_str(), at.endpoint.as_str()),
        ];
        if at.names_rank {
            headers.push((c.rank_header.as_str(), rank.as_str()));
        }
        if let Some(a) = &ex.authorization {
            headers.push(("authorization", a.as_str()));
        }
        match h.dispatch(&c.prefill_cluster, headers, Some(body), timeout) {
            Ok(token) => {
                // Made from the root (a held request released on its
                // tick): the SDK hands the answer to the root, which
                // passes it on by this.
                if self.from_root {
                    st.forward(token, self.context_id(), self.me.clone());
                }
                Ok((token, booking))
            }
            Err(status) => {
                st.release(h, booking, true, None);
                Err(status)
            }
        }
    }

    /// Sends a try of the prefill leg; a call Envoy cannot make (its
    /// host left the catalog) fails the try at once.
    fn send_prefill(&mut self, h: &impl Host, plan: LegPlan) -> Action {
        let Ok(prefill_body) = nixl::prefill_body(&plan.client) else {
            return self.leg_failed(h, plan, "the request body cannot be rewritten");
        };
        let now = h.now_us();
        let left_ms = plan.deadline_us.saturating_sub(now) / 1000;
        if left_ms == 0 {
            return self.leg_failed(h, plan, "the prefill timeout ran out");
        }
        let ex = Exchange {
            path: plan.path.clone(),
            request_id: plan.request_id.clone(),
            authorization: plan.authorization.clone(),
        };
        let timeout = Duration::from_millis(left_ms);
        match self.call_prefill(h, &plan.decode.model, &plan.at, &ex, &prefill_body, timeout) {
            Ok((token, booking)) => {
                self.stage = Stage::Prefilling(Box::new(Prefilling {
                    token,
                    booking,
                    sent_us: now,
                    plan,
                }));
                Action::Pause
            }
            Err(status) => {
                h.log(
                    LogLevel::Warn,
                    &format!(
                        "kvgate: prefill callout to {} failed: {status:?}",
                        plan.at.endpoint
                    ),
                );
                self.leg_failed(h, plan, "the prefill worker is not in the catalog")
            }
        }
    }

    /// Ends a prefill leg's booking at its answer, with its timing: from
    /// its dispatch to the answer, and the answer's status (0: a reset).
    /// Returns the status as read, and the time of the answer.
    fn end_prefill(
        &mut self,
        h: &impl Host,
        booking: Booking,
        sent_us: u64,
        isl: u32,
    ) -> (Option<u16>, u64) {
        let status = h
            .call_response_header(":status")
            .and_then(|s| s.parse::<u16>().ok());
        let now = h.now_us();
        let took = now.saturating_sub(sent_us);
        let took32 = u32::try_from(took).unwrap_or(u32::MAX);
        let mut st = self.state.borrow_mut();
        h.sample(st.metrics.prefill_us, took);
        let timing = Timing {
            leg: Leg::Prefill,
            first_byte_us: took32,
            total_us: took32,
            isl_tokens: isl,
            output_tokens: 0,
            status: status.unwrap_or(0),
            client_first_byte_us: 0,
        };
        st.release(h, booking, true, Some(timing));
        (status, now)
    }

    /// Applies a prefill leg's answer: the decode leg goes on with the
    /// transfer, or the leg failed, or the client's error goes back.
    pub(super) fn prefill_answered(
        &mut self,
        h: &impl Host,
        p: Prefilling,
        body_size: usize,
    ) -> Action {
        let Prefilling {
            booking,
            sent_us,
            mut plan,
            ..
        } = p;
        let (status, now) = self.end_prefill(h, booking, sent_us, plan.decode.clock.isl_tokens);
        let answer = h.call_response_body(body_size).unwrap_or_default();
        match prefill::judge(status, &answer, &plan.client) {
            Verdict::Transfer(body) => {
                let limit = self.state.borrow().config.max_body_bytes;
                // Envoy must not be handed a body over its buffer limit
                // (docs/envoy-callouts.md): from this callback a 413 of
                // Envoy's own aborts the process. The transfer is lost,
                // the prompt is not; another prefill would make a body
                // as large, so none is tried.
                if body.len() > limit.saturating_add(disagg::DECODE_HEADROOM_BYTES) {
                    h.log(
                        LogLevel::Warn,
                        &format!(
                            "kvgate: the decode body of {} ({} bytes) exceeds max_body_bytes and its headroom",
                            plan.request_id,
                            body.len()
                        ),
                    );
                    return self.give_up(h, plan, Reply::too_large(limit));
                }
                replace_body(h, &body);
                if let Some(pull) = &plan.split.pull {
                    self.state.borrow().metrics.placed(h, pull);
                }
                // The decode worker's own clock starts now: its time to
                // first token is not the prefill leg's nor the transfer's
                // wait before it.
                plan.decode.clock.sent_us = now;
                self.stage = Stage::Routed(Box::new(plan.decode));
                Action::Continue
            }
            Verdict::ClientError(status) => {
                h.count(self.state.borrow().metrics.prefill_client_errors);
                self.release_decode(h, plan.decode);
                self.stage = Stage::Replied;
                let content_type = h
                    .call_response_header(header::CONTENT_TYPE)
                    .unwrap_or_else(|| "application/json".into());
                if let Err(s) = h.send_response(
                    status,
                    &[(header::CONTENT_TYPE, content_type.as_str())],
                    &answer,
                ) {
                    h.log(
                        LogLevel::Error,
                        &format!("kvgate: relaying the prefill answer failed: {s:?}"),
                    );
                }
                Action::Pause
            }
            Verdict::Failed(cause) => self.leg_failed(h, plan, cause),
        }
    }

    /// A failed try: as the dispatch says, the runner-up once within the
    /// same budget, then the decode worker computes the prompt or the
    /// request is answered 503.
    fn leg_failed(&mut self, h: &impl Host, mut plan: LegPlan, cause: &str) -> Action {
        h.log(
            LogLevel::Warn,
            &format!(
                "kvgate: prefill leg {} on {} failed: {cause}",
                plan.request_id, plan.at.endpoint
            ),
        );
        let left_us = plan.deadline_us.saturating_sub(h.now_us());
        match plan.split.after_failure(plan.retried, left_us) {
            AfterFailure::Retry(next) => {
                h.count(self.state.borrow().metrics.prefill_retried);
                plan.retried = true;
                plan.at = next;
                self.send_prefill(h, plan)
            }
            _ => self.give_up(h, plan, Reply::prefill_failed(cause)),
        }
    }

    /// No prefill leg will be: as the model says, the decode worker
    /// computes the prompt (and books it), or the client gets `refusal`.
    fn give_up(&mut self, h: &impl Host, plan: LegPlan, refusal: Reply) -> Action {
        h.count(self.state.borrow().metrics.prefill_failed);
        match plan.split.give_up() {
            AfterFailure::Local { prefill_tokens } => {
                let LegPlan {
                    mut decode, client, ..
                } = plan;
                {
                    let mut st = self.state.borrow_mut();
                    if let Some(b) = decode.booking.take() {
                        st.release(h, b, true, None);
                        decode.booking = Some(st.book(
                            h,
                            &decode.model,
                            &self.tenant,
                            b.slot,
                            b.prefill + prefill_tokens,
                            b.decode,
                        ));
                    }
                }
                // The decode worker now serves the request whole, from now.
                decode.clock.leg = Leg::Whole;
                // A pull's decode worker computes what it was to pull; the
                // pull's prediction no longer says anything.
                if let Some(pull) = plan.split.pull.map(|p| p.recomputed()) {
                    self.state.borrow().metrics.placed(h, &pull);
                    decode.placement = Some(pull.header_value());
                    decode.clock.predicted_ttft_ms = None;
                }
                decode.clock.sent_us = h.now_us();
                send_whole(h, &client);
                self.stage = Stage::Routed(Box::new(decode));
                Action::Continue
            }
            _ => self.refuse(h, plan.decode, &refusal),
        }
    }

    /// Answers the client without its decode leg, whose booking ends.
    fn refuse(&mut self, h: &impl Host, decode: Routed, reply: &Reply) -> Action {
        let model = decode.model.clone();
        self.release_decode(h, decode);
        self.reply_for(h, &model, reply)
    }

    /// Ends a decode leg that will not be sent.
    fn release_decode(&mut self, h: &impl Host, mut decode: Routed) {
        if let Some(b) = decode.booking.take() {
            self.state.borrow_mut().release(h, b, true, None);
        }
    }

    /// An SGLang prefill answer: its booking ends. A failure cannot be
    /// retried (the decode leg is on its way, waiting in the room), so it
    /// is counted and logged; the decode worker fails the request on its
    /// own bootstrap timeout.
    pub(super) fn drained(&mut self, h: &impl Host, leg: Draining) {
        let (status, _) = self.end_prefill(h, leg.booking, leg.sent_us, leg.isl_tokens);
        if status == Some(200) {
            return;
        }
        h.count(self.state.borrow().metrics.prefill_failed);
        let status = status.map_or_else(|| "a reset".to_string(), |s| format!("status {s}"));
        h.log(
            LogLevel::Warn,
            &format!(
                "kvgate: SGLang prefill leg {} (room {}) on {} failed with {status}; \
                 its decode worker fails the request on its bootstrap timeout",
                leg.request_id, leg.room, leg.endpoint
            ),
        );
    }
}
