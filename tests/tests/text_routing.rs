//! Chat prompts matched against the engines' own KV events, on real Envoy:
//! a prefix a worker cached without any gateway routing draws requests to
//! it, and stops drawing them once the engine clears or evicts it.

mod common;

use common::*;
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const MODEL: &str = "demo-model";

/// Four workers serving a Llama-3-style model with its real tokenizer;
/// the sidecar holds the same tokenizer and template.
fn stack(kv_blocks: u32) -> Stack {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/chat");
    start(
        StackConfig {
            workers: 4,
            kv_events: true,
            sim_args: vec!["--num-gpu-blocks".into(), kv_blocks.to_string()],
            ..StackConfig::default()
        }
        .with_prompt_files(
            &dir.join("llama3-style.tokenizer.json"),
            &dir.join("llama3-style.tokenizer_config.json"),
            true,
        ),
    )
}

/// A system prompt of about `words` words, distinct per `tag`.
fn system_prompt(tag: &str, words: usize) -> String {
    let vocab = [
        "cache", "prefix", "engine", "router", "token", "block", "worker", "latency", "request",
        "gateway", "policy", "memory", "kernel", "batch", "decode", "prefill",
    ];
    let mut s = format!("You are assistant {tag}. Follow these rules carefully.");
    for i in 0..words {
        s.push(' ');
        s.push_str(vocab[(i * 7 + tag.len() * 3 + i / 5) % vocab.len()]);
        if i % 13 == 12 {
            s.push('.');
        }
    }
    s
}

fn body(system: &str, question: &str) -> Value {
    json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
    })
}

/// Sends a chat straight to worker `i`, as traffic that never passed this
/// gateway would reach it.
fn direct(stack: &Stack, i: usize, b: &Value) {
    let (status, _, reply) = http::request_full(
        &stack.workers[i].endpoint(),
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(b.to_string().as_bytes()),
    )
    .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
}

fn via_envoy(stack: &Stack, b: &Value) -> String {
    let r = post(stack, "/v1/chat/completions", b.to_string().as_bytes(), &[]);
    served_by(&r).0
}

fn text_keys(stack: &Stack) -> f64 {
    stack
        .sidecar_metric(&format!(
            "kvgate_sidecar_text_indexed_keys{{model=\"{MODEL}\"}}"
        ))
        .unwrap_or(0.0)
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_chat_goes_where_the_engine_reported_its_prefix_until_it_is_cleared() {
    let _g = serial();
    let stack = stack(4096);
    stack.wait_routing_ready(Duration::from_secs(20)).unwrap();
    let system = system_prompt("alpha", 600);
    // Worker 3 (id 4) caches the prompt from a request that bypassed Envoy.
    direct(&stack, 3, &body(&system, "warm up"));
    wait_for("the text index to key worker 4's prefix", || {
        text_keys(&stack) >= 8.0
    });
    let holder = stack.workers[3].id.to_string();
    for q in ["what is a cache?", "why route by prefix?", "and load?"] {
        assert_eq!(via_envoy(&stack, &body(&system, q)), holder, "{q}");
    }
    assert!(stack.envoy_stat("kvgate_prompts_rendered_total").unwrap() >= 3);
    assert_eq!(
        stack
            .envoy_stat("kvgate_prompt_render_errors_total")
            .unwrap(),
        0
    );

    // The engine empties its cache (AllBlocksCleared), and the prefix is
    // cached again elsewhere, again without the gateway: requests follow.
    wait_bookings_drained(&stack);
    let (status, _) = http::request(
        &stack.workers[3].endpoint(),
        "POST",
        "/reset_prefix_cache",
        &[],
        None,
    )
    .unwrap();
    assert_eq!(status, 200);
    wait_for("the cleared keys to go", || text_keys(&stack) == 0.0);
    direct(&stack, 1, &body(&system, "warm up again"));
    wait_for("worker 2's keys", || text_keys(&stack) >= 8.0);
    let moved = stack.workers[1].id.to_string();
    for q in ["what is a cache now?", "where did it go?"] {
        assert_eq!(via_envoy(&stack, &body(&system, q)), moved, "{q}");
    }
    // Every block the engines stored was keyed.
    for reason in ["orphan", "undecodable"] {
        let skipped = stack.sidecar_metric(&format!(
            "kvgate_sidecar_text_skipped_blocks_total{{model=\"{MODEL}\",reason=\"{reason}\"}}"
        ));
        assert_eq!(skipped.unwrap_or(0.0), 0.0, "{reason}");
    }
}

#[test]
fn an_evicted_prefix_no_longer_draws_requests() {
    let _g = serial();
    // 96 blocks of 16 tokens per rank: a few long prompts evict the rest.
    let stack = stack(96);
    stack.wait_routing_ready(Duration::from_secs(20)).unwrap();
    let system = system_prompt("beta", 500);
    direct(&stack, 2, &body(&system, "warm up"));
    wait_for("worker 3's keys", || text_keys(&stack) >= 8.0);
    let holder = stack.workers[2].id.to_string();
    assert_eq!(via_envoy(&stack, &body(&system, "first")), holder);
    wait_bookings_drained(&stack);
    // Other traffic reaches worker 3 directly and evicts the prefix.
    for i in 0..6 {
        direct(
            &stack,
            2,
            &body(&system_prompt(&format!("other{i}"), 500), "evict"),
        );
    }
    // Meanwhile worker 1 caches it.
    direct(&stack, 0, &body(&system, "warm up elsewhere"));
    std::thread::sleep(Duration::from_millis(300));
    let elsewhere = stack.workers[0].id.to_string();
    for q in ["second", "third"] {
        assert_eq!(via_envoy(&stack, &body(&system, q)), elsewhere, "{q}");
    }
}
