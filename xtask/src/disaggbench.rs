//! `disagg`: aggregated against disaggregated prefill/decode serving on the
//! same four simulated GPUs, every fleet in one run.
//!
//! Fleets, each its own stack of four `kvgate-sim` workers with identical
//! time models ([`SIM`]):
//! * `aggregated`: four `both` workers, no `[models.disaggregation]`: each
//!   GPU prefills and decodes, and a decode step that shares its engine
//!   step with a prefill chunk pays for it (`--prefill-interference`);
//! * `2P+2D`, `1P+3D`: `prefill` and `decode` workers speaking vLLM's NIXL
//!   protocol, the filter sending the prefill leg and then the request.
//!
//! Workloads, the same requests on every fleet:
//! * `interference`: the aggregated fleet alone at short and long prompts,
//!   the same rate and outputs, to show that its decode steps slow down
//!   with the prefill they share the GPU with (what disaggregation avoids);
//! * `long_prompt`: 4–8k-token prompts, 200–500 output tokens, streaming,
//!   Poisson arrivals;
//! * `mooncake`: the Mooncake conversation trace as token prompts;
//! * `multi_turn`: conversations whose next turn extends the previous
//!   prompt and answer, on 1P+3D (three decode workers a follow-up could
//!   land on) with decode affinity on (3.0) and off (0): whether it
//!   returns to the decode worker holding its context, where the
//!   conditional rule keeps it local.
//!
//! Between runs every worker's prefix cache is reset and the fleet drained.

