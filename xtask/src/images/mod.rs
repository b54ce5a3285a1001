//! `cargo xtask images --registry REGISTRY`: the sidecar and filter OCI
//! images, built with no container tool, as `oci-archive`s in
//! `target/dist/`, and the deploy manifests rendered with their references
//! and digests into `target/dist/deploy/`.
//!
//! * `kvgate-sidecar.oci.tar`: one layer holding the release binary, the
//!   libraries the loader maps for it (its `DT_NEEDED` closure, found by
//!   `ldd`) and `/etc/passwd` and `/etc/group` entries for uid 65532; no
//!   shell, no package manager. It runs as 65532.
//! * `kvgate-filter.oci.tar`: one layer holding `/plugin.wasm`, what an
//!   image volume mounts and Envoy Gateway and Istio pull. It carries no
//!   source or revision label: its digest depends on the `.wasm` and the
//!   version only (`--verify` checks the `.wasm` rebuilds bit for bit).

mod check;
mod closure;
mod layer;
mod layout;
mod render;
mod verify;

use crate::{build, dist, repo};
use anyhow::{Context, Result};
use layer::Tree;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

pub use check::{check, run_in_chroot};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The registry and path the images will be pushed to, e.g.
    /// `ghcr.io/acme`: the manifests name REGISTRY/kvgate-sidecar and
    /// REGISTRY/kvgate-filter.
    #[arg(long, value_name = "REGISTRY", required_unless_present = "verify")]
    pub registry: Option<String>,
    /// The sidecar image's `org.opencontainers.image.source` label; by
    /// default the URL of the checkout's `origin` remote.
    #[arg(long, value_name = "URL")]
    pub source: Option<String>,
    /// Instead of building: builds the filter twice, from clean target
    /// folders in two clones of HEAD at different paths, and checks that
    /// both give the same filter image digest.
    #[arg(long, conflicts_with_all = ["registry", "source"])]
    pub verify: bool,
}

pub const SIDECAR: &str = "kvgate-sidecar";
pub const FILTER: &str = "kvgate-filter";
/// Where the sidecar's binary sits in its image (the manifests' liveness
/// probe runs it there).
pub const SIDECAR_BIN: &str = "/usr/local/bin/kvgate-sidecar";
/// The sidecar's user and group: distroless's `nonroot`, which the
/// manifests' securityContext names.
pub const UID: u32 = 65532;
/// The sidecar's API port (`server.listen`'s default).
pub const API_PORT: u16 = 9190;
/// `kvgate-sidecar agent`'s port (dcgm-exporter's), when the image runs as
/// a node agent.
pub const AGENT_PORT: u16 = 9400;
const VERSION: &str = env!("CARGO_PKG_VERSION");

pub fn run(args: &Args) -> Result<()> {
    if args.verify {
        return verify::run();
    }
    let registry = args.registry.as_deref().context("--registry is required")?;
    let source = match &args.source {
        Some(s) => s.clone(),
        None => origin_url().context(
            "no --source given and the checkout has no `origin` remote: give --source URL, the repository the image is built from",
        )?,
    };
    let built = build(registry, &source)?;
    check(&dist::dir())?;
    built.print();
    Ok(())
}

/// One built image, as `target/dist/images.json` lists it.
#[derive(Debug, Clone)]
pub struct Built {
    pub name: &'static str,
    pub archive: PathBuf,
    pub reference: String,
    pub digest: String,
    pub archive_bytes: u64,
    pub layer_bytes: u64,
    pub file_bytes: u64,
}

pub struct Both {
    pub sidecar: Built,
    pub filter: Built,
    pub manifests: usize,
}

impl Both {
    fn print(&self) {
        println!("xtask images: built into {}", dist::dir().display());
        for b in [&self.sidecar, &self.filter] {
            println!(
                "  {:<24} {:>10} bytes archive, {:>10} bytes pulled (gzip), {:>10} bytes unpacked",
                file_name(&b.archive),
                b.archive_bytes,
                b.layer_bytes,
                b.file_bytes
            );
            println!("    {}", b.reference);
        }
        println!(
            "  {} manifests rendered into {}",
            self.manifests,
            dist::dir().join("deploy").display()
        );
        println!(
            "  push: skopeo copy --preserve-digests oci-archive:{} docker://{}",
            file_name(&self.sidecar.archive),
            self.sidecar.reference.split('@').next().unwrap_or_default()
        );
    }
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Builds the filter and the sidecar (the one optimised build), both
/// images and the rendered manifests.
pub fn build(registry: &str, source: &str) -> Result<Both> {
    let registry = registry.trim_end_matches('/');
    build::wasm()?;
    let sidecar_bin = build::sidecar_image()?;
    dist::publish(&sidecar_bin)?;
    let out = dist::dir();
    let sidecar = write(
        SIDECAR,
        registry,
        &sidecar_image(&out.join(dist::SIDECAR_NAME), source)?,
    )?;
    let wasm = std::fs::read(out.join(dist::WASM_NAME))?;
    let filter = write(FILTER, registry, &filter_image(wasm)?)?;
    let values = template_values(&sidecar, &filter, registry);
    let manifests =
        render::render_tree(&repo(), &crate::MANIFEST_DIRS, &out.join("deploy"), &values)?;
    let summary: serde_json::Map<String, Value> = [&sidecar, &filter]
        .iter()
        .map(|b| {
            let v = json!({
                "archive": file_name(&b.archive),
                "reference": b.reference,
                "digest": b.digest,
                "archive_bytes": b.archive_bytes,
                "layer_bytes": b.layer_bytes,
                "file_bytes": b.file_bytes,
            });
            (b.name.to_string(), v)
        })
        .collect();
    let mut summary = Value::Object(summary);
    summary["template_values"] = json!(values);
    std::fs::write(
        out.join("images.json"),
        serde_json::to_string_pretty(&summary)? + "\n",
    )?;
    Ok(Both {
        sidecar,
        filter,
        manifests,
    })
}

fn template_values(
    sidecar: &Built,
    filter: &Built,
    registry: &str,
) -> BTreeMap<&'static str, String> {
    let hex = filter.digest.trim_start_matches("sha256:").to_string();
    BTreeMap::from([
        ("KVGATE_SIDECAR_IMAGE", sidecar.reference.clone()),
        ("KVGATE_FILTER_IMAGE", filter.reference.clone()),
        (
            "KVGATE_FILTER_BY_TAG",
            format!("{registry}/{FILTER}:{VERSION}"),
        ),
        ("KVGATE_FILTER_DIGEST", hex),
    ])
}

