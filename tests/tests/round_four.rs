//! Round four's holes, closed, on real Envoy: a request whose body ends
//! with HTTP/2 trailers is decided at them; a prefill answer that brings
//! its headers and never its body is survived (the router's VM lives on);
//! a disaggregated model whose prefill pool is down is served whole with
//! none of the client's transfer fields (vLLM), or refused (SGLang);
//! fail-open requests are scrubbed of transfer fields too; and a client
//! that hangs up during a prefill leg leaves the leg's booking on the
//! prefill worker until the leg's deadline. Three stacks in all: NIXL
//! workers whose prefill legs stall after their headers (the model
//! prefilling locally, then failing), and SGLang workers.

mod common;

use common::*;
use http_body_util::{BodyExt, Full};
use kvgate_stack::{Stack, StackConfig};
use serde_json::{Value, json};
use std::io::Write as _;
use std::time::{Duration, Instant};

/// Workers 1 and 2 prefill but stall every prefill leg after its headers
/// (`--prefill-stall-after-headers`), 3 and 4 decode.
fn stalling_stack(on_prefill_failure: &str, prefill_timeout_ms: u64) -> Stack {
    start(pd_config(
        &[
            "--kv-role",
            "kv_producer",
            "--kv-side-channel-port",
            "0",
            "--prefill-stall-after-headers",
        ],
        &["--kv-role", "kv_consumer", "--kv-side-channel-port", "0"],
        format!(
            "[models.disaggregation]\nprotocol = \"vllm-nixl\"\non_prefill_failure = \"{on_prefill_failure}\"\nprefill_timeout_ms = {prefill_timeout_ms}\n"
        ),
    ))
}

/// Workers 1 and 2 prefill, 3 and 4 decode, speaking SGLang's protocol.
fn sglang_stack() -> Stack {
    start(StackConfig {
        bootstrap_ports: true,
        // Even a model that would prefill on the decode worker: an SGLang
        // decode worker cannot.
        ..pd_config(
            &["--kv-role", "kv_producer", "--pd-protocol", "sglang"],
            &["--kv-role", "kv_consumer", "--pd-protocol", "sglang"],
            "[models.disaggregation]\nprotocol = \"sglang\"\non_prefill_failure = \"local\"\nprefill_timeout_ms = 5000\n".into(),
        )
    })
}

/// A client's transfer parameters naming a host of its choice.
fn evil_params() -> Value {
    json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "evil-engine", "remote_block_ids": [1, 2, 3],
        "remote_host": "evil", "remote_port": 5600, "remote_request_id": "victim"})
}

/// A long completion (no decode worker holds it: the prefill leg is
/// taken) carrying the client's own transfer parameters and request id.
fn hostile_body(tag: u32) -> Vec<u8> {
    json!({"model": "demo-model", "prompt": unique_prompt(tag, 3000), "max_tokens": 4,
        "kv_transfer_params": evil_params(), "request_id": "client-chosen"})
    .to_string()
    .into_bytes()
}

fn completion_body(prompt: &[u32]) -> Vec<u8> {
    json!({"model": "demo-model", "prompt": prompt, "max_tokens": 4})
        .to_string()
        .into_bytes()
}

/// Checks that no running worker ever saw the client's transfer
/// parameters (`remote_host` "evil"), nor, in any leg, the client's
/// `request_id` field.
fn no_worker_saw_the_clients_fields(stack: &Stack, workers: &[usize]) {
    for &w in workers {
        for seen in recent(stack, w) {
            assert_ne!(
                seen["kv_transfer_params"]["remote_host"],
                "evil",
                "worker {} got the client's kv_transfer_params: {seen}",
                w + 1
            );
            let keys = seen["body_keys"].as_array().cloned().unwrap_or_default();
            assert!(
                !keys.contains(&json!("request_id")),
                "worker {} got the client's request_id field: {seen}",
                w + 1
            );
        }
    }
}

