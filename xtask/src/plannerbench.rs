//! `planner`: the planner in a closed loop, and its predictors on a trace.
//!
//! * Closed loop: streaming traffic on `kvgate-sim` ramps from a base rate
//!   up to four times it and back down. This harness is the orchestrator:
//!   it long-polls the planner's decisions, starts a simulated worker
//!   (after a start-up delay, as a model load takes) and registers it, or
//!   waits for a drained worker to go idle, removes and stops it, and
//!   reports each decision done. The same traffic against static fleets
//!   sized for the peak and for the mean. Reported: SLA attainment (share
//!   of requests with TTFT and ITL under the SLA), replica-seconds,
//!   scaling actions; load, replicas and estimated latency over time.
//! * Predictors: one-step MAPE of each predictor on the Mooncake trace's
//!   per-minute request count, ISL and OSL.

use crate::build;
use crate::plot;
use crate::stats::points;
use anyhow::{Context, Result};
use kvgate_load::{Outcome, RequestSpec, Target, run_open_loop};
use kvgate_sidecar::config::PredictorKind;
use kvgate_sidecar::planner::predict::mape;
use kvgate_stack::{Stack, StackConfig, http};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

const MAX_WORKERS: usize = 6;
const TTFT_SLA_MS: f64 = 500.0;
const ITL_SLA_MS: f64 = 22.0;
const MAX_TOKENS: u32 = 48;
/// A model load: from a scale-up decision to the worker serving.
const STARTUP: Duration = Duration::from_secs(6);
const BASE_RATE: f64 = 8.0;
/// The ramp planner's sensitivity: the simulated GPU's unloaded ITL (10 ms
/// a step, 1 ms a sequence) is half the SLA, so SLA × sensitivity must
/// sit well above it for a scale-down to be reachable (`docs/planner.md`).
const AGG_SENSITIVITY: f64 = 0.8;
/// The split fleet's decode pool and the aggregated planner on the same
/// GPUs: a decode step alone takes 15 ms of the 20 ms SLA.
const SPLIT_DECODE_SENSITIVITY: f64 = 0.85;
/// The aggregated ramp's simulated GPU: ITL grows with the batch.
const AGG_SIM: [&str; 8] = [
    "--decode-ms-per-token",
    "10",
    "--decode-ms-per-running",
    "1.0",
    "--max-running",
    "16",
    "--num-gpu-blocks",
    "8192",
];

/// The disaggregated bench: four GPUs at most, the disaggregated bench's
/// simulated GPU (prefill 100 µs a token, one prompt at a time; decode
/// 15 ms a step), long prompts whose length rises and falls while the
/// request rate stays.
const SPLIT_GPUS: usize = 4;
const SPLIT_RATE: f64 = 2.0;
const SPLIT_OSL: u32 = 120;
const SPLIT_TTFT_SLA_MS: f64 = 2000.0;
const SPLIT_ITL_SLA_MS: f64 = 20.0;
const SPLIT_SIM: [&str; 22] = [
    "--prefill-us-per-token",
    "100",
    "--decode-ms-per-token",
    "15",
    "--decode-ms-per-running",
    "0.2",
    "--prefill-interference",
    "0.1",
    "--max-num-batched-tokens",
    "2048",
    "--prefill-lanes",
    "1",
    "--max-running",
    "32",
    "--num-gpu-blocks",
    "32768",
    "--kv-transfer-gbps",
    "100",
    "--kv-bytes-per-block",
    "2097152",
    "--kv-role",
    "kv_both",
];

/// Piecewise-linear over time: (seconds, value) corners.
#[derive(Debug, Clone)]
struct Curve(Vec<(f64, f64)>);

impl Curve {
    fn at(&self, t: f64) -> f64 {
        for w in self.0.windows(2) {
            let ((t0, r0), (t1, r1)) = (w[0], w[1]);
            if t <= t1 {
                let f = if t1 > t0 { (t - t0) / (t1 - t0) } else { 1.0 };
                return r0 + (r1 - r0) * f.clamp(0.0, 1.0);
            }
        }
        self.0.last().map_or(0.0, |c| c.1)
    }

    fn end(&self) -> f64 {
        self.0.last().map_or(0.0, |c| c.0)
    }

    fn max(&self) -> f64 {
        self.0.iter().map(|c| c.1).fold(0.0, f64::max)
    }
}

/// A workload: its request rate and prompt length over time.
struct Shape {
    rate: Curve,
    /// Prompt tokens; `None`: the aggregated ramp's 256-token prompts.
    isl: Option<Curve>,
}

impl Shape {
    /// The aggregated bench: 8 req/s rising to 32 and back.
    fn ramp(quick: bool) -> Shape {
        let k = if quick { 1.0 } else { 2.0 };
        let b = BASE_RATE;
        Shape {
            rate: Curve(vec![
                (0.0, b),
                (25.0 * k, b),
                (65.0 * k, 4.0 * b),
                (95.0 * k, 4.0 * b),
                (135.0 * k, b),
                (160.0 * k, b),
            ]),
            isl: None,
        }
    }