/// Writes `image` as `target/dist/NAME.oci.tar`, its digest beside it.
fn write(name: &'static str, registry: &str, image: &layout::Image) -> Result<Built> {
    let w = layout::write(image, VERSION)?;
    let out = dist::dir();
    let archive = out.join(format!("{name}.oci.tar"));
    std::fs::write(&archive, &w.archive)
        .with_context(|| format!("writing {}", archive.display()))?;
    std::fs::write(
        out.join(format!("{name}.digest")),
        format!("{}\n", w.digest),
    )?;
    // The file list, for comparing with an image built by Docker from
    // deploy/docker/ (deploy/README.md, "Images").
    let files: Vec<String> = image.layers.iter().flat_map(Tree::files).collect();
    std::fs::write(out.join(format!("{name}.files")), files.join("\n") + "\n")?;
    Ok(Built {
        name,
        reference: format!("{registry}/{name}:{VERSION}@{}", w.digest),
        digest: w.digest,
        archive_bytes: w.archive.len() as u64,
        layer_bytes: w.layer_bytes,
        file_bytes: w.file_bytes,
        archive,
    })
}

/// The sidecar's files: the binary, what the loader maps for it, and the
/// user it runs as.
fn sidecar_tree(binary: &Path) -> Result<Tree> {
    use std::os::unix::fs::PermissionsExt;
    let mut t = Tree::default();
    t.file(SIDECAR_BIN, true, std::fs::read(binary)?)?;
    for lib in closure::ldd(binary)? {
        // The file the loader maps, at the path it asked for: a soname
        // that is a symlink on this machine is a plain file in the image.
        let bytes = std::fs::read(&lib).with_context(|| format!("reading {}", lib.display()))?;
        let executable = std::fs::metadata(&lib)?.permissions().mode() & 0o111 != 0;
        t.file(&lib.display().to_string(), executable, bytes)?;
    }
    t.file("/etc/passwd", false, passwd().into_bytes())?;
    t.file("/etc/group", false, group().into_bytes())?;
    Ok(t)
}

pub fn passwd() -> String {
    format!("nonroot:x:{UID}:{UID}:nonroot:/nonexistent:/usr/sbin/nologin\n")
}

pub fn group() -> String {
    format!("nonroot:x:{UID}:\n")
}

fn sidecar_image(binary: &Path, source: &str) -> Result<layout::Image> {
    let mut labels = common_labels(
        SIDECAR,
        "kvgate's sidecar: keeps Envoy's routing state fresh",
    );
    labels.insert("org.opencontainers.image.source".into(), json!(source));
    labels.insert(
        "org.opencontainers.image.revision".into(),
        json!(revision()?),
    );
    Ok(layout::Image {
        config: json!({
            "User": format!("{UID}:{UID}"),
            "ExposedPorts": {
                format!("{API_PORT}/tcp"): {},
                format!("{AGENT_PORT}/tcp"): {},
            },
            "Env": ["PATH=/usr/local/bin"],
            "Entrypoint": [SIDECAR_BIN],
            // The image ships no configuration: the ConfigMap is mounted at
            // /etc/kvgate.
            "Cmd": ["--config", "/etc/kvgate/kvgate.toml"],
            "WorkingDir": "/",
            "Labels": labels,
        }),
        layers: vec![sidecar_tree(binary)?],
    })
}

fn filter_image(wasm: Vec<u8>) -> Result<layout::Image> {
    let mut t = Tree::default();
    t.file("/plugin.wasm", false, wasm)?;
    Ok(layout::Image {
        config: json!({
            "Labels": common_labels(FILTER, "kvgate's proxy-wasm filter for Envoy, as /plugin.wasm"),
        }),
        layers: vec![t],
    })
}

fn common_labels(title: &str, description: &str) -> serde_json::Map<String, Value> {
    [
        ("org.opencontainers.image.title", title),
        ("org.opencontainers.image.description", description),
        ("org.opencontainers.image.version", VERSION),
        ("org.opencontainers.image.licenses", "Apache-2.0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), json!(v)))
    .collect()
}

fn git(args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(repo())
        .output()
        .context("running git")?;
    anyhow::ensure!(out.status.success(), "git {} failed", args.join(" "));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The commit built, marked `-dirty` when tracked files differ from it.
fn revision() -> Result<String> {
    let head = git(&["rev-parse", "HEAD"])?;
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    Ok(if dirty { format!("{head}-dirty") } else { head })
}

/// The `origin` remote's URL, when it is one: a clone of a local folder
/// has a path there, which would put this machine's layout in the label.
pub fn origin_url() -> Option<String> {
    git(&["remote", "get-url", "origin"])
        .ok()
        .filter(|u| u.contains("://") || (u.contains('@') && u.contains(':')))
}
