//! The planner of a disaggregated model end to end on real Envoy: its
//! prefill and decode pools sized apart, the decision API an orchestrator
//! follows (a second prefill worker started, registered and reported
//! done), and a pool's scale-down draining one worker, which takes no new
//! leg of its pool and finishes what it has.

mod common;

use common::*;
use kvgate_stack::{Proc, Stack, StackConfig, http};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const MODEL: &str = "demo-model";

/// vLLM NIXL legs; a failed prefill leg fails the request, so that every
/// 200 went through a prefill worker.
const DISAGG: &str = "[models.disaggregation]\nprotocol = \"vllm-nixl\"\non_prefill_failure = \"fail\"\nprefill_timeout_ms = 5000\n";

const PRODUCER: [&str; 4] = ["--kv-role", "kv_producer", "--kv-side-channel-port", "0"];
const CONSUMER: [&str; 4] = ["--kv-role", "kv_consumer", "--kv-side-channel-port", "0"];

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Worker `i` (id `i + 1`) has `roles[i]`; `sim_args` for every sim, and
/// the model's disaggregation and `planner` tables.
fn fleet(roles: &[&str], sim_args: &[&str], planner: &str) -> StackConfig {
    StackConfig {
        workers: roles.len(),
        roles: strings(roles),
        sim_args: strings(sim_args),
        worker_sim_args: roles
            .iter()
            .map(|r| {
                strings(if *r == "prefill" {
                    &PRODUCER
                } else {
                    &CONSUMER
                })
            })
            .collect(),
        model_toml: format!("{DISAGG}{planner}"),
        ..StackConfig::default()
    }
}

/// `GET /v1/planner`'s view of the model.
fn planner(stack: &Stack) -> Value {
    let (status, body) = http::get(&stack.control_addr(), "/v1/planner").unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["models"][0].clone()
}

/// One pool of a planner view or a decision.
fn pool<'a>(v: &'a Value, role: &str) -> &'a Value {
    v["pools"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["role"] == role))
        .unwrap_or_else(|| panic!("no {role} pool in {v}"))
}

fn pool_roles(v: &Value) -> Vec<String> {
    v["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| p["role"].as_str().unwrap_or("?").to_string())
        .collect()
}

/// Waits until the planner's view satisfies `ok`.
fn wait_planner(stack: &Stack, what: &str, within: Duration, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let m = planner(stack);
        if ok(&m) {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "the planner never {what} within {within:?}: {m}\n{}",
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Follows the decision API as an orchestrator does: the decisions after
/// `after`, until one that `ok` accepts (returned with those passed over,
/// oldest first). `between` runs while none has come (traffic, say).
fn wait_decision(
    stack: &Stack,
    mut after: u64,
    what: &str,
    within: Duration,
    ok: impl Fn(&Value) -> bool,
    mut between: impl FnMut(),
) -> (Value, Vec<Value>) {
    let deadline = Instant::now() + within;
    let mut passed = Vec::new();
    loop {
        let (status, body) = http::get(
            &stack.control_addr(),
            &format!("/v1/planner/decisions?after={after}&wait_ms=200"),
        )
        .unwrap();
        match status {
            200 => {
                let d: Value = serde_json::from_slice(&body).unwrap();
                let id = d["id"].as_u64().expect("a decision has an id");
                assert!(id > after, "decision {id} came after {after}: {d}");
                after = id;
                if ok(&d) {
                    return (d, passed);
                }
                passed.push(d);
            }
            204 => between(),
            s => panic!(
                "the decision poll answered {s}: {}",
                String::from_utf8_lossy(&body)
            ),
        }
        assert!(
            Instant::now() < deadline,
            "no decision {what} within {within:?}; decisions seen: {passed:?}\nplanner: {}\n{}",
            planner(stack),
            stack.log_tails()
        );
    }
}

/// The orchestrator reports decision `id` carried out.
fn complete(stack: &Stack, id: u64) {
    let (status, _, body) = http::post_json(
        &stack.control_addr(),
        &format!("/v1/planner/decisions/{id}/complete"),
        b"",
    )
    .unwrap();
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));
}

/// The orchestrator removes a worker from the catalog.
fn remove(stack: &Stack, id: u64) {
    let (status, body) = http::request(
        &stack.control_addr(),
        "DELETE",
        &format!("/workers/{id}"),
        &[],
        None,
    )
    .unwrap();
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));
}