    /// The disaggregated bench: a steady rate, prompts rising from 1k to
    /// 8k tokens and back: prefill's need moves eightfold, decode's not.
    fn long_prompts(quick: bool) -> Shape {
        let k = if quick { 0.5 } else { 1.0 };
        let t = |s: f64| s * k;
        Shape {
            rate: Curve(vec![(0.0, SPLIT_RATE), (t(170.0), SPLIT_RATE)]),
            isl: Some(Curve(vec![
                (0.0, 1000.0),
                (t(30.0), 1000.0),
                (t(60.0), 8000.0),
                (t(110.0), 8000.0),
                (t(140.0), 1000.0),
                (t(170.0), 1000.0),
            ])),
        }
    }

    fn secs(&self) -> f64 {
        self.rate.end()
    }

    /// Poisson arrivals at the shape's rate (thinning), each prompt its
    /// own tokens.
    fn arrivals(&self, seed: u64) -> Vec<RequestSpec> {
        let mut rng = StdRng::seed_from_u64(seed);
        let peak = self.rate.max();
        let (mut t, mut i) = (0.0f64, 0u32);
        let mut out = Vec::new();
        loop {
            let u: f64 = rng.random_range(1e-9..1.0);
            t += -u.ln() / peak;
            if t >= self.secs() {
                return out;
            }
            if rng.random_range(0.0..1.0) > self.rate.at(t) / peak {
                continue;
            }
            out.push(match &self.isl {
                None => crate::shedbench::unique_stream(5_000_000, i, MAX_TOKENS, t),
                Some(isl) => {
                    let base = 7_000_000 + i * 10_000;
                    let prompt = (0..isl.at(t) as u32).map(|k| base + k).collect();
                    crate::shedbench::token_stream(prompt, SPLIT_OSL, t, "")
                }
            });
            i += 1;
        }
    }
}

/// One fleet of a closed-loop comparison.
struct Fleet {
    name: &'static str,
    /// Workers running at the start, by catalog role; the stack holds
    /// `gpus` in all, the rest stopped until the planner asks for them.
    start: Vec<&'static str>,
    gpus: usize,
    /// The `[models.planner]` table (with its profile), or none: static.
    planner: Option<String>,
    /// The model's other tables (its disaggregation).
    model_toml: &'static str,
    sim: &'static [&'static str],
    sla: (f64, f64),
    tokens: u32,
}

pub fn run(quick: bool) -> Result<Value> {
    let predictors = trace_mape()?;
    let paths = build::release_paths()?;
    let ramp = Shape::ramp(quick);
    let profile = sweep(
        &paths,
        "both",
        &AGG_SIM,
        &["--isl", "256", "--osl", "48"],
        (TTFT_SLA_MS, ITL_SLA_MS),
    )?;
    let agg_planner = |sensitivity: f64| {
        format!(
            "[models.planner]\nttft_ms = {TTFT_SLA_MS}\nitl_ms = {ITL_SLA_MS}\nsensitivity = {sensitivity}\nload_interval_ms = 2000\nthroughput_interval_ms = 10000\npredictor = \"kalman\"\nmin_replicas = 1\nmax_replicas = {MAX_WORKERS}\nstartup_ms = {}\npending_timeout_ms = 60000\n{profile}\n",
            STARTUP.as_millis()
        )
    };
    let mut runs = serde_json::Map::new();
    for f in [
        Fleet {
            name: "planner",
            start: vec!["both"],
            gpus: MAX_WORKERS,
            planner: Some(agg_planner(AGG_SENSITIVITY)),
            model_toml: "",
            sim: &AGG_SIM,
            sla: (TTFT_SLA_MS, ITL_SLA_MS),
            tokens: MAX_TOKENS,
        },
        // The setting of the runs before: its scale-down line (13.2 ms)
        // under what a replica at the base rate shows.
        Fleet {
            name: "planner_sensitivity_0.6",
            start: vec!["both"],
            gpus: MAX_WORKERS,
            planner: Some(agg_planner(0.6)),
            model_toml: "",
            sim: &AGG_SIM,
            sla: (TTFT_SLA_MS, ITL_SLA_MS),
            tokens: MAX_TOKENS,
        },
        Fleet {
            name: "static_peak",
            start: vec!["both"; 4],
            gpus: 4,
            planner: None,
            model_toml: "",
            sim: &AGG_SIM,
            sla: (TTFT_SLA_MS, ITL_SLA_MS),
            tokens: MAX_TOKENS,
        },
        Fleet {
            name: "static_mean",
            start: vec!["both"; 2],
            gpus: 2,
            planner: None,
            model_toml: "",
            sim: &AGG_SIM,
            sla: (TTFT_SLA_MS, ITL_SLA_MS),
            tokens: MAX_TOKENS,
        },
    ] {
        eprintln!(
            "xtask: bench planner: {} ({:.0} s, {BASE_RATE}→{} req/s)",
            f.name,
            ramp.secs(),
            4.0 * BASE_RATE
        );
        runs.insert(f.name.into(), closed_loop(&paths, &ramp, &f)?);
    }
    let split = split_runs(&paths, quick)?;
    Ok(json!({
        "ttft_sla_ms": TTFT_SLA_MS, "itl_sla_ms": ITL_SLA_MS, "startup_s": STARTUP.as_secs(),
        "seconds": ramp.secs(), "base_rate": BASE_RATE, "peak_rate": 4.0 * BASE_RATE,
        "sensitivity": AGG_SENSITIVITY,
        "profile": profile,
        "runs": runs,
        "split": split,
        "predictors": predictors,
    }))
}

