//! A disaggregated request's two legs through the real filter: the
//! prefill callout, its answer spliced into the decode leg, the failures
//! and every booking's release (vLLM's NIXL protocol).

use super::{EPOCH, Envoy, events, rank, worker};
use kvgate_core::booking::Event;
use kvgate_core::state::{Disaggregation, OnPrefillFailure, Role};
use kvgate_core::{ModelState, Snapshot, update};
use kvgate_tests::host::Callout;
use serde_json::{Value, json};

pub(super) const COMPLETIONS: [(&str, &str); 3] = [
    (":method", "POST"),
    (":path", "/v1/completions"),
    (":authority", "gw"),
];

/// Prefill workers 11 (idle) and 12 (loaded), decode workers 13 (lightly
/// loaded) and 14: the first choice of each leg is 11 and 13.
pub(super) fn pd_fleet(on_prefill_failure: OnPrefillFailure) -> Snapshot {
    let w = |id: u64, role: Role, prefill: u64, decode: u64| {
        let mut r = rank(0, decode, false);
        r.active_prefill_tokens = prefill;
        r.kv_total_blocks = 100_000;
        let mut w = worker(id, vec![r]);
        w.role = role;
        w
    };
    Snapshot {
        version: 1,
        built_at_ms: 1,
        models: vec![ModelState {
            name: "pd".into(),
            workers: vec![
                w(11, Role::Prefill, 0, 0),
                w(12, Role::Prefill, 5000, 0),
                w(13, Role::Decode, 0, 10),
                w(14, Role::Decode, 0, 50),
            ],
            disaggregation: Some(Disaggregation {
                on_prefill_failure,
                prefill_timeout_ms: 2000,
                ..Disaggregation::default()
            }),
            ..Default::default()
        }],
        applied: Vec::new(),
    }
}

fn ready(on_prefill_failure: OnPrefillFailure) -> Envoy {
    let mut e = Envoy::start("");
    e.publish(&pd_fleet(on_prefill_failure), true);
    e
}

/// A completion of `n` prompt tokens: long enough (with nothing cached)
/// that the conditional rule sends it to a prefill worker.
pub(super) fn prompt(n: u32, extra: Value) -> Vec<u8> {
    let mut v = json!({"model": "pd", "prompt": (0..n).map(|t| 7000 + t).collect::<Vec<u32>>(), "max_tokens": 9, "stream": true});
    if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
        m.extend(x);
    }
    v.to_string().into_bytes()
}

/// A prefill answer as vLLM gives it, its transfer naming `tag`.
pub(super) fn answer(tag: u32) -> Vec<u8> {
    json!({
        "id": "cmpl-1", "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": {
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": format!("engine-{tag}"), "remote_block_ids": [[tag, tag + 1]],
            "remote_host": "10.0.0.11", "remote_port": 5600, "tp_size": 1
        }
    })
    .to_string()
    .into_bytes()
}

/// The one callout pending on router 0.
pub(super) fn only_callout(e: &Envoy) -> Callout {
    let pending = e.routers[0].pending();
    assert_eq!(pending.len(), 1, "{pending:?}");
    pending[0].clone()
}

pub(super) fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

/// Booking events router 0 sent since the last drain.
pub(super) fn bookings(e: &mut Envoy) -> Vec<Event> {
    e.routers[0].tick().unwrap();
    events(&e.routers[0].drain_queue("kvgate", "kvgate.bookings"))
}

/// A booking: its sequence, slot, prefill tokens and decode blocks.
pub(super) type Booked = (u64, u16, u32, u32);

/// The bookings made, and the sequences released.
pub(super) fn ledger(events: &[Event]) -> (Vec<Booked>, Vec<u64>) {
    let mut booked = Vec::new();
    let mut done = Vec::new();
    for ev in events {
        match ev {
            Event::Book {
                key,
                slot,
                prefill_tokens,
                decode_blocks,
                ..
            } => booked.push((key.seq, *slot, *prefill_tokens, *decode_blocks)),
            Event::Done { key, .. } => done.push(key.seq),
            _ => {}
        }
    }
    (booked, done)
}

