//! `pull`: moving a prompt's KV against computing it again, on a fleet of
//! `both` workers speaking vLLM's NIXL protocol.
//!
//! Arms, on the same four simulated GPUs ([`sim_args`], identical in every
//! arm, every worker `kv_both` with a NIXL side channel):
//! * `pulls`: kvgate with `[models.disaggregation.pull]`, whose numbers are
//!   the sims' own ([`pull_toml`]): a loaded holder prefills the uncached
//!   tail and an idle worker pulls the prompt's KV;
//! * `today`: kvgate with the same `[models.disaggregation]` and no pull
//!   table: each request whole, on the holder or recomputed elsewhere;
//! * `least_request`: Envoy's least-request balancing over the same
//!   workers (the stack's plain listener), no kvgate.
//!
//! Workloads, the same requests at the same times in every arm:
//! * `shared_prefix`: groups of prompts sharing a 2048-token prefix;
//! * `mooncake`: the Mooncake conversation trace as token prompts;
//! * `load_spill`: a few groups sharing 4096-token prefixes, one group at
//!   a time hot, arriving faster than one worker serves it, the hot group
//!   rotating ([`kvgate_load::workload::load_spill`]): spilled requests
//!   queue on the holder, recompute the prefix or pull it.
//!
//! Each at [`LOADS`] times the fleet's capacity for that workload, measured
//! first in the same run: the completion rate of a closed loop through
//! today's kvgate (for `load_spill`, its requests with no group hot: what
//! the GPUs serve when the load is spread). Between runs every worker's
//! prefix cache is emptied and the fleet drained.

use crate::build;
use crate::quality::{cap_outputs, counter, mooncake_text, reset, sims};
use crate::stats::{admitted_ttft_us, histogram_buckets, ms, percentiles_between};
use crate::stats::{at, num_or_dash as f, pct_or_dash as pct};
use anyhow::{Context, Result};
use kvgate_load::workload::{LoadSpill, SharedPrefix, load_spill, mooncake, shared_prefix};
use kvgate_load::{Outcome, RequestSpec, Target, run_closed_loop, run_open_loop};
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const MODEL: &str = "demo-model";
const WORKERS: usize = 4;
/// The stack's catalog block size, which the sims are started with.
const BLOCK_SIZE: u64 = 16;

/// The simulated GPU: disagg's time model (100 µs a prompt token, 15 ms a
/// decode step and 0.2 ms per running sequence, a tenth of a shared chunk's
/// compute on the decode step, 2048-token steps, one prefill at a time,
/// Llama-3-8B's 2 MiB blocks over a 100 Gbit/s link), with at most
/// [`MAX_RUNNING`] sequences in a batch instead of 32. A holder is loaded
/// when its batch is full and new requests wait for a slot; with 32 slots
/// the fleet saturates only at several thousand streamed tokens a second,
/// more than two shared cores carry through Envoy.
const PREFILL_US_PER_TOKEN: f64 = 100.0;
const DECODE_MS_PER_TOKEN: f64 = 15.0;
const MAX_RUNNING: usize = 4;
const KV_TRANSFER_GBPS: f64 = 100.0;
const KV_BYTES_PER_BLOCK: u64 = 2 << 20;

/// Output tokens of every request (the trace's capped at it): two shared
/// cores stream every token through Envoy, and placement shows in the
/// prefill.
const OUTPUT_TOKENS: u32 = 32;

/// The offered loads, as multiples of each workload's measured capacity.
const LOADS: [f64; 2] = [0.5, 1.0];
const QUICK_LOADS: [f64; 1] = [1.0];

/// In flight in a closed loop whose requests are bound by decode: every
/// batch slot full and as many waiting, so the GPUs set the pace.
const DECODE_BOUND_CONCURRENCY: usize = WORKERS * MAX_RUNNING * 2;

const ARMS: [&str; 3] = ["pulls", "today", "least_request"];

/// Load spill: groups, their shared prefix, each request's own suffix, how
/// much of the traffic the hot group takes and how long it stays hot.
const SPILL_GROUPS: usize = 8;
const SPILL_PREFIX: usize = 4096;
const SPILL_SUFFIX: (usize, usize) = (128, 256);
const SPILL_HOT_SHARE: f64 = 0.75;
const SPILL_PHASE_S: f64 = 5.0;

/// Shared prefix: the quality bench's shape.
const SHARED_PREFIX: usize = 2048;
const SHARED_QUESTION: usize = 128;
const SHARED_PER_GROUP: usize = 16;

/// The Envoy counters a run's placements are read from.
const ENVOY_COUNTERS: [&str; 7] = [
    "kvgate_placed_holder_total",
    "kvgate_placed_recompute_total",
    "kvgate_placed_pull_total",
    "kvgate_pull_blocks_moved_total",
    "kvgate_recompute_blocks_total",
    "kvgate_prefill_remote_total",
    "kvgate_prefill_failed_total",
];

/// Envoy computes histograms at its stats flush, every 5 s.
const FLUSH: Duration = Duration::from_millis(5500);

/// The sims' `/sim/disagg` counters a run reports (summed over workers).
const SIM_COUNTERS: [&str; 7] = [
    "prefill_legs",
    "decode_legs",
    "pulls",
    "blocks_pulled",
    "failed_pulls",
    "recomputes",
    "link_bytes",
];

