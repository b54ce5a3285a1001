//! The real filter module, driven through the wasmtime proxy-wasm host the
//! way Envoy drives it with `--concurrency 2`: one snapshot-service VM and
//! two router VMs sharing one shared-data store under vm_id `kvgate`.

use kvgate_core::reply::{Reason, Reply};
use kvgate_core::shard::{Holder, encode as encode_shard};
use kvgate_core::update;
use kvgate_core::{ModelState, RankLoad, Snapshot, Thermal, ThermalState, WorkerState};

use kvgate_tests::host::{Filter, Shared, SharedRef, Vm};
use serde_json::{Value, json};

fn filter() -> &'static Filter {
    kvgate_tests::shared_filter()
}

fn rank(rank: u32, decode: u64, busy: bool) -> RankLoad {
    RankLoad {
        rank,
        slot: rank as u16,
        active_decode_blocks: decode,
        kv_total_blocks: 1000,
        busy,
        ..Default::default()
    }
}

/// Slots are unique per (worker, rank), as the sidecar assigns them:
/// worker `id` rank `r` is slot `4 × id + r`.
fn worker(id: u64, mut ranks: Vec<RankLoad>) -> WorkerState {
    for r in &mut ranks {
        r.slot = (id * 4) as u16 + r.rank as u16;
    }
    WorkerState {
        id,
        endpoint: format!("10.0.0.{id}:8000"),
        block_size: 16,
        ranks,
        tenant: "default".into(),
        thermal: Default::default(),
        draining: false,
        role: Default::default(),
        bootstrap_port: 0,
        fits: None,
        topology: Default::default(),
    }
}

fn fleet(version: u64) -> Snapshot {
    Snapshot {
        version,
        built_at_ms: 1,
        models: vec![
            ModelState {
                name: "m".into(),
                workers: vec![
                    worker(1, vec![rank(0, 40, false)]),
                    worker(2, vec![rank(0, 10, false)]),
                    worker(3, vec![rank(0, 30, false)]),
                ],
                ..Default::default()
            },
            ModelState {
                name: "dp".into(),
                workers: vec![worker(4, vec![rank(0, 5, true), rank(1, 50, false)])],
                ..Default::default()
            },
            ModelState {
                name: "busy".into(),
                workers: vec![worker(5, vec![rank(0, 0, true)])],
                ..Default::default()
            },
            ModelState {
                name: "empty".into(),
                ..Default::default()
            },
            ModelState {
                name: "thermal-hot".into(),
                workers: vec![
                    capped(worker(6, vec![rank(0, 0, false)]), 2, 2),
                    worker(7, vec![rank(0, 0, true)]),
                ],
                retry_after_s: 6,
                ..Default::default()
            },
            ModelState {
                name: "thermal-warm".into(),
                workers: vec![
                    capped(worker(8, vec![rank(0, 0, false)]), 1, 0),
                    worker(9, vec![rank(0, 300, false)]),
                ],
                ..Default::default()
            },
        ],
        applied: Vec::new(),
    }
}

/// `w` throttling with this cap and this many requests in flight.
fn capped(mut w: WorkerState, cap: u32, in_flight: u32) -> WorkerState {
    w.thermal = Thermal {
        state: ThermalState::Throttling,
        heat: 1.0,
        cap,
        in_flight,
    };
    w
}

/// An emulated Envoy: the service VM and two router VMs.
struct Envoy {
    shared: SharedRef,
    service: Vm,
    routers: [Vm; 2],
}

const EPOCH: u64 = 4242;

impl Envoy {
    fn start(config: &str) -> Envoy {
        let shared = Shared::new();
        let service = Vm::start(
            filter(),
            &shared,
            "kvgate",
            "kvgate_snapshot_service",
            config,
        )
        .unwrap();
        assert!(
            service.configured,
            "service failed to configure:\n{}",
            service.logs()
        );
        let routers = [0, 1].map(|_| {
            let vm = Vm::start(filter(), &shared, "kvgate", "kvgate_router", config).unwrap();
            assert!(vm.configured, "router failed to configure:\n{}", vm.logs());
            vm
        });
        Envoy {
            shared,
            service,
            routers,
        }
    }

    /// Answers the service's pending poll with a frame holding `snap`.
    fn publish(&mut self, snap: &Snapshot, reset: bool) {
        let bytes = snap.encode().unwrap();
        let frame = update::encode(snap.version, EPOCH, reset, Some(&bytes), []);
        let c = self.service.pending().pop().expect("a poll in flight");
        self.service.respond(c.token, 200, &[], &frame).unwrap();
    }

    fn ready(config: &str) -> Envoy {
        let mut e = Envoy::start(config);
        e.publish(&fleet(1), true);
        e
    }

    fn counter(&self, name: &str) -> i64 {
        self.shared.lock().unwrap().counter(name)
    }
}

fn chat(model: &str) -> Vec<u8> {
    json!({"model": model, "messages": [{"role": "user", "content": "hello"}]})
        .to_string()
        .into_bytes()
}

const CHAT: [(&str, &str); 3] = [
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":authority", "gw"),
];

fn body(e: &kvgate_tests::host::LocalReply) -> Value {
    serde_json::from_slice(&e.body).unwrap()
}

#[test]
fn the_module_imports_only_what_the_host_implements() {
    assert_eq!(filter().unimplemented_imports(), Vec::<String>::new());
}

#[test]
fn the_service_long_polls_and_writes_shared_data() {
    let mut e = Envoy::start("");
    let polls = e.service.pending();
    assert_eq!(polls.len(), 1, "exactly one poll in flight");
    let p = &polls[0];
    assert_eq!(p.cluster, "kvgate_sidecar");
    assert_eq!(p.header(":method"), Some("GET"));
    assert_eq!(p.header(":authority"), Some("kvgate-sidecar"));
    assert_eq!(
        p.header(":path"),
        Some("/v1/snapshot?after=0&epoch=0&wait_ms=1000")
    );
    assert_eq!(p.timeout_ms, 3000);
    assert_eq!(p.header("authorization"), None, "no sidecar_token");
    e.service.tick().unwrap();
    assert_eq!(
        e.service.pending().len(),
        1,
        "a tick does not add a second poll"
    );

    e.publish(&fleet(7), true);
    let now = e.shared.lock().unwrap().now_ms();
    {
        let s = e.shared.lock().unwrap();
        assert_eq!(
            Snapshot::decode(s.get("kvgate.snapshot").unwrap())
                .unwrap()
                .version,
            7
        );
        let m = s.get("kvgate.manifest").unwrap();
        assert_eq!(m.len(), 32);
        assert_eq!(
            u64::from_le_bytes(m[0..8].try_into().unwrap()),
            7,
            "snapshot version"
        );
        assert_eq!(u64::from_le_bytes(m[16..24].try_into().unwrap()), EPOCH);
        assert_eq!(
            u64::from_le_bytes(m[24..32].try_into().unwrap()),
            now,
            "fresh at, Envoy's clock"
        );
    }
    let next = e.service.pending();
    assert_eq!(
        next[0].header(":path"),
        Some(format!("/v1/snapshot?after=7&epoch={EPOCH}&wait_ms=1000").as_str())
    );
    assert_eq!(e.counter("kvgate_snapshot_version"), 7);

    // A 204 keeps the state and refreshes freshness.
    e.shared.lock().unwrap().advance_ms(900);
    e.service
        .respond(
            next[0].token,
            204,
            &[("x-kvgate-epoch", &EPOCH.to_string())],
            b"",
        )
        .unwrap();
    let m = e
        .shared
        .lock()
        .unwrap()
        .get("kvgate.manifest")
        .unwrap()
        .to_vec();
    assert_eq!(u64::from_le_bytes(m[24..32].try_into().unwrap()), now + 900);
}

