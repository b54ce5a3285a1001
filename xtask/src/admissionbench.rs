//! `admission`: holding requests inside Envoy by class and deadline,
//! against shedding them and against no decision at all, on the Mooncake
//! conversation trace.
//!
//! One run, one fleet of [`WORKERS`] simulated workers (a stack each arm
//! needs its own configuration for, the same workers' time model in all):
//!
//! 1. the fleet's unloaded time to first token (the trace's first requests
//!    one at a time), from which the classes' TTFT targets are computed
//!    ([`TARGET_X`] times its p50), and its capacity: the completion rate
//!    of a closed loop that keeps every worker's prefill queue full,
//!    through kvgate without thresholds;
//! 2. Poisson arrivals of the trace's requests (in trace order, outputs
//!    capped) at [`LOADS`] times that capacity, each request of a class
//!    (10 / 60 / 30 % critical / standard / sheddable, in the class header
//!    the plugin configuration names) and of one of four tenants, one of
//!    which sends four times what each other does (equal weights). The
//!    same requests at the same times in every arm:
//!    * `least_request`: Envoy's least-request balancing, no kvgate;
//!    * `today`: kvgate with a busy threshold on the prompt tokens booked on
//!      a rank: the 503 with a place in the retry queue;
//!    * `admission`: the same threshold, `admission` on (critical may use
//!      the reserve and is held 10 s, standard 5 s, sheddable never; with
//!      targets, no longer than its TTFT target), the classes' TTFT
//!      targets and the model's `[models.slo]`, and the predicted-TTFT
//!      response header;
//!    * `admission_no_slo`: admission without any latency target (no fits,
//!      no prediction): the decision's cost without prediction, and what the
//!      targets change.
//!
//! Clients are the same in every arm: a request shed with `Retry-After`
//! of at most [`RETRY_MAX_WAIT_S`] is sent once more after that long, and
//! its time to first token counts from its first send. The four tenants
//! share one fleet: each request names its tenant in the account header
//! (`admission.account_header`, whose booked load the shares count), not
//! kvgate's tenant header, which would give each its own workers.
//!
//! The client here is a small HTTP/1.1 one of its own (a connection per
//! request), as `kvgate-load`'s outcome keeps no response header and the
//! predicted TTFT comes in one.

use crate::build;
use crate::quality::{cap_outputs, mooncake_text, reset};
use crate::stats::{at, num_or_dash as f, pct_or_dash as pct};
use crate::stats::{histogram_buckets, percentiles_between};
use anyhow::{Context, Result};
use bytes::Bytes;
use kvgate_load::summary::percentile;
use kvgate_load::workload::mooncake;
use kvgate_stack::{Stack, StackConfig, http};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MODEL: &str = "demo-model";
const WORKERS: usize = 4;
/// KV blocks per worker (16 tokens each): 512k tokens, an 8B model's
/// cache on an 80 GB GPU, as the quality bench's Mooncake fleet.
const KV_BLOCKS: u32 = 32768;
/// One prefill at a time per worker, 25 µs a prompt token (40k tokens/s):
/// the prompt's queue is what a new request waits behind.
const PREFILL_US_PER_TOKEN: u32 = 25;
/// Outputs capped: two shared cores stream every token through Envoy, and
/// admission acts on the time to first token.
const MAX_OUTPUT_TOKENS: u64 = 32;
/// The offered loads, as multiples of the measured capacity.
const LOADS: [f64; 3] = [1.0, 1.5, 2.0];
/// Classes: name, share of the requests, priority, reserve, hold (ms), and
/// the TTFT target as a multiple of the unloaded p50.
const CLASSES: [(&str, f64, u8, bool, u64, f64); 3] = [
    ("critical", 0.10, 0, true, 10_000, 2.0),
    ("standard", 0.60, 1, false, 5_000, 4.0),
    ("sheddable", 0.30, 2, false, 0, 4.0),
];
/// The TTFT targets' multiples of the unloaded p50, by class.
const TARGET_X: [f64; 3] = [CLASSES[0].5, CLASSES[1].5, CLASSES[2].5];
/// The ITL target ([models.slo] needs one) as a multiple of the unloaded
/// mean gap: loose, so that only the TTFT target decides.
const ITL_X: f64 = 4.0;
/// Tenants: name and how much each sends, relative; all weigh 1.
const TENANTS: [(&str, f64); 4] = [("t1", 4.0), ("t2", 1.0), ("t3", 1.0), ("t4", 1.0)];
const RESERVE_PCT: u32 = 10;
/// The busy threshold: this many times the mean prompt of the requests
/// used, in prompt tokens booked on a rank.
const THRESHOLD_X_MEAN_ISL: f64 = 2.0;
/// A client retries a shed request once, after its `Retry-After`, when
/// that is at most this long; otherwise it gives up.
const RETRY_MAX_WAIT_S: u32 = 5;
const CLASS_HEADER: &str = "x-bench-class";
/// Names the request's tenant as admission counts its share (the local
/// stack's Envoy strips `x-kvgate-account` from clients).
const ACCOUNT_HEADER: &str = "x-bench-account";
const PREDICTED_HEADER: &str = "x-kvgate-predicted-ttft-ms";
const TIMEOUT: Duration = Duration::from_secs(120);
/// Envoy computes histograms at its stats flush (every 5 s).
const FLUSH: Duration = Duration::from_secs(6);

const ARMS: [&str; 4] = ["least_request", "today", "admission", "admission_no_slo"];

/// One request of the workload.
#[derive(Debug, Clone)]
struct Req {
    body: Bytes,
    at: Duration,
    class: usize,
    tenant: usize,
}

/// One HTTP exchange as the client saw it.
#[derive(Debug, Clone, Default)]
struct Attempt {
    status: u16,
    reason: Option<String>,
    retry_after_s: Option<u32>,
    predicted_ms: Option<f64>,
    ttft_us: Option<u64>,
    latency_us: u64,
    start_us: u64,
    events: u32,
    error: Option<String>,
}

/// A request's first attempt and its retry, if it made one.
#[derive(Debug, Clone)]
struct Done {
    class: usize,
    tenant: usize,
    first: Attempt,
    retry: Option<Attempt>,
}

impl Done {
    fn last(&self) -> &Attempt {
        self.retry.as_ref().unwrap_or(&self.first)
    }

