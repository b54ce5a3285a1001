//! Disaggregated prefill and decode on real Envoy: two prefill and two
//! decode simulated vLLM workers speaking NIXL's protocol (a real side
//! channel between them), the filter making the prefill callout from the
//! request's own context; and the same fleet speaking SGLang's (both legs
//! at once, paired in a bootstrap room). A stack per protocol, and one for
//! a model that fails rather than prefill on a decode worker, so the suite
//! fits CI.

mod common;

use common::*;
use kvgate_stack::{Stack, StackConfig};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Workers 1 and 2 prefill, 3 and 4 decode; decode workers publish the
/// blocks they receive, so the conditional rule can see them.
fn pd_stack() -> Stack {
    start(StackConfig {
        kv_events: true,
        ..pd_config(
            &["--kv-role", "kv_producer", "--kv-side-channel-port", "0"],
            &["--kv-role", "kv_consumer", "--kv-side-channel-port", "0"],
            "[models.disaggregation]\nprotocol = \"vllm-nixl\"\non_prefill_failure = \"local\"\nprefill_timeout_ms = 5000\n".into(),
        )
    })
}

/// The sum of a sidecar metric's series that carry every one of `labels`.
fn summed(stack: &Stack, name: &str, labels: &[&str]) -> f64 {
    let (status, body) = kvgate_stack::http::get(&stack.sidecar_addr(), "/metrics").unwrap();
    assert_eq!(status, 200);
    String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{'))
                && labels.iter().all(|x| l.contains(x))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn completion_body(prompt: &[u32], stream: bool) -> Vec<u8> {
    json!({"model": "demo-model", "prompt": prompt, "max_tokens": 4, "stream": stream})
        .to_string()
        .into_bytes()
}

#[test]
fn prefill_then_decode_through_envoy() {
    let _g = serial();
    let mut stack = pd_stack();
    wait_workers(&stack, 4);

    // A long prompt, nothing cached: the prefill leg runs on a prefill
    // worker, its transfer reaches the decode worker the plan named.
    let prompt = unique_prompt(1, 3000);
    // A client cannot choose where either leg goes: a listener it names
    // in the prefill cluster's header, or the routed cluster's, hears
    // nothing.
    let canary = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    canary.set_nonblocking(true).unwrap();
    let canary_addr = canary.local_addr().unwrap().to_string();
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&prompt, false),
        &[
            ("x-request-id", "client-chosen-id"),
            ("x-kvgate-prefill-host", &canary_addr),
            ("x-gateway-destination-endpoint", &canary_addr),
        ],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        matches!(canary.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a client header made Envoy connect outside the catalog"
    );
    let decode = decode_worker(&r);
    assert_eq!(prefill_legs(&stack), 1);
    let prefill = if sim_counter(&stack, 0, "prefill_legs") == 1 {
        0
    } else {
        1
    };
    let leg = last_seen(&stack, prefill);
    assert_eq!(leg["leg"], "prefill");
    let id = leg["request_id"].as_str().unwrap().to_string();
    assert!(
        id.starts_with("kvgate-"),
        "kvgate's id, not the client's: {id}"
    );
    let got = last_seen(&stack, decode);
    assert_eq!(got["leg"], "decode");
    assert_eq!(got["request_id"], id.as_str(), "one id on both legs");
    let params = &got["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true);
    let engines = sim_disagg(&stack, prefill)["engine_ids"].clone();
    assert!(
        engines
            .as_array()
            .unwrap()
            .contains(&params["remote_engine_id"]),
        "the transfer names the prefill worker's engine: {params} vs {engines}"
    );
    assert!(got["pulled_blocks"].as_u64().unwrap() >= 180, "{got}");
    assert_eq!(
        sim_counter(&stack, 2, "prefill_legs") + sim_counter(&stack, 3, "prefill_legs"),
        0
    );

    // Each leg is timed from its own dispatch, by structure: the prefill
    // leg from its callout to its answer, so at least what the prefill
    // worker says it computed; the decode leg's first byte from its own
    // dispatch, after the transfer; the client's first byte from the
    // decision, which spans the prefill leg and the decode leg's wait.
    let model = r#"model="demo-model""#;
    let deadline = Instant::now() + Duration::from_secs(10);
    while summed(&stack, "kvgate_sidecar_client_ttft_seconds_count", &[model]) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the legs' timed ends never reached the sidecar"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let prefill = [model, r#"role="prefill""#, r#"leg="prefill""#];
    let decode = [model, r#"role="decode""#, r#"leg="decode""#];
    let prefill_s = summed(&stack, "kvgate_sidecar_leg_seconds_sum", &prefill);
    let decode_first_s = summed(&stack, "kvgate_sidecar_leg_first_byte_seconds_sum", &decode);
    let client_s = summed(&stack, "kvgate_sidecar_client_ttft_seconds_sum", &[model]);
    let computed_s = leg["took_us"].as_f64().unwrap() / 1e6;
    assert!(
        prefill_s >= computed_s && computed_s > 0.0,
        "the prefill leg took {prefill_s} s, its worker computed for {computed_s} s"
    );
    assert!(
        decode_first_s > 0.0 && client_s >= prefill_s + decode_first_s - 1e-6,
        "the client waited {client_s} s: the prefill leg {prefill_s} s, the decode leg's first byte {decode_first_s} s"
    );
    assert_eq!(
        summed(
            &stack,
            "kvgate_sidecar_leg_seconds_count",
            &[model, r#"leg="whole""#]
        ),
        0.0,
        "a split request is no whole leg"
    );

    // Streaming, as a chat: the decode leg streams, the prefill leg never.
    let chat = json!({"model": "demo-model", "stream": true, "max_tokens": 3,
        "messages": [{"role": "user", "content": "word ".repeat(3000)}]});
    let r = post(
        &stack,
        "/v1/chat/completions",
        chat.to_string().as_bytes(),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("data: [DONE]"), "{}", r.text());
    assert_eq!(prefill_legs(&stack), 2);
    assert_eq!(last_seen(&stack, decode_worker(&r))["leg"], "decode");

    // The same prompt again: its decode worker holds it now (it published
    // the blocks it received), so the conditional rule skips the leg.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = post(
            &stack,
            "/v1/completions",
            &completion_body(&prompt, false),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        if last_seen(&stack, decode_worker(&r))["leg"] == "local" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a cached prompt still took the prefill leg"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(stack.envoy_stat("kvgate_prefill_local_total").unwrap() >= 1);

    // A prefill worker gone: its leg fails and the runner-up serves it.
    stack.kill_worker(0);
    let before = sim_counter(&stack, 1, "prefill_legs");
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&unique_prompt(2, 3000), true),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_seen(&stack, decode_worker(&r))["leg"], "decode");
    assert!(sim_counter(&stack, 1, "prefill_legs") > before);

    // Both gone: the decode worker prefills the prompt itself.
    stack.kill_worker(1);
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&unique_prompt(3, 3000), false),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = last_seen(&stack, decode_worker(&r));
    assert_eq!(seen["leg"], "local", "{seen}");
    assert_eq!(seen["kv_transfer_params"], Value::Null);

    wait_bookings_drained(&stack);
}

/// A fleet whose model fails rather than prefill on a decode worker, with
/// prefill workers too slow for its prefill timeout on long prompts and
/// too small for the longest.
fn failing_stack() -> Stack {
    start(pd_config(
        &[
            "--kv-role",
            "kv_producer",
            "--kv-side-channel-port",
            "0",
            "--num-gpu-blocks",
            "300",
            "--prefill-us-per-token",
            "2000",
        ],
        &["--kv-role", "kv_consumer", "--kv-side-channel-port", "0"],
        "[models.disaggregation]\nprotocol = \"vllm-nixl\"\non_prefill_failure = \"fail\"\nprefill_timeout_ms = 150\n".into(),
    ))
}

#[test]
fn prefill_failures_through_envoy() {
    let _g = serial();
    let stack = failing_stack();
    wait_workers(&stack, 4);

    // Short enough for the timeout: served through both legs.
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&unique_prompt(10, 40), false),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_seen(&stack, decode_worker(&r))["leg"], "decode");

    // Too long for a prefill worker's cache: its 400 is the client's
    // answer, and no decode leg is sent.
    let decode_legs =
        || sim_counter(&stack, 2, "decode_legs") + sim_counter(&stack, 3, "decode_legs");
    let before = decode_legs();
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&unique_prompt(11, 6000), false),
        &[],
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), None, "the worker's own answer");
    assert_eq!(decode_legs(), before);

    // Too slow for the prefill timeout (3,000 tokens at 2 ms a token, sped
    // up 20×, is 300 ms against 150): the first try spends the one budget
    // both tries share, so no second try, and the 503 the model asks for.
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&unique_prompt(12, 3000), false),
        &[],
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("prefill_failed"));
    assert_eq!(decode_legs(), before);
    assert_eq!(stack.envoy_stat("kvgate_prefill_retried_total").unwrap(), 0);
    assert_eq!(stack.envoy_stat("kvgate_prefill_failed_total").unwrap(), 1);
    assert_eq!(
        stack
            .envoy_stat("kvgate_rejected_prefill_failed_total")
            .unwrap(),
        1
    );

    wait_bookings_drained(&stack);
}

