//! The ext_proc comparison route on real Envoy: kvgate's decision made by
//! `kvgate-extproc` (its own sidecar in-process) through Envoy's
//! `ext_proc` filter, into the routed cluster the filter's listener uses.
//! It must route where the decision says, shed without touching a worker,
//! free every reservation when requests end, and refuse a malformed body
//! without going down.

mod common;

use common::*;
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// A sample from `kvgate-extproc`'s in-process sidecar's `/metrics`.
fn extproc_metric(stack: &Stack, series: &str) -> f64 {
    let (status, body) = http::get(&stack.extproc_sidecar_addr(), "/metrics").unwrap();
    assert_eq!(status, 200);
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

fn reservations(stack: &Stack) -> f64 {
    extproc_metric(stack, "kvgate_sidecar_ledger_holders{kind=\"reservation\"}")
}

fn wait_reservations(stack: &Stack, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while reservations(stack) != n {
        assert!(
            Instant::now() < deadline,
            "reservations stay at {}, not {n}\n{}",
            reservations(stack),
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn chat_via_extproc(stack: &Stack, body: &[u8], headers: &[(&str, &str)]) -> Reply {
    post_via_extproc(stack, "/v1/chat/completions", body, headers)
}

/// Posts a JSON body to the ext_proc listener.
fn post_via_extproc(stack: &Stack, path: &str, body: &[u8], headers: &[(&str, &str)]) -> Reply {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let (status, headers, body) =
        http::request_full(&stack.extproc_addr(), "POST", path, &h, Some(body))
            .unwrap_or_else(|e| panic!("request failed: {e:#}\n{}", stack.log_tails()));
    Reply {
        status,
        headers,
        body,
    }
}

fn ask(stack: &Stack, text: &str) -> Reply {
    let body = json!({"model": "demo-model", "max_tokens": 2,
                      "messages": [{"role": "user", "content": text}]});
    chat_via_extproc(stack, body.to_string().as_bytes(), &[])
}

/// The worker the decision named, from the served-by header.
fn decided(r: &Reply) -> String {
    let v = r.header("x-kvgate-served-by").unwrap_or_else(|| {
        panic!("no served-by header: {:?}", r.headers);
    });
    v.split(';')
        .find_map(|p| p.trim().strip_prefix("worker_id="))
        .unwrap_or_else(|| panic!("served-by {v:?} names no worker"))
        .to_string()
}

#[test]
fn extproc_routes_sheds_and_frees_its_reservations() {
    let _g = serial();
    let stack = start(StackConfig {
        extproc: true,
        ..busy_prone()
    });
    let ids: Vec<String> = stack.workers.iter().map(|w| w.id.to_string()).collect();

    // Routed where the decision says; a client's destination is ignored.
    for i in 0..6 {
        let body = json!({"model": "demo-model", "max_tokens": 2,
                          "messages": [{"role": "user", "content": format!("question {i}")}]});
        let r = chat_via_extproc(
            &stack,
            body.to_string().as_bytes(),
            &[("x-gateway-destination-endpoint", "127.0.0.1:1")],
        );
        let (worker, _) = served_by(&r);
        assert!(ids.contains(&worker), "routed to unknown worker {worker}");
        assert_eq!(decided(&r), worker, "Envoy did not go where ext_proc said");
    }
    wait_reservations(&stack, 0.0);

    // A hog books its rank busy; what follows goes to the other worker.
    let hog = |tag: u32| {
        let addr = stack.extproc_addr();
        std::thread::spawn(move || completion(&addr, &unique_prompt(tag, 160), 150).unwrap())
    };
    let first = hog(1);
    wait_reservations(&stack, 1.0);
    let hogged = loop {
        // The hog's worker, from the in-process sidecar's ledger view.
        let (_, body) = http::get(&stack.extproc_sidecar_addr(), "/v1/state").unwrap();
        let state: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let busy: Vec<String> = state["models"][0]["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|w| w["ranks"][0]["busy"] == true)
            .map(|w| w["worker_id"].to_string())
            .collect();
        if let [one] = busy.as_slice() {
            break one.clone();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for i in 0..3 {
        let r = ask(&stack, &format!("while one is busy {i}"));
        let (worker, _) = served_by(&r);
        assert_ne!(worker, hogged, "routed onto the busy worker");
    }
    let second = hog(2);
    wait_reservations(&stack, 2.0);

    // Every worker busy: the filter's 503, and no worker sees it. Every
    // request so far (6 + 3 + the two hogs) has reached its worker first.
    let deadline = Instant::now() + Duration::from_secs(5);
    while served_total(&stack) < 11 {
        assert!(Instant::now() < deadline, "the hogs never reached a worker");
        std::thread::sleep(Duration::from_millis(20));
    }
    let served_before = served_total(&stack);
    let r = ask(&stack, "may I?");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.json(),
        json!({"message": "Service temporarily unavailable: All workers are busy, please retry later", "type": "service_unavailable", "code": 503})
    );
    assert_eq!(r.header("x-kvgate-reason"), Some("all_workers_busy"));
    assert!(r.header("retry-after").is_some());
    assert!(r.header("x-kvgate-sim-worker").is_none());
    assert_eq!(served_total(&stack), served_before, "a worker saw the 503");

    // The hogs end on different workers; their reservations are freed.
    let a = first.join().unwrap();
    let b = second.join().unwrap();
    assert_ne!(served_by(&a).0, served_by(&b).0);
    wait_reservations(&stack, 0.0);
    let prefill: u64 = {
        let (_, body) = http::get(&stack.extproc_sidecar_addr(), "/v1/state").unwrap();
        let state: serde_json::Value = serde_json::from_slice(&body).unwrap();
        state["models"][0]["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
            .map(|r| r["active_prefill_tokens"].as_u64().unwrap_or(0))
            .sum()
    };
    assert_eq!(prefill, 0);
    assert_eq!(
        extproc_metric(
            &stack,
            "kvgate_sidecar_bookings_active{model=\"demo-model\"}"
        ),
        0.0
    );
    let r = ask(&stack, "again?");
    assert_eq!(r.status, 200, "{}", r.text());

    // Malformed and unknown: answered locally, and the server stays up.
    let r = chat_via_extproc(&stack, b"{not json", &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("bad_request"));
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = chat_via_extproc(&stack, br#"{"model": "demo-model"}"#, &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    let body = json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]});
    let r = chat_via_extproc(&stack, body.to_string().as_bytes(), &[]);
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("unknown_model"));
    let r = ask(&stack, "still there?");
    assert_eq!(r.status, 200, "{}", r.text());
    wait_reservations(&stack, 0.0);
}

#[test]
fn least_request_route_reaches_every_worker() {
    let _g = serial();
    let stack = start(StackConfig {
        workers: 2,
        extproc: true,
        ..StackConfig::default()
    });
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..24 {
        let body = json!({"model": "demo-model", "prompt": format!("p {i}"), "max_tokens": 1});
        let (status, headers, _) = http::request_full(
            stack.least_request_url().trim_start_matches("http://"),
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            Some(body.to_string().as_bytes()),
        )
        .unwrap();
        assert_eq!(status, 200);
        if let Some((_, w)) = headers.iter().find(|(k, _)| k == "x-kvgate-sim-worker") {
            seen.insert(w.clone());
        }
    }
    assert_eq!(seen.len(), 2, "least request used {seen:?}");
}

/// A prefill/decode fleet behind `kvgate-extproc`, the model's
/// `on_prefill_failure` as given (NIXL).
fn pd_via_extproc(on_prefill_failure: &str) -> Stack {
    start(StackConfig {
        extproc: true,
        ..pd_config(
            &["--kv-role", "kv_producer", "--kv-side-channel-port", "0"],
            &["--kv-role", "kv_consumer", "--kv-side-channel-port", "0"],
            format!(
                "[models.disaggregation]\nprotocol = \"vllm-nixl\"\non_prefill_failure = \"{on_prefill_failure}\"\n"
            ),
        )
    })
}

/// A long completion (nothing cached: the filter would split it) that
/// names a transfer of the client's own.
fn forged_transfer(tag: u32) -> Vec<u8> {
    json!({"model": "demo-model", "prompt": unique_prompt(tag, 3000), "max_tokens": 2,
           "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "evil",
                                  "remote_block_ids": [[1]], "remote_host": "127.0.0.1",
                                  "remote_port": 1}})
    .to_string()
    .into_bytes()
}

fn completion_via_extproc(stack: &Stack, body: &[u8]) -> Reply {
    post_via_extproc(
        stack,
        "/v1/completions",
        body,
        &[("x-request-id", "client-chosen")],
    )
}

#[test]
fn extproc_computes_a_split_request_on_its_decode_worker_or_refuses_it() {
    let _g = serial();
    // `local`: the decode worker gets the request whole, without the
    // client's transfer, under kvgate's request id, and no prefill worker
    // hears of it (this door makes no prefill leg).
    let stack = pd_via_extproc("local");
    let r = completion_via_extproc(&stack, &forged_transfer(1));
    assert_eq!(r.status, 200, "{}\n{}", r.text(), stack.log_tails());
    let got = last_seen(&stack, decode_worker(&r));
    assert_eq!(got["leg"], "local", "{got}");
    assert_eq!(got["kv_transfer_params"], Value::Null, "{got}");
    assert!(
        !got["body_keys"]
            .as_array()
            .unwrap()
            .contains(&json!("kv_transfer_params")),
        "{got}"
    );
    let id = got["request_id"].as_str().unwrap();
    assert!(id.starts_with("kvgate-") && id.len() == 39, "{id}");
    assert_eq!(prefill_legs(&stack), 0);
    wait_reservations(&stack, 0.0);
    drop(stack);

    // `fail`: refused as the filter refuses a failed leg; no worker sees it.
    let stack = pd_via_extproc("fail");
    let before = served_total(&stack);
    let r = completion_via_extproc(&stack, &forged_transfer(2));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("prefill_failed"));
    assert_eq!(r.json()["error"]["code"], 503);
    assert_eq!(served_total(&stack), before, "a worker saw the refusal");
    wait_reservations(&stack, 0.0);
}