    /// Time to first token from the first send, µs; `None` unless the last
    /// attempt streamed.
    fn ttft_us(&self) -> Option<u64> {
        let l = self.last();
        if l.status != 200 {
            return None;
        }
        Some(l.start_us.saturating_sub(self.first.start_us) + l.ttft_us?)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn count(hay: &[u8], needle: &[u8]) -> u32 {
    hay.windows(needle.len()).filter(|w| *w == needle).count() as u32
}

/// The request's head: connection closed after the answer.
fn head(body_len: usize, class: &str, tenant: &str) -> Vec<u8> {
    format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvgate-bench\r\ncontent-type: application/json\r\ncontent-length: {body_len}\r\nconnection: close\r\n{CLASS_HEADER}: {class}\r\n{ACCOUNT_HEADER}: {tenant}\r\n\r\n"
    )
    .into_bytes()
}

fn parse_head(text: &[u8], a: &mut Attempt) {
    let text = String::from_utf8_lossy(text);
    let mut lines = text.split("\r\n");
    a.status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let v = v.trim();
        match k.trim().to_ascii_lowercase().as_str() {
            "x-kvgate-reason" => a.reason = Some(v.to_string()),
            "retry-after" => a.retry_after_s = v.parse().ok(),
            PREDICTED_HEADER => a.predicted_ms = v.parse().ok(),
            _ => {}
        }
    }
}

/// One exchange: the time to the first SSE `data:` event of a 200.
async fn exchange(addr: &str, msg: &[u8], start: Instant, a: &mut Attempt) -> std::io::Result<()> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    // One write: a filter that answers at the headers may close the
    // connection, and a body written after that draws a reset.
    s.write_all(msg).await?;
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut chunk = vec![0u8; 65536];
    let mut body_at: Option<usize> = None;
    let mut scanned = 0usize;
    let (mut events, mut done) = (0u32, 0u32);
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        let from = match body_at {
            Some(at) => at,
            None => {
                let Some(i) = find(&buf, b"\r\n\r\n") else {
                    continue;
                };
                parse_head(&buf[..i], a);
                body_at = Some(i + 4);
                scanned = i + 4;
                i + 4
            }
        };
        // A pattern split across reads starts at most its length − 1
        // before the new bytes.
        let at = scanned.saturating_sub(4).max(from);
        events += count(&buf[at..], b"data:");
        let at_done = scanned.saturating_sub(11).max(from);
        done += count(&buf[at_done..], b"data: [DONE]");
        scanned = buf.len();
        if a.status == 200 && a.ttft_us.is_none() && events > done {
            a.ttft_us = Some(start.elapsed().as_micros() as u64);
        }
    }
    a.events = events.saturating_sub(done);
    Ok(())
}

async fn attempt(addr: &str, msg: &[u8], run_start: Instant) -> Attempt {
    let start = Instant::now();
    let mut a = Attempt {
        start_us: start.duration_since(run_start).as_micros() as u64,
        ..Attempt::default()
    };
    match tokio::time::timeout(TIMEOUT, exchange(addr, msg, start, &mut a)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => a.error = Some(e.to_string()),
        Err(_) => a.error = Some("timed out".into()),
    }
    a.latency_us = start.elapsed().as_micros() as u64;
    a
}

fn message(r: &Req) -> Vec<u8> {
    let mut m = head(r.body.len(), CLASSES[r.class].0, TENANTS[r.tenant].0);
    m.extend_from_slice(&r.body);
    m
}

