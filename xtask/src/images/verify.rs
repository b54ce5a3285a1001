//! `cargo xtask images --verify`: the filter image is reproducible. HEAD
//! is cloned twice, at paths of different lengths, and each clone builds
//! the filter into its own clean target folder; both must give the same
//! image digest. Not part of `cargo xtask test` (two more builds of the
//! filter from nothing); run it before a release.

use super::{FILTER, VERSION, filter_image, git, layout};
use crate::build;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn run() -> Result<()> {
    let head = git(&["rev-parse", "HEAD"])?;
    if !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty() {
        eprintln!(
            "xtask: images --verify builds the commit {head}; uncommitted changes are not in it"
        );
    }
    let base = std::env::temp_dir().join(format!("kvgate-verify-{}", std::process::id()));
    let clones = [base.join("a"), base.join("a-longer-path/to/a/second/clone")];
    let mut digests = Vec::new();
    for dir in &clones {
        clone(&head, dir)?;
        let wasm = build::wasm_in(dir, &dir.join("target"))?;
        let bytes = std::fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;
        let digest = layout::write(&filter_image(bytes)?, VERSION)?.digest;
        eprintln!("xtask: {FILTER} built in {}: {digest}", dir.display());
        digests.push(digest);
    }
    anyhow::ensure!(
        digests[0] == digests[1],
        "{FILTER} is not reproducible: {} and {} from the same commit (the clones are kept in {} to compare)",
        digests[0],
        digests[1],
        base.display()
    );
    std::fs::remove_dir_all(&base).with_context(|| format!("removing {}", base.display()))?;
    println!(
        "xtask images --verify: {FILTER} of {head} has the digest {} from both clones",
        digests[0]
    );
    Ok(())
}

fn clone(commit: &str, dir: &Path) -> Result<PathBuf> {
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let run = |args: &[&str], at: &Path| -> Result<()> {
        let ok = Command::new("git")
            .args(args)
            .current_dir(at)
            .status()
            .context("running git")?
            .success();
        anyhow::ensure!(ok, "git {} failed", args.join(" "));
        Ok(())
    };
    let repo = crate::repo();
    let d = dir.display().to_string();
    run(
        &[
            "clone",
            "--quiet",
            "--no-hardlinks",
            "--no-checkout",
            &repo.display().to_string(),
            &d,
        ],
        &repo,
    )?;
    run(&["checkout", "--quiet", "--detach", commit], dir)?;
    Ok(dir.to_path_buf())
}
