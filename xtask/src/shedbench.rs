//! `shedding`: what load shedding costs and what it buys.
//!
//! 1. The busy 503 answered by the filter inside Envoy, against a request
//!    Envoy passes through to a worker that answers at once (the plain
//!    listener, an unknown path: the worker's own 404), closed loop,
//!    alternating, same run.
//! 2. Admitted requests' time to first token at about twice the fleet's
//!    capacity (open loop, Poisson arrivals, streaming), with shedding off
//!    and then on, the thresholds switched through Envoy's control
//!    listener between the two runs.
//! 3. Whether `Retry-After` tells the truth: the same overload from clients
//!    that retry once after the advertised delay, and the share of those
//!    retries that are admitted.

use crate::build;
use crate::stats::{self, admitted_ttft_us, median};
use anyhow::{Context, Result};
use bytes::Bytes;
use kvgate_load::summary::percentile;
use kvgate_load::{
    Outcome, RequestSpec, Target, run_closed_loop, run_open_loop, run_open_loop_retrying,
};
use kvgate_stack::{Stack, StackConfig, http};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn small(path: &str, n: usize) -> Vec<RequestSpec> {
    let body = json!({"model": "demo-model", "max_tokens": 1,
                      "messages": [{"role": "user", "content": "ping"}]});
    (0..n)
        .map(|_| RequestSpec {
            path: path.into(),
            body: Bytes::from(body.to_string()),
            stream: false,
            at: Duration::ZERO,
            tag: String::new(),
            prompt_tokens: None,
        })
        .collect()
}

fn latencies(outcomes: &[Outcome], status: u16) -> Vec<u64> {
    let mut v: Vec<u64> = outcomes
        .iter()
        .filter(|o| o.status == status)
        .map(|o| o.latency_us)
        .collect();
    v.sort_unstable();
    v
}

/// Busy 503 latency against a pass-through round trip.
fn reply_latency(quick: bool) -> Result<Value> {
    let (reps, n, concurrency) = if quick { (3, 1000, 8) } else { (5, 3000, 8) };
    eprintln!("xtask: bench shedding: 503 latency ({reps} × {n} per route)");
    let stack = Stack::start_with(
        build::release_paths()?,
        StackConfig {
            workers: 2,
            sim_args: ["--num-gpu-blocks", "64", "--decode-ms-per-token", "500"]
                .map(String::from)
                .to_vec(),
            model_toml: "active_decode_blocks_threshold = 0.1".into(),
            ..StackConfig::default()
        },
    )?;
    // A long request on each worker, sent to it directly, keeps every worker
    // busy for the whole run.
    let hogs: Vec<_> = stack
        .workers
        .iter()
        .map(|w| {
            let addr = w.endpoint();
            std::thread::spawn(move || {
                let prompt: Vec<u32> = (0..320).collect();
                let body = json!({"model": "demo-model", "prompt": prompt, "max_tokens": 100});
                http::post_json(&addr, "/v1/completions", body.to_string().as_bytes())
            })
        })
        .collect();
    let rt = tokio::runtime::Runtime::new()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let o = rt.block_on(run_closed_loop(
            &Target::new(stack.envoy_url()),
            &small("/v1/chat/completions", 1),
            1,
        ));
        if o.first().is_some_and(|o| o.status == 503) {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the fleet never went busy");
        std::thread::sleep(Duration::from_millis(50));
    }
    let shed_specs = small("/v1/chat/completions", n);
    let pass_specs = small("/v1/kvgate-bench-unknown", n);
    let (mut shed, mut pass) = (Vec::new(), Vec::new());
    for rep in 0..reps {
        let one = |base: String, specs: &[RequestSpec], status: u16| {
            let t = Instant::now();
            let o = rt.block_on(run_closed_loop(&Target::new(base), specs, concurrency));
            let wall = t.elapsed().as_secs_f64();
            let lat = latencies(&o, status);
            (
                percentile(&lat, 50.0).unwrap_or(0) as f64,
                percentile(&lat, 99.0).unwrap_or(0) as f64,
                lat.len() as f64 / wall,
                o.len() - lat.len(),
            )
        };
        if rep % 2 == 0 {
            shed.push(one(stack.envoy_url(), &shed_specs, 503));
            pass.push(one(stack.plain_url(), &pass_specs, 404));
        } else {
            pass.push(one(stack.plain_url(), &pass_specs, 404));
            shed.push(one(stack.envoy_url(), &shed_specs, 503));
        }
    }
    drop(stack);
    for h in hogs {
        let _ = h.join();
    }
    let side = |v: &[(f64, f64, f64, usize)]| {
        json!({
            "p50_us": median(v.iter().map(|r| r.0).collect()),
            "p99_us": median(v.iter().map(|r| r.1).collect()),
            "rps": median(v.iter().map(|r| r.2).collect()),
            "unexpected_status": v.iter().map(|r| r.3).sum::<usize>(),
        })
    };
    Ok(json!({
        "runs": reps, "requests_per_run": n, "concurrency": concurrency,
        "busy_503_through_envoy": side(&shed),
        "baseline_pass_through": side(&pass),
    }))
}

