//! Builds the filter module and the native binaries.

use crate::{cargo, repo, setup, sh};
use anyhow::Result;
use kvgate_stack::Paths;
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Debug,
    Release,
}

impl Profile {
    pub fn dir(self) -> PathBuf {
        target_dir().join(match self {
            Profile::Debug => "debug",
            Profile::Release => "release",
        })
    }
}

/// Where cargo builds: `CARGO_TARGET_DIR` when set, as cargo itself reads
/// it, else the repository's `target/`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => repo().join(d),
        _ => repo().join("target"),
    }
}

pub fn wasm_path() -> PathBuf {
    target_dir().join("wasm32-wasip1/release-wasm/kvgate_filter.wasm")
}

/// The filter module of git revision `rev`, built as [`wasm`] builds it,
/// in a worktree of its own under `target/`: the baseline a before/after
/// benchmark runs beside this tree's build. Its build directory is kept
/// across revisions, so a second baseline builds little.
pub fn baseline_wasm(rev: &str) -> Result<PathBuf> {
    let commit = crate::output(
        "git",
        &["rev-parse", "--verify", &format!("{rev}^{{commit}}")],
    )?;
    let commit = commit.trim();
    let dir = target_dir().join("baseline");
    let out = dir.join(format!("kvgate_filter-{commit}.wasm"));
    if out.exists() {
        return Ok(out);
    }
    let tree = dir.join(format!("tree-{commit}"));
    let tree_s = tree.display().to_string();
    if !tree.exists() {
        sh(
            "git",
            &["worktree", "add", "--detach", &tree_s, commit],
            &[],
        )?;
    }
    let build_dir = dir.join("target");
    let built = std::process::Command::new(cargo())
        .args([
            "build",
            "-p",
            "kvgate-filter",
            "--target",
            "wasm32-wasip1",
            "--profile",
            "release-wasm",
        ])
        .env("CARGO_TARGET_DIR", &build_dir)
        .current_dir(&tree)
        .status()?;
    let removed = sh("git", &["worktree", "remove", "--force", &tree_s], &[]);
    anyhow::ensure!(
        built.success(),
        "building the filter of {rev} ({commit}) failed"
    );
    removed?;
    std::fs::copy(
        build_dir.join("wasm32-wasip1/release-wasm/kvgate_filter.wasm"),
        &out,
    )?;
    Ok(out)
}

/// The filter is always built optimized: Envoy runs it, and a debug build
/// would make every filter test measure the wrong thing.
pub fn wasm() -> Result<()> {
    sh(
        &cargo(),
        &[
            "build",
            "-p",
            "kvgate-filter",
            "--target",
            "wasm32-wasip1",
            "--profile",
            "release-wasm",
        ],
        &[],
    )
}

pub fn bins(profile: Profile) -> Result<()> {
    let mut args = vec![
        "build",
        "-p",
        "kvgate-sidecar",
        "-p",
        "kvgate-sim",
        "-p",
        "kvgate-load",
        "-p",
        "kvgate-extproc",
    ];
    if profile == Profile::Release {
        args.push("--release");
    }
    sh(&cargo(), &args, &[])
}

/// Every target of the workspace, once, before `cargo test` runs the
/// suite: the binaries the tests start come out of the same build as the
/// tests, with the same feature unification, so no dependency is compiled
/// twice (a per-package `-p` build unifies features differently and
/// doubles the disk a clean run needs).
pub fn test_targets() -> Result<()> {
    sh(&cargo(), &["build", "--workspace", "--all-targets"], &[])
}

/// The release sidecar alone, for `cargo xtask dist`.
pub fn sidecar_release() -> Result<()> {
    sh(
        &cargo(),
        &["build", "--locked", "--release", "-p", "kvgate-sidecar"],
        &[],
    )
}

/// Where the release build's parts are, for the demo and the benchmarks.
pub fn release_paths() -> Result<Paths> {
    let mut paths = Paths::discover()?;
    paths.bin_dir = Profile::Release.dir();
    // `KVGATE_FILTER_WASM` names another filter build to measure (an
    // older revision's, for a before/after comparison on one stack).
    if std::env::var_os("KVGATE_FILTER_WASM").is_none() {
        paths.wasm = wasm_path();
    }
    paths.envoy = setup::envoy_path();
    Ok(paths)
}