/// A completion of a prompt no worker holds, so that it takes the
/// prefill leg; every one must be served.
fn served_completion(stack: &Stack, tag: u32, prompt_tokens: u32, max_tokens: u32) -> Reply {
    let r = completion(
        &stack.envoy_addr(),
        &unique_prompt(tag, prompt_tokens),
        max_tokens,
    )
    .unwrap_or_else(|e| panic!("request failed: {e:#}\n{}", stack.log_tails()));
    assert_eq!(r.status, 200, "{}", r.text());
    r
}

/// A completion of a fresh 256-token prompt decoding `max_tokens`, sent
/// from a thread of its own.
fn send(stack: &Stack, tag: u32, max_tokens: u32) -> std::thread::JoinHandle<Reply> {
    let addr = stack.envoy_addr();
    std::thread::spawn(move || completion(&addr, &unique_prompt(tag, 256), max_tokens).unwrap())
}

/// How many of the requests each worker answered; every one must be
/// served.
fn answered(sent: Vec<std::thread::JoinHandle<Reply>>) -> std::collections::BTreeMap<u64, u32> {
    let mut per = std::collections::BTreeMap::new();
    for h in sent {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        *per.entry(answered_by(&r)).or_default() += 1;
    }
    per
}

/// The worker (by id) that answered: the decode leg's.
fn answered_by(r: &Reply) -> u64 {
    served_by(r).0.parse().unwrap()
}

/// A sim's index in the stack by its worker id.
fn index(stack: &Stack, id: u64) -> usize {
    stack
        .workers
        .iter()
        .position(|w| w.id == id)
        .unwrap_or_else(|| panic!("no worker {id}"))
}

/// Requests running on a sim now, by its own count.
fn running(endpoint: &str) -> u64 {
    let (status, body) = http::get(endpoint, "/sim/state").unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["running"].as_u64())
        .sum()
}

/// A sim's prefill or decode legs, by its own counter, at an endpoint.
fn legs_at(endpoint: &str, name: &str) -> u64 {
    let (status, body) = http::get(endpoint, "/sim/disagg").unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["counters"][name].as_u64().unwrap_or(0)
}

/// Waits until the sidecar's snapshot marks `id` draining and Envoy holds
/// that snapshot: the next request is routed on it.
fn wait_draining(stack: &Stack, id: u64) {
    wait_published(
        stack,
        &format!("worker {id} never showed draining"),
        Duration::from_secs(10),
        |state| {
            state["models"][0]["workers"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|w| w["worker_id"] == id && w["draining"] == true)
        },
    );
}

/// A streamed completion's parts: its status, the worker that answered,
/// how many token chunks came, and whether it ended with `[DONE]` after a
/// `length` finish.
struct Streamed {
    status: u16,
    worker: Option<u64>,
    tokens: usize,
    finished: bool,
    text: String,
}

fn stream(addr: &str, prompt: &[u32], max_tokens: u32) -> Streamed {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": true});
    let (status, headers, body) = http::request_full(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        Some(body.to_string().as_bytes()),
    )
    .unwrap_or_else(|e| panic!("stream failed: {e:#}"));
    let text = String::from_utf8_lossy(&body).into_owned();
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| d.starts_with('{'))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let tokens = chunks
        .iter()
        .filter(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty()))
        .count();
    let finished = chunks
        .last()
        .is_some_and(|c| c["choices"][0]["finish_reason"] == "length")
        && text.trim_end().ends_with("data: [DONE]");
    Streamed {
        status,
        worker: headers
            .iter()
            .find(|(k, _)| k == "x-kvgate-sim-worker")
            .and_then(|(_, v)| v.parse().ok()),
        tokens,
        finished,
        text,
    }
}

