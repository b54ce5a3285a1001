//! SGLang's two legs through the real filter: one body with kvgate's
//! bootstrap fields to the prefill worker (a callout) and to the decode
//! worker (the request itself, at once), the room on both chosen ranks,
//! the prefill answer drained, and every booking's release.

use super::disagg::{COMPLETIONS, bookings, json_of, ledger, only_callout, prompt};
use super::{Envoy, rank, worker};
use kvgate_core::state::{Disaggregation, OnPrefillFailure, Protocol, Role};
use kvgate_core::{ModelState, Snapshot};
use serde_json::json;

/// Prefill workers 11 (3 ranks, rank 1 idle; bootstrap port 9101) and
/// 12 (loaded; SGLang's default port), decode workers 13 (4 ranks, rank 2
/// the lightest) and 14 (loaded). `busy` makes every prefill rank busy.
pub(super) fn sglang_fleet(prefill_busy: bool) -> Snapshot {
    let prefill = |id: u64, loads: &[u64], port: u16| {
        let ranks = loads
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut r = rank(i as u32, 0, prefill_busy);
                r.active_prefill_tokens = *p;
                r.kv_total_blocks = 100_000;
                r
            })
            .collect();
        let mut w = worker(id, ranks);
        w.role = Role::Prefill;
        w.bootstrap_port = port;
        w
    };
    let decode = |id: u64, loads: &[u64]| {
        let ranks = loads
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let mut r = rank(i as u32, *d, false);
                r.kv_total_blocks = 100_000;
                r
            })
            .collect();
        let mut w = worker(id, ranks);
        w.role = Role::Decode;
        w
    };
    Snapshot {
        version: 1,
        built_at_ms: 1,
        models: vec![ModelState {
            name: "pd".into(),
            workers: vec![
                prefill(11, &[6000, 0, 6000], 9101),
                prefill(12, &[5000], 0),
                decode(13, &[60, 60, 5, 60]),
                decode(14, &[90]),
            ],
            disaggregation: Some(Disaggregation {
                protocol: Protocol::Sglang,
                on_prefill_failure: OnPrefillFailure::Local,
                prefill_timeout_ms: 2000,
                ..Disaggregation::default()
            }),
            ..Default::default()
        }],
        applied: Vec::new(),
    }
}

fn ready(prefill_busy: bool) -> Envoy {
    let mut e = Envoy::start("");
    e.publish(&sglang_fleet(prefill_busy), true);
    e
}

#[test]
fn both_legs_carry_one_body_and_the_request_goes_on_at_once() {
    let mut e = ready(false);
    let client = prompt(3000, json!({"temperature": 0.10, "x-keep": 1e2}));
    let (ex, ctx) = e.routers[0].open(
        &[
            COMPLETIONS[0],
            COMPLETIONS[1],
            COMPLETIONS[2],
            ("authorization", "Bearer k"),
            ("x-kvgate-prefill-host", "10.0.0.12:8000"),
        ],
        &[&client],
    );
    assert_eq!(ex.trapped, None);
    assert!(ex.continued, "the decode leg never waits for the prefill");
    assert_eq!(ex.resumes, 0, "it went on from its own callback");
    assert_eq!(ex.destination(), Some("10.0.0.13:8000"));
    assert_eq!(ex.header("x-data-parallel-rank"), Some("2"));

    let call = only_callout(&e);
    assert_eq!(call.cluster, "kvgate_prefill");
    assert_eq!(call.header("x-kvgate-prefill-host"), Some("10.0.0.11:8000"));
    assert_eq!(call.header("x-data-parallel-rank"), Some("1"));
    assert_eq!(call.header("authorization"), Some("Bearer k"));
    assert_eq!(call.header(":path"), Some("/v1/completions"));
    assert_eq!(
        call.header("x-request-id"),
        ex.header("x-request-id"),
        "both legs, one id"
    );
    // One body, byte for byte: the client's bytes verbatim (0.10 and 1e2
    // kept), then kvgate's three fields.
    assert_eq!(call.body, ex.body);
    assert!(ex.body.starts_with(&client[..client.len() - 1]));
    assert_eq!(
        ex.header("content-length"),
        Some(ex.body.len().to_string().as_str())
    );
    let body = json_of(&ex.body);
    assert_eq!(body["bootstrap_host"], "10.0.0.11");
    assert_eq!(body["bootstrap_port"], 9101);
    assert_eq!(body["stream"], true, "the client's own, on both legs");
    let room = body["bootstrap_room"].as_u64().unwrap();
    assert!(room < 1 << 63);
    assert_eq!(room % 3, 1, "prefill rank 1 of 3");
    assert_eq!(room % 4, 2, "decode rank 2 of 4");
    assert_eq!(e.counter("kvgate_prefill_remote_total"), 1);

    // A second request (the first's load booked) draws another room, on
    // the ranks it was placed on.
    let ex2 = e.routers[0].request(&COMPLETIONS, &[&prompt(3100, json!({}))]);
    let room2 = json_of(&ex2.body)["bootstrap_room"].as_u64().unwrap();
    assert_ne!(room, room2);
    let decode_rank: u64 = ex2.header("x-data-parallel-rank").unwrap().parse().unwrap();
    assert_eq!(room2 % 4, decode_rank);
    let pending = e.routers[0].pending();
    let call2 = pending.iter().find(|c| c.body == ex2.body).unwrap();
    if let Some(r) = call2.header("x-data-parallel-rank") {
        assert_eq!(room2 % 3, r.parse::<u64>().unwrap());
    }

    // Booked: the prompt on prefill worker 11's rank 1 (slot 45), the
    // blocks on decode worker 13's rank 2 (slot 54).
    let (booked, _) = ledger(&bookings(&mut e));
    assert!(booked.iter().any(|b| b.1 == 45 && b.2 >= 3000 && b.3 == 0));
    assert!(booked.iter().any(|b| b.1 == 54 && b.2 == 0 && b.3 > 0));
    e.routers[0].finish(ctx);
}

