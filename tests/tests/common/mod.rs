//! Helpers shared by the end-to-end test binaries.
// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use kvgate_stack::{Gateway, Stack, StackConfig, http};
use serde_json::{Value, json};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn post(stack: &Stack, path: &str, body: &[u8], headers: &[(&str, &str)]) -> Reply {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let (status, headers, body) =
        http::request_full(&stack.envoy_addr(), "POST", path, &h, Some(body))
            .unwrap_or_else(|e| panic!("request failed: {e:#}\n{}", stack.log_tails()));
    Reply {
        status,
        headers,
        body,
    }
}

pub fn chat(stack: &Stack, model: &str, text: &str, max_tokens: u32) -> Reply {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    });
    post(
        stack,
        "/v1/chat/completions",
        body.to_string().as_bytes(),
        &[],
    )
}

/// Two workers that a single long request makes busy: tiny KV caches and
/// slow decoding, so its decode blocks pass the threshold (10 % of 64)
/// for as long as it runs.
pub fn busy_prone() -> StackConfig {
    StackConfig {
        workers: 2,
        sim_args: [
            "--num-gpu-blocks",
            "64",
            "--decode-ms-per-token",
            "40",
            "--speedup",
            "1",
            "--default-max-tokens",
            "4",
        ]
        .map(String::from)
        .to_vec(),
        model_toml: "active_decode_blocks_threshold = 0.1".into(),
        ..StackConfig::default()
    }
}

/// Workers that take a whole burst at once (256 running) and decode in
/// real time, slowly (10 ms a token): the load each request of a burst
/// books lasts while the burst arrives, so where the burst goes shows how
/// the cost spreads load.
pub fn burst_sim_args() -> Vec<String> {
    [
        "--max-running",
        "256",
        "--decode-ms-per-token",
        "10",
        "--speedup",
        "1",
    ]
    .map(String::from)
    .to_vec()
}

pub fn start(config: StackConfig) -> Stack {
    Stack::start(config).unwrap_or_else(|e| panic!("stack failed to start: {e:#}"))
}

/// Completions served by all workers, from their own metrics.
pub fn served_total(stack: &Stack) -> u64 {
    let mut total = 0;
    for w in &stack.workers {
        if let Ok((200, body)) = http::get(&w.endpoint(), "/sim/state") {
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            total += v["requests_total"].as_u64().unwrap_or(0);
        }
    }
    total
}

/// (worker, rank) that served a reply.
pub fn served_by(r: &Reply) -> (String, String) {
    assert_eq!(r.status, 200, "{}", r.text());
    (
        r.header("x-kvgate-sim-worker").unwrap().to_string(),
        r.header("x-kvgate-sim-rank").unwrap().to_string(),
    )
}

pub fn bookings_active(stack: &Stack) -> f64 {
    stack
        .sidecar_metric("kvgate_sidecar_bookings_active{model=\"demo-model\"}")
        .unwrap_or(-1.0)
}

