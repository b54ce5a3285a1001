//! `cargo xtask bench [--quick]`: benchmarks, each against a baseline
//! measured in the same run, written to `bench/results/<name>.json` with
//! the run that measured them (`measured`: date, commit, quick, baseline
//! build). `bench/report.md`, its Summary, and the figures the README and
//! architecture.md quote are rendered from those files alone
//! ([`crate::figures`]) after every run; `--report` renders them without
//! running anything. Benchmarks never fail on speed.
//!
//! * `overhead`: the same requests through four routes of one Envoy (same
//!   upstream workers in instant mode), alternating, closed loop: the plain
//!   listener, Envoy's least-request balancing, the kvgate filter, and
//!   kvgate's decision through `ext_proc` (`kvgate-extproc`, the peers'
//!   architecture); CPU per request per process, and the filter's own
//!   decision-time histogram from Envoy.
//! * `kv` ([`crate::kvbench`]): KV-aware routing through Envoy over a
//!   1.6M-block index: selection and whole-decision time on 2k-token
//!   prompts (with `--baseline`, both builds in turns, [`crate::turns`]),
//!   freshness, memory, and the selection API. `--only kv`.
//! * `ingest`: KV events decoded, hashed and indexed on one thread, against
//!   a generic msgpack decode of the same bytes.
//! * `dump`: the size of a 1.6M-block index's `GET /dump` and the cost of
//!   recovering from it (the index thread's copy, encoding, decoding,
//!   replay; and between two sidecars over HTTP). `--only dump` runs just
//!   that one.
//! * `shedding` ([`crate::shedbench`]): the busy 503's latency against a
//!   pass-through route, and admitted TTFT at 2× overload with shedding off
//!   and on. `--only shedding` runs just that one.
//! * `thermal` ([`crate::thermalbench`]): a thermal soak, one worker's
//!   cooling degraded mid-run, with kvgate's thermal control and without.
//!   `--only thermal` runs just that one.
//! * `planner` ([`crate::plannerbench`]): the planner in a closed loop
//!   (this harness as the orchestrator) against static fleets, and its
//!   predictors' error on the Mooncake trace. `--only planner`.
//! * `quality` ([`crate::quality`]): routing quality of five policies on 8
//!   simulated workers, two workloads, several rates; plots in
//!   `bench/plots/`. `--only quality` runs just that one.
//! * `text` ([`crate::textbench`]): chat and text prompts through the text
//!   index against the routed-prefix index and token prompts, hit rates
//!   next to the offline reference; decision cost and memory. `--only text`.
//! * `disagg` ([`crate::disaggbench`]): aggregated serving against 2P+2D
//!   and 1P+3D disaggregated fleets on the same four simulated GPUs (TTFT,
//!   ITL, goodput, the conditional rule's local share, the decision's
//!   cost), and decode affinity on and off. `--only disagg`.
//! * `admission` ([`crate::admissionbench`]): admission's holding by class
//!   and deadline against today's 503 with its retry queue and against
//!   Envoy's least-request balancing, on the Mooncake trace at 1–2× the
//!   fleet's measured capacity. `--only admission`.
//! * `pull` ([`crate::pullbench`]): kvgate pulling a prompt's KV from its
//!   loaded holder against today's kvgate (holder or recompute) and
//!   against Envoy's least-request balancing, on the same four simulated
//!   GPUs, on shared-prefix, Mooncake and load-spill workloads at
//!   multiples of each one's measured capacity. `--only pull`.
//! * `hostile` ([`crate::hostilebench`]): each hardening attack on a fresh
//!   sidecar, its memory and `/select` latency against the same sidecar
//!   idle. Only with `--only hostile`: it measures bounds, not speed.

use crate::build::{self, Profile};
use crate::stats::{histogram_buckets, median, percentiles_between, spread};
use crate::{cargo, figures, repo, setup};
use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use kvgate_load::summary::percentile;
use kvgate_load::workload::mixed_demo;
use kvgate_load::{Outcome, Target, run_closed_loop};
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::process::Command;
use std::time::{Duration, Instant};