use crate::build;
use crate::quality::{cap_outputs, counter, mooncake_text, reset, sims};
use crate::shedbench::token_stream as stream;
use crate::stats::{admitted_ttft_us, ms};
use crate::stats::{histogram_buckets, percentiles_between};
use anyhow::{Context, Result};
use kvgate_load::workload::mooncake;
use kvgate_load::{Outcome, RequestSpec, Target, run_open_loop};
use kvgate_stack::{Stack, StackConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::time::Duration;

/// The simulated GPU, identical in every fleet. 100 µs a prompt token and
/// 15 ms a decode step put prefill and decode in an 8B model's proportion
/// on one GPU, slowed down so that two shared cores can stream every token
/// through Envoy. A step's budget of 2048 tokens is vLLM's chunked-prefill
/// default for online serving; a decode step sharing it with a full chunk
/// pays a tenth of that chunk's compute (+20 ms): enough that a decode
/// step sharing the GPU with a prefill is a third slower, as measured
/// chunked-prefill serving shows, with a fleet that still meets its SLO.
const SIM: [(&str, &str); 11] = [
    ("--prefill-us-per-token", "100"),
    ("--decode-ms-per-token", "15"),
    ("--decode-ms-per-running", "0.2"),
    ("--prefill-interference", "0.1"),
    ("--max-num-batched-tokens", "2048"),
    ("--prefill-lanes", "1"),
    ("--max-running", "32"),
    ("--num-gpu-blocks", "32768"),
    ("--kv-transfer-gbps", "100"),
    ("--kv-bytes-per-block", "2097152"),
    ("--speedup", "1"),
];

const WORKERS: usize = 4;

/// The SLO goodput counts against: time to first token, and the mean gap
/// between a stream's tokens (TPOT).
const SLO_TTFT_MS: f64 = 3000.0;
const SLO_TPOT_MS: f64 = 20.0;

/// Offered rate of the long-prompt workload: the aggregated fleet's
/// prefill lanes busy about 40 % of the time (6k tokens × 100 µs = 0.6 s
/// a prompt), where its decode steps share a GPU with prefill that often.
const LONG_RATE: f64 = 2.5;
/// The Mooncake trace's rate: its prompts are 14k tokens on average.
const MOONCAKE_RATE: f64 = 1.0;

struct Fleet {
    name: &'static str,
    roles: [&'static str; WORKERS],
    /// `[models.disaggregation]`'s `decode_affinity`; `None`: aggregated.
    decode_affinity: Option<f64>,
}

const AGGREGATED: Fleet = Fleet {
    name: "aggregated",
    roles: ["both"; WORKERS],
    decode_affinity: None,
};
const P2D2: Fleet = Fleet {
    name: "2P+2D",
    roles: ["prefill", "prefill", "decode", "decode"],
    decode_affinity: Some(3.0),
};
const P1D3: Fleet = Fleet {
    name: "1P+3D",
    roles: ["prefill", "decode", "decode", "decode"],
    decode_affinity: Some(3.0),
};
const P1D3_NO_AFFINITY: Fleet = Fleet {
    name: "1P+3D, decode_affinity 0",
    roles: ["prefill", "decode", "decode", "decode"],
    decode_affinity: Some(0.0),
};

fn config(fleet: &Fleet) -> StackConfig {
    let sim_args = SIM.iter().flat_map(|(k, v)| [*k, *v]).map(String::from);
    let disaggregated = fleet.decode_affinity.is_some();
    // Only a disaggregated fleet's sims speak NIXL: the aggregated one is
    // four plain engines.
    let role_args = |role: &str| -> Vec<String> {
        let kv_role = match role {
            "prefill" => "kv_producer",
            "decode" => "kv_consumer",
            _ => "kv_both",
        };
        if disaggregated {
            ["--kv-role", kv_role, "--kv-side-channel-port", "0"]
                .map(String::from)
                .to_vec()
        } else {
            Vec::new()
        }
    };
    StackConfig {
        workers: WORKERS,
        // The decode workers publish the blocks they receive: what the
        // conditional rule and the decode affinity read.
        kv_events: true,
        sim_args: sim_args.collect(),
        roles: fleet.roles.map(String::from).to_vec(),
        worker_sim_args: fleet.roles.iter().map(|r| role_args(r)).collect(),
        model_toml: fleet.decode_affinity.map_or(String::new(), |a| {
            format!("[models.disaggregation]\nprotocol = \"vllm-nixl\"\ndecode_affinity = {a:.1}\n")
        }),
        // Mooncake prompts reach 120k tokens.
        plugin: json!({"max_body_bytes": 4 << 20}),
        ..StackConfig::default()
    }
}

/// Poisson arrivals at `rate` for `secs`, prompts of `isl` tokens that no
/// other request shares, `osl` output tokens (both uniform in the range).
fn poisson(
    rate: f64,
    secs: f64,
    isl: (u32, u32),
    osl: (u32, u32),
    seed: u64,
    tag: &str,
) -> Vec<RequestSpec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut t, mut i) = (0.0, 0u32);
    let mut out = Vec::new();
    while t < secs {
        let len = rng.random_range(isl.0..=isl.1);
        // Each request's tokens are its own: nothing is cached but what
        // the fleet computed for that very request.
        let base = 1_000_000 + (seed as u32 % 16) * 100_000_000 + i * 10_000;
        let prompt = (0..len).map(|k| base + k).collect();
        out.push(stream(prompt, rng.random_range(osl.0..=osl.1), t, tag));
        i += 1;
        let u: f64 = rng.random_range(1e-9..1.0);
        t += -u.ln() / rate;
    }
    out
}

/// Conversations of `turns` turns: a 3000-token first prompt (past the
/// conditional rule's 2048 uncached tokens, so it takes the prefill leg),
/// then each turn the previous prompt, its 64-token answer and a 256-token
/// question. Conversations start evenly over `secs`; turns follow each
/// other `gap_s` apart, longer than a turn takes.
fn multi_turn(conversations: u32, turns: u32, secs: f64, gap_s: f64) -> Vec<RequestSpec> {
    const FIRST: u32 = 3000;
    const ANSWER: u32 = 64;
    const QUESTION: u32 = 256;
    let mut out = Vec::new();
    for c in 0..conversations {
        let start = secs * f64::from(c) / f64::from(conversations);
        for t in 0..turns {
            // A token is a function of its position in its conversation,
            // so every turn's prompt extends the one before.
            let len = FIRST + t * (ANSWER + QUESTION);
            let prompt = (0..len).map(|p| 2_000_000_000 + c * 100_000 + p).collect();
            let tag = if t == 0 { "first" } else { "follow_up" };
            out.push(stream(prompt, ANSWER, start + f64::from(t) * gap_s, tag));
        }
    }
    out.sort_by_key(|s| s.at);
    out
}

