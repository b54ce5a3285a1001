//! A request's life as a state machine: each [`Stage`] owns the data
//! valid in it, and each callback of the request is a transition written
//! against [`Host`], so that every transition runs natively in tests.
//!
//! ```text
//! Start ─► Passing                        (not a request kvgate routes)
//!   └────► Reading ─► Replied             (400, 413, stale, shed, refused)
//!             ├─────► Open                (failed open: scrubbed, undecided)
//!             ├─────► Routed ─► Ended     (whole, or SGLang's two legs at once)
//!             ├─────► Prefilling ─► Routed | Prefilling (runner-up) | Replied
//!             └─────► Held ─► Routed | Prefilling | Replied (deadline, displaced)
//! ```
//!
//! A paused request goes on when something calls [`Flow::resume`] in its
//! context: its prefill callout's answer, or the root's tick for a held
//! request (`router::held`), which makes the request's context effective
//! first and decides it again ([`Flow::retry_held`]).

use super::super::gates::Gate;
use super::super::held::HeldRef;
use super::super::{Booking, RouterState};
use super::decide::{self, Admit, Decision, Facts, Inputs};
use super::legs::{Draining, Prefilling};
use super::stopwatch::{Phase, Stopwatch};
use super::usage::{self, Usage};
use crate::config::{OnStale, ms};
use crate::host::Host;
use crate::manifest::Manifest;
use crate::metrics::Outcome;
use crate::reply::{Reason, Reply};
use kvgate_core::DEFAULT_TENANT;
use kvgate_core::admit::{body as admit_body, queue::Pushed};
use kvgate_core::booking::Timing;
use kvgate_core::dispatch::{Target, Whole, WholeBody};
use kvgate_core::header::ATTEMPT_COUNT;
use kvgate_core::plan::Leg;
use kvgate_core::plan::request::{Endpoint, parse};
use kvgate_core::state::Protocol;
use proxy_wasm::types::{Action, LogLevel};
use std::cell::RefCell;
use std::rc::{Rc, Weak};

/// Where a request is in its life, with what it holds there.
#[derive(Debug, Default)]
pub(super) enum Stage {
    /// Before its headers.
    #[default]
    Start,
    /// Not a request kvgate routes: it passes untouched.
    Passing,
    /// Headers seen, its body being read whole.
    Reading(Reading),
    /// Paused on its prefill leg.
    Prefilling(Box<Prefilling>),
    /// Paused in the VM's queue until a worker may take it.
    Held(Box<Holding>),
    /// Sent on to its worker, and booked there until its response ends.
    Routed(Box<Routed>),
    /// Failed open: sent on undecided, its body scrubbed.
    Open,
    /// Answered by the filter itself.
    Replied,
    /// Its stream is done (logged, or its context dropped): nothing of
    /// it is booked any more.
    Ended,
}

/// A request whose body is being read.
#[derive(Debug)]
pub(super) struct Reading {
    endpoint: Endpoint,
    /// From the configured tenant header; `default` when absent.
    tenant: String,
    /// What the request read at its headers.
    manifest: Manifest,
    /// The body's size so far, as the last body callback said: an
    /// HTTP/2 request that ends with trailers is decided at them.
    body_seen: usize,
    /// No fresh state: the body is read whole only to be scrubbed of
    /// transfer fields before Envoy's own balancing sends it on.
    failed_open: bool,
    /// The class header's value, as Envoy set it.
    class: Option<String>,
    /// The client asked, by header, not to be held.
    do_not_queue: bool,
}

/// A held request: what deciding it again needs.
#[derive(Debug)]
pub(super) struct Holding {
    reading: Reading,
    body_size: usize,
    class: usize,
    model: String,
    held_at_ms: u64,
}

/// How often a request is decided again when the decode worker it was
/// given filled up meanwhile (another thread took its last slot).
const GATE_TRIES: usize = 3;

/// What deciding a request came to.
enum Applied {
    /// Routed, split or answered: the callback's action.
    Done(Action),
    /// No worker may take it now, and its class may be held: the reading
    /// back, its model and the Retry-After hint.
    Full(Reading, String, u32),
}

/// What a held request's try came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retried {
    /// Sent on (or answered): it left the queue.
    Left,
    /// Still no worker: it stays.
    StillHeld,
}

/// A request sent on to a worker.
#[derive(Debug)]
pub(super) struct Routed {
    /// The model the fleet knows it by.
    pub model: String,
    /// Its load on the worker, until released.
    pub booking: Option<Booking>,
    pub clock: Clock,
    /// Where Envoy retries when the worker refuses the connection.
    pub fallback: Option<Target>,
    /// What the served-by response header says: engines name no worker.
    pub served_by: Option<String>,
    /// What the placement header says, on a model that pulls.
    pub placement: Option<String>,
    /// An SGLang prefill leg sent beside it, until it answers.
    pub draining: Option<Draining>,
    /// Sampled: its answer is read for the cached tokens the engine used.
    pub usage: Option<Usage>,
}

