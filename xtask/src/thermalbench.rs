//! `thermal`: a thermal soak (the seed's validation checklist) on
//! `kvgate-sim`'s thermal plant.
//!
//! Four workers of two GPUs each take streaming requests near capacity
//! (open loop, Poisson arrivals). A while in, worker 1's cooling degrades:
//! at its load its GPUs would settle past the slowdown temperature. The
//! same run four times:
//!
//! * `controlled`: kvgate's thermal control on, engines with batch control;
//! * `uncontrolled`: the same readings, control off (`enabled = false`);
//! * `idle_on` / `idle_off`: no degradation, control on and off, to show
//!   what an idle policy costs.
//!
//! Reported: the hottest GPU after settling, throttling entries per worker
//! per minute, goodput, TTFT, and temperature, cap and throughput over
//! time (SVG).

use crate::build;
use crate::plot;
use crate::stats::{self, admitted_latency_us, admitted_ttft_us, points};
use anyhow::{Context, Result};
use kvgate_load::{Outcome, RequestSpec, Target, run_open_loop};
use kvgate_stack::{Stack, StackConfig, ThermalStack, http};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const WORKERS: usize = 4;
const TARGET_C: f64 = 82.0;
const SLOWDOWN_C: f64 = 87.0;
const MAX_TOKENS: u32 = 128;

/// One run's shape.
#[derive(Debug, Clone, Copy)]
struct Soak {
    name: &'static str,
    control: bool,
    degrade: bool,
}

struct Timing {
    secs: f64,
    degrade_at: f64,
    settle: f64,
    rate: f64,
}

fn timing(quick: bool) -> Timing {
    // Four workers of 32 slots, ~1.5 s a request: about 84 req/s; the load
    // is 75 % of that.
    if quick {
        Timing {
            secs: 90.0,
            degrade_at: 15.0,
            settle: 35.0,
            rate: 63.0,
        }
    } else {
        Timing {
            secs: 180.0,
            degrade_at: 30.0,
            settle: 40.0,
            rate: 63.0,
        }
    }
}

pub fn run(quick: bool) -> Result<Value> {
    let t = timing(quick);
    let mut runs = serde_json::Map::new();
    for s in [
        Soak {
            name: "controlled",
            control: true,
            degrade: true,
        },
        Soak {
            name: "uncontrolled",
            control: false,
            degrade: true,
        },
        Soak {
            name: "idle_on",
            control: true,
            degrade: false,
        },
        Soak {
            name: "idle_off",
            control: false,
            degrade: false,
        },
    ] {
        eprintln!(
            "xtask: bench thermal: {} ({} s at {} req/s{})",
            s.name,
            t.secs,
            t.rate,
            if s.degrade {
                ", worker 1's cooling degrades"
            } else {
                ""
            }
        );
        runs.insert(s.name.into(), soak(s, &t)?);
    }
    let runs = Value::Object(runs);
    let c = &runs["controlled"];
    let u = &runs["uncontrolled"];
    let ratio =
        |a: &Value, b: &Value| a.as_f64().unwrap_or(0.0) / b.as_f64().unwrap_or(1.0).max(1e-9);
    Ok(json!({
        "workers": WORKERS, "gpus_per_worker": 2, "target_c": TARGET_C, "slowdown_c": SLOWDOWN_C,
        "seconds": t.secs, "degrade_at_s": t.degrade_at, "settle_s": t.settle, "rate_per_s": t.rate,
        "runs": runs,
        "goodput_ratio_controlled_vs_uncontrolled": ratio(&c["goodput_tokens_per_s"], &u["goodput_tokens_per_s"]),
        "ttft_p99_ratio_idle_on_vs_off": ratio(&runs["idle_on"]["ttft_ms_p99"], &runs["idle_off"]["ttft_ms_p99"]),
    }))
}

