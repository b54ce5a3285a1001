//! End to end on real Envoy: the kvgate filter (the real `.wasm`), the
//! sidecar, and `kvgate-sim` workers, all on loopback.
//!
//! Each test starts its own stack. Stacks are serialized: a stack is four
//! workers, a sidecar and Envoy, and two of them at once on a 2-core machine
//! would make timing-dependent steps (scrape bounds) flaky.

mod common;

use common::*;
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[test]
fn routes_to_workers_the_snapshot_allows_and_spreads_load() {
    let _g = serial();
    let stack = start(StackConfig::default());
    let allowed: Vec<String> = stack.workers.iter().map(|w| w.id.to_string()).collect();
    let mut per_worker: BTreeMap<String, u32> = BTreeMap::new();
    for i in 0..24 {
        // A client-supplied destination must never be honoured.
        let body = json!({"model": "demo-model", "prompt": format!("request {i} about routing"), "max_tokens": 4});
        let r = post(
            &stack,
            "/v1/completions",
            body.to_string().as_bytes(),
            &[("x-gateway-destination-endpoint", "127.0.0.1:1")],
        );
        assert_eq!(r.status, 200, "body: {}\n{}", r.text(), stack.log_tails());
        let worker = r
            .header("x-kvgate-sim-worker")
            .expect("sim worker header")
            .to_string();
        assert!(
            allowed.contains(&worker),
            "routed to unknown worker {worker}"
        );
        let j = r.json();
        assert_eq!(j["object"], "text_completion");
        *per_worker.entry(worker).or_default() += 1;
    }
    // Idle workers tie; ties are spread, so more than one worker serves.
    assert!(
        per_worker.len() >= 2,
        "all requests went to one worker: {per_worker:?}"
    );
    assert_eq!(stack.envoy_stat("kvgate_routed_total").unwrap(), 24);

    // Paths kvgate does not route pass through to Envoy's own balancing.
    let (status, body) = http::get(&stack.envoy_addr(), "/v1/models").unwrap();
    assert_eq!(status, 200);
    let models: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(models["data"][0]["id"], "demo-model");
}

#[test]
fn streaming_works_through_envoy() {
    let _g = serial();
    let stack = start(StackConfig::default());
    let body = json!({
        "model": "demo-model",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "stream please"}],
        "stream": true,
        "max_tokens": 6,
    });
    let r = post(
        &stack,
        "/v1/chat/completions",
        body.to_string().as_bytes(),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.header("content-type")
            .unwrap_or_default()
            .starts_with("text/event-stream")
    );
    let text = r.text();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "stream: {text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks.len() >= 6,
        "expected a chunk per token, got {}",
        chunks.len()
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
}

#[test]
fn error_replies_come_from_envoy_without_touching_workers() {
    let _g = serial();
    let stack = start(StackConfig {
        plugin: json!({"max_body_bytes": 4096}),
        ..StackConfig::default()
    });
    let served_before = served_total(&stack);

    let r = chat(&stack, "no-such-model", "hi", 4);
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("unknown_model"));
    assert_eq!(r.json()["error"]["code"], 404);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no-such-model")
    );

    let r = post(
        &stack,
        "/v1/chat/completions",
        b"{\"model\": \"demo-model\", \"messages\": [",
        &[],
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("bad_request"));
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    let r = post(
        &stack,
        "/v1/completions",
        br#"{"model": "demo-model"}"#,
        &[],
    );
    assert_eq!(r.status, 400, "a completion needs a prompt: {}", r.text());

    // Empty token lists are malformed prompts too: the engine would only
    // refuse them after a round trip.
    for prompt in ["[[]]", "[[], [1]]"] {
        let body = format!(r#"{{"model": "demo-model", "prompt": {prompt}}}"#);
        let r = post(&stack, "/v1/completions", body.as_bytes(), &[]);
        assert_eq!(r.status, 400, "{prompt}: {}", r.text());
        assert_eq!(r.header("x-kvgate-reason"), Some("bad_request"), "{prompt}");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }

    let big = json!({"model": "demo-model", "prompt": "x".repeat(10_000)});
    let r = post(&stack, "/v1/completions", big.to_string().as_bytes(), &[]);
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("body_too_large"));

    assert_eq!(
        served_total(&stack),
        served_before,
        "a local reply reached a worker"
    );
}

#[test]
fn sheds_with_503_when_every_worker_is_busy() {
    sheds_when_every_worker_is_busy(["vllm", "vllm"]);
}

/// SGLang reports its capacity in tokens, not in blocks: the decode rule
/// needs it converted to see these workers full at all.
#[test]
fn sheds_sglang_workers_with_503_when_every_worker_is_busy() {
    sheds_when_every_worker_is_busy(["sglang", "sglang"]);
}

#[test]
fn sheds_a_mixed_vllm_and_sglang_fleet_with_503_when_every_worker_is_busy() {
    sheds_when_every_worker_is_busy(["vllm", "sglang"]);
}

