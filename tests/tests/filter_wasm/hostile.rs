//! Round four of the hostile inputs, through the real filter: requests
//! that would get around the decision (HTTP/2 trailers, a down prefill
//! pool, fail-open), worker answers that would trap the VM (no headers,
//! non-UTF-8 values), departed clients' prefill legs, and decode bodies
//! past the buffer.

use super::disagg::{
    COMPLETIONS, answer, bookings, json_of, ledger, only_callout, pd_fleet, prompt,
};
use super::disagg_sglang::sglang_fleet;
use super::{CHAT, Envoy, chat};
use kvgate_core::Snapshot;
use kvgate_core::state::{OnPrefillFailure, Role};
use serde_json::json;

/// A client's transfer fields: each would make a worker pull KV blocks
/// from the attacker's host, or match a victim's transfer by its id.
fn hostile_fields() -> serde_json::Value {
    json!({
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "evil", "remote_port": 1},
        "vllm_xargs": {"kv_transfer_params": {"remote_host": "evil"}, "keep": 1},
        "bootstrap_host": "evil", "bootstrap_port": 1, "bootstrap_room": 7,
        "request_id": "victim"
    })
}

fn assert_scrubbed(body: &[u8]) {
    let v = json_of(body);
    for f in [
        "kv_transfer_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "request_id",
    ] {
        assert!(v.get(f).is_none(), "{f} survived: {v}");
    }
    assert_eq!(v["vllm_xargs"], json!({"keep": 1}), "{v}");
}

/// `snap` with every worker of `role` gone: down, or left the catalog.
fn without(role: Role, mut snap: Snapshot) -> Snapshot {
    for m in &mut snap.models {
        m.workers.retain(|w| w.role != role);
    }
    snap
}

#[test]
fn a_request_ending_with_trailers_is_decided_at_them() {
    let mut e = Envoy::ready("");
    let (ex, ctx) = e.routers[0].begin(&CHAT, false);
    assert!(!ex.continued);
    let ex = e.routers[0].body(ctx, &chat("m"), false);
    assert!(!ex.continued, "the body is buffered");
    let ex = e.routers[0].trailers(ctx, &[("x-checksum", "1")]);
    assert_eq!(ex.trapped, None);
    assert!(ex.continued);
    assert!(ex.destination().is_some(), "decided at the trailers");
    assert_eq!(e.counter("kvgate_routed_total"), 1);
    assert_eq!(e.counter("kvgate_requests_with_trailers_total"), 1);
    let (booked, _) = ledger(&bookings(&mut e));
    assert_eq!(booked.len(), 1, "booked like any other");
    e.routers[0].finish(ctx);

    // A disaggregated model: the prefill leg is sent, and the client's
    // transfer fields go nowhere.
    let mut e = Envoy::start("");
    e.publish(&pd_fleet(OnPrefillFailure::Local), true);
    let (_, ctx) = e.routers[0].begin(&COMPLETIONS, false);
    e.routers[0].body(ctx, &prompt(3000, hostile_fields()), false);
    let ex = e.routers[0].trailers(ctx, &[("x-checksum", "1")]);
    assert!(!ex.continued, "paused on its prefill leg");
    let call = only_callout(&e);
    assert_eq!(
        json_of(&call.body)["kv_transfer_params"]["do_remote_decode"],
        true
    );

    // A body that never parses is refused there, not forwarded.
    let mut e = Envoy::ready("");
    let (_, ctx) = e.routers[0].begin(&CHAT, false);
    e.routers[0].body(ctx, b"{not json", false);
    let ex = e.routers[0].trailers(ctx, &[]);
    assert_eq!(ex.reply.map(|r| r.status), Some(400));
}