/// The disaggregated comparison on the same four simulated GPUs.
fn split_runs(paths: &kvgate_stack::Paths, quick: bool) -> Result<Value> {
    let shape = Shape::long_prompts(quick);
    let sla = (SPLIT_TTFT_SLA_MS, SPLIT_ITL_SLA_MS);
    let osl = SPLIT_OSL.to_string();
    let prefill = sweep(paths, "prefill", &SPLIT_SIM, &["--isl", "1000,8000"], sla)?;
    // A decode worker of the split fleet computes no prompt, and the
    // simulated ITL does not grow with context: short prompts measure its
    // decode without its own prefills in the way (a real engine's ITL
    // grows with context: profile it at the context it will hold).
    let decode = sweep(
        paths,
        "decode",
        &SPLIT_SIM,
        &["--isl", "64", "--osl", &osl],
        sla,
    )?;
    let both = sweep(
        paths,
        "both",
        &SPLIT_SIM,
        &["--isl", "1000,8000", "--osl", &osl],
        sla,
    )?;
    let table = |rows: &[&str], max: usize, sensitivity: f64| {
        format!(
            "[models.planner]\nttft_ms = {SPLIT_TTFT_SLA_MS}\nitl_ms = {SPLIT_ITL_SLA_MS}\nsensitivity = {sensitivity}\nload_interval_ms = 2000\nthroughput_interval_ms = 10000\nmin_replicas = 1\nmax_replicas = {max}\nstartup_ms = {}\npending_timeout_ms = 60000\nprofile = [{}]\n",
            STARTUP.as_millis(),
            rows.join(", ")
        )
    };
    let disagg = "[models.disaggregation]\nprotocol = \"vllm-nixl\"\n";
    let mut runs = serde_json::Map::new();
    for f in [
        Fleet {
            name: "planner_split",
            start: vec!["prefill", "decode"],
            gpus: SPLIT_GPUS,
            planner: Some(format!(
                "{}[models.planner.prefill]\nmax_replicas = {}\n[models.planner.decode]\nmax_replicas = {}\nsensitivity = {SPLIT_DECODE_SENSITIVITY}\n",
                table(&[&rows_of(&prefill), &rows_of(&decode)], SPLIT_GPUS, 0.6),
                SPLIT_GPUS - 1,
                SPLIT_GPUS - 1
            )),
            model_toml: disagg,
            sim: &SPLIT_SIM,
            sla,
            tokens: SPLIT_OSL,
        },
        Fleet {
            name: "static_split",
            start: vec!["prefill", "prefill", "prefill", "decode"],
            gpus: SPLIT_GPUS,
            planner: None,
            model_toml: disagg,
            sim: &SPLIT_SIM,
            sla,
            tokens: SPLIT_OSL,
        },
        Fleet {
            name: "planner_aggregated",
            start: vec!["both"],
            gpus: SPLIT_GPUS,
            planner: Some(table(
                &[&rows_of(&both)],
                SPLIT_GPUS,
                SPLIT_DECODE_SENSITIVITY,
            )),
            model_toml: "",
            sim: &SPLIT_SIM,
            sla,
            tokens: SPLIT_OSL,
        },
    ] {
        eprintln!("xtask: bench planner: {} ({:.0} s)", f.name, shape.secs());
        runs.insert(f.name.into(), closed_loop(paths, &shape, &f)?);
    }
    Ok(json!({
        "ttft_sla_ms": SPLIT_TTFT_SLA_MS, "itl_sla_ms": SPLIT_ITL_SLA_MS, "rate": SPLIT_RATE,
        "decode_sensitivity": SPLIT_DECODE_SENSITIVITY,
        "osl": SPLIT_OSL, "seconds": shape.secs(), "gpus": SPLIT_GPUS,
        "profiles": {"prefill": prefill, "decode": decode, "both": both},
        "runs": runs,
    }))
}

/// The rows inside a `profile = [...]` line.
fn rows_of(profile: &str) -> String {
    profile
        .lines()
        .find_map(|l| l.trim().strip_prefix("profile = ["))
        .and_then(|l| l.strip_suffix(']'))
        .unwrap_or_default()
        .trim()
        .trim_end_matches(',')
        .to_string()
}

