//! The KV-routing benchmark through real Envoy: 16 workers whose KV events
//! this benchmark publishes itself ([`crate::kvfleet`]: vLLM wire format
//! over ZMQ, 100k blocks each, chains of 2048 tokens), then
//!
//! * Envoy's resident memory before and after the 1.6M-block index arrives;
//! * the filter's selection time on 2k-token prompts (Envoy histogram
//!   `kvgate_selection_us`), and how many requests went to the holder;
//! * the whole decision on those prompts in turns, beside the baseline
//!   build's with `--baseline` ([`crate::turns`]);
//! * freshness: from publishing a new chain to the first of three
//!   consecutive requests that follow it.

use crate::build;
use crate::kvfleet::{self, CHAIN_BLOCKS, chain_tokens};
use anyhow::{Result, bail};
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const WORKERS: usize = 16;
/// The target size: 100k cached blocks per worker.
const BLOCKS_PER_WORKER: usize = 100_000;

fn completion(stack: &Stack, tokens: &[u32]) -> Result<Option<String>> {
    let body = json!({"model": "demo-model", "prompt": tokens, "max_tokens": 1}).to_string();
    let (status, headers, _) =
        http::post_json(&stack.envoy_addr(), "/v1/completions", body.as_bytes())?;
    if status != 200 {
        bail!("request answered {status}");
    }
    Ok(headers
        .into_iter()
        .find(|(k, _)| k == "x-kvgate-sim-worker")
        .map(|(_, v)| v))
}

/// `baseline`: another build of the filter, whose whole decision on the
/// same 2k-token prompts is measured beside this one's, in turns
/// ([`crate::turns`]).
pub fn run(
    quick: bool,
    baseline: Option<&std::path::Path>,
    histogram: impl Fn(&Stack, &str) -> Result<Value>,
) -> Result<Value> {
    let chains_per_worker = BLOCKS_PER_WORKER / CHAIN_BLOCKS;
    eprintln!("xtask: bench kv ({WORKERS} workers × {BLOCKS_PER_WORKER} blocks)");
    let paths = build::release_paths()?;
    let fleet = kvfleet::config(WORKERS);
    let stack = Stack::start_with(
        paths,
        StackConfig {
            sim_args: [
                fleet.sim_args.clone(),
                vec!["--num-gpu-blocks".into(), "256".into()],
            ]
            .concat(),
            plugin: json!({"max_body_bytes": 4194304}),
            baseline_wasm: baseline.map(std::path::Path::to_path_buf),
            ..fleet
        },
    )?;
    let mut pubs = kvfleet::publishers(&stack)?;
    for i in 0..20 {
        completion(&stack, &chain_tokens(i % WORKERS, 0))?;
    }
    let rss_before = stack.envoy_rss().unwrap_or(0);

    let t = Instant::now();
    let published = kvfleet::fill(&stack, &mut pubs, chains_per_worker)?;
    let index_s = t.elapsed().as_secs_f64();
    // The shards reach Envoy within one long poll; give it a moment.
    std::thread::sleep(Duration::from_secs(3));

    let n = 400;
    let mut hits = 0;
    for i in 0..n {
        let w = i % WORKERS;
        let mut tokens = chain_tokens(w, (i * 37) % chains_per_worker);
        tokens.extend([7, 7, 7]);
        if completion(&stack, &tokens)? == Some((w + 1).to_string()) {
            hits += 1;
        }
    }
    let rss_after = stack.envoy_rss().unwrap_or(0);
    // Envoy computes histogram percentiles at its stats flush (every 5 s);
    // read before the turns below add the baseline build's samples.
    std::thread::sleep(Duration::from_secs(6));
    let selection_us = histogram(&stack, "kvgate_selection_us")?;
    let decision_us = histogram(&stack, "kvgate_decision_us")?;

    // The whole decision on 2k-token prompts that hit, paced at 200 a
    // second and back to back, this build against the baseline's.
    let (turn, reps) = crate::turns::size(quick);
    let prompts = (0..turn).map(|i| {
        let mut tokens = chain_tokens(i % WORKERS, (i * 37) % chains_per_worker);
        tokens.extend([7, 7, 7]);
        json!({"model": "demo-model", "prompt": tokens, "max_tokens": 1})
    });
    let specs = crate::turns::paced("/v1/completions", prompts);
    let rt = tokio::runtime::Runtime::new()?;
    let listeners = crate::turns::listeners(&stack, baseline.is_some());
    stack.deprioritize_workers()?;
    let turns = crate::turns::decision(&stack, &rt, &listeners, &specs, reps)?;

    // Freshness: publish a new chain on one worker, then follow it.
    let mut fresh = Vec::new();
    for k in 0..if quick { 20 } else { 50 } {
        let w = k % WORKERS;
        // Token ids above every indexed chain's range: nothing holds this
        // prefix until the event arrives.
        let tokens: Vec<u32> = (0..(CHAIN_BLOCKS * 16) as u32)
            .map(|i| 2_000_000 + (k as u32) * 10_000 + i)
            .collect();
        let t0 = Instant::now();
        pubs[w].chains(std::slice::from_ref(&tokens))?;
        let (mut streak, mut first_of_streak) = (0, None);
        while streak < 3 {
            if t0.elapsed() > Duration::from_secs(5) {
                bail!("chain {k} never reached routing");
            }
            let at = t0.elapsed();
            if completion(&stack, &tokens)? == Some((w + 1).to_string()) {
                streak += 1;
                first_of_streak.get_or_insert(at);
            } else {
                streak = 0;
                first_of_streak = None;
            }
        }
        fresh.push(first_of_streak.unwrap_or_default().as_secs_f64() * 1e3);
    }
    fresh.sort_by(f64::total_cmp);
    // The same index through the sidecar's selection API.
    let prompts: Vec<Vec<u32>> = (0..256)
        .map(|i| chain_tokens(i % WORKERS, (i * 37) % chains_per_worker))
        .collect();
    let api = crate::apibench::selection(&stack, &prompts)?;
    let pct = |p: f64| fresh[((fresh.len() as f64 * p).ceil() as usize).clamp(1, fresh.len()) - 1];
    Ok(json!({
        "name": "kv",
        "workers": WORKERS,
        "indexed_blocks": published,
        "index_build_s": index_s,
        "envoy_rss_before_mib": rss_before as f64 / (1 << 20) as f64,
        "envoy_rss_after_mib": rss_after as f64 / (1 << 20) as f64,
        "envoy_rss_growth_mib": (rss_after as f64 - rss_before as f64) / (1 << 20) as f64,
        "requests": n,
        "routed_to_prefix_holder": hits,
        "selection_us": selection_us,
        "decision_us": decision_us,
        "decision_turns": turns,
        "freshness_ms_p50": pct(0.5),
        "freshness_ms_p99": pct(0.99),
        "freshness_samples": fresh.len(),
        "selection_api": api,
    }))
}