#[test]
fn a_prefill_pool_over_its_ttft_sla_asks_for_a_prefill_worker_and_the_orchestrator_brings_it() {
    let _g = serial();
    // One prefill and one decode worker. Any prefill leg takes longer than
    // 0.01 ms: the prefill pool is over its TTFT SLA once it has samples.
    // The decode pool is far under its ITL SLA, at its minimum of one.
    let stack = start(fleet(
        &["prefill", "decode"],
        &["--speedup", "20"],
        "[models.planner]\nttft_ms = 0.01\nitl_ms = 60000\nload_interval_ms = 300\nthroughput_interval_ms = 600000\nmin_replicas = 1\n[models.planner.prefill]\nmax_replicas = 3\n",
    ));
    wait_workers(&stack, 2);
    let m = planner(&stack);
    assert_eq!(m["disaggregated"], true, "{m}");
    assert_eq!(pool_roles(&m), ["prefill", "decode"], "{m}");

    // Long prompts, one at a time, until the prefill pool asks for more.
    let mut tag = 0;
    let (first, passed) = wait_decision(
        &stack,
        0,
        "with num_prefill = 2",
        Duration::from_secs(30),
        |d| d["num_prefill"] == 2,
        || {
            tag += 1;
            served_completion(&stack, tag, 2000, 2);
        },
    );
    assert!(tag >= 10, "the fits need ten samples first: {tag} requests");
    let first_id = first["id"].as_u64().unwrap();
    assert_eq!(first["model"], MODEL);
    assert_eq!(
        first["num_decode"], 1,
        "the decode pool is unchanged: {first}"
    );
    assert_eq!(first["reason"], "scale_up", "{first}");
    assert_eq!(
        (first["desired"].as_u64(), first["ready"].as_u64()),
        (Some(3), Some(2)),
        "{first}"
    );
    assert_eq!(pool_roles(&first), ["prefill", "decode"], "{first}");
    let p = pool(&first, "prefill");
    assert_eq!(
        (&p["desired"], &p["ready"], &p["reason"], &p["changed"]),
        (&json!(2), &json!(1), &json!("scale_up"), &json!(true)),
        "{first}"
    );
    let d = pool(&first, "decode");
    assert_eq!(
        (&d["desired"], &d["ready"], &d["changed"]),
        (&json!(1), &json!(1), &json!(false)),
        "{first}"
    );
    assert_eq!(first["drain"], json!([]), "a scale-up drains nothing");
    assert!(first.get("switch").is_none(), "no switch: {first}");
    for d in &passed {
        assert_ne!(d["reason"], "scale_up", "an earlier scale-up: {d}");
    }
    let m = planner(&stack);
    let p = pool(&m, "prefill");
    assert_eq!(p["pending"]["id"], first_id, "{m}");
    assert_eq!(
        (&p["pending"]["from"], &p["pending"]["to"]),
        (&json!(1), &json!(2))
    );
    assert!(
        p["scale_up_eta_ms"].as_u64().is_some(),
        "a scale-up has an ETA: {m}"
    );
    assert!(pool(&m, "decode")["pending"].is_null(), "{m}");
    assert_eq!(
        stack
            .sidecar_metric(&format!(
                "kvgate_planner_pool_desired_replicas{{model=\"{MODEL}\",role=\"prefill\"}}"
            ))
            .unwrap(),
        2.0
    );

    // The orchestrator starts a prefill worker, registers it, and reports
    // the decision done.
    let port = kvgate_stack::free_ports(1).unwrap()[0];
    let endpoint = format!("127.0.0.1:{port}");
    let mut args = strings(&[
        "--listen",
        &endpoint,
        "--worker-id",
        "3",
        "--model",
        MODEL,
        "--block-size",
        "16",
        "--speedup",
        "20",
    ]);
    args.extend(strings(&PRODUCER));
    let _new = Proc::spawn(
        "worker-3",
        &stack.paths.bin("kvgate-sim"),
        &args,
        &stack.run_dir,
    )
    .unwrap();
    http::wait_for_status(&endpoint, "/health", 200, Duration::from_secs(20)).unwrap();
    let body = json!({"worker_id": 3, "model_name": MODEL, "endpoint": endpoint, "block_size": 16, "role": "prefill"});
    let (status, _, reply) = http::post_json(
        &stack.control_addr(),
        "/workers",
        body.to_string().as_bytes(),
    )
    .unwrap();
    assert!(
        (200..300).contains(&status),
        "registering: {status} {}",
        String::from_utf8_lossy(&reply)
    );
    complete(&stack, first_id);
    // The first decision is no longer what the pool waits on.
    let m = planner(&stack);
    assert_ne!(pool(&m, "prefill")["pending"]["id"], first_id, "{m}");
    let m = wait_planner(
        &stack,
        "counted the new prefill worker",
        Duration::from_secs(10),
        |m| pool(m, "prefill")["ready"] == 2,
    );
    assert_eq!(pool(&m, "decode")["ready"], 1, "{m}");

    // The new worker is as slow as the SLA says every worker is: the pool
    // asks for a third, from two ready; the decode pool still holds.
    let (second, _) = wait_decision(
        &stack,
        first_id,
        "with num_prefill = 3",
        Duration::from_secs(10),
        |d| d["num_prefill"] == 3,
        || {},
    );
    let second_id = second["id"].as_u64().unwrap();
    assert!(second_id > first_id);
    assert_eq!(second["num_decode"], 1, "{second}");
    assert_eq!(second["reason"], "scale_up", "{second}");
    assert_eq!(
        (second["desired"].as_u64(), second["ready"].as_u64()),
        (Some(4), Some(3)),
        "{second}"
    );
    let p = pool(&second, "prefill");
    assert_eq!(
        (&p["desired"], &p["ready"], &p["changed"]),
        (&json!(3), &json!(2), &json!(true)),
        "{second}"
    );
    assert_eq!(pool(&second, "decode")["changed"], false, "{second}");
    let m = planner(&stack);
    let p = pool(&m, "prefill");
    assert_eq!(
        (
            &p["pending"]["id"],
            &p["pending"]["from"],
            &p["pending"]["to"]
        ),
        (&json!(second_id), &json!(2), &json!(3)),
        "{m}"
    );
    assert_eq!((&p["desired"], &p["ready"]), (&json!(3), &json!(2)), "{m}");
    assert_eq!((&m["desired"], &m["ready"]), (&json!(4), &json!(3)), "{m}");
    assert!(pool(&m, "decode")["pending"].is_null(), "{m}");
    for (role, want) in [("prefill", 3.0), ("decode", 1.0)] {
        let series =
            format!("kvgate_planner_pool_desired_replicas{{model=\"{MODEL}\",role=\"{role}\"}}");
        assert_eq!(stack.sidecar_metric(&series).unwrap(), want, "{series}");
    }

    // The new worker serves prefill legs: it is in the routed catalog.
    let before = legs_at(&endpoint, "prefill_legs");
    let deadline = Instant::now() + Duration::from_secs(10);
    while legs_at(&endpoint, "prefill_legs") == before {
        assert!(
            Instant::now() < deadline,
            "the new prefill worker never took a leg"
        );
        let sent: Vec<_> = (0..2)
            .map(|k| {
                let addr = stack.envoy_addr();
                tag += 1;
                let prompt = unique_prompt(tag + 1000 * k, 2000);
                std::thread::spawn(move || completion(&addr, &prompt, 2))
            })
            .collect();
        for s in sent {
            let r = s.join().unwrap().unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
    }
}

#[test]
fn a_drained_decode_worker_takes_no_new_decode_legs_and_finishes_its_streams() {
    let _g = serial();
    // One prefill and two decode workers decoding in real time (40 ms a
    // token). An ITL SLA no worker comes near: the decode pool is
    // oversized, down to its minimum of one; the prefill pool is at its
    // minimum of one.
    let stack = start(fleet(
        &["prefill", "decode", "decode"],
        &["--speedup", "1", "--decode-ms-per-token", "40"],
        "[models.planner]\nttft_ms = 60000\nitl_ms = 60000\nload_interval_ms = 300\nthroughput_interval_ms = 600000\nmin_replicas = 1\n[models.planner.decode]\nmin_replicas = 1\nsensitivity = 0.5\n",
    ));
    wait_workers(&stack, 3);
    let decoders = [2u64, 3];
    let endpoint = |id: u64| stack.workers[index(&stack, id)].endpoint();

    // Long streams, each sent once Envoy holds the snapshot showing the
    // ones before it running, so they spread over both decode workers.
    const STREAM_TOKENS: u32 = 300;
    let streams: Vec<_> = (0..4u32)
        .map(|k| {
            let addr = stack.envoy_addr();
            let h = std::thread::spawn(move || {
                stream(&addr, &unique_prompt(900 + k, 64), STREAM_TOKENS)
            });
            let n = u64::from(k) + 1;
            wait_published(
                &stack,
                &format!("{n} streams never ran"),
                Duration::from_secs(10),
                |state| {
                    let ws = state["models"][0]["workers"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default();
                    let running: u64 = ws
                        .iter()
                        .filter(|w| w["role"] == "decode")
                        .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
                        .filter_map(|r| r["running"].as_u64())
                        .sum();
                    running >= n
                },
            );
            h
        })
        .collect();
    let per: Vec<u64> = decoders.iter().map(|id| running(&endpoint(*id))).collect();
    assert!(
        per.iter().all(|n| *n >= 1),
        "the streams did not spread over both decode workers: {per:?}"
    );

    // Requests that overlap (a new one every 200 ms, each decoding for
    // 800 ms) until the fits have their samples and the planner drains a
    // decode worker. The router spreads them over both decode workers.
    let mut tag = 0;
    let mut warm = Vec::new();
    let (d, _) = wait_decision(
        &stack,
        0,
        "draining a decode worker",
        Duration::from_secs(20),
        |d| !d["drain"].as_array().is_none_or(Vec::is_empty),
        || {
            tag += 1;
            warm.push(send(&stack, tag, 20));
        },
    );
    let warm = answered(warm);
    assert_eq!(
        warm.keys().copied().collect::<Vec<_>>(),
        decoders,
        "the decode legs did not spread over both decode workers: {warm:?}"
    );
    assert!(
        streams.iter().all(|h| !h.is_finished()),
        "the streams ended before the drain: the test proves nothing"
    );
    let drained = d["drain"][0].as_u64().unwrap();
    let kept = if drained == 2 { 3 } else { 2 };
    assert!(decoders.contains(&drained), "drained a decode worker: {d}");
    assert_eq!(d["drain"].as_array().unwrap().len(), 1, "{d}");
    assert_eq!(
        (&d["num_prefill"], &d["num_decode"], &d["reason"]),
        (&json!(1), &json!(1), &json!("scale_down")),
        "{d}"
    );
    let p = pool(&d, "decode");
    assert_eq!(
        (&p["desired"], &p["ready"], &p["changed"], &p["reason"]),
        (&json!(1), &json!(2), &json!(true), &json!("scale_down")),
        "{d}"
    );
    assert_eq!(pool(&d, "prefill")["changed"], false, "{d}");
    let in_flight = running(&endpoint(drained));
    assert!(in_flight >= 1, "the drained worker has streams in flight");
    let m = planner(&stack);
    assert_eq!(m["draining"], json!([drained]), "{m}");
    assert_eq!(
        pool(&m, "decode")["ready"],
        1,
        "a draining worker is not ready: {m}"
    );

    // New requests, overlapping as before: every decode leg on the worker
    // kept.
    wait_draining(&stack, drained);
    let legs_before = legs_at(&endpoint(drained), "decode_legs");
    let sent: Vec<_> = (0..12)
        .map(|k| {
            let h = send(&stack, 500 + k, 20);
            std::thread::sleep(Duration::from_millis(150));
            h
        })
        .collect();
    let after = answered(sent);
    assert_eq!(
        after.keys().copied().collect::<Vec<_>>(),
        [kept],
        "requests decoded on the draining worker: {after:?}"
    );
    assert_eq!(
        legs_at(&endpoint(drained), "decode_legs"),
        legs_before,
        "the draining worker took a decode leg"
    );

    // What it had in flight finishes, every token of it.
    let mut on_drained = 0;
    for h in streams {
        let s = h.join().unwrap();
        assert_eq!(s.status, 200, "{}", s.text);
        assert!(
            s.tokens == STREAM_TOKENS as usize && s.finished,
            "a stream on worker {:?} ended after {} of {STREAM_TOKENS} tokens:\n{}",
            s.worker,
            s.tokens,
            s.text
        );
        on_drained += usize::from(s.worker == Some(drained));
    }
    assert!(on_drained >= 1, "no stream was on the drained worker");

    // The orchestrator removes it and reports the decision done.
    assert_eq!(running(&endpoint(drained)), 0);
    remove(&stack, drained);
    complete(&stack, d["id"].as_u64().unwrap());
    let m = planner(&stack);
    assert_eq!(m["draining"], json!([]), "{m}");
    assert!(pool(&m, "decode")["pending"].is_null(), "{m}");
    let r = served_completion(&stack, 600, 256, 2);
    assert_eq!(answered_by(&r), kept);
}

#[test]
fn a_drained_prefill_worker_takes_no_new_prefill_legs() {
    let _g = serial();
    // Two prefill workers and one decode worker; a TTFT SLA no worker
    // comes near: the prefill pool is oversized, down to its minimum of
    // one. The decode pool is at its minimum of one.
    let stack = start(fleet(
        &["prefill", "prefill", "decode"],
        &["--speedup", "20"],
        "[models.planner]\nttft_ms = 60000\nitl_ms = 60000\nload_interval_ms = 300\nthroughput_interval_ms = 600000\nmin_replicas = 1\n[models.planner.prefill]\nmin_replicas = 1\nsensitivity = 0.5\n",
    ));
    wait_workers(&stack, 3);
    let prefill_legs =
        |id: u64| legs_at(&stack.workers[index(&stack, id)].endpoint(), "prefill_legs");

    // Long prompts, two at a time, until the planner drains a prefill
    // worker.
    let mut tag = 0;
    let (d, _) = wait_decision(
        &stack,
        0,
        "draining a prefill worker",
        Duration::from_secs(20),
        |d| !d["drain"].as_array().is_none_or(Vec::is_empty),
        || {
            let sent: Vec<_> = (0..2)
                .map(|_| {
                    tag += 1;
                    let addr = stack.envoy_addr();
                    let prompt = unique_prompt(tag, 1500);
                    std::thread::spawn(move || completion(&addr, &prompt, 2))
                })
                .collect();
            for s in sent {
                let r = s.join().unwrap().unwrap();
                assert_eq!(r.status, 200, "{}", r.text());
            }
        },
    );
    // Both took legs before: the router would send the next ones to either.
    let warm = [prefill_legs(1), prefill_legs(2)];
    assert!(
        warm.iter().all(|n| *n >= 1),
        "the prefill legs did not spread over both prefill workers: {warm:?}"
    );
    let drained = d["drain"][0].as_u64().unwrap();
    assert!([1, 2].contains(&drained), "drained a prefill worker: {d}");
    let kept = 3 - drained;
    assert_eq!(d["drain"].as_array().unwrap().len(), 1, "{d}");
    assert_eq!(
        (&d["num_prefill"], &d["num_decode"], &d["reason"]),
        (&json!(1), &json!(1), &json!("scale_down")),
        "{d}"
    );
    let p = pool(&d, "prefill");
    assert_eq!(
        (&p["desired"], &p["ready"], &p["changed"], &p["reason"]),
        (&json!(1), &json!(2), &json!(true), &json!("scale_down")),
        "{d}"
    );
    assert_eq!(pool(&d, "decode")["changed"], false, "{d}");

    // New requests, two at a time: every prefill leg on the worker kept.
    wait_draining(&stack, drained);
    let before = [prefill_legs(drained), prefill_legs(kept)];
    const AFTER: u64 = 12;
    for k in 0..AFTER / 2 {
        let sent: Vec<_> = (0..2)
            .map(|j| {
                let addr = stack.envoy_addr();
                let prompt = unique_prompt(700 + 2 * k as u32 + j, 1500);
                std::thread::spawn(move || completion(&addr, &prompt, 2))
            })
            .collect();
        for s in sent {
            let r = s.join().unwrap().unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(answered_by(&r), 3);
        }
    }
    assert_eq!(
        prefill_legs(drained),
        before[0],
        "the draining prefill worker took a prefill leg"
    );
    assert_eq!(
        prefill_legs(kept),
        before[1] + AFTER,
        "every prefill leg on the worker kept"
    );

    // The orchestrator removes it and reports the decision done.
    remove(&stack, drained);
    complete(&stack, d["id"].as_u64().unwrap());
    let m = planner(&stack);
    assert_eq!(m["draining"], json!([]), "{m}");
    let p = pool(&m, "prefill");
    assert_eq!((&p["desired"], &p["ready"]), (&json!(1), &json!(1)), "{m}");
    assert!(p["pending"].is_null(), "{m}");
}