/// The Mooncake trace's first requests as token prompts (512-token hash
/// blocks), outputs capped at 500, timestamps scaled to `rate`; `None`
/// when the trace is not there.
fn mooncake_specs(rate: f64, secs: f64) -> Result<Option<(Vec<RequestSpec>, f64)>> {
    let (path, text) = mooncake_text();
    let Some(text) = text else {
        eprintln!(
            "xtask: bench disagg: no Mooncake trace at {} (set KVGATE_MOONCAKE_TRACE); skipped",
            path.display()
        );
        return Ok(None);
    };
    let n = (rate * secs).ceil() as usize;
    let mut trace = mooncake(&text, "demo-model", n, 512).map_err(anyhow::Error::msg)?;
    cap_outputs(&mut trace, 500);
    let span = trace.last().map_or(1.0, |s| s.at.as_secs_f64()).max(1.0);
    let scale = secs / span;
    Ok(Some((trace, scale)))
}

/// Every token gap of the admitted streams, sorted, µs.
fn itl_us(outcomes: &[Outcome]) -> Vec<u64> {
    let mut v: Vec<u64> = outcomes
        .iter()
        .filter(|o| o.status == 200)
        .flat_map(|o| o.itl_us.iter().copied())
        .collect();
    v.sort_unstable();
    v
}

/// Whether an admitted stream met the SLO.
fn in_slo(o: &Outcome) -> bool {
    let (Some(ttft), false) = (o.ttft_us, o.itl_us.is_empty()) else {
        return false;
    };
    let tpot_ms = o.itl_us.iter().sum::<u64>() as f64 / o.itl_us.len() as f64 / 1000.0;
    o.status == 200 && ttft as f64 / 1000.0 <= SLO_TTFT_MS && tpot_ms <= SLO_TPOT_MS
}

/// TTFT and ITL percentiles, and goodput over the offered `secs`.
fn latency(outcomes: &[Outcome], secs: f64) -> Value {
    let ttft = admitted_ttft_us(outcomes);
    let itl = itl_us(outcomes);
    let good = outcomes.iter().filter(|o| in_slo(o)).count();
    json!({
        "sent": outcomes.len(),
        "ok": ttft.len(),
        "failed": outcomes.len() - ttft.len(),
        "ttft_ms": {"p50": ms(&ttft, 50.0), "p90": ms(&ttft, 90.0)},
        "itl_ms": {"p50": ms(&itl, 50.0), "p90": ms(&itl, 90.0), "p99": ms(&itl, 99.0),
                   "mean": itl.iter().sum::<u64>() as f64 / itl.len().max(1) as f64 / 1000.0},
        "goodput_per_s": good as f64 / secs,
        "goodput_share": good as f64 / outcomes.len().max(1) as f64,
    })
}

/// The Envoy and worker readings a run's figures are differences of.
struct Reading {
    local: u64,
    remote: u64,
    decision: Vec<(f64, f64, u64)>,
    prefill: Vec<(f64, f64, u64)>,
    sims: Vec<Value>,
}

fn read(stack: &Stack) -> Result<Reading> {
    Ok(Reading {
        local: stack.envoy_stat("kvgate_prefill_local_total").unwrap_or(0),
        remote: stack.envoy_stat("kvgate_prefill_remote_total").unwrap_or(0),
        decision: histogram_buckets(stack, "kvgate_decision_us")?,
        prefill: histogram_buckets(stack, "kvgate_prefill_us").unwrap_or_default(),
        sims: sims(stack),
    })
}