/// Sends every request at its time; a shed one with a short enough
/// `Retry-After` once more after it.
async fn open_loop(addr: &str, reqs: &[Req]) -> Vec<Done> {
    let addr: Arc<str> = Arc::from(addr);
    let run_start = Instant::now();
    let mut handles = Vec::with_capacity(reqs.len());
    for r in reqs {
        tokio::time::sleep_until(tokio::time::Instant::from_std(run_start + r.at)).await;
        let (addr, r) = (addr.clone(), r.clone());
        handles.push(tokio::spawn(async move {
            let msg = message(&r);
            let first = attempt(&addr, &msg, run_start).await;
            let retry = match (first.status, first.retry_after_s) {
                (429 | 503 | 529, Some(s)) if s <= RETRY_MAX_WAIT_S => {
                    tokio::time::sleep(Duration::from_secs(u64::from(s))).await;
                    Some(attempt(&addr, &msg, run_start).await)
                }
                _ => None,
            };
            Done {
                class: r.class,
                tenant: r.tenant,
                first,
                retry,
            }
        }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        if let Ok(d) = h.await {
            out.push(d);
        }
    }
    out
}

/// Keeps `concurrency` requests in flight until all were sent.
async fn closed_loop(addr: &str, reqs: &[Req], concurrency: usize) -> Vec<Attempt> {
    let addr: Arc<str> = Arc::from(addr);
    let reqs: Arc<Vec<Req>> = Arc::new(reqs.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let run_start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (addr, reqs, next) = (addr.clone(), reqs.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(r) = reqs.get(i) else { break };
                mine.push((i, attempt(&addr, &message(r), run_start).await));
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        if let Ok(v) = t.await {
            all.extend(v);
        }
    }
    all.sort_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, a)| a).collect()
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

fn ms(sorted_us: &[u64], p: f64) -> Value {
    match percentile(sorted_us, p) {
        Some(us) => json!(us as f64 / 1000.0),
        None => Value::Null,
    }
}

/// Jain's fairness index of `x`: 1 when all are equal, 1/n when one has
/// everything.
fn jain(x: &[f64]) -> Value {
    let sum: f64 = x.iter().sum();
    let sq: f64 = x.iter().map(|v| v * v).sum();
    if sq <= 0.0 {
        return Value::Null;
    }
    json!(sum * sum / (x.len() as f64 * sq))
}

/// The trace's requests: the first `n`, outputs capped, each with a class
/// and a tenant drawn with `seed`, arriving as a Poisson process at
/// `rate` (`None`: all at once, for the closed loops).
fn workload(text: &str, n: usize, rate: Option<f64>, seed: u64) -> Result<Vec<Req>> {
    let mut specs = mooncake(text, MODEL, n, 512).map_err(anyhow::Error::msg)?;
    cap_outputs(&mut specs, MAX_OUTPUT_TOKENS);
    let mut rng = StdRng::seed_from_u64(seed);
    let tenant_total: f64 = TENANTS.iter().map(|t| t.1).sum();
    let mut t = 0.0f64;
    let mut out = Vec::with_capacity(specs.len());
    for s in specs {
        let draw = |rng: &mut StdRng, shares: &[f64]| {
            let total: f64 = shares.iter().sum();
            let mut u = rng.random_range(0.0..total);
            for (i, w) in shares.iter().enumerate() {
                if u < *w {
                    return i;
                }
                u -= w;
            }
            shares.len() - 1
        };
        let class = draw(&mut rng, &CLASSES.map(|c| c.1));
        let tenant = draw(&mut rng, &TENANTS.map(|t| t.1 / tenant_total));
        out.push(Req {
            body: s.body,
            at: Duration::from_secs_f64(t),
            class,
            tenant,
        });
        if let Some(rate) = rate {
            let u: f64 = rng.random_range(1e-9..1.0);
            t += -u.ln() / rate;
        }
    }
    Ok(out)
}

/// Mean prompt tokens of the trace's first `n` requests.
fn mean_isl(text: &str, n: usize) -> f64 {
    let v: Vec<f64> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["input_length"].as_f64())
        .collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn fleet(model_toml: String, plugin: Value) -> StackConfig {
    let mut p = json!({"max_body_bytes": 4 << 20});
    if let (Some(base), Some(extra)) = (p.as_object_mut(), plugin.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    StackConfig {
        workers: WORKERS,
        kv_events: true,
        sim_args: [
            "--num-gpu-blocks",
            &KV_BLOCKS.to_string(),
            "--max-running",
            "16",
            "--prefill-lanes",
            "1",
            "--prefill-us-per-token",
            &PREFILL_US_PER_TOKEN.to_string(),
            "--decode-ms-per-token",
            "5",
        ]
        .map(String::from)
        .to_vec(),
        plugin: p,
        model_toml,
        ..StackConfig::default()
    }
}

/// Every kvgate counter and gauge Envoy's admin lists (histograms aside).
fn counters(stack: &Stack) -> BTreeMap<String, f64> {
    let Ok((200, body)) = http::get(&stack.admin_addr(), "/stats?filter=^wasmcustom\\.kvgate_")
    else {
        return BTreeMap::new();
    };
    String::from_utf8_lossy(&body)
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(": ")?;
            let name = k.trim().strip_prefix("wasmcustom.")?;
            Some((name.to_string(), v.trim().parse::<f64>().ok()?))
        })
        .collect()
}

/// What a run reads from Envoy before and after: counters and the
/// histograms it reports.
struct Reading {
    counters: BTreeMap<String, f64>,
    histograms: BTreeMap<String, Vec<(f64, f64, u64)>>,
}

fn histogram_names() -> Vec<String> {
    let mut v = vec![
        "kvgate_decision_us".to_string(),
        "kvgate_ttft_prediction_error_pct".to_string(),
    ];
    for c in CLASSES {
        v.push(format!(
            "kvgate_admission_wait_ms.model.{MODEL}.class.{}",
            c.0
        ));
    }
    v
}

fn read(stack: &Stack) -> Reading {
    let histograms = histogram_names()
        .into_iter()
        .map(|n| {
            let b = histogram_buckets(stack, &n).unwrap_or_default();
            (n, b)
        })
        .collect();
    Reading {
        counters: counters(stack),
        histograms,
    }
}

impl Reading {
    fn delta(&self, before: &Reading, name: &str) -> f64 {
        self.counters.get(name).copied().unwrap_or(0.0)
            - before.counters.get(name).copied().unwrap_or(0.0)
    }

    fn percentiles(&self, before: &Reading, name: &str) -> Value {
        let empty = Vec::new();
        let b = before.histograms.get(name).unwrap_or(&empty);
        let a = self.histograms.get(name).unwrap_or(&empty);
        percentiles_between(b, a, &[50.0, 90.0, 99.0])
    }
}

/// The figures of one arm at one load.
fn summarize(
    done: &[Done],
    secs: f64,
    targets_ms: &[f64; 3],
    envoy: Option<(&Reading, &Reading)>,
    kvgate: bool,
) -> Value {
    let within = |d: &Done| {
        d.ttft_us()
            .is_some_and(|t| t as f64 <= targets_ms[d.class] * 1000.0)
    };
    let mut classes = serde_json::Map::new();
    for (ci, c) in CLASSES.iter().enumerate() {
        let mine: Vec<&Done> = done.iter().filter(|d| d.class == ci).collect();
        let ok = mine.iter().filter(|d| d.ttft_us().is_some()).count();
        let good = mine.iter().filter(|d| within(d)).count();
        let ttft = sorted(mine.iter().filter_map(|d| d.ttft_us()).collect());
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        for d in &mine {
            let l = d.last();
            if l.status != 200 {
                let r = match (&l.reason, l.status) {
                    (Some(r), _) => r.clone(),
                    (None, 0) => "no_answer".into(),
                    (None, s) => format!("status_{s}"),
                };
                *reasons.entry(r).or_default() += 1;
            }
        }
        classes.insert(
            c.0.into(),
            json!({
                "sent": mine.len(),
                "ok": ok,
                "within_slo": good,
                "attainment": good as f64 / mine.len().max(1) as f64,
                "goodput_rps": good as f64 / secs,
                "retried": mine.iter().filter(|d| d.retry.is_some()).count(),
                "ttft_ms": {"p50": ms(&ttft, 50.0), "p90": ms(&ttft, 90.0), "p99": ms(&ttft, 99.0)},
                "failed_by_reason": reasons,
            }),
        );
    }
    let mut failed_by_reason: BTreeMap<String, u64> = BTreeMap::new();
    for c in classes.values() {
        for (r, k) in c["failed_by_reason"].as_object().into_iter().flatten() {
            *failed_by_reason.entry(r.clone()).or_default() += k.as_u64().unwrap_or(0);
        }
    }
    let mut tenants = serde_json::Map::new();
    let (mut goodput_per_weight, mut attainment) = (Vec::new(), Vec::new());
    for (ti, t) in TENANTS.iter().enumerate() {
        let mine: Vec<&Done> = done.iter().filter(|d| d.tenant == ti).collect();
        let good = mine.iter().filter(|d| within(d)).count();
        let weight = 1.0;
        goodput_per_weight.push(good as f64 / secs / weight);
        let att = good as f64 / mine.len().max(1) as f64;
        attainment.push(att);
        tenants.insert(
            t.0.into(),
            json!({"sent": mine.len(), "within_slo": good, "weight": weight,
                   "goodput_rps": good as f64 / secs, "attainment": att}),
        );
    }
    let good = done.iter().filter(|d| within(d)).count();
    let ok = done.iter().filter(|d| d.ttft_us().is_some()).count();
    // The predicted TTFT against the TTFT of the attempt that carried it
    // (its own send to its first token, a hold included).
    let errors: Vec<f64> = done
        .iter()
        .filter_map(|d| {
            let l = d.last();
            let p = l.predicted_ms?;
            let t = l.ttft_us? as f64 / 1000.0;
            (l.status == 200 && t > 0.0).then(|| (p - t).abs() / t)
        })
        .collect();
    let attempts: usize = done
        .iter()
        .map(|d| 1 + usize::from(d.retry.is_some()))
        .sum();
    let mut v = json!({
        "sent": done.len(),
        "attempts": attempts,
        "ok": ok,
        "within_slo": good,
        "attainment": good as f64 / done.len().max(1) as f64,
        "goodput_rps": good as f64 / secs,
        "failed": done.len() - ok,
        "failed_by_reason": failed_by_reason,
        "retried": done.iter().filter(|d| d.retry.is_some()).count(),
        "retried_ok": done.iter().filter(|d| d.retry.as_ref().is_some_and(|r| r.status == 200)).count(),
        "classes": classes,
        "tenants": tenants,
        "jain_goodput_per_weight": jain(&goodput_per_weight),
        "jain_attainment": jain(&attainment),
        "prediction": {
            "with_header": errors.len(),
            "share_with_header": errors.len() as f64 / ok.max(1) as f64,
            "mape_pct": if errors.is_empty() { Value::Null } else {
                json!(100.0 * errors.iter().sum::<f64>() / errors.len() as f64)
            },
        },
    });
    if let (true, Some((before, after))) = (kvgate, envoy) {
        v["decision_us"] = after.percentiles(before, "kvgate_decision_us");
        v["filter_prediction_error_pct"] =
            after.percentiles(before, "kvgate_ttft_prediction_error_pct");
        v["predictions_total"] = json!(after.delta(before, "kvgate_ttft_predictions_total"));
        v["retry_admitted_total"] = json!(after.delta(before, "kvgate_retry_admitted_total"));
        let mut rejected = serde_json::Map::new();
        for k in after.counters.keys() {
            if let Some(reason) = k
                .strip_prefix("kvgate_rejected_")
                .and_then(|r| r.strip_suffix("_total"))
            {
                let d = after.delta(before, k);
                if d > 0.0 {
                    rejected.insert(reason.to_string(), json!(d));
                }
            }
        }
        v["rejected"] = Value::Object(rejected);
        let mut adm = serde_json::Map::new();
        for (ci, c) in CLASSES.iter().enumerate() {
            let attempts: usize = done
                .iter()
                .filter(|d| d.class == ci)
                .map(|d| 1 + usize::from(d.retry.is_some()))
                .sum();
            let mut m = serde_json::Map::new();
            m.insert("attempts".into(), json!(attempts));
            for what in ["held", "sent", "expired", "shed", "do_not_queue"] {
                let name = format!("kvgate_admission_{what}_total.model.{MODEL}.class.{}", c.0);
                let n = after.delta(before, &name);
                m.insert(what.into(), json!(n));
                m.insert(format!("{what}_share"), json!(n / attempts.max(1) as f64));
            }
            m.insert(
                "wait_ms".into(),
                after.percentiles(
                    before,
                    &format!("kvgate_admission_wait_ms.model.{MODEL}.class.{}", c.0),
                ),
            );
            adm.insert(c.0.into(), Value::Object(m));
        }
        v["admission"] = Value::Object(adm);
    }
    v
}

/// Sets the model's busy threshold through Envoy's control listener
/// (`None` unsets it).
fn set_threshold(stack: &Stack, tokens: Option<u64>) -> Result<()> {
    stack.set_thresholds(&json!({"model": MODEL, "active_prefill_tokens_threshold": tokens}))?;
    // One poll answer later the filter has it.
    std::thread::sleep(Duration::from_millis(500));
    Ok(())
}

/// The trace's first requests one at a time, every cache empty first.
fn one_at_a_time(
    rt: &tokio::runtime::Runtime,
    stack: &Stack,
    reqs: &[Req],
) -> Result<Vec<Attempt>> {
    reset(stack)?;
    let a = rt.block_on(closed_loop(&stack.envoy_addr(), reqs, 1));
    let ok = a
        .iter()
        .filter(|a| a.status == 200 && a.ttft_us.is_some())
        .count();
    anyhow::ensure!(
        ok * 2 >= a.len(),
        "unloaded: only {ok} of {} requests streamed",
        a.len()
    );
    Ok(a)
}

/// The unloaded figures of [`one_at_a_time`]'s attempts; with the TTFT
/// targets, the share of each class's target they met (the most a loaded
/// run can reach).
fn unloaded(a: &[Attempt], targets_ms: Option<&[f64; 3]>) -> Value {
    let ok: Vec<&Attempt> = a
        .iter()
        .filter(|a| a.status == 200 && a.ttft_us.is_some())
        .collect();
    let ttft = sorted(ok.iter().filter_map(|a| a.ttft_us).collect());
    let gaps = sorted(
        ok.iter()
            .filter(|a| a.events > 1)
            .map(|a| (a.latency_us - a.ttft_us.unwrap_or(0)) / u64::from(a.events - 1))
            .collect(),
    );
    let errors: Vec<f64> = ok
        .iter()
        .filter_map(|a| {
            let t = a.ttft_us? as f64 / 1000.0;
            Some((a.predicted_ms? - t).abs() / t)
        })
        .collect();
    let mut v = json!({
        "requests": a.len(),
        "ok": ok.len(),
        "ttft_ms": {"p50": ms(&ttft, 50.0), "p90": ms(&ttft, 90.0)},
        "itl_ms_p50": ms(&gaps, 50.0),
        "with_prediction": errors.len(),
        "prediction_mape_pct": if errors.is_empty() { Value::Null } else {
            json!(100.0 * errors.iter().sum::<f64>() / errors.len() as f64)
        },
    });
    if let Some(t) = targets_ms {
        let mut within = serde_json::Map::new();
        for (i, c) in CLASSES.iter().enumerate() {
            let n = ttft
                .iter()
                .filter(|&&us| us as f64 <= t[i] * 1000.0)
                .count();
            within.insert(c.0.into(), json!(n as f64 / a.len().max(1) as f64));
        }
        v["within_target"] = Value::Object(within);
    }
    v
}

/// The same requests one at a time, and the filter's decision time over
/// them; `teach`: after a first pass that teaches the sidecar's fits.
fn unloaded_pass(
    rt: &tokio::runtime::Runtime,
    stack: &Stack,
    reqs: &[Req],
    teach: bool,
) -> Result<(Vec<Attempt>, Value)> {
    if teach {
        one_at_a_time(rt, stack, reqs)?;
        // Its decisions reach the histogram at the next flush.
        std::thread::sleep(FLUSH);
    }
    let before = read(stack);
    let a = one_at_a_time(rt, stack, reqs)?;
    std::thread::sleep(FLUSH);
    let after = read(stack);
    let mut v = unloaded(&a, None);
    v["decision_us"] = after.percentiles(&before, "kvgate_decision_us");
    Ok((a, v))
}

/// Completions per second of a closed loop that keeps every worker's
/// queue full, between its first and last `concurrency` completions.
fn capacity(
    rt: &tokio::runtime::Runtime,
    stack: &Stack,
    reqs: &[Req],
    concurrency: usize,
) -> Result<Value> {
    reset(stack)?;
    let t = Instant::now();
    let a = rt.block_on(closed_loop(&stack.envoy_addr(), reqs, concurrency));
    let wall = t.elapsed().as_secs_f64();
    let ends: Vec<u64> = a
        .iter()
        .filter(|o| o.status == 200)
        .map(|o| o.start_us + o.latency_us)
        .collect();
    crate::stats::steady_capacity(ends, a.len(), concurrency, wall)
}

/// `None` while Envoy answers; else what its log says of its end.
fn envoy_gone(stack: &Stack) -> Option<String> {
    if http::get(&stack.admin_addr(), "/ready").is_ok() {
        return None;
    }
    let log = std::fs::read_to_string(stack.run_dir.join("envoy.log")).unwrap_or_default();
    Some(
        log.lines()
            .find_map(|l| l.find("Caught ").map(|at| l[at..].to_string()))
            .unwrap_or_else(|| "Envoy stopped answering".into()),
    )
}

/// What an arm runs on: its stack, and how to start another like it.
struct Fleet<'a> {
    stack: Stack,
    restart: &'a dyn Fn() -> Result<Stack>,
    /// Where its requests go: the kvgate listener, or the plain one.
    plain: bool,
}