/// Streaming completions of unique prompts, Poisson arrivals.
fn arrivals(rate: f64, secs: f64, seed: u64) -> Vec<RequestSpec> {
    crate::shedbench::poisson_streams(rate, secs, seed, 3_000_000, MAX_TOKENS)
}

/// One sample of every worker: hottest GPU, running, cap, state.
#[derive(Debug, Clone, Default)]
struct Sample {
    at_s: f64,
    hottest_c: Vec<f64>,
    running: Vec<f64>,
    cap: Vec<f64>,
    throttling: Vec<bool>,
}

fn sample(stack: &Stack, at_s: f64) -> Option<Sample> {
    let mut s = Sample {
        at_s,
        ..Default::default()
    };
    for w in &stack.workers {
        let (status, body) = http::get(&w.endpoint(), "/sim/thermal").ok()?;
        if status != 200 {
            return None;
        }
        let v: Value = serde_json::from_slice(&body).ok()?;
        let hottest = v["gpus"]
            .as_array()?
            .iter()
            .filter_map(|g| g["temp_c"].as_f64())
            .fold(f64::MIN, f64::max);
        s.hottest_c.push(hottest);
        s.running.push(v["running"].as_f64().unwrap_or(0.0));
    }
    let (status, body) = http::get(&stack.control_addr(), "/v1/admin/thermal").ok()?;
    if status != 200 {
        return None;
    }
    let v: Value = serde_json::from_slice(&body).ok()?;
    for w in &stack.workers {
        let t = v["workers"]
            .as_array()?
            .iter()
            .find(|x| x["worker_id"] == w.id)?;
        s.cap.push(t["cap"].as_f64().unwrap_or(0.0));
        s.throttling.push(t["state"] == "throttling");
    }
    Some(s)
}

fn soak(s: Soak, t: &Timing) -> Result<Value> {
    let mut worker_args = vec![Vec::new(); WORKERS];
    if s.degrade {
        // At 75 % load its GPUs would settle near 93 °C: past the slowdown.
        worker_args[0] = [
            "--degrade-at-s".to_string(),
            format!("{}", t.degrade_at),
            "--degrade-ambient-c".to_string(),
            "55".to_string(),
        ]
        .to_vec();
    }
    let stack = Stack::start_with(
        build::release_paths()?,
        StackConfig {
            workers: WORKERS,
            sim_args: [
                "--decode-ms-per-token",
                "10",
                "--max-running",
                "32",
                "--num-gpu-blocks",
                "16384",
                "--thermal-tau-s",
                "8",
            ]
            .map(String::from)
            .to_vec(),
            worker_sim_args: worker_args,
            thermal: Some(ThermalStack {
                gpus: 2,
                batch_control: true,
                toml: format!(
                    "interval_ms = 500\nstale_after_ms = 3000\ntarget_c = {TARGET_C}\nenabled = {}\n",
                    s.control
                ),
            }),
            ..StackConfig::default()
        },
    )?;
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let rt = tokio::runtime::Runtime::new()?;
    let target = Target::new(stack.envoy_url());
    let specs = arrivals(t.rate, t.secs, 21);
    let (outcomes, samples) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut out = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Some(x) = sample(&stack, started.elapsed().as_secs_f64()) {
                    out.push(x);
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            out
        });
        let outcomes = rt.block_on(run_open_loop(&target, &specs, 1.0));
        stop.store(true, Ordering::Relaxed);
        (outcomes, sampler.join().unwrap_or_default())
    });
    let entries: Vec<f64> = stack
        .workers
        .iter()
        .map(|w| {
            stack
                .sidecar_metric(&format!(
                    "kvgate_sidecar_thermal_throttle_entries_total{{model=\"demo-model\",worker_id=\"{}\"}}",
                    w.id
                ))
                .unwrap_or(0.0)
        })
        .collect();
    let batch_calls = stack
        .sidecar_metric("kvgate_sidecar_thermal_batch_calls_total{result=\"ok\"}")
        .unwrap_or(0.0);
    summarize(s, t, &outcomes, &samples, &entries, batch_calls).context("summarising")
}

