//! The ext_proc comparison route on real Envoy: kvgate's decision made by
//! `kvgate-extproc` (its own sidecar in-process) through Envoy's
//! `ext_proc` filter, into the routed cluster the filter's listener uses.
//! It must route where the decision says, shed without touching a worker,
//! free every reservation when requests end, and refuse a malformed body
//! without going down.

mod common;

use common::*;
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::json;
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
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let (status, headers, body) = http::request_full(
        &stack.extproc_addr(),
        "POST",
        "/v1/chat/completions",
        &h,
        Some(body),
    )
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