/// A leg's clock, for its timed end.
#[derive(Debug, Clone, Copy)]
pub(super) struct Clock {
    pub leg: Leg,
    /// When the request was decided: the client's clock.
    pub decided_us: u64,
    /// When this leg was sent: its worker's clock.
    pub sent_us: u64,
    pub first_byte_us: Option<u64>,
    /// The response's status, once its headers came.
    pub status: u16,
    pub isl_tokens: u32,
    pub output_tokens: u32,
    /// Its time to first token as its worker's fit predicted it (ms).
    pub predicted_ttft_ms: Option<u32>,
}

impl Clock {
    pub fn new(leg: Leg, now_us: u64, facts: &Facts) -> Clock {
        Clock {
            leg,
            decided_us: now_us,
            sent_us: now_us,
            first_byte_us: None,
            status: 0,
            isl_tokens: facts.isl_tokens,
            output_tokens: facts.output_tokens,
            predicted_ttft_ms: None,
        }
    }

    /// The leg's timing at its end; none for a leg that never answered.
    pub fn timing(&self, now_us: u64) -> Option<Timing> {
        let since = |from: u64, t: u64| u32::try_from(t.saturating_sub(from)).unwrap_or(u32::MAX);
        let first = self.first_byte_us?;
        Some(Timing {
            leg: self.leg,
            first_byte_us: since(self.sent_us, first),
            total_us: since(self.sent_us, now_us),
            isl_tokens: self.isl_tokens,
            output_tokens: self.output_tokens,
            status: self.status,
            client_first_byte_us: since(self.decided_us, first),
        })
    }
}

/// One request's state and the router state it shares with its VM.
pub(crate) struct Flow {
    pub(super) state: Rc<RefCell<RouterState>>,
    pub(super) stage: Stage,
    /// Envoy's id of the request's context: where a resume from outside
    /// the request's own callbacks must be made current first.
    context_id: u32,
    /// The flow itself, as the queue and the root's callouts reach it.
    pub(super) me: Weak<RefCell<Flow>>,
    /// Running from the root's tick (a held request released): callouts
    /// made now answer to the root, which passes them on.
    pub(super) from_root: bool,
    /// Its slot on a decode worker with a bound on requests, until it ends.
    gate: Option<Gate>,
    /// Whose share of the load it counts against, as its bookings name
    /// it: its account where admission names one, else its tenant.
    pub(super) tenant: String,
}

impl Flow {
    pub fn new(state: Rc<RefCell<RouterState>>, context_id: u32) -> Flow {
        Flow {
            state,
            stage: Stage::Start,
            context_id,
            me: Weak::new(),
            from_root: false,
            gate: None,
            tenant: String::new(),
        }
    }

    /// A flow the root can reach while it is held.
    pub fn shared(state: Rc<RefCell<RouterState>>, context_id: u32) -> Rc<RefCell<Flow>> {
        let f = Rc::new(RefCell::new(Flow::new(state, context_id)));
        f.borrow_mut().me = Rc::downgrade(&f);
        f
    }

    pub fn context_id(&self) -> u32 {
        self.context_id
    }

