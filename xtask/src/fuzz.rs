//! `cargo xtask fuzz`: long fuzz runs of every decoder of outside input
//! (see `fuzz/README.md`).
//!
//! ```text
//! cargo xtask fuzz [--seconds N] [--target NAME]... [--engine auto|libfuzzer|builtin]
//!                  [--jobs J] [--sanitizer none|address]
//! ```
//!
//! With libFuzzer (`cargo +nightly fuzz`, the default where it works) each
//! target runs N seconds from a scratch copy of the checked-in corpus under
//! `target/fuzz/libfuzzer/`, so the checked-in corpus only grows by hand.
//! The built-in engine is the stable mutation runner, for machines without
//! nightly.

use crate::repo;
use anyhow::{Context, Result, bail};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Instant;

/// Which fuzzing engine runs the targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// libFuzzer where `cargo +nightly fuzz` works, else the built-in one.
    Auto,
    /// libFuzzer through `cargo +nightly fuzz`.
    #[value(name = "libfuzzer")]
    LibFuzzer,
    /// The stable mutation runner.
    Builtin,
}

/// `cargo xtask fuzz`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// How long each target runs, in seconds.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// A target to run (repeatable); none: every target.
    #[arg(long = "target", value_name = "NAME")]
    targets: Vec<String>,
    /// Which engine runs the targets.
    #[arg(long, value_enum, default_value_t = Engine::Auto)]
    engine: Engine,
    /// Targets run at a time.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    jobs: u32,
    /// libFuzzer's sanitizer. The decoders are safe Rust, so
    /// AddressSanitizer finds little and costs about half the throughput;
    /// the allocation bound is enforced by the targets' own guard
    /// allocator either way.
    #[arg(long, default_value = "none", value_parser = ["none", "address"])]
    sanitizer: String,
}

pub fn run(args: &Args) -> Result<()> {
    let all = targets()?;
    for t in &args.targets {
        if !all.contains(t) {
            bail!("no fuzz target {t:?}; targets: {}", all.join(", "));
        }
    }
    let targets = if args.targets.is_empty() {
        all
    } else {
        args.targets.clone()
    };
    let engine = match args.engine {
        Engine::Auto if libfuzzer_usable() => Engine::LibFuzzer,
        Engine::Auto => {
            eprintln!("xtask: `cargo +nightly fuzz` is not usable here; using the built-in engine");
            Engine::Builtin
        }
        e => e,
    };
    match engine {
        Engine::LibFuzzer => libfuzzer(args, &targets),
        _ => builtin(args, &targets),
    }
}

/// Target names, from the libFuzzer project's target files (the CI test
/// checks they match the library's table).
fn targets() -> Result<Vec<String>> {
    let dir = repo().join("fuzz/libfuzzer/fuzz_targets");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .with_context(|| dir.display().to_string())?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let p = e.path();
            (p.extension()? == "rs").then(|| p.file_stem().map(|s| s.to_string_lossy().into()))?
        })
        .collect();
    names.sort();
    Ok(names)
}

/// A command for nightly cargo, free of what this stable `cargo run` put
/// in the environment (a toolchain pin, stable's own cargo).
fn nightly_cargo() -> Command {
    let mut c = Command::new("cargo");
    c.arg("+nightly").current_dir(repo());
    for v in [
        "RUSTUP_TOOLCHAIN",
        "CARGO",
        "RUSTC",
        "RUSTDOC",
        "RUSTC_WRAPPER",
    ] {
        c.env_remove(v);
    }
    c
}