/// Asserts that Envoy's log shows no wasm panic: a VM that panics is dead
/// for every later request on its thread.
fn no_panic_in_envoy_log(stack: &Stack) {
    let log = std::fs::read_to_string(stack.run_dir.join("envoy.log")).unwrap_or_default();
    let panics: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("panicked") || l.contains("wasm trap"))
        .collect();
    assert!(
        panics.is_empty(),
        "the filter panicked:\n{}",
        panics.join("\n")
    );
}

/// POSTs `body` over HTTP/2 with prior knowledge (h2c), the body followed
/// by a trailers frame: the request ends with the trailers, not with its
/// last data frame.
fn h2c_post_with_trailers(
    addr: &str,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> Reply {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .expect("Envoy's listener takes HTTP/2 with prior knowledge");
        tokio::spawn(conn);
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("x-client-trailer", "end".parse().unwrap());
        let body = Full::new(bytes::Bytes::from(body))
            .with_trailers(std::future::ready(Some(Ok(trailers))));
        let mut req = hyper::Request::builder()
            .method("POST")
            .uri(format!("http://{addr}{path}"))
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = sender.send_request(req.body(body).unwrap()).await.unwrap();
        assert_eq!(resp.version(), hyper::Version::HTTP_2);
        let status = resp.status().as_u16();
        let headers = resp
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let body = resp
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec();
        Reply {
            status,
            headers,
            body,
        }
    })
}