    /// Request headers: routing headers are ours alone, whatever the
    /// request; a request kvgate routes waits for its body.
    pub fn on_request_headers(&mut self, h: &impl Host, end_of_stream: bool) -> Action {
        {
            let st = self.state.borrow();
            let c = &st.config;
            let _ = h.remove_request_header(&c.destination_header);
            let _ = h.remove_request_header(&c.rank_header);
            if h.request_header(&c.fallback_header).is_some() {
                let _ = h.remove_request_header(&c.fallback_header);
                // The route may have been matched on the client's header.
                let _ = h.clear_route_cache();
            }
        }
        let endpoint = match h.request_header(":method").as_deref() {
            Some("POST") => Endpoint::from_path(&h.request_header(":path").unwrap_or_default()),
            _ => None,
        };
        let Some(endpoint) = endpoint else {
            self.stage = Stage::Passing;
            return Action::Continue;
        };
        let (cfg_fallback, cfg_tenant, stale_after, on_stale) = {
            let mut st = self.state.borrow_mut();
            st.release_orphans(h);
            h.count(st.metrics.requests);
            let c = &st.config;
            (
                c.fallback_header.clone(),
                c.tenant_header.clone(),
                ms(c.stale_after),
                c.on_stale,
            )
        };
        let tenant = h
            .request_header(&cfg_tenant)
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| DEFAULT_TENANT.to_string());
        let manifest = Manifest::read(h).unwrap_or_default();
        let (class, do_not_queue) = match &self.state.borrow().config.admission {
            Some(a) => (
                {
                    self.tenant = h
                        .request_header(&a.account_header)
                        .filter(|t| !t.is_empty())
                        .unwrap_or_else(|| tenant.clone());
                    h.request_header(&a.class_header)
                },
                a.client_do_not_queue
                    && h.request_header(kvgate_core::header::DO_NOT_QUEUE)
                        .is_some_and(|v| matches!(v.as_str(), "1" | "true")),
            ),
            None => (None, false),
        };
        let mut reading = Reading {
            endpoint,
            tenant,
            manifest,
            body_seen: 0,
            failed_open: false,
            class,
            do_not_queue,
        };
        if !manifest.is_fresh(h.now_ms(), stale_after) {
            match on_stale {
                OnStale::FailClosed => return self.reply(h, &Reply::stale()),
                OnStale::FailOpen => {
                    h.count(self.state.borrow().metrics.failed_open);
                    let _ = h.set_request_header(&cfg_fallback, "stale");
                    if let Err(s) = h.clear_route_cache() {
                        h.log(
                            LogLevel::Warn,
                            &format!("kvgate: clear_route_cache failed: {s:?}"),
                        );
                    }
                    // The body is read whole all the same: without state
                    // the filter cannot tell a disaggregated model, so it
                    // scrubs every body of transfer fields.
                    if end_of_stream {
                        self.stage = Stage::Open;
                        return Action::Continue;
                    }
                    reading.failed_open = true;
                    self.stage = Stage::Reading(reading);
                    return Action::Pause;
                }
            }
        }
        if end_of_stream {
            return self.reply(h, &Reply::bad_request("a request body is required"));
        }
        self.stage = Stage::Reading(reading);
        Action::Pause
    }

    /// A piece of the request body: buffered until the whole is in.
    pub fn on_request_body(
        &mut self,
        h: &impl Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let Stage::Reading(reading) = &mut self.stage else {
            return Action::Continue;
        };
        let limit = self.state.borrow().config.max_body_bytes;
        if body_size > limit {
            return self.reply(h, &Reply::too_large(limit));
        }
        reading.body_seen = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.complete(h, body_size)
    }

    /// HTTP/2 trailers end a request whose last body callback did not:
    /// without this the SDK's default would let Envoy forward the
    /// buffered body undecided. The body read so far is all of it.
    pub fn on_request_trailers(&mut self, h: &impl Host) -> Action {
        let Stage::Reading(reading) = &self.stage else {
            return Action::Continue;
        };
        let seen = reading.body_seen;
        h.count(self.state.borrow().metrics.trailers);
        self.complete(h, seen)
    }

    /// The whole body is in: decided, or (failed open) scrubbed and let
    /// through to Envoy's own balancing.
    fn complete(&mut self, h: &impl Host, body_size: usize) -> Action {
        let Stage::Reading(reading) = std::mem::take(&mut self.stage) else {
            return Action::Continue;
        };
        if reading.failed_open {
            self.stage = Stage::Open;
            let mut body = h.request_body(body_size).unwrap_or_default();
            // Undecided, it is not held, but its admission fields are
            // the gateway's all the same.
            if self.state.borrow().config.admission.is_some()
                && let Some(stripped) = admit_body::take(&body, None).rewritten
            {
                replace_body(h, &stripped);
                body = stripped;
            }
            send_whole(h, &body);
            return Action::Continue;
        }
        self.route(h, reading, body_size)
    }

    /// Decides where the whole buffered body goes, and applies it: after
    /// admission's fields are read from it and stripped, and its class
    /// resolved.
    fn route(&mut self, h: &impl Host, reading: Reading, body_size: usize) -> Action {
        if self.tenant.is_empty() {
            self.tenant.clone_from(&reading.tenant);
        }
        let body = h.request_body(body_size).unwrap_or_default();
        let (class, do_not_queue, rewritten) = self.admission_fields(h, &reading, body);
        // The body Envoy holds now: without the admission fields, with
        // vLLM's priority.
        let body_size = rewritten.unwrap_or(body_size);
        match self.decide_and_apply(h, reading, body_size, class) {
            Applied::Done(action) => action,
            Applied::Full(reading, model, hint) => {
                if do_not_queue {
                    self.count_admission(h, &model, class, Outcome::DoNotQueue);
                    return self.shed(h, &model, Reason::AllWorkersBusy, hint);
                }
                self.hold(h, reading, body_size, class, model, hint)
            }
        }
    }

    /// Reads and strips the body's admission fields (replacing Envoy's
    /// buffered body when they were there), and resolves the request's
    /// class: its header, or its body's field where the operator lets
    /// clients name their own. Returns the class, whether the client
    /// asked not to be held, and the body's new length if it changed.
    fn admission_fields(
        &mut self,
        h: &impl Host,
        reading: &Reading,
        body: Vec<u8>,
    ) -> (usize, bool, Option<usize>) {
        let st = self.state.borrow();
        let Some(a) = &st.config.admission else {
            return (0, false, None);
        };
        let f = admit_body::take(&body, None);
        let class = match (&reading.class, &f.class) {
            (Some(header), _) => a.class_of(Some(header)),
            (None, Some(own)) if a.client_class => a.class_of(Some(own)),
            _ => a.class_of(None),
        };
        let do_not_queue = reading.do_not_queue || (a.client_do_not_queue && f.do_not_queue);
        let priority = a
            .vllm_priority
            .then(|| a.classes.get(class).map(|c| i64::from(c.priority)))
            .flatten();
        let rewritten = match priority {
            Some(p) => admit_body::take(f.rewritten.as_deref().unwrap_or(&body), Some(p)).rewritten,
            None => f.rewritten,
        };
        drop(st);
        let len = rewritten.map(|b| {
            replace_body(h, &b);
            b.len()
        });
        (class, do_not_queue, len)
    }

    /// Decides the request and applies the decision, unless no worker
    /// may take it now and its class may be held (then the caller holds
    /// it). A decode worker with a bound on requests is taken by compare
    /// and swap first; a worker that filled up meanwhile is counted full
    /// and the request decided again, a few times at most.
    fn decide_and_apply(
        &mut self,
        h: &impl Host,
        reading: Reading,
        body_size: usize,
        class: usize,
    ) -> Applied {
        let mut clock = {
            let mut st = self.state.borrow_mut();
            st.decisions = st.decisions.wrapping_add(1);
            Stopwatch::start(h, st.decisions, st.config.phase_timing_every)
        };
        let body = h.request_body(body_size).unwrap_or_default();
        let mut req = match parse(reading.endpoint, &body) {
            Ok(r) => r,
            Err(e) => return Applied::Done(self.reply_for(h, "", &Reply::bad_request(&e.0))),
        };
        let admit = Admit::of(&self.state.borrow().config, class);
        // Requests of its class or before are held for this model: it
        // waits its turn (or, never held, is shed), or a worker that frees
        // up goes to whoever came last rather than to them.
        if !self.from_root {
            let st = self.state.borrow();
            let priority = st
                .config
                .admission
                .as_ref()
                .and_then(|a| a.classes.get(class));
            if let Some(c) = priority
                && st.queued_before(&req.model, c.priority)
            {
                let hint = st.config.retry_after_s;
                drop(st);
                if admit.may_hold {
                    return Applied::Full(reading, req.model, hint);
                }
                self.count_admission(h, &req.model, class, Outcome::Shed);
                return Applied::Done(self.shed(h, &req.model, Reason::PriorityShed, hint));
            }
        }
        let mut decision = None;
        for _ in 0..GATE_TRIES {
            let mut st = self.state.borrow_mut();
            if decide::prepare(h, &mut st, &mut req, &body, &reading.manifest).is_none() {
                drop(st);
                return Applied::Done(self.reply_for(h, &req.model, &Reply::stale()));
            }
            clock.mark(h, Phase::Parsed);
            let inputs = Inputs {
                req: &req,
                tenant: &reading.tenant,
                account: &self.tenant,
                body: &body,
                manifest: &reading.manifest,
                admit: &admit,
            };
            let d = decide::decide(h, &mut st, &inputs, &mut clock);
            let gate = match &d {
                Decision::Whole(_, f) | Decision::Split(_, f) => f.gate.clone(),
                _ => None,
            };
            match gate {
                Some(g) if !st.acquire_gate(h, &g) => continue,
                g => {
                    self.gate = g;
                    decision = Some(d);
                    break;
                }
            }
        }
        let model = req.model.clone();
        let decision = decision.unwrap_or(Decision::Full(0));
        let action = match decision {
            Decision::Whole(w, facts) => {
                let scrub = w.body == WholeBody::Scrubbed;
                let routed = self.route_to(h, *w, &facts, Leg::Whole);
                self.stage = Stage::Routed(Box::new(routed));
                if scrub {
                    self.mint_request_id(h);
                    send_whole(h, &body);
                }
                Action::Continue
            }
            Decision::Split(s, facts) if s.protocol == Protocol::Sglang => {
                self.split_sglang(h, *s, &facts, &body)
            }
            Decision::Split(s, facts) => self.split(h, *s, &facts, body),
            Decision::Reply(r) => {
                // A class never held (or a request asked not to be) is shed
                // here: admission counts it with the rest.
                if r.reason.is_shed() && admit.class.is_some() {
                    self.count_admission(h, &model, class, Outcome::Shed);
                }
                self.reply_for(h, &model, &r)
            }
            Decision::Full(hint) if admit.may_hold => {
                clock.finish(h, &self.state.borrow().metrics);
                return Applied::Full(reading, model, hint);
            }
            Decision::Full(hint) => self.shed(h, &model, Reason::AllWorkersBusy, hint),
        };
        clock.finish(h, &self.state.borrow().metrics);
        Applied::Done(action)
    }

    /// Holds a request no worker may take now, in the VM's queue: until
    /// one frees up or its class's hold runs out. A full queue sheds the
    /// last of the model's requests if this one comes before it, else
    /// this one.
    fn hold(
        &mut self,
        h: &impl Host,
        reading: Reading,
        body_size: usize,
        class: usize,
        model: String,
        hint: u32,
    ) -> Action {
        let now = h.now_ms();
        let pushed = {
            let mut guard = self.state.borrow_mut();
            let st = &mut *guard;
            let Some(a) = &st.config.admission else {
                drop(guard);
                return self.shed(h, &model, Reason::AllWorkersBusy, hint);
            };
            let Some(c) = a.classes.get(class) else {
                drop(guard);
                return self.shed(h, &model, Reason::AllWorkersBusy, hint);
            };
            if c.hold_ms == 0 {
                drop(guard);
                self.count_admission(h, &model, class, Outcome::Shed);
                return self.shed(h, &model, Reason::AllWorkersBusy, hint);
            }
            // Held past its time-to-first-token target it is a miss
            // whatever comes: it waits no longer than that.
            let target = st
                .view
                .snapshot
                .as_ref()
                .and_then(|s| s.model(&model))
                .and_then(|m| a.slo(class, m.slo))
                .map(|slo| u64::from(slo.ttft_ms))
                .filter(|&t| t > 0);
            let wait = target.map_or(c.hold_ms, |t| t.min(c.hold_ms));
            let (priority, deadline) = (c.priority, now.saturating_add(wait));
            let max = a.max_held(&model);
            let me = HeldRef {
                context_id: self.context_id,
                flow: self.me.clone(),
                tenant: self.tenant.clone(),
            };
            // A full queue makes room for a tenant under its share by
            // shedding the last held request of one over it, of this class
            // or a later one.
            let mut unfair = None;
            if st.held.len_of(&model) >= max && !st.over_share(&model, &self.tenant) {
                let victim = st
                    .held
                    .iter()
                    .filter(|e| e.model == model && e.priority >= priority)
                    .filter(|e| st.over_share(&model, &e.item.tenant))
                    .last()
                    .map(|e| e.item.context_id);
                unfair = victim.and_then(|id| st.held.take(|e| e.item.context_id == id));
            }
            match (st.held.push(&model, priority, deadline, me, max), unfair) {
                (Pushed::Held, Some(v)) => Pushed::Displaced(v),
                (pushed, _) => pushed,
            }
        };
        match pushed {
            Pushed::Full(_) => {
                self.count_admission(h, &model, class, Outcome::Shed);
                return self.shed(h, &model, Reason::QueueFull, hint);
            }
            // Answered on the root's next tick, not from inside this
            // request's callback: Envoy sends a local reply on another
            // stream from within one stream's callback unsafely (it
            // crashed doing so).
            Pushed::Displaced(victim) => self.state.borrow_mut().displaced.push(victim.item),
            Pushed::Held => {}
        }
        self.count_admission(h, &model, class, Outcome::Held);
        self.stage = Stage::Held(Box::new(Holding {
            reading,
            body_size,
            class,
            model,
            held_at_ms: now,
        }));
        Action::Pause
    }

    /// Tries a held request again, from the root's tick with its context
    /// made effective: sent on (and resumed) if a worker may take it now.
    pub fn retry_held(&mut self, h: &impl Host) -> Retried {
        let Stage::Held(held) = std::mem::take(&mut self.stage) else {
            return Retried::Left;
        };
        let Holding {
            reading,
            body_size,
            class,
            model,
            held_at_ms,
        } = *held;
        self.from_root = true;
        let applied = self.decide_and_apply(h, reading, body_size, class);
        self.from_root = false;
        match applied {
            Applied::Full(reading, _, _) => {
                self.stage = Stage::Held(Box::new(Holding {
                    reading,
                    body_size,
                    class,
                    model,
                    held_at_ms,
                }));
                Retried::StillHeld
            }
            Applied::Done(_) => {
                let id = self.context_id;
                let left = self
                    .state
                    .borrow_mut()
                    .held
                    .take(|e| e.item.context_id == id)
                    .is_some();
                // Sent, or answered after all (a shed is counted where
                // it is decided): either way its place in the depth goes.
                if left {
                    match self.stage {
                        Stage::Replied => self.left_queue(h, &model, class),
                        _ => self.count_admission(h, &model, class, Outcome::Sent),
                    }
                }
                self.count_wait(h, &model, class, held_at_ms);
                self.resume(h);
                Retried::Left
            }
        }
    }

    /// A held request's deadline passed (the queue let it go).
    pub fn expire_held(&mut self, h: &impl Host) {
        if let Stage::Held(held) = std::mem::take(&mut self.stage) {
            self.count_admission(h, &held.model, held.class, Outcome::Expired);
            self.count_wait(h, &held.model, held.class, held.held_at_ms);
            let hint = self.hint(&held.model);
            let _ = self.shed(h, &held.model, Reason::DeadlinePassed, hint);
        }
    }

    /// A held request shed for one that comes first (the queue let it go).
    pub fn shed_held(&mut self, h: &impl Host, reason: Reason) {
        if let Stage::Held(held) = std::mem::take(&mut self.stage) {
            self.left_queue(h, &held.model, held.class);
            self.count_admission(h, &held.model, held.class, Outcome::Shed);
            self.count_wait(h, &held.model, held.class, held.held_at_ms);
            let hint = self.hint(&held.model);
            let _ = self.shed(h, &held.model, reason, hint);
        }
    }

    /// The model's Retry-After estimate, else the configured hint.
    fn hint(&self, model: &str) -> u32 {
        let st = self.state.borrow();
        st.view
            .snapshot
            .as_ref()
            .and_then(|s| s.model(model))
            .map(|m| m.retry_after_s)
            .filter(|&s| s > 0)
            .unwrap_or(st.config.retry_after_s)
    }

    /// Answers with the model's shed status and `reason`.
    fn shed(&mut self, h: &impl Host, model: &str, reason: Reason, hint: u32) -> Action {
        let status = self
            .state
            .borrow()
            .config
            .admission
            .as_ref()
            .map_or(503, |a| a.shed_status(model));
        self.reply_for(h, model, &Reply::shed(status, reason, hint))
    }

    fn class_name(&self, class: usize) -> String {
        self.state
            .borrow()
            .config
            .admission
            .as_ref()
            .and_then(|a| a.classes.get(class))
            .map_or_else(String::new, |c| c.name.clone())
    }

    fn count_admission(&self, h: &impl Host, model: &str, class: usize, o: Outcome) {
        let name = self.class_name(class);
        self.state.borrow_mut().metrics.admitted(h, model, &name, o);
    }

    fn count_wait(&self, h: &impl Host, model: &str, class: usize, since_ms: u64) {
        let name = self.class_name(class);
        let waited = h.now_ms().saturating_sub(since_ms);
        self.state
            .borrow_mut()
            .metrics
            .waited(h, model, &name, waited);
    }

    /// A held request left the queue other than by being sent or
    /// expiring: its depth goes.
    fn left_queue(&self, h: &impl Host, model: &str, class: usize) {
        let name = self.class_name(class);
        self.state.borrow_mut().metrics.unheld(h, model, &name);
    }

    /// Sets the routing headers for `w`, books it and starts its clock;
    /// the caller sets the stage.
    pub(super) fn route_to(&mut self, h: &impl Host, w: Whole, facts: &Facts, leg: Leg) -> Routed {
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let destination = w.destination();
        let Whole {
            model,
            target,
            fallback,
            pull,
            ..
        } = w;
        let c = &st.config;
        let every = c.cached_tokens_every;
        let served_by = (!c.served_by_header.is_empty()).then(|| target.served_by());
        let mut ok = h
            .set_request_header(&c.destination_header, &destination)
            .is_ok();
        // Without a rank to name, the header stays as the request headers
        // left it: scrubbed of any client's copy.
        if target.names_rank {
            ok &= h
                .set_request_header(&c.rank_header, &target.rank.to_string())
                .is_ok();
        }
        if !ok {
            h.log(LogLevel::Error, "kvgate: could not set routing headers");
        }
        h.count(st.metrics.routed);
        if let Some(record) = &facts.report {
            st.report(h, record);
        }
        let booking = st.book(
            h,
            &model,
            &self.tenant,
            target.slot,
            target.prefill_tokens,
            target.decode_blocks,
        );
        let mut clock = Clock::new(leg, h.now_us(), facts);
        // A decode leg's first byte follows another worker's prefill: it
        // carries a prediction only for a pull, whose target predicts the
        // holder's prefill and the transfer, from now (before the prefill
        // leg is sent).
        clock.predicted_ttft_ms = target.ttft_ms;
        let usage =
            (leg == Leg::Whole && every > 0 && st.decisions.is_multiple_of(every)).then(|| {
                let isl_tokens = u64::from(facts.isl_tokens);
                Usage {
                    predicted: isl_tokens.saturating_sub(target.prefill_tokens),
                    isl_tokens,
                    reported: None,
                }
            });
        Routed {
            model,
            booking: Some(booking),
            clock,
            fallback,
            served_by,
            placement: pull.map(|p| p.header_value()),
            draining: None,
            usage,
        }
    }

    /// Answers the client itself, counted under the request's model.
    pub(super) fn reply_for(&mut self, h: &impl Host, model: &str, r: &Reply) -> Action {
        {
            let mut st = self.state.borrow_mut();
            st.metrics.rejected(h, r.reason);
            st.send(
                h,
                &kvgate_core::booking::Event::Rejected {
                    model: model.to_string(),
                    reason: r.reason,
                },
            );
        }
        if let Err(status) = h.send_reply(r) {
            h.log(
                LogLevel::Error,
                &format!("kvgate: local reply failed: {status:?}"),
            );
        }
        self.stage = Stage::Replied;
        Action::Pause
    }

    fn reply(&mut self, h: &impl Host, r: &Reply) -> Action {
        self.reply_for(h, "", r)
    }

    /// A callout's answer: the SGLang prefill leg drained beside its
    /// request, or the prefill leg the request waits on.
    pub fn on_callout_answer(&mut self, h: &impl Host, token: u32, body_size: usize) {
        if let Stage::Routed(r) = &mut self.stage
            && let Some(d) = r.draining.take_if(|d| d.token == token)
        {
            self.drained(h, d);
            return;
        }
        if !matches!(&self.stage, Stage::Prefilling(p) if p.token() == token) {
            return;
        }
        let Stage::Prefilling(p) = std::mem::take(&mut self.stage) else {
            return;
        };
        self.prefill_answered(h, *p, body_size);
        self.resume(h);
    }

    /// A callout answer the root passed on: made while the request was
    /// released from the queue, so any try after it answers to the root
    /// too.
    pub fn on_forwarded_answer(&mut self, h: &impl Host, token: u32, body_size: usize) {
        self.from_root = true;
        self.on_callout_answer(h, token, body_size);
        self.from_root = false;
    }

    /// Lets a paused request go on to the worker its stage names: called
    /// in the request's own context (today from its callout's answer). A
    /// request still paused, or answered, is not resumed.
    pub fn resume(&mut self, h: &impl Host) {
        if let Stage::Routed(_) | Stage::Open = self.stage
            && let Err(status) = h.resume_request()
        {
            h.log(
                LogLevel::Error,
                &format!("kvgate: resuming the request failed: {status:?}"),
            );
        }
    }

    /// Response headers: the leg's status, a retry's booking moved, the
    /// served-by header.
    pub fn on_response_headers(&mut self, h: &impl Host) -> Action {
        let Stage::Routed(r) = &mut self.stage else {
            return Action::Continue;
        };
        r.clock.status = h
            .response_header(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if r.fallback.is_some() {
            self.follow_retry(h);
        }
        if let Stage::Routed(r) = &mut self.stage
            && let Some(value) = r.served_by.take()
        {
            let st = self.state.borrow();
            let _ = h.set_response_header(&st.config.served_by_header, &value);
        }
        if let Stage::Routed(r) = &mut self.stage
            && let Some(value) = r.placement.take()
        {
            let _ = h.set_response_header(kvgate_core::header::PLACEMENT, &value);
        }
        if let Stage::Routed(r) = &self.stage
            && let Some(p) = r.clock.predicted_ttft_ms
        {
            let st = self.state.borrow();
            if !st.config.predicted_ttft_header.is_empty() {
                let _ = h.set_response_header(&st.config.predicted_ttft_header, &p.to_string());
            }
        }
        Action::Continue
    }

    /// Response body: the prompt's booking ends at the first byte, the
    /// rest at the last. Releasing at the last byte, not at `on_log`,
    /// frees the rank before the client can send its next request.
    pub fn on_response_body(
        &mut self,
        h: &impl Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if body_size > 0
            && let Stage::Routed(r) = &mut self.stage
            && let Some(u) = r.usage.as_mut()
            && let Some(n) = h
                .response_body(body_size)
                .as_deref()
                .and_then(usage::cached_tokens)
        {
            u.reported = Some(n);
        }
        if end_of_stream {
            self.release(h, true);
        } else if body_size > 0 {
            self.release(h, false);
        }
        Action::Continue
    }

    /// The stream is done, however it ended.
    pub fn on_log(&mut self, h: &impl Host) {
        if matches!(self.stage, Stage::Routed(_)) {
            self.count_upstream_failure(h);
        }
        self.end(h);
    }

    /// Ends what the request still holds: its booking now, a prefill leg
    /// still running at its deadline. Also the backstop for a context
    /// Envoy deletes without a log callback.
    pub fn end(&mut self, h: &impl Host) {
        // Never panic on a re-entrant borrow (not expected: callbacks do
        // not nest); skipping leaves the sidecar's expiry to clean up.
        let Ok(mut st) = self.state.try_borrow_mut() else {
            return;
        };
        match std::mem::take(&mut self.stage) {
            // The client left during the prefill leg: its answer will find
            // no context (Envoy cancels no callout), so the decode booking
            // ends now and the prefill's at the leg's deadline.
            Stage::Prefilling(p) => {
                let (leg, deadline_us, decode) = p.into_parts();
                st.orphan(h, leg, deadline_us);
                if let Some(b) = decode {
                    st.release(h, b, true, None);
                }
            }
            Stage::Routed(mut r) => {
                if let Some(d) = r.draining.take() {
                    st.orphan(h, d.booking, d.deadline_us);
                }
                if let Some(b) = r.booking.take() {
                    let timing = r.clock.timing(h.now_us());
                    st.release(h, b, true, timing);
                }
            }
            // The client left while held: its place goes with it.
            Stage::Held(held) => {
                let id = self.context_id;
                let displaced = st.displaced.iter().position(|d| d.context_id == id);
                if let Some(i) = displaced {
                    st.displaced.swap_remove(i);
                }
                if st.held.take(|e| e.item.context_id == id).is_some() || displaced.is_some() {
                    let name = st
                        .config
                        .admission
                        .as_ref()
                        .and_then(|a| a.classes.get(held.class))
                        .map_or_else(String::new, |c| c.name.clone());
                    st.metrics.unheld(h, &held.model, &name);
                }
            }
            Stage::Start | Stage::Passing | Stage::Reading(_) | Stage::Open => {}
            Stage::Replied | Stage::Ended => {}
        }
        if let Some(g) = self.gate.take() {
            st.release_gate(h, &g);
        }
        st.forwarded.retain(|(_, id, _)| *id != self.context_id);
        self.stage = Stage::Ended;
    }

    /// Releases the routed booking: its prompt at the first byte, all of
    /// it when the response ends (`done`).
    fn release(&mut self, h: &impl Host, done: bool) {
        let Stage::Routed(r) = &mut self.stage else {
            return;
        };
        let Some(b) = r.booking.as_mut() else {
            return;
        };
        if !done && b.first_byte {
            return;
        }
        let Ok(mut st) = self.state.try_borrow_mut() else {
            return;
        };
        let now = h.now_us();
        if done {
            // The stage stays routed until the stream's log: what Envoy
            // says of the upstream is read there, and an SGLang prefill
            // leg may still run, released when it answers or at its
            // deadline.
            let timing = r.clock.timing(now);
            if let Some(b) = r.booking.take() {
                st.release(h, b, true, timing);
            }
            if let Some(g) = self.gate.take() {
                st.release_gate(h, &g);
            }
            if let Some(u) = r.usage.take() {
                st.metrics.cached(h, &u);
            }
        } else {
            st.release(h, *b, false, None);
            b.first_byte = true;
            r.clock.first_byte_us = Some(now);
            if let Some(p) = r.clock.predicted_ttft_ms {
                // A decode leg carries a prediction only as a pull's, of
                // the holder's prefill and the transfer: from its decision,
                // not from its own dispatch after the prefill answered.
                let from = if r.clock.leg == Leg::Decode {
                    r.clock.decided_us
                } else {
                    r.clock.sent_us
                };
                let observed_ms = now.saturating_sub(from) as f64 / 1000.0;
                st.metrics.predicted(h, f64::from(p), observed_ms);
            }
        }
    }

    /// Moves the booking to the fallback worker when Envoy's retry served
    /// the request there, so load is counted where it runs.
    fn follow_retry(&mut self, h: &impl Host) {
        let Stage::Routed(r) = &mut self.stage else {
            return;
        };
        let Some(fb) = r.fallback.take() else {
            return;
        };
        // A first attempt that answered is the common case, and a header
        // read is several times cheaper than a property; the property
        // decides where the header is absent (not configured) or names a
        // retry.
        if h.response_header(ATTEMPT_COUNT).as_deref() == Some("1") {
            return;
        }
        let served_by = h.property(&["upstream", "address"]);
        if served_by.as_deref() != Some(fb.endpoint.as_bytes()) {
            return;
        }
        let Ok(mut st) = self.state.try_borrow_mut() else {
            return;
        };
        // The request's clock runs on: it was routed once, served once.
        if let Some(b) = r.booking.take() {
            st.release(h, b, true, None);
        }
        if r.served_by.is_some() {
            r.served_by = Some(fb.served_by());
        }
        h.count(st.metrics.retried);
        r.booking = Some(st.book(
            h,
            &r.model,
            &self.tenant,
            fb.slot,
            fb.prefill_tokens,
            fb.decode_blocks,
        ));
    }

    /// Counts a routed request that no worker answered (Envoy replied in
    /// OpenAI's error shape), or whose worker went away mid-response.
    fn count_upstream_failure(&self, h: &impl Host) {
        let Some(details) = h.property(&["response", "code_details"]) else {
            return;
        };
        let st = self.state.borrow();
        if details.starts_with(b"upstream_reset_after_response_started") {
            h.count(st.metrics.streams_cut);
        } else if details.starts_with(b"upstream_reset_before_response_started")
            || details.starts_with(b"no_healthy_upstream")
        {
            h.count(st.metrics.upstream_unavailable);
        }
    }

    /// The id every leg of a disaggregated model's request carries, set
    /// on the request: the engines key the KV handoff by it, so kvgate
    /// chooses it. A client's own is logged beside it, never passed on.
    pub(super) fn mint_request_id(&mut self, h: &impl Host) -> String {
        let request_id = super::prefill::request_id(|| h.random_u64());
        if let Some(client_id) = h.request_header(kvgate_core::header::REQUEST_ID) {
            h.log(
                LogLevel::Debug,
                &format!("kvgate: request {client_id} is disaggregated as {request_id}"),
            );
        }
        let _ = h.set_request_header(kvgate_core::header::REQUEST_ID, &request_id);
        request_id
    }
}

/// Sends the client's body to a worker that computes the prompt itself:
/// without any transfer field of the client's (`kv_transfer_params`,
/// SGLang's `bootstrap_*`), which would name a host for the worker to
/// pull blocks from.
pub(super) fn send_whole(h: &impl Host, client: &[u8]) {
    match kvgate_core::disagg::whole_body(client) {
        Ok(std::borrow::Cow::Owned(body)) => replace_body(h, &body),
        Ok(std::borrow::Cow::Borrowed(_)) => {}
        // Not an object: the worker refuses it as the client's error.
        Err(_) => {}
    }
}

/// Replaces the buffered request body and its length.
pub(super) fn replace_body(h: &impl Host, body: &[u8]) {
    let len = body.len().to_string();
    if h.set_request_body(body).is_err() || h.set_request_header("content-length", &len).is_err() {
        h.log(
            LogLevel::Error,
            "kvgate: could not replace the request body",
        );
    }
}