impl Fleet<'_> {
    fn addr(&self) -> String {
        if self.plain {
            self.stack
                .plain_url()
                .trim_start_matches("http://")
                .to_string()
        } else {
            self.stack.envoy_addr()
        }
    }
}

/// One arm at the loads `loads` (indices into `workloads`). An Envoy that
/// died in a run is noted in it, and the arm goes on on a fresh stack.
#[allow(clippy::too_many_arguments)]
fn run_arm(
    rt: &tokio::runtime::Runtime,
    fleet: &mut Fleet<'_>,
    arm: &str,
    workloads: &[(f64, f64, Vec<Req>)],
    loads: &[usize],
    secs: f64,
    targets_ms: &[f64; 3],
    out: &mut [serde_json::Map<String, Value>],
) -> Result<()> {
    let kvgate = arm != "least_request";
    for &i in loads {
        let (load, rate, reqs) = &workloads[i];
        reset(&fleet.stack)?;
        let before = read(&fleet.stack);
        eprintln!(
            "xtask: bench admission: {arm} at {load}× capacity ({rate:.1} req/s, {} requests)",
            reqs.len()
        );
        let t = Instant::now();
        let done = rt.block_on(open_loop(&fleet.addr(), reqs));
        let wall = t.elapsed();
        let gone = envoy_gone(&fleet.stack);
        let mut v = match &gone {
            None => {
                reset(&fleet.stack)?;
                std::thread::sleep(FLUSH.saturating_sub(t.elapsed().saturating_sub(wall)));
                let after = read(&fleet.stack);
                summarize(&done, secs, targets_ms, Some((&before, &after)), kvgate)
            }
            Some(why) => {
                eprintln!(
                    "xtask: bench admission: Envoy died in {arm} at {load}×: {why}; a fresh stack for the rest"
                );
                let mut v = summarize(&done, secs, targets_ms, None, kvgate);
                v["envoy_crash"] = json!(why);
                fleet.stack = (fleet.restart)()?;
                v
            }
        };
        v["wall_s"] = json!(wall.as_secs_f64());
        out[i].insert(arm.into(), v);
    }
    Ok(())
}