#[test]
fn stalled_prefill_legs_trailers_a_down_prefill_pool_and_fail_open() {
    let _g = serial();
    let mut stack = stalling_stack("local", 300);
    wait_workers(&stack, 4);

    // A prefill leg answered with headers and no body: Envoy ends the
    // callout at the prefill timeout with no response headers for the
    // filter. The decode worker computes the prompt itself.
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&unique_prompt(1, 3000)),
        &[],
    );
    assert_eq!(r.status, 200, "{}\n{}", r.text(), stack.log_tails());
    let seen = last_seen(&stack, decode_worker(&r));
    assert_eq!(seen["leg"], "local", "{seen}");
    assert_eq!(seen["kv_transfer_params"], Value::Null, "{seen}");
    assert!(prefill_legs(&stack) >= 1);
    assert!(stack.envoy_stat("kvgate_prefill_failed_total").unwrap() >= 1);

    // The router's VMs live on: before the fix the one that took that
    // answer panicked, and every later request on its thread failed.
    // Twenty more, all at once (each waits out a stalled prefill leg),
    // reach both of Envoy's worker threads.
    let addr = stack.envoy_addr();
    let sent: Vec<_> = (0..20u32)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || completion(&addr, &unique_prompt(100 + i, 3000), 4))
        })
        .collect();
    for s in sent {
        let r = s.join().unwrap().expect("a request after the stall");
        assert_eq!(r.status, 200, "{}", r.text());
        decode_worker(&r);
    }
    no_panic_in_envoy_log(&stack);
    wait_bookings_drained(&stack);

    // HTTP/2 with trailers: decided at the trailers (before, Envoy sent
    // it on undecided, with the client's transfer parameters, to any
    // worker).
    let routed = stack.envoy_stat("kvgate_routed_total").unwrap();
    let r = h2c_post_with_trailers(
        &addr,
        "/v1/completions",
        hostile_body(2),
        &[("x-request-id", "client-chosen-id")],
    );
    assert_eq!(r.status, 200, "{}\n{}", r.text(), stack.log_tails());
    assert_eq!(
        stack
            .envoy_stat("kvgate_requests_with_trailers_total")
            .unwrap(),
        1
    );
    assert!(stack.envoy_stat("kvgate_routed_total").unwrap() > routed);
    let seen = last_seen(&stack, decode_worker(&r));
    assert_eq!(seen["leg"], "local", "{seen}");
    assert_eq!(seen["kv_transfer_params"], Value::Null, "{seen}");
    let id = seen["request_id"].as_str().unwrap_or_default();
    assert!(
        id.starts_with("kvgate-"),
        "kvgate's id, not the client's: {id}"
    );
    no_worker_saw_the_clients_fields(&stack, &[0, 1, 2, 3]);

    // The prefill pool down: the model is still disaggregated, so the
    // decode worker gets the request whole, without the client's
    // transfer parameters or request id, under kvgate's id.
    stack.kill_worker(0);
    stack.kill_worker(1);
    wait_workers(&stack, 2);
    let r = post(
        &stack,
        "/v1/completions",
        &hostile_body(3),
        &[("x-request-id", "client-chosen-id")],
    );
    assert_eq!(r.status, 200, "{}\n{}", r.text(), stack.log_tails());
    let seen = last_seen(&stack, decode_worker(&r));
    assert_eq!(seen["leg"], "local", "{seen}");
    assert_eq!(seen["status"], 200, "{seen}");
    assert_eq!(seen["kv_transfer_params"], Value::Null, "{seen}");
    let keys = seen["body_keys"].as_array().cloned().unwrap_or_default();
    assert!(!keys.contains(&json!("request_id")), "{seen}");
    assert!(!keys.contains(&json!("kv_transfer_params")), "{seen}");
    let id = seen["request_id"].as_str().unwrap_or_default();
    assert!(
        id.starts_with("kvgate-"),
        "kvgate's id, not the client's: {id}"
    );
    no_worker_saw_the_clients_fields(&stack, &[2, 3]);
    wait_bookings_drained(&stack);

    // Fail-open (the sidecar gone past stale_after_ms, on_stale =
    // fail_open): Envoy's own balancing, but the body is scrubbed of
    // every transfer field all the same.
    stack.kill_sidecar();
    let body = json!({"model": "demo-model", "prompt": unique_prompt(4, 3000),
        "max_tokens": 4, "kv_transfer_params": evil_params(),
        "vllm_xargs": {"kv_transfer_params": evil_params(), "keep": 1},
        "bootstrap_host": "evil", "bootstrap_port": 8998, "bootstrap_room": 7})
    .to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    let r = loop {
        let failed_open = stack.envoy_stat("kvgate_failed_open_total").unwrap();
        let r = post(&stack, "/v1/completions", body.as_bytes(), &[]);
        if stack.envoy_stat("kvgate_failed_open_total").unwrap() > failed_open {
            break r;
        }
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(Instant::now() < deadline, "the state never went stale");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(r.status, 200, "{}\n{}", r.text(), stack.log_tails());
    let seen = last_seen(&stack, decode_worker(&r));
    assert_eq!(seen["leg"], "local", "{seen}");
    assert_eq!(seen["status"], 200, "{seen}");
    assert_eq!(seen["kv_transfer_params"], Value::Null, "{seen}");
    assert_eq!(seen["vllm_xargs"], json!({"keep": 1}), "{seen}");
    let keys = seen["body_keys"].as_array().cloned().unwrap_or_default();
    for field in [
        "kv_transfer_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
    ] {
        assert!(!keys.contains(&json!(field)), "{field} reached: {seen}");
    }
    no_worker_saw_the_clients_fields(&stack, &[2, 3]);
    no_panic_in_envoy_log(&stack);
}