fn sim_args() -> Vec<(&'static str, String)> {
    vec![
        ("--prefill-us-per-token", PREFILL_US_PER_TOKEN.to_string()),
        ("--decode-ms-per-token", DECODE_MS_PER_TOKEN.to_string()),
        ("--decode-ms-per-running", "0.2".into()),
        ("--prefill-interference", "0.1".into()),
        ("--max-num-batched-tokens", "2048".into()),
        ("--prefill-lanes", "1".into()),
        ("--max-running", MAX_RUNNING.to_string()),
        ("--num-gpu-blocks", "32768".into()),
        ("--kv-transfer-gbps", KV_TRANSFER_GBPS.to_string()),
        ("--kv-bytes-per-block", KV_BYTES_PER_BLOCK.to_string()),
        ("--speedup", "1".into()),
        ("--kv-role", "kv_both".into()),
        ("--kv-side-channel-port", "0".into()),
        ("--kv-load-failure-policy", "recompute".into()),
    ]
}

/// The pull table, priced from the sims' own numbers: KV bytes per token
/// from the block's bytes, prefill speed from the time model, and the
/// holder's link (workers without a topology are `elsewhere`).
fn pull_toml() -> String {
    format!(
        "[models.disaggregation.pull]\nmin_blocks = 4\nkv_bytes_per_token = {}\nprefill_tokens_per_s = {:.1}\n\
[models.disaggregation.pull.link]\nsame_node_gbps = 400.0\nsame_rack_gbps = 200.0\nelsewhere_gbps = {:.1}\n",
        KV_BYTES_PER_BLOCK / BLOCK_SIZE,
        1e6 / PREFILL_US_PER_TOKEN,
        KV_TRANSFER_GBPS,
    )
}

/// The most whole (or decode) requests a worker takes in both kvgate arms
/// (`active_decode_requests_threshold`), the same in both so that the
/// pull table is all that differs: one batch slot short of the engine's,
/// so that a loaded worker queues nothing in its engine and a holder has
/// a slot to prefill a pull's tail in. What no worker may take is held in
/// Envoy (admission, no share reserved) rather than shed, so that TTFT
/// counts the wait.
const REQUEST_BOUND: usize = MAX_RUNNING - 1;

fn config(pulls: bool) -> StackConfig {
    let mut model_toml = format!(
        "active_decode_requests_threshold = {}\n[models.disaggregation]\nprotocol = \"vllm-nixl\"\n",
        REQUEST_BOUND
    );
    if pulls {
        model_toml.push_str(&pull_toml());
    }
    StackConfig {
        workers: WORKERS,
        block_size: BLOCK_SIZE as u32,
        // The holder is found from the workers' events, and a pulled
        // prompt's blocks are published by the worker that received them.
        kv_events: true,
        sim_args: sim_args()
            .into_iter()
            .flat_map(|(k, v)| [k.to_string(), v])
            .collect(),
        model_toml,
        // Mooncake prompts reach 120k tokens.
        plugin: json!({
            "max_body_bytes": 4 << 20,
            "admission": {
                "reserve_pct": 0,
                "default_class": "standard",
                "classes": [{"name": "standard", "priority": 1, "hold_ms": 60_000}],
            },
        }),
        ..StackConfig::default()
    }
}

fn start(pulls: bool) -> Result<Stack> {
    let stack = Stack::start_with(build::release_paths()?, config(pulls)).with_context(|| {
        format!(
            "starting the {} fleet",
            if pulls { "pulls" } else { "today" }
        )
    })?;
    stack.wait_routing_ready(Duration::from_secs(30))?;
    Ok(stack)
}

/// Makes a workload's requests at a rate: the requests, and the time scale
/// to send them at.
type Make = Box<dyn Fn(f64) -> Result<(Vec<RequestSpec>, f64)>>;

/// A workload: how to make its requests at a rate, and the closed loop its
/// capacity is measured with.
struct Workload {
    name: &'static str,
    describe: String,
    /// Seconds of arrivals a run.
    secs: f64,
    /// Requests for a capacity measurement (arrival times ignored), and
    /// how many the closed loop keeps in flight.
    capacity_specs: Vec<RequestSpec>,
    concurrency: usize,
    make: Make,
}

/// One workload at one load: the same requests in every arm.
struct Run {
    load: f64,
    rate: f64,
    specs: Vec<RequestSpec>,
    scale: f64,
}

fn shared_prefix_workload(secs: f64, capacity_n: usize) -> Workload {
    let p = |groups: usize, rate: f64| SharedPrefix {
        groups,
        per_group: SHARED_PER_GROUP,
        prefix_tokens: SHARED_PREFIX,
        question_tokens: SHARED_QUESTION,
        output_tokens: OUTPUT_TOKENS,
        rate,
    };
    let groups_for = |n: usize| n.div_ceil(SHARED_PER_GROUP).max(1);
    Workload {
        name: "shared_prefix",
        secs,
        describe: format!(
            "groups of {SHARED_PER_GROUP} prompts, a {SHARED_PREFIX}-token shared prefix and a {SHARED_QUESTION}-token question each, groups interleaved, Poisson arrivals"
        ),
        capacity_specs: shared_prefix(MODEL, p(groups_for(capacity_n), 1.0), 7),
        concurrency: DECODE_BOUND_CONCURRENCY,
        make: Box::new(move |rate| {
            let n = (rate * secs).ceil() as usize;
            Ok((shared_prefix(MODEL, p(groups_for(n), rate), 42), 1.0))
        }),
    }
}