/// Workers 1 and 2 prefill, 3 and 4 decode, speaking SGLang's protocol
/// with two DP ranks each; the prefill workers' bootstrap ports are
/// allocated by the stack and named in the catalog.
fn sglang_stack() -> Stack {
    start(StackConfig {
        dp_size: 2,
        bootstrap_ports: true,
        ..pd_config(
            &["--kv-role", "kv_producer", "--pd-protocol", "sglang"],
            &["--kv-role", "kv_consumer", "--pd-protocol", "sglang"],
            "[models.disaggregation]\nprotocol = \"sglang\"\non_prefill_failure = \"fail\"\nprefill_timeout_ms = 10000\n".into(),
        )
    })
}

/// The prefill leg some prefill worker recorded in `room`.
fn prefill_in_room(stack: &Stack, room: u64) -> Option<Value> {
    (0..2).find_map(|w| {
        sim_disagg(stack, w)["recent"]
            .as_array()?
            .iter()
            .find(|r| r["leg"] == "prefill" && r["bootstrap_room"] == room)
            .cloned()
    })
}

/// Checks that a reply's decode leg met a prefill leg in its room: both
/// served, neither failed. Returns the room.
fn paired(stack: &Stack, r: &Reply) -> u64 {
    let decode = last_seen(stack, decode_worker(r));
    assert_eq!(decode["leg"], "decode", "{decode}");
    assert_eq!(decode["status"], 200, "{decode}");
    assert_eq!(decode["error"], Value::Null, "{decode}");
    let room = decode["bootstrap_room"].as_u64().expect("a room");
    assert!(room < 1 << 63);
    // The prefill's answer is drained after the decode worker answered:
    // wait for its record.
    let deadline = Instant::now() + Duration::from_secs(10);
    let prefill = loop {
        if let Some(p) = prefill_in_room(stack, room) {
            break p;
        }
        assert!(Instant::now() < deadline, "no prefill leg in room {room}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(prefill["status"], 200, "{prefill}");
    assert_eq!(prefill["error"], Value::Null, "{prefill}");
    assert_eq!(prefill["request_id"], decode["request_id"], "one id");
    assert_eq!(prefill["rank"], room % 2, "the rank SGLang derives");
    assert_eq!(decode["rank"], room % 2);
    room
}

#[test]
fn sglang_legs_meet_in_one_room_through_envoy() {
    let _g = serial();
    let stack = sglang_stack();
    wait_workers(&stack, 4);

    // A long prompt: both legs at once, the decode worker's answer to the
    // client, the two paired in kvgate's room. A client's own room never
    // reaches a worker.
    let body = json!({"model": "demo-model", "prompt": unique_prompt(11, 3000),
        "max_tokens": 4, "bootstrap_room": 5, "bootstrap_host": "127.0.0.9"});
    let r = post(&stack, "/v1/completions", body.to_string().as_bytes(), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let room = paired(&stack, &r);
    assert_ne!(room, 5, "kvgate's room, not the client's");

    // Streaming, as a chat.
    let chat = json!({"model": "demo-model", "stream": true, "max_tokens": 3,
        "messages": [{"role": "user", "content": "word ".repeat(3000)}]});
    let r = post(
        &stack,
        "/v1/chat/completions",
        chat.to_string().as_bytes(),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("data: [DONE]"), "{}", r.text());
    assert_ne!(paired(&stack, &r), room);

    // A few more, streaming and not: every one paired, rooms distinct.
    let mut rooms = std::collections::HashSet::from([room]);
    for i in 0..4u32 {
        let r = post(
            &stack,
            "/v1/completions",
            &completion_body(&unique_prompt(20 + i, 2500), i % 2 == 0),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(rooms.insert(paired(&stack, &r)));
    }
    assert_eq!(
        sim_counter(&stack, 2, "prefill_legs") + sim_counter(&stack, 3, "prefill_legs"),
        0,
        "decode workers never prefill"
    );
    assert!(stack.envoy_stat("kvgate_prefill_remote_total").unwrap() >= 6);
    assert_eq!(
        stack.envoy_stat("kvgate_prefill_failed_total").unwrap_or(0),
        0
    );

    wait_bookings_drained(&stack);
}
