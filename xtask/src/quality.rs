//! `quality`: routing quality on a fleet of 8 simulated workers behind
//! Envoy, policy against policy on the same requests at the same rates.
//!
//! Policies:
//! * `round_robin`, `least_request`: Envoy's own balancers (the plain
//!   listener), what a fleet gets without kvgate;
//! * `approximate`: kvgate with text prompts, prefixes learned from its own
//!   routing decisions (the same prompts rendered as words);
//! * `precise`: kvgate with token prompts and the workers' KV events;
//! * `precise_shedding`: the same with busy thresholds on, set through the
//!   control listener;
//! * `precise_credit_1`: `precise` with the model's `overlap_credit` at
//!   Dynamo's 1.0 instead of kvgate's 3.0 (a cached block weighs one block
//!   of another request's load, not three), on a second fleet configured
//!   so: what the default gains over Dynamo's weights.
//!
//! Between runs every worker's prefix cache is reset, so each run starts
//! cold. Hit rates come from the workers' own counters.

use crate::build;
use crate::plot;
use crate::stats::{admitted_latency_us, admitted_ttft_us, ms};
use anyhow::{Context, Result};
use bytes::Bytes;
use kvgate_load::workload::{SharedPrefix, mooncake, shared_prefix};
use kvgate_load::{Outcome, RequestSpec, Target, run_open_loop};
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const POLICIES: [&str; 6] = [
    "round_robin",
    "least_request",
    "approximate",
    "precise",
    "precise_shedding",
    CREDIT_1,
];

/// The policy that runs on a fleet whose model has Dynamo's weights.
const CREDIT_1: &str = "precise_credit_1";

/// Busy past half of a rank's KV cache (gateway bookings included).
const SHED_THRESHOLD: f64 = 0.5;

/// Words the fixture tokenizer (the simulated workers' own) keeps whole
/// after a space: a synthetic token id becomes one of them, so equal token
/// prefixes give equal text prefixes of as many tokens. Taken from the
/// vocabulary, which is frozen, so the prompts do not move with the docs.
pub(crate) fn dictionary() -> Result<Vec<String>> {
    let path = crate::repo().join("tests/fixtures/chat/llama3-style.tokenizer.json");
    let tokenizer: Value = serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
    )?;
    // Byte-level BPE writes the leading space as 'Ġ'.
    let mut words: Vec<String> = tokenizer["model"]["vocab"]
        .as_object()
        .into_iter()
        .flat_map(|vocab| vocab.keys())
        .filter_map(|token| token.strip_prefix('Ġ'))
        .filter(|w| (3..=10).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase()))
        .map(str::to_owned)
        .collect();
    words.sort();
    anyhow::ensure!(
        words.len() > 200,
        "too few whole words in {}",
        path.display()
    );
    Ok(words)
}

pub(crate) fn words(tokens: &[u32], dict: &[String]) -> String {
    let mut s = String::with_capacity(tokens.len() * 7);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(&dict[*t as usize % dict.len()]);
    }
    s
}

/// The same prompt as words, one per token, for the text (approximate)
/// policy: equal token prefixes give equal text prefixes, and the workers'
/// tokenizer makes one token of each word.
fn as_text(spec: &RequestSpec, dict: &[String]) -> RequestSpec {
    let mut v: Value = serde_json::from_slice(&spec.body).unwrap_or(Value::Null);
    let tokens: Vec<u32> = v["prompt"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_u64().map(|t| t as u32))
        .collect();
    v["prompt"] = json!(words(&tokens, dict));
    RequestSpec {
        body: Bytes::from(v.to_string()),
        ..spec.clone()
    }
}

pub(crate) fn sims(stack: &Stack) -> Vec<Value> {
    stack
        .workers
        .iter()
        .map(|w| {
            http::get(&w.endpoint(), "/sim/state")
                .ok()
                .and_then(|(_, b)| serde_json::from_slice(&b).ok())
                .unwrap_or(Value::Null)
        })
        .collect()
}

pub(crate) fn counter(states: &[Value], key: &str) -> u64 {
    states
        .iter()
        .flat_map(|s| s["ranks"].as_array().cloned().unwrap_or_default())
        .map(|r| r[key].as_u64().unwrap_or(0))
        .sum()
}

