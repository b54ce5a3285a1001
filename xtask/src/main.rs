//! `cargo xtask <task>`: the project's own tasks; `cargo xtask --help`
//! lists them ([`cli`]).

mod admissionbench;
mod apibench;
mod bench;
mod build;
mod cli;
mod demo;
mod disaggbench;
mod dist;
#[cfg(test)]
mod docs;
mod figures;
mod fuzz;
mod hostilebench;
mod images;
mod kvbench;
mod kvfleet;
mod plannerbench;
mod plot;
mod pullbench;
mod quality;
mod replay;
mod setup;
mod shapebench;
mod shedbench;
mod stats;
mod textbench;
mod thermalbench;
mod turns;

use anyhow::{Context, Result, bail};
use clap::Parser;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    if let Err(e) = run() {
        eprintln!("xtask: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    use cli::Task;
    match cli::Cli::parse().task {
        Task::Setup => setup::all(),
        Task::Demo => demo::run(),
        Task::Test(args) => test(&args.cargo_test),
        Task::Lint => lint(),
        Task::Bench(args) => bench::run(&args),
        Task::Fuzz(args) => fuzz::run(&args),
        Task::Dist => dist::run(),
        Task::Images(args) => images::run(&args),
        Task::DeployCheck => {
            setup::all()?;
            alert_rules()?;
            manifests(&repo())
        }
    }
}

/// Repository root (xtask lives one level below it).
pub fn repo() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// Cargo's target folder: `CARGO_TARGET_DIR` when set (relative to the
/// repository root, as cargo reads it from there), else `target/`. Every
/// path xtask reads a build output from starts here, so a build into
/// another folder is found where cargo put it.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => repo().join(d),
        _ => repo().join("target"),
    }
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

/// Runs a command in the repository root and returns what it printed.
pub fn output(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .current_dir(repo())
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// The registry the test run renders the manifests for: a local one, as a
/// kind or minikube cluster pulls from. `cargo xtask images --registry`
/// renders them for a real one.
const TEST_REGISTRY: &str = "localhost:5000/kvgate";

/// The source label of a test run's sidecar image when the checkout has
/// no `origin` URL (CI's clone has a local path there).
const TEST_SOURCE: &str = "urn:kvgate:unpublished";

fn test(rest: &[String]) -> Result<()> {
    setup::all()?;
    alert_rules()?;
    manifests(&repo())?;
    // The filter, the optimised sidecar and their images: the test run's
    // one release build. The tests read the images' rendered manifests
    // and the filter from the image's layer.
    let source = images::origin_url().unwrap_or_else(|| TEST_SOURCE.into());
    images::build(TEST_REGISTRY, &source)?;
    let dist = dist::dir();
    manifests(&dist)?;
    images::check(&dist)?;
    build::test_targets()?;
    let wasm = build::wasm_path();
    let bins = build::Profile::Debug.dir();
    images::run_in_chroot(&dist, &bins)?;
    let envoy = setup::envoy_path();
    let prometheus = setup::prometheus_path();
    let mut args = vec!["test", "--workspace", "--all-targets"];
    args.extend(rest.iter().map(String::as_str));
    let env = [
        ("KVGATE_FILTER_WASM", wasm.as_path()),
        ("KVGATE_BIN_DIR", bins.as_path()),
        ("KVGATE_ENVOY", envoy.as_path()),
        ("KVGATE_PROMETHEUS", prometheus.as_path()),
        ("KVGATE_DIST_DIR", dist.as_path()),
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
            // The workspace, as above: selecting one package changes feature
            // unification and would rebuild every dependency a second time.
            "--workspace",
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
/// fields are errors): the templates when `root` is the repository, the
/// rendered ones when it is `target/dist`. Custom resources
/// (Envoy Gateway, Istio, KEDA, Prometheus Operator) have no schema there
/// and are only warned about; tests/tests/deploy.rs checks their fields.
fn manifests(root: &Path) -> Result<()> {
    let tool = setup::kubernetes_validate_path();
    let mut files = Vec::new();
    for dir in MANIFEST_DIRS {
        let mut found: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
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
        "xtask: {passed} Kubernetes objects in {} manifest files under {} validate against {KUBERNETES_VERSION}",
        files.len(),
        root.display()
    );
    Ok(())
}

/// Where the Kubernetes manifests are.
pub(crate) const MANIFEST_DIRS: [&str; 4] = [
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
