//! Builds the filter module and the native binaries.

use crate::{cargo, repo, setup, sh, target_dir};
use anyhow::{Context, Result};
use kvgate_stack::Paths;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Debug,
    Release,
    /// The sidecar as its image ships it (`[profile.release-image]`).
    Image,
}

impl Profile {
    pub fn dir(self) -> PathBuf {
        target_dir().join(match self {
            Profile::Debug => "debug",
            Profile::Release => "release",
            Profile::Image => "release-image",
        })
    }
}

pub fn wasm_path() -> PathBuf {
    wasm_path_in(&target_dir())
}

fn wasm_path_in(target: &Path) -> PathBuf {
    target.join("wasm32-wasip1/release-wasm/kvgate_filter.wasm")
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
    let built = wasm_in(&tree, &dir.join("target"));
    let removed = sh("git", &["worktree", "remove", "--force", &tree_s], &[]);
    let built = built.with_context(|| format!("building the filter of {rev} ({commit})"))?;
    removed?;
    std::fs::copy(built, &out)?;
    Ok(out)
}

/// The filter is always built optimized: Envoy runs it, and a debug build
/// would make every filter test measure the wrong thing.
pub fn wasm() -> Result<()> {
    wasm_in(&repo(), &target_dir()).map(|_| ())
}

/// Builds the filter of the checkout at `root` into `target` and returns
/// the module's path. The source paths rustc writes into the module (panic
/// locations of the dependencies, the standard library and the filter) are
/// remapped to fixed names, so the module holds no path of this machine and
/// two checkouts at different paths build the same bytes.
pub fn wasm_in(root: &Path, target: &Path) -> Result<PathBuf> {
    let flags = remap_flags(root, target)?;
    let config = format!("target.wasm32-wasip1.rustflags={}", toml_array(&flags));
    let args = [
        "build",
        "--locked",
        "-p",
        "kvgate-filter",
        "--target",
        "wasm32-wasip1",
        "--profile",
        "release-wasm",
        "--config",
        &config,
    ];
    eprintln!("xtask: $ cargo {} (in {})", args.join(" "), root.display());
    let status = Command::new(cargo())
        .args(args)
        .current_dir(root)
        .env("CARGO_TARGET_DIR", target)
        .status()
        .context("running cargo")?;
    anyhow::ensure!(status.success(), "the filter's build failed with {status}");
    Ok(wasm_path_in(target))
}

/// `--remap-path-prefix` for every place a source path can come from.
/// rustc applies the last flag that matches, so the narrower prefixes
/// (the target folder, which may sit inside the checkout) come last.
fn remap_flags(root: &Path, target: &Path) -> Result<Vec<String>> {
    let mut pairs = vec![
        (sysroot()?, "/rust-sysroot".to_string()),
        (cargo_home(), "/cargo".to_string()),
        (root.to_path_buf(), "/kvgate".to_string()),
        (target.to_path_buf(), "/kvgate/target".to_string()),
    ];
    pairs.retain(|(from, _)| from.is_absolute());
    Ok(pairs
        .into_iter()
        .map(|(from, to)| format!("--remap-path-prefix={}={to}", from.display()))
        .collect())
}

fn sysroot() -> Result<PathBuf> {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .with_context(|| format!("running {rustc} --print sysroot"))?;
    anyhow::ensure!(out.status.success(), "{rustc} --print sysroot failed");
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Where cargo keeps the registry's sources (`CARGO_HOME`, else
/// `~/.cargo`).
fn cargo_home() -> PathBuf {
    if let Some(h) = std::env::var_os("CARGO_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cargo"))
        .unwrap_or_default()
}

/// A TOML array of strings (JSON's string escapes are TOML's too).
fn toml_array(items: &[String]) -> String {
    let quoted: Vec<String> = items
        .iter()
        .map(|s| serde_json::Value::from(s.as_str()).to_string())
        .collect();
    format!("[{}]", quoted.join(", "))
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
    match profile {
        Profile::Debug => {}
        Profile::Release => args.push("--release"),
        Profile::Image => args.extend(["--profile", "release-image"]),
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

/// The sidecar as its image ships it, for `cargo xtask dist` and
/// `cargo xtask images`: the one optimised native build `cargo xtask test`
/// makes.
pub fn sidecar_image() -> Result<PathBuf> {
    sh(
        &cargo(),
        &[
            "build",
            "--locked",
            "--profile",
            "release-image",
            "-p",
            "kvgate-sidecar",
        ],
        &[],
    )?;
    Ok(Profile::Image.dir().join("kvgate-sidecar"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remapping_puts_the_narrower_prefix_last() {
        let flags = remap_flags(Path::new("/src/kvgate"), Path::new("/src/kvgate/target")).unwrap();
        let at = |to: &str| {
            flags
                .iter()
                .position(|f| f.ends_with(&format!("={to}")))
                .unwrap()
        };
        assert!(at("/kvgate") < at("/kvgate/target"));
        assert!(flags.contains(&"--remap-path-prefix=/src/kvgate=/kvgate".to_string()));
    }

    #[test]
    fn rustflags_are_a_toml_array_of_strings() {
        assert_eq!(
            toml_array(&["a=b".into(), r#"c"d\e"#.into()]),
            r#"["a=b", "c\"d\\e"]"#
        );
    }
}