#[test]
fn failed_polls_back_off_and_garbage_is_rejected() {
    let mut e = Envoy::ready("");
    let c = e.service.pending().pop().unwrap();
    e.service.fail(c.token).unwrap();
    assert!(
        e.service.pending().is_empty(),
        "no immediate retry after a failure"
    );
    e.service.tick().unwrap();
    assert!(e.service.pending().is_empty(), "still backing off");
    e.shared.lock().unwrap().advance_ms(150);
    e.service.tick().unwrap();
    assert_eq!(e.service.pending().len(), 1, "retried after the backoff");
    assert_eq!(e.counter("kvgate_snapshot_poll_errors_total"), 1);

    let c = e.service.pending().pop().unwrap();
    e.service
        .respond(c.token, 200, &[], b"definitely not a frame")
        .unwrap();
    assert_eq!(e.counter("kvgate_snapshot_decode_errors_total"), 1);
    let s = e.shared.lock().unwrap();
    assert_eq!(
        Snapshot::decode(s.get("kvgate.snapshot").unwrap())
            .unwrap()
            .version,
        1,
        "old snapshot kept"
    );
}

#[test]
fn routes_to_the_least_loaded_worker_and_overwrites_client_headers() {
    let mut e = Envoy::ready("");
    let mut headers = CHAT.to_vec();
    headers.push(("x-gateway-destination-endpoint", "6.6.6.6:1"));
    for vm in &mut e.routers {
        let ex = vm.request(&headers, &[&chat("m")]);
        assert_eq!(ex.trapped, None);
        assert!(ex.continued, "{:?}", ex.reply);
        assert_eq!(ex.destination(), Some("10.0.0.2:8000"));
        assert_eq!(
            ex.retry_destination(),
            Some("10.0.0.3:8000"),
            "the next cheapest worker"
        );
        assert_eq!(
            ex.headers
                .iter()
                .filter(|(k, _)| k == "x-gateway-destination-endpoint")
                .count(),
            1
        );
        assert_eq!(
            ex.header("x-data-parallel-rank"),
            None,
            "single-rank worker"
        );
    }
    // Requests the filter does not route lose the routing headers too,
    // whatever their method or path.
    for (method, path) in [
        ("GET", "/v1/completions"),
        ("DELETE", "/v1/chat/completions"),
        ("PUT", "/admin"),
        ("POST", "/v1/models"),
    ] {
        let ex = e.routers[0].request(
            &[
                (":method", method),
                (":path", path),
                ("x-gateway-destination-endpoint", "127.0.0.1:9901"),
                ("x-data-parallel-rank", "3"),
                ("x-kvgate-fallback", "stale"),
            ],
            &[b"{}"],
        );
        assert!(ex.continued, "{method} {path}");
        for h in [
            "x-gateway-destination-endpoint",
            "x-data-parallel-rank",
            "x-kvgate-fallback",
        ] {
            assert_eq!(ex.header(h), None, "{method} {path} kept {h}");
        }
    }
    let tokens = json!({"model": "m", "prompt": [1, 2, 3, 4]}).to_string();
    let ex = e.routers[0].request(
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("x-data-parallel-rank", "7"),
        ],
        &[tokens.as_bytes()],
    );
    assert!(ex.continued);
    assert_eq!(
        ex.header("x-data-parallel-rank"),
        None,
        "a client's rank header is removed"
    );
    assert_eq!(e.counter("kvgate_routed_total"), 3);
}

#[test]
fn a_request_is_placed_only_on_its_tenants_workers() {
    let mut e = Envoy::start("");
    let mut snap = fleet(1);
    // Worker 2 (the least loaded) belongs to team-a, worker 3 to team-b.
    snap.models[0].workers[1].tenant = "team-a".into();
    snap.models[0].workers[2].tenant = "team-b".into();
    e.publish(&snap, true);
    let dest = |e: &mut Envoy, tenant: Option<&str>| {
        let mut headers = CHAT.to_vec();
        if let Some(t) = tenant {
            headers.push(("x-kvgate-tenant", t));
        }
        let ex = e.routers[0].request(&headers, &[&chat("m")]);
        (
            ex.destination().map(str::to_string),
            ex.reply.map(|r| r.status),
        )
    };
    assert_eq!(
        dest(&mut e, Some("team-a")),
        (Some("10.0.0.2:8000".into()), None)
    );
    assert_eq!(
        dest(&mut e, Some("team-b")),
        (Some("10.0.0.3:8000".into()), None)
    );
    assert_eq!(
        dest(&mut e, None),
        (Some("10.0.0.1:8000".into()), None),
        "no header: the default tenant, whose only worker is 1"
    );
    assert_eq!(
        dest(&mut e, Some("team-c")),
        (None, Some(503)),
        "a tenant with no workers has no one to serve it"
    );
}

#[test]
fn other_paths_and_methods_pass_through_untouched() {
    let mut e = Envoy::ready("");
    for h in [
        vec![(":method", "GET"), (":path", "/v1/models")],
        vec![(":method", "GET"), (":path", "/v1/chat/completions")],
        vec![(":method", "POST"), (":path", "/health")],
    ] {
        let ex = e.routers[0].request(&h, &[b"whatever"]);
        assert!(ex.continued);
        assert_eq!(ex.destination(), None);
    }
    assert_eq!(e.counter("kvgate_requests_total"), 0);
}

/// Streams on one VM interleave, as on one Envoy worker thread: each
/// keeps its own headers, body and reply, whichever finishes first.
#[test]
fn interleaved_streams_keep_their_own_state() {
    let mut e = Envoy::ready("");
    let vm = &mut e.routers[0];
    let (a, ctx_a) = vm.begin(&CHAT, false);
    let (b, ctx_b) = vm.begin(&CHAT, false);
    assert!(!a.continued && !b.continued, "both wait for their bodies");
    let b = vm.body(ctx_b, b"{not json", true);
    let a = vm.body(ctx_a, &chat("m"), true);
    assert_eq!(b.reply.as_ref().map(|r| r.status), Some(400));
    assert_eq!(b.destination(), None);
    assert!(a.continued, "{:?}", a.reply);
    assert!(a.reply.is_none(), "the other stream's reply is its own");
    assert!(a.destination().is_some());
    assert_eq!(a.body, chat("m"));
    vm.finish(ctx_b);
    assert!(vm.stream(ctx_b).is_none());
    assert!(vm.stream(ctx_a).is_some(), "A is still open");
    vm.finish(ctx_a);
    assert_eq!(vm.trapped, None);
}

