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
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAX_WORKERS: usize = 6;
const TTFT_SLA_MS: f64 = 500.0;
const ITL_SLA_MS: f64 = 22.0;
const MAX_TOKENS: u32 = 48;
/// A model load: from a scale-up decision to the worker serving.
const STARTUP: Duration = Duration::from_secs(6);
const BASE_RATE: f64 = 8.0;

struct Shape {
    /// (seconds, rate) corners of the piecewise-linear rate.
    corners: Vec<(f64, f64)>,
}

impl Shape {
    fn ramp(quick: bool) -> Shape {
        let k = if quick { 1.0 } else { 2.0 };
        let b = BASE_RATE;
        Shape {
            corners: vec![
                (0.0, b),
                (25.0 * k, b),
                (65.0 * k, 4.0 * b),
                (95.0 * k, 4.0 * b),
                (135.0 * k, b),
                (160.0 * k, b),
            ],
        }
    }

    fn secs(&self) -> f64 {
        self.corners.last().map_or(0.0, |c| c.0)
    }

    fn rate(&self, t: f64) -> f64 {
        for w in self.corners.windows(2) {
            let ((t0, r0), (t1, r1)) = (w[0], w[1]);
            if t <= t1 {
                let f = if t1 > t0 { (t - t0) / (t1 - t0) } else { 1.0 };
                return r0 + (r1 - r0) * f.clamp(0.0, 1.0);
            }
        }
        self.corners.last().map_or(0.0, |c| c.1)
    }

    /// Poisson arrivals at the shape's rate (thinning).
    fn arrivals(&self, seed: u64) -> Vec<RequestSpec> {
        let mut rng = StdRng::seed_from_u64(seed);
        let peak = self.corners.iter().map(|c| c.1).fold(0.0, f64::max);
        let (mut t, mut i) = (0.0f64, 0u32);
        let mut out = Vec::new();
        loop {
            let u: f64 = rng.random_range(1e-9..1.0);
            t += -u.ln() / peak;
            if t >= self.secs() {
                return out;
            }
            if rng.random_range(0.0..1.0) > self.rate(t) / peak {
                continue;
            }
            out.push(crate::shedbench::unique_stream(5_000_000, i, MAX_TOKENS, t));
            i += 1;
        }
    }
}

pub fn run(quick: bool) -> Result<Value> {
    let predictors = trace_mape()?;
    let shape = Shape::ramp(quick);
    let mut runs = serde_json::Map::new();
    for (name, fleet) in [
        ("planner", None),
        ("static_peak", Some(4)),
        ("static_mean", Some(2)),
    ] {
        eprintln!(
            "xtask: bench planner: {name} ({:.0} s, {BASE_RATE}→{} req/s)",
            shape.secs(),
            4.0 * BASE_RATE
        );
        runs.insert(name.into(), closed_loop(&shape, fleet)?);
    }
    Ok(json!({
        "ttft_sla_ms": TTFT_SLA_MS, "itl_sla_ms": ITL_SLA_MS, "startup_s": STARTUP.as_secs(),
        "seconds": shape.secs(), "base_rate": BASE_RATE, "peak_rate": 4.0 * BASE_RATE,
        "runs": runs,
        "predictors": predictors,
    }))
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
    desired: f64,
    ready: f64,
    provisioned: f64,
    ttft_est: f64,
    itl_est: f64,
}

fn planner_view(addr: &str) -> Option<Value> {
    let (status, body) = http::get(addr, "/v1/planner").ok()?;
    (status == 200).then(|| serde_json::from_slice(&body).ok())?
}

fn worker_body(stack: &Stack, i: usize) -> String {
    let w = &stack.workers[i];
    json!({"worker_id": w.id, "model_name": "demo-model", "endpoint": w.endpoint(), "block_size": 16})
        .to_string()
}

