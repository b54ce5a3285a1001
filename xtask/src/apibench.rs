//! The selection API and replica sync, measured:
//!
//! * [`selection`]: `POST /select` and `/select_and_reserve` over loopback
//!   HTTP against the KV benchmark's 1.6M-block index: latency with one
//!   request in flight, throughput with four, and the sidecar's CPU per
//!   call (selections per core-second);
//! * [`sync`]: two sidecars as replica-sync peers while one takes 1k
//!   admissions a second; how long until the other counts a new admission,
//!   and its end.

use crate::build;
use anyhow::{Context, Result, bail};
use kvgate_core::hash::{XXH3_SEED, block_hashes, sequence_hashes};
use kvgate_load::summary::percentile;
use kvgate_load::{Outcome, RequestSpec, Target, run_closed_loop};
use kvgate_stack::{Gateway, Stack, StackConfig, http};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// One way of calling the API, measured.
fn calls(
    rt: &tokio::runtime::Runtime,
    stack: &Stack,
    path: &str,
    bodies: &[String],
) -> Result<Value> {
    let target = Target::new(format!("http://{}", stack.gateways[0].selection_addr()));
    let specs = |n: usize| -> Vec<RequestSpec> {
        (0..n)
            .map(|i| RequestSpec {
                path: path.to_string(),
                body: bodies[i % bodies.len()].clone().into(),
                stream: false,
                at: Duration::ZERO,
                tag: String::new(),
                prompt_tokens: None,
            })
            .collect()
    };
    let ok = |o: &[Outcome]| -> Result<Vec<u64>> {
        let mut lat: Vec<u64> = o
            .iter()
            .filter(|o| o.status == 200)
            .map(|o| o.latency_us)
            .collect();
        if lat.len() != o.len() {
            let bad = o.iter().find(|o| o.status != 200);
            bail!(
                "{path}: {} of {} calls failed: {bad:?}",
                o.len() - lat.len(),
                o.len()
            );
        }
        lat.sort_unstable();
        Ok(lat)
    };
    rt.block_on(run_closed_loop(&target, &specs(200), 1));
    let serial = ok(&rt.block_on(run_closed_loop(&target, &specs(3000), 1)))?;
    let cpu0 = stack.cpu_seconds()[1];
    let t = Instant::now();
    let n = 20_000;
    ok(&rt.block_on(run_closed_loop(&target, &specs(n), 4)))?;
    let wall = t.elapsed().as_secs_f64();
    let cpu = stack.cpu_seconds()[1] - cpu0;
    Ok(json!({
        "p50_us": percentile(&serial, 50.0),
        "p99_us": percentile(&serial, 99.0),
        "rps_4_in_flight": n as f64 / wall,
        "sidecar_cpu_us_per_call": cpu * 1e6 / n as f64,
        "per_core_second": if cpu > 0.0 { n as f64 / cpu } else { 0.0 },
    }))
}

/// `/select` and `/select_and_reserve` on `prompts`, each cached whole on
/// worker `i % workers + 1` of the KV benchmark's stack.
pub fn selection(stack: &Stack, prompts: &[Vec<u32>]) -> Result<Value> {
    let workers = stack.workers.len();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let hashes = |p: &[u32]| sequence_hashes(&block_hashes(p, 16, XXH3_SEED));
    let by_hashes: Vec<String> = prompts
        .iter()
        .map(|p| {
            json!({"model_name": "demo-model", "sequence_hashes": hashes(p), "isl_tokens": p.len()})
                .to_string()
        })
        .collect();
    let by_tokens: Vec<String> = prompts
        .iter()
        .map(|p| json!({"model_name": "demo-model", "token_ids": p}).to_string())
        .collect();
    // What the calls answer, checked on a sample: the holder, all matched.
    let addr = stack.gateways[0].selection_addr();
    let mut held = 0;
    for (i, b) in by_hashes.iter().enumerate().take(64) {
        let (status, _, body) = http::post_json(&addr, "/select", b.as_bytes())?;
        let v: Value = serde_json::from_slice(&body)?;
        if status == 200
            && v["worker_id"] == (i % workers + 1)
            && v["overlap"]["gpu"] == prompts[i].len()
        {
            held += 1;
        }
    }
    eprintln!("xtask: bench selection API");
    let select_hashes = calls(&rt, stack, "/select", &by_hashes)?;
    let select_tokens = calls(&rt, stack, "/select", &by_tokens)?;
    let reserve = calls(&rt, stack, "/select_and_reserve", &by_hashes)?;
    Ok(json!({
        "prompt_tokens": prompts.first().map_or(0, Vec::len),
        "sampled": 64,
        "sampled_to_holder": held,
        "select_sequence_hashes": select_hashes,
        "select_token_ids": select_tokens,
        "select_and_reserve": reserve,
    }))
}