fn summarize(
    s: Soak,
    t: &Timing,
    outcomes: &[Outcome],
    samples: &[Sample],
    entries: &[f64],
    batch_calls: f64,
) -> Result<Value> {
    let ttft = admitted_ttft_us(outcomes);
    let ms = |p: f64| stats::ms(&ttft, p);
    let total = admitted_latency_us(outcomes);
    let total_ms = |p: f64| stats::ms(&total, p);
    let ok = outcomes.iter().filter(|o| o.status == 200).count();
    let settled_from = t.degrade_at + t.settle;
    let settled: Vec<&Sample> = samples.iter().filter(|x| x.at_s >= settled_from).collect();
    let max_settled = settled
        .iter()
        .flat_map(|x| x.hottest_c.iter().copied())
        .fold(f64::MIN, f64::max);
    let max_any = samples
        .iter()
        .flat_map(|x| x.hottest_c.iter().copied())
        .fold(f64::MIN, f64::max);
    let minutes = t.secs / 60.0;
    let per_minute = entries.iter().copied().fold(0.0, f64::max) / minutes;
    // Completions per second over time, from the outcomes' end times.
    let bins = t.secs.ceil() as usize + 30;
    let mut per_s = vec![0.0; bins];
    for o in outcomes.iter().filter(|o| o.status == 200) {
        let end = (o.start_us + o.latency_us) as f64 / 1e6;
        if let Some(b) = per_s.get_mut(end as usize) {
            *b += 1.0;
        }
    }
    let series = |f: &dyn Fn(&Sample) -> &Vec<f64>| -> Vec<Vec<(f64, f64)>> {
        (0..WORKERS)
            .map(|w| {
                samples
                    .iter()
                    .filter_map(|x| f(x).get(w).map(|v| (x.at_s, *v)))
                    .collect()
            })
            .collect()
    };
    Ok(json!({
        "control": s.control, "degrade": s.degrade,
        "sent": outcomes.len(), "ok": ok,
        "shed": outcomes.iter().filter(|o| o.status == 503).count(),
        "goodput_tokens_per_s": ok as f64 * f64::from(MAX_TOKENS) / t.secs,
        "ttft_ms_p50": ms(50.0), "ttft_ms_p99": ms(99.0),
        "request_ms_p50": total_ms(50.0), "request_ms_p99": total_ms(99.0),
        "hottest_gpu_c_after_settling": max_settled,
        "hottest_gpu_c": max_any,
        "crossed_slowdown": max_any >= SLOWDOWN_C,
        "throttle_entries": entries,
        "throttle_entries_per_worker_per_minute_max": per_minute,
        "batch_calls_ok": batch_calls,
        "series": {
            "hottest_c": series(&|x| &x.hottest_c),
            "cap": series(&|x| &x.cap),
            "running": series(&|x| &x.running),
            "completions_per_s": per_s.iter().enumerate().map(|(i, v)| (i as f64, *v)).collect::<Vec<_>>(),
        },
    }))
}