/// One closed-loop run: `static_fleet` workers and no planner, or the
/// planner starting from one worker.
fn closed_loop(shape: &Shape, static_fleet: Option<usize>) -> Result<Value> {
    let planned = static_fleet.is_none();
    let mut model_toml = String::new();
    if planned {
        model_toml = format!(
            "[models.planner]\nttft_ms = {TTFT_SLA_MS}\nitl_ms = {ITL_SLA_MS}\nsensitivity = 0.6\nload_interval_ms = 2000\nthroughput_interval_ms = 20000\nmin_replicas = 1\nmax_replicas = {MAX_WORKERS}\nstartup_ms = {}\npending_timeout_ms = 60000\n",
            STARTUP.as_millis()
        );
    }
    let mut stack = Stack::start_with(
        build::release_paths()?,
        StackConfig {
            workers: static_fleet.unwrap_or(MAX_WORKERS),
            sim_args: [
                "--decode-ms-per-token",
                "10",
                "--decode-ms-per-running",
                "1.0",
                "--max-running",
                "16",
                "--num-gpu-blocks",
                "8192",
            ]
            .map(String::from)
            .to_vec(),
            model_toml,
            ..StackConfig::default()
        },
    )?;
    let control = stack.control_addr();
    // The planner starts from one worker: the others are not running.
    let started = Arc::new(Mutex::new(vec![true; stack.workers.len()]));
    if planned {
        for i in 1..stack.workers.len() {
            let id = stack.workers[i].id;
            http::request(&control, "DELETE", &format!("/workers/{id}"), &[], None)?;
            stack.kill_worker(i);
            if let Ok(mut s) = started.lock() {
                s[i] = false;
            }
        }
    }
    let provisioned = Arc::new(AtomicU32::new(static_fleet.map_or(1, |n| n as u32)));
    let actions = Arc::new(Mutex::new(Vec::<Value>::new()));
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
                let mut s = Sample {
                    at_s: at,
                    rate: shape.rate(at),
                    provisioned: f64::from(provisioned.load(Ordering::Relaxed)),
                    ready: f64::from(provisioned.load(Ordering::Relaxed)),
                    desired: f64::from(provisioned.load(Ordering::Relaxed)),
                    ..Default::default()
                };
                if planned && let Some(v) = planner_view(&control) {
                    let m = &v["models"][0];
                    s.desired = m["desired"].as_f64().unwrap_or(0.0);
                    s.ready = m["ready"].as_f64().unwrap_or(0.0);
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
            let (started, provisioned, actions, stop) = (&started, &provisioned, &actions, &stop);
            let control = control.clone();
            scope.spawn(move || {
                orchestrate(stack, &control, started, provisioned, actions, stop, t0)
            });
        }
        let outcomes = rt.block_on(run_open_loop(&target, &specs, 1.0));
        stop.store(true, Ordering::Relaxed);
        let samples = sampler.join().unwrap_or_default();
        Ok((outcomes, samples))
    })?;
    summarize(
        shape,
        &outcomes,
        &samples,
        actions.lock().map(|a| a.clone()).unwrap_or_default(),
    )
}