/// Prefill tokens gateway `g`'s sidecar counts on worker 1, rank 0.
fn prefill_on_worker_1(g: &Gateway) -> Result<u64> {
    let (status, body) = http::get(&g.selection_addr(), "/loads")?;
    if status != 200 {
        bail!("/loads answered {status}");
    }
    let v: Value = serde_json::from_slice(&body)?;
    v["models"][0]["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["worker_id"] == 1)
        .and_then(|r| r["active_prefill_tokens"].as_u64())
        .context("worker 1 missing from /loads")
}

fn reserve(addr: &str, id: &str, worker: u64, isl: u64) -> Result<()> {
    let body = json!({"reservation_id": id, "model_name": "demo-model",
                      "worker_id": worker, "isl_tokens": isl});
    let (status, _, b) = http::post_json(addr, "/reservations", body.to_string().as_bytes())?;
    if status != 200 {
        bail!("reservation {id}: {status} {}", String::from_utf8_lossy(&b));
    }
    Ok(())
}

fn free(addr: &str, id: &str) -> Result<()> {
    let (status, _) = http::request(addr, "DELETE", &format!("/reservations/{id}"), &[], None)?;
    if status != 204 {
        bail!("free {id}: {status}");
    }
    Ok(())
}

/// Polls until `f` holds; returns how long it took.
fn until(what: &str, mut f: impl FnMut() -> Result<bool>) -> Result<Duration> {
    let t = Instant::now();
    while !f()? {
        if t.elapsed() > Duration::from_secs(5) {
            bail!("{what} never happened");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(t.elapsed())
}

/// Replica-sync convergence between two sidecars under 1k admissions/s.
pub fn sync(quick: bool) -> Result<Value> {
    eprintln!("xtask: bench replica sync");
    let stack = Stack::start_with(
        build::release_paths()?,
        StackConfig {
            workers: 4,
            gateways: 2,
            replica_sync: true,
            selection_api: true,
            sim_args: vec!["--instant".into()],
            ..StackConfig::default()
        },
    )?;
    let a = stack.gateways[0].selection_addr();
    // Wait until the subscriptions carry messages.
    reserve(&a, "warm", 1, 1_000_000)?;
    until("the first sync", || {
        Ok(prefill_on_worker_1(&stack.gateways[1])? > 0)
    })?;
    free(&a, "warm")?;
    until("the first free", || {
        Ok(prefill_on_worker_1(&stack.gateways[1])? == 0)
    })?;

    // Background: 1k admissions a second on workers 2-4, each freed 50 ms
    // later (about 50 in flight), from another thread.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let background = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || -> Result<u64> {
            let mut n = 0u64;
            let mut live = std::collections::VecDeque::new();
            let t = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let id = format!("bg-{n}");
                reserve(&a, &id, 2 + n % 3, 512)?;
                live.push_back((Instant::now(), id));
                n += 1;
                while live
                    .front()
                    .is_some_and(|(at, _)| at.elapsed() > Duration::from_millis(50))
                {
                    if let Some((_, id)) = live.pop_front() {
                        free(&a, &id)?;
                    }
                }
                // Paced to 1k a second.
                let due = t + Duration::from_micros(1000 * n);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            for (_, id) in live {
                free(&a, &id)?;
            }
            Ok(n * 1000 / t.elapsed().as_millis().max(1) as u64)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    let (mut admit_ms, mut free_ms) = (Vec::new(), Vec::new());
    for k in 0..if quick { 20 } else { 50 } {
        let id = format!("probe-{k}");
        reserve(&a, &id, 1, 1_000_000)?;
        admit_ms.push(
            until("a probe's admission at the peer", || {
                Ok(prefill_on_worker_1(&stack.gateways[1])? >= 1_000_000)
            })?
            .as_secs_f64()
                * 1e3,
        );
        free(&a, &id)?;
        free_ms.push(
            until("a probe's free at the peer", || {
                Ok(prefill_on_worker_1(&stack.gateways[1])? == 0)
            })?
            .as_secs_f64()
                * 1e3,
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rate = background
        .join()
        .map_err(|_| anyhow::anyhow!("the background thread panicked"))??;
    let dropped = stack.gateways[1]
        .sidecar_metric("kvgate_sidecar_replica_sync_events_total{result=\"dropped_inbound\"}")?
        + stack.gateways[0].sidecar_metric(
            "kvgate_sidecar_replica_sync_events_total{result=\"dropped_outbox\"}",
        )?;
    let pct = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
    };
    Ok(json!({
        "background_admissions_per_s": rate,
        "probes": admit_ms.len(),
        "admission_ms_p50": pct(&mut admit_ms, 0.5),
        "admission_ms_p99": pct(&mut admit_ms, 0.99),
        "free_ms_p50": pct(&mut free_ms, 0.5),
        "free_ms_p99": pct(&mut free_ms, 0.99),
        "dropped_events": dropped,
    }))
}

/// The report's section for both.
pub fn report(selection: &Value, sync: &Value) -> String {
    let f = |v: &Value, k: &[&str]| k.iter().fold(v, |v, k| &v[*k]).as_f64().unwrap_or(f64::NAN);
    let row = |name: &str, k: &str| {
        let v = &selection[k];
        format!(
            "| {name} | {:.0} / {:.0} µs | {:.0} /s | {:.0} µs | {:.0} /s |\n",
            f(v, &["p50_us"]),
            f(v, &["p99_us"]),
            f(v, &["rps_4_in_flight"]),
            f(v, &["sidecar_cpu_us_per_call"]),
            f(v, &["per_core_second"]),
        )
    };
    format!(
        "\n## Selection API and replica sync\n\n\
Over loopback HTTP, against the KV benchmark's index (16 workers, 1.6M blocks), {}-token prompts; {} of {} sampled selections named the prefix holder with every block matched. Targets: p50 ≤ 100 µs, ≥ 10k selections per core-second.\n\n\
| call | p50 / p99, 1 in flight | throughput, 4 in flight | sidecar CPU per call | per core-second |\n| --- | --- | --- | --- | --- |\n{}{}{}\n\
Replica sync between two sidecars while one takes {:.0} admissions a second (each freed 50 ms later): a new admission is counted by the peer after {:.1} ms p50 / {:.1} ms p99, its free after {:.1} / {:.1} ms ({} probes; {} events dropped). Times include the HTTP round trips of the probe and of polling the peer's `/loads`.\n",
        f(selection, &["prompt_tokens"]),
        f(selection, &["sampled_to_holder"]),
        f(selection, &["sampled"]),
        row("`/select`, `sequence_hashes`", "select_sequence_hashes"),
        row(
            "`/select`, `token_ids` (hashed by kvgate)",
            "select_token_ids"
        ),
        row(
            "`/select_and_reserve`, `sequence_hashes`",
            "select_and_reserve"
        ),
        f(sync, &["background_admissions_per_s"]),
        f(sync, &["admission_ms_p50"]),
        f(sync, &["admission_ms_p99"]),
        f(sync, &["free_ms_p50"]),
        f(sync, &["free_ms_p99"]),
        f(sync, &["probes"]),
        f(sync, &["dropped_events"]),
    )
}