/// `metrics_flavors`: whose metric names each worker speaks (`kvgate-sim
/// --metrics-flavor`).
fn sheds_when_every_worker_is_busy(metrics_flavors: [&str; 2]) {
    let _g = serial();
    let stack = start(StackConfig {
        worker_sim_args: metrics_flavors
            .map(|f| vec!["--metrics-flavor".to_string(), f.to_string()])
            .to_vec(),
        ..busy_prone()
    });
    // Each hog makes one worker busy; the second goes out only once the
    // first worker shows busy, so it cannot land on the same one.
    let long_prompt: Vec<u32> = (0..160).collect();
    let mut hogs = Vec::new();
    for i in 0..2u32 {
        let addr = stack.envoy_addr();
        let mut prompt = long_prompt.clone();
        prompt[0] = 10_000 + i;
        hogs.push(std::thread::spawn(move || {
            let body = json!({"model": "demo-model", "prompt": prompt, "max_tokens": 150});
            http::request_full(
                &addr,
                "POST",
                "/v1/completions",
                &[("content-type", "application/json")],
                Some(body.to_string().as_bytes()),
            )
            .map(|(s, h, _)| (s, h))
        }));
        wait_busy(&stack, i as usize + 1);
    }

    // Wait until the sidecar sees both workers busy and Envoy has that state.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut shed = None;
    while Instant::now() < deadline {
        let r = chat(&stack, "demo-model", "may I?", 2);
        if r.status == 503 {
            shed = Some(r);
            break;
        }
        assert_eq!(r.status, 200, "{}", r.text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = shed.unwrap_or_else(|| {
        panic!(
            "never shed; sidecar state {}",
            stack.sidecar_state().unwrap()
        )
    });
    assert_eq!(
        r.json(),
        json!({"message": "Service temporarily unavailable: All workers are busy, please retry later", "type": "service_unavailable", "code": 503})
    );
    assert_eq!(r.header("x-kvgate-reason"), Some("all_workers_busy"));
    assert!(r.header("retry-after").is_some());
    assert!(
        r.header("x-kvgate-sim-worker").is_none(),
        "a worker answered the 503"
    );

    // The hogs finish, load drains, and admission resumes.
    let distinct: std::collections::BTreeSet<String> = hogs
        .into_iter()
        .map(|h| {
            let (status, headers) = h.join().unwrap().unwrap();
            assert_eq!(status, 200);
            headers
                .into_iter()
                .find(|(k, _)| k == "x-kvgate-sim-worker")
                .unwrap()
                .1
        })
        .collect();
    assert_eq!(
        distinct.len(),
        2,
        "the two hogs should have landed on different workers"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = chat(&stack, "demo-model", "again?", 2);
        if r.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still shedding after load drained: {}",
            r.text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        stack
            .envoy_stat("kvgate_rejected_all_workers_busy_total")
            .unwrap()
            >= 1
    );
}

#[test]
fn a_dead_worker_is_routed_around_and_no_workers_gives_503() {
    let _g = serial();
    let mut stack = start(StackConfig {
        workers: 3,
        ..StackConfig::default()
    });
    stack.kill_worker(0);
    // Past the sidecar's down bound (600 ms) and a snapshot round trip.
    std::thread::sleep(Duration::from_millis(1500));
    for i in 0..12 {
        let r = chat(&stack, "demo-model", &format!("after the crash {i}"), 2);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_ne!(
            r.header("x-kvgate-sim-worker"),
            Some("1"),
            "routed to the dead worker"
        );
    }
    stack.kill_worker(1);
    stack.kill_worker(2);
    std::thread::sleep(Duration::from_millis(1500));
    let r = chat(&stack, "demo-model", "anyone?", 2);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("no_workers"));
    assert_eq!(r.json()["error"]["code"], 503);

    // A worker that comes back is used again.
    stack.start_worker(0).unwrap();
    stack.wait_routing_ready(Duration::from_secs(20)).unwrap();
    let r = chat(&stack, "demo-model", "welcome back", 2);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvgate-sim-worker"), Some("1"));
}

#[test]
fn stale_state_fails_open_to_envoys_own_balancing() {
    let _g = serial();
    let mut stack = start(StackConfig {
        plugin: json!({"stale_after_ms": 800, "poll_wait_ms": 300, "on_stale": "fail_open"}),
        ..StackConfig::default()
    });
    stack.kill_sidecar();
    std::thread::sleep(Duration::from_millis(1500));
    let r = chat(&stack, "demo-model", "sidecar is gone", 2);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(stack.envoy_stat("kvgate_failed_open_total").unwrap() >= 1);
    assert!(
        stack
            .envoy_stat("kvgate_snapshot_poll_errors_total")
            .unwrap()
            >= 1
    );

    // The sidecar returns and kvgate routes again.
    stack.restart_sidecar().unwrap();
    stack.wait_routing_ready(Duration::from_secs(20)).unwrap();
    let routed = stack.envoy_stat("kvgate_routed_total").unwrap();
    let r = chat(&stack, "demo-model", "sidecar is back", 2);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(stack.envoy_stat("kvgate_routed_total").unwrap(), routed + 1);
}

#[test]
fn stale_state_fails_closed_when_configured() {
    let _g = serial();
    let mut stack = start(StackConfig {
        workers: 2,
        plugin: json!({"stale_after_ms": 800, "poll_wait_ms": 300, "on_stale": "fail_closed"}),
        ..StackConfig::default()
    });
    stack.kill_sidecar();
    std::thread::sleep(Duration::from_millis(1500));
    let r = chat(&stack, "demo-model", "sidecar is gone", 2);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("stale_state"));
}