/// Opens a request to Envoy, reads nothing, and hangs up after a while.
fn hang_up_during(stack: &Stack, body: &[u8], after: Duration) {
    let mut s = std::net::TcpStream::connect(stack.envoy_addr()).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    std::thread::sleep(after);
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// Prompt tokens booked on the prefill workers (1 and 2), from the
/// sidecar's state: the stalled legs compute nothing, so it is all
/// kvgate's booking.
fn prefill_booked(stack: &Stack) -> u64 {
    let state = stack.sidecar_state().unwrap();
    state["models"][0]["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["worker_id"] == 1 || w["worker_id"] == 2)
        .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
        .map(|r| r["active_prefill_tokens"].as_u64().unwrap_or(0))
        .sum()
}

#[test]
fn a_failing_model_and_a_client_that_hangs_up_during_a_prefill_leg() {
    let _g = serial();
    let stack = stalling_stack("fail", 3000);
    wait_workers(&stack, 4);
    let decode_legs = || recent(&stack, 2).len() + recent(&stack, 3).len();

    // A stalled prefill leg for a model that does not prefill locally:
    // 503 prefill_failed, no decode leg, and the VM lives on.
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&unique_prompt(1, 3000)),
        &[],
    );
    assert_eq!(r.status, 503, "{}\n{}", r.text(), stack.log_tails());
    assert_eq!(r.header("x-kvgate-reason"), Some("prefill_failed"));
    assert_eq!(decode_legs(), 0);
    assert_eq!(stack.envoy_stat("kvgate_prefill_failed_total").unwrap(), 1);
    no_panic_in_envoy_log(&stack);
    wait_bookings_drained(&stack);

    // A client that leaves during the prefill leg: the leg keeps running
    // on its worker (Envoy cancels no callout), so its booking stays
    // there until the leg's deadline; the decode booking ends with the
    // request.
    let legs_before = prefill_legs(&stack);
    hang_up_during(
        &stack,
        &completion_body(&unique_prompt(2, 3000)),
        Duration::from_millis(200),
    );
    let legs = || prefill_legs(&stack);
    let deadline = Instant::now() + Duration::from_secs(10);
    while legs() < legs_before + 1 {
        assert!(Instant::now() < deadline, "the prefill leg was never sent");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(legs(), legs_before + 1, "one leg, not retried");
    while stack.envoy_stat("kvgate_prefill_orphaned_total").unwrap() < 1 {
        assert!(
            Instant::now() < deadline,
            "the departed client's prefill leg was never orphaned"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        stack.envoy_stat("kvgate_prefill_orphaned_total").unwrap(),
        1
    );
    // The sidecar hears of the request's end (its decode booking gone)
    // while the prefill leg's booking stays.
    let deadline = Instant::now() + Duration::from_secs(10);
    while bookings_active(&stack) != 1.0 {
        assert!(
            Instant::now() < deadline,
            "expected the prefill leg's booking alone; {} active",
            bookings_active(&stack)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let booked = prefill_booked(&stack);
    assert!(
        booked > 0,
        "the prefill worker's booking ended with the client: {}",
        stack.sidecar_state().unwrap()
    );
    // Then the leg's deadline passes and the booking ends, with no
    // request to prompt it.
    wait_bookings_drained(&stack);
    assert_eq!(prefill_booked(&stack), 0);
    assert_eq!(decode_legs(), 0, "no decode leg for a departed client");

    // Ordinary service goes on.
    let r = post(
        &stack,
        "/v1/completions",
        &completion_body(&unique_prompt(3, 3000)),
        &[],
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("prefill_failed"));
    no_panic_in_envoy_log(&stack);
}

#[test]
fn an_sglang_model_without_prefill_workers_sends_no_decode_worker_a_whole_request() {
    let _g = serial();
    let mut stack = sglang_stack();
    wait_workers(&stack, 4);
    stack.kill_worker(0);
    stack.kill_worker(1);
    wait_workers(&stack, 2);

    let before = recent(&stack, 2).len() + recent(&stack, 3).len();
    let served = served_total(&stack);
    let body = json!({"model": "demo-model", "prompt": unique_prompt(1, 3000),
        "max_tokens": 4, "bootstrap_host": "evil", "bootstrap_room": 5});
    let r = post(&stack, "/v1/completions", body.to_string().as_bytes(), &[]);
    assert_eq!(r.status, 503, "{}\n{}", r.text(), stack.log_tails());
    assert_eq!(r.header("x-kvgate-reason"), Some("prefill_failed"));
    assert_eq!(
        recent(&stack, 2).len() + recent(&stack, 3).len(),
        before,
        "a decode worker received it"
    );
    assert_eq!(served_total(&stack), served);
    assert!(stack.envoy_stat("kvgate_prefill_failed_total").unwrap() >= 1);
    no_panic_in_envoy_log(&stack);
    wait_bookings_drained(&stack);
}