/// The planner's profile step: `kvgate-sidecar profile` against one
/// simulated worker of `sim`, as an operator runs it against one engine
/// before deploying. Returns the `profile = [...]` line.
fn sweep(
    paths: &kvgate_stack::Paths,
    role: &str,
    sim: &[&str],
    points: &[&str],
    sla: (f64, f64),
) -> Result<String> {
    let mut stack = Stack::start_with(
        paths.clone(),
        StackConfig {
            workers: 1,
            sim_args: sim.iter().map(|s| s.to_string()).collect(),
            ..StackConfig::default()
        },
    )?;
    let endpoint = format!("http://{}", stack.workers[0].endpoint());
    let out = std::process::Command::new(paths.bin("kvgate-sidecar"))
        .args([
            "profile",
            "--endpoint",
            &endpoint,
            "--model",
            "demo-model",
            "--role",
            role,
        ])
        .args(points)
        .args([
            "--ttft-ms",
            &sla.0.to_string(),
            "--itl-ms",
            &sla.1.to_string(),
        ])
        .args([
            "--duration-s",
            "6",
            "--bisect-steps",
            "2",
            "--max-rps",
            "48",
        ])
        .output()
        .context("kvgate-sidecar profile")?;
    stack.kill_worker(0);
    anyhow::ensure!(
        out.status.success(),
        "kvgate-sidecar profile: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let line = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join(" ");
    let line = line.split_whitespace().collect::<Vec<_>>().join(" ");
    anyhow::ensure!(
        line.starts_with("profile = ["),
        "unexpected profile output: {text}"
    );
    eprintln!("xtask: bench planner: {role} profile: {line}");
    Ok(line)
}

/// One-step MAPE per predictor on the Mooncake trace, per minute.
fn trace_mape() -> Result<Value> {
    let path = std::env::var_os("KVGATE_MOONCAKE_TRACE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| crate::repo().join("../shared/data/mooncake/conversation_trace.jsonl"));
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!(
            "xtask: bench planner: no Mooncake trace at {}",
            path.display()
        );
        return Ok(Value::Null);
    };
    // (requests, ISL sum, OSL sum) per minute.
    let mut minutes: Vec<(f64, f64, f64)> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).context("a trace line")?;
        let minute = (v["timestamp"].as_u64().unwrap_or(0) / 60_000) as usize;
        if minutes.len() <= minute {
            minutes.resize(minute + 1, (0.0, 0.0, 0.0));
        }
        let m = &mut minutes[minute];
        m.0 += 1.0;
        m.1 += v["input_length"].as_f64().unwrap_or(0.0);
        m.2 += v["output_length"].as_f64().unwrap_or(0.0);
    }
    let counts: Vec<f64> = minutes.iter().map(|m| m.0).collect();
    let isl: Vec<f64> = minutes.iter().map(|m| m.1 / m.0.max(1.0)).collect();
    let osl: Vec<f64> = minutes.iter().map(|m| m.2 / m.0.max(1.0)).collect();
    let season = 10;
    let mut out = serde_json::Map::new();
    for kind in PredictorKind::ALL {
        out.insert(
            kind.as_str().into(),
            json!({
                "requests": mape(kind, season, &counts),
                "isl": mape(kind, season, &isl),
                "osl": mape(kind, season, &osl),
            }),
        );
    }
    Ok(
        json!({"intervals": minutes.len(), "interval_s": 60, "season_intervals": season, "mape_pct": out}),
    )
}

#[derive(Debug, Clone, Default)]
struct Sample {
    at_s: f64,
    rate: f64,
    isl: f64,
    desired: f64,
    ready: f64,
    provisioned: f64,
    /// Per pool (prefill, decode) for a split model.
    desired_prefill: f64,
    desired_decode: f64,
    running_prefill: f64,
    running_decode: f64,
    ttft_est: f64,
    itl_est: f64,
}

fn planner_view(addr: &str) -> Option<Value> {
    let (status, body) = http::get(addr, "/v1/planner").ok()?;
    (status == 200).then(|| serde_json::from_slice(&body).ok())?
}

fn worker_body(stack: &Stack, i: usize, role: &str) -> String {
    let w = &stack.workers[i];
    json!({"worker_id": w.id, "model_name": "demo-model", "endpoint": w.endpoint(), "block_size": 16, "role": role})
        .to_string()
}

/// What runs where: each stack worker's catalog role while it runs.
type Running = Mutex<Vec<Option<&'static str>>>;

fn role_name(r: &str) -> &'static str {
    match r {
        "prefill" => "prefill",
        "decode" => "decode",
        _ => "both",
    }
}

fn count(running: &Running, role: &str) -> usize {
    running
        .lock()
        .map(|s| s.iter().filter(|x| **x == Some(role_name(role))).count())
        .unwrap_or(0)
}