/// Streaming requests with Poisson arrivals at `rate` per second.
fn arrivals(rate: f64, secs: f64, seed: u64) -> Vec<RequestSpec> {
    // Each seed has its own prompts, so one run's bodies are not another's
    // retries.
    poisson_streams(
        rate,
        secs,
        seed,
        1_000_000 + (seed % 64) as u32 * 10_000_000,
        32,
    )
}

/// Poisson arrivals of [`unique_stream`] requests whose prompts start at
/// `base`.
pub(crate) fn poisson_streams(
    rate: f64,
    secs: f64,
    seed: u64,
    base: u32,
    max_tokens: u32,
) -> Vec<RequestSpec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut t, mut i) = (0.0, 0u32);
    let mut out = Vec::new();
    while t < secs {
        out.push(unique_stream(base, i, max_tokens, t));
        i += 1;
        let u: f64 = rng.random_range(1e-9..1.0);
        t += -u.ln() / rate;
    }
    out
}

/// Streaming completion `i` of 256 tokens no other request shares (nothing
/// is cached, every request costs the same), sent at `at_s`.
pub(crate) fn unique_stream(base: u32, i: u32, max_tokens: u32, at_s: f64) -> RequestSpec {
    let prompt: Vec<u32> = (0..256).map(|k| base + i * 300 + k).collect();
    token_stream(prompt, max_tokens, at_s, "")
}

/// A streaming completion of the token `prompt`, sent at `at_s`.
pub(crate) fn token_stream(prompt: Vec<u32>, max_tokens: u32, at_s: f64, tag: &str) -> RequestSpec {
    let n = prompt.len() as u64;
    let body =
        json!({"model": "demo-model", "prompt": prompt, "max_tokens": max_tokens, "stream": true});
    RequestSpec {
        path: "/v1/completions".into(),
        body: Bytes::from(body.to_string()),
        stream: true,
        at: Duration::from_secs_f64(at_s),
        tag: tag.into(),
        prompt_tokens: Some(n),
    }
}

fn wait_drained(stack: &Stack) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = stack
            .sidecar_metric("kvgate_sidecar_bookings_active{model=\"demo-model\"}")
            .unwrap_or(0.0);
        if n == 0.0 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "bookings never drained");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn ttft_summary(outcomes: &[Outcome], secs: f64) -> Value {
    let ttft = admitted_ttft_us(outcomes);
    let ms = |p: f64| stats::ms(&ttft, p);
    let shed = outcomes.iter().filter(|o| o.status == 503).count();
    let other = outcomes.len() - ttft.len() - shed;
    json!({
        "sent": outcomes.len(),
        "admitted": ttft.len(),
        "shed": shed,
        "other_failures": other,
        "shed_rate": shed as f64 / outcomes.len().max(1) as f64,
        "ttft_ms_p50": ms(50.0), "ttft_ms_p90": ms(90.0), "ttft_ms_p99": ms(99.0),
        "admitted_per_s": ttft.len() as f64 / secs,
    })
}