fn admission_plugin(targets_ms: Option<&[f64; 3]>) -> Value {
    let classes: Vec<Value> = CLASSES
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({"name": c.0, "priority": c.2, "reserve": c.3, "hold_ms": c.4});
            // Sheddable keeps the model's target.
            if let (Some(t), true) = (targets_ms, i < 2) {
                v["ttft_ms"] = json!(t[i].round() as u64);
            }
            v
        })
        .collect();
    json!({
        "predicted_ttft_header": PREDICTED_HEADER,
        "admission": {
            "class_header": CLASS_HEADER,
            "account_header": ACCOUNT_HEADER,
            "default_class": "standard",
            "classes": classes,
            "reserve_pct": RESERVE_PCT,
        },
    })
}

pub fn run(quick: bool) -> Result<Value> {
    let started = Instant::now();
    let (path, text) = mooncake_text();
    let Some(text) = text else {
        eprintln!(
            "xtask: bench admission: no Mooncake trace at {} (set KVGATE_MOONCAKE_TRACE); skipped",
            path.display()
        );
        return Ok(json!({"name": "admission", "skipped": "no Mooncake trace"}));
    };
    let secs = if quick { 10.0 } else { 40.0 };
    let (unloaded_n, capacity_n) = if quick { (16, 80) } else { (40, 240) };
    let concurrency = WORKERS * 4;
    // The no-target admission arm only at the middle load in a quick run.
    let no_slo_loads: Vec<usize> = if quick {
        vec![1]
    } else {
        (0..LOADS.len()).collect()
    };
    let all: Vec<usize> = (0..LOADS.len()).collect();
    let rt = tokio::runtime::Runtime::new()?;
    let paths = build::release_paths()?;
    let first = workload(&text, unloaded_n.max(capacity_n), None, 1)?;
    let first_few = &first[..unloaded_n];

    // Today's fleet: no thresholds while capacity and the unloaded TTFT
    // are measured, and for least-request (which never asks kvgate).
    let start_a = || Stack::start_with(paths.clone(), fleet(String::new(), json!({})));
    let a = start_a()?;
    eprintln!("xtask: bench admission: unloaded TTFT ({unloaded_n} requests one at a time)");
    let (idle_attempts, decisions_today) = unloaded_pass(&rt, &a, first_few, false)?;
    let p50 = unloaded(&idle_attempts, None)["ttft_ms"]["p50"]
        .as_f64()
        .context("no unloaded TTFT")?;
    let itl = unloaded(&idle_attempts, None)["itl_ms_p50"]
        .as_f64()
        .unwrap_or(0.0);
    let targets_ms = TARGET_X.map(|x| (x * p50).ceil());
    let itl_target_ms = (ITL_X * itl).ceil().max(1.0);
    let idle = unloaded(&idle_attempts, Some(&targets_ms));
    eprintln!("xtask: bench admission: capacity ({capacity_n} requests, {concurrency} in flight)");
    let cap = capacity(&rt, &a, &first[..capacity_n], concurrency)?;
    let cap_rps = cap["rps"].as_f64().unwrap_or(0.0);
    anyhow::ensure!(cap_rps > 0.0, "no capacity measured");
    let mut workloads = Vec::new();
    let mut most = 0;
    for (i, load) in LOADS.iter().enumerate() {
        let rate = load * cap_rps;
        let n = (rate * secs).ceil() as usize;
        most = most.max(n);
        workloads.push((*load, rate, workload(&text, n, Some(rate), 100 + i as u64)?));
    }
    let threshold = ((THRESHOLD_X_MEAN_ISL * mean_isl(&text, most)) / 1000.0).round() as u64 * 1000;
    let mut by_load: Vec<serde_json::Map<String, Value>> =
        LOADS.iter().map(|_| serde_json::Map::new()).collect();
    let mut fa = Fleet {
        stack: a,
        restart: &start_a,
        plain: true,
    };
    run_arm(
        &rt,
        &mut fa,
        "least_request",
        &workloads,
        &all,
        secs,
        &targets_ms,
        &mut by_load,
    )?;
    let start_today = || -> Result<Stack> {
        let s = start_a()?;
        set_threshold(&s, Some(threshold))?;
        Ok(s)
    };
    set_threshold(&fa.stack, Some(threshold))?;
    let mut fa = Fleet {
        stack: fa.stack,
        restart: &start_today,
        plain: false,
    };
    run_arm(
        &rt,
        &mut fa,
        "today",
        &workloads,
        &all,
        secs,
        &targets_ms,
        &mut by_load,
    )?;
    drop(fa);

    let threshold_toml = format!("active_prefill_tokens_threshold = {threshold}\n");
    let slo_toml = format!(
        "[models.slo]\nttft_ms = {}\nitl_ms = {}\n",
        targets_ms[1].round() as u64,
        itl_target_ms as u64
    );
    // Admission with the latency targets; without the predicted-TTFT
    // header and `[models.slo]` where this build knows neither.
    let with_slo = || {
        Stack::start_with(
            paths.clone(),
            fleet(
                format!("{threshold_toml}{slo_toml}"),
                admission_plugin(Some(&targets_ms)),
            ),
        )
    };
    let without_slo = || {
        let mut p = admission_plugin(None);
        if let Some(o) = p.as_object_mut() {
            o.remove("predicted_ttft_header");
        }
        Stack::start_with(paths.clone(), fleet(threshold_toml.clone(), p))
    };
    let (b, slo_measured) = match with_slo() {
        Ok(s) => (s, true),
        Err(e) => {
            eprintln!(
                "xtask: bench admission: the stack with latency targets did not start ({e:#}); admission without them"
            );
            (without_slo()?, false)
        }
    };
    // A fresh stack's fits learn from a first pass.
    let start_b = || -> Result<Stack> {
        let s = if slo_measured {
            with_slo()?
        } else {
            without_slo()?
        };
        one_at_a_time(&rt, &s, first_few)?;
        Ok(s)
    };
    eprintln!("xtask: bench admission: the admission fleet, unloaded");
    let (_, decisions_admission) = unloaded_pass(&rt, &b, first_few, true)?;
    let mut fb = Fleet {
        stack: b,
        restart: &start_b,
        plain: false,
    };
    run_arm(
        &rt,
        &mut fb,
        "admission",
        &workloads,
        &all,
        secs,
        &targets_ms,
        &mut by_load,
    )?;
    drop(fb);

    let start_c = || {
        Stack::start_with(
            paths.clone(),
            fleet(threshold_toml.clone(), admission_plugin(None)),
        )
    };
    let c = start_c()?;
    eprintln!("xtask: bench admission: the admission fleet without targets, unloaded");
    let (_, decisions_no_slo) = unloaded_pass(&rt, &c, first_few, false)?;
    let mut fc = Fleet {
        stack: c,
        restart: &start_c,
        plain: false,
    };
    run_arm(
        &rt,
        &mut fc,
        "admission_no_slo",
        &workloads,
        &no_slo_loads,
        secs,
        &targets_ms,
        &mut by_load,
    )?;
    drop(fc);

    let loads: Vec<Value> = workloads
        .iter()
        .zip(by_load)
        .map(|((load, rate, reqs), arms)| {
            json!({"load": load, "rate_per_s": rate, "requests": reqs.len(), "arms": arms})
        })
        .collect();
    Ok(json!({
        "name": "admission",
        "workers": WORKERS,
        "worker_model": format!(
            "kvgate-sim: {KV_BLOCKS} KV blocks of 16 tokens, 16 running, one prefill at a time at {PREFILL_US_PER_TOKEN} µs a prompt token, decode 5 ms a token"
        ),
        "trace": "Mooncake conversation trace, first requests in order, token prompts (512-token hash blocks), outputs capped",
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "window_s": secs,
        "classes": CLASSES.iter().enumerate().map(|(i, c)| json!({
            "name": c.0, "share": c.1, "priority": c.2, "reserve": c.3, "hold_ms": c.4,
            "target_x_unloaded_p50": c.5, "ttft_target_ms": targets_ms[i],
        })).collect::<Vec<_>>(),
        "tenants": TENANTS.iter().map(|t| json!({
            "name": t.0, "demand_share": t.1 / TENANTS.iter().map(|t| t.1).sum::<f64>(), "weight": 1.0,
        })).collect::<Vec<_>>(),
        "reserve_pct": RESERVE_PCT,
        "threshold_active_prefill_tokens": threshold,
        "threshold_x_mean_isl": THRESHOLD_X_MEAN_ISL,
        "itl_target_ms": itl_target_ms,
        "slo_measured": slo_measured,
        "retry_max_wait_s": RETRY_MAX_WAIT_S,
        "unloaded": idle,
        "unloaded_decisions": {
            "today": decisions_today,
            "admission": decisions_admission,
            "admission_no_slo": decisions_no_slo,
        },
        "capacity": cap,
        "loads": loads,
        "arms": ARMS,
        "wall_s": started.elapsed().as_secs_f64(),
    }))
}