fn spill(rate: f64, secs: f64, hot_share: f64) -> LoadSpill {
    LoadSpill {
        groups: SPILL_GROUPS,
        prefix_tokens: SPILL_PREFIX,
        suffix_tokens: SPILL_SUFFIX,
        output_tokens: OUTPUT_TOKENS,
        rate,
        hot_share,
        phase_s: SPILL_PHASE_S,
        secs,
    }
}

fn load_spill_workload(secs: f64, capacity_n: usize) -> Workload {
    // Uniform over the groups, at a rate high enough for `capacity_n`
    // requests in a second: only their order matters to a closed loop.
    let mut capacity_specs = load_spill(MODEL, spill(capacity_n as f64, 1.0, 0.0), 9);
    capacity_specs.truncate(capacity_n);
    Workload {
        name: "load_spill",
        secs,
        describe: format!(
            "{SPILL_GROUPS} groups with a {SPILL_PREFIX}-token shared prefix, each request's own {}–{}-token suffix; {:.0} % of the arrivals in one hot group, the next group hot every {SPILL_PHASE_S:.0} s, the rest spread over all groups; Poisson arrivals",
            SPILL_SUFFIX.0,
            SPILL_SUFFIX.1,
            100.0 * SPILL_HOT_SHARE
        ),
        capacity_specs,
        concurrency: DECODE_BOUND_CONCURRENCY,
        make: Box::new(move |rate| {
            Ok((
                load_spill(MODEL, spill(rate, secs, SPILL_HOT_SHARE), 11),
                1.0,
            ))
        }),
    }
}

/// The trace's first `n` requests as token prompts (512-token hash
/// blocks), outputs capped.
fn trace_head(text: &str, n: usize) -> Result<Vec<RequestSpec>> {
    let mut specs = mooncake(text, MODEL, n, 512).map_err(anyhow::Error::msg)?;
    cap_outputs(&mut specs, u64::from(OUTPUT_TOKENS));
    Ok(specs)
}

/// The Mooncake workload; `None` without the trace.
fn mooncake_workload(secs: f64, capacity_n: usize) -> Result<Option<Workload>> {
    let (path, text) = mooncake_text();
    let Some(text) = text else {
        eprintln!(
            "xtask: bench pull: no Mooncake trace at {} (set KVGATE_MOONCAKE_TRACE); skipped",
            path.display()
        );
        return Ok(None);
    };
    let capacity_specs = trace_head(&text, capacity_n)?;
    let mean = capacity_specs
        .iter()
        .map(|s| s.prompt_tokens.unwrap_or(0) as f64)
        .sum::<f64>()
        / capacity_specs.len().max(1) as f64;
    Ok(Some(Workload {
        name: "mooncake",
        secs,
        describe: format!(
            "the Mooncake conversation trace's first requests in order (mean input {mean:.0} tokens over the first {capacity_n}), 512-token hash blocks as token prompts, outputs capped at {OUTPUT_TOKENS}, timestamps scaled to the rate"
        ),
        capacity_specs,
        // Each prompt's prefill (a second and more) is what queues: a full
        // batch on every worker keeps every prefill lane busy.
        concurrency: WORKERS * MAX_RUNNING,
        make: Box::new(move |rate| {
            let specs = trace_head(&text, (rate * secs).ceil() as usize)?;
            let span = specs.last().map_or(1.0, |s| s.at.as_secs_f64()).max(1.0);
            Ok((specs, secs / span))
        }),
    }))
}

/// Every worker's `/sim/disagg` counters.
fn disagg_counters(stack: &Stack) -> Vec<Value> {
    stack
        .workers
        .iter()
        .map(|w| {
            http::get(&w.endpoint(), "/sim/disagg")
                .ok()
                .and_then(|(_, b)| serde_json::from_slice::<Value>(&b).ok())
                .map_or(Value::Null, |v| v["counters"].clone())
        })
        .collect()
}

/// The Envoy and worker readings a run's figures are differences of.
struct Reading {
    envoy: Vec<u64>,
    sims: Vec<Value>,
    disagg: Vec<Value>,
}

fn read(stack: &Stack) -> Reading {
    Reading {
        envoy: ENVOY_COUNTERS
            .iter()
            .map(|c| stack.envoy_stat(c).unwrap_or(0))
            .collect(),
        sims: sims(stack),
        disagg: disagg_counters(stack),
    }
}

impl Reading {
    fn envoy(&self, before: &Reading, name: &str) -> u64 {
        let i = ENVOY_COUNTERS.iter().position(|c| *c == name).unwrap_or(0);
        self.envoy[i].saturating_sub(before.envoy[i])
    }

    fn sim(&self, before: &Reading, key: &str) -> u64 {
        counter(&self.sims, key).saturating_sub(counter(&before.sims, key))
    }

    fn disagg(&self, before: &Reading, key: &str) -> u64 {
        let sum = |v: &[Value]| v.iter().map(|c| c[key].as_u64().unwrap_or(0)).sum::<u64>();
        sum(&self.disagg).saturating_sub(sum(&before.disagg))
    }
}

fn ttft(outcomes: &[Outcome]) -> Value {
    let t = admitted_ttft_us(outcomes);
    json!({"p50": ms(&t, 50.0), "p90": ms(&t, 90.0), "p99": ms(&t, 99.0)})
}

