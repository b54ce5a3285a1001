//! Pulls on real Envoy: three simulated vLLM workers, every one `both`
//! (`kv_both`, NIXL side channels on free ports, a decode leg whose blocks
//! cannot be loaded computing the prompt itself), of a model that pulls.
//! One long request makes its worker busy by decode while it holds a
//! prompt's prefix; the same prompt with a few more tokens is then
//! prefilled there and decoded on an idle worker that pulls the KV over
//! the holder's side channel. A stack per way the pull can end: the blocks
//! moved, the holder's lease gone before the pull, the prefill leg itself
//! failed.

mod common;

use common::*;
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The prompt the long request caches: 64 full blocks.
const PREFIX_TOKENS: u32 = 1024;
/// What the second request adds: two full blocks and a partial one.
const SUFFIX_TOKENS: u32 = 40;
/// The long request's answer: at 25 ms a token, about 15 s of decoding,
/// far longer than the waits between it and the second request.
const LONG_TOKENS: u32 = 600;
/// The sim's default `--kv-bytes-per-block`.
const BYTES_PER_BLOCK: u64 = 2 * 1024 * 1024;

/// Three `kv_both` workers with 1000-block caches decoding in real time;
/// the model is busy past 5 % of a cache in decode blocks, so the long
/// request (over 100 blocks) makes its worker busy for as long as it runs
/// while a worker decoding nothing stays free.
fn pull_stack(sim_args: &[&str], prefill_timeout_ms: u64) -> Stack {
    let mut args: Vec<String> = [
        "--speedup",
        "1",
        "--decode-ms-per-token",
        "25",
        "--num-gpu-blocks",
        "1000",
        "--kv-role",
        "kv_both",
        "--kv-side-channel-port",
        "0",
        "--kv-load-failure-policy",
        "recompute",
    ]
    .map(String::from)
    .to_vec();
    args.extend(sim_args.iter().map(|s| s.to_string()));
    let stack = start(StackConfig {
        workers: 3,
        kv_events: true,
        selection_api: true,
        sim_args: args,
        model_toml: format!(
            "active_decode_blocks_threshold = 0.05\n\
             [models.disaggregation]\n\
             protocol = \"vllm-nixl\"\n\
             prefill_timeout_ms = {prefill_timeout_ms}\n\
             [models.disaggregation.pull]\n\
             min_blocks = 4\n\
             kv_bytes_per_token = 131072\n\
             prefill_tokens_per_s = 10000.0\n\
             [models.disaggregation.pull.link]\n\
             same_node_gbps = 400.0\n\
             same_rack_gbps = 200.0\n\
             elsewhere_gbps = 100.0\n"
        ),
        ..StackConfig::default()
    });
    wait_workers(&stack, 3);
    stack
}

fn prefix() -> Vec<u32> {
    unique_prompt(70, PREFIX_TOKENS)
}

/// The prefix and a few tokens of its own.
fn extended() -> Vec<u32> {
    let mut p = prefix();
    p.extend(unique_prompt(71, SUFFIX_TOKENS));
    p
}