#[test]
fn data_parallel_ranks_are_chosen() {
    let mut e = Envoy::ready("");
    let mut h = CHAT.to_vec();
    h.push(("x-data-parallel-rank", "0"));
    let ex = e.routers[1].request(&h, &[&chat("dp")]);
    assert!(ex.continued);
    assert_eq!(ex.destination(), Some("10.0.0.4:8000"));
    assert_eq!(
        ex.header("x-data-parallel-rank"),
        Some("1"),
        "rank 0 is busy; the client's value is replaced"
    );
}

#[test]
fn thermal_caps_are_applied_per_request_and_a_hot_fleet_sheds_as_thermal() {
    let mut e = Envoy::ready("");
    let r = &mut e.routers[0];
    // Worker 8 is throttling with room for one: it is still far cheaper
    // than worker 9, so it takes the first request...
    let (ex, open) = r.open(&CHAT, &[&chat("thermal-warm")]);
    assert_eq!(ex.destination(), Some("10.0.0.8:8000"));
    // ...and this VM's own booking puts it at its cap before any snapshot
    // says so: the next goes elsewhere while the first is open.
    let ex = r.request(&CHAT, &[&chat("thermal-warm")]);
    assert_eq!(ex.destination(), Some("10.0.0.9:8000"));
    r.finish(open);
    let ex = r.request(&CHAT, &[&chat("thermal-warm")]);
    assert_eq!(
        ex.destination(),
        Some("10.0.0.8:8000"),
        "its end frees the place"
    );

    // Worker 6 is at its cap and worker 7 busy: shed, reason thermal.
    let ex = r.request(&CHAT, &[&chat("thermal-hot")]);
    let reply = ex.reply.unwrap();
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-kvgate-reason"), Some("thermal"));
    assert_eq!(reply.header("retry-after"), Some("6"));
    assert_eq!(
        body(&reply),
        json!({"message": "Service temporarily unavailable: All workers are busy, please retry later", "type": "service_unavailable", "code": 503})
    );
    assert!(!ex.continued);
    assert_eq!(e.counter("kvgate_rejected_thermal_total"), 1);
}

/// The local reply the filter sends for core's `reply`: every header,
/// in order, and the body, as they are.
fn rendered(reply: &Reply) -> kvgate_tests::host::LocalReply {
    kvgate_tests::host::LocalReply {
        status: u32::from(reply.status),
        headers: reply
            .headers()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        body: reply.body.clone().into_bytes(),
    }
}