/// One arm's figures on one run.
fn summarize(outcomes: &[Outcome], before: &Reading, after: &Reading, kvgate: bool) -> Value {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.status == 200).collect();
    let shed = outcomes.iter().filter(|o| o.status == 503).count();
    let span_s = crate::stats::span_s(outcomes).max(1e-9);
    let tokens: u64 = ok.iter().map(|o| u64::from(o.chunks)).sum();
    // A pull's decode leg counts the prompt as looked up and missed where
    // it lands, though it computed none of it: the blocks it pulled are
    // taken off the workers' misses. A pull's partial last block counts
    // as whole, a few tokens a pull.
    let blocks_pulled = after.disagg(before, "blocks_pulled");
    let missed = after
        .sim(before, "prefix_cache_queries")
        .saturating_sub(after.sim(before, "prefix_cache_hits"));
    let computed = missed.saturating_sub(blocks_pulled * BLOCK_SIZE);
    let prompt: u64 = ok.iter().filter_map(|o| o.prompt_tokens).sum();
    let mut v = json!({
        "sent": outcomes.len(),
        "ok": ok.len(),
        "shed": shed,
        "failed": outcomes.len() - ok.len() - shed,
        "ttft_ms": ttft(outcomes),
        "span_s": span_s,
        "throughput_rps": ok.len() as f64 / span_s,
        "output_tok_per_s": tokens as f64 / span_s,
        "prompt_tokens": prompt,
        "computed_tokens": computed,
        "hit_rate": if prompt > 0 { json!(1.0 - computed as f64 / prompt as f64) } else { Value::Null },
        "blocks_pulled": blocks_pulled,
        "blocks_pulled_per_request": blocks_pulled as f64 / outcomes.len().max(1) as f64,
    });
    let mut sims = serde_json::Map::new();
    for k in SIM_COUNTERS {
        sims.insert(k.into(), json!(after.disagg(before, k)));
    }
    // Since the worker started: the link keeps no per-run maximum.
    sims.insert(
        "link_max_concurrent_so_far".into(),
        json!(
            after
                .disagg
                .iter()
                .filter_map(|c| c["link_max_concurrent"].as_u64())
                .max()
        ),
    );
    v["sims"] = Value::Object(sims);
    if kvgate {
        let placed = |k: &str| after.envoy(before, &format!("kvgate_placed_{k}_total"));
        let (holder, recompute, pull) = (placed("holder"), placed("recompute"), placed("pull"));
        let total = holder + recompute + pull;
        // Only a model that pulls counts its placements.
        v["placed"] = if total > 0 {
            json!({
                "holder": holder, "recompute": recompute, "pull": pull,
                "holder_share": holder as f64 / total as f64,
                "recompute_share": recompute as f64 / total as f64,
                "pull_share": pull as f64 / total as f64,
            })
        } else {
            Value::Null
        };
        let moved = after.envoy(before, "kvgate_pull_blocks_moved_total");
        v["pull_blocks_moved"] = json!(moved);
        v["blocks_moved_per_request"] = json!(moved as f64 / outcomes.len().max(1) as f64);
        v["recompute_blocks"] = json!(after.envoy(before, "kvgate_recompute_blocks_total"));
        v["prefill_remote"] = json!(after.envoy(before, "kvgate_prefill_remote_total"));
        v["prefill_failed"] = json!(after.envoy(before, "kvgate_prefill_failed_total"));
    }
    let mut tags: Vec<&str> = outcomes.iter().map(|o| o.tag.as_str()).collect();
    tags.sort_unstable();
    tags.dedup();
    if tags.contains(&"hot") {
        let mut by = serde_json::Map::new();
        for t in tags {
            let mine: Vec<Outcome> = outcomes.iter().filter(|o| o.tag == t).cloned().collect();
            by.insert(
                t.into(),
                json!({"sent": mine.len(), "ttft_ms": ttft(&mine)}),
            );
        }
        v["by_tag"] = Value::Object(by);
    }
    v
}

/// One arm on one run: the fleet drained and emptied first.
fn measure(
    rt: &tokio::runtime::Runtime,
    stack: &Stack,
    arm: &str,
    specs: &[RequestSpec],
    time_scale: f64,
) -> Result<Value> {
    reset(stack)?;
    let kvgate = arm != "least_request";
    let url = if kvgate {
        stack.envoy_url()
    } else {
        stack.plain_url()
    };
    let before = read(stack);
    // Only a pull makes a prefill leg on a model of `both` workers.
    let legs = arm == "pulls";
    let legs_before = if legs {
        histogram_buckets(stack, "kvgate_prefill_us").unwrap_or_default()
    } else {
        Vec::new()
    };
    let t = Instant::now();
    let outcomes = rt.block_on(run_open_loop(&Target::new(url), specs, time_scale));
    let wall = t.elapsed().as_secs_f64();
    let after = read(stack);
    let mut v = summarize(&outcomes, &before, &after, kvgate);
    v["wall_s"] = json!(wall);
    if legs {
        std::thread::sleep(FLUSH);
        let legs_after = histogram_buckets(stack, "kvgate_prefill_us").unwrap_or_default();
        let p = percentiles_between(&legs_before, &legs_after, &[50.0, 90.0]);
        let ms = |k: &str| {
            p[k].as_f64()
                .filter(|x| x.is_finite())
                .map(|us| us / 1000.0)
        };
        v["prefill_leg_ms"] = json!({"count": p["count"], "p50": ms("P50"), "p90": ms("P90")});
    }
    Ok(v)
}

