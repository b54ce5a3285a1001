//! The bound on a decode worker's requests in flight, held at the moment
//! each request is sent (`active_decode_requests_threshold`): two router
//! VMs, as two Envoy worker threads, share one store, and the test runs
//! one VM's whole request between the other's read of the slot counts and
//! its compare-and-swap write ([`Shared::before_set`]).

use super::{CHAT, EPOCH, chat, filter, rank, worker};
use kvgate_core::admit::ledger;
use kvgate_core::{ModelState, Snapshot, Thresholds, update};
use kvgate_tests::host::{Exchange, Shared, SharedRef, Vm};
use std::sync::{Arc, Mutex};

/// Model `m` on one worker that takes one request at a time.
fn one_slot(version: u64) -> Snapshot {
    Snapshot {
        version,
        built_at_ms: 1,
        models: vec![ModelState {
            name: "m".into(),
            thresholds: Thresholds {
                active_decode_requests: Some(1),
                ..Default::default()
            },
            workers: vec![worker(1, vec![rank(0, 0, false)])],
            ..Default::default()
        }],
        applied: Vec::new(),
    }
}

/// A service VM and two router VMs on one store, the snapshot
/// published. The clock moves between the routers' starts: the host's
/// randomness follows the clock, and Envoy's threads draw distinct VM
/// tags.
fn start(config: &str, snap: &Snapshot) -> (SharedRef, Vm, Vm, Vm) {
    let shared = Shared::new();
    let mut service = Vm::start(
        filter(),
        &shared,
        "kvgate",
        "kvgate_snapshot_service",
        config,
    )
    .unwrap();
    assert!(service.configured, "{}", service.logs());
    let router = || {
        shared.lock().unwrap().advance_ms(1);
        let vm = Vm::start(filter(), &shared, "kvgate", "kvgate_router", config).unwrap();
        assert!(vm.configured, "{}", vm.logs());
        vm
    };
    let (a, b) = (router(), router());
    publish(&mut service, snap, true);
    (shared, service, a, b)
}

fn publish(service: &mut Vm, snap: &Snapshot, reset: bool) {
    let bytes = snap.encode().unwrap();
    let frame = update::encode(snap.version, EPOCH, reset, Some(&bytes), []);
    let c = service.pending().pop().expect("a poll in flight");
    service.respond(c.token, 200, &[], &frame).unwrap();
}

/// The ledger's entries for `m`'s worker 1 that count now: (VM tag,
/// count), and their total.
fn slots(shared: &SharedRef) -> (Vec<(u64, u32)>, u64) {
    let s = shared.lock().unwrap();
    let entries = ledger::decode(s.get(&ledger::key("m")).unwrap_or_default());
    let now = s.now_ms();
    let live = entries
        .iter()
        .filter(|e| e.worker == 1 && e.count > 0)
        .map(|e| (e.vm, e.count))
        .collect();
    (live, ledger::count(&entries, 1, now))
}

/// VM `a` decides a request while, between its read of the counts and
/// its compare-and-swap, VM `b` sends a whole request to the same
/// worker's one slot. Returns `a`'s exchange and stream, and `b`'s.
fn race(shared: &SharedRef, a: &mut Vm, b: Arc<Mutex<Vm>>) -> ((Exchange, i32), (Exchange, i32)) {
    let b_side: Arc<Mutex<Option<(Exchange, i32)>>> = Arc::default();
    let out = b_side.clone();
    shared
        .lock()
        .unwrap()
        .before_set("kvgate.inflight.", move || {
            let mut b = b.lock().unwrap();
            *out.lock().unwrap() = Some(b.open(&CHAT, &[&chat("m")]));
        });
    let a_side = a.open(&CHAT, &[&chat("m")]);
    assert_eq!(
        shared.lock().unwrap().armed_hooks(),
        0,
        "A wrote the counts, and B ran in between"
    );
    let b_side = b_side.lock().unwrap().take().expect("B ran");
    (a_side, b_side)
}