/// How the advertised `Retry-After` held up: the share of retries, made
/// at the advertised time, that were admitted. Only retries sent while the
/// overload still ran count: later ones meet an idle fleet.
fn retry_summary(runs: &[(Outcome, Option<Outcome>)], secs: f64) -> Value {
    let window_us = (secs * 1e6) as u64;
    let mut advertised: Vec<u64> = Vec::new();
    let (mut tried, mut admitted) = (0usize, 0usize);
    for (first, retry) in runs {
        let Some(r) = retry else { continue };
        advertised.push(u64::from(first.retry_after_s.unwrap_or(0)));
        if r.start_us > window_us {
            continue;
        }
        tried += 1;
        if r.status == 200 {
            admitted += 1;
        }
    }
    advertised.sort_unstable();
    json!({
        "shed_first": runs.iter().filter(|(f, _)| f.status == 503).count(),
        "retries_in_overload": tried,
        "retries_admitted": admitted,
        "admitted_share": admitted as f64 / tried.max(1) as f64,
        "retry_after_s_p50": percentile(&advertised, 50.0).unwrap_or(0),
        "retry_after_s_max": advertised.last().copied().unwrap_or(0),
    })
}

/// Admitted TTFT at about 2× capacity, shedding off then on.
fn overload(quick: bool) -> Result<Value> {
    let secs = if quick { 6.0 } else { 15.0 };
    // Two workers, 8 running per rank, ~0.35 s per request: about 45 req/s.
    let capacity = 45.0;
    let rate = 2.0 * capacity;
    eprintln!("xtask: bench shedding: TTFT at {rate} req/s for {secs} s, shedding off and on");
    let stack = Stack::start_with(
        build::release_paths()?,
        StackConfig {
            workers: 2,
            sim_args: [
                "--num-gpu-blocks",
                "512",
                "--max-running",
                "8",
                "--decode-ms-per-token",
                "10",
            ]
            .map(String::from)
            .to_vec(),
            ..StackConfig::default()
        },
    )?;
    let rt = tokio::runtime::Runtime::new()?;
    let target = Target::new(stack.envoy_url());
    let specs = arrivals(rate, secs, 11);
    let off = rt.block_on(run_open_loop(&target, &specs, 1.0));
    wait_drained(&stack)?;
    // Shed when a rank's booked blocks pass a third of its cache (about
    // ten requests in flight on a rank that runs eight at a time).
    stack
        .set_thresholds(&json!({"model": "demo-model", "active_decode_blocks_threshold": 0.33}))?;
    std::thread::sleep(Duration::from_millis(500));
    let on = rt.block_on(run_open_loop(&target, &specs, 1.0));
    wait_drained(&stack)?;
    // The same load from clients that honour Retry-After: each shed request
    // is sent once more after the advertised delay. An honest Retry-After
    // is one after which a retry is admitted.
    let retried = rt.block_on(run_open_loop_retrying(
        &target,
        &arrivals(rate, secs, 12),
        1.0,
        Duration::from_secs(60),
    ));
    let mut retry = retry_summary(&retried, secs);
    retry["admitted_on_ticket"] = json!(stack.envoy_stat("kvgate_retry_admitted_total")?);
    retry["service_rate_per_s"] = stack.sidecar_state()?["models"][0]["service_rate_per_s"].clone();
    Ok(json!({
        "rate_per_s": rate, "estimated_capacity_per_s": capacity, "seconds": secs,
        "threshold_active_decode_blocks": 0.33,
        "baseline_shedding_off": ttft_summary(&off, secs),
        "shedding_on": ttft_summary(&on, secs),
        "retry_after": retry,
    }))
}