/// Completions per second of a closed loop of `concurrency` through
/// today's kvgate, between its first and last `concurrency` completions.
fn capacity(
    rt: &tokio::runtime::Runtime,
    stack: &Stack,
    specs: &[RequestSpec],
    concurrency: usize,
) -> Result<Value> {
    reset(stack)?;
    let t = Instant::now();
    let outcomes = rt.block_on(run_closed_loop(
        &Target::new(stack.envoy_url()),
        specs,
        concurrency,
    ));
    let wall = t.elapsed().as_secs_f64();
    let ends: Vec<u64> = outcomes
        .iter()
        .filter(|o| o.status == 200)
        .map(|o| o.start_us + o.latency_us)
        .collect();
    crate::stats::steady_capacity(ends, outcomes.len(), concurrency, wall)
}

/// `a` over `b` at `path` of two arms' figures.
fn over(a: &Value, b: &Value, path: &[&str]) -> Value {
    let get = |v: &Value| path.iter().fold(v, |cur, p| &cur[*p]).as_f64();
    match (get(a), get(b)) {
        (Some(x), Some(y)) if y > 0.0 && x.is_finite() => json!(x / y),
        _ => Value::Null,
    }
}

pub fn run(quick: bool) -> Result<Value> {
    let started = Instant::now();
    // Seconds of arrivals per run. The trace's conversations come back
    // after a couple of hundred other requests, which its prefill-bound
    // rate takes longer to reach.
    let (secs, mooncake_secs) = if quick { (10.0, 15.0) } else { (40.0, 80.0) };
    let loads: &[f64] = if quick { &QUICK_LOADS } else { &LOADS };
    let (decode_bound_n, mooncake_n) = if quick { (96, 64) } else { (192, 96) };
    let rt = tokio::runtime::Runtime::new()?;
    let mut workloads = vec![
        shared_prefix_workload(secs, decode_bound_n),
        load_spill_workload(secs, decode_bound_n),
    ];
    workloads.extend(mooncake_workload(mooncake_secs, mooncake_n)?);

    eprintln!("xtask: bench pull: today's fleet (capacity, today, least request)");
    let today = start(false)?;
    // Capacity first, every workload, then each arm's runs.
    let mut caps = Vec::new();
    for w in &workloads {
        eprintln!(
            "xtask: bench pull: {} capacity ({} requests, {} in flight)",
            w.name,
            w.capacity_specs.len(),
            w.concurrency
        );
        let cap = capacity(&rt, &today, &w.capacity_specs, w.concurrency)
            .with_context(|| format!("{} capacity", w.name))?;
        eprintln!("xtask: bench pull: {} capacity {cap}", w.name);
        caps.push(cap);
    }
    // The requests of every workload and load, the same in every arm.
    let mut runs: Vec<Vec<Run>> = Vec::new();
    for (w, cap) in workloads.iter().zip(&caps) {
        let rps = cap["rps"].as_f64().unwrap_or(0.0);
        let mut mine = Vec::new();
        for &load in loads {
            let rate = load * rps;
            let (specs, scale) = (w.make)(rate)?;
            mine.push(Run {
                load,
                rate,
                specs,
                scale,
            });
        }
        runs.push(mine);
    }
    let mut results: Vec<Vec<serde_json::Map<String, Value>>> = runs
        .iter()
        .map(|r| r.iter().map(|_| serde_json::Map::new()).collect())
        .collect();
    let mut each = |stack: &Stack, arm: &str| -> Result<()> {
        for (wi, w) in workloads.iter().enumerate() {
            for (ri, run) in runs[wi].iter().enumerate() {
                let Run {
                    load,
                    rate,
                    specs,
                    scale,
                } = run;
                eprintln!(
                    "xtask: bench pull: {arm}, {} at {load}× capacity ({rate:.1} req/s, {} requests)",
                    w.name,
                    specs.len()
                );
                let v = measure(&rt, stack, arm, specs, *scale)
                    .with_context(|| format!("{arm}, {} at {load}×", w.name))?;
                eprintln!("xtask: bench pull: {arm}, {} at {load}×: {v}", w.name);
                results[wi][ri].insert(arm.into(), v);
            }
        }
        Ok(())
    };
    each(&today, "today")?;
    each(&today, "least_request")?;
    drop(today);
    eprintln!("xtask: bench pull: the pulls fleet");
    let pulls = start(true)?;
    each(&pulls, "pulls")?;
    drop(pulls);

    let mut out = Vec::new();
    for (((w, cap), mine), res) in workloads.iter().zip(&caps).zip(&runs).zip(results) {
        let rates: Vec<Value> = mine
            .iter()
            .zip(res)
            .map(
                |(
                    Run {
                        load, rate, specs, ..
                    },
                    arms,
                )| {
                    let p = &arms["pulls"];
                    let (t, lr) = (&arms["today"], &arms["least_request"]);
                    let vs = json!({
                        "ttft_p90_vs_today": over(p, t, &["ttft_ms", "p90"]),
                        "ttft_p90_vs_least_request": over(p, lr, &["ttft_ms", "p90"]),
                        "throughput_vs_today": over(p, t, &["throughput_rps"]),
                        "throughput_vs_least_request": over(p, lr, &["throughput_rps"]),
                        "today_ttft_p90_vs_least_request": over(t, lr, &["ttft_ms", "p90"]),
                    });
                    json!({"load": load, "rate_per_s": rate, "requests": specs.len(),
                       "arms": arms, "pulls_vs": vs})
                },
            )
            .collect();
        out.push(
            json!({"name": w.name, "describe": w.describe, "seconds": w.secs,
                        "capacity": cap, "rates": rates}),
        );
    }
    let date = crate::output("date", &["-u", "+%Y-%m-%d %H:%M UTC"])
        .map(|d| d.trim().to_string())
        .unwrap_or_default();
    Ok(json!({
        "name": "pull",
        "quick": quick,
        "date": date,
        "workers": WORKERS,
        "sim": sim_args().into_iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        "pull_table": pull_toml(),
        "request_bound": REQUEST_BOUND,
        "output_tokens": OUTPUT_TOKENS,
        "loads": loads,
        "arms": ARMS,
        "workloads": out,
        "wall_s": started.elapsed().as_secs_f64(),
    }))
}