#[test]
fn the_prefill_answer_is_spliced_into_the_clients_bytes_for_the_decode_worker() {
    let mut e = ready(OnPrefillFailure::Local);
    let client = prompt(3000, json!({"temperature": 0.10, "x-keep": 1e2}));
    let (ex, ctx) = e.routers[0].open(
        &[
            COMPLETIONS[0],
            COMPLETIONS[1],
            COMPLETIONS[2],
            ("x-request-id", "client-chosen"),
            ("authorization", "Bearer k"),
            // A client naming a prefill host steers nothing.
            ("x-kvgate-prefill-host", "10.0.0.12:8000"),
        ],
        &[&client],
    );
    assert!(!ex.continued, "the request waits for its prefill leg");
    assert_eq!(ex.trapped, None);
    let call = only_callout(&e);
    assert_eq!(call.cluster, "kvgate_prefill");
    assert_eq!(call.header("x-kvgate-prefill-host"), Some("10.0.0.11:8000"));
    assert_eq!(call.header(":path"), Some("/v1/completions"));
    assert_eq!(call.header("authorization"), Some("Bearer k"));
    let id = call.header("x-request-id").unwrap().to_string();
    assert!(id.starts_with("kvgate-"), "kvgate mints the id: {id}");
    assert!(call.timeout_ms <= 2000 && call.timeout_ms > 1000);
    let leg = json_of(&call.body);
    assert_eq!(leg["stream"], false);
    assert_eq!(leg["max_tokens"], 1);
    assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(leg["prompt"].as_array().unwrap().len(), 3000);

    e.routers[0]
        .respond(
            call.token,
            200,
            &[("content-type", "application/json")],
            &answer(40),
        )
        .unwrap();
    let s = e.routers[0].stream(ctx).unwrap().clone();
    assert_eq!(s.resumes, 1, "resumed once, on the answer");
    assert_eq!(
        s.header("x-gateway-destination-endpoint")
            .map(|d| d.split(',').next().unwrap()),
        Some("10.0.0.13:8000")
    );
    assert_eq!(
        s.header("x-request-id"),
        Some(id.as_str()),
        "both legs, one id"
    );
    assert_eq!(
        s.header("content-length"),
        Some(s.body.len().to_string().as_str())
    );
    // The client's bytes, verbatim (0.10 and 1e2 are not rewritten), with
    // the prefill's parameters spliced in before the closing brace.
    let head = &client[..client.len() - 1];
    assert!(s.body.starts_with(head));
    let decode = json_of(&s.body);
    assert_eq!(decode["stream"], true);
    assert_eq!(decode["max_tokens"], 9);
    assert_eq!(
        decode["kv_transfer_params"],
        json_of(&answer(40))["kv_transfer_params"]
    );
    assert_eq!(e.counter("kvgate_prefill_remote_total"), 1);

    // The prefill booking ended with its answer; the decode one with the
    // stream.
    let (booked, done) = ledger(&bookings(&mut e));
    assert_eq!(booked.len(), 2, "{booked:?}");
    let prefill = booked
        .iter()
        .find(|b| b.1 == 44)
        .expect("prefill booked on worker 11");
    let decode = booked
        .iter()
        .find(|b| b.1 == 52)
        .expect("decode booked on worker 13");
    assert!(
        prefill.2 >= 3000 && prefill.3 == 0,
        "prompt on the prefill worker: {prefill:?}"
    );
    assert!(
        decode.2 == 0 && decode.3 > 0,
        "blocks on the decode worker: {decode:?}"
    );
    assert_eq!(done, vec![prefill.0]);
    e.routers[0].finish(ctx);
    let (_, done) = ledger(&bookings(&mut e));
    assert_eq!(done, vec![decode.0]);
}

#[test]
fn two_paused_requests_answered_out_of_order_each_get_their_own_transfer() {
    let mut e = ready(OnPrefillFailure::Local);
    let (_, a) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let (_, b) = e.routers[0].open(&COMPLETIONS, &[&prompt(3100, json!({}))]);
    let pending = e.routers[0].pending();
    assert_eq!(pending.len(), 2);
    let call_of = |ctx: i32| pending.iter().find(|c| c.context == ctx).unwrap().clone();
    let (ca, cb) = (call_of(a), call_of(b));
    assert_ne!(ca.header("x-request-id"), cb.header("x-request-id"));
    e.routers[0]
        .respond(cb.token, 200, &[], &answer(2))
        .unwrap();
    e.routers[0]
        .respond(ca.token, 200, &[], &answer(1))
        .unwrap();
    for (ctx, tag, call) in [(a, 1, &ca), (b, 2, &cb)] {
        let s = e.routers[0].stream(ctx).unwrap();
        assert_eq!(s.resumes, 1);
        let body = json_of(&s.body);
        assert_eq!(
            body["kv_transfer_params"]["remote_block_ids"],
            json!([[tag, tag + 1]])
        );
        assert_eq!(s.header("x-request-id"), call.header("x-request-id"));
    }
}