#[test]
fn a_clients_own_bootstrap_fields_never_pass() {
    let mut e = ready(false);
    let client = prompt(
        3000,
        json!({"bootstrap_room": 7, "bootstrap_host": "evil", "bootstrap_port": 1}),
    );
    let ex = e.routers[0].request(&COMPLETIONS, &[&client]);
    assert!(ex.continued);
    let call = only_callout(&e);
    assert_eq!(call.body, ex.body);
    let text = String::from_utf8(ex.body.clone()).unwrap();
    for f in ["bootstrap_room", "bootstrap_host", "bootstrap_port"] {
        assert_eq!(text.matches(f).count(), 1, "{text}");
    }
    let body = json_of(&ex.body);
    assert_eq!(body["bootstrap_host"], "10.0.0.11");
    assert_eq!(body["bootstrap_port"], 9101);
    assert_ne!(body["bootstrap_room"], 7);
    assert_eq!(body["prompt"].as_array().unwrap().len(), 3000);
}

#[test]
fn the_prefill_booking_ends_with_its_answer_or_the_request_whichever_first() {
    // The answer first, then the request's end.
    let mut e = ready(false);
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let call = only_callout(&e);
    let (booked, done) = ledger(&bookings(&mut e));
    assert_eq!((booked.len(), done.len()), (2, 0));
    let prefill = booked.iter().find(|b| b.1 == 45).unwrap().0;
    let decode = booked.iter().find(|b| b.1 == 54).unwrap().0;
    e.routers[0]
        .respond(call.token, 200, &[], br#"{"choices":[]}"#)
        .unwrap();
    let s = e.routers[0].stream(ctx).unwrap();
    assert_eq!((s.resumes, s.reply.is_none()), (0, true), "nothing resumed");
    let (_, done) = ledger(&bookings(&mut e));
    assert_eq!(done, vec![prefill]);
    e.routers[0].finish(ctx);
    let (_, done) = ledger(&bookings(&mut e));
    assert_eq!(done, vec![decode]);
    assert_eq!(e.counter("kvgate_prefill_failed_total"), 0);

    // The request's end first (Envoy does not cancel the callout): the
    // decode booking ends with it, the prefill's at the leg's deadline
    // (2 s); the answer finds nothing left to release.
    let mut e = ready(false);
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let call = only_callout(&e);
    e.routers[0].finish(ctx);
    let (booked, done) = ledger(&bookings(&mut e));
    let prefill = booked.iter().find(|b| b.1 == 45).unwrap().0;
    let decode = booked.iter().find(|b| b.1 == 54).unwrap().0;
    assert_eq!(done, vec![decode]);
    e.routers[0]
        .respond(call.token, 200, &[], br#"{"choices":[]}"#)
        .unwrap();
    assert_eq!(e.routers[0].trapped, None);
    assert!(bookings(&mut e).is_empty());
    e.shared.lock().unwrap().advance_ms(2500);
    assert_eq!(ledger(&bookings(&mut e)).1, vec![prefill]);
}

#[test]
fn a_failed_prefill_is_counted_and_not_retried() {
    for status in [0, 503, 500] {
        let mut e = ready(false);
        let (ex, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
        assert!(ex.continued);
        let call = only_callout(&e);
        if status == 0 {
            e.routers[0].fail(call.token).unwrap();
        } else {
            e.routers[0]
                .respond(call.token, status, &[], b"no")
                .unwrap();
        }
        assert!(e.routers[0].pending().is_empty(), "no retry after {status}");
        assert_eq!(e.counter("kvgate_prefill_failed_total"), 1);
        assert_eq!(e.counter("kvgate_prefill_retried_total"), 0);
        let s = e.routers[0].stream(ctx).unwrap();
        assert!(s.reply.is_none(), "the decode leg answers the client");
        let (booked, done) = ledger(&bookings(&mut e));
        let prefill = booked.iter().find(|b| b.1 == 45).unwrap().0;
        assert_eq!(done, vec![prefill], "the prefill booking ends");
        e.routers[0].finish(ctx);
    }
}

#[test]
fn a_prefill_host_gone_from_the_catalog_moves_to_the_runner_up_before_the_decode_leg() {
    let mut e = ready(false);
    e.routers[0]
        .state_mut()
        .unlisted_hosts
        .push("10.0.0.11:8000".into());
    let ex = e.routers[0].request(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    assert!(ex.continued);
    let call = only_callout(&e);
    assert_eq!(call.header("x-kvgate-prefill-host"), Some("10.0.0.12:8000"));
    assert_eq!(call.header("x-data-parallel-rank"), None, "one rank");
    let body = json_of(&ex.body);
    assert_eq!(call.body, ex.body);
    assert_eq!(body["bootstrap_host"], "10.0.0.12");
    assert_eq!(body["bootstrap_port"], 8998, "SGLang's default");
    assert_eq!(body["bootstrap_room"].as_u64().unwrap() % 4, 2);
    assert_eq!(e.counter("kvgate_prefill_retried_total"), 1);

    // Both gone: no decode leg without a room, a 503.
    let mut e = ready(false);
    for h in ["10.0.0.11:8000", "10.0.0.12:8000"] {
        e.routers[0].state_mut().unlisted_hosts.push(h.into());
    }
    let (ex, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let reply = ex.reply.expect("a local reply");
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-kvgate-reason"), Some("prefill_failed"));
    e.routers[0].finish(ctx);
    let (booked, mut done) = ledger(&bookings(&mut e));
    done.sort_unstable();
    let mut seqs: Vec<u64> = booked.iter().map(|b| b.0).collect();
    seqs.sort_unstable();
    assert_eq!(done, seqs, "every booking released");
}

#[test]
fn a_decode_worker_is_never_sent_a_request_whole() {
    // Every prefill worker busy: the plan prefills on the decode worker,
    // which an SGLang decode worker cannot do without a room.
    let mut e = ready(true);
    let ex = e.routers[0].request(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let reply = ex.reply.expect("a local reply");
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-kvgate-reason"), Some("prefill_failed"));
    let message = json_of(&reply.body)["error"]["message"].to_string();
    assert!(message.contains("SGLang"), "{message}");
    assert!(e.routers[0].pending().is_empty());

    // A `both` worker may take it whole, without a client's bootstrap
    // fields.
    let mut e = Envoy::start("");
    let mut snap = sglang_fleet(true);
    for w in &mut snap.models[0].workers {
        if w.id == 13 {
            w.role = Role::Both;
        }
    }
    e.publish(&snap, true);
    let ex = e.routers[0].request(&COMPLETIONS, &[&prompt(3000, json!({"bootstrap_room": 3}))]);
    assert!(ex.continued, "{:?}", ex.reply);
    assert_eq!(ex.destination(), Some("10.0.0.13:8000"));
    assert_eq!(
        ex.retry_destination(),
        None,
        "no retry on a decode worker either"
    );
    assert!(json_of(&ex.body).get("bootstrap_room").is_none());
    assert!(e.routers[0].pending().is_empty());
}