/// One workload on one fleet: the fleet drained and emptied first, the
/// figures of this run alone.
fn measure(
    stack: &Stack,
    rt: &tokio::runtime::Runtime,
    fleet: &Fleet,
    specs: &[RequestSpec],
    time_scale: f64,
    secs: f64,
) -> Result<Value> {
    reset(stack)?;
    let before = read(stack)?;
    let outcomes = rt.block_on(run_open_loop(
        &Target::new(stack.envoy_url()),
        specs,
        time_scale,
    ));
    // Every request has ended; the workers' counters are final now.
    let sims_after = sims(stack);
    // Envoy computes histograms at its stats flush, every 5 s.
    std::thread::sleep(Duration::from_millis(5500));
    let after = Reading {
        sims: sims_after,
        ..read(stack)?
    };
    // The hit rate of the workers that decode: a decode worker's cached
    // prompt tokens are the ones no prefill leg had to send it.
    let decoders: Vec<usize> = (0..WORKERS)
        .filter(|&i| fleet.roles[i] != "prefill")
        .collect();
    let pick = |s: &[Value]| decoders.iter().map(|&i| s[i].clone()).collect::<Vec<_>>();
    let delta =
        |k: &str| counter(&pick(&after.sims), k).saturating_sub(counter(&pick(&before.sims), k));
    let (local, remote) = (
        after.local.saturating_sub(before.local),
        after.remote.saturating_sub(before.remote),
    );
    let mut v = latency(&outcomes, secs);
    v["prefill_local"] = json!(local);
    v["prefill_remote"] = json!(remote);
    v["local_share"] = if local + remote > 0 {
        json!(local as f64 / (local + remote) as f64)
    } else {
        Value::Null
    };
    v["decode_hit_rate"] =
        json!(delta("prefix_cache_hits") as f64 / delta("prefix_cache_queries").max(1) as f64);
    v["decision_us"] = percentiles_between(&before.decision, &after.decision, &[50.0, 99.0]);
    v["prefill_leg_ms"] = {
        let p = percentiles_between(&before.prefill, &after.prefill, &[50.0, 90.0]);
        json!({"p50": p["P50"].as_f64().map(|us| us / 1000.0),
               "p90": p["P90"].as_f64().map(|us| us / 1000.0)})
    };
    // Follow-up turns apart, where there are any.
    let follow: Vec<Outcome> = outcomes
        .iter()
        .filter(|o| o.tag == "follow_up")
        .cloned()
        .collect();
    if !follow.is_empty() {
        let ttft = admitted_ttft_us(&follow);
        v["follow_up_ttft_ms"] = json!({"p50": ms(&ttft, 50.0), "p90": ms(&ttft, 90.0)});
    }
    eprintln!("xtask: bench disagg: {}: {v}", fleet.name);
    Ok(v)
}

fn start(fleet: &Fleet) -> Result<Stack> {
    let stack = Stack::start_with(build::release_paths()?, config(fleet))
        .with_context(|| format!("starting the {} fleet", fleet.name))?;
    // A disaggregated request splits only once the filter's snapshot has
    // both roles up: every worker, here.
    stack.wait_routing_ready(Duration::from_secs(30))?;
    Ok(stack)
}