#[test]
fn a_client_gone_during_the_prefill_leg_sends_no_decode_and_every_booking_ends() {
    let mut e = ready(OnPrefillFailure::Local);
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let call = only_callout(&e);
    e.routers[0].finish(ctx);
    // The prefill leg's booking lasts until its deadline (2 s).
    e.shared.lock().unwrap().advance_ms(2500);
    let (booked, mut done) = ledger(&bookings(&mut e));
    done.sort_unstable();
    let mut seqs: Vec<u64> = booked.iter().map(|b| b.0).collect();
    seqs.sort_unstable();
    assert_eq!((booked.len(), done), (2, seqs), "both released at the end");
    // Envoy does not cancel the callout: its answer comes for a context
    // that is gone, and changes nothing.
    e.routers[0]
        .respond(call.token, 200, &[], &answer(1))
        .unwrap();
    assert_eq!(e.routers[0].trapped, None);
    assert!(bookings(&mut e).is_empty());
}

#[test]
fn a_failed_leg_is_tried_once_on_the_runner_up() {
    // A reset, a 5xx, overload, an answer without a transfer: all fail
    // the leg, and the runner-up (worker 12) gets it.
    let failures: [(u16, Vec<u8>); 5] = [
        (0, Vec::new()),
        (503, b"upstream connect error".to_vec()),
        (429, b"{}".to_vec()),
        (408, b"{}".to_vec()),
        (200, br#"{"choices":[],"kv_transfer_params":null}"#.to_vec()),
    ];
    for (status, body) in failures {
        let mut e = ready(OnPrefillFailure::Fail);
        let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
        let first = only_callout(&e);
        if status == 0 {
            e.routers[0].fail(first.token).unwrap();
        } else {
            e.routers[0]
                .respond(first.token, status, &[], &body)
                .unwrap();
        }
        let second = only_callout(&e);
        assert_eq!(
            second.header("x-kvgate-prefill-host"),
            Some("10.0.0.12:8000"),
            "after {status}"
        );
        assert_eq!(second.header("x-request-id"), first.header("x-request-id"));
        assert!(
            second.timeout_ms <= first.timeout_ms,
            "one budget for both tries"
        );
        e.routers[0]
            .respond(second.token, 200, &[], &answer(3))
            .unwrap();
        let s = e.routers[0].stream(ctx).unwrap();
        assert_eq!(s.resumes, 1);
        assert_eq!(
            json_of(&s.body)["kv_transfer_params"]["remote_block_ids"],
            json!([[3, 4]])
        );
        assert_eq!(e.counter("kvgate_prefill_retried_total"), 1);
        e.routers[0].finish(ctx);
        let (booked, mut done) = ledger(&bookings(&mut e));
        done.sort_unstable();
        let mut seqs: Vec<u64> = booked.iter().map(|b| b.0).collect();
        seqs.sort_unstable();
        assert_eq!(
            booked.len(),
            3,
            "decode, first and second prefill: {booked:?}"
        );
        assert_eq!(done, seqs, "every booking released");
    }
}

#[test]
fn when_every_try_fails_the_model_says_local_or_fail() {
    // `local`: the decode worker gets the client's body, without the
    // client's own transfer parameters, and books the prompt too.
    let mut e = ready(OnPrefillFailure::Local);
    let client = prompt(
        3000,
        json!({"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "evil", "remote_port": 1}}),
    );
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&client]);
    let leg = json_of(&only_callout(&e).body);
    assert_eq!(
        leg["kv_transfer_params"]["do_remote_decode"], true,
        "never the client's"
    );
    e.routers[0].fail(only_callout(&e).token).unwrap();
    e.routers[0]
        .respond(only_callout(&e).token, 500, &[], b"oops")
        .unwrap();
    let s = e.routers[0].stream(ctx).unwrap().clone();
    assert_eq!(s.resumes, 1);
    let body = json_of(&s.body);
    assert!(body.get("kv_transfer_params").is_none(), "{body}");
    assert_eq!(body["prompt"].as_array().unwrap().len(), 3000);
    assert_eq!(
        s.header("content-length"),
        Some(s.body.len().to_string().as_str())
    );
    assert_eq!(e.counter("kvgate_prefill_failed_total"), 1);
    let (booked, _) = ledger(&bookings(&mut e));
    let rebooked = booked.last().unwrap();
    assert_eq!(rebooked.1, 52, "the decode worker");
    assert!(
        rebooked.2 >= 3000 && rebooked.3 > 0,
        "prompt and blocks: {rebooked:?}"
    );
    e.routers[0].finish(ctx);
    let (_, done) = ledger(&bookings(&mut e));
    assert_eq!(done, vec![rebooked.0]);

    // `fail`: a 503 naming the cause, and nothing left booked.
    let mut e = ready(OnPrefillFailure::Fail);
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    e.routers[0]
        .respond(only_callout(&e).token, 504, &[], b"timeout")
        .unwrap();
    e.routers[0]
        .respond(only_callout(&e).token, 502, &[], b"bad")
        .unwrap();
    let s = e.routers[0].stream(ctx).unwrap().clone();
    let reply = s.reply.expect("a local reply");
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-kvgate-reason"), Some("prefill_failed"));
    assert_eq!(json_of(&reply.body)["error"]["code"], 503);
    assert_eq!(s.resumes, 0, "no decode leg");
    assert_eq!(e.counter("kvgate_rejected_prefill_failed_total"), 1);
    e.routers[0].finish(ctx);
    let (booked, mut done) = ledger(&bookings(&mut e));
    done.sort_unstable();
    let mut seqs: Vec<u64> = booked.iter().map(|b| b.0).collect();
    seqs.sort_unstable();
    assert_eq!(done, seqs);
}

#[test]
fn a_client_error_from_the_prefill_worker_goes_back_to_the_client() {
    let mut e = ready(OnPrefillFailure::Local);
    let (_, ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    let refusal =
        br#"{"error":{"message":"max_tokens is too large","type":"BadRequestError","code":400}}"#;
    e.routers[0]
        .respond(
            only_callout(&e).token,
            400,
            &[("content-type", "application/json")],
            refusal,
        )
        .unwrap();
    let s = e.routers[0].stream(ctx).unwrap().clone();
    let reply = s.reply.expect("relayed");
    assert_eq!((reply.status, reply.body.as_slice()), (400, &refusal[..]));
    assert_eq!(s.resumes, 0);
    assert!(
        e.routers[0].pending().is_empty(),
        "no retry for the client's error"
    );
    assert_eq!(e.counter("kvgate_prefill_client_errors_total"), 1);
}

#[test]
fn a_prefill_host_gone_from_the_catalog_fails_the_try_at_once() {
    let mut e = ready(OnPrefillFailure::Local);
    e.routers[0]
        .state_mut()
        .unlisted_hosts
        .push("10.0.0.11:8000".into());
    let (ex, _ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    assert!(!ex.continued);
    assert_eq!(
        only_callout(&e).header("x-kvgate-prefill-host"),
        Some("10.0.0.12:8000"),
        "the runner-up, with no answer awaited from the first"
    );
    // Both gone: the decode worker prefills, within the body callback.
    let mut e = ready(OnPrefillFailure::Local);
    for h in ["10.0.0.11:8000", "10.0.0.12:8000"] {
        e.routers[0].state_mut().unlisted_hosts.push(h.into());
    }
    let (ex, _ctx) = e.routers[0].open(&COMPLETIONS, &[&prompt(3000, json!({}))]);
    assert!(ex.continued, "{:?}", ex.reply);
    assert_eq!(ex.resumes, 0, "it went on from its own callback");
    assert!(e.routers[0].pending().is_empty());
}

#[test]
fn a_prompt_mostly_cached_on_the_decode_worker_skips_the_prefill_leg() {
    use kvgate_core::hash::{XXH3_SEED, block_hashes, sequence_hashes};
    use kvgate_core::shard::{Holder, TIER_DEVICE, encode, shard_of};
    let mut e = Envoy::start("");
    let mut snap = pd_fleet(OnPrefillFailure::Local);
    snap.models[0].shard_count = 4;
    // Worker 13 (slot 52) holds the first 2,400 of 3,000 tokens: 600
    // uncached, under 2048 and under 70 %.
    let tokens: Vec<u32> = (0..3000).map(|t| 7000 + t).collect();
    let held = sequence_hashes(&block_hashes(&tokens[..2400], 16, XXH3_SEED));
    let mut per_shard: std::collections::BTreeMap<u32, Vec<(u64, Vec<Holder>)>> =
        Default::default();
    for h in held {
        per_shard.entry(shard_of(h, 4)).or_default().push((
            h,
            vec![Holder {
                slot: 52,
                tiers: TIER_DEVICE,
            }],
        ));
    }
    let shards: Vec<(u32, Vec<u8>)> = per_shard
        .into_iter()
        .map(|(s, mut v)| (s, encode(&mut v)))
        .collect();
    let bytes = snap.encode().unwrap();
    let frame = update::encode(
        1,
        EPOCH,
        true,
        Some(&bytes),
        shards.iter().map(|(s, b)| ("pd", *s, b.as_slice())),
    );
    let c = e.service.pending().pop().unwrap();
    e.service.respond(c.token, 200, &[], &frame).unwrap();

    let client = prompt(
        3000,
        json!({"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "evil"}}),
    );
    let ex = e.routers[0].request(&COMPLETIONS, &[&client]);
    assert!(ex.continued, "{:?}", ex.reply);
    assert!(e.routers[0].pending().is_empty(), "no prefill leg");
    assert_eq!(ex.destination(), Some("10.0.0.13:8000"));
    let body = json_of(&ex.body);
    assert!(
        body.get("kv_transfer_params").is_none(),
        "a client's transfer parameters never reach a worker: {body}"
    );
    assert_eq!(e.counter("kvgate_prefill_local_total"), 1);
    assert_eq!(e.counter("kvgate_prefill_remote_total"), 0);
}