fn arm_label(arm: &str) -> &'static str {
    match arm {
        "least_request" => "least request (no kvgate)",
        "today" => "kvgate today: 503 + retry queue",
        "admission" => "kvgate admission, latency targets",
        "admission_no_slo" => "kvgate admission, no targets",
        _ => "?",
    }
}

/// A histogram's median and 90th percentile, as "p50 / p90 unit"; `None`
/// where it holds no sample.
fn p50_p90(v: &Value, key: &str, unit: &str) -> Option<String> {
    (at(v, &[key, "count"]).unwrap_or(0.0) > 0.0).then(|| {
        format!(
            "{} / {} {unit}",
            f(at(v, &[key, "P50"]), 0),
            f(at(v, &[key, "P90"]), 0)
        )
    })
}

pub fn report(v: &Value) -> String {
    let mut md = String::from("\n## Admission inside Envoy: holding by class and deadline\n\n");
    if let Some(why) = v["skipped"].as_str() {
        md.push_str(&format!("Not measured: {why}.\n"));
        return md;
    }
    let n = |path: &[&str], d: usize| f(at(v, path), d);
    let class_name = |i: usize| v["classes"][i]["name"].as_str().unwrap_or("?").to_string();
    let classes: Vec<usize> = (0..v["classes"].as_array().map_or(0, Vec::len)).collect();
    let targets: Vec<String> = classes
        .iter()
        .map(|&i| {
            let c = &v["classes"][i];
            format!(
                "{} {} ms ({}× the unloaded p50, met by {} of the unloaded requests; {} of the requests, {}{})",
                class_name(i),
                f(c["ttft_target_ms"].as_f64(), 0),
                f(c["target_x_unloaded_p50"].as_f64(), 0),
                pct(v["unloaded"]["within_target"][class_name(i)].as_f64(), 0),
                pct(c["share"].as_f64(), 0),
                match c["hold_ms"].as_f64() {
                    Some(h) if h > 0.0 => format!("held up to {} ms", f(Some(h), 0)),
                    _ => "never held".into(),
                },
                if c["reserve"].as_bool() == Some(true) {
                    ", may use the reserve"
                } else {
                    ""
                },
            )
        })
        .collect();
    let tenants: Vec<String> = v["tenants"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            format!(
                "{} {}",
                t["name"].as_str().unwrap_or("?"),
                pct(t["demand_share"].as_f64(), 0)
            )
        })
        .collect();
    md.push_str(&format!(
        "`cargo xtask bench --only admission`: {} simulated workers ({}); {}. \
Unloaded, one request at a time, the fleet's TTFT is {} ms at p50 ({} requests); its capacity, the completion rate of a closed loop of {} requests keeping every worker's prefill queue full through kvgate, is {} req/s. \
Each load sends Poisson arrivals at a multiple of that capacity for {} s; every arm gets the same requests at the same times. \
Classes and their TTFT targets: {}. Tenants (sharing the fleet, named in admission's account header, equal weights): {}. \
Busy threshold for kvgate's arms: {} prompt tokens booked on a rank ({}× the mean prompt); admission keeps the last {} % of it for the reserve. \
Clients in every arm retry a shed request once after its `Retry-After` when that is at most {} s, and its TTFT counts from the first send. \
Attainment is the share of a class's requests whose first token came within its target; goodput is those requests per second of the window; Jain's index is over the tenants' goodput per weight (1 when equal; the heavy tenant asks for four times each other's) and over their attainment.\n",
        n(&["workers"], 0),
        v["worker_model"].as_str().unwrap_or(""),
        v["trace"].as_str().unwrap_or(""),
        n(&["unloaded", "ttft_ms", "p50"], 0),
        n(&["unloaded", "requests"], 0),
        n(&["capacity", "requests"], 0),
        n(&["capacity", "rps"], 1),
        n(&["window_s"], 0),
        targets.join("; "),
        tenants.join(", "),
        n(&["threshold_active_prefill_tokens"], 0),
        n(&["threshold_x_mean_isl"], 1),
        n(&["reserve_pct"], 0),
        n(&["retry_max_wait_s"], 0),
    ));
    if v["slo_measured"].as_bool() == Some(false) {
        md.push_str("\nThe filter or sidecar of this run knew no latency targets (`predicted_ttft_header`, `[models.slo]`): the admission arm ran without them, and the prediction is not measured.\n");
    }
    let d = |arm: &str, p: &str| f(at(v, &["unloaded_decisions", arm, "decision_us", p]), 0);
    let b = &v["unloaded_decisions"]["admission"];
    md.push_str(&format!(
        "\nThe filter's decision time (Envoy's `kvgate_decision_us`, p50 / p99) over the same {} requests one at a time (with targets after a first pass that teaches the fits): today's kvgate {} / {} µs, admission without targets {} / {} µs, admission with targets (its fits predicting each rank's TTFT) {} / {} µs. In that pass the predicted-TTFT header came with {} of {} answers, {} off the measured TTFT on average (MAPE).\n",
        n(&["unloaded_decisions", "admission", "requests"], 0),
        d("today", "P50"),
        d("today", "P99"),
        d("admission_no_slo", "P50"),
        d("admission_no_slo", "P99"),
        d("admission", "P50"),
        d("admission", "P99"),
        f(b["with_prediction"].as_f64(), 0),
        f(b["ok"].as_f64(), 0),
        if b["with_prediction"].as_f64().unwrap_or(0.0) > 0.0 {
            pct(b["prediction_mape_pct"].as_f64().map(|x| x / 100.0), 1)
        } else {
            "not measured".into()
        },
    ));
    let loads = v["loads"].as_array().cloned().unwrap_or_default();
    let arms: Vec<String> = v["arms"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(String::from))
        .collect();
    let cls: Vec<String> = classes.iter().map(|&i| class_name(i)).collect();
    // Headline: critical attainment at each load, per arm.
    let mut head = Vec::new();
    for l in &loads {
        let parts: Vec<String> = arms
            .iter()
            .filter(|a| l["arms"][a.as_str()].is_object())
            .map(|a| {
                format!(
                    "{} {}",
                    a.replace('_', " "),
                    pct(
                        at(&l["arms"][a.as_str()], &["classes", &cls[0], "attainment"]),
                        0
                    )
                )
            })
            .collect();
        head.push(format!(
            "at {}× ({} req/s) {}",
            f(l["load"].as_f64(), 1),
            f(l["rate_per_s"].as_f64(), 1),
            parts.join(", ")
        ));
    }
    if !cls.is_empty() {
        md.push_str(&format!(
            "\nThe {} requests within their target: {}.\n",
            cls[0],
            head.join("; ")
        ));
    }
    md.push_str(&format!(
        "\n| load | arm | attainment {} | goodput | Jain: goodput / attainment | failed (after a retry) | retried |\n| --- | --- | --- | --- | --- | --- | --- |\n",
        cls.join(" / ")
    ));
    for l in &loads {
        for a in &arms {
            let r = &l["arms"][a.as_str()];
            if !r.is_object() {
                continue;
            }
            let att: Vec<String> = cls
                .iter()
                .map(|c| pct(at(r, &["classes", c, "attainment"]), 0))
                .collect();
            let sent = at(r, &["sent"]).unwrap_or(0.0).max(1.0);
            let why: Vec<String> = r["failed_by_reason"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, n)| format!("{k} {n}"))
                .collect();
            let why = if why.is_empty() {
                String::new()
            } else {
                format!(" ({})", why.join(", "))
            };
            md.push_str(&format!(
                "| {}× | {} | {} | {} req/s | {} / {} | {}{why} | {} |\n",
                f(l["load"].as_f64(), 1),
                arm_label(a),
                att.join(" / "),
                f(at(r, &["goodput_rps"]), 1),
                f(at(r, &["jain_goodput_per_weight"]), 2),
                f(at(r, &["jain_attainment"]), 2),
                pct(at(r, &["failed"]).map(|x| x / sent), 1),
                pct(at(r, &["retried"]).map(|x| x / sent), 1),
            ));
        }
    }
    md.push_str(&format!(
        "\nTime to first token of the requests that got one (from the first send), p50 / p90:\n\n| load | arm | {} |\n| --- | --- |{}\n",
        cls.join(" | "),
        " --- |".repeat(cls.len())
    ));
    for l in &loads {
        for a in &arms {
            let r = &l["arms"][a.as_str()];
            if !r.is_object() {
                continue;
            }
            let cells: Vec<String> = cls
                .iter()
                .map(|c| {
                    format!(
                        "{} / {} ms",
                        f(at(r, &["classes", c, "ttft_ms", "p50"]), 0),
                        f(at(r, &["classes", c, "ttft_ms", "p90"]), 0)
                    )
                })
                .collect();
            md.push_str(&format!(
                "| {}× | {} | {} |\n",
                f(l["load"].as_f64(), 1),
                arm_label(a),
                cells.join(" | ")
            ));
        }
    }
    md.push_str(
        "\nWhat admission did, from Envoy's counters (`kvgate_admission_{held,sent,expired,shed}_total` by class, as a share of the class's sends, retries included) and its hold histogram (`kvgate_admission_wait_ms`, p50 / p90 of every hold, whatever became of it):\n\n| load | arm | class | held | sent after a hold | expired | shed at once | hold p50 / p90 |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for l in &loads {
        for a in arms.iter().filter(|a| a.starts_with("admission")) {
            let r = &l["arms"][a.as_str()];
            if !r.is_object() {
                continue;
            }
            for c in &cls {
                let m = &r["admission"][c.as_str()];
                let wait = p50_p90(m, "wait_ms", "ms").unwrap_or_else(|| "—".into());
                md.push_str(&format!(
                    "| {}× | {} | {c} | {} | {} | {} | {} | {wait} |\n",
                    f(l["load"].as_f64(), 1),
                    arm_label(a),
                    pct(at(m, &["held_share"]), 1),
                    pct(at(m, &["sent_share"]), 1),
                    pct(at(m, &["expired_share"]), 1),
                    pct(at(m, &["shed_share"]), 1),
                ));
            }
        }
    }
    md.push_str(
        "\nThe filter's decision (Envoy's `kvgate_decision_us`, every decision of the run, a held request's again at each look), and the predicted TTFT: the response header against the TTFT the client measured for that send (mean absolute percentage error, a hold included), and the filter's own error (`kvgate_ttft_prediction_error_pct`: from its send to the worker's first byte, no hold):\n\n| load | arm | decisions (per send) | decision p50 / p90 / p99 | requests with a prediction | header MAPE | filter's error p50 / p90 |\n| --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for l in &loads {
        for a in arms.iter().filter(|a| *a != "least_request") {
            let r = &l["arms"][a.as_str()];
            if !r.is_object() {
                continue;
            }
            let predicted = at(r, &["prediction", "with_header"]).unwrap_or(0.0) > 0.0;
            let mape = if predicted {
                pct(at(r, &["prediction", "mape_pct"]).map(|x| x / 100.0), 0)
            } else {
                "not measured".into()
            };
            let own = p50_p90(r, "filter_prediction_error_pct", "%")
                .unwrap_or_else(|| "not measured".into());
            md.push_str(&format!(
                "| {}× | {} | {} ({}) | {} / {} / {} µs | {} | {mape} | {own} |\n",
                f(l["load"].as_f64(), 1),
                arm_label(a),
                f(at(r, &["decision_us", "count"]), 0),
                f(
                    at(r, &["decision_us", "count"])
                        .map(|x| x / at(r, &["attempts"]).unwrap_or(0.0).max(1.0)),
                    1
                ),
                f(at(r, &["decision_us", "P50"]), 0),
                f(at(r, &["decision_us", "P90"]), 0),
                f(at(r, &["decision_us", "P99"]), 0),
                pct(at(r, &["prediction", "share_with_header"]), 0),
            ));
        }
    }
    // What the tables show where admission starves its held classes.
    let mut notes = Vec::new();
    if cls.len() == 3 {
        for l in &loads {
            let r = &l["arms"]["admission"];
            let expired = at(r, &["admission", &cls[1], "expired_share"]);
            let (std_att, shed_att) = (
                at(r, &["classes", &cls[1], "attainment"]),
                at(r, &["classes", &cls[2], "attainment"]),
            );
            if let (Some(e), Some(a1), Some(a2)) = (expired, std_att, shed_att)
                && e > 0.3
                && a2 > a1
            {
                notes.push(format!(
                    "at {}× {} of the {} sends expired after their hold while {} requests, never held, met their target {} of the time",
                    f(l["load"].as_f64(), 1),
                    pct(Some(e), 0),
                    cls[1],
                    cls[2],
                    pct(Some(a2), 0),
                ));
            }
        }
    }
    if !notes.is_empty() {
        md.push_str(&format!(
            "\nWith targets, {}. Held requests leave the queue in order, and each tick stops at a model's first request that still finds no rank; with targets a rank must also be predicted to meet the request's TTFT target, which a long prompt misses on an idle rank too ({} of the unloaded requests missed the {} target), so such a request holds every request behind it until its own hold runs out. A class that is never held skips the queue and is decided at once, so it takes the room that frees up before the tick offers it to the held ones.\n",
            notes.join("; "),
            pct(
                v["unloaded"]["within_target"][cls[0].as_str()]
                    .as_f64()
                    .map(|x| 1.0 - x),
                0
            ),
            cls[0],
        ));
    }
    let crashes: Vec<String> = loads
        .iter()
        .flat_map(|l| {
            arms.iter().filter_map(move |a| {
                l["arms"][a.as_str()]["envoy_crash"]
                    .as_str()
                    .map(|why| format!("{} at {}× ({why})", arm_label(a), f(l["load"].as_f64(), 1)))
            })
        })
        .collect();
    if !crashes.is_empty() {
        md.push_str(&format!(
            "\nEnvoy died during: {}. Those runs' requests after the crash count as failed, their Envoy figures are lost, and the arm went on with a fresh stack (its fits taught again).\n",
            crashes.join("; ")
        ));
    }
    md
}