/// Empties every worker's prefix cache and waits until nothing is running
/// and the index has forgotten it.
pub(crate) fn reset(stack: &Stack) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let running: u64 = counter(&sims(stack), "running") + counter(&sims(stack), "waiting");
        let booked = stack
            .sidecar_metric("kvgate_sidecar_bookings_active{model=\"demo-model\"}")
            .unwrap_or(0.0);
        if running == 0 && booked == 0.0 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the fleet never went idle");
        std::thread::sleep(Duration::from_millis(200));
    }
    // A worker still holding blocks for a pull refuses the reset until
    // its lease ends.
    for w in &stack.workers {
        loop {
            let (status, _) =
                http::request(&w.endpoint(), "POST", "/reset_prefix_cache", &[], None)
                    .with_context(|| format!("resetting worker {}", w.id))?;
            if status == 200 {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "worker {} kept refusing to reset its prefix cache ({status})",
                w.id
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    while stack
        .sidecar_metric("kvgate_sidecar_kv_indexed_blocks{model=\"demo-model\"}")
        .unwrap_or(0.0)
        > 0.0
    {
        anyhow::ensure!(Instant::now() < deadline, "the index never emptied");
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

fn set_shedding(stack: &Stack, on: bool) -> Result<()> {
    let body = if on {
        json!({"model": "demo-model", "active_decode_blocks_threshold": SHED_THRESHOLD})
    } else {
        json!({"model": "demo-model", "active_decode_blocks_threshold": null})
    };
    stack.set_thresholds(&body)?;
    // One poll answer later the filter has it.
    std::thread::sleep(Duration::from_millis(300));
    Ok(())
}

/// One policy at one rate: the figures and the TTFT distribution.
pub(crate) fn summarize(
    outcomes: &[Outcome],
    before: &[Value],
    after: &[Value],
    workers: usize,
) -> Value {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.status == 200).collect();
    let ttft = admitted_ttft_us(outcomes);
    let e2e = admitted_latency_us(outcomes);
    let shed = outcomes.iter().filter(|o| o.status == 503).count();
    let failed = outcomes.len() - ok.len() - shed;
    let span_s = crate::stats::span_s(outcomes);
    let delta = |k: &str| counter(after, k).saturating_sub(counter(before, k));
    let (queries, hits) = (delta("prefix_cache_queries"), delta("prefix_cache_hits"));
    let mut per_worker: BTreeMap<String, u64> = BTreeMap::new();
    for o in &ok {
        if let Some(w) = &o.worker {
            *per_worker.entry(w.clone()).or_default() += 1;
        }
    }
    let loads: Vec<u64> = (1..=workers)
        .map(|w| per_worker.get(&w.to_string()).copied().unwrap_or(0))
        .collect();
    // The CDF keeps 100 points: enough for a plot, small in JSON.
    let cdf: Vec<f64> = (1..=100).map(|p| ms(&ttft, p as f64)).collect();
    json!({
        "sent": outcomes.len(),
        "ok": ok.len(),
        "shed": shed,
        "failed": failed,
        "shed_rate": shed as f64 / outcomes.len().max(1) as f64,
        "ttft_ms": {"p50": ms(&ttft, 50.0), "p90": ms(&ttft, 90.0), "p99": ms(&ttft, 99.0)},
        "e2e_ms": {"p50": ms(&e2e, 50.0), "p90": ms(&e2e, 90.0), "p99": ms(&e2e, 99.0)},
        "throughput_rps": ok.len() as f64 / span_s.max(1e-9),
        "hit_rate": hits as f64 / queries.max(1) as f64,
        "requests_per_worker": loads,
        "max_min_load": {
            "max": loads.iter().max().copied().unwrap_or(0),
            "min": loads.iter().min().copied().unwrap_or(0),
        },
        "ttft_cdf_ms": cdf,
    })
}

fn run_policy(
    stack: &Stack,
    rt: &tokio::runtime::Runtime,
    policy: &str,
    specs: &[RequestSpec],
    time_scale: f64,
) -> Result<Value> {
    reset(stack)?;
    set_shedding(stack, policy == "precise_shedding")?;
    let (target, specs): (Target, Vec<RequestSpec>) = match policy {
        "round_robin" => {
            let mut t = Target::new(stack.plain_url());
            t.headers
                .push(("x-kvgate-baseline".into(), "round_robin".into()));
            (t, specs.to_vec())
        }
        "least_request" => (Target::new(stack.plain_url()), specs.to_vec()),
        "approximate" => {
            let dict = dictionary()?;
            (
                Target::new(stack.envoy_url()),
                specs.iter().map(|s| as_text(s, &dict)).collect(),
            )
        }
        _ => (Target::new(stack.envoy_url()), specs.to_vec()),
    };
    let before = sims(stack);
    let outcomes = rt.block_on(run_open_loop(&target, &specs, time_scale));
    let after = sims(stack);
    Ok(summarize(&outcomes, &before, &after, stack.workers.len()))
}

struct Workload {
    name: &'static str,
    describe: String,
    /// KV blocks per worker: small enough that spreading a prefix over
    /// every worker evicts it, as on a real fleet.
    kv_blocks: u32,
    /// Prefill speed of every worker, µs per uncached prompt token.
    prefill_us_per_token: u32,
    /// Offered rates, each with the specs and time scale that produce it.
    runs: Vec<(f64, Vec<RequestSpec>, f64)>,
}

fn workloads(quick: bool) -> Result<Vec<Workload>> {
    // 16 prompts a group as the workload has it: with fewer, the
    // groups' cold first requests alone fill the TTFT p90 of every policy.
    let (groups, per_group) = if quick { (32, 16) } else { (64, 16) };
    let rates: &[f64] = if quick {
        &[30.0, 60.0]
    } else {
        &[20.0, 40.0, 80.0]
    };
    let p = |rate| SharedPrefix {
        groups,
        per_group,
        prefix_tokens: 2048,
        question_tokens: 128,
        output_tokens: 32,
        rate,
    };
    let shared = Workload {
        name: "shared_prefix",
        kv_blocks: 4096,
        prefill_us_per_token: 100,
        describe: format!(
            "{groups} groups × {per_group} prompts, 2048-token shared prefix + 128-token question, 32 output tokens, Poisson arrivals"
        ),
        runs: rates
            .iter()
            .map(|r| (*r, shared_prefix("demo-model", p(*r), 42), 1.0))
            .collect(),
    };
    let (path, text) = mooncake_text();
    let Some(text) = text else {
        eprintln!(
            "xtask: bench quality: no Mooncake trace at {} (set KVGATE_MOONCAKE_TRACE); shared prefix only",
            path.display()
        );
        return Ok(vec![shared]);
    };
    // The trace's reuse builds up: an ideal cache serves 4 % of the first
    // 80 requests' blocks, 8 % of 300, 21 % of 1000.
    let n = if quick { 300 } else { 1000 };
    let mut trace = mooncake(&text, "demo-model", n, 512).map_err(anyhow::Error::msg)?;
    // Outputs capped: the simulated fleet shares two cores with Envoy and
    // the load generator, and routing quality shows in the prefill.
    cap_outputs(&mut trace, 32);
    let span = trace.last().map_or(1.0, |s| s.at.as_secs_f64()).max(1.0);
    let natural = trace.len() as f64 / span;
    let trace_rates: &[f64] = if quick { &[16.0] } else { &[8.0, 16.0] };
    let mooncake = Workload {
        name: "mooncake",
        // 512k tokens: an 8B model's KV cache on an 80 GB GPU. The trace's
        // conversations come back after about 200 other requests (median),
        // which a smaller cache has evicted under any routing.
        kv_blocks: 32768,
        // 40k tokens/s, an 8B model on one H100: a cold 14k-token prompt
        // takes 0.36 s, so 8 workers prefill about 22 such prompts a
        // second and the rates below load them to a third and two thirds.
        prefill_us_per_token: 25,
        describe: format!(
            "first {n} requests of the Mooncake conversation trace (mean input {:.0} tokens, 512-token hash blocks), outputs capped at 32 tokens, timestamps scaled to the rate",
            trace
                .iter()
                .map(|s| s.prompt_tokens.unwrap_or(0) as f64)
                .sum::<f64>()
                / trace.len().max(1) as f64
        ),
        runs: trace_rates
            .iter()
            .map(|r| (*r, trace.clone(), natural / r))
            .collect(),
    };
    Ok(vec![shared, mooncake])
}

/// The Mooncake conversation trace's path, and its text when it can be
/// read: `KVGATE_MOONCAKE_TRACE`, else the shared copy beside the repo.
pub(crate) fn mooncake_text() -> (std::path::PathBuf, Option<String>) {
    let path = std::env::var_os("KVGATE_MOONCAKE_TRACE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| crate::repo().join("../shared/data/mooncake/conversation_trace.jsonl"));
    let text = std::fs::read_to_string(&path).ok();
    (path, text)
}

/// Caps every request's `max_tokens` at `max`.
pub(crate) fn cap_outputs(specs: &mut [RequestSpec], max: u64) {
    for s in specs {
        let mut v: Value = serde_json::from_slice(&s.body).unwrap_or(Value::Null);
        let out = v["max_tokens"].as_u64().unwrap_or(1).min(max);
        v["max_tokens"] = json!(out);
        s.body = Bytes::from(v.to_string());
    }
}

/// Eight workers whose prefills take turns (one lane each), as an
/// engine's shared compute does, so a rank's queued prefill is what a new
/// request waits behind.
/// Workers of the quality benches' fleets.
pub(crate) const WORKERS: usize = 8;

/// The simulated workers as the quality benches run them: KV blocks of 16
/// tokens, 16 running a worker, one prefill at a time, 5 ms a token.
pub(crate) fn fleet_config(kv_blocks: u32, prefill_us_per_token: u32) -> StackConfig {
    StackConfig {
        workers: WORKERS,
        kv_events: true,
        sim_args: [
            "--num-gpu-blocks",
            &kv_blocks.to_string(),
            "--max-running",
            "16",
            "--prefill-lanes",
            "1",
            "--prefill-us-per-token",
            &prefill_us_per_token.to_string(),
            "--decode-ms-per-token",
            "5",
        ]
        .map(String::from)
        .to_vec(),
        plugin: json!({"max_body_bytes": 4 << 20}),
        ..StackConfig::default()
    }
}

/// The token prompts of `specs`, in order.
pub fn token_prompts(specs: &[RequestSpec]) -> Vec<Vec<u32>> {
    specs
        .iter()
        .map(|s| {
            let v: Value = serde_json::from_slice(&s.body).unwrap_or(Value::Null);
            v["prompt"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_u64().map(|t| t as u32))
                .collect()
        })
        .collect()
}

pub fn run(quick: bool) -> Result<Value> {
    let rt = tokio::runtime::Runtime::new()?;
    let mut out = Vec::new();
    for w in workloads(quick)? {
        let reference = w.runs.first().map(|(_, specs, _)| {
            crate::replay::replay(&token_prompts(specs), WORKERS, w.kv_blocks as usize, 16)
        });
        let mut by_rate: Vec<serde_json::Map<String, Value>> =
            w.runs.iter().map(|_| serde_json::Map::new()).collect();
        // kvgate's weights first, then a fleet whose model has Dynamo's;
        // one fleet at a time on the shared cores.
        for (credit, names) in [(None, &POLICIES[..5]), (Some(1.0), &POLICIES[5..])] {
            let mut config = fleet_config(w.kv_blocks, w.prefill_us_per_token);
            if let Some(c) = credit {
                config.model_toml = format!("policy = {{ overlap_credit = {c:.1} }}");
            }
            let stack = Stack::start_with(build::release_paths()?, config)?;
            for ((rate, specs, scale), policies) in w.runs.iter().zip(&mut by_rate) {
                for &policy in names {
                    eprintln!(
                        "xtask: bench quality: {} at {rate} req/s, {policy} ({} requests)",
                        w.name,
                        specs.len()
                    );
                    let v = run_policy(&stack, &rt, policy, specs, *scale)
                        .with_context(|| format!("{} {policy} at {rate}", w.name))?;
                    policies.insert(policy.into(), v);
                }
            }
        }
        let rates: Vec<Value> = w
            .runs
            .iter()
            .zip(by_rate)
            .map(|((rate, _, _), policies)| json!({"rate_per_s": rate, "policies": policies}))
            .collect();
        out.push(
            json!({"name": w.name, "describe": w.describe, "kv_blocks_per_worker": w.kv_blocks,
                        "prefill_us_per_token": w.prefill_us_per_token, "rates": rates,
                        "reference_hit_rate": reference.map(|r| r.reference),
                        "reference_floor_blocks": reference.map(|r| r.floor.0),
                        "ideal_hit_rate": reference.map(|r| r.ideal)}),
        );
    }
    Ok(json!({
        "name": "quality",
        "workers": 8,
        "worker_model": "kvgate-sim: KV blocks of 16 tokens, 16 running per worker, one prefill at a time per worker (FIFO), decode 5 ms per token",
        "shed_threshold_active_decode_blocks": SHED_THRESHOLD,
        "workloads": out,
    }))
}

/// The report section, and the plots it links (name, SVG).
pub fn report(v: &Value) -> (String, Vec<(String, String)>) {
    let mut md = format!(
        "\n## Routing quality (8 simulated workers behind Envoy)\n\nWorkers: {}. Policies on the same requests at the same offered rates; each run starts with every prefix cache empty. Hit rate is prompt tokens served from cache, from the workers' own counters; load is requests completed per worker (max / min); shedding sheds past {} of a rank's KV blocks.\n",
        v["worker_model"].as_str().unwrap_or(""),
        v["shed_threshold_active_decode_blocks"]
    );
    let mut plots = Vec::new();
    for w in v["workloads"].as_array().into_iter().flatten() {
        let name = w["name"].as_str().unwrap_or("?");
        let reference = w["reference_hit_rate"].as_f64().unwrap_or(f64::NAN);
        md.push_str(&format!(
            "\n### {name}: {} ({} KV blocks per worker, prefill {} µs per uncached token)\n\nWith these caches, routing with perfect knowledge (offline replay, load ignored) reaches a {:.1} % hit rate; an unbounded cache {:.1} %.\n\n| rate | policy | TTFT p50 / p90 / p99 (ms) | e2e p50 / p90 / p99 (ms) | throughput | hit rate | of reference | load max / min | 503 |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
            w["describe"].as_str().unwrap_or(""),
            w["kv_blocks_per_worker"],
            w["prefill_us_per_token"],
            100.0 * reference,
            100.0 * w["ideal_hit_rate"].as_f64().unwrap_or(f64::NAN),
        ));
        let rates = w["rates"].as_array().cloned().unwrap_or_default();
        for r in &rates {
            for policy in POLICIES {
                let p = &r["policies"][policy];
                let f = |a: &str, b: &str| p[a][b].as_f64().unwrap_or(f64::NAN);
                md.push_str(&format!(
                    "| {} req/s | {policy} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} | {:.1} req/s | {:.1} % | {:.0} % | {} / {} | {:.1} % |\n",
                    r["rate_per_s"],
                    f("ttft_ms", "p50"),
                    f("ttft_ms", "p90"),
                    f("ttft_ms", "p99"),
                    f("e2e_ms", "p50"),
                    f("e2e_ms", "p90"),
                    f("e2e_ms", "p99"),
                    p["throughput_rps"].as_f64().unwrap_or(f64::NAN),
                    100.0 * p["hit_rate"].as_f64().unwrap_or(f64::NAN),
                    100.0 * p["hit_rate"].as_f64().unwrap_or(f64::NAN) / reference,
                    p["max_min_load"]["max"],
                    p["max_min_load"]["min"],
                    100.0 * p["shed_rate"].as_f64().unwrap_or(f64::NAN),
                ));
            }
        }
        // Plots at the highest rate: where routing matters most.
        if let Some(r) = rates.last() {
            let rate = r["rate_per_s"].as_f64().unwrap_or(0.0);
            let series: Vec<(&str, Vec<f64>)> = POLICIES
                .iter()
                .map(|p| {
                    let v: Vec<f64> = r["policies"][*p]["ttft_cdf_ms"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_f64)
                        .collect();
                    (*p, v)
                })
                .collect();
            let cdf_name = format!("quality_{name}_ttft_cdf.svg");
            plots.push((
                cdf_name.clone(),
                plot::cdf(
                    &format!("{name}: TTFT at {rate} req/s"),
                    "time to first token (ms)",
                    &series,
                ),
            ));
            let workers: Vec<String> = (1..=8).map(|i| format!("w{i}")).collect();
            let loads: Vec<(&str, Vec<f64>)> = POLICIES
                .iter()
                .map(|p| {
                    let v: Vec<f64> = r["policies"][*p]["requests_per_worker"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_f64)
                        .collect();
                    (*p, v)
                })
                .collect();
            let load_name = format!("quality_{name}_load.svg");
            plots.push((
                load_name.clone(),
                plot::bars(
                    &format!("{name}: requests per worker at {rate} req/s"),
                    "requests",
                    &workers,
                    &loads,
                ),
            ));
            let rate_labels: Vec<String> = rates
                .iter()
                .map(|r| format!("{} req/s", r["rate_per_s"]))
                .collect();
            let hits: Vec<(&str, Vec<f64>)> = POLICIES
                .iter()
                .map(|p| {
                    let v: Vec<f64> = rates
                        .iter()
                        .map(|r| r["policies"][*p]["hit_rate"].as_f64().unwrap_or(0.0))
                        .collect();
                    (*p, v)
                })
                .collect();
            let hits_name = format!("quality_{name}_hit_rate.svg");
            plots.push((
                hits_name.clone(),
                plot::bars(
                    &format!("{name}: prefix-cache hit rate"),
                    "hit rate",
                    &rate_labels,
                    &hits,
                ),
            ));
            md.push_str(&format!(
                "\n![TTFT CDF](plots/{cdf_name}) ![load per worker](plots/{load_name}) ![hit rate](plots/{hits_name})\n"
            ));
        }
    }
    (md, plots)
}
