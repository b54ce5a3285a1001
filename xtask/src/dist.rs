//! `cargo xtask dist`: the release artifacts, without Docker, in
//! `target/dist/`: the sidecar binary (as its image ships it), the
//! filter's `.wasm` and its sha256 (what an HTTP code source verifies).
//! `cargo xtask images` packages the same files as OCI images.

use crate::build;
use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use std::fs;
use std::path::{Path, PathBuf};

pub const WASM_NAME: &str = "kvgate_filter.wasm";
pub const SIDECAR_NAME: &str = "kvgate-sidecar";

pub fn dir() -> PathBuf {
    crate::target_dir().join("dist")
}

pub fn run() -> Result<()> {
    build::wasm()?;
    let sidecar = build::sidecar_image()?;
    publish(&sidecar)?;
    Ok(())
}

/// Copies the built `sidecar` and filter into `target/dist/` and writes
/// the `.wasm`'s sha256 beside it.
pub fn publish(sidecar: &Path) -> Result<()> {
    let out = dir();
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let sidecar = copy(sidecar, &out)?;
    let wasm = copy(&build::wasm_path(), &out)?;
    let bytes = fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;
    let sum = sha256_hex(&bytes);
    // sha256sum's format, so `sha256sum -c` checks it from target/dist/.
    let sum_file = out.join(format!("{WASM_NAME}.sha256"));
    fs::write(&sum_file, format!("{sum}  {WASM_NAME}\n"))
        .with_context(|| format!("writing {}", sum_file.display()))?;
    println!("xtask dist: built into {}", out.display());
    for p in [&sidecar, &wasm, &sum_file] {
        let len = fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        println!("  {:<32} {len:>10} bytes", name(p));
    }
    println!("  sha256 of {WASM_NAME}: {sum}");
    Ok(())
}

fn copy(from: &Path, dir: &Path) -> Result<PathBuf> {
    let to = dir.join(name(from));
    fs::copy(from, &to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(to)
}

fn name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn sha256_matches_the_standard_vector() {
        assert_eq!(
            super::sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
