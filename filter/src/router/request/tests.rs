//! Every transition of a request's [`Flow`], run natively against a host
//! of the tests' own: what the request sets, books, calls and answers,
//! read back from the host. The wasmtime tests run the same module as
//! Envoy does; these reach every branch without one.

use super::flow::{Flow, Stage};
use crate::config::Config;
use crate::host::{Fault, Host};
use crate::manifest::{self, Manifest};
use crate::router::RouterState;
use kvgate_core::booking::{Event, decode_batch};
use kvgate_core::disagg::pull::Pull;
use kvgate_core::plan::Leg;
use kvgate_core::state::{
    Disaggregation, ModelState, OnPrefillFailure, Protocol, RankLoad, Role, Snapshot, Thresholds,
    WorkerState,
};
use proxy_wasm::types::{Action, LogLevel};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

/// A prefill callout the request made.
#[derive(Debug, Clone)]
struct Callout {
    headers: HashMap<String, String>,
    body: Vec<u8>,
    timeout: Duration,
}

/// Another VM's write to shared data, between a read and its write.
type Interleaved = Box<dyn FnOnce(&mut HashMap<String, Vec<u8>>)>;

/// A host whose every effect is kept for the test to read.
#[derive(Default)]
struct Mock {
    now_us: Cell<u64>,
    shared: RefCell<HashMap<String, Vec<u8>>>,
    /// Everything enqueued on the bookings queue (id 1).
    bookings: RefCell<Vec<u8>>,
    request: RefCell<HashMap<String, String>>,
    response: RefCell<HashMap<String, String>>,
    body: RefCell<Vec<u8>>,
    /// The response body chunk of the current callback.
    response_chunk: RefCell<Vec<u8>>,
    properties: RefCell<HashMap<String, Vec<u8>>>,
    callouts: RefCell<Vec<Callout>>,
    /// Endpoints whose callouts Envoy refuses (not in the catalog).
    refused: RefCell<Vec<String>>,
    answer_headers: RefCell<HashMap<String, String>>,
    answer_body: RefCell<Vec<u8>>,
    resumed: Cell<u32>,
    /// The context host calls act on, as the last switch named it.
    effective: Cell<u32>,
    replies: RefCell<Vec<(u16, Vec<u8>)>>,
    /// Each reply's `x-kvgate-reason`.
    reasons: RefCell<Vec<String>>,
    /// Runs once between a shared-data read and its write: another VM's
    /// write landing in between.
    interleave: RefCell<Option<Interleaved>>,
    counters: RefCell<HashMap<u32, i64>>,
    metric_names: RefCell<Vec<String>>,
    random: Cell<u64>,
}

impl Mock {
    /// Compare-and-swap as Envoy's: a write over a value that changed
    /// since it was read fails, and is tried again from a new read; with
    /// `existing`, a missing key is not written.
    fn update(&self, key: &str, existing: bool, f: &mut crate::host::Rewrite<'_>) -> bool {
        for _ in 0..4 {
            let read = self.shared.borrow().get(key).cloned();
            if existing && read.is_none() {
                return false;
            }
            let Some(v) = f(read.as_deref()) else {
                return false;
            };
            if let Some(other) = self.interleave.borrow_mut().take() {
                other(&mut self.shared.borrow_mut());
            }
            let mut shared = self.shared.borrow_mut();
            if shared.get(key) != read.as_ref() {
                continue;
            }
            shared.insert(key.to_string(), v);
            return true;
        }
        false
    }
}