#[test]
fn a_callout_answer_without_headers_is_a_reset_not_a_trap() {
    // The prefill leg: tried on the runner-up, on both VMs' threads.
    let mut e = Envoy::start("");
    e.publish(&pd_fleet(OnPrefillFailure::Fail), true);
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let first = only_callout(&e);
    e.routers[0].fail(first.token).unwrap();
    assert_eq!(e.routers[0].trapped, None, "{}", e.routers[0].logs());
    let second = only_callout(&e);
    assert_ne!(
        second.header("x-kvgate-prefill-host"),
        first.header("x-kvgate-prefill-host")
    );
    // Headers without a status: a reset too.
    e.routers[0]
        .respond_raw(second.token, &[("content-type", "text/plain")], b"")
        .unwrap();
    assert_eq!(e.routers[0].trapped, None);
    let reply = e.routers[0].stream(ctx).unwrap().reply.clone().unwrap();
    assert_eq!(reply.status, 503);
    e.routers[0].finish(ctx);
    // The VM lives on: the next request is decided.
    let ex = e.routers[0].request(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    assert_eq!(ex.trapped, None);
    assert_eq!(e.routers[0].pending().len(), 1);

    // The snapshot service's own callouts.
    let mut e = Envoy::start("");
    let poll = e.service.pending().pop().unwrap();
    e.service.fail(poll.token).unwrap();
    assert_eq!(e.service.trapped, None, "{}", e.service.logs());
}

#[test]
fn non_utf8_client_headers_on_a_split_request_are_ignored() {
    let mut e = Envoy::start("");
    e.publish(&pd_fleet(OnPrefillFailure::Local), true);
    e.routers[0].state_mut().next_raw_headers = vec![
        ("authorization".into(), vec![b'B', 0xff, 0xfe]),
        ("x-request-id".into(), vec![0xc3, 0x28]),
    ];
    let (ex, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    assert_eq!(ex.trapped, None, "{}", e.routers[0].logs());
    let call = only_callout(&e);
    assert_eq!(call.header("authorization"), None, "not passed on");
    let id = call.header("x-request-id").unwrap();
    assert!(id.starts_with("kvgate-"));
    e.routers[0]
        .respond(call.token, 200, &[], &answer(1))
        .unwrap();
    assert_eq!(e.routers[0].stream(ctx).unwrap().resumes, 1);
}

#[test]
fn a_disaggregated_model_served_whole_is_scrubbed_and_gets_kvgates_id() {
    // Its prefill pool is down: decode workers take it whole (vLLM's can
    // compute the prompt), without the client's transfer fields.
    let mut e = Envoy::start("");
    e.publish(
        &without(Role::Prefill, pd_fleet(OnPrefillFailure::Local)),
        true,
    );
    let mut h = COMPLETIONS.to_vec();
    h.push(("x-request-id", "victim"));
    let ex = e.routers[0].request(&h, &[&prompt(3000, hostile_fields())]);
    assert!(ex.continued);
    assert!(e.routers[0].pending().is_empty(), "no prefill leg");
    assert_scrubbed(&ex.body);
    let id = ex.header("x-request-id").unwrap();
    assert!(id.starts_with("kvgate-") && id.len() == 39, "{id}");
    assert_eq!(
        ex.header("content-length"),
        Some(ex.body.len().to_string().as_str())
    );

    // SGLang: neither a decode nor a prefill worker can take a request
    // whole, so none does, whichever role is left.
    for gone in [Role::Prefill, Role::Decode] {
        let mut e = Envoy::start("");
        e.publish(&without(gone, sglang_fleet(false)), true);
        let ex = e.routers[0].request(&COMPLETIONS, &[&prompt(3000, json!({}))]);
        let reply = ex.reply.clone().expect("refused");
        assert_eq!(reply.status, 503, "{gone:?} gone");
        assert_eq!(reply.header("x-kvgate-reason"), Some("prefill_failed"));
        assert_eq!(ex.destination(), None);
        assert!(e.routers[0].pending().is_empty());
    }
}

#[test]
fn minted_request_ids_are_random_not_a_counter() {
    let mut e = Envoy::start("");
    e.publish(&pd_fleet(OnPrefillFailure::Local), true);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
        let call = only_callout(&e);
        ids.push(call.header("x-request-id").unwrap().to_string());
        e.routers[0]
            .respond(call.token, 200, &[], &answer(1))
            .unwrap();
        e.routers[0].finish(ctx);
    }
    for id in &ids {
        let hex = id.strip_prefix("kvgate-").unwrap();
        assert_eq!(hex.len(), 32, "{id}");
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    }
    // Successive ids share no leading half: nothing of a VM tag or a
    // counter to predict the next from.
    assert_ne!(ids[0][..23], ids[1][..23]);
    assert_ne!(ids[1][..23], ids[2][..23]);
}

#[test]
fn failing_open_still_scrubs_transfer_fields() {
    let mut e = Envoy::ready(r#"{"stale_after_ms": 2000}"#);
    e.shared.lock().unwrap().advance_ms(2500);
    let mut h = COMPLETIONS.to_vec();
    h.push(("x-request-id", "client"));
    let body = prompt(10, hostile_fields());
    let ex = e.routers[0].request(&h, &[&body]);
    assert!(ex.continued);
    assert_eq!(ex.header("x-kvgate-fallback"), Some("stale"));
    assert_eq!(ex.destination(), None, "not decided: Envoy balances it");
    assert_scrubbed(&ex.body);
    assert_eq!(
        ex.header("content-length"),
        Some(ex.body.len().to_string().as_str())
    );
    // A body without such fields goes on as it came.
    let plain = prompt(10, json!({}));
    let ex = e.routers[0].request(&COMPLETIONS, &[&plain]);
    assert_eq!(ex.body, plain);
    // And one past the limit is refused, as when deciding.
    let mut e = Envoy::ready(r#"{"stale_after_ms": 2000, "max_body_bytes": 64}"#);
    e.shared.lock().unwrap().advance_ms(2500);
    let ex = e.routers[0].request(&COMPLETIONS, &[&body]);
    assert_eq!(ex.reply.map(|r| r.status), Some(413));
}

#[test]
fn a_departed_clients_prefill_stays_booked_until_its_deadline() {
    let mut e = Envoy::start(r#"{"flush_ms": 10}"#);
    e.publish(&pd_fleet(OnPrefillFailure::Local), true);
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let call = only_callout(&e);
    e.shared.lock().unwrap().advance_ms(200);
    e.routers[0].finish(ctx);
    let (booked, done) = ledger(&bookings(&mut e));
    assert_eq!(booked.len(), 2);
    let prefill = booked.iter().find(|b| b.1 == 44).unwrap().0;
    let decode = booked.iter().find(|b| b.1 == 52).unwrap().0;
    assert_eq!(
        done,
        vec![decode],
        "only the decode leg ends with the client"
    );
    assert_eq!(e.counter("kvgate_prefill_orphaned_total"), 1);
    // The worker is still computing it: its answer finds no context.
    e.routers[0]
        .respond(call.token, 200, &[], &answer(1))
        .unwrap();
    assert_eq!(e.routers[0].trapped, None);
    e.shared.lock().unwrap().advance_ms(1500);
    assert!(
        ledger(&bookings(&mut e)).1.is_empty(),
        "within the deadline"
    );
    // Past the 2 s deadline from its dispatch, exactly one end.
    e.shared.lock().unwrap().advance_ms(400);
    assert_eq!(ledger(&bookings(&mut e)).1, vec![prefill]);
    e.shared.lock().unwrap().advance_ms(5000);
    assert!(ledger(&bookings(&mut e)).1.is_empty(), "ended once");
}

#[test]
fn a_decode_body_past_the_headroom_goes_local_without_another_prefill() {
    let mut e = Envoy::start("");
    e.publish(&pd_fleet(OnPrefillFailure::Local), true);
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, hostile_fields())]);
    let call = only_callout(&e);
    // An answer whose transfer parameters alone pass max_body_bytes (1 MiB
    // by default) and the 1 MiB headroom.
    let ids: Vec<u32> = (0..400_000).collect();
    let huge = json!({
        "choices": [],
        "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [ids],
            "remote_host": "10.0.0.11", "remote_port": 5600}
    })
    .to_string();
    assert!(huge.len() > kvgate_core::disagg::DECODE_HEADROOM_BYTES + (1 << 20));
    assert!(huge.len() < 4 << 20);
    e.routers[0]
        .respond(call.token, 200, &[], huge.as_bytes())
        .unwrap();
    assert_eq!(e.routers[0].trapped, None);
    assert!(e.routers[0].pending().is_empty(), "no second prefill");
    assert_eq!(e.counter("kvgate_prefill_retried_total"), 0);
    let s = e.routers[0].stream(ctx).unwrap().clone();
    assert_eq!(s.resumes, 1, "sent on to its decode worker");
    assert_scrubbed(&s.body);
    assert!(s.body.len() < 100_000);
}