/// One closed-loop run of `fleet` under `shape`: with the planner the
/// harness is the orchestrator, from the fleet's starting workers.
fn closed_loop(paths: &kvgate_stack::Paths, shape: &Shape, fleet: &Fleet) -> Result<Value> {
    let planned = fleet.planner.is_some();
    let mut stack = Stack::start_with(
        paths.clone(),
        StackConfig {
            workers: fleet.gpus,
            sim_args: fleet.sim.iter().map(|s| s.to_string()).collect(),
            roles: (0..fleet.gpus)
                .map(|i| fleet.start.get(i).copied().unwrap_or("both").to_string())
                .collect(),
            worker_sim_args: if fleet.sim == SPLIT_SIM.as_slice() {
                vec![vec!["--kv-side-channel-port".into(), "0".into()]; fleet.gpus]
            } else {
                Vec::new()
            },
            model_toml: format!(
                "{}{}",
                fleet.model_toml,
                fleet.planner.clone().unwrap_or_default()
            ),
            plugin: json!({"max_body_bytes": 4 << 20}),
            ..StackConfig::default()
        },
    )?;
    let control = stack.control_addr();
    let running: Running = Mutex::new(
        (0..fleet.gpus)
            .map(|i| fleet.start.get(i).map(|r| role_name(r)))
            .collect(),
    );
    // The workers beyond the starting ones are not running.
    for i in fleet.start.len()..fleet.gpus {
        let id = stack.workers[i].id;
        http::request(&control, "DELETE", &format!("/workers/{id}"), &[], None)?;
        stack.kill_worker(i);
    }
    let provisioned = AtomicU32::new(fleet.start.len() as u32);
    let actions = Mutex::new(Vec::<Value>::new());
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let rt = tokio::runtime::Runtime::new()?;
    let target = Target::new(stack.envoy_url());
    let specs = shape.arrivals(31);
    let (outcomes, samples) = std::thread::scope(|scope| -> Result<_> {
        let sampler = scope.spawn(|| {
            let mut out = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let at = t0.elapsed().as_secs_f64();
                let n = f64::from(provisioned.load(Ordering::Relaxed));
                let mut s = Sample {
                    at_s: at,
                    rate: shape.rate.at(at),
                    isl: shape.isl.as_ref().map_or(256.0, |c| c.at(at)),
                    provisioned: n,
                    ready: n,
                    desired: n,
                    running_prefill: count(&running, "prefill") as f64,
                    running_decode: (count(&running, "decode")) as f64,
                    ..Default::default()
                };
                if planned && let Some(v) = planner_view(&control) {
                    let m = &v["models"][0];
                    s.desired = m["desired"].as_f64().unwrap_or(0.0);
                    s.ready = m["ready"].as_f64().unwrap_or(0.0);
                    for p in m["pools"].as_array().into_iter().flatten() {
                        let d = p["desired"].as_f64().unwrap_or(0.0);
                        match p["role"].as_str() {
                            Some("prefill") => s.desired_prefill = d,
                            Some("decode") => s.desired_decode = d,
                            _ => {}
                        }
                    }
                    let worst = |k: &str| {
                        m["estimates"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(|e| e[k].as_f64())
                            .fold(0.0, f64::max)
                    };
                    s.ttft_est = worst("ttft_ms");
                    s.itl_est = worst("itl_ms");
                }
                out.push(s);
                std::thread::sleep(Duration::from_millis(1000));
            }
            out
        });
        if planned {
            let stack = &mut stack;
            let (running, provisioned, actions, stop) = (&running, &provisioned, &actions, &stop);
            let control = control.clone();
            scope.spawn(move || {
                orchestrate(stack, &control, running, provisioned, actions, stop, t0)
            });
        }
        let outcomes = rt.block_on(run_open_loop(&target, &specs, 1.0));
        stop.store(true, Ordering::Relaxed);
        let samples = sampler.join().unwrap_or_default();
        Ok((outcomes, samples))
    })?;
    summarize(
        shape,
        fleet,
        &outcomes,
        &samples,
        actions.lock().map(|a| a.clone()).unwrap_or_default(),
    )
}

/// The orchestrator: carries out the planner's decisions until `stop`.
/// A decision's counts are targets: per pool (`num_prefill`,
/// `num_decode`), else the model's `desired` of `both` workers.
fn orchestrate(
    stack: &mut Stack,
    control: &str,
    running: &Running,
    provisioned: &AtomicU32,
    actions: &Mutex<Vec<Value>>,
    stop: &AtomicBool,
    t0: Instant,
) {
    let mut after = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Ok((200, body)) = http::get(
            control,
            &format!("/v1/planner/decisions?after={after}&wait_ms=1000"),
        ) else {
            continue;
        };
        let Ok(d) = serde_json::from_slice::<Value>(&body) else {
            continue;
        };
        after = d["id"].as_u64().unwrap_or(after);
        let at = t0.elapsed().as_secs_f64();
        let before: usize = running
            .lock()
            .map(|s| s.iter().flatten().count())
            .unwrap_or(0);
        // A switch: the worker changes role, nothing starts or stops.
        for sw in d["switch"].as_array().into_iter().flatten() {
            let (Some(id), Some(to)) = (sw["worker_id"].as_u64(), sw["to"].as_str()) else {
                continue;
            };
            let body = json!({"role": to}).to_string();
            let _ = http::request(
                control,
                "PATCH",
                &format!("/workers/{id}"),
                &[],
                Some(body.as_bytes()),
            );
            if let Some(i) = stack.workers.iter().position(|w| w.id == id)
                && let Ok(mut s) = running.lock()
            {
                s[i] = Some(role_name(to));
            }
        }
        // Drains first: what they run finishes, then they go.
        for id in d["drain"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
        {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline && in_flight(stack, id) > 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = http::request(control, "DELETE", &format!("/workers/{id}"), &[], None);
            if let Some(i) = stack.workers.iter().position(|w| w.id == id) {
                stack.kill_worker(i);
                if let Ok(mut s) = running.lock() {
                    s[i] = None;
                }
            }
        }
        let targets: Vec<(&str, usize)> =
            match (d["num_prefill"].as_u64(), d["num_decode"].as_u64()) {
                (Some(p), Some(n)) => vec![("prefill", p as usize), ("decode", n as usize)],
                _ => vec![("both", d["desired"].as_u64().unwrap_or(0) as usize)],
            };
        let starts: Vec<(&str, usize)> = targets
            .iter()
            .map(|(role, want)| (*role, want.saturating_sub(count(running, role))))
            .filter(|(_, n)| *n > 0)
            .collect();
        if !starts.is_empty() {
            // Allocated now, serving after the model loads.
            let now_running = running
                .lock()
                .map(|s| s.iter().flatten().count())
                .unwrap_or(0);
            let adding: usize = starts.iter().map(|s| s.1).sum();
            provisioned.store((now_running + adding) as u32, Ordering::Relaxed);
            std::thread::sleep(STARTUP);
            for (role, n) in starts {
                for _ in 0..n {
                    let Some(i) = running
                        .lock()
                        .ok()
                        .and_then(|s| s.iter().position(Option::is_none))
                    else {
                        break;
                    };
                    if stack.start_worker(i).is_err() {
                        continue;
                    }
                    let body = worker_body(stack, i, role);
                    let _ = http::post_json(control, "/workers", body.as_bytes());
                    if let Ok(mut s) = running.lock() {
                        s[i] = Some(role_name(role));
                    }
                }
            }
        }
        let now_running = running
            .lock()
            .map(|s| s.iter().flatten().count())
            .unwrap_or(0);
        provisioned.store(now_running as u32, Ordering::Relaxed);
        if let Ok(mut a) = actions.lock() {
            a.push(json!({"at_s": at, "id": after, "desired": d["desired"], "num_prefill": d["num_prefill"], "num_decode": d["num_decode"], "from": before, "switch": d["switch"], "reason": d["reason"]}));
        }
        let _ = http::post_json(
            control,
            &format!("/v1/planner/decisions/{after}/complete"),
            b"",
        );
    }
}