/// `cargo xtask bench`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Short runs: fewer repetitions, rates and seconds; a check that each
    /// benchmark works more than a figure to quote.
    #[arg(long)]
    pub quick: bool,
    /// Runs just this benchmark and replaces its section of
    /// `bench/report.md` (the ingest and wasmtime-selection figures come
    /// only from a full run).
    #[arg(long, value_enum)]
    pub only: Option<Only>,
    /// Builds the filter of this git revision too, and runs it beside
    /// this tree's on a second kvgate listener of the same Envoy: the
    /// request shapes and length curve (part of `overhead`) and the 2k-token
    /// decision (`kv` for token ids, `text` for chats and text), before and
    /// after in one run, alternating.
    #[arg(long, value_name = "REV")]
    pub baseline: Option<String>,
    /// Runs nothing: writes `bench/report.md` (its Summary and every
    /// section), the README's headline figures and architecture.md's
    /// measured figures from `bench/results/*.json` as they are.
    #[arg(long, conflicts_with_all = ["quick", "only", "baseline"])]
    pub report: bool,
}

/// The benchmarks `--only` can run alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Only {
    Overhead,
    Kv,
    Sync,
    Dump,
    Shedding,
    Thermal,
    Planner,
    Text,
    Quality,
    Disagg,
    Admission,
    Pull,
    Hostile,
}

impl Args {
    /// The flags again, for the optimised re-run.
    fn to_flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        if self.quick {
            flags.push("--quick".to_string());
        }
        if let Some(only) = self.only.and_then(|o| o.to_possible_value()) {
            flags.extend(["--only".to_string(), only.get_name().to_string()]);
        }
        if let Some(rev) = &self.baseline {
            flags.extend(["--baseline".to_string(), rev.clone()]);
        }
        flags
    }
}

pub fn run(args: &Args) -> Result<()> {
    if args.report {
        write_report(None)?;
        return Ok(());
    }
    // The load generator runs in this process: an unoptimised build of it
    // would take CPU from the Envoy it measures. Run again, optimised.
    if cfg!(debug_assertions) {
        let mut a = vec![
            "run",
            "--release",
            "--quiet",
            "--package",
            "xtask",
            "--",
            "bench",
        ];
        let flags = args.to_flags();
        a.extend(flags.iter().map(String::as_str));
        return crate::sh(&cargo(), &a, &[]);
    }
    let quick = args.quick;
    let only = args.only;
    let rev = args.baseline.as_deref();
    let baseline = rev.map(build::baseline_wasm).transpose()?;
    let baseline = baseline.as_deref();
    let started = Instant::now();
    // The dump benchmark runs its sidecars in process: no Envoy, no filter.
    if only != Some(Only::Dump) {
        setup::all()?;
        build::wasm()?;
        build::bins(Profile::Release)?;
    }
    // Each benchmark's results, stamped with this run; only the benches
    // that build the baseline are stamped with it.
    let save = |name: &str, mut v: Value, with_baseline: bool| -> Result<()> {
        save(name, &mut v, quick, rev.filter(|_| with_baseline))
    };
    if let Some(name) = only {
        match name {
            Only::Shedding => save("shedding", crate::shedbench::run(quick)?, false)?,
            Only::Quality => save("quality", crate::quality::run(quick)?, false)?,
            Only::Sync => save("sync", crate::apibench::sync(quick)?, false)?,
            Only::Kv => save(
                "kv",
                crate::kvbench::run(quick, baseline, envoy_histogram)?,
                true,
            )?,
            Only::Overhead => save("overhead", overhead(quick, baseline)?, true)?,
            Only::Planner => save("planner", crate::plannerbench::run(quick)?, false)?,
            Only::Thermal => save("thermal", crate::thermalbench::run(quick)?, false)?,
            Only::Text => save("text", crate::textbench::run(quick, baseline)?, true)?,
            Only::Disagg => save("disagg", crate::disaggbench::run(quick)?, false)?,
            Only::Admission => save("admission", crate::admissionbench::run(quick)?, false)?,
            Only::Pull => save("pull", crate::pullbench::run(quick)?, false)?,
            Only::Hostile => save("hostile", crate::hostilebench::run(quick)?, false)?,
            Only::Dump => save(
                "dump",
                sidecar_example("dump_bench", if quick { 3 } else { 5 })?,
                false,
            )?,
        }
        // Every section and quoted figure again, from the results as they
        // now are: this run's and every other run's.
        write_report(None)?;
        return Ok(());
    }

    save(
        "ingest",
        sidecar_example("ingest_bench", if quick { 3 } else { 5 })?,
        false,
    )?;
    save(
        "dump",
        sidecar_example("dump_bench", if quick { 3 } else { 5 })?,
        false,
    )?;
    save("overhead", overhead(quick, baseline)?, true)?;
    save(
        "kv",
        crate::kvbench::run(quick, baseline, envoy_histogram)?,
        true,
    )?;
    save("sync", crate::apibench::sync(quick)?, false)?;
    save(
        "selection",
        example("kvgate-tests", "selection_bench")?,
        false,
    )?;
    save("shedding", crate::shedbench::run(quick)?, false)?;
    save("quality", crate::quality::run(quick)?, false)?;
    save("text", crate::textbench::run(quick, baseline)?, true)?;
    save("thermal", crate::thermalbench::run(quick)?, false)?;
    save("planner", crate::plannerbench::run(quick)?, false)?;
    save("disagg", crate::disaggbench::run(quick)?, false)?;
    save("admission", crate::admissionbench::run(quick)?, false)?;
    save("pull", crate::pullbench::run(quick)?, false)?;
    let report = write_report(Some(header(quick, started.elapsed())))?;
    println!("\n{report}");
    Ok(())
}