/// The report section, and its plots written under `plots`.
pub fn report(v: &Value, plots: &std::path::Path) -> Result<String> {
    std::fs::create_dir_all(plots)?;
    let runs = &v["runs"];
    let names = ["controlled", "uncontrolled"];
    let temp: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .map(|n| {
            (
                format!("worker 1, {n}"),
                points(&runs[*n]["series"]["hottest_c"][0]),
            )
        })
        .chain(std::iter::once((
            "worker 2, controlled".to_string(),
            points(&runs["controlled"]["series"]["hottest_c"][1]),
        )))
        .collect();
    fn refs(s: &[(String, Vec<(f64, f64)>)]) -> Vec<(&str, Vec<(f64, f64)>)> {
        s.iter().map(|(n, p)| (n.as_str(), p.clone())).collect()
    }
    std::fs::write(
        plots.join("thermal_temperature.svg"),
        plot::lines(
            "Hottest GPU, worker 1's cooling degraded",
            "s",
            "°C",
            &refs(&temp),
            &[("target", TARGET_C), ("slowdown", SLOWDOWN_C)],
        ),
    )?;
    let caps: Vec<(String, Vec<(f64, f64)>)> = vec![
        (
            "cap, worker 1".into(),
            points(&runs["controlled"]["series"]["cap"][0]),
        ),
        (
            "running, worker 1".into(),
            points(&runs["controlled"]["series"]["running"][0]),
        ),
        (
            "running, worker 1, uncontrolled".into(),
            points(&runs["uncontrolled"]["series"]["running"][0]),
        ),
    ];
    std::fs::write(
        plots.join("thermal_cap.svg"),
        plot::lines("Cap and running batch", "s", "requests", &refs(&caps), &[]),
    )?;
    let tput: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .map(|n| {
            (
                (*n).to_string(),
                points(&runs[*n]["series"]["completions_per_s"]),
            )
        })
        .collect();
    std::fs::write(
        plots.join("thermal_throughput.svg"),
        plot::lines("Completions per second", "s", "req/s", &refs(&tput), &[]),
    )?;
    // Results from before the whole request was timed have no figure for
    // it: a dash, not a zero.
    let ms = |x: &Value| x.as_f64().map_or("—".to_string(), |x| format!("{x:.0}"));
    let row = |n: &str| {
        let r = &runs[n];
        format!(
            "| {n} | {:.1} | {:.1} | {} | {:.2} | {:.0} | {:.0} / {:.0} | {} / {} |",
            r["hottest_gpu_c"].as_f64().unwrap_or(0.0),
            r["hottest_gpu_c_after_settling"].as_f64().unwrap_or(0.0),
            r["crossed_slowdown"],
            r["throttle_entries_per_worker_per_minute_max"]
                .as_f64()
                .unwrap_or(0.0),
            r["goodput_tokens_per_s"].as_f64().unwrap_or(0.0),
            r["ttft_ms_p50"].as_f64().unwrap_or(0.0),
            r["ttft_ms_p99"].as_f64().unwrap_or(0.0),
            ms(&r["request_ms_p50"]),
            ms(&r["request_ms_p99"]),
        )
    };
    Ok(format!(
        "\n## Thermal soak\n\n\
`cargo xtask bench --only thermal`: {w} simulated workers of 2 GPUs \
(first-order thermal plant, τ 8 s; decode slows to half at the {sd} °C \
slowdown), streaming completions at {rate} req/s (about 75 % of capacity) \
for {secs} s; at {at} s worker 1's ambient goes from 25 to 55 °C, enough to settle \
past the slowdown at its load. Target {target} °C, hysteresis 3 °C. \
\"After settling\" is from {settle} s after the degradation.\n\n\
| run | hottest GPU °C | after settling | crossed slowdown | throttle entries / worker / min (max) | goodput tok/s | TTFT p50 / p99 ms | request p50 / p99 ms |\n\
| --- | --- | --- | --- | --- | --- | --- | --- |\n{}\n{}\n{}\n{}\n\n\
Goodput with control / without: {:.3}. TTFT p99 with the policy on but idle / off: {:.3}.\n\n\
![temperature](plots/thermal_temperature.svg) ![cap](plots/thermal_cap.svg) \
![throughput](plots/thermal_throughput.svg)\n",
        row("controlled"),
        row("uncontrolled"),
        row("idle_on"),
        row("idle_off"),
        v["goodput_ratio_controlled_vs_uncontrolled"]
            .as_f64()
            .unwrap_or(0.0),
        v["ttft_p99_ratio_idle_on_vs_off"].as_f64().unwrap_or(0.0),
        w = WORKERS,
        sd = SLOWDOWN_C,
        rate = v["rate_per_s"],
        secs = v["seconds"],
        at = v["degrade_at_s"],
        target = TARGET_C,
        settle = v["settle_s"],
    ))
}