fn in_flight(stack: &Stack, id: u64) -> u64 {
    stack
        .sidecar_state()
        .ok()
        .and_then(|s| {
            s["models"][0]["workers"]
                .as_array()?
                .iter()
                .find(|w| w["worker_id"] == id)
                .and_then(|w| w["thermal"]["in_flight"].as_u64())
        })
        .unwrap_or(0)
}

/// (seconds, value) points.
type Series = Vec<(f64, f64)>;

/// Observed latency per five-second window of sends: p90 TTFT and mean
/// ITL of the requests sent in it.
fn observed(outcomes: &[Outcome], tokens: u32) -> (Series, Series) {
    let mut windows: std::collections::BTreeMap<u64, (Vec<f64>, Vec<f64>)> = Default::default();
    for o in outcomes.iter().filter(|o| o.status == 200) {
        let w = windows.entry(o.start_us / 5_000_000).or_default();
        let ttft = o.ttft_us.unwrap_or(0) as f64 / 1000.0;
        w.0.push(ttft);
        w.1.push((o.latency_us as f64 / 1000.0 - ttft) / f64::from(tokens.max(2) - 1));
    }
    let mut ttft = Vec::new();
    let mut itl = Vec::new();
    for (k, (mut t, i)) in windows {
        let at = k as f64 * 5.0 + 2.5;
        t.sort_by(f64::total_cmp);
        ttft.push((at, t[(t.len() * 9 / 10).min(t.len() - 1)]));
        itl.push((at, i.iter().sum::<f64>() / i.len() as f64));
    }
    (ttft, itl)
}

fn summarize(
    shape: &Shape,
    fleet: &Fleet,
    outcomes: &[Outcome],
    samples: &[Sample],
    actions: Vec<Value>,
) -> Result<Value> {
    let (ttft_sla, itl_sla) = fleet.sla;
    let within = outcomes
        .iter()
        .filter(|o| o.status == 200)
        .filter(|o| {
            let ttft = o.ttft_us.unwrap_or(u64::MAX) as f64 / 1000.0;
            let itl = (o.latency_us as f64 / 1000.0 - ttft) / f64::from(fleet.tokens - 1);
            ttft <= ttft_sla && itl <= itl_sla
        })
        .count();
    let replica_s: f64 = samples
        .windows(2)
        .map(|w| w[0].provisioned * (w[1].at_s - w[0].at_s))
        .sum();
    let series = |f: fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|s| (s.at_s, f(s))).collect()
    };
    let (ttft_obs, itl_obs) = observed(outcomes, fleet.tokens);
    // A scale-down after the load's peak has passed.
    let peak_end = shape
        .rate
        .0
        .iter()
        .chain(shape.isl.iter().flat_map(|c| c.0.iter()))
        .fold(
            (0.0f64, 0.0f64),
            |(t, v), c| if c.1 >= v { (c.0, c.1) } else { (t, v) },
        )
        .0;
    let downs_after_peak = actions
        .iter()
        .filter(|a| a["at_s"].as_f64().unwrap_or(0.0) > peak_end)
        .filter(|a| {
            let target = a["desired"].as_u64().unwrap_or(0);
            target < a["from"].as_u64().unwrap_or(0)
        })
        .count();
    Ok(json!({
        "sent": outcomes.len(),
        "ok": outcomes.iter().filter(|o| o.status == 200).count(),
        "sla_attainment": within as f64 / outcomes.len().max(1) as f64,
        "replica_seconds": replica_s,
        "seconds": shape.secs(),
        "scaling_actions": actions.len(),
        "scale_downs_after_peak": downs_after_peak,
        "actions": actions,
        "series": {
            "rate": series(|s| s.rate),
            "isl": series(|s| s.isl),
            "desired": series(|s| s.desired),
            "ready": series(|s| s.ready),
            "provisioned": series(|s| s.provisioned),
            "desired_prefill": series(|s| s.desired_prefill),
            "desired_decode": series(|s| s.desired_decode),
            "running_prefill": series(|s| s.running_prefill),
            "running_decode": series(|s| s.running_decode),
            "ttft_est_ms": series(|s| s.ttft_est),
            "itl_est_ms": series(|s| s.itl_est),
            "ttft_p90_ms": ttft_obs,
            "itl_mean_ms": itl_obs,
        },
    }))
}