#[test]
fn a_ticking_router_says_it_is_alive_once_a_second() {
    use kvgate_core::booking::{Event, decode_batch};
    let mut e = Envoy::ready("");
    let beats = |e: &mut Envoy| {
        e.routers[0].tick().unwrap();
        e.routers[0]
            .drain_queue("kvgate", "kvgate.bookings")
            .iter()
            .flat_map(|b| decode_batch(b).unwrap())
            .filter(|ev| matches!(ev, Event::Alive { .. }))
            .count()
    };
    assert_eq!(beats(&mut e), 1);
    e.shared.lock().unwrap().advance_ms(500);
    assert_eq!(beats(&mut e), 0, "not twice within the second");
    e.shared.lock().unwrap().advance_ms(600);
    assert_eq!(beats(&mut e), 1);
    // The VM's own tag: the one its bookings carry.
    e.shared.lock().unwrap().advance_ms(1000);
    let ex = e.routers[0].request(&CHAT, &[&chat("m")]);
    assert!(ex.continued);
    e.routers[0].tick().unwrap();
    let evs: Vec<Event> = e.routers[0]
        .drain_queue("kvgate", "kvgate.bookings")
        .iter()
        .flat_map(|b| decode_batch(b).unwrap())
        .collect();
    let booked_vm = evs.iter().find_map(|ev| match ev {
        Event::Book { key, .. } => Some(key.vm),
        _ => None,
    });
    let alive_vm = evs.iter().find_map(|ev| match ev {
        Event::Alive { vm } => Some(*vm),
        _ => None,
    });
    assert!(booked_vm.is_some());
    assert_eq!(booked_vm, alive_vm);
}