fn libfuzzer_usable() -> bool {
    nightly_cargo()
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn scratch() -> PathBuf {
    crate::target_dir().join("fuzz")
}

fn libfuzzer(args: &Args, targets: &[String]) -> Result<()> {
    let target_dir = crate::target_dir().join("libfuzzer");
    let mut build = nightly_cargo();
    build.args([
        "fuzz",
        "build",
        "--fuzz-dir",
        "fuzz/libfuzzer",
        "--sanitizer",
    ]);
    build
        .arg(&args.sanitizer)
        .arg("--target-dir")
        .arg(&target_dir);
    eprintln!(
        "xtask: $ cargo +nightly fuzz build (all targets, sanitizer {})",
        args.sanitizer
    );
    if !build
        .status()
        .context("cargo +nightly fuzz build")?
        .success()
    {
        bail!("cargo +nightly fuzz build failed");
    }
    let base = scratch().join("libfuzzer");
    let queue = Mutex::new(targets.iter().cloned().collect::<VecDeque<_>>());
    let results = Mutex::new(Vec::new());
    eprintln!(
        "xtask: fuzzing {} targets for {} s each, {} at a time; logs in {}",
        targets.len(),
        args.seconds,
        args.jobs,
        base.join("logs").display()
    );
    std::thread::scope(|s| {
        for _ in 0..(args.jobs as usize).min(targets.len()) {
            s.spawn(|| {
                loop {
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    let Some(t) = next else { break };
                    let r = run_libfuzzer(&t, args, &target_dir, &base)
                        .unwrap_or_else(|e| Outcome::failed(&t, format!("{e:#}")));
                    eprintln!("xtask: {} done: {}", r.target, r.result);
                    results.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by(|a, b| a.target.cmp(&b.target));
    println!(
        "{:<10} {:>12} {:>9} {:>7} {:>7} {:>8}  result",
        "target", "runs", "execs/s", "wall s", "corpus", "rss MB"
    );
    for r in &results {
        println!(
            "{:<10} {:>12} {:>9} {:>7.0} {:>7} {:>8}  {}",
            r.target, r.runs, r.execs_per_s, r.wall_s, r.corpus, r.rss_mb, r.result
        );
    }
    if results.iter().any(|r| !r.ok) {
        bail!("fuzzing found failures; see the artifacts listed above");
    }
    Ok(())
}

struct Outcome {
    target: String,
    runs: u64,
    execs_per_s: u64,
    wall_s: f64,
    corpus: usize,
    rss_mb: u64,
    ok: bool,
    result: String,
}

impl Outcome {
    fn failed(target: &str, why: String) -> Self {
        Outcome {
            target: target.into(),
            runs: 0,
            execs_per_s: 0,
            wall_s: 0.0,
            corpus: 0,
            rss_mb: 0,
            ok: false,
            result: why,
        }
    }
}

fn run_libfuzzer(t: &str, args: &Args, target_dir: &Path, base: &Path) -> Result<Outcome> {
    let corpus = base.join("corpus").join(t);
    let artifacts = base.join("artifacts").join(t);
    let logs = base.join("logs");
    for d in [&corpus, &artifacts, &logs] {
        std::fs::create_dir_all(d).with_context(|| d.display().to_string())?;
    }
    // The scratch corpus keeps what earlier runs found; the checked-in
    // seeds and crashes are copied in on top.
    let checked_in = repo().join("fuzz/corpus").join(t);
    if let Ok(entries) = std::fs::read_dir(&checked_in) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|f| f.is_file()) {
                std::fs::copy(e.path(), corpus.join(e.file_name()))?;
            }
        }
    }
    let bin = built_binary(target_dir, t)?;
    let log_path = logs.join(format!("{t}.log"));
    let log = std::fs::File::create(&log_path)?;
    let mut c = Command::new(&bin);
    c.arg(&corpus)
        .arg(format!("-max_total_time={}", args.seconds))
        .arg("-malloc_limit_mb=64")
        .arg("-rss_limit_mb=2048")
        // Every target handles one input in microseconds; seconds on one
        // is a hang worth reporting.
        .arg("-timeout=10")
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .current_dir(repo())
        .stdout(log.try_clone()?)
        .stderr(log);
    let dict = repo().join("fuzz/libfuzzer/dict").join(format!("{t}.dict"));
    if dict.exists() {
        c.arg(format!("-dict={}", dict.display()));
    }
    let started = Instant::now();
    let status = c.status().with_context(|| bin.display().to_string())?;
    let wall_s = started.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let stat = |key: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("stat::{key}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let found: Vec<String> = std::fs::read_dir(&artifacts)
        .map(|d| {
            d.flatten()
                .map(|e| e.path().display().to_string())
                .collect()
        })
        .unwrap_or_default();
    let ok = status.success() && found.is_empty();
    let result = if ok {
        "ok".to_string()
    } else if found.is_empty() {
        format!("exited with {status}; see {}", log_path.display())
    } else {
        format!("FOUND {}", found.join(" "))
    };
    Ok(Outcome {
        target: t.into(),
        runs: stat("number_of_executed_units"),
        execs_per_s: stat("average_exec_per_sec"),
        wall_s,
        corpus: std::fs::read_dir(&corpus).map(|d| d.count()).unwrap_or(0),
        rss_mb: stat("peak_rss_mb"),
        ok,
        result,
    })
}

/// cargo-fuzz builds for the host triple under `<target-dir>/<triple>/release`.
fn built_binary(target_dir: &Path, t: &str) -> Result<PathBuf> {
    for e in std::fs::read_dir(target_dir)?.flatten() {
        let p = e.path().join("release").join(t);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("no built fuzz target {t} under {}", target_dir.display())
}

fn builtin(args: &Args, targets: &[String]) -> Result<()> {
    crate::sh(
        &crate::cargo(),
        &[
            "build",
            "--release",
            "-p",
            "kvgate-fuzz",
            "--bin",
            "kvgate-fuzz",
        ],
        &[],
    )?;
    let bin = crate::target_dir().join("release/kvgate-fuzz");
    let crashes = scratch().join("builtin/crashes");
    let mut c = Command::new(&bin);
    c.arg("--seconds")
        .arg(args.seconds.to_string())
        .arg("--crashes")
        .arg(&crashes)
        .current_dir(repo());
    for t in targets {
        c.arg("--target").arg(t);
    }
    let status = c.status().with_context(|| bin.display().to_string())?;
    if !status.success() {
        bail!(
            "the built-in fuzzer found failures; inputs are under {}",
            crashes.display()
        );
    }
    Ok(())
}
