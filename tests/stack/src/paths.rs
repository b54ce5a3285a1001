//! Where the stack's parts live. Defaults follow the repository layout that
//! `cargo xtask` builds; environment variables override each one so the same
//! code can run binaries built elsewhere (a release build, an install).

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

#[derive(Debug, Clone)]
pub struct Paths {
    pub repo: PathBuf,
    /// Directory holding `kvgate-sidecar` and `kvgate-sim` (`KVGATE_BIN_DIR`).
    pub bin_dir: PathBuf,
    /// The Envoy binary (`KVGATE_ENVOY`; default: the project venv's).
    pub envoy: PathBuf,
    /// The filter module (`KVGATE_FILTER_WASM`).
    pub wasm: PathBuf,
    /// What `cargo xtask images` writes (`KVGATE_DIST_DIR`): the images,
    /// their digests, the rendered manifests and the unpacked images.
    pub dist: PathBuf,
}

impl Paths {
    pub fn discover() -> Result<Paths> {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let repo = repo.canonicalize().unwrap_or(repo);
        let var = |name: &str, default: PathBuf| {
            std::env::var_os(name).map(PathBuf::from).unwrap_or(default)
        };
        Ok(Paths {
            bin_dir: var("KVGATE_BIN_DIR", repo.join("target/debug")),
            envoy: var("KVGATE_ENVOY", repo.join(".venv/bin/envoy")),
            wasm: var(
                "KVGATE_FILTER_WASM",
                repo.join("target/wasm32-wasip1/release-wasm/kvgate_filter.wasm"),
            ),
            dist: var("KVGATE_DIST_DIR", repo.join("target/dist")),
            repo,
        })
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }

    /// Fails with the command that fixes it when a part is missing.
    pub fn check(&self) -> Result<()> {
        let mut missing = Vec::new();
        for p in [
            self.bin("kvgate-sidecar"),
            self.bin("kvgate-sim"),
            self.envoy.clone(),
            self.wasm.clone(),
        ] {
            if !p.exists() {
                missing.push(p.display().to_string());
            }
        }
        if !missing.is_empty() {
            bail!(
                "missing {}: run `cargo xtask test` (or `cargo xtask setup` and the builds it prints) first",
                missing.join(", ")
            );
        }
        Ok(())
    }

    /// A fresh directory for one stack's configs and logs.
    pub fn new_run_dir(&self) -> Result<PathBuf> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let dir = self.repo.join("target/kvgate-runs").join(format!(
            "{stamp}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(dir)
    }
}