/// Waits until the gateway's bookings are all released and the sidecar's
/// state shows no booked prefill anywhere.
pub fn wait_bookings_drained(stack: &Stack) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let state = stack.sidecar_state().unwrap();
        let prefill: u64 = state["models"][0]["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
            .map(|r| r["active_prefill_tokens"].as_u64().unwrap_or(0))
            .sum();
        let active = bookings_active(stack);
        if active == 0.0 && prefill == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "bookings never drained: {active} active, {prefill} prefill tokens"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A completion with `n` tokens unique to `tag`, so no prefix is shared.
pub fn unique_prompt(tag: u32, n: u32) -> Vec<u32> {
    let base = tag.wrapping_mul(10_007).wrapping_add(50_000_000);
    (0..n).map(|k| base.wrapping_add(k)).collect()
}

pub fn completion(addr: &str, prompt: &[u32], max_tokens: u32) -> anyhow::Result<Reply> {
    let body = json!({"model": "demo-model", "prompt": prompt, "max_tokens": max_tokens});
    let (status, headers, body) = http::request_full(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        Some(body.to_string().as_bytes()),
    )?;
    Ok(Reply {
        status,
        headers,
        body,
    })
}

/// Sends `n` completions of `prompt` at once (a barrier releases them
/// together), request `i` through `addrs[i % addrs.len()]`; every one must
/// succeed. Returns how many each worker served.
pub fn burst(
    addrs: &[String],
    n: usize,
    prompt: &[u32],
    max_tokens: u32,
) -> std::collections::BTreeMap<String, usize> {
    let start = std::sync::Arc::new(std::sync::Barrier::new(n));
    let sent: Vec<_> = (0..n)
        .map(|i| {
            let addr = addrs[i % addrs.len()].clone();
            let start = start.clone();
            let prompt = prompt.to_vec();
            std::thread::spawn(move || {
                start.wait();
                completion(&addr, &prompt, max_tokens).unwrap()
            })
        })
        .collect();
    let mut per_worker = std::collections::BTreeMap::new();
    for r in sent {
        let r = r.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        *per_worker
            .entry(r.header("x-kvgate-sim-worker").unwrap().to_string())
            .or_default() += 1;
    }
    per_worker
}

/// Waits until the sidecar's state satisfies `ready` and Envoy holds that
/// snapshot, so the next request is decided on it; `what` names the wait
/// in the failure.
pub fn wait_published(stack: &Stack, what: &str, within: Duration, ready: impl Fn(&Value) -> bool) {
    wait_published_at(&stack.gateways[0], what, within, ready);
}

/// [`wait_published`] at gateway `g`, its sidecar and its Envoy; the
/// state that satisfied `ready`.
pub fn wait_published_at(
    g: &Gateway,
    what: &str,
    within: Duration,
    ready: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let state = g.sidecar_state().unwrap();
        let version = state["version"].as_u64().unwrap_or(u64::MAX);
        if ready(&state) && g.envoy_stat("kvgate_snapshot_version").unwrap_or(0) >= version {
            return state;
        }
        assert!(Instant::now() < deadline, "{what}: {state}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the sidecar's snapshot shows `n` busy workers and Envoy
/// holds that snapshot: the next request is decided on it.
pub fn wait_busy(stack: &Stack, n: usize) {
    let what = format!("{n} workers never became busy");
    wait_published(stack, &what, Duration::from_secs(5), |state| {
        let busy = state["models"][0]["workers"]
            .as_array()
            .map(|ws| ws.iter().filter(|w| w["ranks"][0]["busy"] == true).count())
            .unwrap_or(0);
        busy >= n
    });
}

/// Workers 1 and 2 prefill, 3 and 4 decode, with these sims' arguments
/// and the model's `[models.disaggregation]` table.
pub fn pd_config(producer: &[&str], consumer: &[&str], model_toml: String) -> StackConfig {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    StackConfig {
        workers: 4,
        roles: ["prefill", "prefill", "decode", "decode"]
            .map(String::from)
            .to_vec(),
        worker_sim_args: vec![
            args(producer),
            args(producer),
            args(consumer),
            args(consumer),
        ],
        model_toml,
        ..StackConfig::default()
    }
}

/// What a sim's `/sim/disagg` says.
pub fn sim_disagg(stack: &Stack, worker: usize) -> Value {
    let (status, body) = http::get(&stack.workers[worker].endpoint(), "/sim/disagg").unwrap();
    assert_eq!(status, 200);
    serde_json::from_slice(&body).unwrap()
}

/// One of a sim's prefill/decode counters.
pub fn sim_counter(stack: &Stack, worker: usize, name: &str) -> u64 {
    sim_disagg(stack, worker)["counters"][name]
        .as_u64()
        .unwrap_or(0)
}

/// Prefill legs served by both prefill workers (1 and 2).
pub fn prefill_legs(stack: &Stack) -> u64 {
    sim_counter(stack, 0, "prefill_legs") + sim_counter(stack, 1, "prefill_legs")
}

/// Every request a running sim recorded, oldest first.
pub fn recent(stack: &Stack, worker: usize) -> Vec<Value> {
    sim_disagg(stack, worker)["recent"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The newest request a sim recorded.
pub fn last_seen(stack: &Stack, worker: usize) -> Value {
    recent(stack, worker).pop().unwrap_or(Value::Null)
}

/// The decode worker (3 or 4) that served a reply, as an index.
pub fn decode_worker(r: &Reply) -> usize {
    let (worker, _) = served_by(r);
    let id: usize = worker.parse().unwrap();
    assert!(
        id == 3 || id == 4,
        "served by worker {id}, not a decode worker"
    );
    id - 1
}

/// Waits until the sidecar's published state lists `n` workers up, and
/// Envoy holds that snapshot.
pub fn wait_workers(stack: &Stack, n: usize) {
    wait_published(
        stack,
        &format!("the state never listed {n} workers"),
        Duration::from_secs(20),
        |state| state["models"][0]["workers"].as_array().map_or(0, Vec::len) == n,
    );
}