#[test]
fn two_vms_never_send_into_a_decode_workers_last_slot() {
    let (shared, mut service, mut a, b) = start(r#"{"admission": {}}"#, &one_slot(1));
    let b = Arc::new(Mutex::new(b));
    // The counts' value exists (a request came and went before), so each
    // write swaps against the token its read returned.
    let (ex, ctx) = b.lock().unwrap().open(&CHAT, &[&chat("m")]);
    assert_eq!(ex.destination(), Some("10.0.0.1:8000"), "{:?}", ex.reply);
    b.lock().unwrap().finish(ctx);
    assert_eq!(slots(&shared).1, 0);
    assert!(shared.lock().unwrap().get(&ledger::key("m")).is_some());

    let before = shared.lock().unwrap().reads[&ledger::key("m")];
    let ((ex_a, ctx_a), (ex_b, ctx_b)) = race(&shared, &mut a, b.clone());
    assert_eq!(
        shared.lock().unwrap().reads[&ledger::key("m")] - before,
        3,
        "A read, B read and wrote, A's swap failed and A read again"
    );

    // B took the slot; A's swap failed, it read again, found the worker
    // full and holds its request: not sent, not answered.
    assert_eq!(ex_b.trapped, None);
    assert!(ex_b.continued, "{:?}", ex_b.reply);
    assert_eq!(ex_b.destination(), Some("10.0.0.1:8000"));
    assert_eq!(ex_a.trapped, None);
    assert!(!ex_a.continued, "A was sent into the last slot");
    assert_eq!(ex_a.destination(), None);
    assert_eq!(ex_a.reply, None, "held, not shed");
    assert_eq!(a.stream(ctx_a).unwrap().resumes, 0);
    let reads = shared.lock().unwrap().reads[&ledger::key("m")];
    let (live, total) = slots(&shared);
    assert_eq!(total, 1, "{live:?}");
    let tag_b = live[0].0;
    assert_eq!(live, vec![(tag_b, 1)], "B's slot alone");

    // B's response ends: its slot is free. A's view counts the worker
    // full until its next snapshot (`acquire_gate`), which the sidecar
    // publishes as B's load goes; A's next tick then sends A's held
    // request there. (Whether a tick before that snapshot already does
    // is left open: either way it is sent once, into a free slot.)
    b.lock().unwrap().finish(ctx_b);
    assert_eq!(slots(&shared).1, 0, "B released its slot");
    shared.lock().unwrap().advance_ms(10);
    a.tick().unwrap();
    assert!(slots(&shared).1 <= 1);
    publish(&mut service, &one_slot(2), false);
    shared.lock().unwrap().advance_ms(10);
    a.tick().unwrap();
    let s = a.stream(ctx_a).unwrap();
    assert_eq!(s.resumes, 1, "A's held request went on:\n{}", a.logs());
    assert_eq!(
        s.header("x-gateway-destination-endpoint"),
        Some("10.0.0.1:8000")
    );
    let (live, total) = slots(&shared);
    assert_eq!(total, 1, "{live:?}");
    assert_ne!(live[0].0, tag_b, "A's slot, under A's own tag");
    assert!(shared.lock().unwrap().reads[&ledger::key("m")] > reads);
    a.finish(ctx_a);
    assert_eq!(slots(&shared).1, 0);
    assert_eq!(a.trapped, None);
}

#[test]
fn without_admission_the_vm_that_lost_the_last_slot_sheds() {
    let (shared, _service, mut a, b) = start("", &one_slot(1));
    let b = Arc::new(Mutex::new(b));
    let (_, ctx) = b.lock().unwrap().open(&CHAT, &[&chat("m")]);
    b.lock().unwrap().finish(ctx);
    let ((ex_a, _), (ex_b, _)) = race(&shared, &mut a, b);
    assert_eq!(
        ex_b.destination(),
        Some("10.0.0.1:8000"),
        "{:?}",
        ex_b.reply
    );
    assert_eq!(ex_a.destination(), None);
    let reply = ex_a.reply.expect("A is answered");
    assert_eq!(
        (reply.status, reply.header("x-kvgate-reason")),
        (503, Some("all_workers_busy"))
    );
    let (live, total) = slots(&shared);
    assert_eq!(total, 1, "B's slot alone: {live:?}");
}

/// The same race on the model's first request since Envoy started. Envoy
/// takes a write to a key it does not hold whatever the compare-and-swap
/// token (proxy-wasm-cpp-host's `SharedData::set`), so two VMs creating
/// the counts at once would each erase the other's slot: the snapshot
/// service creates them, before it publishes the bound, and a VM only
/// ever rewrites them.
#[test]
fn two_vms_never_send_into_a_decode_workers_last_slot_even_the_first() {
    let (shared, _service, mut a, b) = start(r#"{"admission": {}}"#, &one_slot(1));
    let b = Arc::new(Mutex::new(b));
    assert_eq!(
        shared.lock().unwrap().get(&ledger::key("m")),
        Some(&[][..]),
        "created empty with the snapshot"
    );
    let ((ex_a, _), (ex_b, _)) = race(&shared, &mut a, b);
    assert!(ex_b.continued, "{:?}", ex_b.reply);
    assert_eq!(ex_b.destination(), Some("10.0.0.1:8000"));
    let (live, total) = slots(&shared);
    assert!(
        !ex_a.continued && ex_a.destination().is_none(),
        "both were sent into the one slot; the counts hold {live:?}"
    );
    assert_eq!(total, 1, "{live:?}");
}