pub fn run(quick: bool) -> Result<Value> {
    // Seconds of arrivals per run.
    let secs = if quick { 15.0 } else { 40.0 };
    let rt = tokio::runtime::Runtime::new()?;
    let long = poisson(LONG_RATE, secs, (4096, 8192), (200, 500), 31, "long");
    let short = poisson(LONG_RATE, secs, (256, 512), (200, 500), 32, "short");
    let trace = mooncake_specs(MOONCAKE_RATE, secs)?;
    let (conversations, turns) = if quick { (10, 4) } else { (30, 4) };
    let chat = multi_turn(conversations, turns, secs, 4.0);
    let chat_secs = secs + 3.0 * 4.0;

    let mut fleets = serde_json::Map::new();
    let mut interference = Value::Null;
    let mut affinity = serde_json::Map::new();
    for fleet in [&AGGREGATED, &P2D2, &P1D3] {
        eprintln!("xtask: bench disagg: fleet {}", fleet.name);
        let stack = start(fleet)?;
        let mut runs = serde_json::Map::new();
        let long_run = measure(&stack, &rt, fleet, &long, 1.0, secs)?;
        if fleet.decode_affinity.is_none() {
            // Same rate and outputs, short prompts against the long ones:
            // how much the prefill sharing its GPU slows the aggregated
            // decode.
            interference = json!({
                "secs": secs,
                "short_256_512": measure(&stack, &rt, fleet, &short, 1.0, secs)?,
                "long_4096_8192": long_run.clone(),
            });
        }
        runs.insert("long_prompt".into(), long_run);
        if let Some((specs, scale)) = &trace {
            runs.insert(
                "mooncake".into(),
                measure(&stack, &rt, fleet, specs, *scale, secs)?,
            );
        }
        if fleet.name == P1D3.name {
            affinity.insert(
                "on_3.0".into(),
                measure(&stack, &rt, fleet, &chat, 1.0, chat_secs)?,
            );
        }
        fleets.insert(fleet.name.into(), Value::Object(runs));
    }
    {
        let fleet = &P1D3_NO_AFFINITY;
        eprintln!("xtask: bench disagg: fleet {}", fleet.name);
        let stack = start(fleet)?;
        affinity.insert(
            "off_0".into(),
            measure(&stack, &rt, fleet, &chat, 1.0, chat_secs)?,
        );
    }
    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    Ok(json!({
        "name": "disagg",
        "quick": quick,
        "date": date,
        "workers": WORKERS,
        "sim": SIM.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        "slo": {"ttft_ms": SLO_TTFT_MS, "tpot_ms": SLO_TPOT_MS},
        "seconds": secs,
        "long_prompt": {"rate_per_s": LONG_RATE, "requests": long.len(),
                        "isl": [4096, 8192], "osl": [200, 500]},
        "mooncake": trace.as_ref().map(|(s, _)| json!({
            "rate_per_s": MOONCAKE_RATE, "requests": s.len(),
            "mean_input_tokens": s.iter().map(|r| r.prompt_tokens.unwrap_or(0)).sum::<u64>() as f64 / s.len().max(1) as f64,
        })),
        "multi_turn": {"conversations": conversations, "turns": turns, "first_prompt": 3000,
                       "answer": 64, "question": 256, "turn_gap_s": 4.0, "fleet": "1P+3D"},
        "interference": interference,
        "fleets": fleets,
        "decode_affinity": affinity,
    }))
}

/// A number at `path`, NaN when absent.
fn num(v: &Value, path: &[&str]) -> f64 {
    crate::stats::at(v, path).unwrap_or(f64::NAN)
}

/// `x` over the aggregated fleet's `base`, as `×r`.
fn ratio(x: f64, base: f64) -> String {
    if base > 0.0 && x.is_finite() {
        format!("×{:.2}", x / base)
    } else {
        "—".into()
    }
}

fn share(v: &Value) -> String {
    v.as_f64()
        .map_or("—".into(), |s| format!("{:.0} %", 100.0 * s))
}