/// A token prompt: `prefix_blocks` blocks of 16 tokens shared by `group`,
/// then a few tokens unique to `i`.
fn grouped(group: u32, i: u32, prefix_blocks: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (0..prefix_blocks * 16)
        .map(|k| 1000 + group * 100_000 + k)
        .collect();
    t.extend((0..8).map(|k| 900_000 + i * 10 + k));
    t
}

/// Waits until the snapshot shows no load anywhere (engine or booked), so
/// that load is equal and prefix overlap alone decides the next request.
fn wait_idle(stack: &Stack) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = stack.sidecar_state().unwrap();
        let busy: u64 = s["models"][0]["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
            .map(|r| {
                [
                    "kv_used_blocks",
                    "running",
                    "active_decode_blocks",
                    "active_prefill_tokens",
                ]
                .iter()
                .map(|k| r[*k].as_u64().unwrap_or(0))
                .sum::<u64>()
            })
            .sum();
        if busy == 0 {
            wait_envoy_has(stack, s["version"].as_u64().unwrap_or(0));
            return;
        }
        assert!(Instant::now() < deadline, "fleet never went idle: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until Envoy holds the sidecar's snapshot `version` (or a later
/// one of the same sidecar), so a decision cannot see an older load.
fn wait_envoy_has(stack: &Stack, version: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let held = stack.envoy_stat("kvgate_snapshot_version").unwrap_or(0);
        // Versions restart with a restarted sidecar: a held version beyond
        // the sidecar's current one is the old process's.
        let current = stack.sidecar_state().unwrap()["version"]
            .as_u64()
            .unwrap_or(0);
        if held >= version && held <= current {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Envoy never caught up with snapshot {version} (holds {held})"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn complete(stack: &Stack, tokens: &[u32]) -> Reply {
    wait_idle(stack);
    let body = json!({"model": "demo-model", "prompt": tokens, "max_tokens": 2});
    post(stack, "/v1/completions", body.to_string().as_bytes(), &[])
}

fn indexed_blocks(stack: &Stack) -> f64 {
    stack
        .sidecar_metric("kvgate_sidecar_kv_indexed_blocks{model=\"demo-model\"}")
        .unwrap_or(0.0)
}

/// Waits until the index gauge (refreshed about once a second) reads the
/// same twice in a row, so that every change in flight is counted.
fn index_settled(stack: &Stack) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = indexed_blocks(stack);
    loop {
        std::thread::sleep(Duration::from_millis(1200));
        let now = indexed_blocks(stack);
        if now == last {
            return;
        }
        assert!(Instant::now() < deadline, "the index never settled");
        last = now;
    }
}

/// Waits for the index to hold at least `n` blocks (events are published,
/// indexed and pushed to Envoy within milliseconds; the gauge lags by up
/// to a second).
fn wait_indexed(stack: &Stack, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let have = indexed_blocks(stack);
        if have >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "index never reached {n} blocks (holds {have})\n{}",
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn prefix_routing_with_tagged_events_and_topic_replay() {
    prefix_routing(&[
        "--event-shape",
        "tagged",
        "--replay-shape",
        "topic",
        "--engine-hash",
        "u64",
    ]);
}

#[test]
fn prefix_routing_with_positional_events_and_legacy_replay() {
    prefix_routing(&[
        "--event-shape",
        "positional",
        "--replay-shape",
        "legacy",
        "--engine-hash",
        "i64",
    ]);
}

/// A finished request stops loading its rank at once in the Envoy thread
/// that routed it: back-to-back requests of one prefix group on one
/// connection (as an OpenAI client's pool sends them) all stay with their
/// cache, though each reaches Envoy before the sidecar has heard the last
/// one end. Each books 20 blocks of its own, more than its 8-block cached
/// prefix is worth, so a stale booking would send the next one elsewhere.
#[test]
fn back_to_back_requests_of_a_group_stay_on_their_cache() {
    let _g = serial();
    let stack = start(StackConfig {
        workers: 3,
        kv_events: true,
        // Real time: each request runs ~70 ms, long enough for a snapshot
        // to count its booking before it ends.
        sim_args: vec!["--speedup".into(), "1".into()],
        ..StackConfig::default()
    });
    let prompt = |i: u32| -> Vec<u32> {
        let mut t: Vec<u32> = (0..128).map(|k| 7000 + k).collect();
        t.extend((0..320).map(|k| 2_000_000 + i * 1000 + k));
        t
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let served: Vec<String> = rt.block_on(async {
        use http_body_util::{BodyExt, Full};
        // One keep-alive connection: one Envoy worker thread.
        let tcp = tokio::net::TcpStream::connect(stack.envoy_addr())
            .await
            .unwrap();
        let (mut client, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        let mut served = Vec::new();
        for i in 0..8 {
            let body = json!({"model": "demo-model", "prompt": prompt(i), "max_tokens": 30});
            let req = hyper::Request::builder()
                .method("POST")
                .uri("/v1/completions")
                .header("host", stack.envoy_addr())
                .header("content-type", "application/json")
                .body(Full::new(bytes::Bytes::from(body.to_string())))
                .unwrap();
            let resp = client.send_request(req).await.unwrap();
            assert_eq!(resp.status(), 200);
            let worker = resp.headers()["x-kvgate-sim-worker"]
                .to_str()
                .unwrap()
                .to_string();
            assert_eq!(
                resp.headers()["x-kvgate-served-by"].to_str().unwrap(),
                format!("worker_id={worker}; dp_rank=0"),
                "the gateway's own account of where it routed"
            );
            resp.into_body().collect().await.unwrap();
            served.push(worker);
            if i == 0 {
                // The group's prefix is in Envoy's index from now on; the
                // requests that follow come back to back.
                wait_indexed(&stack, 28.0);
            }
        }
        served
    });
    assert!(
        served.iter().all(|w| *w == served[0]),
        "the group left its cache: {served:?}"
    );
}

/// Requests follow their cached prefix across DP ranks, a sidecar restart
/// (index rebuilt by replay) and an engine restart (index entries dropped).
fn prefix_routing(event_args: &[&str]) {
    let _g = serial();
    let mut sim_args: Vec<String> = ["--speedup", "50"].map(String::from).to_vec();
    sim_args.extend(event_args.iter().map(|s| s.to_string()));
    let mut stack = start(StackConfig {
        workers: 3,
        dp_size: 2,
        kv_events: true,
        sim_args,
        ..StackConfig::default()
    });
    // Four prefix groups; the first request of each lands anywhere, the
    // rest must follow it to the same worker and DP rank.
    let mut home = Vec::new();
    for g in 0..4 {
        home.push(served_by(&complete(&stack, &grouped(g, 0, 16))));
    }
    wait_indexed(&stack, 64.0);
    std::thread::sleep(Duration::from_millis(200));
    for round in 1..4 {
        for g in 0..4u32 {
            let r = complete(&stack, &grouped(g, round, 16));
            assert_eq!(
                served_by(&r),
                home[g as usize],
                "group {g} left its cached prefix"
            );
            assert_eq!(
                r.header("x-kvgate-sim-cached-tokens"),
                Some("256"),
                "the worker had the prefix cached"
            );
        }
    }
    let ranks: std::collections::BTreeSet<&String> = home.iter().map(|(_, r)| r).collect();
    assert!(
        ranks.len() > 1
            || home
                .iter()
                .map(|(w, _)| w)
                .collect::<std::collections::BTreeSet<_>>()
                .len()
                > 1
    );

    // A sidecar restart recovers the index by replay and keeps the routing.
    stack.restart_sidecar().unwrap();
    stack.wait_routing_ready(Duration::from_secs(20)).unwrap();
    wait_indexed(&stack, 64.0);
    std::thread::sleep(Duration::from_millis(200));
    for g in 0..4u32 {
        assert_eq!(
            served_by(&complete(&stack, &grouped(g, 9, 16))),
            home[g as usize],
            "after sidecar restart"
        );
    }

    // An engine restart empties its cache; the sidecar notices the sequence
    // start over at the worker's next batch and drops what it had indexed.
    let (w0, _) = &home[0];
    let idx: usize = w0.parse::<usize>().unwrap() - 1;
    let addr = stack.workers[idx].endpoint();
    let before = indexed_blocks(&stack);
    http::request(&addr, "POST", "/sim/restart", &[], None).unwrap();
    let fresh =
        json!({"model": "demo-model", "prompt": grouped(99, 0, 4), "max_tokens": 1}).to_string();
    // The rank that held group 0 publishes again, from sequence 0.
    let rank_header = [
        ("content-type", "application/json"),
        ("x-data-parallel-rank", home[0].1.as_str()),
    ];
    http::request(
        &addr,
        "POST",
        "/v1/completions",
        &rank_header,
        Some(fresh.as_bytes()),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let resyncs = stack
            .sidecar_metric(&format!(
                "kvgate_sidecar_kv_resyncs_total{{dp_rank=\"{}\",worker_id=\"{w0}\"}}",
                home[0].1
            ))
            .unwrap_or(0.0);
        if resyncs >= 1.0 && indexed_blocks(&stack) < before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "restart never detected (resyncs {resyncs})\n{}",
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // vLLM's reset_prefix_cache publishes AllBlocksCleared: the worker's
    // entries leave the index that routing reads.
    let (w1, _) = &home[1];
    let addr = stack.workers[w1.parse::<usize>().unwrap() - 1].endpoint();
    wait_idle(&stack);
    let before = indexed_blocks(&stack);
    let (status, _) = http::request(&addr, "POST", "/reset_prefix_cache", &[], None).unwrap();
    assert_eq!(status, 200);
    let deadline = Instant::now() + Duration::from_secs(5);
    while indexed_blocks(&stack) >= before {
        assert!(
            Instant::now() < deadline,
            "AllBlocksCleared never reached the index"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Each of the worker's ranks clears on its own: count from when both
    // have, or the second clear would eat the blocks waited for below.
    index_settled(&stack);
    // What kvgate routed there is forgotten with it: once another worker
    // caches group 1's prefix, group 1 goes there, not back to the worker
    // it was routed to before the clear.
    // Not the restarted worker either: its other rank reveals the restart
    // only at its next batch, and dropping what that rank held would eat
    // the blocks counted below.
    let other = (1..=stack.workers.len())
        .map(|i| i.to_string())
        .find(|w| w != w1 && w != w0)
        .unwrap();
    let other_addr = stack.workers[other.parse::<usize>().unwrap() - 1].endpoint();
    let before = indexed_blocks(&stack);
    assert_eq!(
        completion(&other_addr, &grouped(1, 20, 16), 1)
            .unwrap()
            .status,
        200
    );
    wait_indexed(&stack, before + 16.0);
    wait_idle(&stack);
    assert_eq!(
        served_by(&complete(&stack, &grouped(1, 21, 16))).0,
        other,
        "group 1 still drawn to its cleared worker"
    );
}

/// SGLang's default page size is one token: the events carry one-token
/// pages while requests are hashed in blocks of 16. kvgate re-chunks the
/// pages along their chains, so a group's requests still find the worker
/// holding their prefix.
#[test]
fn one_token_pages_are_rechunked_and_route_by_prefix() {
    let _g = serial();
    let mut stack = start(StackConfig {
        workers: 3,
        kv_events: true,
        engine_block_size: Some(1),
        sim_args: [
            "--speedup",
            "50",
            "--num-gpu-blocks",
            "16384",
            "--metrics-flavor",
            "sglang",
        ]
        .map(String::from)
        .to_vec(),
        ..StackConfig::default()
    });
    let mut home = Vec::new();
    for g in 0..4 {
        home.push(served_by(&complete(&stack, &grouped(g, 0, 16))).0);
    }
    // Only the engines' events count: a restarted sidecar has no memory of
    // where it routed, and rebuilds its index from the workers' replay.
    stack.restart_sidecar().unwrap();
    stack.wait_routing_ready(Duration::from_secs(20)).unwrap();
    // 16 blocks of 16 per group, from one-token pages.
    wait_indexed(&stack, 64.0);
    std::thread::sleep(Duration::from_millis(200));
    for round in 1..3 {
        for g in 0..4u32 {
            let r = complete(&stack, &grouped(g, round, 16));
            assert_eq!(
                served_by(&r).0,
                home[g as usize],
                "group {g} left its cache"
            );
            assert_eq!(r.header("x-kvgate-sim-cached-tokens"), Some("256"));
        }
    }
    assert!(
        stack
            .sidecar_metric(
                "kvgate_sidecar_kv_block_size_mismatch_total{dp_rank=\"0\",worker_id=\"1\"}"
            )
            .unwrap_or(0.0)
            + stack
                .sidecar_metric(
                    "kvgate_sidecar_kv_block_size_mismatch_total{dp_rank=\"0\",worker_id=\"2\"}"
                )
                .unwrap_or(0.0)
            + stack
                .sidecar_metric(
                    "kvgate_sidecar_kv_block_size_mismatch_total{dp_rank=\"0\",worker_id=\"3\"}"
                )
                .unwrap_or(0.0)
            > 0.0,
        "the page size is reported"
    );
}

/// A completion under an adapter or a salt (`model` may name either the
/// base model or an adapter).
fn complete_scoped(stack: &Stack, model: &str, salt: Option<&str>, tokens: &[u32]) -> Reply {
    wait_idle(stack);
    let mut body = json!({"model": model, "prompt": tokens, "max_tokens": 2});
    if let Some(salt) = salt {
        body["cache_salt"] = salt.into();
    }
    post(stack, "/v1/completions", body.to_string().as_bytes(), &[])
}

#[test]
fn adapters_and_salts_follow_their_own_cache_and_no_one_elses() {
    let _g = serial();
    let mut stack = start(StackConfig {
        workers: 3,
        kv_events: true,
        sim_args: ["--speedup", "50", "--lora-modules", "sql-lora"]
            .map(String::from)
            .to_vec(),
        model_toml: "lora_adapters = [\"sql-lora\"]".into(),
        ..StackConfig::default()
    });
    // Requests of another scope never match a holder's blocks: with equal
    // load they land where the tie-break sends them, on the holder about
    // one time in three. Were the blocks credited to them, every one would
    // go there.
    let pairs = [
        (("sql-lora", None), ("demo-model", None)),
        (("sql-lora", Some("tenant-a")), ("sql-lora", None)),
        (
            ("demo-model", Some("tenant-a")),
            ("demo-model", Some("tenant-b")),
        ),
    ];
    let mut group = 0;
    let mut homes = Vec::new();
    for ((model, salt), (other, other_salt)) in pairs {
        let mut on_holder = 0;
        for _ in 0..8 {
            group += 1;
            let holder = served_by(&complete_scoped(
                &stack,
                model,
                salt,
                &grouped(group, 0, 16),
            ))
            .0;
            homes.push((model, salt, group, holder.clone()));
            wait_indexed(&stack, 16.0 * f64::from(group));
            let r = complete_scoped(&stack, other, other_salt, &grouped(group, 1, 16));
            assert_eq!(r.header("x-kvgate-sim-cached-tokens"), Some("0"));
            on_holder += usize::from(served_by(&r).0 == holder);
        }
        assert!(
            on_holder < 8,
            "{other} {other_salt:?} followed {model} {salt:?} blocks it cannot use"
        );
    }
    let (_, metrics) = http::get(&stack.sidecar_addr(), "/metrics").unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    let unmatchable: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("kvgate_sidecar_kv_unmatchable_blocks_total{") && !l.ends_with(" 0")
        })
        .collect();
    assert!(
        unmatchable.is_empty(),
        "adapter and salt keys are ones kvgate reproduces: {unmatchable:?}"
    );
    // A restarted sidecar knows only what the engines' events say (its
    // routed-prefix memory is gone): requests of each scope still find
    // their own holder, with the whole prefix cached.
    stack.restart_sidecar().unwrap();
    stack.wait_routing_ready(Duration::from_secs(20)).unwrap();
    wait_indexed(&stack, 16.0 * f64::from(group));
    std::thread::sleep(Duration::from_millis(200));
    for (model, salt, g, holder) in homes.iter().step_by(4) {
        let r = complete_scoped(&stack, model, *salt, &grouped(*g, 2, 16));
        assert_eq!(&served_by(&r).0, holder, "{model} {salt:?} left its cache");
        assert_eq!(r.header("x-kvgate-sim-cached-tokens"), Some("256"));
    }
}

#[test]
fn text_prompts_follow_prefixes_learned_from_routing() {
    let _g = serial();
    // No KV events at all: the approximate mode is the only prefix signal.
    let stack = start(StackConfig {
        workers: 4,
        sim_args: ["--speedup", "50"].map(String::from).to_vec(),
        ..StackConfig::default()
    });
    let system =
        |g: u32| format!("You are assistant number {g} of the evaluation team. ").repeat(40);
    let ask = |g: u32, q: u32| {
        wait_idle(&stack);
        let r = chat_with_system(&stack, &system(g), &format!("Question {q} for group {g}?"));
        assert_eq!(r.status, 200, "{}", r.text());
        r.header("x-kvgate-sim-worker").unwrap().to_string()
    };
    let home: Vec<String> = (0..4).map(|g| ask(g, 0)).collect();
    // The decisions travel filter → queue → snapshot service → sidecar →
    // shards → Envoy; give them a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while stack
        .sidecar_metric("kvgate_sidecar_approx_learned_total")
        .unwrap_or(0.0)
        < 4.0
    {
        assert!(
            Instant::now() < deadline,
            "no routing decision reached the sidecar\n{}",
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    for q in 1..4 {
        for g in 0..4u32 {
            assert_eq!(
                ask(g, q),
                home[g as usize],
                "group {g} question {q} left its learned prefix"
            );
        }
    }
    assert!(stack.envoy_stat("kvgate_routed_reports_total").unwrap() >= 1);
    let state = stack.sidecar_state().unwrap();
    assert_eq!(state["models"][0]["mode"], "approximate");
}

fn chat_with_system(stack: &Stack, system: &str, question: &str) -> Reply {
    let body = json!({
        "model": "demo-model",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
    });
    post(
        stack,
        "/v1/chat/completions",
        body.to_string().as_bytes(),
        &[],
    )
}

#[test]
fn overload_sheds_then_recovers_and_every_request_gets_an_answer() {
    let _g = serial();
    // Four ranks (2 workers x 2 DP ranks) of 256 blocks, busy past half of
    // them. A 256-token request books 16 blocks, so about eight in flight
    // make a rank busy; 48 clients keep ~48 in flight: overload.
    let stack = start(StackConfig {
        workers: 2,
        dp_size: 2,
        sim_args: [
            "--num-gpu-blocks",
            "256",
            "--max-running",
            "4",
            "--decode-ms-per-token",
            "15",
            "--speedup",
            "1",
        ]
        .map(String::from)
        .to_vec(),
        model_toml: "active_decode_blocks_threshold = 0.5".into(),
        ..StackConfig::default()
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..48u32)
        .map(|c| {
            let addr = stack.envoy_addr();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    let r = completion(&addr, &unique_prompt(c * 1000 + i, 256), 8)
                        .unwrap_or_else(|e| panic!("a request got no answer: {e:#}"));
                    if r.status == 503 {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    seen.push(r);
                }
                seen
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let replies: Vec<Reply> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    let mut served_by = BTreeMap::<(String, String), usize>::new();
    let mut shed = 0;
    for r in &replies {
        match r.status {
            200 => {
                let w = r.header("x-kvgate-sim-worker").unwrap().to_string();
                let rank = r.header("x-kvgate-sim-rank").unwrap().to_string();
                *served_by.entry((w, rank)).or_default() += 1;
            }
            503 => {
                shed += 1;
                assert_eq!(r.header("x-kvgate-reason"), Some("all_workers_busy"));
                assert!(r.header("x-kvgate-sim-worker").is_none());
                let retry: u32 = r.header("retry-after").unwrap().parse().unwrap();
                assert!((1..=30).contains(&retry), "Retry-After {retry}");
            }
            s => panic!("unexpected status {s}: {}", r.text()),
        }
    }
    let admitted: usize = served_by.values().sum();
    eprintln!("overload: {admitted} admitted {served_by:?}, {shed} shed");
    assert!(shed > 0, "never shed under overload ({admitted} admitted)");
    assert!(admitted > 0);
    assert_eq!(
        served_by.len(),
        4,
        "every DP rank of both workers took work: {served_by:?}"
    );
    // The sidecar counted what the gateway did.
    let rejected = stack
        .sidecar_metric(
            "kvgate_sidecar_rejected_total{model=\"demo-model\",reason=\"all_workers_busy\"}",
        )
        .unwrap_or(0.0);
    assert!(rejected >= 1.0);
    // Load drains: bookings go back to zero and admission resumes.
    wait_bookings_drained(&stack);
    wait_idle(&stack);
    let r = completion(&stack.envoy_addr(), &unique_prompt(999_999, 64), 2).unwrap();
    assert_eq!(r.status, 200, "still shedding: {}", r.text());
    assert_eq!(
        stack
            .envoy_stat("kvgate_rejected_all_workers_busy_total")
            .unwrap(),
        shed as u64
    );
}

#[test]
fn one_busy_rank_of_two_leaves_the_worker_open() {
    let _g = serial();
    let stack = start(StackConfig {
        workers: 1,
        dp_size: 2,
        ..busy_prone()
    });
    let rank_busy = |rank: &str| -> bool {
        let s = stack.sidecar_state().unwrap();
        s["models"][0]["workers"][0]["ranks"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| {
                r["dp_rank"].as_u64().is_some_and(|v| v.to_string() == rank) && r["busy"] == true
            })
    };
    let hog = |tag: u32| {
        let addr = stack.envoy_addr();
        std::thread::spawn(move || completion(&addr, &unique_prompt(tag, 160), 120).unwrap())
    };
    let first = hog(1);
    // The hog's booking makes its rank busy; find which one it took.
    let deadline = Instant::now() + Duration::from_secs(5);
    let busy_rank = loop {
        if rank_busy("0") {
            break "0";
        }
        if rank_busy("1") {
            break "1";
        }
        assert!(Instant::now() < deadline, "the hog's rank never went busy");
        std::thread::sleep(Duration::from_millis(20));
    };
    let free_rank = if busy_rank == "0" { "1" } else { "0" };
    wait_envoy_has(
        &stack,
        stack.sidecar_state().unwrap()["version"].as_u64().unwrap(),
    );
    // One busy rank of two: the worker still takes work, on the free rank.
    for i in 0..3 {
        let r = completion(&stack.envoy_addr(), &unique_prompt(100 + i, 16), 1).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-kvgate-sim-rank"), Some(free_rank));
    }
    // Both ranks busy: the worker is busy and the model sheds.
    let second = hog(2);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !rank_busy(free_rank) {
        assert!(
            Instant::now() < deadline,
            "the second hog's rank never went busy"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_envoy_has(
        &stack,
        stack.sidecar_state().unwrap()["version"].as_u64().unwrap(),
    );
    let r = completion(&stack.envoy_addr(), &unique_prompt(200, 16), 1).unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    for h in [first, second] {
        assert_eq!(h.join().unwrap().status, 200);
    }
}

#[test]
fn thresholds_change_live_through_envoys_control_listener() {
    let _g = serial();
    // The busy-prone worker, with no threshold until the test sets one.
    let stack = start(StackConfig {
        workers: 1,
        model_toml: String::new(),
        control_token: Some("letmein".into()),
        ..busy_prone()
    });
    let control = stack.control_addr();
    let auth = [
        ("content-type", "application/json"),
        ("authorization", "Bearer letmein"),
    ];
    let post = |body: Value, headers: &[(&str, &str)]| {
        let (s, b) = http::request(
            &control,
            "POST",
            "/busy_threshold",
            headers,
            Some(body.to_string().as_bytes()),
        )
        .unwrap();
        (
            s,
            serde_json::from_slice::<Value>(&b).unwrap_or(Value::Null),
        )
    };
    // Without the token: 401, before anything else is looked at.
    let (s, _) = http::request(&control, "GET", "/busy_threshold", &[], None).unwrap();
    assert_eq!(s, 401);
    let (s, _) = post(
        json!({"model": "demo-model", "active_decode_blocks_threshold": 0.01}),
        &[("content-type", "application/json")],
    );
    assert_eq!(s, 401);
    let (s, b) = http::request(&control, "GET", "/busy_threshold", &auth, None).unwrap();
    assert_eq!(s, 200);
    assert_eq!(
        serde_json::from_slice::<Value>(&b).unwrap(),
        json!({"thresholds": [{"model": "demo-model"}]})
    );
    assert_eq!(
        post(
            json!({"model": "nope", "active_decode_blocks_threshold": 0.5}),
            &auth
        )
        .0,
        404
    );
    assert_eq!(
        post(
            json!({"model": "demo-model", "active_decode_blocks_threshold": 1.5}),
            &auth
        )
        .0,
        400
    );
    assert_eq!(
        post(
            json!({"model": "demo-model", "active_prefill_tokens_threshold": "many"}),
            &auth
        )
        .0,
        400
    );

    // A long request holds KV blocks; with no threshold nothing sheds.
    let addr = stack.envoy_addr();
    let hog = std::thread::spawn(move || completion(&addr, &unique_prompt(1, 160), 120).unwrap());
    let deadline = Instant::now() + Duration::from_secs(5);
    while stack.sidecar_state().unwrap()["models"][0]["workers"][0]["ranks"][0]
        ["active_decode_blocks"]
        .as_u64()
        .unwrap_or(0)
        == 0
    {
        assert!(Instant::now() < deadline, "the hog never showed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = completion(&stack.envoy_addr(), &unique_prompt(2, 16), 1).unwrap();
    assert_eq!(r.status, 200);

    // Tighten: the next snapshot Envoy takes sheds.
    let (s, b) = post(
        json!({"model": "demo-model", "active_decode_blocks_threshold": 0.01}),
        &auth,
    );
    assert_eq!(
        (s, &b["active_decode_blocks_threshold"]),
        (200, &json!(0.01))
    );
    let v = stack.sidecar_state().unwrap()["version"].as_u64().unwrap();
    wait_envoy_has(&stack, v);
    let r = completion(&stack.envoy_addr(), &unique_prompt(3, 16), 1).unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    // Unset it: admission resumes with the next snapshot.
    let (s, b) = post(
        json!({"model": "demo-model", "active_decode_blocks_threshold": null}),
        &auth,
    );
    assert_eq!((s, b), (200, json!({"model": "demo-model"})));
    let v = stack.sidecar_state().unwrap()["version"].as_u64().unwrap();
    wait_envoy_has(&stack, v);
    let r = completion(&stack.envoy_addr(), &unique_prompt(4, 16), 1).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(hog.join().unwrap().status, 200);
    assert_eq!(
        stack
            .sidecar_metric("kvgate_sidecar_threshold_changes_total{model=\"demo-model\"}")
            .unwrap_or(0.0),
        2.0
    );
}

#[test]
fn a_burst_across_envoy_threads_spreads_by_cost_not_onto_one_worker() {
    let _g = serial();
    let stack = start(StackConfig {
        workers: 4,
        kv_events: true,
        sim_args: burst_sim_args(),
        ..StackConfig::default()
    });
    // Every worker caches the burst's prompt first, straight from the
    // worker: the prefix credit is then the same everywhere and the spread
    // is the load's doing alone (otherwise identical requests rightly
    // follow whichever worker they reached first).
    let prompt: Vec<u32> = (0..64).collect();
    for w in &stack.workers {
        assert_eq!(completion(&w.endpoint(), &prompt, 1).unwrap().status, 200);
    }
    wait_indexed(&stack, 4.0);
    std::thread::sleep(Duration::from_millis(300));
    // Three long-running requests through Envoy book 4 blocks each on three
    // workers, one after the other; the fourth worker is then the least
    // loaded by 4 blocks, and without per-VM bookings the whole burst would
    // land there. With them, each Envoy thread fills that gap once (a
    // cached request books 1 block) and then spreads: about 56 there, 48
    // elsewhere.
    let mut hogs = Vec::new();
    for i in 0..3u32 {
        let addr = stack.envoy_addr();
        hogs.push(std::thread::spawn(move || {
            completion(&addr, &unique_prompt(i, 64), 400)
        }));
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let s = stack.sidecar_state().unwrap();
            let loaded = s["models"][0]["workers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|w| w["ranks"][0]["active_decode_blocks"].as_u64().unwrap_or(0) > 0)
                .count();
            if loaded == i as usize + 1 {
                wait_envoy_has(&stack, s["version"].as_u64().unwrap());
                break;
            }
            assert!(Instant::now() < deadline, "hog {i} never showed: {s}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let idle: String = stack.sidecar_state().unwrap()["models"][0]["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|w| w["ranks"][0]["active_decode_blocks"] == 0)
        .map(|w| w["worker_id"].to_string())
        .expect("one worker without a hog");
    let per_worker = burst(&[stack.envoy_addr()], 200, &prompt, 16);
    eprintln!("burst of 200: {per_worker:?}");
    let to_least_loaded = per_worker.get(&idle).copied().unwrap_or(0);
    // Herding would send nearly all 200 there.
    assert!(
        to_least_loaded <= 75,
        "the burst herded onto worker {idle}: {per_worker:?}"
    );
    assert!(
        per_worker.len() == 4 && per_worker.values().all(|n| *n >= 30),
        "the burst did not spread: {per_worker:?}"
    );
    for h in hogs {
        assert_eq!(h.join().unwrap().unwrap().status, 200);
    }
    wait_bookings_drained(&stack);
}