pub fn run(quick: bool) -> Result<Value> {
    let replies = reply_latency(quick).context("503 latency")?;
    let overload = overload(quick).context("overload TTFT")?;
    Ok(json!({"name": "shedding", "reply_latency": replies, "overload": overload}))
}

pub fn report(v: &Value) -> String {
    let f = |path: &[&str]| {
        let mut cur = v;
        for p in path {
            cur = &cur[*p];
        }
        cur.as_f64().unwrap_or(f64::NAN)
    };
    let r = |side: &str, k: &str| f(&["reply_latency", side, k]);
    let o = |side: &str, k: &str| f(&["overload", side, k]);
    format!(
        "\n## Load shedding\n\n\
Busy 503 answered inside Envoy against a pass-through round trip to a worker that answers at once (closed loop ×{:.0}, medians of {:.0} runs):\n\n\
| route | p50 | p99 | throughput |\n| --- | --- | --- | --- |\n\
| pass-through, plain listener (baseline) | {:.0} µs | {:.0} µs | {:.0} req/s |\n\
| busy 503 from the kvgate filter | {:.0} µs | {:.0} µs | {:.0} req/s |\n\n\
Admitted requests at {:.0} req/s offered, about 2× the fleet's capacity (2 workers, streaming, 256-token prompts, 32 output tokens, {:.0} s, Poisson):\n\n\
| shedding | admitted | shed | TTFT p50 | p90 | p99 | admitted/s offered |\n| --- | --- | --- | --- | --- | --- | --- |\n\
| off (baseline) | {:.0} | {:.0} | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} |\n\
| on (decode blocks > 0.33) | {:.0} | {:.0} | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} |\n\n\
Retry-After, the same load (other prompts) from clients that honour it (each shed request sent once more after the advertised delay): {:.0} retries made while the overload ran, {:.0} admitted ({:.0} %; target ≥ 80 %); advertised p50 {:.0} s, max {:.0} s. Each shed request gets a place in a retry queue paced at three quarters of the model's service rate ({:.1} requests/s as the sidecar measured it at the end), and a retry back at its place goes ahead of new work within 50 % over the thresholds ({:.0} admitted so, counting retries after the overload). The places stretch as long as the overload lasts: that is when a retry can be admitted.\n",
        f(&["reply_latency", "concurrency"]),
        f(&["reply_latency", "runs"]),
        r("baseline_pass_through", "p50_us"),
        r("baseline_pass_through", "p99_us"),
        r("baseline_pass_through", "rps"),
        r("busy_503_through_envoy", "p50_us"),
        r("busy_503_through_envoy", "p99_us"),
        r("busy_503_through_envoy", "rps"),
        f(&["overload", "rate_per_s"]),
        f(&["overload", "seconds"]),
        o("baseline_shedding_off", "admitted"),
        o("baseline_shedding_off", "shed"),
        o("baseline_shedding_off", "ttft_ms_p50"),
        o("baseline_shedding_off", "ttft_ms_p90"),
        o("baseline_shedding_off", "ttft_ms_p99"),
        o("baseline_shedding_off", "admitted_per_s"),
        o("shedding_on", "admitted"),
        o("shedding_on", "shed"),
        o("shedding_on", "ttft_ms_p50"),
        o("shedding_on", "ttft_ms_p90"),
        o("shedding_on", "ttft_ms_p99"),
        o("shedding_on", "admitted_per_s"),
        o("retry_after", "retries_in_overload"),
        o("retry_after", "retries_admitted"),
        100.0 * o("retry_after", "admitted_share"),
        o("retry_after", "retry_after_s_p50"),
        o("retry_after", "retry_after_s_max"),
        o("retry_after", "service_rate_per_s"),
        o("retry_after", "admitted_on_ticket"),
    )
}