/// The orchestrator: carries out the planner's decisions until `stop`.
fn orchestrate(
    stack: &mut Stack,
    control: &str,
    started: &Mutex<Vec<bool>>,
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
        let desired = d["desired"].as_u64().unwrap_or(0) as usize;
        let running: usize = started
            .lock()
            .map(|s| s.iter().filter(|x| **x).count())
            .unwrap_or(0);
        let at = t0.elapsed().as_secs_f64();
        if desired > running {
            // Allocated now, serving after the model loads.
            provisioned.store(desired as u32, Ordering::Relaxed);
            std::thread::sleep(STARTUP);
            for _ in running..desired {
                let Some(i) = started.lock().ok().and_then(|s| s.iter().position(|x| !x)) else {
                    break;
                };
                if stack.start_worker(i).is_err() {
                    continue;
                }
                let body = worker_body(stack, i);
                let _ = http::post_json(control, "/workers", body.as_bytes());
                if let Ok(mut s) = started.lock() {
                    s[i] = true;
                }
            }
        } else {
            for id in d["drain"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64)
            {
                // Idle first: what it runs finishes.
                let deadline = Instant::now() + Duration::from_secs(30);
                while Instant::now() < deadline && in_flight(stack, id) > 0 {
                    std::thread::sleep(Duration::from_millis(200));
                }
                let _ = http::request(control, "DELETE", &format!("/workers/{id}"), &[], None);
                if let Some(i) = stack.workers.iter().position(|w| w.id == id) {
                    stack.kill_worker(i);
                    if let Ok(mut s) = started.lock() {
                        s[i] = false;
                    }
                }
            }
            let now_running = started
                .lock()
                .map(|s| s.iter().filter(|x| **x).count())
                .unwrap_or(0);
            provisioned.store(now_running as u32, Ordering::Relaxed);
        }
        if let Ok(mut a) = actions.lock() {
            a.push(json!({"at_s": at, "id": after, "desired": desired, "from": running}));
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

fn summarize(
    shape: &Shape,
    outcomes: &[Outcome],
    samples: &[Sample],
    actions: Vec<Value>,
) -> Result<Value> {
    let within = outcomes
        .iter()
        .filter(|o| o.status == 200)
        .filter(|o| {
            let ttft = o.ttft_us.unwrap_or(u64::MAX) as f64 / 1000.0;
            let itl = (o.latency_us as f64 / 1000.0 - ttft) / f64::from(MAX_TOKENS - 1);
            ttft <= TTFT_SLA_MS && itl <= ITL_SLA_MS
        })
        .count();
    let replica_s: f64 = samples
        .windows(2)
        .map(|w| w[0].provisioned * (w[1].at_s - w[0].at_s))
        .sum();
    let series = |f: fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|s| (s.at_s, f(s))).collect()
    };
    Ok(json!({
        "sent": outcomes.len(),
        "ok": outcomes.iter().filter(|o| o.status == 200).count(),
        "sla_attainment": within as f64 / outcomes.len().max(1) as f64,
        "replica_seconds": replica_s,
        "seconds": shape.secs(),
        "scaling_actions": actions.len(),
        "actions": actions,
        "series": {
            "rate": series(|s| s.rate),
            "desired": series(|s| s.desired),
            "ready": series(|s| s.ready),
            "provisioned": series(|s| s.provisioned),
            "ttft_est_ms": series(|s| s.ttft_est),
            "itl_est_ms": series(|s| s.itl_est),
        },
    }))
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
                (
                    "offered req/s ÷ 4",
                    points(&p["rate"])
                        .iter()
                        .map(|(t, r)| (*t, r / 4.0))
                        .collect(),
                ),
                ("desired", points(&p["desired"])),
                ("ready", points(&p["ready"])),
                ("provisioned", points(&p["provisioned"])),
            ],
            &[],
        ),
    )?;
    std::fs::write(
        plots.join("planner_latency.svg"),
        plot::lines(
            "Estimated latency, worst worker",
            "s",
            "ms",
            &[
                (
                    "TTFT ÷ 10",
                    points(&p["ttft_est_ms"])
                        .iter()
                        .map(|(t, y)| (*t, y / 10.0))
                        .collect(),
                ),
                ("ITL", points(&p["itl_est_ms"])),
            ],
            &[
                ("ITL SLA", ITL_SLA_MS),
                ("TTFT SLA ÷ 10", TTFT_SLA_MS / 10.0),
            ],
        ),
    )?;
    let row = |n: &str| {
        let r = &v["runs"][n];
        format!(
            "| {n} | {:.1} % | {:.0} | {} | {}/{} |",
            100.0 * r["sla_attainment"].as_f64().unwrap_or(0.0),
            r["replica_seconds"].as_f64().unwrap_or(0.0),
            r["scaling_actions"],
            r["ok"],
            r["sent"],
        )
    };
    let mut mape_rows = String::new();
    if let Some(m) = v["predictors"]["mape_pct"].as_object() {
        for (k, x) in m {
            let f = |q: &str| {
                x[q].as_f64()
                    .map_or("-".to_string(), |v| format!("{v:.1} %"))
            };
            mape_rows.push_str(&format!(
                "| {k} | {} | {} | {} |\n",
                f("requests"),
                f("isl"),
                f("osl")
            ));
        }
    }
    Ok(format!(
        "\n## Planner\n\n\
`cargo xtask bench --only planner`: streaming completions ({MAX_TOKENS} tokens) on simulated workers \
whose ITL grows with their batch, offered {} req/s rising to {} and back over {} s. SLA: TTFT \
{TTFT_SLA_MS} ms, ITL {ITL_SLA_MS} ms. With the planner the harness is the orchestrator: it follows \
the decision API, a new worker serving {} s after the decision (its model load), a drained one \
removed once idle. Against fleets fixed at 4 (the peak's need) and 2 (the mean's).\n\n\
| fleet | SLA attainment | replica-seconds | scaling actions | ok/sent |\n| --- | --- | --- | --- | --- |\n{}\n{}\n{}\n\n\
Predictors, one-step error on the Mooncake conversation trace per minute ({} minutes; seasonal period 10):\n\n\
| predictor | requests | ISL | OSL |\n| --- | --- | --- | --- |\n{mape_rows}\n\
![replicas](plots/planner_replicas.svg) ![latency](plots/planner_latency.svg)\n",
        v["base_rate"],
        v["peak_rate"],
        v["seconds"],
        v["startup_s"],
        row("planner"),
        row("static_peak"),
        row("static_mean"),
        v["predictors"]["intervals"],
    ))
}