/// A series' values divided by `k`, to share a plot's axis.
fn scaled(s: &Value, k: f64) -> Series {
    points(s).iter().map(|(t, y)| (*t, y / k)).collect()
}

/// The report section; its plots go under `plots`.
pub fn report(v: &Value, plots: &std::path::Path) -> Result<String> {
    std::fs::create_dir_all(plots)?;
    let p = &v["runs"]["planner"]["series"];
    std::fs::write(
        plots.join("planner_replicas.svg"),
        plot::lines(
            "Load and replicas (planner)",
            "s",
            "req/s, replicas",
            &[
                ("offered req/s ÷ 4", scaled(&p["rate"], 4.0)),
                ("desired", points(&p["desired"])),
                ("ready", points(&p["ready"])),
                ("provisioned", points(&p["provisioned"])),
            ],
            &[],
        ),
    )?;
    let sensitivity = v["sensitivity"].as_f64().unwrap_or(AGG_SENSITIVITY);
    let latency = |p: &Value, title: &str, sensitivity: f64| {
        plot::lines(
            title,
            "s",
            "ms",
            &[
                ("estimated TTFT ÷ 10", scaled(&p["ttft_est_ms"], 10.0)),
                ("observed TTFT p90 ÷ 10", scaled(&p["ttft_p90_ms"], 10.0)),
                ("estimated ITL", points(&p["itl_est_ms"])),
                ("observed ITL, mean", points(&p["itl_mean_ms"])),
            ],
            &[
                ("ITL SLA", ITL_SLA_MS),
                ("ITL SLA × sensitivity", ITL_SLA_MS * sensitivity),
                ("TTFT SLA ÷ 10", TTFT_SLA_MS / 10.0),
            ],
        )
    };
    std::fs::write(
        plots.join("planner_latency.svg"),
        latency(
            p,
            "Estimated (worst worker) against observed latency",
            sensitivity,
        ),
    )?;
    let before = &v["runs"]["planner_sensitivity_0.6"]["series"];
    std::fs::write(
        plots.join("planner_latency_sensitivity_06.svg"),
        latency(
            before,
            "The same at sensitivity 0.6: the scale-down line under the unloaded ITL",
            0.6,
        ),
    )?;
    std::fs::write(
        plots.join("planner_replicas_sensitivity_06.svg"),
        plot::lines(
            "Load and replicas (planner, sensitivity 0.6)",
            "s",
            "req/s, replicas",
            &[
                ("offered req/s ÷ 4", scaled(&before["rate"], 4.0)),
                ("desired", points(&before["desired"])),
                ("provisioned", points(&before["provisioned"])),
            ],
            &[],
        ),
    )?;
    let row = |runs: &Value, n: &str| {
        let r = &runs[n];
        format!(
            "| {n} | {:.1} % | {:.0} | {} | {} | {}/{} |",
            100.0 * r["sla_attainment"].as_f64().unwrap_or(0.0),
            r["replica_seconds"].as_f64().unwrap_or(0.0),
            r["scaling_actions"],
            r["scale_downs_after_peak"],
            r["ok"],
            r["sent"],
        )
    };
    let runs = &v["runs"];
    let ratio = |n: &str| {
        let a = runs[n]["replica_seconds"].as_f64().unwrap_or(0.0);
        let b = runs["static_peak"]["replica_seconds"]
            .as_f64()
            .unwrap_or(0.0);
        if b > 0.0 {
            format!("{:.0} %", 100.0 * a / b)
        } else {
            "-".into()
        }
    };
    let mut mape_rows = String::new();
    if let Some(m) = v["predictors"]["mape_pct"].as_object() {
        for (k, x) in m {
            let f = |q: &str| {
                x[q].as_f64()
                    .map_or("-".to_string(), |v| format!("{v:.1} %"))
            };
            let mean = ["requests", "isl", "osl"]
                .iter()
                .map(|q| x[*q].as_f64())
                .sum::<Option<f64>>()
                .map_or("-".to_string(), |s| format!("{:.1} %", s / 3.0));
            mape_rows.push_str(&format!(
                "| {k} | {} | {} | {} | {mean} |\n",
                f("requests"),
                f("isl"),
                f("osl")
            ));
        }
    }
    let split = split_report(&v["split"], plots)?;
    Ok(format!(
        "\n## Planner\n\n\
`cargo xtask bench --only planner`: streaming completions ({MAX_TOKENS} tokens) on simulated workers \
whose ITL grows with their batch, offered {} req/s rising to {} and back over {} s. SLA: TTFT \
{TTFT_SLA_MS} ms, ITL {ITL_SLA_MS} ms. With the planner the harness is the orchestrator: it follows \
the decision API, a new worker serving {} s after the decision (its model load), a drained one \
removed once idle. The planner starts from one worker with the profile `kvgate-sidecar profile` \
measured on one simulated worker in the same run (`{}`), the Kalman predictor (it follows a ramp's \
trend), a 10 s throughput interval and sensitivity {sensitivity}; the same planner at sensitivity 0.6, \
the setting of the runs before, beside it. Against fleets fixed at 4 (the peak's need) and 2 (the mean's).\n\n\
| fleet | SLA attainment | replica-seconds | scaling actions | scale-downs after the peak | ok/sent |\n| --- | --- | --- | --- | --- | --- |\n{}\n{}\n{}\n{}\n\n\
The planner's replica-seconds are {} of the peak fleet's ({} at sensitivity 0.6).\n\n\
![replicas](plots/planner_replicas.svg) ![latency](plots/planner_latency.svg)\n\n\
At sensitivity 0.6 (why the planner of the runs before never scaled down, `docs/planner.md`):\n\n\
![replicas at 0.6](plots/planner_replicas_sensitivity_06.svg) ![latency at 0.6](plots/planner_latency_sensitivity_06.svg)\n\n\
Predictors, one-step error on the Mooncake conversation trace per minute ({} minutes; seasonal period 10):\n\n\
| predictor | requests | ISL | OSL | mean |\n| --- | --- | --- | --- | --- |\n{mape_rows}\n{split}",
        v["base_rate"],
        v["peak_rate"],
        v["seconds"],
        v["startup_s"],
        v["profile"].as_str().unwrap_or("-"),
        row(runs, "planner"),
        row(runs, "planner_sensitivity_0.6"),
        row(runs, "static_peak"),
        row(runs, "static_mean"),
        ratio("planner"),
        ratio("planner_sensitivity_0.6"),
        v["predictors"]["intervals"],
    ))
}