/// Writes one benchmark's results to `bench/results/<name>.json`, stamped
/// with the run ([`figures::stamp`]) unless they carry a stamp already
/// (a subset of the hostile attacks merged into the published results
/// keeps the published run's).
fn save(name: &str, v: &mut Value, quick: bool, baseline: Option<&str>) -> Result<()> {
    if v.get("measured").is_none() {
        v["measured"] = figures::stamp(quick, baseline);
    }
    let dir = repo().join(figures::RESULTS_DIR);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_vec_pretty(v)?,
    )?;
    Ok(())
}

/// Writes `bench/report.md` from the results alone: `header` (a full
/// run's) or the report's own, the Summary, and a section for each
/// results file; then every block of quoted figures
/// ([`figures::rewrite`]). The report as written.
fn write_report(header: Option<String>) -> Result<String> {
    let path = repo().join("bench/report.md");
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    let mut report =
        header.unwrap_or_else(|| old[..old.find("\n## ").unwrap_or(old.len())].to_string());
    report.push_str(&format!("\n{SUMMARY}\n\n{}", figures::block("summary", "")));
    let results = figures::Results::load(&repo().join(figures::RESULTS_DIR))?;
    for section in sections(&results)? {
        report.push_str(&section);
    }
    std::fs::write(&path, &report)?;
    let changed = figures::rewrite(&repo())?;
    let report = std::fs::read_to_string(&path)?;
    // The report went through a Summary left empty on its way: say what
    // differs from before, not what was written.
    if report != old {
        eprintln!("xtask: wrote {}", path.display());
    }
    for other in changed.iter().filter(|c| **c != path) {
        eprintln!("xtask: wrote {}", other.display());
    }
    Ok(report)
}

/// The report's Summary heading: figures from every results file, each
/// with its run.
const SUMMARY: &str = "## Summary";

/// Every section of the report the results hold, in the report's order;
/// the plots go to `bench/plots/`.
fn sections(r: &figures::Results) -> Result<Vec<String>> {
    let plots = repo().join("bench/plots");
    let null = Value::Null;
    let mut out = Vec::new();
    if let Some(v) = r.get("overhead") {
        out.push(overhead_section(v));
    }
    if let Some(v) = r.get("ingest") {
        out.push(ingest_section(v));
    }
    if let Some(v) = r.get("kv") {
        out.push(kv_report(v));
    }
    if r.get("kv").is_some() || r.get("sync").is_some() {
        let kv = r.get("kv").unwrap_or(&null);
        let sync = r.get("sync").unwrap_or(&null);
        out.push(crate::apibench::report(&kv["selection_api"], sync));
    }
    if let Some(v) = r.get("dump") {
        out.push(dump_section(v));
    }
    if let Some(v) = r.get("selection") {
        out.push(selection_report(v));
    }
    if let Some(v) = r.get("shedding") {
        out.push(crate::shedbench::report(v));
    }
    if let Some(v) = r.get("quality") {
        out.push(quality_section(v)?);
    }
    if let Some(v) = r.get("text") {
        out.push(crate::textbench::report(v));
    }
    if let Some(v) = r.get("thermal") {
        out.push(crate::thermalbench::report(v, &plots)?);
    }
    if let Some(v) = r.get("planner") {
        out.push(crate::plannerbench::report(v, &plots)?);
    }
    if let Some(v) = r.get("disagg") {
        out.push(crate::disaggbench::report(v));
    }
    if let Some(v) = r.get("admission") {
        out.push(crate::admissionbench::report(v));
    }
    if let Some(v) = r.get("pull") {
        out.push(crate::pullbench::report(v));
    }
    if let Some(v) = r.get("hostile") {
        out.push(crate::hostilebench::report(v));
    }
    Ok(out)
}

