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
        repo().join(match self {
            Profile::Debug => "target/debug",
            Profile::Release => "target/release",
        })
    }
}

pub fn wasm_path() -> PathBuf {
    repo().join("target/wasm32-wasip1/release-wasm/kvgate_filter.wasm")
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