/// The disaggregated section.
fn split_report(v: &Value, plots: &std::path::Path) -> Result<String> {
    if v.is_null() {
        return Ok(String::new());
    }
    let p = &v["runs"]["planner_split"]["series"];
    std::fs::write(
        plots.join("planner_split_replicas.svg"),
        plot::lines(
            "Prompt length and replicas per pool (disaggregated planner)",
            "s",
            "k tokens, replicas",
            &[
                ("ISL ÷ 1000", scaled(&p["isl"], 1000.0)),
                ("prefill desired", points(&p["desired_prefill"])),
                ("prefill running", points(&p["running_prefill"])),
                ("decode desired", points(&p["desired_decode"])),
                ("decode running", points(&p["running_decode"])),
            ],
            &[],
        ),
    )?;
    std::fs::write(
        plots.join("planner_split_latency.svg"),
        plot::lines(
            "Estimated against observed latency (disaggregated planner)",
            "s",
            "ms",
            &[
                (
                    "estimated prefill TTFT ÷ 100",
                    scaled(&p["ttft_est_ms"], 100.0),
                ),
                ("observed TTFT p90 ÷ 100", scaled(&p["ttft_p90_ms"], 100.0)),
                ("estimated ITL", points(&p["itl_est_ms"])),
                ("observed ITL, mean", points(&p["itl_mean_ms"])),
            ],
            &[
                ("ITL SLA", SPLIT_ITL_SLA_MS),
                ("TTFT SLA ÷ 100", SPLIT_TTFT_SLA_MS / 100.0),
            ],
        ),
    )?;
    let runs = &v["runs"];
    let row = |n: &str, what: &str| {
        let r = &runs[n];
        format!(
            "| {what} | {:.1} % | {:.0} | {} | {}/{} |",
            100.0 * r["sla_attainment"].as_f64().unwrap_or(0.0),
            r["replica_seconds"].as_f64().unwrap_or(0.0),
            r["scaling_actions"],
            r["ok"],
            r["sent"],
        )
    };
    Ok(format!(
        "### Disaggregated mode\n\n\
The same orchestrator on at most {} simulated GPUs of the disaggregated bench's kind (`--kv-role kv_both`, \
a NIXL side channel each, so any of them serves either pool): {} req/s throughout, {} output tokens, \
prompts of 1k tokens rising to 8k and back over {} s, so that prefill's need moves eightfold and \
decode's not. SLA: TTFT {} ms, ITL {} ms. The disaggregated planner starts from one prefill and one \
decode worker, with prefill and decode profiles measured in the same run (the decode profile on short \
prompts: the simulated ITL does not grow with context), at most {} workers in all, sensitivity 0.6 and \
{} for the decode pool (a decode step alone takes 15 ms of the 20 ms SLA); the static split is three \
prefill workers and one decode worker (the peak's need) throughout; the aggregated planner plans the \
same GPUs as one pool of `both` workers, with its own profile and sensitivity {}.\n\n\
| fleet | SLA attainment | replica-seconds | scaling actions | ok/sent |\n| --- | --- | --- | --- | --- |\n{}\n{}\n{}\n\n\
![replicas per pool](plots/planner_split_replicas.svg) ![latency](plots/planner_split_latency.svg)\n",
        v["gpus"],
        v["rate"],
        v["osl"],
        v["seconds"],
        v["ttft_sla_ms"],
        v["itl_sla_ms"],
        v["gpus"],
        v["decode_sensitivity"],
        v["decode_sensitivity"],
        row("planner_split", "disaggregated planner"),
        row("static_split", "static 3P+1D"),
        row("planner_aggregated", "aggregated planner"),
    ))
}