/// The routing-quality section; its plots go to `bench/plots/`.
fn quality_section(v: &Value) -> Result<String> {
    let (md, plots) = crate::quality::report(v);
    let dir = repo().join("bench/plots");
    std::fs::create_dir_all(&dir)?;
    for (name, svg) in plots {
        std::fs::write(dir.join(name), svg)?;
    }
    Ok(md)
}

/// Runs a benchmark example that prints one JSON object.
fn example(package: &str, name: &str) -> Result<Value> {
    eprintln!("xtask: bench {name}");
    let out = Command::new(cargo())
        .args(["run", "--release", "-q", "-p", package, "--example", name])
        .env("KVGATE_FILTER_WASM", build::wasm_path())
        .current_dir(repo())
        .output()
        .with_context(|| format!("running {name}"))?;
    if !out.status.success() {
        bail!("{name} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim())
        .with_context(|| format!("parsing {name}'s output"))
}

fn selection_report(v: &Value) -> String {
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    format!(
        "\n## Selection in the wasmtime host (real `.wasm`, {:.2}M indexed blocks, 2k-token prompts)\n\n\
Whole request path through the host, P50 / P99: {:.0} / {:.0} µs with the index, against {:.0} / {:.0} µs \
for the same requests with no index (baseline, same run); {} of {} requests went to the prefix holder. \
Parsing the 2k-token body dominates; the prefix search is within the run's noise.\n",
        f("indexed_blocks") / 1e6,
        f("with_index_us_p50"),
        f("with_index_us_p99"),
        f("baseline_no_index_us_p50"),
        f("baseline_no_index_us_p99"),
        f("routed_to_prefix_holder"),
        f("requests"),
    )
}

/// Runs one of the sidecar's benchmark examples (`ingest_bench`,
/// `dump_bench`), which prints one JSON object.
fn sidecar_example(name: &str, runs: usize) -> Result<Value> {
    eprintln!("xtask: bench {name} ({runs} runs)");
    let out = Command::new(cargo())
        .args([
            "run",
            "--release",
            "-q",
            "-p",
            "kvgate-sidecar",
            "--example",
            name,
            "--",
        ])
        .arg(runs.to_string())
        .current_dir(repo())
        .output()
        .with_context(|| format!("running {name}"))?;
    if !out.status.success() {
        bail!("{name} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("parsing {name}'s output"))
}

fn dump_section(v: &Value) -> String {
    let f = |path: &[&str]| num(v, path);
    format!(
        "\n## Index dump and recovery ({:.2}M blocks: {} ranks × {}k)\n\n\
| figure | value |\n| --- | --- |\n\
| `GET /dump` size | {:.1} MB ({:.1} bytes a block) |\n\
| index thread's copy of its tables (all ingest waits for) | {:.1} ms |\n\
| encode (sort into runs, checksum), off the index thread | {:.0} ms |\n\
| decode (checksum, bounds) | {:.0} ms |\n\
| replay into an empty index | {:.0} ms |\n\
| `GET /dump` from a client, loopback | {:.0} ms |\n\
| recovery of a new sidecar from its peer (`kvgate_index_recovery_seconds`: fetch + decode + replay) | {:.0} ms, {:.2}M blocks |\n\
| for scale: the peer indexing the same blocks from a burst of KV events over ZMQ (polled every 100 ms) | {:.0} ms |\n\n\
Medians of {} runs. A block costs its engine hash and its sequence hash (8 bytes each); tiers and the unmatchable flag are written once per run of equal flags.\n",
        f(&["in_process", "blocks"]) / 1e6,
        f(&["ranks"]),
        f(&["blocks_per_rank"]) / 1e3,
        f(&["in_process", "dump_bytes"]) / 1e6,
        f(&["in_process", "bytes_per_block"]),
        f(&["in_process", "copy_ms"]),
        f(&["in_process", "encode_ms"]),
        f(&["in_process", "decode_ms"]),
        f(&["in_process", "replay_ms"]),
        f(&["over_http", "get_dump_ms"]),
        f(&["over_http", "recovery_ms"]),
        f(&["over_http", "recovered_blocks"]) / 1e6,
        f(&["over_http", "index_from_events_s"]) * 1e3,
        f(&["runs"]),
    )
}

struct Run {
    p50_us: u64,
    p99_us: u64,
    rps: f64,
    errors: usize,
}

fn measure(rt: &tokio::runtime::Runtime, base: &str, n: usize, concurrency: usize) -> Run {
    let specs: Vec<_> = mixed_demo("demo-model", n, Duration::ZERO, 7)
        .into_iter()
        .map(|mut s| {
            // Small, non-streaming bodies: the cost measured is the proxy's.
            s.stream = false;
            s.path = "/v1/chat/completions".into();
            s.body = json!({"model": "demo-model", "max_tokens": 1,
                            "messages": [{"role": "user", "content": "ping"}]})
            .to_string()
            .into();
            s
        })
        .collect();
    let t = Instant::now();
    let outcomes: Vec<Outcome> =
        rt.block_on(run_closed_loop(&Target::new(base), &specs, concurrency));
    let wall = t.elapsed().as_secs_f64();
    let mut lat: Vec<u64> = outcomes
        .iter()
        .filter(|o| o.status == 200)
        .map(|o| o.latency_us)
        .collect();
    lat.sort_unstable();
    Run {
        p50_us: percentile(&lat, 50.0).unwrap_or(0),
        p99_us: percentile(&lat, 99.0).unwrap_or(0),
        rps: lat.len() as f64 / wall,
        errors: outcomes.len() - lat.len(),
    }
}

/// Envoy's own percentiles of a filter histogram, from `/stats`, over
/// everything since Envoy started.
pub(crate) fn envoy_histogram(stack: &Stack, name: &str) -> Result<Value> {
    let (_, body) = http::get(
        &stack.admin_addr(),
        &format!("/stats?filter=wasmcustom\\.{name}$"),
    )?;
    let text = String::from_utf8_lossy(&body);
    // "wasmcustom.x: P0(a,b) P25(a,b) ...": interval, then cumulative,
    // the one taken.
    let mut out = serde_json::Map::new();
    for part in text.split_whitespace() {
        if let Some((p, vals)) = part.split_once('(')
            && let Some(v) = vals.trim_end_matches(')').split(',').nth(1)
            && let Ok(v) = v.parse::<f64>()
        {
            out.insert(p.to_string(), json!(v));
        }
    }
    Ok(Value::Object(out))
}

/// The routes `overhead` measures, in the order of even repetitions: the
/// plain Envoy route (baseline), Envoy's least-request balancing, the
/// kvgate filter, and kvgate's decision outside the proxy through
/// `ext_proc` (the peers' architecture).
const ROUTES: [&str; 4] = ["plain", "least_request", "kvgate", "extproc"];

/// The processes whose CPU `overhead` reports, per request.
const CPU_PARTS: [&str; 5] = ["envoy", "sidecar", "extproc", "workers", "load_generator"];

fn overhead(quick: bool, baseline: Option<&std::path::Path>) -> Result<Value> {
    let (reps, n, concurrency) = if quick { (3, 1500, 8) } else { (5, 5000, 8) };
    eprintln!(
        "xtask: bench overhead ({reps} × {n} requests per route, {} routes, concurrency {concurrency})",
        ROUTES.len()
    );
    let paths = build::release_paths()?;
    let stack = Stack::start_with(
        paths,
        StackConfig {
            workers: 4,
            sim_args: vec!["--instant".into()],
            envoy_concurrency: 2,
            extproc: true,
            ..StackConfig::default()
        },
    )?;
    let rt = tokio::runtime::Runtime::new()?;
    let urls = [
        stack.plain_url(),
        stack.least_request_url(),
        stack.envoy_url(),
        stack.extproc_url(),
    ];
    // Warm connections and caches on every route, and let V8 tier the
    // filter up: its first requests run in baseline code.
    for url in &urls {
        measure(&rt, url, 1000, concurrency);
    }
    // Envoy records histograms at its stats flush (every 5 s).
    std::thread::sleep(Duration::from_secs(6));
    let decision_before = histogram_buckets(&stack, "kvgate_decision_us")?;
    let mut runs: [Vec<Run>; 4] = Default::default();
    // CPU seconds per route, by CPU_PARTS.
    let mut cpu = [[0.0f64; 5]; 4];
    // Envoy's worker threads' involuntary context switches per route.
    let mut preemptions = [0u64; 4];
    let cpu_now = |s: &Stack| {
        let [e, sc, w] = s.cpu_seconds();
        [
            e,
            sc,
            s.extproc_cpu_seconds(),
            w,
            kvgate_stack::process_cpu_seconds(std::process::id()).unwrap_or(0.0),
        ]
    };
    for rep in 0..reps {
        // Reverse the order every other repetition so that drift on a
        // shared machine hits every route alike.
        let order: Vec<usize> = if rep % 2 == 0 {
            (0..ROUTES.len()).collect()
        } else {
            (0..ROUTES.len()).rev().collect()
        };
        for i in order {
            let before = cpu_now(&stack);
            let preempted = stack.envoy_worker_preemptions();
            runs[i].push(measure(&rt, &urls[i], n, concurrency));
            for (a, (x, y)) in cpu[i].iter_mut().zip(cpu_now(&stack).iter().zip(before)) {
                *a += x - y;
            }
            preemptions[i] += stack.envoy_worker_preemptions().saturating_sub(preempted);
        }
    }
    let per_request = |cpu: &[f64; 5]| {
        let us = |s: f64| (s * 1e6 / (reps * n) as f64).round();
        let mut m = serde_json::Map::new();
        for (part, s) in CPU_PARTS.iter().zip(cpu) {
            m.insert((*part).to_string(), json!(us(*s)));
        }
        Value::Object(m)
    };
    let col = |v: &[Run], f: fn(&Run) -> f64| v.iter().map(f).collect::<Vec<f64>>();
    let side = |v: &[Run]| {
        let p50 = col(v, |r| r.p50_us as f64);
        let p99 = col(v, |r| r.p99_us as f64);
        let rps = col(v, |r| r.rps);
        json!({
            "p50_us": median(p50.clone()), "p50_spread_us": spread(&p50),
            "p99_us": median(p99.clone()), "p99_spread_us": spread(&p99),
            "rps": median(rps.clone()), "rps_spread": spread(&rps),
            "errors": v.iter().map(|r| r.errors).sum::<usize>(),
        })
    };
    let sides: Vec<Value> = runs.iter().map(|r| side(r)).collect();
    // Envoy computes histogram percentiles at its stats flush (every 5 s).
    std::thread::sleep(Duration::from_secs(6));
    let decision = percentiles_between(
        &decision_before,
        &histogram_buckets(&stack, "kvgate_decision_us")?,
        &[50.0, 90.0, 99.0, 99.9],
    );
    drop(stack);
    let shapes = crate::shapebench::run(quick, baseline)?;
    crate::shapebench::plot(&shapes, &repo().join("bench/plots"))?;
    let (p, k) = (&sides[0], &sides[2]);
    let f = |v: &Value, key: &str| v[key].as_f64().unwrap_or(0.0);
    let vs_plain = |v: &Value| {
        json!({
            "added_p50_us": f(v, "p50_us") - f(p, "p50_us"),
            "added_p99_us": f(v, "p99_us") - f(p, "p99_us"),
            "p50_ratio": f(v, "p50_us") / f(p, "p50_us").max(1.0),
            "throughput_ratio": f(v, "rps") / f(p, "rps").max(1e-9),
        })
    };
    let mut cpu_json = serde_json::Map::new();
    for (route, c) in ROUTES.iter().zip(&cpu) {
        cpu_json.insert((*route).to_string(), per_request(c));
    }
    Ok(json!({
        "name": "overhead",
        "requests_per_run": n,
        "runs": reps,
        "concurrency": concurrency,
        "envoy_concurrency": 2,
        "baseline_plain_route": p,
        "least_request_route": sides[1],
        "kvgate_route": k,
        "extproc_route": sides[3],
        "added_p50_us": f(k, "p50_us") - f(p, "p50_us"),
        "added_p99_us": f(k, "p99_us") - f(p, "p99_us"),
        "p50_ratio": f(k, "p50_us") / f(p, "p50_us").max(1.0),
        "throughput_ratio": f(k, "rps") / f(p, "rps").max(1e-9),
        "vs_plain": {
            "least_request": vs_plain(&sides[1]),
            "kvgate": vs_plain(k),
            "extproc": vs_plain(&sides[3]),
        },
        "filter_decision_us": decision,
        // Beside the decision's P99: how often a request's worker thread
        // was preempted, on the kvgate route's runs.
        "envoy_worker_preemptions_per_request": preemptions[2] as f64 / (reps * n) as f64,
        "cpu_us_per_request": Value::Object(cpu_json),
        "by_shape": shapes,
    }))
}

fn kv_report(kv: &Value) -> String {
    let f = |k: &str| kv[k].as_f64().unwrap_or(f64::NAN);
    let h = |k: &str, p: &str| kv[k][p].as_f64().unwrap_or(f64::NAN);
    let mut md = format!(
        "\n## KV-aware routing through Envoy ({} workers, {:.2}M blocks indexed from ZMQ events)\n\n\
| figure | value | baseline / target |\n| --- | --- | --- |\n\
| selection (hash 2k-token prompt, read shards, cost), Envoy histogram P50 / P99 | {:.0} / {:.0} µs | target ≤ 20 µs P50 |\n\
| whole decision (parse + select) P50 / P99, the same requests | {:.0} / {:.0} µs | — |\n\
| requests routed to the prefix holder | {} of {} | — |\n\
| event published → decision follows it, p50 / p99 | {:.1} / {:.1} ms | target ≤ 25 ms p99 (the sidecar publishes shards every 5 ms) |\n\
| Envoy resident memory growth for the index | {:.1} MiB ({:.0} → {:.0} MiB) | baseline: Envoy before the index; target ≤ 64 MiB |\n\
| time to index all blocks (publish → sidecar) | {:.1} s | — |\n",
        f("workers"),
        f("indexed_blocks") / 1e6,
        h("selection_us", "P50"),
        h("selection_us", "P99"),
        h("decision_us", "P50"),
        h("decision_us", "P99"),
        f("routed_to_prefix_holder"),
        f("requests"),
        f("freshness_ms_p50"),
        f("freshness_ms_p99"),
        f("envoy_rss_growth_mib"),
        f("envoy_rss_before_mib"),
        f("envoy_rss_after_mib"),
        f("index_build_s"),
    );
    if kv["decision_turns"].is_object() {
        md.push_str(&format!(
            "\nThe whole decision on 2k-token prompts that hit, in turns of {} requests: paced at {} a second (the VM idle between requests) and back to back on one connection (the VM warm), {} turns of each per listener, the builds alternating in one Envoy (`crate::turns`; `--baseline REV` adds the old build's listener; the simulated workers at nice 19):\n\n{}",
            kv["decision_turns"]["kvgate"]["paced"]["requests"].as_u64().unwrap_or(0)
                / kv["decision_turns"]["kvgate"]["paced"]["turns"].as_u64().unwrap_or(1).max(1),
            crate::turns::RATE,
            kv["decision_turns"]["kvgate"]["paced"]["turns"],
            crate::turns::table(&[("token ids, 1.6M-block index".into(), &kv["decision_turns"])]),
        ));
    }
    md
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    format!("{cores} vCPU, {cpu}")
}

/// A number at `path` in `v`, NaN when absent.
fn num(v: &Value, path: &[&str]) -> f64 {
    crate::stats::at(v, path).unwrap_or(f64::NAN)
}

/// The report's first lines: what kind of run, on what, when, how long.
fn header(quick: bool, took: Duration) -> String {
    let date = crate::output("date", &["-u", "+%Y-%m-%d"])
        .map(|d| d.trim().to_string())
        .unwrap_or_default();
    format!(
        "# kvgate benchmarks\n\n{} run of every benchmark on {}, {date}; took {:.0} s. A benchmark run alone since carries its own date and commit (the Summary's run column). Medians of repeated runs, spread (max − min) in brackets; every figure is next to its baseline from the same run.\n",
        if quick { "Quick" } else { "Full" },
        machine(),
        took.as_secs_f64(),
    )
}

fn overhead_section(o: &Value) -> String {
    let f = |path: &[&str]| num(o, path);
    let cpu = |route: &str, part: &str| num(o, &["cpu_us_per_request", route, part]);
    // Results from before the ext_proc server existed have no column for
    // it: count it as nothing rather than NaN.
    let cpu0 = |route: &str, part: &str| match cpu(route, part) {
        v if v.is_nan() && part == "extproc" => 0.0,
        v => v,
    };
    let names = [
        (
            "baseline_plain_route",
            "plain",
            "plain Envoy route (baseline)",
        ),
        (
            "least_request_route",
            "least_request",
            "Envoy least request (static cluster)",
        ),
        ("kvgate_route", "kvgate", "kvgate filter (in-proxy wasm)"),
        (
            "extproc_route",
            "extproc",
            "kvgate over ext_proc (gRPC, out of proxy)",
        ),
    ];
    let mut rows = String::new();
    let mut cpu_rows = String::new();
    for (key, route, label) in names {
        let g = |k: &str| f(&[key, k]);
        let (added, ratio) = match route {
            "plain" => ("—".to_string(), "—".to_string()),
            _ => (
                format!(
                    "{:+.0} µs, ×{:.2}",
                    f(&["vs_plain", route, "added_p50_us"]),
                    f(&["vs_plain", route, "p50_ratio"]),
                ),
                format!("×{:.2}", f(&["vs_plain", route, "throughput_ratio"])),
            ),
        };
        rows.push_str(&format!(
            "| {label} | {:.0} µs [{:.0}] | {:.0} µs [{:.0}] | {:.0} req/s [{:.0}] | {added} | {ratio} |\n",
            g("p50_us"),
            g("p50_spread_us"),
            g("p99_us"),
            g("p99_spread_us"),
            g("rps"),
            g("rps_spread"),
        ));
        let total: f64 = CPU_PARTS.iter().map(|p| cpu0(route, p)).sum();
        cpu_rows.push_str(&format!(
            "| {label} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {total:.0} |\n",
            cpu0(route, "envoy"),
            cpu0(route, "sidecar"),
            cpu0(route, "extproc"),
            cpu0(route, "workers"),
            cpu0(route, "load_generator"),
        ));
    }
    format!(
        "\n## Filter overhead against Envoy's own balancing and ext_proc (Envoy 1.40, 2 worker threads, 4 instant workers, closed loop ×{})\n\n\
The same requests through four routes of one Envoy, in one run, the order reversed every other repetition. \
The ext_proc route is the architecture peers use (Gateway API Inference Extension, llm-d, AIBrix): Envoy's `ext_proc` filter \
streams each request to an endpoint picker outside the proxy over gRPC (HTTP/2, Envoy's gRPC client), here `kvgate-extproc`, \
which holds the fleet state in-process (a whole kvgate sidecar) and makes the filter's decision over it \
(request headers, the buffered body, and the response headers cross; a reservation per request). \
Every request is the same one-word chat (`\"content\": \"ping\"`, `max_tokens` 1, not streamed), so the figures are the proxy's cost; \
the decision on long prompts is in the request-shape table below.\n\n\
| route | p50 | p99 | throughput | added p50, p50 ratio | throughput ratio |\n| --- | --- | --- | --- | --- | --- |\n{rows}\n\
Added latency of the filter: p50 {:+.0} µs (ratio {:.2}), p99 {:+.0} µs; throughput ratio {:.2}. The filter's own decision time on the one-word chat (Envoy histogram `kvgate_decision_us`, the measured runs only, warm-up excluded): P50 {:.0} µs, P99 {:.0} µs, \
with Envoy's worker threads preempted {:.2} times a request (involuntary context switches on the kvgate route's runs), which is what sets most of that P99 on shared cores.\n\n\
The loop keeps both cores busy, so latency and throughput follow CPU per request. Where it goes (CPU µs per request, user + system, from `/proc`; \
the sidecars' background work, scraping and publishing, is counted on every route, so the ext_proc server's column on the other routes is its idle cost):\n\n\
| route | Envoy | sidecar | ext_proc server | workers | load generator | total |\n| --- | --- | --- | --- | --- | --- | --- |\n{cpu_rows}",
        f(&["concurrency"]),
        f(&["added_p50_us"]),
        f(&["p50_ratio"]),
        f(&["added_p99_us"]),
        f(&["throughput_ratio"]),
        f(&["filter_decision_us", "P50"]),
        f(&["filter_decision_us", "P99"]),
        f(&["envoy_worker_preemptions_per_request"]),
    ) + &crate::shapebench::report(&o["by_shape"])
}

fn ingest_section(i: &Value) -> String {
    let f = |path: &[&str]| num(i, path);
    format!(
        "\n## KV event ingest (one thread; 16 ranks × 100k blocks, 16-token blocks, vLLM 0.33 tagged events)\n\n\
| path | blocks/s |\n| --- | --- |\n\
| generic msgpack decode into `rmpv::Value` (baseline, decode only) | {:.2}M [{:.2}M] |\n\
| kvgate decode + hash | {:.2}M |\n\
| kvgate decode + hash + index (end to end from frames) | {:.2}M [{:.2}M] |\n\n\
Ingest is {:.2}× the baseline's decode alone. Sidecar heap per indexed block: {:.0} bytes.\n",
        f(&["baseline_rmpv_decode_blocks_per_s"]) / 1e6,
        f(&["baseline_spread"]) / 1e6,
        f(&["decode_hash_blocks_per_s"]) / 1e6,
        f(&["ingest_blocks_per_s"]) / 1e6,
        f(&["ingest_spread"]) / 1e6,
        f(&["ratio_ingest_vs_baseline_decode"]),
        f(&["sidecar_heap_bytes_per_block"]),
    )
}