fn workload_table(v: &Value, workload: &str) -> String {
    let base = &v["fleets"]["aggregated"][workload];
    let mut rows = String::new();
    for fleet in ["aggregated", "2P+2D", "1P+3D"] {
        let r = &v["fleets"][fleet][workload];
        if r.is_null() {
            continue;
        }
        let f = |p: &[&str]| num(r, p);
        let b = |p: &[&str]| num(base, p);
        let leg = if f(&["prefill_leg_ms", "p50"]).is_nan() {
            "—".to_string()
        } else {
            format!(
                "{:.0} / {:.0} ms",
                f(&["prefill_leg_ms", "p50"]),
                f(&["prefill_leg_ms", "p90"])
            )
        };
        rows.push_str(&format!(
            "| {fleet} | {:.0} / {:.0} ms ({}) | {:.1} / {:.1} / {:.1} ms ({}) | {:.2}/s, {:.0} % ({}) | {} | {:.0} % | {:.0} / {:.0} µs | {leg} | {} |\n",
            f(&["ttft_ms", "p50"]),
            f(&["ttft_ms", "p90"]),
            ratio(f(&["ttft_ms", "p90"]), b(&["ttft_ms", "p90"])),
            f(&["itl_ms", "p50"]),
            f(&["itl_ms", "p90"]),
            f(&["itl_ms", "p99"]),
            ratio(f(&["itl_ms", "p90"]), b(&["itl_ms", "p90"])),
            f(&["goodput_per_s"]),
            100.0 * f(&["goodput_share"]),
            ratio(f(&["goodput_per_s"]), b(&["goodput_per_s"])),
            share(&r["local_share"]),
            100.0 * f(&["decode_hit_rate"]),
            f(&["decision_us", "P50"]),
            f(&["decision_us", "P99"]),
            f(&["failed"]),
        ));
    }
    format!(
        "| fleet | TTFT p50 / p90 (p90 vs aggregated) | ITL p50 / p90 / p99 (p90 vs aggregated) | goodput (vs aggregated) | kept local | decode-side hit rate | decision P50 / P99 | prefill leg P50 / P90 | failed |\n\
| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n{rows}"
    )
}