#[test]
fn local_replies() {
    let mut e = Envoy::ready(r#"{"max_body_bytes": 200, "retry_after_s": 3}"#);
    let r = &mut e.routers[0];

    let ex = r.request(&CHAT, &[&chat("busy")]);
    let reply = ex.reply.unwrap();
    assert_eq!(reply.status, 503);
    assert_eq!(
        body(&reply),
        json!({"message": "Service temporarily unavailable: All workers are busy, please retry later", "type": "service_unavailable", "code": 503})
    );
    assert_eq!(reply.header("retry-after"), Some("3"));
    assert_eq!(reply.header("x-kvgate-reason"), Some("all_workers_busy"));
    assert!(!ex.continued);

    let reply = r.request(&CHAT, &[&chat("empty")]).reply.unwrap();
    assert_eq!(
        (reply.status, reply.header("x-kvgate-reason")),
        (503, Some("no_workers"))
    );

    let reply = r.request(&CHAT, &[&chat("nope")]).reply.unwrap();
    assert_eq!(
        (reply.status, reply.header("x-kvgate-reason")),
        (404, Some("unknown_model"))
    );
    assert_eq!(body(&reply)["error"]["type"], "not_found_error");
    assert_eq!(reply, rendered(&Reply::unknown_model("nope")));

    let reply = r.request(&CHAT, &[b"{\"model\": "]).reply.unwrap();
    assert_eq!(
        (reply.status, reply.header("x-kvgate-reason")),
        (400, Some("bad_request"))
    );

    let reply = r.request(&CHAT, &[]).reply.unwrap();
    assert_eq!(reply.status, 400, "headers-only request");

    let big = vec![b'x'; 150];
    let ex = r.request(&CHAT, &[&big, &big]);
    assert_eq!(
        ex.reply,
        Some(rendered(&Reply::too_large(200))),
        "limit crossed across chunks"
    );
    assert!(!ex.continued);

    assert_eq!(e.counter("kvgate_rejected_all_workers_busy_total"), 1);
    assert_eq!(e.counter("kvgate_rejected_no_workers_total"), 1);
    assert_eq!(e.counter("kvgate_rejected_unknown_model_total"), 1);
    assert_eq!(e.counter("kvgate_rejected_bad_request_total"), 2);
    assert_eq!(e.counter("kvgate_rejected_body_too_large_total"), 1);
}

fn chat_saying(model: &str, text: &str) -> Vec<u8> {
    json!({"model": model, "messages": [{"role": "user", "content": text}]})
        .to_string()
        .into_bytes()
}

#[test]
fn a_shed_request_retried_at_its_time_goes_ahead_of_new_work() {
    let mut e = Envoy::start(r#"{"retry_after_s": 1}"#);
    let mut snap = fleet(1);
    // Busy by prefill (1200 tokens over a 1000 threshold), within the
    // default 50 % headroom; ten completions a second, three quarters of
    // them for retries: places 133 ms apart.
    let mut hot = worker(6, vec![rank(0, 0, true)]);
    hot.ranks[0].active_prefill_tokens = 1200;
    snap.models.push(ModelState {
        name: "hot".into(),
        thresholds: kvgate_core::Thresholds {
            active_prefill_tokens: Some(1000),
            ..Default::default()
        },
        workers: vec![hot],
        service_rate_per_s: 10.0,
        ..Default::default()
    });
    e.publish(&snap, true);
    let shed = |vm: &mut Vm, text: &str| {
        let ex = vm.request(&CHAT, &[&chat_saying("hot", text)]);
        ex.reply.map(|r| {
            assert_eq!(r.status, 503);
            r.header("retry-after").unwrap().to_string()
        })
    };
    // The first place a second away, then 133 ms apart.
    assert_eq!(shed(&mut e.routers[0], "a").as_deref(), Some("1"));
    assert_eq!(shed(&mut e.routers[1], "b").as_deref(), Some("2"));
    assert_eq!(shed(&mut e.routers[0], "c").as_deref(), Some("2"));
    // A retry before its time is new work.
    assert_eq!(shed(&mut e.routers[1], "a").as_deref(), Some("2"));
    e.shared.lock().unwrap().advance_ms(1000);
    // "a" took a new place when it came early; "b" is due at 1.133 s.
    e.shared.lock().unwrap().advance_ms(133);
    let ex = e.routers[1].request(&CHAT, &[&chat_saying("hot", "b")]);
    assert!(ex.continued, "{:?}", ex.reply);
    assert_eq!(ex.destination(), Some("10.0.0.6:8000"));
    assert_eq!(e.counter("kvgate_retry_admitted_total"), 1);
    // Once only; new work is still shed; another tenant's copy is new work.
    assert!(shed(&mut e.routers[0], "b").is_some());
    assert!(shed(&mut e.routers[0], "d").is_some());
    let mut other = CHAT.to_vec();
    other.push(("x-kvgate-tenant", "team-b"));
    let ex = e.routers[0].request(&other, &[&chat_saying("hot", "c")]);
    assert!(ex.reply.is_some(), "team-b has no ticket, and no worker");

    // Beyond the headroom even a ticket holder is shed, with a new place.
    snap.version = 2;
    snap.models.last_mut().unwrap().workers[0].ranks[0].active_prefill_tokens = 2000;
    e.publish(&snap, false);
    e.shared.lock().unwrap().advance_ms(1000);
    assert!(shed(&mut e.routers[0], "c").is_some());
    assert_eq!(e.counter("kvgate_retry_admitted_total"), 1);
}

#[test]
fn stale_state_fails_open_or_closed() {
    let mut e = Envoy::ready(r#"{"stale_after_ms": 2000}"#);
    e.shared.lock().unwrap().advance_ms(2500);
    let ex = e.routers[0].request(&CHAT, &[&chat("m")]);
    assert!(ex.continued);
    assert_eq!(ex.header("x-kvgate-fallback"), Some("stale"));
    assert_eq!(ex.destination(), None);
    assert_eq!(ex.foreign_calls, vec!["clear_route_cache".to_string()]);
    assert_eq!(e.counter("kvgate_failed_open_total"), 1);

    let mut e = Envoy::ready(r#"{"stale_after_ms": 2000, "on_stale": "fail_closed"}"#);
    e.shared.lock().unwrap().advance_ms(2500);
    let reply = e.routers[1].request(&CHAT, &[&chat("m")]).reply.unwrap();
    assert_eq!(
        (reply.status, reply.header("x-kvgate-reason")),
        (503, Some("stale_state"))
    );

    // Before any snapshot at all, the state is stale too.
    let mut e = Envoy::start(r#"{"on_stale": "fail_closed"}"#);
    assert_eq!(
        e.routers[0]
            .request(&CHAT, &[&chat("m")])
            .reply
            .unwrap()
            .status,
        503
    );
}

#[test]
fn a_client_fallback_header_is_removed_and_the_route_recomputed() {
    let mut e = Envoy::ready("");
    let mut h = CHAT.to_vec();
    h.push(("x-kvgate-fallback", "stale"));
    let ex = e.routers[0].request(&h, &[&chat("m")]);
    assert!(ex.continued);
    assert_eq!(ex.header("x-kvgate-fallback"), None);
    assert_eq!(ex.foreign_calls, vec!["clear_route_cache".to_string()]);
    assert!(ex.destination().is_some());
}

#[test]
fn new_versions_are_picked_up_and_the_snapshot_read_once_per_version() {
    let mut e = Envoy::ready("");
    for _ in 0..5 {
        assert_eq!(
            e.routers[0].request(&CHAT, &[&chat("m")]).destination(),
            Some("10.0.0.2:8000")
        );
    }
    assert_eq!(
        e.shared.lock().unwrap().reads["kvgate.snapshot"],
        1,
        "decoded once for five requests"
    );
    assert_eq!(
        e.shared.lock().unwrap().reads["kvgate.manifest"],
        5,
        "the manifest is read per request"
    );
    let mut next = fleet(2);
    next.models[0].workers[1].ranks[0].busy = true;
    e.publish(&next, false);
    let ex = e.routers[0].request(&CHAT, &[&chat("m")]);
    assert_eq!(
        ex.destination(),
        Some("10.0.0.3:8000"),
        "worker 2 went busy"
    );
    assert_eq!(e.shared.lock().unwrap().reads["kvgate.snapshot"], 2);

    // The root's tick decodes a new version between requests: the next
    // request finds its view current, and one that read an older manifest
    // decides from the newer view without reading the snapshot again.
    let mut third = fleet(3);
    third.models[0].workers[2].ranks[0].busy = true;
    let (_, stale) = e.routers[0].begin(&CHAT, false);
    e.publish(&third, false);
    e.routers[0].tick().unwrap();
    assert_eq!(
        e.shared.lock().unwrap().reads["kvgate.snapshot"],
        3,
        "read on the tick"
    );
    let fresh = e.routers[0].request(&CHAT, &[&chat("m")]);
    let older = e.routers[0].body(stale, &chat("m"), true);
    e.routers[0].finish(stale);
    for ex in [fresh, older] {
        assert_eq!(
            ex.destination(),
            Some("10.0.0.2:8000"),
            "worker 3 went busy"
        );
    }
    assert_eq!(e.shared.lock().unwrap().reads["kvgate.snapshot"], 3);
}

#[test]
fn shards_are_written_and_cleared_on_reset() {
    let mut e = Envoy::ready("");
    let shard = encode_shard(&mut [(9, vec![Holder { slot: 1, tiers: 1 }])]);
    let c = e.service.pending().pop().unwrap();
    e.service
        .respond(
            c.token,
            200,
            &[],
            &update::encode(2, EPOCH, false, None, [("m", 3, &shard[..])]),
        )
        .unwrap();
    assert_eq!(
        e.shared.lock().unwrap().get("kvgate.idx.m.3"),
        Some(&shard[..])
    );
    let c = e.service.pending().pop().unwrap();
    let snap = fleet(3).encode().unwrap();
    e.service
        .respond(
            c.token,
            200,
            &[],
            &update::encode(3, EPOCH + 1, true, Some(&snap), []),
        )
        .unwrap();
    assert_eq!(
        e.shared.lock().unwrap().get("kvgate.idx.m.3"),
        Some(&[][..]),
        "a reset empties shards it does not list"
    );
}

/// Encoded shards of an index (`shard_count` shards) in which each slot
/// holds its hashes on device.
fn shards_holding(held: &[(u16, Vec<u64>)], shard_count: u32) -> Vec<(u32, Vec<u8>)> {
    use kvgate_core::shard::{TIER_DEVICE, shard_of};
    let mut per_shard: std::collections::BTreeMap<u32, Vec<(u64, Vec<Holder>)>> =
        Default::default();
    for (slot, hashes) in held {
        for &h in hashes {
            per_shard
                .entry(shard_of(h, shard_count))
                .or_default()
                .push((
                    h,
                    vec![Holder {
                        slot: *slot,
                        tiers: TIER_DEVICE,
                    }],
                ));
        }
    }
    per_shard
        .into_iter()
        .map(|(s, mut e)| (s, encode_shard(&mut e)))
        .collect()
}

/// Answers the service's poll with fleet 1 (worker i on slot i, 8 index
/// shards, model `m` with `adapters`) and an index in which each slot holds
/// its hashes on device.
fn serve_index(e: &mut Envoy, held: &[(u16, Vec<u64>)], adapters: Vec<String>) {
    let shards = shards_holding(held, 8);
    let mut snap = fleet(1);
    snap.models[0].shard_count = 8;
    snap.models[0].lora_adapters = adapters;
    for (i, w) in snap.models[0].workers.iter_mut().enumerate() {
        w.ranks[0].slot = i as u16;
    }
    serve(e, &snap, &shards);
}

/// Answers the service's poll with `snap` and model `m`'s index `shards`.
fn serve(e: &mut Envoy, snap: &Snapshot, shards: &[(u32, Vec<u8>)]) {
    let bytes = snap.encode().unwrap();
    let frame = update::encode(
        1,
        EPOCH,
        true,
        Some(&bytes),
        shards.iter().map(|(s, b)| ("m", *s, b.as_slice())),
    );
    let c = e.service.pending().pop().unwrap();
    e.service.respond(c.token, 200, &[], &frame).unwrap();
}

#[test]
fn token_prompts_go_where_their_prefix_is_cached() {
    use kvgate_core::hash::{XXH3_SEED, block_hashes, sequence_hashes};
    let mut e = Envoy::start("");
    // Worker 1 (slot 0) carries 30 more decode blocks than worker 2 but
    // holds the prompt's 37 blocks: credit 37 > 30, so it wins; with only a
    // few blocks cached it would not (docs/selection.md).
    let tokens: Vec<u32> = (0..600).map(|t| 5000 + t).collect();
    let seq = sequence_hashes(&block_hashes(&tokens, 16, XXH3_SEED));
    serve_index(&mut e, &[(0, seq)], Vec::new());
    let body = json!({"model": "m", "prompt": tokens}).to_string();
    let ex = e.routers[0].request(
        &[(":method", "POST"), (":path", "/v1/completions")],
        &[body.as_bytes()],
    );
    assert_eq!(ex.trapped, None);
    assert_eq!(
        ex.destination(),
        Some("10.0.0.1:8000"),
        "the cached prefix outweighs 30 decode blocks"
    );
    // A different prompt has no overlap and goes to the least loaded worker.
    let other = json!({"model": "m", "prompt": (0..130).collect::<Vec<u32>>()}).to_string();
    let ex = e.routers[0].request(
        &[(":method", "POST"), (":path", "/v1/completions")],
        &[other.as_bytes()],
    );
    assert_eq!(ex.destination(), Some("10.0.0.2:8000"));
}

/// Index shard reads since `before`, by key.
fn shard_reads(
    e: &Envoy,
    before: &std::collections::HashMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    e.shared
        .lock()
        .unwrap()
        .reads
        .iter()
        .filter(|(k, _)| k.starts_with("kvgate.idx."))
        .map(|(k, n)| (k.clone(), n - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// A retry holding its ticket is placed twice when every worker is busy
/// (without, then with the headroom), but its prompt is hashed and its
/// shards read once: it reads exactly what one ordinary decision reads.
#[test]
fn a_redeemed_retry_reads_the_index_once() {
    use kvgate_core::hash::{XXH3_SEED, block_hashes, sequence_hashes};
    let mut e = Envoy::start(r#"{"retry_after_s": 1}"#);
    let tokens: Vec<u32> = (0..600).map(|t| 7000 + t).collect();
    let seq = sequence_hashes(&block_hashes(&tokens, 16, XXH3_SEED));
    let shards = shards_holding(&[(0, seq)], 8);
    // Every worker busy by prefill (1200 over a 1000 threshold), within
    // the default 50 % headroom.
    let mut snap = fleet(1);
    let m = &mut snap.models[0];
    m.shard_count = 8;
    m.thresholds.active_prefill_tokens = Some(1000);
    m.service_rate_per_s = 10.0;
    for (i, w) in m.workers.iter_mut().enumerate() {
        w.ranks[0].slot = i as u16;
        w.ranks[0].busy = true;
        w.ranks[0].active_prefill_tokens = 1200;
    }
    serve(&mut e, &snap, &shards);
    let body = json!({"model": "m", "prompt": tokens}).to_string();
    let completion = [(":method", "POST"), (":path", "/v1/completions")];

    let before = e.shared.lock().unwrap().reads.clone();
    let ex = e.routers[0].request(&completion, &[body.as_bytes()]);
    assert_eq!(ex.reply.as_ref().map(|r| r.status), Some(503));
    let one_decision = shard_reads(&e, &before);
    assert!(
        !one_decision.is_empty(),
        "the prompt's prefix is indexed: a decision reads its shards"
    );

    e.shared.lock().unwrap().advance_ms(1000);
    let before = e.shared.lock().unwrap().reads.clone();
    let ex = e.routers[0].request(&completion, &[body.as_bytes()]);
    assert!(
        ex.continued,
        "the ticket holder is admitted: {:?}",
        ex.reply
    );
    assert_eq!(e.counter("kvgate_retry_admitted_total"), 1);
    assert_eq!(
        ex.destination(),
        Some("10.0.0.1:8000"),
        "placed where its prefix is cached"
    );
    assert_eq!(shard_reads(&e, &before), one_decision);
}

/// The KV events of a LoRA adapter and of a salted prompt are indexed
/// under their own hashes (the sidecar's rule, `kvgate_core::hash`); the
/// filter must hash a request the same way: an adapter request finds the
/// adapter's blocks, a salted one only its salt's, an unsalted one neither.
#[test]
fn adapter_and_salted_requests_match_only_their_own_cache() {
    use kvgate_core::booking::Event;
    use kvgate_core::hash::{CacheScope, scoped_sequence_hashes};
    let mut e = Envoy::start("");
    let tokens: Vec<u32> = (0..600).map(|t| 9000 + t).collect();
    // Slot 0 (worker 1, 40 decode blocks) holds the prompt under the
    // adapter; slot 2 (worker 3, 30 blocks) holds it salted "s1"; worker 2
    // (10 blocks) holds nothing and is the least loaded.
    let lora = CacheScope {
        lora_name: Some("sql-lora"),
        cache_salt: None,
    };
    let salted = CacheScope {
        lora_name: None,
        cache_salt: Some("s1"),
    };
    serve_index(
        &mut e,
        &[
            (0, scoped_sequence_hashes(&tokens, 16, lora)),
            (2, scoped_sequence_hashes(&tokens, 16, salted)),
        ],
        vec!["sql-lora".into()],
    );
    let route = |e: &mut Envoy, body: Value| {
        let body = body.to_string();
        let ex = e.routers[0].request(
            &[(":method", "POST"), (":path", "/v1/completions")],
            &[body.as_bytes()],
        );
        assert_eq!(ex.trapped, None);
        assert!(ex.continued, "{:?}", ex.reply);
        ex.destination().map(str::to_owned)
    };
    let cases = [
        (
            json!({"model": "sql-lora", "prompt": tokens}),
            "10.0.0.1:8000",
        ),
        (
            json!({"model": "m", "prompt": tokens, "cache_salt": "s1"}),
            "10.0.0.3:8000",
        ),
        (json!({"model": "m", "prompt": tokens}), "10.0.0.2:8000"),
        (
            json!({"model": "m", "prompt": tokens, "cache_salt": "s2"}),
            "10.0.0.2:8000",
        ),
        (
            json!({"model": "sql-lora", "prompt": tokens, "cache_salt": "s1"}),
            "10.0.0.2:8000",
        ),
    ];
    for (body, want) in &cases {
        assert_eq!(
            route(&mut e, body.clone()).as_deref(),
            Some(*want),
            "model {} cache_salt {}",
            body["model"],
            body["cache_salt"]
        );
    }
    // The adapter's load is the base model's, the one the sidecar knows.
    e.routers[0].tick().unwrap();
    let booked: Vec<String> = events(&e.routers[0].drain_queue("kvgate", "kvgate.bookings"))
        .into_iter()
        .filter_map(|ev| match ev {
            Event::Book { model, .. } => Some(model),
            _ => None,
        })
        .collect();
    assert_eq!(booked, vec!["m"; cases.len()]);
}

#[test]
fn text_prompts_are_reported_and_follow_the_learned_index() {
    use kvgate_core::approx::{self, Routed};
    use kvgate_core::shard::{TIER_DEVICE, shard_of};
    let mut e = Envoy::ready("");
    // 2.5 KiB of system prompt: 10 chunks, credited as 40 blocks of 16.
    let system = "You are a meticulous assistant. ".repeat(80);
    let ask = |q: &str| {
        json!({"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}).to_string()
    };
    // A first request is routed on load alone and reported.
    let ex = e.routers[0].request(&CHAT, &[ask("first?").as_bytes()]);
    assert_eq!(ex.destination(), Some("10.0.0.2:8000"));
    e.routers[0].tick().unwrap();
    assert_eq!(
        e.shared.lock().unwrap().queued("kvgate", "kvgate.routed"),
        1
    );
    e.service.deliver_queues().unwrap();
    let report = e
        .service
        .pending()
        .into_iter()
        .find(|c| c.header(":path") == Some("/v1/routed"))
        .expect("a report");
    assert_eq!(report.header(":method"), Some("POST"));
    let records = Routed::decode_all(&report.body).unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(
        (records[0].model.as_str(), records[0].slot, records[0].kind),
        ("m", 8, approx::ChunkKind::Text),
        "worker 2's rank 0 is slot 8"
    );
    assert!(!records[0].hashes.is_empty());
    // While that report is in flight, more decisions wait in the queue and
    // go together once it is answered: one request at a time.
    for q in ["a?", "b?"] {
        e.routers[1].request(&CHAT, &[ask(q).as_bytes()]);
    }
    e.routers[1].tick().unwrap();
    e.service.deliver_queues().unwrap();
    let reports = |e: &Envoy| {
        e.service
            .pending()
            .into_iter()
            .filter(|c| c.header(":path") == Some("/v1/routed"))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        reports(&e).len(),
        1,
        "no second report while one is in flight"
    );
    e.service.respond(report.token, 204, &[], b"").unwrap();
    let next = reports(&e);
    assert_eq!(next.len(), 1);
    assert_eq!(Routed::decode_all(&next[0].body).unwrap().len(), 2);
    e.service.respond(next[0].token, 204, &[], b"").unwrap();

    // The sidecar publishes what it learned (here: worker 3, slot 12, holds
    // the system prompt's chunks); a new question with the same system
    // prompt follows it although worker 3 is more loaded.
    let snap = fleet(2);
    let shared_chunks =
        kvgate_core::text::prefix_keys(&format!("system\n{system}"), Default::default());
    let mut per_shard: std::collections::BTreeMap<u32, Vec<(u64, Vec<Holder>)>> =
        Default::default();
    for h in &shared_chunks {
        per_shard
            .entry(shard_of(*h, approx::SHARDS))
            .or_default()
            .push((
                *h,
                vec![Holder {
                    slot: 12,
                    tiers: TIER_DEVICE,
                }],
            ));
    }
    let shards: Vec<(u32, Vec<u8>)> = per_shard
        .into_iter()
        .map(|(s, mut e)| (s, encode_shard(&mut e)))
        .collect();
    let key = approx::model_key("m");
    let bytes = snap.encode().unwrap();
    let frame = update::encode(
        2,
        EPOCH,
        false,
        Some(&bytes),
        shards.iter().map(|(s, b)| (key.as_str(), *s, b.as_slice())),
    );
    let poll = e
        .service
        .pending()
        .into_iter()
        .find(|c| {
            c.header(":path")
                .is_some_and(|p| p.starts_with("/v1/snapshot"))
        })
        .unwrap();
    e.service.respond(poll.token, 200, &[], &frame).unwrap();
    let ex = e.routers[1].request(&CHAT, &[ask("second, a different question?").as_bytes()]);
    assert_eq!(ex.destination(), Some("10.0.0.3:8000"));
}

#[test]
fn bad_configuration_fails_the_load() {
    let shared = Shared::new();
    for bad in [
        r#"{"on_stale": "maybe"}"#,
        r#"{"bogus": true}"#,
        "not json",
        r#"{"max_body_bytes": 0}"#,
    ] {
        let vm = Vm::start(filter(), &shared, "kvgate", "kvgate_router", bad).unwrap();
        assert!(!vm.configured, "{bad} was accepted");
        assert!(vm.logs().contains("kvgate"), "no log line for {bad}");
        let vm = Vm::start(filter(), &shared, "kvgate", "kvgate_snapshot_service", bad).unwrap();
        assert!(!vm.configured);
    }
}

#[test]
fn garbage_never_traps_and_bursts_spread() {
    let mut e = Envoy::ready("");
    let mut seed = 0x1234_5678u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let valid = chat("m");
    for i in 0..500 {
        let body: Vec<u8> = match i % 3 {
            0 => (0..(next() % 300)).map(|_| next() as u8).collect(),
            1 => valid[..(next() as usize % valid.len())].to_vec(),
            _ => {
                let mut b = valid.clone();
                let at = next() as usize % b.len();
                b[at] = next() as u8;
                b
            }
        };
        let ex = e.routers[i % 2].request(&CHAT, &[&body]);
        assert_eq!(ex.trapped, None, "body {body:?}");
        assert!(
            ex.continued
                || ex
                    .reply
                    .as_ref()
                    .is_some_and(|r| r.status == 400 || r.status == 404)
        );
    }
    // An idle fleet: identical requests spread over the tied workers.
    let idle = Snapshot {
        version: 9,
        built_at_ms: 1,
        models: vec![ModelState {
            name: "m".into(),
            workers: (1..=4)
                .map(|id| worker(id, vec![rank(0, 0, false)]))
                .collect(),
            ..Default::default()
        }],
        applied: Vec::new(),
    };
    e.publish(&idle, false);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..40 {
        let ex = e.routers[i % 2].request(&CHAT, &[&chat("m")]);
        seen.insert(ex.destination().unwrap().to_string());
    }
    assert_eq!(seen.len(), 4, "a burst spread over {seen:?}");
    let h = e
        .shared
        .lock()
        .unwrap()
        .metric("kvgate_decision_us")
        .unwrap()
        .samples
        .len();
    assert!(h >= 40, "decision latency recorded per routed request");
}

/// Every decision is timed; its phases on one request in
/// `phase_timing_every` of a VM's, after the decision's own sample.
#[test]
fn every_decision_is_timed_and_its_phases_on_a_sample() {
    for (config, every) in [
        ("", 8),
        (r#"{"phase_timing_every": 1}"#, 1),
        (r#"{"phase_timing_every": 3}"#, 3),
        (r#"{"phase_timing_every": 0}"#, 0),
    ] {
        let mut e = Envoy::ready(config);
        for _ in 0..24 {
            let ex = e.routers[0].request(&CHAT, &[&chat("m")]);
            assert!(ex.continued, "{config}: routed");
        }
        let shared = e.shared.lock().unwrap();
        let samples = |name: &str| shared.metric(name).map_or(0, |m| m.samples.len());
        assert_eq!(samples("kvgate_decision_us"), 24, "{config}");
        let sampled = 24_usize.checked_div(every).unwrap_or(0);
        for phase in ["kvgate_parse_us", "kvgate_gather_us", "kvgate_selection_us"] {
            assert_eq!(samples(phase), sampled, "{config}: {phase}");
        }
    }
}

fn path_of(c: &kvgate_tests::host::Callout) -> &str {
    c.headers
        .iter()
        .find(|(k, _)| k == ":path")
        .map_or("", |(_, v)| v.as_str())
}

/// The booking events in queue items, without the VM's heartbeats (a
/// ticking VM sends one a second: see `hostile.rs` for them).
fn events(items: &[Vec<u8>]) -> Vec<kvgate_core::booking::Event> {
    items
        .iter()
        .flat_map(|b| kvgate_core::booking::decode_batch(b).unwrap())
        .filter(|e| !matches!(e, kvgate_core::booking::Event::Alive { .. }))
        .collect()
}

#[test]
fn open_requests_book_load_so_a_burst_spreads_and_every_booking_is_released() {
    use kvgate_core::booking::Event;
    let mut e = Envoy::start("");
    let idle = Snapshot {
        version: 3,
        built_at_ms: 1,
        models: vec![ModelState {
            name: "m".into(),
            workers: (1..=4)
                .map(|id| {
                    let mut r = rank(0, 0, false);
                    r.kv_total_blocks = 10_000;
                    worker(id, vec![r])
                })
                .collect(),
            ..Default::default()
        }],
        applied: Vec::new(),
    };
    e.publish(&idle, true);
    // Eight identical requests, all still waiting on their upstream: each
    // one's booking steers the next, so they spread two per worker.
    let mut open = Vec::new();
    let mut per_worker = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..8 {
        let (ex, ctx) = e.routers[0].open(&CHAT, &[&chat("m")]);
        assert!(ex.continued, "{:?}", ex.reply);
        *per_worker
            .entry(ex.destination().unwrap().to_string())
            .or_default() += 1;
        open.push(ctx);
    }
    assert_eq!(
        per_worker.values().copied().collect::<Vec<_>>(),
        vec![2; 4],
        "{per_worker:?}"
    );
    // The VM holds its events until its root's tick flushes them, as one
    // queue item (one wake of the service instead of eight).
    assert_eq!(
        e.shared.lock().unwrap().queued("kvgate", "kvgate.bookings"),
        0
    );
    e.routers[0].tick().unwrap();
    let items = e.routers[0].drain_queue("kvgate", "kvgate.bookings");
    assert_eq!(items.len(), 1);
    let booked = events(&items);
    assert_eq!(booked.len(), 8);
    let mut seqs = Vec::new();
    for ev in &booked {
        match ev {
            Event::Book {
                key,
                model,
                decode_blocks,
                ..
            } => {
                assert_eq!(model, "m");
                assert!(*decode_blocks >= 1);
                seqs.push(key.seq);
            }
            other => panic!("expected a booking, got {other:?}"),
        }
    }
    assert_eq!(seqs, (1..=8).collect::<Vec<_>>());
    // First byte of one response, then every stream ends.
    e.routers[0].response_body(open[0], 12).unwrap();
    e.routers[0].response_body(open[0], 40).unwrap();
    for ctx in &open {
        e.routers[0].finish(*ctx);
    }
    e.routers[0].tick().unwrap();
    let released = events(&e.routers[0].drain_queue("kvgate", "kvgate.bookings"));
    let first = released
        .iter()
        .filter(|e| matches!(e, Event::FirstByte { .. }))
        .count();
    let done = released
        .iter()
        .filter(|e| matches!(e, Event::Done { .. }))
        .count();
    assert_eq!((first, done, released.len()), (1, 8, 9), "{released:?}");
    // Released load leaves the VM's view: the next request is free to go
    // anywhere again, and a rejected one is reported with its reason.
    let ex = e.routers[0].request(&CHAT, &[&chat("nope")]);
    assert_eq!(ex.reply.unwrap().status, 404);
    e.routers[0].tick().unwrap();
    let rejected = events(&e.routers[0].drain_queue("kvgate", "kvgate.bookings"));
    assert_eq!(
        rejected,
        vec![Event::Rejected {
            model: "nope".into(),
            reason: Reason::UnknownModel
        }]
    );
}

#[test]
fn the_service_forwards_bookings_one_batch_at_a_time() {
    let mut e = Envoy::ready("");
    e.routers[1].request(&CHAT, &[&chat("m")]);
    e.routers[1].tick().unwrap();
    e.service.deliver_queues().unwrap();
    let posts: Vec<_> = e
        .service
        .pending()
        .into_iter()
        .filter(|c| path_of(c) == "/v1/bookings")
        .collect();
    assert_eq!(posts.len(), 1);
    let evs = events(std::slice::from_ref(&posts[0].body));
    assert!(matches!(evs[0], kvgate_core::booking::Event::Book { .. }));
    assert!(matches!(evs[1], kvgate_core::booking::Event::Done { .. }));
    // While it is in flight, new events wait in the queue.
    e.routers[0].request(&CHAT, &[&chat("m")]);
    e.routers[0].tick().unwrap();
    e.service.deliver_queues().unwrap();
    let in_flight = e
        .service
        .pending()
        .into_iter()
        .filter(|c| path_of(c) == "/v1/bookings")
        .count();
    assert_eq!(in_flight, 1);
    // Its answer sends the next batch.
    e.service.respond(posts[0].token, 204, &[], b"").unwrap();
    let next: Vec<_> = e
        .service
        .pending()
        .into_iter()
        .filter(|c| path_of(c) == "/v1/bookings")
        .collect();
    assert_eq!(next.len(), 1);
    assert_eq!(events(std::slice::from_ref(&next[0].body)).len(), 2);
    // A failed batch is counted and does not wedge the queue.
    e.service.fail(next[0].token).unwrap();
    assert_eq!(e.counter("kvgate_booking_batch_errors_total"), 1);
    e.routers[0].request(&CHAT, &[&chat("m")]);
    e.routers[0].tick().unwrap();
    e.service.deliver_queues().unwrap();
    assert!(
        e.service
            .pending()
            .iter()
            .any(|c| path_of(c) == "/v1/bookings")
    );
}

/// The poll carries the sidecar token, which spares its reset frames the
/// sidecar's cap on whole-index readers.
#[test]
fn a_poll_carries_the_sidecar_token() {
    let e = Envoy::start(r#"{"sidecar_token": "s3cret"}"#);
    let polls = e.service.pending();
    assert_eq!(polls.len(), 1);
    assert_eq!(polls[0].header("authorization"), Some("Bearer s3cret"));
}

/// A sidecar that has a control token refuses the bookings of a filter
/// without one: the filter warns once, saying what to set, not once per
/// batch, and again after a minute if the refusals go on.
#[test]
fn a_refused_token_is_logged_once_then_rate_limited() {
    // Fresh state past the minute the test waits, so that it still routes
    // (and books) then.
    let mut e = Envoy::ready(r#"{"stale_after_ms": 120000}"#);
    let warnings = |e: &Envoy| {
        e.service
            .logs()
            .lines()
            .filter(|l| l.starts_with("[3]") && l.contains("sidecar_token"))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let refuse_one = |e: &mut Envoy| {
        e.routers[0].request(&CHAT, &[&chat("m")]);
        e.routers[0].tick().unwrap();
        e.service.deliver_queues().unwrap();
        let post = e
            .service
            .pending()
            .into_iter()
            .find(|c| path_of(c) == "/v1/bookings")
            .expect("a booking batch");
        e.service
            .respond(post.token, 401, &[("www-authenticate", "Bearer")], b"")
            .unwrap();
    };
    for _ in 0..3 {
        refuse_one(&mut e);
    }
    assert_eq!(e.counter("kvgate_booking_batch_errors_total"), 3);
    let logged = warnings(&e);
    assert_eq!(logged.len(), 1, "{}", e.service.logs());
    assert!(
        logged[0].contains("refused 1 report(s) with 401"),
        "{logged:?}"
    );
    assert!(logged[0].contains("/v1/bookings"), "{logged:?}");
    e.shared.lock().unwrap().advance_ms(60_000);
    refuse_one(&mut e);
    let logged = warnings(&e);
    assert_eq!(logged.len(), 2, "{}", e.service.logs());
    assert!(logged[1].contains("refused 3 report(s)"), "{logged:?}");
}

/// A chat of a model with a prompt template is rendered in the VM and
/// matched against the text index: it goes to the rank whose engine holds
/// the rendered prefix, even with more load; a template blob that does not
/// decode is refused with the whole frame.
#[test]
fn chat_prompts_are_rendered_and_matched_against_the_text_index() {
    use kvgate_core::hash::CacheScope;
    use kvgate_core::text::{self, template::PromptTemplate};
    let mut e = Envoy::start("");
    let template = PromptTemplate {
        chat_template: "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}".into(),
        bos_token: "<s>".into(),
        eos_token: "</s>".into(),
        completion_prefix: "<s>".into(),
    };
    let system = "You route requests to the worker holding their prefix. ".repeat(60);
    let messages = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "which worker?"},
    ]);
    let rendered = kvgate_core::text::template::Renderer::new(template.clone())
        .unwrap()
        .chat(&messages, None, None, 0)
        .unwrap();
    // The engine of worker 3 (slot 2) cached all but the last chunk.
    let mut keys = text::prefix_keys(&rendered, CacheScope::default());
    keys.pop();
    let shards = shards_holding(&[(2, keys)], text::SHARDS);
    let mut snap = fleet(1);
    snap.models[0].prompt_template = template.version();
    for (i, w) in snap.models[0].workers.iter_mut().enumerate() {
        w.ranks[0].slot = i as u16;
    }
    let (text_ns, template_ns) = (text::index_key("m"), text::template_key("m"));
    let blob = template.encode();
    let frame = update::encode(
        1,
        EPOCH,
        true,
        Some(&snap.encode().unwrap()),
        shards
            .iter()
            .map(|(s, b)| (text_ns.as_str(), *s, b.as_slice()))
            .chain([(template_ns.as_str(), 0, blob.as_slice())]),
    );
    let c = e.service.pending().pop().unwrap();
    e.service.respond(c.token, 200, &[], &frame).unwrap();
    let body = json!({"model": "m", "messages": messages}).to_string();
    let ex = e.routers[0].request(&CHAT, &[body.as_bytes()]);
    assert_eq!(ex.trapped, None);
    assert_eq!(
        ex.destination(),
        Some("10.0.0.3:8000"),
        "the engine's cached text outweighs 20 decode blocks"
    );
    assert_eq!(e.counter("kvgate_prompts_rendered_total"), 1);
    // That system prompt ends in a space the template trims, so the chat
    // ran the template; without it, the chat is assembled from its
    // shape's skeleton, renders the same text and goes to the same rank.
    assert_eq!(e.counter("kvgate_prompts_assembled_total"), 0);
    let trimmed = json!({"model": "m", "messages": [
        {"role": "system", "content": system.trim_end()},
        {"role": "user", "content": "which worker?"},
    ]});
    let ex = e.routers[0].request(&CHAT, &[trimmed.to_string().as_bytes()]);
    assert_eq!(ex.destination(), Some("10.0.0.3:8000"));
    assert_eq!(e.counter("kvgate_prompts_assembled_total"), 1);
    // Another system prompt matches nothing: least loaded.
    let other = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(3000)}]});
    let ex = e.routers[1].request(&CHAT, &[other.to_string().as_bytes()]);
    assert_eq!(ex.destination(), Some("10.0.0.2:8000"));

    // A frame whose template blob is garbage changes nothing.
    let bad = update::encode(
        2,
        EPOCH,
        false,
        None,
        [(template_ns.as_str(), 0, &b"KVGT\xff\xff\xff\xff"[..])],
    );
    let c = e.service.pending().pop().unwrap();
    e.service.respond(c.token, 200, &[], &bad).unwrap();
    assert!(e.counter("kvgate_snapshot_decode_errors_total") >= 1);
    assert_eq!(
        e.shared
            .lock()
            .unwrap()
            .get(&update::shard_key(&template_ns, 0)),
        Some(&blob[..]),
        "the good blob stays"
    );
}

#[path = "filter_wasm/disagg.rs"]
mod disagg;

#[path = "filter_wasm/disagg_sglang.rs"]
mod disagg_sglang;

#[path = "filter_wasm/gates.rs"]
mod gates;

#[path = "filter_wasm/hostile.rs"]
mod hostile;

#[path = "filter_wasm/reference.rs"]
mod reference;

/// The module is built with its source paths remapped (`cargo xtask`'s
/// filter build): it names no folder of the machine that built it, so
/// builds from checkouts at different paths are byte for byte the same.
#[test]
fn the_module_names_no_path_of_the_build_machine() {
    let wasm = std::fs::read(kvgate_tests::filter_wasm()).unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .canonicalize()
        .unwrap();
    let mut machine = vec![repo.display().to_string(), "/root/".to_string()];
    if let Some(home) = std::env::var_os("HOME").filter(|h| h.len() > 1) {
        machine.push(format!("{}/", std::path::Path::new(&home).display()));
    }
    for p in machine {
        assert!(
            !wasm.windows(p.len()).any(|w| w == p.as_bytes()),
            "the filter module holds {p:?}"
        );
    }
    // The remapped names are there instead: the dependencies' panic
    // locations name the registry under /cargo.
    assert!(wasm.windows(16).any(|w| w == b"/cargo/registry/"));
}