fn times(x: Option<f64>) -> String {
    match x {
        Some(x) if x.is_finite() => format!("×{}", crate::figures::fixed(x, 2)),
        _ => "—".into(),
    }
}

fn arm_label(arm: &str) -> &'static str {
    match arm {
        "pulls" => "kvgate with pulls",
        "today" => "kvgate today (no pull table)",
        "least_request" => "least request (no kvgate)",
        _ => "?",
    }
}

fn workload_table(w: &Value, arms: &[String]) -> String {
    let mut md = String::from(
        "| load | arm | TTFT p50 / p90 / p99 | TTFT p90: pulls against it | completed | throughput | throughput: pulls against it | hit rate | blocks moved per request: planned / pulled | placed pull / holder / recompute | 503 / failed |\n\
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in w["rates"].as_array().into_iter().flatten() {
        let p = &r["arms"]["pulls"];
        for arm in arms {
            let a = &r["arms"][arm.as_str()];
            if !a.is_object() {
                continue;
            }
            let g = |path: &[&str]| at(a, path);
            let (ttft_vs, tput_vs) = if arm == "pulls" {
                ("—".to_string(), "—".to_string())
            } else {
                (
                    times(over(p, a, &["ttft_ms", "p90"]).as_f64()),
                    times(over(p, a, &["throughput_rps"]).as_f64()),
                )
            };
            let placed = if a["placed"].is_object() {
                format!(
                    "{} / {} / {}",
                    pct(g(&["placed", "pull_share"]), 0),
                    pct(g(&["placed", "holder_share"]), 0),
                    pct(g(&["placed", "recompute_share"]), 0)
                )
            } else {
                "—".into()
            };
            let moved = if a["placed"].is_object() {
                format!(
                    "{} / {}",
                    f(g(&["blocks_moved_per_request"]), 1),
                    f(g(&["blocks_pulled_per_request"]), 1)
                )
            } else {
                f(g(&["blocks_pulled_per_request"]), 1)
            };
            md.push_str(&format!(
                "| {}× ({} req/s) | {} | {} / {} / {} ms | {ttft_vs} | {} of {} | {} req/s, {} tok/s | {tput_vs} | {} | {moved} | {placed} | {} / {} |\n",
                f(r["load"].as_f64(), 1),
                f(r["rate_per_s"].as_f64(), 1),
                arm_label(arm),
                f(g(&["ttft_ms", "p50"]), 0),
                f(g(&["ttft_ms", "p90"]), 0),
                f(g(&["ttft_ms", "p99"]), 0),
                f(g(&["ok"]), 0),
                f(g(&["sent"]), 0),
                f(g(&["throughput_rps"]), 1),
                f(g(&["output_tok_per_s"]), 0),
                pct(g(&["hit_rate"]), 1),
                f(g(&["shed"]), 0),
                f(g(&["failed"]), 0),
            ));
        }
    }
    let legs: Vec<String> = w["rates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| at(r, &["arms", "pulls", "prefill_leg_ms", "count"]).unwrap_or(0.0) > 0.0)
        .map(|r| {
            let p = &r["arms"]["pulls"];
            format!(
                "at {}×, {} legs: {} / {} ms",
                f(r["load"].as_f64(), 1),
                f(at(p, &["prefill_leg_ms", "count"]), 0),
                f(at(p, &["prefill_leg_ms", "p50"]), 0),
                f(at(p, &["prefill_leg_ms", "p90"]), 0),
            )
        })
        .collect();
    if !legs.is_empty() {
        md.push_str(&format!(
            "\nThe pulls' prefill legs on the holder, from the filter's call to the holder's answer (Envoy's `kvgate_prefill_us`), p50 / p90: {}.\n",
            legs.join("; ")
        ));
    }
    // The hot group's requests apart, where the workload has one.
    let hot: Vec<String> = w["rates"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| {
            arms.iter().filter_map(move |arm| {
                let a = &r["arms"][arm.as_str()];
                a["by_tag"]["hot"].is_object().then(|| {
                    format!(
                        "{} at {}×: {} / {} ms",
                        arm.replace('_', " "),
                        f(r["load"].as_f64(), 1),
                        f(at(a, &["by_tag", "hot", "ttft_ms", "p50"]), 0),
                        f(at(a, &["by_tag", "hot", "ttft_ms", "p90"]), 0),
                    )
                })
            })
        })
        .collect();
    if !hot.is_empty() {
        md.push_str(&format!(
            "\nThe hot group's requests alone, TTFT p50 / p90: {}.\n",
            hot.join("; ")
        ));
    }
    md
}

pub fn report(v: &Value) -> String {
    let n = |path: &[&str], d: usize| f(at(v, path), d);
    let quick = v["quick"].as_bool().unwrap_or(false);
    let sim = crate::stats::flags(&v["sim"]);
    let arms: Vec<String> = v["arms"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(String::from))
        .collect();
    let table: String = v["pull_table"]
        .as_str()
        .unwrap_or("")
        .lines()
        .filter(|l| !l.starts_with('['))
        .map(|l| format!("`{l}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut md = format!(
        "\n## Moving the KV: pulls against recompute ({} simulated GPUs: kvgate with pulls, kvgate today, least request)\n\n\
`cargo xtask bench --only pull`, {} run, {}{}. One fleet of {} `kvgate-sim` workers, every one `both` \
and speaking vLLM's NIXL (a real side channel, `kv_both`, `--kv-load-failure-policy recompute`), the same in every arm: {}. \
Arms: kvgate with `[models.disaggregation] protocol = \"vllm-nixl\"` and its pull table ({}; the sims' own KV bytes, prefill speed \
and link, no topology, so every pair is `elsewhere`); kvgate with the same section and no pull table (each request whole, on the \
holder or computed again elsewhere, as today); Envoy's least-request balancing over the same workers, no kvgate. In both kvgate \
arms a worker takes at most {} requests (`active_decode_requests_threshold`, one batch slot short of the \
engine's: nothing queues in an engine, and a holder keeps a slot to prefill a pull's tail in; least request uses every slot and \
queues in the engines), and what no worker may take is held in Envoy (admission, one class, no reserve) rather than shed. \
Each workload's capacity is the completion rate of a closed loop through today's kvgate in the same run, and every load a multiple \
of it; the same requests at the same times in every arm, every prefix cache emptied and the fleet drained between runs. \
TTFT is at the client through Envoy. Throughput: completed requests, and their streamed tokens, per second from the first send to \
the last answer. Hit rate: the share of the prompt tokens of the completed requests that no worker computed (from the workers' \
counters: misses, less the tokens pulled). Blocks moved per request sent: planned, Envoy's `kvgate_pull_blocks_moved_total` (the blocks the index says the decode worker lacks); pulled, the blocks the sims' decode legs pulled (fewer where a decode worker got the blocks meanwhile, e.g. from another pull of the same prefix in flight). Placed: Envoy's \
`kvgate_placed_{{pull,holder,recompute}}_total` (counted on a model that pulls only).\n",
        n(&["workers"], 0),
        if quick { "quick" } else { "full" },
        v["date"].as_str().unwrap_or(""),
        if quick {
            " (figures from a quick run: one load, short windows; a check more than a figure to quote)"
        } else {
            ""
        },
        n(&["workers"], 0),
        sim.join(", "),
        table,
        n(&["request_bound"], 0),
    );
    let workloads: Vec<&Value> = v["workloads"].as_array().into_iter().flatten().collect();
    for w in &workloads {
        md.push_str(&format!(
            "\n### {}: {}\n\n{} s of arrivals a run. Capacity: {} req/s ({} requests, {} in flight).\n\n{}",
            w["name"].as_str().unwrap_or("?"),
            w["describe"].as_str().unwrap_or(""),
            f(at(w, &["seconds"]), 0),
            f(at(w, &["capacity", "rps"]), 1),
            f(at(w, &["capacity", "requests"]), 0),
            f(at(w, &["capacity", "concurrency"]), 0),
            workload_table(w, &arms),
        ));
    }
    if !workloads.iter().any(|w| w["name"] == "mooncake") {
        md.push_str("\nThe Mooncake trace was not found: no Mooncake figures.\n");
    }
    // Where a pull pays: its TTFT p90 and throughput against today's, by
    // workload and load.
    let loads: Vec<f64> = v["loads"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .collect();
    let head: Vec<String> = loads
        .iter()
        .map(|l| format!("{}×", crate::figures::fixed(*l, 1)))
        .collect();
    md.push_str(&format!(
        "\nWhere a pull pays: kvgate with pulls against kvgate today, TTFT p90 (under ×1: pulls faster) and throughput (over ×1: pulls more), by workload and load; the share of requests pulled; and against least request, TTFT p90:\n\n\
| workload | {} |\n| --- |{}\n",
        head.iter()
            .map(|h| format!("{h}: TTFT p90 / throughput vs today, pulled, TTFT p90 vs least request"))
            .collect::<Vec<_>>()
            .join(" | "),
        " --- |".repeat(head.len()),
    ));
    let (mut pays, mut not, mut none) = (Vec::new(), Vec::new(), Vec::new());
    for w in &workloads {
        let name = w["name"].as_str().unwrap_or("?");
        let mut cells = Vec::new();
        for l in &loads {
            let r = w["rates"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|r| r["load"].as_f64() == Some(*l));
            let Some(r) = r else {
                cells.push("—".to_string());
                continue;
            };
            let ratio = at(r, &["pulls_vs", "ttft_p90_vs_today"]);
            let pulled = at(r, &["arms", "pulls", "placed", "pull"]).unwrap_or(0.0);
            cells.push(format!(
                "{} / {}, {}, {}",
                times(ratio),
                times(at(r, &["pulls_vs", "throughput_vs_today"])),
                pct(at(r, &["arms", "pulls", "placed", "pull_share"]), 0),
                times(at(r, &["pulls_vs", "ttft_p90_vs_least_request"])),
            ));
            let at_load = format!(
                "{name} at {}× ({})",
                crate::figures::fixed(*l, 1),
                times(ratio)
            );
            // With nothing pulled the two kvgate arms route alike, and
            // their ratio is the runs' noise.
            match ratio {
                Some(_) if pulled == 0.0 => none.push(at_load),
                Some(x) if x < 1.0 => pays.push(at_load),
                Some(_) => not.push(at_load),
                None => {}
            }
        }
        md.push_str(&format!("| {name} | {} |\n", cells.join(" | ")));
    }
    let list = |v: &[String]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    md.push_str(&format!(
        "\nPulls cut the TTFT p90 against today on: {}; they did not on: {}; nothing was pulled on: {} (the two kvgate arms routed alike there, and the ratio is the runs' own spread).\n",
        list(&pays),
        list(&not),
        list(&none)
    ));
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(p90: f64, rps: f64, pulled: Option<u64>) -> Value {
        let mut v = json!({
            "sent": 10, "ok": 10, "shed": 0, "failed": 0,
            "ttft_ms": {"p50": p90 / 2.0, "p90": p90, "p99": p90 * 2.0},
            "throughput_rps": rps, "output_tok_per_s": rps * 32.0,
            "hit_rate": 0.5, "blocks_pulled_per_request": 1.0,
        });
        if let Some(n) = pulled {
            v["blocks_moved_per_request"] = json!(2.0);
            v["prefill_leg_ms"] = json!({"count": n, "p50": 40.0, "p90": 90.0});
            v["placed"] = json!({"pull": n, "holder": 10 - n, "recompute": 0,
                                 "pull_share": n as f64 / 10.0, "holder_share": 1.0 - n as f64 / 10.0,
                                 "recompute_share": 0.0});
        }
        v
    }

    fn rate(load: f64, pulls: Value, today: Value, lr: Value) -> Value {
        json!({"load": load, "rate_per_s": 10.0 * load, "requests": 10,
               "pulls_vs": {"ttft_p90_vs_today": over(&pulls, &today, &["ttft_ms", "p90"]),
                            "throughput_vs_today": over(&pulls, &today, &["throughput_rps"]),
                            "ttft_p90_vs_least_request": over(&pulls, &lr, &["ttft_ms", "p90"])},
               "arms": {"pulls": pulls, "today": today, "least_request": lr}})
    }

    #[test]
    fn report_says_where_a_pull_pays_from_the_results() {
        let v = json!({
            "name": "pull", "quick": false, "date": "d", "workers": 4,
            "sim": [["--max-running", "4"]], "pull_table": pull_toml(), "request_bound": 3,
            "loads": [0.5, 1.0], "arms": ARMS,
            "workloads": [
                {"name": "load_spill", "describe": "spill", "seconds": 40,
                 "capacity": {"rps": 20.0, "requests": 192, "concurrency": 32},
                 "rates": [
                    rate(0.5, arm(500.0, 10.0, Some(2)), arm(1000.0, 8.0, None), arm(800.0, 9.0, None)),
                    rate(1.0, arm(1200.0, 20.0, Some(3)), arm(1000.0, 16.0, None), arm(800.0, 18.0, None)),
                 ]},
                {"name": "mooncake", "describe": "trace", "seconds": 80,
                 "capacity": {"rps": 3.0, "requests": 96, "concurrency": 16},
                 "rates": [rate(0.5, arm(900.0, 1.5, Some(0)), arm(1000.0, 1.5, None), arm(1000.0, 1.5, None))]},
            ],
        });
        let md = report(&v);
        assert!(md.contains("## Moving the KV: pulls against recompute"));
        assert!(md.contains("`min_blocks = 4`"), "{md}");
        assert!(
            md.contains("| load_spill | ×0.50 / ×1.25, 20 %, ×0.62 | ×1.20 / ×1.25, 30 %, ×1.50 |"),
            "{md}"
        );
        assert!(
            md.contains("| mooncake | ×0.90 / ×1.00, 0 %, ×0.90 | — |"),
            "{md}"
        );
        assert!(md.contains("against today on: load_spill at 0.5× (×0.50); they did not on: load_spill at 1.0× (×1.20); nothing was pulled on: mooncake at 0.5× (×0.90)"), "{md}");
        assert!(
            md.contains(
                "| 0.5× (5.0 req/s) | kvgate today (no pull table) | 500 / 1000 / 2000 ms | ×0.50 |"
            ),
            "{md}"
        );
        assert!(md.contains("| 2.0 / 1.0 | 20 % / 80 % / 0 % |"), "{md}");
        assert!(
            md.contains("p50 / p90: at 0.5×, 2 legs: 40 / 90 ms; at 1.0×, 3 legs: 40 / 90 ms."),
            "{md}"
        );
        assert!(
            md.contains("80 s of arrivals a run. Capacity: 3.0 req/s (96 requests, 16 in flight)."),
            "{md}"
        );
    }
}