fn body(prompt: &[u32], max_tokens: u32, stream: bool) -> Vec<u8> {
    json!({"model": "demo-model", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
        .to_string()
        .into_bytes()
}

/// The long request, streaming from its own thread.
fn send_long(stack: &Stack) -> std::thread::JoinHandle<Reply> {
    send_at(stack, &body(&prefix(), LONG_TOKENS, true))
}

/// The worker `x-kvgate-served-by` names, by id.
fn served_by_kvgate(r: &Reply) -> u64 {
    let v = r
        .header("x-kvgate-served-by")
        .unwrap_or_else(|| panic!("no served-by header: {:?}", r.headers));
    v.strip_prefix("worker_id=")
        .and_then(|v| v.split(';').next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("served-by {v:?}"))
}

/// The id of the only busy worker in a published state.
fn busy_worker(state: &Value) -> Option<u64> {
    let busy: Vec<u64> = state["models"][0]["workers"]
        .as_array()?
        .iter()
        .filter(|w| w["ranks"][0]["busy"] == true)
        .filter_map(|w| w["worker_id"].as_u64())
        .collect();
    (busy.len() == 1).then(|| busy[0])
}

/// What the sidecar's selection API would do with `prompt` now.
fn select(stack: &Stack, prompt: &[u32]) -> Value {
    let req = json!({"model_name": "demo-model", "token_ids": prompt});
    let (status, _, body) = http::post_json(
        &stack.gateways[0].selection_addr(),
        "/select",
        req.to_string().as_bytes(),
    )
    .unwrap();
    let v = serde_json::from_slice(&body).unwrap_or(Value::Null);
    assert_eq!(status, 200, "{v}");
    v
}

/// Blocks the sidecar's index holds, from the workers' KV events (the
/// gauge lags by up to a second).
fn indexed_blocks(stack: &Stack) -> f64 {
    stack
        .sidecar_metric("kvgate_sidecar_kv_indexed_blocks{model=\"demo-model\"}")
        .unwrap_or(0.0)
}

/// Waits until Envoy holds everything the sidecar had published when
/// called. Envoy's root polls one at a time and writes an answer before
/// it sends the next poll: once two more have been sent, the first of
/// them was sent after this call, and was answered with everything
/// published before it.
fn wait_envoy_caught_up(stack: &Stack) {
    let polls = || stack.envoy_stat("kvgate_snapshot_polls_total").unwrap_or(0);
    let from = polls();
    let deadline = Instant::now() + Duration::from_secs(20);
    while polls() < from + 2 {
        assert!(
            Instant::now() < deadline,
            "Envoy stopped polling the sidecar\n{}",
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the long request and waits until Envoy decides on a view in
/// which its worker, busy with it, holds the prefix and would take the
/// extended prompt's prefill leg for an idle worker that pulls. Returns
/// the holder's id and the long request's thread.
fn hold_and_load(stack: &Stack) -> (u64, std::thread::JoinHandle<Reply>) {
    let long = send_long(stack);
    let deadline = Instant::now() + Duration::from_secs(30);
    // The selection API decides on the published snapshot and index, as
    // Envoy does. The prefix is credited to the worker the moment it is
    // routed there, for a while; its KV events make that last.
    let holder = loop {
        let state = stack.sidecar_state().unwrap();
        if let Some(holder) = busy_worker(&state) {
            let v = select(stack, &extended());
            if v["placement"]["kind"] == "pull"
                && v["disaggregation"]["prefill"]["worker_id"] == holder
                && indexed_blocks(stack) >= f64::from(PREFIX_TOKENS / 16)
            {
                break holder;
            }
        }
        assert!(
            !long.is_finished(),
            "the long request ended before its worker was seen busy holding the prefix: {}\n{state}",
            select(stack, &extended()),
        );
        assert!(
            Instant::now() < deadline,
            "the selection API never pulled: {}\n{state}\n{}",
            select(stack, &extended()),
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    wait_envoy_caught_up(stack);
    assert!(
        !long.is_finished(),
        "the long request ended before the next could be sent"
    );
    (holder, long)
}

/// `/sim/disagg`'s counters of worker `id` (1-based).
fn counters(stack: &Stack, id: u64) -> Value {
    sim_disagg(stack, id as usize - 1)["counters"].clone()
}

fn counter(stack: &Stack, id: u64, name: &str) -> u64 {
    counters(stack, id)[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name}"))
}

/// The `blocks=` of a placement header.
fn blocks_of(placement: &str) -> u64 {
    placement
        .split("; ")
        .find_map(|p| p.strip_prefix("blocks="))
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("no blocks in {placement:?}"))
}

/// A completion's answer with `n` tokens of text: nothing was lost on
/// the way.
fn answered_whole(r: &Reply, n: u64) {
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], n, "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens"],
        u64::from(PREFIX_TOKENS + SUFFIX_TOKENS),
        "{v}"
    );
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{v}"
    );
}

/// The long request's answer, streamed to its end from the holder, which
/// it found holding nothing of its prompt.
fn long_ended_on(long: std::thread::JoinHandle<Reply>, holder: u64) {
    let r = long.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("data: [DONE]"), "{}", r.text());
    assert_eq!(served_by_kvgate(&r), holder);
    assert_eq!(r.header("x-kvgate-placement"), Some("holder"));
}

/// Waits until the gateway's bookings are released and no rank of the
/// sidecar's state carries any load: every prompt token and decode block
/// booked for either leg was given back.
fn wait_unbooked(stack: &Stack) {
    wait_bookings_drained(stack);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let state = stack.sidecar_state().unwrap();
        let loaded: Vec<Value> = state["models"][0]["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
            .filter(|r| {
                r["active_prefill_tokens"].as_u64() != Some(0)
                    || r["active_decode_blocks"].as_u64() != Some(0)
            })
            .collect();
        if loaded.is_empty() && bookings_active(stack) == 0.0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "ranks still loaded after every request ended: {loaded:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A request through Envoy from a thread of its own.
fn send_at(stack: &Stack, body: &[u8]) -> std::thread::JoinHandle<Reply> {
    let (addr, body) = (stack.envoy_addr(), body.to_vec());
    std::thread::spawn(move || {
        let (status, headers, body) = http::request_full(
            &addr,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            Some(&body),
        )
        .expect("a request through Envoy");
        Reply {
            status,
            headers,
            body,
        }
    })
}

/// As many idle connections as worker `id`'s side channel serves at once
/// (the sim's bound): a pull connecting after them waits in the listen
/// backlog, in order, until one of them closes.
fn crowd_side_channel(stack: &Stack, id: u64) -> Vec<std::net::TcpStream> {
    const SERVED_AT_ONCE: usize = 256;
    let d = sim_disagg(stack, id as usize - 1);
    let addr = format!(
        "{}:{}",
        d["side_channel_host"].as_str().unwrap(),
        d["side_channel_ports"][0]
    );
    (0..SERVED_AT_ONCE)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect()
}

#[test]
fn a_prompt_held_by_a_loaded_worker_is_prefilled_there_and_decoded_on_an_idle_one() {
    let _g = serial();
    let stack = pull_stack(&[], 20_000);
    let (holder, long) = hold_and_load(&stack);
    assert_eq!(counter(&stack, holder, "prefill_legs"), 0);

    let r = post(&stack, "/v1/completions", &body(&extended(), 4, false), &[]);
    answered_whole(&r, 4);
    let placement = r.header("x-kvgate-placement").unwrap_or_default();
    assert!(placement.starts_with("pull; blocks="), "{placement}");
    let blocks = blocks_of(placement);
    // Every block of the prompt, the partial last one too: the decode
    // worker held none of it.
    assert_eq!(
        blocks,
        u64::from(PREFIX_TOKENS + SUFFIX_TOKENS).div_ceil(16),
        "{placement}"
    );
    let decoder = served_by_kvgate(&r);
    assert_ne!(decoder, holder, "decoded on another worker");
    let (sim_worker, _) = served_by(&r);
    assert_eq!(sim_worker, decoder.to_string());

    // The holder computed only the tail, its cached prefix reused, and
    // served one pull of every block through its link.
    assert_eq!(counter(&stack, holder, "prefill_legs"), 1);
    assert_eq!(counter(&stack, holder, "pulls_served"), 1);
    assert_eq!(
        counter(&stack, holder, "link_bytes"),
        blocks * BYTES_PER_BLOCK
    );
    let (_, state) =
        http::get(&stack.workers[holder as usize - 1].endpoint(), "/sim/state").unwrap();
    let state: Value = serde_json::from_slice(&state).unwrap();
    assert_eq!(
        state["ranks"][0]["prefix_cache_hits"],
        u64::from(PREFIX_TOKENS),
        "the prefill leg found the prefix cached: {state}"
    );
    let prefill = last_seen(&stack, holder as usize - 1);
    assert_eq!(prefill["leg"], "prefill", "{prefill}");

    // The decode worker pulled them from the holder's side channel and
    // computed nothing.
    let d = counters(&stack, decoder);
    assert_eq!(
        (d["decode_legs"].as_u64(), d["pulls"].as_u64()),
        (Some(1), Some(1)),
        "{d}"
    );
    assert_eq!(d["blocks_pulled"], blocks, "{d}");
    assert_eq!(
        (d["failed_pulls"].as_u64(), d["recomputes"].as_u64()),
        (Some(0), Some(0))
    );
    let leg = last_seen(&stack, decoder as usize - 1);
    assert_eq!(leg["leg"], "decode", "{leg}");
    assert_eq!(
        leg["request_id"], prefill["request_id"],
        "one id on both legs"
    );
    let params = &leg["kv_transfer_params"];
    let h = sim_disagg(&stack, holder as usize - 1);
    assert!(
        h["engine_ids"]
            .as_array()
            .unwrap()
            .contains(&params["remote_engine_id"])
            && h["side_channel_ports"]
                .as_array()
                .unwrap()
                .contains(&params["remote_port"]),
        "the transfer names the holder's side channel: {params} vs {h}"
    );
    let idle = (1..=3).find(|w| *w != holder && *w != decoder).unwrap();
    let i = counters(&stack, idle);
    assert_eq!(
        (i["prefill_legs"].as_u64(), i["decode_legs"].as_u64()),
        (Some(0), Some(0)),
        "{i}"
    );

    assert_eq!(stack.envoy_stat("kvgate_placed_pull_total").unwrap(), 1);
    assert_eq!(
        stack.envoy_stat("kvgate_pull_blocks_moved_total").unwrap(),
        blocks
    );
    assert_eq!(stack.envoy_stat("kvgate_prefill_remote_total").unwrap(), 1);
    assert_eq!(
        stack
            .envoy_stat("kvgate_placed_recompute_total")
            .unwrap_or(0),
        0
    );

    long_ended_on(long, holder);
    assert_eq!(stack.envoy_stat("kvgate_placed_holder_total").unwrap(), 1);
    wait_unbooked(&stack);
}

#[test]
fn an_evicted_holder_falls_back_cleanly() {
    let _g = serial();
    // A prefill leg's blocks are held for half a second.
    let stack = pull_stack(&["--kv-lease-ms", "500"], 20_000);
    let (holder, long) = hold_and_load(&stack);

    // The holder's side channel is kept busy with connections that ask
    // for nothing: the decode worker's pull waits behind them until its
    // lease has run out, and is heard only when they go.
    let crowd = crowd_side_channel(&stack, holder);
    let second = send_at(&stack, &body(&extended(), 4, false));
    let deadline = Instant::now() + Duration::from_secs(20);
    while counter(&stack, holder, "lease_expiries") == 0 {
        assert!(
            !second.is_finished(),
            "answered before the holder's lease ran out"
        );
        assert!(
            Instant::now() < deadline,
            "the holder's lease never ran out: {}",
            sim_disagg(&stack, holder as usize - 1)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(crowd);
    let r = second.join().unwrap();
    answered_whole(&r, 4);
    // Placed as a pull: the gateway cannot know the blocks are gone.
    let placement = r.header("x-kvgate-placement").unwrap_or_default();
    assert!(placement.starts_with("pull; blocks="), "{placement}");
    let decoder = served_by_kvgate(&r);
    assert_ne!(decoder, holder);

    assert_eq!(counter(&stack, holder, "prefill_legs"), 1);
    assert_eq!(counter(&stack, holder, "lease_expiries"), 1);
    assert_eq!(counter(&stack, holder, "pulls_served"), 0);
    assert_eq!(counter(&stack, holder, "link_bytes"), 0, "nothing moved");
    // The decode worker found them gone and computed the prompt itself.
    let d = counters(&stack, decoder);
    assert_eq!(
        (
            d["decode_legs"].as_u64(),
            d["failed_pulls"].as_u64(),
            d["recomputes"].as_u64(),
            d["pulls"].as_u64(),
            d["blocks_pulled"].as_u64(),
        ),
        (Some(1), Some(1), Some(1), Some(0), Some(0)),
        "{d}"
    );
    let leg = last_seen(&stack, decoder as usize - 1);
    assert_eq!(
        (&leg["leg"], &leg["recomputed"], &leg["status"]),
        (&json!("decode"), &json!(true), &json!(200)),
        "{leg}"
    );
    assert!(
        leg["error"]
            .as_str()
            .is_some_and(|e| e.contains("no longer holds the blocks")),
        "{leg}"
    );
    assert_eq!(stack.envoy_stat("kvgate_placed_pull_total").unwrap(), 1);

    long_ended_on(long, holder);
    wait_unbooked(&stack);
}

#[test]
fn a_pull_whose_prefill_leg_fails_is_computed_on_its_decode_worker() {
    let _g = serial();
    // Prefill legs answer their headers and never their body: each one
    // outlives the model's prefill timeout. Whole requests are served.
    let stack = pull_stack(&["--prefill-stall-after-headers"], 1000);
    let (holder, long) = hold_and_load(&stack);

    let r = post(&stack, "/v1/completions", &body(&extended(), 4, false), &[]);
    answered_whole(&r, 4);
    let placement = r.header("x-kvgate-placement").unwrap_or_default();
    assert!(placement.starts_with("recompute; blocks="), "{placement}");
    assert!(
        blocks_of(placement) >= u64::from(PREFIX_TOKENS / 16),
        "{placement}"
    );
    let decoder = served_by_kvgate(&r);
    assert_ne!(decoder, holder);
    assert_eq!(
        counter(&stack, holder, "prefill_legs"),
        1,
        "the one that stalled"
    );
    // The decode worker got the client's request whole, with nothing to
    // pull.
    let leg = last_seen(&stack, decoder as usize - 1);
    assert_eq!(leg["leg"], "local", "{leg}");
    assert_eq!(leg["kv_transfer_params"], Value::Null, "{leg}");
    assert_eq!(counter(&stack, decoder, "decode_legs"), 0);
    assert_eq!(stack.envoy_stat("kvgate_prefill_failed_total").unwrap(), 1);
    assert_eq!(
        stack
            .envoy_stat("kvgate_rejected_prefill_failed_total")
            .unwrap_or(0),
        0
    );
    // Counted as the recompute it became, never as a pull.
    assert_eq!(stack.envoy_stat("kvgate_placed_pull_total").unwrap_or(0), 0);
    assert_eq!(
        stack.envoy_stat("kvgate_placed_recompute_total").unwrap(),
        1
    );
    assert_eq!(
        stack.envoy_stat("kvgate_recompute_blocks_total").unwrap(),
        blocks_of(placement)
    );

    long_ended_on(long, holder);
    wait_unbooked(&stack);
}