impl Host for Mock {
    fn log(&self, _level: LogLevel, _msg: &str) {}
    fn now_us(&self) -> u64 {
        self.now_us.get()
    }
    fn random_u64(&self) -> u64 {
        self.random.set(self.random.get() + 1);
        self.random.get()
    }
    fn get_shared(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.borrow().get(key).cloned()
    }
    fn update_shared(&self, key: &str, f: &mut crate::host::Rewrite<'_>) -> bool {
        self.update(key, false, f)
    }
    fn update_existing(&self, key: &str, f: &mut crate::host::Rewrite<'_>) -> bool {
        self.update(key, true, f)
    }
    fn resolve_queue(&self, _vm_id: &str, name: &str) -> Option<u32> {
        Some(if name == crate::host::BOOKINGS_QUEUE {
            1
        } else {
            2
        })
    }
    fn enqueue(&self, queue: u32, data: &[u8]) -> Result<(), Fault> {
        if queue == 1 {
            self.bookings.borrow_mut().extend_from_slice(data);
        }
        Ok(())
    }
    fn request_header(&self, name: &str) -> Option<String> {
        self.request.borrow().get(name).cloned()
    }
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), Fault> {
        self.request
            .borrow_mut()
            .insert(name.to_string(), value.to_string());
        Ok(())
    }
    fn remove_request_header(&self, name: &str) -> Result<(), Fault> {
        self.request.borrow_mut().remove(name);
        Ok(())
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.response.borrow().get(name).cloned()
    }
    fn set_response_header(&self, name: &str, value: &str) -> Result<(), Fault> {
        self.response
            .borrow_mut()
            .insert(name.to_string(), value.to_string());
        Ok(())
    }
    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        let b = self.body.borrow();
        Some(b[..size.min(b.len())].to_vec())
    }
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        let b = self.response_chunk.borrow();
        Some(b[..size.min(b.len())].to_vec())
    }
    fn set_request_body(&self, body: &[u8]) -> Result<(), Fault> {
        *self.body.borrow_mut() = body.to_vec();
        Ok(())
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties.borrow().get(&path.join(".")).cloned()
    }
    fn clear_route_cache(&self) -> Result<(), Fault> {
        Ok(())
    }
    fn dispatch(
        &self,
        _cluster: &str,
        headers: Vec<(&str, &str)>,
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Fault> {
        let headers: HashMap<String, String> = headers
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if self.refused.borrow().contains(&headers[":authority"]) {
            return Err(Fault(1));
        }
        self.callouts.borrow_mut().push(Callout {
            headers,
            body: body.unwrap_or_default().to_vec(),
            timeout,
        });
        Ok(self.callouts.borrow().len() as u32)
    }
    fn call_response_header(&self, name: &str) -> Option<String> {
        self.answer_headers.borrow().get(name).cloned()
    }
    fn call_response_body(&self, size: usize) -> Option<Vec<u8>> {
        let b = self.answer_body.borrow();
        Some(b[..size.min(b.len())].to_vec())
    }
    fn resume_request(&self) -> Result<(), Fault> {
        self.resumed.set(self.resumed.get() + 1);
        Ok(())
    }
    fn set_effective_context(&self, context_id: u32) -> Result<(), Fault> {
        self.effective.set(context_id);
        Ok(())
    }
    fn send_response(
        &self,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Fault> {
        if let Some((_, r)) = headers
            .iter()
            .find(|(k, _)| *k == kvgate_core::header::REASON)
        {
            self.reasons.borrow_mut().push(r.to_string());
        }
        self.replies.borrow_mut().push((status, body.to_vec()));
        Ok(())
    }
    fn define_metric(&self, _kind: u32, name: &str) -> Option<u32> {
        let mut names = self.metric_names.borrow_mut();
        names.push(name.to_string());
        Some(names.len() as u32 - 1)
    }
    fn increment_metric(&self, id: u32, offset: i64) {
        *self.counters.borrow_mut().entry(id).or_default() += offset;
    }
    fn record_metric(&self, id: u32, _value: u64) {
        *self.counters.borrow_mut().entry(id).or_default() += 1;
    }
}

impl Mock {
    fn counter(&self, name: &str) -> i64 {
        let names = self.metric_names.borrow();
        let id = names.iter().position(|n| n == name).expect(name) as u32;
        self.counters.borrow().get(&id).copied().unwrap_or(0)
    }

    fn events(&self) -> Vec<Event> {
        decode_batch(&self.bookings.borrow()).unwrap()
    }

    fn header(&self, name: &str) -> Option<String> {
        self.request.borrow().get(name).cloned()
    }

    fn advance_ms(&self, ms: u64) {
        self.now_us.set(self.now_us.get() + ms * 1000);
    }

    /// The prefill worker answers the last callout.
    fn answer(&self, status: Option<u16>, body: &str) {
        let mut headers = HashMap::new();
        if let Some(s) = status {
            headers.insert(":status".to_string(), s.to_string());
        }
        *self.answer_headers.borrow_mut() = headers;
        *self.answer_body.borrow_mut() = body.as_bytes().to_vec();
    }
}

fn rank(slot: u16, decode: u64) -> RankLoad {
    RankLoad {
        slot,
        active_decode_blocks: decode,
        kv_total_blocks: 1000,
        max_num_batched_tokens: 8192,
        ..Default::default()
    }
}

fn worker(id: u64, role: Role, decode: u64) -> WorkerState {
    WorkerState {
        id,
        endpoint: format!("10.0.0.{id}:8000"),
        block_size: 16,
        ranks: vec![rank(id as u16, decode)],
        tenant: "default".into(),
        thermal: Default::default(),
        draining: false,
        role,
        bootstrap_port: 8998,
        ..Default::default()
    }
}

/// `agg`: workers 1 (busier) and 2, served whole. `nixl`: prefill
/// workers 3 and 4 (4 busier), decode worker 5. `sgl`: the same roles
/// (6, 7, 8) with SGLang. `fail`: as `nixl` (9, 10) with no local prefill.
fn snapshot() -> Snapshot {
    let split = |name: &str, ids: [u64; 3], protocol, on_prefill_failure| ModelState {
        name: name.into(),
        shard_count: 8,
        workers: vec![
            worker(ids[0], Role::Prefill, 0),
            worker(ids[1], Role::Prefill, 5),
            worker(ids[2], Role::Decode, 0),
        ],
        disaggregation: Some(Disaggregation {
            protocol,
            on_prefill_failure,
            ..Disaggregation::default()
        }),
        ..Default::default()
    };
    Snapshot {
        version: 1,
        built_at_ms: 1,
        models: vec![
            ModelState {
                name: "agg".into(),
                shard_count: 8,
                workers: vec![worker(1, Role::Both, 40), worker(2, Role::Both, 10)],
                ..Default::default()
            },
            split(
                "nixl",
                [3, 4, 5],
                Protocol::VllmNixl,
                OnPrefillFailure::Local,
            ),
            split("sgl", [6, 7, 8], Protocol::Sglang, OnPrefillFailure::Local),
            split(
                "fail",
                [9, 10, 11],
                Protocol::VllmNixl,
                OnPrefillFailure::Fail,
            ),
        ],
        ..Default::default()
    }
}

/// A router VM with `snap` published and fresh, and a request's flow.
fn setup(snap: &Snapshot) -> (Mock, Flow) {
    let h = Mock::default();
    h.now_us.set(1_000_000_000);
    publish(&h, snap, h.now_ms());
    let config = Config::parse(Some(br#"{"flush_ms":0}"#)).unwrap();
    let state = Rc::new(RefCell::new(RouterState::new(&h, config, "kvgate".into())));
    (h, Flow::new(state, 7))
}

fn publish(h: &Mock, snap: &Snapshot, fresh_at_ms: u64) {
    let m = Manifest {
        snapshot_version: snap.version,
        update_version: 0,
        epoch: 1,
        fresh_at_ms,
    };
    let mut shared = h.shared.borrow_mut();
    shared.insert(manifest::KEY.into(), m.encode().to_vec());
    shared.insert(manifest::SNAPSHOT_KEY.into(), snap.encode().unwrap());
}

fn post(h: &Mock, body: &str) {
    let mut r = h.request.borrow_mut();
    r.insert(":method".into(), "POST".into());
    r.insert(":path".into(), "/v1/completions".into());
    *h.body.borrow_mut() = body.as_bytes().to_vec();
}

/// A prompt of 320 tokens: no worker holds any of it.
fn body(model: &str, extra: &str) -> String {
    let tokens: Vec<u32> = (0..320).collect();
    format!(r#"{{"model":"{model}","prompt":{tokens:?},"max_tokens":8{extra}}}"#)
}

/// Sends the request's headers and its whole body.
fn send(h: &Mock, f: &mut Flow, body: &str) -> Action {
    post(h, body);
    assert_eq!(f.on_request_headers(h, false), Action::Pause);
    f.on_request_body(h, body.len(), true)
}

/// Index shards of `model` in which `slot` holds the first `blocks`
/// blocks of [`body`]'s prompt on its device.
fn index(h: &Mock, model: &str, slot: u16, blocks: usize) {
    use kvgate_core::shard::{Holder, TIER_DEVICE, encode, shard_of};
    let tokens: Vec<u32> = (0..320).collect();
    let hashes = kvgate_core::hash::scoped_sequence_hashes(
        &tokens,
        16,
        kvgate_core::hash::CacheScope::default(),
    );
    let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
    for hsh in hashes.into_iter().take(blocks) {
        let holder = Holder {
            slot,
            tiers: TIER_DEVICE,
        };
        per_shard
            .entry(shard_of(hsh, 8))
            .or_default()
            .push((hsh, vec![holder]));
    }
    let mut shared = h.shared.borrow_mut();
    for (s, mut e) in per_shard {
        shared.insert(kvgate_core::update::shard_key(model, s), encode(&mut e));
    }
}

const ANSWER: &str = r#"{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_host":"10.0.0.3","remote_port":5600}}"#;

fn destination(h: &Mock) -> Option<String> {
    h.header(kvgate_core::header::DESTINATION)
}

fn stage(f: &Flow) -> &'static str {
    match &f.stage {
        Stage::Start => "start",
        Stage::Passing => "passing",
        Stage::Reading(_) => "reading",
        Stage::Prefilling(_) => "prefilling",
        Stage::Held(_) => "held",
        Stage::Routed(_) => "routed",
        Stage::Open => "open",
        Stage::Replied => "replied",
        Stage::Ended => "ended",
    }
}

/// Books and their ends balance: every booked key ended exactly once.
fn balanced(h: &Mock) -> bool {
    let mut open: HashMap<u64, i32> = HashMap::new();
    for e in h.events() {
        match e {
            Event::Book { key, .. } => *open.entry(key.seq).or_default() += 1,
            Event::Done { key, .. } => *open.entry(key.seq).or_default() -= 1,
            _ => {}
        }
    }
    open.values().all(|n| *n == 0)
}

/// The timed ends, by leg.
fn timed(h: &Mock) -> Vec<kvgate_core::booking::Timing> {
    h.events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Done {
                timing: Some(t), ..
            } => Some(t),
            _ => None,
        })
        .collect()
}

/// The response: headers, a first chunk, the last.
fn respond(h: &Mock, f: &mut Flow) {
    h.response
        .borrow_mut()
        .insert(":status".into(), "200".into());
    f.on_response_headers(h);
    h.advance_ms(5);
    f.on_response_body(h, 10, false);
    h.advance_ms(5);
    f.on_response_body(h, 10, true);
    f.on_log(h);
}

#[test]
fn a_request_kvgate_does_not_route_passes_with_routing_headers_scrubbed() {
    let (h, mut f) = setup(&snapshot());
    h.request
        .borrow_mut()
        .insert(kvgate_core::header::DESTINATION.into(), "10.6.6.6:1".into());
    h.request
        .borrow_mut()
        .insert(":method".into(), "GET".into());
    h.request
        .borrow_mut()
        .insert(":path".into(), "/v1/models".into());
    assert_eq!(f.on_request_headers(&h, true), Action::Continue);
    assert_eq!(stage(&f), "passing");
    assert_eq!(destination(&h), None);
    assert_eq!(f.on_request_body(&h, 3, true), Action::Continue);
}

#[test]
fn a_whole_request_is_routed_booked_and_released_with_its_timing() {
    let (h, mut f) = setup(&snapshot());
    assert_eq!(send(&h, &mut f, &body("agg", "")), Action::Continue);
    assert_eq!(stage(&f), "routed");
    // Worker 2 has the lighter load; worker 1 is the fallback.
    assert_eq!(
        destination(&h).as_deref(),
        Some("10.0.0.2:8000,10.0.0.1:8000")
    );
    assert_eq!(
        h.header(kvgate_core::header::REQUEST_ID),
        None,
        "not disaggregated"
    );
    respond(&h, &mut f);
    assert_eq!(stage(&f), "ended");
    assert!(balanced(&h));
    let t = timed(&h);
    assert_eq!(t.len(), 1);
    assert_eq!((t[0].leg, t[0].status), (Leg::Whole, 200));
    assert_eq!((t[0].first_byte_us, t[0].total_us), (5000, 10_000));
    assert_eq!(t[0].client_first_byte_us, 5000);
}

#[test]
fn a_body_without_an_end_is_refused_and_one_too_large_answered_413() {
    let (h, mut f) = setup(&snapshot());
    post(&h, "");
    assert_eq!(f.on_request_headers(&h, true), Action::Pause);
    assert_eq!(h.replies.borrow()[0].0, 400);
    let (h, mut f) = setup(&snapshot());
    post(&h, "{}");
    f.on_request_headers(&h, false);
    assert_eq!(f.on_request_body(&h, (1 << 20) + 1, false), Action::Pause);
    assert_eq!(h.replies.borrow()[0].0, 413);
    assert_eq!(stage(&f), "replied");
    let (h, mut f) = setup(&snapshot());
    assert_eq!(send(&h, &mut f, "not json"), Action::Pause);
    assert_eq!(h.replies.borrow()[0].0, 400);
}

#[test]
fn trailers_decide_a_request_whose_body_did_not_end() {
    let (h, mut f) = setup(&snapshot());
    let b = body("agg", "");
    post(&h, &b);
    f.on_request_headers(&h, false);
    assert_eq!(f.on_request_body(&h, b.len(), false), Action::Pause);
    assert_eq!(f.on_request_trailers(&h), Action::Continue);
    assert_eq!(stage(&f), "routed");
    assert_eq!(h.counter("kvgate_requests_with_trailers_total"), 1);
}

#[test]
fn a_stale_view_fails_open_scrubbed_or_closed_as_configured() {
    let (h, mut f) = setup(&snapshot());
    // The sidecar was last heard from a minute ago.
    h.advance_ms(60_000);
    let b = body("nixl", r#","kv_transfer_params":{"remote_host":"evil"}"#);
    assert_eq!(send(&h, &mut f, &b), Action::Continue);
    assert_eq!(stage(&f), "open");
    assert_eq!(destination(&h), None, "Envoy's own balancing");
    assert!(!String::from_utf8_lossy(&h.body.borrow()).contains("evil"));
    assert_eq!(h.counter("kvgate_failed_open_total"), 1);

    let (h, mut f) = setup(&snapshot());
    f.state.borrow_mut().config.on_stale = crate::config::OnStale::FailClosed;
    h.advance_ms(60_000);
    post(&h, &b);
    assert_eq!(f.on_request_headers(&h, false), Action::Pause);
    assert_eq!(h.replies.borrow()[0].0, 503);
}

#[test]
fn a_nixl_split_books_both_legs_and_the_decode_clock_starts_at_its_dispatch() {
    let (h, mut f) = setup(&snapshot());
    let b = body("nixl", r#","kv_transfer_params":{"remote_host":"evil"}"#);
    assert_eq!(send(&h, &mut f, &b), Action::Pause);
    assert_eq!(stage(&f), "prefilling");
    assert_eq!(destination(&h).as_deref(), Some("10.0.0.5:8000"));
    let call = h.callouts.borrow()[0].clone();
    assert_eq!(
        call.headers[":authority"], "10.0.0.3:8000",
        "the idler prefill worker"
    );
    let id = h.header(kvgate_core::header::REQUEST_ID).unwrap();
    assert_eq!(call.headers[kvgate_core::header::REQUEST_ID], id);
    assert!(!String::from_utf8_lossy(&call.body).contains("evil"));
    assert_eq!(call.timeout, Duration::from_secs(30));
    // Both legs are booked: the prompt where it is computed.
    let books = books(&h);
    assert_eq!(books, vec![(5, 0, 20), (3, 320, 0)]);

    h.advance_ms(40);
    h.answer(Some(200), ANSWER);
    f.on_callout_answer(&h, 1, ANSWER.len());
    assert_eq!(stage(&f), "routed");
    assert_eq!(h.resumed.get(), 1);
    let sent = String::from_utf8(h.body.borrow().clone()).unwrap();
    assert!(sent.contains(r#""remote_host":"10.0.0.3""#) && !sent.contains("evil"));
    respond(&h, &mut f);
    assert!(balanced(&h));
    let t = timed(&h);
    assert_eq!(t.len(), 2);
    assert_eq!(
        (t[0].leg, t[0].status, t[0].total_us),
        (Leg::Prefill, 200, 40_000)
    );
    assert_eq!(t[1].leg, Leg::Decode);
    assert_eq!(t[1].first_byte_us, 5000, "from the decode leg's dispatch");
    assert_eq!(
        t[1].client_first_byte_us, 45_000,
        "the client waited for both"
    );
}

#[test]
fn a_failed_prefill_tries_the_runner_up_once_then_prefills_on_the_decode_worker() {
    let (h, mut f) = setup(&snapshot());
    let b = body("nixl", "");
    send(&h, &mut f, &b);
    h.answer(Some(503), "");
    f.on_callout_answer(&h, 1, 0);
    assert_eq!(stage(&f), "prefilling", "the runner-up");
    assert_eq!(
        h.callouts.borrow()[1].headers[":authority"],
        "10.0.0.4:8000"
    );
    assert_eq!(h.resumed.get(), 0);
    // A reset: no status at all.
    h.answer(None, "");
    f.on_callout_answer(&h, 2, 0);
    assert_eq!(stage(&f), "routed");
    assert_eq!(h.resumed.get(), 1);
    assert_eq!(h.counter("kvgate_prefill_retried_total"), 1);
    assert_eq!(h.counter("kvgate_prefill_failed_total"), 1);
    // The decode worker books the prompt it now computes.
    let last_book = h
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Book { prefill_tokens, .. } => Some(prefill_tokens),
            _ => None,
        })
        .next_back();
    assert_eq!(last_book, Some(320));
    respond(&h, &mut f);
    assert!(balanced(&h));
    let legs: Vec<(Leg, u16)> = timed(&h).iter().map(|t| (t.leg, t.status)).collect();
    assert_eq!(
        legs,
        vec![(Leg::Prefill, 503), (Leg::Prefill, 0), (Leg::Whole, 200)]
    );
}

#[test]
fn a_model_that_forbids_local_prefill_answers_503_and_ends_both_bookings() {
    let (h, mut f) = setup(&snapshot());
    send(&h, &mut f, &body("fail", ""));
    // Both tries fail: one with a malformed answer.
    h.answer(Some(200), r#"{"choices":[]}"#);
    f.on_callout_answer(&h, 1, 14);
    h.answer(Some(500), "");
    f.on_callout_answer(&h, 2, 0);
    assert_eq!(stage(&f), "replied");
    assert_eq!(h.resumed.get(), 0);
    assert_eq!(h.replies.borrow()[0].0, 503);
    f.on_log(&h);
    assert!(balanced(&h));
}

#[test]
fn a_try_that_spent_the_budget_is_not_retried() {
    let (h, mut f) = setup(&snapshot());
    send(&h, &mut f, &body("nixl", ""));
    // Envoy times the callout out at the leg's deadline.
    h.advance_ms(30_000);
    h.answer(Some(504), "");
    f.on_callout_answer(&h, 1, 0);
    assert_eq!(h.callouts.borrow().len(), 1, "no second try");
    assert_eq!(stage(&f), "routed", "computed on the decode worker");
    f.on_log(&h);
    assert!(balanced(&h));
}

#[test]
fn a_prefill_worker_gone_from_the_catalog_fails_the_try_at_once() {
    let (h, mut f) = setup(&snapshot());
    h.refused.borrow_mut().push("10.0.0.3:8000".into());
    assert_eq!(send(&h, &mut f, &body("nixl", "")), Action::Pause);
    assert_eq!(stage(&f), "prefilling");
    assert_eq!(
        h.callouts.borrow()[0].headers[":authority"],
        "10.0.0.4:8000"
    );
    f.end(&h);
    assert_eq!(h.counter("kvgate_prefill_orphaned_total"), 1);
}

#[test]
fn the_clients_error_from_the_prefill_worker_goes_back_as_it_came() {
    let (h, mut f) = setup(&snapshot());
    send(&h, &mut f, &body("nixl", ""));
    h.answer(Some(422), r#"{"error":"bad"}"#);
    h.answer_headers
        .borrow_mut()
        .insert("content-type".into(), "application/json".into());
    f.on_callout_answer(&h, 1, 15);
    assert_eq!(stage(&f), "replied");
    assert_eq!(h.replies.borrow()[0], (422, br#"{"error":"bad"}"#.to_vec()));
    assert_eq!(h.resumed.get(), 0);
    f.on_log(&h);
    assert!(balanced(&h));
}

#[test]
fn a_client_gone_while_paused_leaves_the_prefill_booked_until_its_deadline() {
    let (h, mut f) = setup(&snapshot());
    send(&h, &mut f, &body("nixl", ""));
    f.on_log(&h);
    assert_eq!(stage(&f), "ended");
    assert!(!balanced(&h), "the prefill leg still runs");
    // Its answer finds no request: nothing happens.
    f.on_callout_answer(&h, 1, 0);
    assert_eq!(h.resumed.get(), 0);
    let state = f.state.clone();
    h.advance_ms(30_001);
    state.borrow_mut().release_orphans(&h);
    assert!(balanced(&h));
}

#[test]
fn an_answer_to_another_token_is_ignored() {
    let (h, mut f) = setup(&snapshot());
    send(&h, &mut f, &body("nixl", ""));
    h.answer(Some(200), ANSWER);
    f.on_callout_answer(&h, 99, ANSWER.len());
    assert_eq!(stage(&f), "prefilling");
}

#[test]
fn a_decode_body_past_the_headroom_is_computed_on_the_decode_worker_at_once() {
    let (h, mut f) = setup(&snapshot());
    f.state.borrow_mut().config.max_body_bytes = 2000;
    assert_eq!(send(&h, &mut f, &body("nixl", "")), Action::Pause);
    // Fits max_body_bytes with the headroom: split.
    assert_eq!(stage(&f), "prefilling");

    // A prompt of 2.5 M tokens (by its length): its transfer parameters
    // would name more blocks than the headroom holds.
    let (h, mut f) = setup(&snapshot());
    let b = format!(r#"{{"model":"nixl","prompt":"{}"}}"#, "x".repeat(10 << 20));
    f.state.borrow_mut().config.max_body_bytes = b.len();
    assert_eq!(send(&h, &mut f, &b), Action::Continue);
    assert_eq!(stage(&f), "routed");
    assert!(h.callouts.borrow().is_empty());
}

#[test]
fn sglang_sends_both_legs_at_once_and_drains_the_prefill_answer() {
    let (h, mut f) = setup(&snapshot());
    let b = body("sgl", r#","bootstrap_host":"evil""#);
    assert_eq!(send(&h, &mut f, &b), Action::Continue);
    assert_eq!(stage(&f), "routed");
    assert_eq!(destination(&h).as_deref(), Some("10.0.0.8:8000"));
    let call = h.callouts.borrow()[0].clone();
    assert_eq!(call.headers[":authority"], "10.0.0.6:8000");
    // One body to both legs, with kvgate's bootstrap fields.
    assert_eq!(call.body, *h.body.borrow());
    let sent = String::from_utf8(call.body).unwrap();
    assert!(sent.contains(r#""bootstrap_host":"10.0.0.6""#) && !sent.contains("evil"));
    // The decode response ends first; the prefill leg is still booked.
    h.response
        .borrow_mut()
        .insert(":status".into(), "200".into());
    f.on_response_headers(&h);
    f.on_response_body(&h, 10, false);
    f.on_response_body(&h, 10, true);
    assert_eq!(stage(&f), "routed");
    assert!(!balanced(&h));
    h.answer(Some(200), "{}");
    f.on_callout_answer(&h, 1, 2);
    assert!(balanced(&h));
    f.on_log(&h);
    assert_eq!(stage(&f), "ended");
    assert!(balanced(&h), "nothing is orphaned");
    assert_eq!(h.counter("kvgate_prefill_orphaned_total"), 0);
    let legs: Vec<Leg> = timed(&h).iter().map(|t| t.leg).collect();
    assert_eq!(legs, vec![Leg::Decode, Leg::Prefill]);
}

#[test]
fn sglang_tries_the_runner_up_when_envoy_refuses_the_callout_and_refuses_with_none() {
    let (h, mut f) = setup(&snapshot());
    h.refused.borrow_mut().push("10.0.0.6:8000".into());
    assert_eq!(send(&h, &mut f, &body("sgl", "")), Action::Continue);
    assert_eq!(
        h.callouts.borrow()[0].headers[":authority"],
        "10.0.0.7:8000"
    );

    let (h, mut f) = setup(&snapshot());
    h.refused
        .borrow_mut()
        .extend(["10.0.0.6:8000".to_string(), "10.0.0.7:8000".to_string()]);
    assert_eq!(send(&h, &mut f, &body("sgl", "")), Action::Pause);
    assert_eq!(h.replies.borrow()[0].0, 503);
    f.on_log(&h);
    assert!(balanced(&h));
}

#[test]
fn sglang_with_its_prefill_pool_down_is_refused_never_sent_whole_to_a_decode_worker() {
    let mut snap = snapshot();
    snap.models[2].workers.retain(|w| w.role == Role::Decode);
    let (h, mut f) = setup(&snap);
    assert_eq!(send(&h, &mut f, &body("sgl", "")), Action::Pause);
    assert_eq!(stage(&f), "replied");
    assert_eq!(h.replies.borrow()[0].0, 503);
    assert_eq!(destination(&h), None);
    assert!(balanced(&h));
}

#[test]
fn the_conditional_rule_computes_a_mostly_cached_prompt_on_the_decode_worker() {
    let snap = snapshot();
    let (h, mut f) = setup(&snap);
    // The decode worker holds 18 of the prompt's 20 blocks.
    index(&h, "nixl", 5, 18);
    let b = body("nixl", r#","kv_transfer_params":{"remote_host":"evil"}"#);
    assert_eq!(send(&h, &mut f, &b), Action::Continue);
    assert_eq!(stage(&f), "routed");
    assert!(h.callouts.borrow().is_empty(), "no prefill leg");
    assert_eq!(destination(&h).as_deref(), Some("10.0.0.5:8000"));
    // Still scrubbed, with kvgate's request id.
    assert!(!String::from_utf8_lossy(&h.body.borrow()).contains("evil"));
    assert!(h.header(kvgate_core::header::REQUEST_ID).is_some());
    assert_eq!(h.counter("kvgate_prefill_local_total"), 1);
}

/// `pull`: three `both` workers (12, 13, 14) of a model that pulls, a
/// rank busy past 40 % of its cache in decode blocks. With `loaded`,
/// worker 12 has 500 decode blocks resident and is busy. The model fails
/// a split's failed leg, which a pull must not do.
fn pulling(loaded: bool) -> Snapshot {
    let mut holder = worker(12, Role::Both, 0);
    if loaded {
        let r = &mut holder.ranks[0];
        (r.active_decode_blocks, r.kv_used_blocks, r.busy) = (500, 500, true);
    }
    Snapshot {
        version: 1,
        built_at_ms: 1,
        models: vec![ModelState {
            name: "pull".into(),
            shard_count: 8,
            thresholds: Thresholds {
                active_decode_blocks: Some(0.4),
                ..Default::default()
            },
            workers: vec![holder, worker(13, Role::Both, 0), worker(14, Role::Both, 0)],
            disaggregation: Some(Disaggregation {
                protocol: Protocol::VllmNixl,
                on_prefill_failure: OnPrefillFailure::Fail,
                pull: Some(Pull::default()),
                ..Disaggregation::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Each booking made: slot, prompt tokens, decode blocks.
fn books(h: &Mock) -> Vec<(u16, u32, u32)> {
    h.events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Book {
                slot,
                prefill_tokens,
                decode_blocks,
                ..
            } => Some((slot, prefill_tokens, decode_blocks)),
            _ => None,
        })
        .collect()
}

fn placement(h: &Mock) -> Option<String> {
    h.response
        .borrow()
        .get(kvgate_core::header::PLACEMENT)
        .cloned()
}

#[test]
fn a_holder_busy_with_decode_prefills_the_tail_and_an_idle_worker_pulls() {
    let (h, mut f) = setup(&pulling(true));
    // Worker 12 holds 18 of the prompt's 20 blocks.
    index(&h, "pull", 12, 18);
    assert_eq!(send(&h, &mut f, &body("pull", "")), Action::Pause);
    assert_eq!(stage(&f), "prefilling");
    let call = h.callouts.borrow()[0].clone();
    assert_eq!(
        call.headers[":authority"], "10.0.0.12:8000",
        "the prefill leg goes to the holder"
    );
    let leg = String::from_utf8(call.body).unwrap();
    assert!(leg.contains(r#""do_remote_decode":true"#), "{leg}");
    // The decode worker and its fallback are the idle ones: the holder is
    // busy for a whole request.
    let decode = destination(&h).unwrap();
    assert!(!decode.contains("10.0.0.12"), "{decode}");
    let decoder: u16 = decode
        .split(',')
        .next()
        .and_then(|e| e.strip_prefix("10.0.0."))
        .and_then(|e| e.strip_suffix(":8000"))
        .and_then(|id| id.parse().ok())
        .unwrap();
    // The holder books the tail it computes (2 blocks); the decode worker
    // the whole prompt it pulls, and no prompt.
    assert_eq!(books(&h), vec![(decoder, 0, 20), (12, 32, 0)]);
    assert_eq!(h.counter("kvgate_prefill_remote_total"), 1);
    assert_eq!(
        h.counter("kvgate_placed_pull_total"),
        0,
        "a pull counts once its prefill leg answered"
    );

    h.answer(Some(200), ANSWER);
    f.on_callout_answer(&h, 1, ANSWER.len());
    assert_eq!(h.counter("kvgate_placed_pull_total"), 1);
    assert_eq!(h.counter("kvgate_pull_blocks_moved_total"), 20);
    assert_eq!(h.counter("kvgate_placed_holder_total"), 0);
    assert_eq!(stage(&f), "routed");
    assert_eq!(h.resumed.get(), 1);
    let sent = String::from_utf8(h.body.borrow().clone()).unwrap();
    assert!(sent.contains(r#""do_remote_prefill":true"#), "{sent}");
    respond(&h, &mut f);
    // 20 blocks of 16 tokens at 128 KiB a token over 100 Gbit/s: 3.36 ms.
    assert_eq!(
        placement(&h).as_deref(),
        Some("pull; blocks=20; transfer_ms=3.4")
    );
    assert!(balanced(&h));
}

#[test]
fn a_pull_whose_prefill_leg_fails_is_recomputed_on_its_decode_worker() {
    let (h, mut f) = setup(&pulling(true));
    index(&h, "pull", 12, 18);
    send(&h, &mut f, &body("pull", ""));
    h.answer(Some(503), "");
    f.on_callout_answer(&h, 1, 0);
    assert_eq!(
        h.callouts.borrow().len(),
        1,
        "no other worker holds the prefix"
    );
    // Served, though the model fails a split whose leg failed.
    assert_eq!(stage(&f), "routed");
    assert_eq!(h.resumed.get(), 1);
    assert!(h.replies.borrow().is_empty());
    let last = books(&h).pop().unwrap();
    assert_eq!(
        (last.1, last.2),
        (320, 20),
        "the decode worker books the prompt it now computes"
    );
    assert_eq!(h.counter("kvgate_prefill_failed_total"), 1);
    let sent = String::from_utf8(h.body.borrow().clone()).unwrap();
    assert!(!sent.contains("kv_transfer_params"), "{sent}");
    respond(&h, &mut f);
    // It computes again the 18 cached blocks the holder had; counted as a
    // recompute, never as a pull.
    assert_eq!(placement(&h).as_deref(), Some("recompute; blocks=18"));
    assert_eq!(h.counter("kvgate_placed_pull_total"), 0);
    assert_eq!(h.counter("kvgate_pull_blocks_moved_total"), 0);
    assert_eq!(h.counter("kvgate_placed_recompute_total"), 1);
    assert_eq!(h.counter("kvgate_recompute_blocks_total"), 18);
    assert!(balanced(&h));
}

#[test]
fn an_idle_holder_keeps_its_request_whole() {
    let (h, mut f) = setup(&pulling(false));
    index(&h, "pull", 12, 18);
    assert_eq!(send(&h, &mut f, &body("pull", "")), Action::Continue);
    assert_eq!(stage(&f), "routed");
    assert!(h.callouts.borrow().is_empty(), "no prefill leg");
    let to = destination(&h).unwrap();
    assert!(to.starts_with("10.0.0.12:8000"), "{to}");
    respond(&h, &mut f);
    assert_eq!(placement(&h).as_deref(), Some("holder"));
    assert_eq!(h.counter("kvgate_placed_holder_total"), 1);
    assert_eq!(h.counter("kvgate_placed_pull_total"), 0);
    assert_eq!(h.counter("kvgate_prefill_remote_total"), 0);
    assert!(balanced(&h));

    // A model that does not pull says nothing of placement.
    let (h, mut f) = setup(&snapshot());
    send(&h, &mut f, &body("agg", ""));
    respond(&h, &mut f);
    assert_eq!(placement(&h), None);
    assert_eq!(h.counter("kvgate_placed_holder_total"), 0);
}

#[test]
fn a_shed_request_gets_a_ticket_and_its_retry_goes_ahead_at_its_time() {
    let mut snap = snapshot();
    for w in &mut snap.models[0].workers {
        w.ranks[0].busy = true;
    }
    let (h, mut f) = setup(&snap);
    let b = body("agg", "");
    assert_eq!(send(&h, &mut f, &b), Action::Pause);
    assert_eq!(h.replies.borrow()[0].0, 503);
    let retry_after: u64 = {
        let reply = String::from_utf8_lossy(&h.replies.borrow()[0].1).to_string();
        assert!(reply.contains("busy"), "{reply}");
        1
    };
    // The same request at its time holds the ticket and goes ahead.
    h.advance_ms(retry_after * 1000);
    let state = f.state.clone();
    let mut again = Flow::new(state, 8);
    h.replies.borrow_mut().clear();
    assert_eq!(send(&h, &mut again, &b), Action::Continue);
    assert_eq!(stage(&again), "routed");
    assert_eq!(h.counter("kvgate_retry_admitted_total"), 1);
}

#[test]
fn a_retry_on_the_fallback_moves_the_booking_there() {
    let (h, mut f) = setup(&snapshot());
    send(&h, &mut f, &body("agg", ""));
    h.response
        .borrow_mut()
        .insert(":status".into(), "200".into());
    h.response
        .borrow_mut()
        .insert(kvgate_core::header::ATTEMPT_COUNT.into(), "2".into());
    h.properties
        .borrow_mut()
        .insert("upstream.address".into(), b"10.0.0.1:8000".to_vec());
    f.on_response_headers(&h);
    assert_eq!(
        h.response.borrow()[kvgate_core::header::SERVED_BY],
        "worker_id=1; dp_rank=0"
    );
    let slots: Vec<u16> = h
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Book { slot, .. } => Some(slot),
            _ => None,
        })
        .collect();
    assert_eq!(slots, vec![2, 1]);
    f.on_response_body(&h, 1, true);
    assert!(balanced(&h));
    assert_eq!(h.counter("kvgate_retried_on_fallback_total"), 1);
}

#[test]
fn a_request_no_worker_answered_is_counted_at_its_log() {
    let (h, mut f) = setup(&snapshot());
    send(&h, &mut f, &body("agg", ""));
    // Envoy answers itself: a 503 of its own, read through the response
    // callbacks like a worker's.
    h.response
        .borrow_mut()
        .insert(":status".into(), "503".into());
    f.on_response_headers(&h);
    f.on_response_body(&h, 20, true);
    h.properties.borrow_mut().insert(
        "response.code_details".into(),
        b"upstream_reset_before_response_started{connection_failure}".to_vec(),
    );
    f.on_log(&h);
    assert_eq!(h.counter("kvgate_upstream_unavailable_total"), 1);
    assert!(balanced(&h));
    assert!(timed(&h).iter().all(|t| t.status == 503));
}

#[test]
fn the_context_id_is_kept_for_a_resume_from_outside_the_callout() {
    let (h, mut f) = setup(&snapshot());
    assert_eq!(f.context_id(), 7);
    // A paused request is resumed only once it has a worker to go to.
    send(&h, &mut f, &body("nixl", ""));
    f.resume(&h);
    assert_eq!(h.resumed.get(), 0, "still on its prefill leg");
    h.answer(Some(200), ANSWER);
    f.on_callout_answer(&h, 1, ANSWER.len());
    assert_eq!(h.resumed.get(), 1);
}

/// A router VM with admission configured (`admission` is its JSON) and
/// `snap` published: the state and a shared flow the root can reach.
fn admitting(snap: &Snapshot, admission: &str) -> (Mock, Rc<RefCell<RouterState>>) {
    let h = Mock::default();
    h.now_us.set(1_000_000_000);
    publish(&h, snap, h.now_ms());
    let json = format!(r#"{{"flush_ms":0,"admission":{admission}}}"#);
    let config = Config::parse(Some(json.as_bytes())).unwrap();
    let state = Rc::new(RefCell::new(RouterState::new(&h, config, "kvgate".into())));
    (h, state)
}

fn busy(snap: &mut Snapshot, busy: bool) {
    for w in &mut snap.models[0].workers {
        w.ranks[0].busy = busy;
    }
}

/// Two tenants' load on a model: `heavy` holds nearly all of it.
fn heavy_and_light() -> Vec<kvgate_core::TenantLoad> {
    let load = |tenant: &str, prefill_tokens, decode_blocks| kvgate_core::TenantLoad {
        tenant: tenant.into(),
        prefill_tokens,
        decode_blocks,
    };
    vec![load("heavy", 8000, 80), load("light", 100, 1)]
}

/// The router root's tick, as far as held requests go: the look ahead at
/// the newest snapshot, then the queue.
fn tick(state: &Rc<RefCell<RouterState>>, h: &Mock) {
    state.borrow_mut().look_ahead(h);
    crate::router::held::on_tick(state, h);
}

fn held(state: &Rc<RefCell<RouterState>>) -> usize {
    state.borrow().held.len()
}

#[test]
fn a_held_request_is_sent_when_a_worker_frees_up() {
    let mut snap = snapshot();
    busy(&mut snap, true);
    let (h, state) = admitting(&snap, "{}");
    let f = Flow::shared(state.clone(), 7);
    assert_eq!(
        send(&h, &mut f.borrow_mut(), &body("agg", "")),
        Action::Pause
    );
    assert_eq!(stage(&f.borrow()), "held");
    assert_eq!(held(&state), 1);
    assert!(h.replies.borrow().is_empty(), "held, not shed");
    // Still busy on the next tick: it stays.
    tick(&state, &h);
    assert_eq!((stage(&f.borrow()), h.resumed.get()), ("held", 0));
    // A new snapshot frees a worker: the tick sends it there.
    busy(&mut snap, false);
    snap.version = 2;
    h.advance_ms(20);
    publish(&h, &snap, h.now_ms());
    tick(&state, &h);
    assert_eq!(stage(&f.borrow()), "routed");
    assert_eq!(
        (h.resumed.get(), h.effective.get(), held(&state)),
        (1, 7, 0)
    );
    assert!(destination(&h).is_some());
    assert_eq!(
        h.counter("kvgate_admission_sent_total.model.agg.class.standard"),
        1
    );
    respond(&h, &mut f.borrow_mut());
    assert!(balanced(&h));
}

#[test]
fn a_held_request_is_answered_at_its_deadline_with_the_models_status() {
    let mut snap = snapshot();
    busy(&mut snap, true);
    let (h, state) = admitting(&snap, r#"{"models":{"agg":{"shed_status":429}}}"#);
    let f = Flow::shared(state.clone(), 7);
    send(&h, &mut f.borrow_mut(), &body("agg", ""));
    h.advance_ms(4_999);
    tick(&state, &h);
    assert_eq!(stage(&f.borrow()), "held");
    h.advance_ms(1);
    tick(&state, &h);
    assert_eq!(stage(&f.borrow()), "replied");
    assert_eq!(h.replies.borrow()[0].0, 429);
    assert_eq!(h.reasons.borrow()[0], "deadline_passed");
    assert_eq!(held(&state), 0);
    assert!(balanced(&h));
}

#[test]
fn do_not_queue_is_shed_at_once_where_allowed_and_never_reaches_a_worker() {
    let mut snap = snapshot();
    busy(&mut snap, true);
    let (h, state) = admitting(&snap, r#"{"shed_status":529}"#);
    let mut f = Flow::new(state.clone(), 7);
    send(&h, &mut f, &body("agg", r#","do_not_queue":true"#));
    assert_eq!(stage(&f), "replied");
    assert_eq!(h.replies.borrow()[0].0, 529);
    // Forbidden: the field is stripped and counts for nothing.
    let (h, state) = admitting(&snap, r#"{"client_do_not_queue":false}"#);
    let f = Flow::shared(state.clone(), 7);
    send(
        &h,
        &mut f.borrow_mut(),
        &body("agg", r#","do_not_queue":true,"kvgate_class":"critical""#),
    );
    assert_eq!(stage(&f.borrow()), "held");
    let sent = String::from_utf8(h.body.borrow().clone()).unwrap();
    assert!(
        !sent.contains("do_not_queue") && !sent.contains("kvgate_class"),
        "{sent}"
    );
    // The client's class did not count: held as the default class.
    assert_eq!(
        h.counter("kvgate_admission_held_total.model.agg.class.standard"),
        1
    );
}

#[test]
fn a_sheddable_request_is_shed_where_a_critical_one_is_admitted() {
    let mut snap = snapshot();
    snap.models[0].thresholds.active_prefill_tokens = Some(1000);
    for w in &mut snap.models[0].workers {
        w.ranks[0].active_prefill_tokens = 950;
    }
    let (h, state) = admitting(&snap, "{}");
    // 950 prompt tokens in flight is over 90 % of 1000, the share a class
    // without the reserve may use, and under all of it, critical's.
    let mut f = Flow::new(state.clone(), 7);
    h.request
        .borrow_mut()
        .insert("x-kvgate-class".into(), "sheddable".into());
    send(&h, &mut f, &body("agg", ""));
    assert_eq!(stage(&f), "replied");
    assert_eq!(h.reasons.borrow()[0], "priority_shed");
    let mut f = Flow::new(state.clone(), 8);
    h.request
        .borrow_mut()
        .insert("x-kvgate-class".into(), "critical".into());
    assert_eq!(send(&h, &mut f, &body("agg", "")), Action::Continue);
    assert_eq!(stage(&f), "routed");
}

#[test]
fn a_full_queue_sheds_its_last_for_a_request_that_comes_first() {
    let mut snap = snapshot();
    busy(&mut snap, true);
    let (h, state) = admitting(&snap, r#"{"max_held":1}"#);
    let standard = Flow::shared(state.clone(), 7);
    send(&h, &mut standard.borrow_mut(), &body("agg", ""));
    // Another standard one finds the queue full of one that comes first.
    let mut late = Flow::new(state.clone(), 8);
    send(&h, &mut late, &body("agg", ""));
    assert_eq!(h.reasons.borrow()[0], "queue_full");
    // A critical one displaces the standard one, which is answered.
    let critical = Flow::shared(state.clone(), 9);
    h.request
        .borrow_mut()
        .insert("x-kvgate-class".into(), "critical".into());
    send(&h, &mut critical.borrow_mut(), &body("agg", ""));
    assert_eq!(stage(&critical.borrow()), "held");
    // The displaced one is answered from the root's tick, in its own
    // context, never from inside another request's callback.
    assert_eq!(stage(&standard.borrow()), "held");
    assert_eq!(h.effective.get(), 0);
    tick(&state, &h);
    assert_eq!(stage(&standard.borrow()), "replied");
    assert_eq!(h.reasons.borrow()[1], "priority_shed");
    assert_eq!(h.effective.get(), 9, "the critical one was tried after");
    assert_eq!(held(&state), 1);
}

#[test]
fn a_client_gone_while_held_leaves_no_entry_and_no_booking() {
    let mut snap = snapshot();
    busy(&mut snap, true);
    let (h, state) = admitting(&snap, "{}");
    let f = Flow::shared(state.clone(), 7);
    send(&h, &mut f.borrow_mut(), &body("agg", ""));
    assert_eq!(held(&state), 1);
    f.borrow_mut().on_log(&h);
    assert_eq!(held(&state), 0);
    assert!(h.events().iter().all(|e| !matches!(e, Event::Book { .. })));
    // Its context gone, the tick finds nothing to do.
    tick(&state, &h);
    assert_eq!(h.resumed.get(), 0);
}

#[test]
fn two_vms_never_take_a_decode_workers_last_slot_together() {
    use kvgate_core::admit::ledger;
    let mut snap = snapshot();
    snap.models[0].thresholds.active_decode_requests = Some(1);
    snap.models[0].workers.truncate(1);
    let (h, state) = admitting(&snap, "{}");
    // The snapshot service created the count before it published the
    // bound; a VM never creates it.
    h.shared.borrow_mut().insert(ledger::key("agg"), Vec::new());
    // Between this VM's read of the counts and its write, another VM
    // takes the worker's one slot.
    *h.interleave.borrow_mut() = Some(Box::new(|shared: &mut HashMap<String, Vec<u8>>| {
        let key = ledger::key("agg");
        let now = 1_000_000;
        let entries = ledger::decode(shared.get(&key).map_or(&[][..], |v| &v[..]));
        let taken = ledger::acquire(entries, 0xB, 1, 1, now).unwrap();
        shared.insert(key, ledger::encode(&taken));
    }));
    let f = Flow::shared(state.clone(), 7);
    send(&h, &mut f.borrow_mut(), &body("agg", ""));
    assert_eq!(
        stage(&f.borrow()),
        "held",
        "the swap failed, the read again found it full"
    );
    let counts = ledger::decode(&h.get_shared(&ledger::key("agg")).unwrap());
    assert_eq!(
        ledger::count(&counts, 1, h.now_ms()),
        1,
        "one slot, one holder"
    );
    // The other VM's request ends: this one goes on the next tick, which
    // reads the count again though no new snapshot says so.
    let freed = ledger::release(counts, 0xB, 1, h.now_ms()).unwrap();
    h.shared
        .borrow_mut()
        .insert(ledger::key("agg"), ledger::encode(&freed));
    h.advance_ms(20);
    tick(&state, &h);
    assert_eq!(stage(&f.borrow()), "routed");
    respond(&h, &mut f.borrow_mut());
    let counts = ledger::decode(&h.get_shared(&ledger::key("agg")).unwrap());
    assert_eq!(
        ledger::count(&counts, 1, h.now_ms()),
        0,
        "released at its end"
    );
}

#[test]
fn a_tenant_over_its_share_waits_behind_one_under_it() {
    let mut snap = snapshot();
    snap.models[0].workers.truncate(1);
    snap.models[0].thresholds.active_decode_requests = Some(1);
    snap.models[0].tenants = heavy_and_light();
    busy(&mut snap, true);
    let (h, state) = admitting(&snap, "{}");
    h.shared
        .borrow_mut()
        .insert(kvgate_core::admit::ledger::key("agg"), Vec::new());
    let heavy = Flow::shared(state.clone(), 7);
    h.request
        .borrow_mut()
        .insert("x-kvgate-account".into(), "heavy".into());
    send(&h, &mut heavy.borrow_mut(), &body("agg", ""));
    let light = Flow::shared(state.clone(), 8);
    h.request
        .borrow_mut()
        .insert("x-kvgate-account".into(), "light".into());
    send(&h, &mut light.borrow_mut(), &body("agg", ""));
    assert_eq!(held(&state), 2);
    // The worker frees up for one request: the tenant under its share
    // goes first, though it came second.
    busy(&mut snap, false);
    snap.version = 2;
    h.advance_ms(20);
    publish(&h, &snap, h.now_ms());
    tick(&state, &h);
    assert_eq!(stage(&light.borrow()), "routed");
    assert_eq!(stage(&heavy.borrow()), "held");
    // Its booking names its tenant.
    assert!(h.events().iter().any(|e| matches!(
        e,
        Event::Book { tenant, .. } if tenant == "light"
    )));
}

#[test]
fn a_request_no_worker_can_serve_within_its_targets_is_held_or_shed() {
    use kvgate_core::fit::{Fit, MIN_SAMPLES, WorkerFits};
    let fit = |intercept_ms| Fit {
        intercept_ms,
        slope_ms_per_ktok: 100.0,
        samples: MIN_SAMPLES,
        age_s: 1,
    };
    let with = |intercept_ms, queued| {
        let mut snap = snapshot();
        for w in &mut snap.models[0].workers {
            w.fits = Some(WorkerFits {
                ttft: fit(intercept_ms),
                itl: fit(intercept_ms),
            });
            w.ranks[0].active_prefill_tokens = queued;
        }
        snap.models[0].slo = kvgate_core::Slo {
            ttft_ms: 500,
            itl_ms: 0,
        };
        snap
    };
    // 900 ms before the first token even on an idle worker: waiting does
    // not help, so it is shed at once, held or not.
    let (h, state) = admitting(&with(900.0, 0), "{}");
    let f = Flow::shared(state.clone(), 7);
    send(&h, &mut f.borrow_mut(), &body("agg", ""));
    assert_eq!(stage(&f.borrow()), "replied");
    assert_eq!(h.reasons.borrow()[0], "slo_unattainable");
    // 100 ms idle, but 5000 prompt tokens queued on each worker put it at
    // 632: it waits for a queue to drain, and a sheddable request behind
    // it is shed for it.
    let (h, state) = admitting(&with(100.0, 5000), "{}");
    let f = Flow::shared(state.clone(), 7);
    send(&h, &mut f.borrow_mut(), &body("agg", ""));
    assert_eq!(stage(&f.borrow()), "held");
    let mut shed = Flow::new(state.clone(), 8);
    h.request
        .borrow_mut()
        .insert("x-kvgate-class".into(), "sheddable".into());
    send(&h, &mut shed, &body("agg", ""));
    assert_eq!(h.reasons.borrow()[0], "priority_shed");
    // A class whose own target the fits meet is routed, with the
    // prediction kept for its error.
    let (h, state) = admitting(
        &with(900.0, 0),
        r#"{"classes":[{"name":"patient","priority":0,"hold_ms":100,"ttft_ms":5000}],"default_class":"patient"}"#,
    );
    let mut f = Flow::new(state, 9);
    assert_eq!(send(&h, &mut f, &body("agg", "")), Action::Continue);
    respond(&h, &mut f);
    assert_eq!(h.counter("kvgate_ttft_predictions_total"), 1);
}

#[test]
fn a_sampled_answer_is_read_for_the_cached_tokens_the_engine_used() {
    let h = Mock::default();
    h.now_us.set(1_000_000_000);
    publish(&h, &snapshot(), h.now_ms());
    let config = Config::parse(Some(br#"{"flush_ms":0,"cached_tokens_every":1}"#)).unwrap();
    let state = Rc::new(RefCell::new(RouterState::new(&h, config, "kvgate".into())));
    let mut f = Flow::new(state, 7);
    assert_eq!(send(&h, &mut f, &body("agg", "")), Action::Continue);
    h.response
        .borrow_mut()
        .insert(":status".into(), "200".into());
    f.on_response_headers(&h);
    // The engine says it reused 64 of the prompt's 320 tokens; the index
    // predicted none (no worker holds any of it).
    *h.response_chunk.borrow_mut() =
        br#"{"usage":{"prompt_tokens":320,"prompt_tokens_details":{"cached_tokens":64}}}"#.to_vec();
    let n = h.response_chunk.borrow().len();
    f.on_response_body(&h, n, true);
    f.on_log(&h);
    assert_eq!(h.counter("kvgate_cached_tokens_predicted_total"), 0);
    assert_eq!(h.counter("kvgate_cached_tokens_reported_total"), 64);
}

#[test]
fn the_class_priority_goes_to_vllm_in_a_body_that_grew() {
    let (h, state) = admitting(&snapshot(), r#"{"vllm_priority":true}"#);
    let mut f = Flow::new(state, 7);
    h.request
        .borrow_mut()
        .insert("x-kvgate-class".into(), "sheddable".into());
    assert_eq!(send(&h, &mut f, &body("agg", "")), Action::Continue);
    assert_eq!(stage(&f), "routed");
    let sent: serde_json::Value = serde_json::from_slice(&h.body.borrow()).unwrap();
    assert_eq!(sent["priority"], 2, "{sent}");
    assert_eq!(sent["prompt"].as_array().map(Vec::len), Some(320), "whole");
}

#[test]
fn a_tenant_over_its_share_is_kept_out_of_the_reserve_band() {
    let mut snap = snapshot();
    snap.models[0].thresholds.active_prefill_tokens = Some(1000);
    for w in &mut snap.models[0].workers {
        w.ranks[0].active_prefill_tokens = 950;
    }
    snap.models[0].tenants = heavy_and_light();
    let (h, state) = admitting(&snap, "{}");
    h.request
        .borrow_mut()
        .insert("x-kvgate-class".into(), "critical".into());
    // 950 of 1000 is in the reserve band: critical work of a tenant under
    // its share gets in, a tenant's over it waits.
    let mut light = Flow::new(state.clone(), 7);
    h.request
        .borrow_mut()
        .insert("x-kvgate-account".into(), "light".into());
    assert_eq!(send(&h, &mut light, &body("agg", "")), Action::Continue);
    let heavy = Flow::shared(state.clone(), 8);
    h.request
        .borrow_mut()
        .insert("x-kvgate-account".into(), "heavy".into());
    send(&h, &mut heavy.borrow_mut(), &body("agg", ""));
    assert_eq!(stage(&heavy.borrow()), "held");
}

#[test]
fn a_split_request_released_from_hold_gets_its_prefill_answer_through_the_root() {
    let mut snap = snapshot();
    // The nixl model's decode worker (5) is busy: the request is held.
    snap.models[1].workers[2].ranks[0].busy = true;
    let (h, state) = admitting(&snap, "{}");
    let f = Flow::shared(state.clone(), 7);
    send(&h, &mut f.borrow_mut(), &body("nixl", ""));
    assert_eq!(stage(&f.borrow()), "held");
    // It frees up: the root's tick splits it and calls the prefill worker
    // from the request's context, but the SDK hands the answer to the
    // root, which passes it on.
    snap.models[1].workers[2].ranks[0].busy = false;
    snap.version = 2;
    h.advance_ms(20);
    publish(&h, &snap, h.now_ms());
    tick(&state, &h);
    assert_eq!(stage(&f.borrow()), "prefilling");
    assert_eq!(h.callouts.borrow().len(), 1);
    h.effective.set(0);
    h.answer(Some(200), ANSWER);
    crate::router::held::on_callout_answer(&state, &h, 1, ANSWER.len());
    assert_eq!(h.effective.get(), 7, "in the request's own context");
    assert_eq!(stage(&f.borrow()), "routed");
    assert_eq!(h.resumed.get(), 1);
    assert!(state.borrow().forwarded.is_empty());
    respond(&h, &mut f.borrow_mut());
    assert!(balanced(&h));
}