pub fn report(v: &Value) -> String {
    let f = |p: &[&str]| num(v, p);
    let sim = crate::stats::flags(&v["sim"]);
    let i = |run: &str, p: &[&str]| num(&v["interference"][run], p);
    let a = |run: &str, p: &[&str]| num(&v["decode_affinity"][run], p);
    let aff_row = |run: &str, label: &str| {
        format!(
            "| {label} | {} | {:.0} % | {:.0} / {:.0} ms | {:.0} / {:.0} ms | {:.1} / {:.1} ms | {:.0} |\n",
            share(&v["decode_affinity"][run]["local_share"]),
            100.0 * a(run, &["decode_hit_rate"]),
            a(run, &["follow_up_ttft_ms", "p50"]),
            a(run, &["follow_up_ttft_ms", "p90"]),
            a(run, &["ttft_ms", "p50"]),
            a(run, &["ttft_ms", "p90"]),
            a(run, &["itl_ms", "p50"]),
            a(run, &["itl_ms", "p90"]),
            a(run, &["failed"]),
        )
    };
    let mooncake = if v["mooncake"].is_null() {
        "The Mooncake trace was not found: no Mooncake figures.\n".to_string()
    } else {
        format!(
            "Mooncake conversation trace, first {:.0} requests (mean input {:.0} tokens, 512-token hash blocks as token prompts), outputs capped at 500 tokens, timestamps scaled to {:.1} req/s:\n\n{}",
            f(&["mooncake", "requests"]),
            f(&["mooncake", "mean_input_tokens"]),
            f(&["mooncake", "rate_per_s"]),
            workload_table(v, "mooncake"),
        )
    };
    format!(
        "\n## Disaggregated prefill and decode ({} simulated GPUs: aggregated ×4 against 2P+2D and 1P+3D)\n\n\
{} run, {}: {:.0} s of arrivals per run{}. Every fleet and workload in the same run, on the same simulated GPUs; \
each fleet its own Envoy, sidecar and four `kvgate-sim` workers, prefix caches emptied between runs. \
Disaggregated fleets: roles `prefill`/`decode`, `[models.disaggregation] protocol = \"vllm-nixl\"` (the conditional rule at its defaults, \
2048 uncached tokens and 0.7 of the prompt), the sims `--kv-role kv_producer|kv_consumer`, a real NIXL side channel between them; \
the aggregated fleet: four `both` workers, no disaggregation section.\n\n\
Simulated GPU, the same in every fleet: {}. TTFT and ITL are wall times at the client through Envoy; ITL is every gap between \
streamed tokens. SLO for goodput: TTFT ≤ {:.0} ms and the stream's mean token gap ≤ {:.0} ms; goodput is requests meeting it per \
offered second. Kept local: Envoy's `kvgate_prefill_local_total` / (`local` + `kvgate_prefill_remote_total`). Decode-side hit rate: \
prompt tokens the decoding workers (all four when aggregated) found cached, from their own counters. Decision: the filter's \
`kvgate_decision_us` over the run (parse, select, and on a disaggregated fleet the prefill callout's planning and dispatch; \
aggregated = without the callout); prefill leg: `kvgate_prefill_us`, the callout's time to its answer.\n\n\
Interference on the aggregated fleet, first (Poisson at {:.1} req/s, 200–500 output tokens, {:.0} s each): ITL p50 / p90 / p99 \
{:.1} / {:.1} / {:.1} ms (mean {:.1}) with 256–512-token prompts against {:.1} / {:.1} / {:.1} ms (mean {:.1}) with the 4–8k-token \
prompts below (TTFT p50 {:.0} against {:.0} ms). A decode step alone takes 15 ms + 0.2 ms per running sequence; one sharing the \
GPU with a 2048-token prefill chunk takes 20 ms more, and the longer the prompts, the more steps do.\n\n\
Long prompts: 4–8k tokens (uniform), 200–500 output tokens, streaming, Poisson at {:.1} req/s ({:.0} requests), \
which keeps the aggregated fleet's prefill (one prompt at a time per GPU, 0.6 s for a mean prompt) busy about 40 % of the time, \
2P+2D's 75 % and 1P+3D's 150 % (over its capacity: the one prefill worker queues). Ratios are against the aggregated fleet:\n\n{}\n{}\n\
Decode affinity, 1P+3D (three decode workers a follow-up can land on), on a multi-turn workload ({:.0} conversations × {:.0} turns: a 3000-token first prompt, then each turn the \
previous prompt, a 64-token answer and a 256-token question, turns 4 s apart); the decode workers publish the blocks they receive:\n\n\
| `decode_affinity` | kept local | decode-side hit rate | follow-up TTFT p50 / p90 | all turns TTFT p50 / p90 | ITL p50 / p90 | failed |\n\
| --- | --- | --- | --- | --- | --- | --- |\n{}{}",
        f(&["workers"]),
        if v["quick"].as_bool().unwrap_or(false) {
            "Quick"
        } else {
            "Full"
        },
        v["date"].as_str().unwrap_or(""),
        f(&["seconds"]),
        if v["quick"].as_bool().unwrap_or(false) {
            " (figures from a quick run: short windows, few requests; a check more than a figure to quote)"
        } else {
            ""
        },
        sim.join(", "),
        f(&["slo", "ttft_ms"]),
        f(&["slo", "tpot_ms"]),
        f(&["long_prompt", "rate_per_s"]),
        f(&["interference", "secs"]),
        i("short_256_512", &["itl_ms", "p50"]),
        i("short_256_512", &["itl_ms", "p90"]),
        i("short_256_512", &["itl_ms", "p99"]),
        i("short_256_512", &["itl_ms", "mean"]),
        i("long_4096_8192", &["itl_ms", "p50"]),
        i("long_4096_8192", &["itl_ms", "p90"]),
        i("long_4096_8192", &["itl_ms", "p99"]),
        i("long_4096_8192", &["itl_ms", "mean"]),
        i("short_256_512", &["ttft_ms", "p50"]),
        i("long_4096_8192", &["ttft_ms", "p50"]),
        f(&["long_prompt", "rate_per_s"]),
        f(&["long_prompt", "requests"]),
        workload_table(v, "long_prompt"),
        mooncake,
        f(&["multi_turn", "conversations"]),
        f(&["multi_turn", "turns"]),
        aff_row("on_3.0", "3.0 (default)"),
        aff_row("off_0", "0 (by load alone)"),
    )
}
