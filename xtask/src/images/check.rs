//! The images' checks, run by `cargo xtask images` and `cargo xtask test`:
//! each archive is read back (every blob against its digest), unpacked into
//! `target/dist/unpacked/NAME/`, and held to what it promises.
//!
//! * The sidecar: its config (user 65532, entrypoint, command, ports,
//!   labels), and its files are exactly the binary, the closure its ELF
//!   files ask for, resolved inside the image, and `/etc/passwd` and
//!   `/etc/group`. Any other file fails.
//! * The filter: one layer, one file, `/plugin.wasm`, whose bytes are
//!   `target/dist/kvgate_filter.wasm`'s, and no revision label.
//!
//! [`run_in_chroot`] then starts the unpacked sidecar as it would run in a
//! pod (needs root for `chroot`).

use super::layer::{self, Entry, Tree};
use super::{FILTER, SIDECAR, SIDECAR_BIN, UID, VERSION, closure, layout};
use crate::dist;
use anyhow::{Context, Result, bail};
use kvgate_stack::{Proc, free_ports, http, tails};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub fn unpacked(dist: &Path, name: &str) -> PathBuf {
    dist.join("unpacked").join(name)
}

/// Reads `NAME.oci.tar`, checks its digest against `NAME.digest`, and
/// unpacks its single layer.
fn open(dist: &Path, name: &str) -> Result<(Value, Tree)> {
    let archive = dist.join(format!("{name}.oci.tar"));
    let bytes = std::fs::read(&archive).with_context(|| {
        format!(
            "reading {}: run `cargo xtask images --registry REGISTRY` first",
            archive.display()
        )
    })?;
    let read = layout::read(&bytes).with_context(|| format!("reading {}", archive.display()))?;
    let recorded = std::fs::read_to_string(dist.join(format!("{name}.digest")))?;
    anyhow::ensure!(
        recorded.trim() == read.digest,
        "{name}: the archive's digest {} is not the recorded {}",
        read.digest,
        recorded.trim()
    );
    anyhow::ensure!(
        read.layers.len() == 1,
        "{name}: {} layers, not one",
        read.layers.len()
    );
    let tree = layer::untar(&read.layers[0])?;
    let root = unpacked(dist, name);
    if root.exists() {
        std::fs::remove_dir_all(&root)?;
    }
    tree.unpack(&root)?;
    Ok((read.config, tree))
}

fn file<'a>(tree: &'a Tree, path: &str) -> Result<&'a [u8]> {
    match tree.get(path) {
        Some(Entry::File { bytes, .. }) => Ok(bytes),
        _ => bail!("{path} is not a file of the image"),
    }
}

pub fn check(dist: &Path) -> Result<()> {
    let (config, tree) = open(dist, SIDECAR)?;
    check_sidecar_config(&config)?;
    let libs = check_sidecar_files(&tree)?;
    anyhow::ensure!(
        file(&tree, SIDECAR_BIN)? == std::fs::read(dist.join(dist::SIDECAR_NAME))?,
        "the image's binary is not target/dist/{}",
        dist::SIDECAR_NAME
    );
    let (config, tree) = open(dist, FILTER)?;
    check_filter(&config, &tree, &std::fs::read(dist.join(dist::WASM_NAME))?)?;
    eprintln!(
        "xtask: images check: {SIDECAR} holds its binary, {} libraries and passwd/group, runs as {UID}; {FILTER} holds /plugin.wasm = {}",
        libs.len(),
        dist::WASM_NAME
    );
    Ok(())
}

fn labels(config: &Value) -> &serde_json::Map<String, Value> {
    static EMPTY: std::sync::OnceLock<serde_json::Map<String, Value>> = std::sync::OnceLock::new();
    config["config"]["Labels"]
        .as_object()
        .unwrap_or_else(|| EMPTY.get_or_init(Default::default))
}

fn check_sidecar_config(config: &Value) -> Result<()> {
    let c = &config["config"];
    let user = format!("{UID}:{UID}");
    let expect = [
        ("User", json!(user)),
        ("Entrypoint", json!([SIDECAR_BIN])),
        ("Cmd", json!(["--config", "/etc/kvgate/kvgate.toml"])),
    ];
    for (key, want) in expect {
        anyhow::ensure!(c[key] == want, "{SIDECAR}: {key} is {}, not {want}", c[key]);
    }
    anyhow::ensure!(
        c["ExposedPorts"]
            .get(format!("{}/tcp", super::API_PORT))
            .is_some(),
        "{SIDECAR}: the API port is not exposed"
    );
    let l = labels(config);
    for key in ["source", "version", "revision", "title"] {
        let v = l
            .get(&format!("org.opencontainers.image.{key}"))
            .and_then(Value::as_str)
            .unwrap_or("");
        anyhow::ensure!(!v.is_empty(), "{SIDECAR}: no {key} label");
    }
    anyhow::ensure!(l["org.opencontainers.image.version"] == VERSION);
    Ok(())
}

/// The image's files are the binary, its closure and the user entries,
/// nothing else; returns the closure.
fn check_sidecar_files(tree: &Tree) -> Result<BTreeSet<String>> {
    let bytes: BTreeMap<String, &[u8]> = tree
        .files()
        .into_iter()
        .map(|p| {
            let b = file(tree, &p)?;
            Ok((p, b))
        })
        .collect::<Result<_>>()?;
    let libs = closure::closure_in(&bytes, SIDECAR_BIN)?;
    anyhow::ensure!(
        libs.iter().any(|l| l.ends_with("/libc.so.6")),
        "{SIDECAR}: the binary does not link glibc: {libs:?}"
    );
    let mut expected: BTreeSet<String> = libs.clone();
    expected.extend([SIDECAR_BIN, "/etc/passwd", "/etc/group"].map(String::from));
    let actual: BTreeSet<String> = bytes.keys().cloned().collect();
    let extra: Vec<_> = actual.difference(&expected).collect();
    anyhow::ensure!(extra.is_empty(), "{SIDECAR}: files no one needs: {extra:?}");
    anyhow::ensure!(
        file(tree, "/etc/passwd")? == super::passwd().as_bytes()
            && file(tree, "/etc/group")? == super::group().as_bytes(),
        "{SIDECAR}: /etc/passwd or /etc/group is not the {UID} entry alone"
    );
    Ok(libs)
}

fn check_filter(config: &Value, tree: &Tree, wasm: &[u8]) -> Result<()> {
    anyhow::ensure!(
        tree.files() == ["/plugin.wasm"],
        "{FILTER}: holds {:?}, not /plugin.wasm alone",
        tree.files()
    );
    anyhow::ensure!(
        file(tree, "/plugin.wasm")? == wasm,
        "{FILTER}: /plugin.wasm is not target/dist/{}",
        dist::WASM_NAME
    );
    let l = labels(config);
    anyhow::ensure!(l["org.opencontainers.image.version"] == VERSION);
    for key in ["revision", "source"] {
        anyhow::ensure!(
            !l.contains_key(&format!("org.opencontainers.image.{key}")),
            "{FILTER}: a {key} label would give the same filter another digest"
        );
    }
    Ok(())
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `chroot --userspec=65532:65532 ROOTFS ARGS...`: the image's filesystem
/// and user, as a container runtime would give them.
fn in_image(rootfs: &Path, args: &[&str]) -> Vec<String> {
    let mut v = vec![
        format!("--userspec={UID}:{UID}"),
        rootfs.display().to_string(),
    ];
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

/// Starts the unpacked sidecar under `chroot` as uid 65532, on a
/// configuration against a simulated worker (`kvgate-sim` from `bin_dir`)
/// on loopback, and waits for `/ready` 200; runs `--version` and `check`
/// on the shipped `kvgate.toml` there too. Without root, says so and skips.
pub fn run_in_chroot(dist: &Path, bin_dir: &Path) -> Result<()> {
    if !is_root() {
        eprintln!(
            "xtask: images check: not root, so the unpacked sidecar is not started under chroot (CI runs it as root)"
        );
        return Ok(());
    }
    let rootfs = unpacked(dist, SIDECAR);
    anyhow::ensure!(
        rootfs.join(SIDECAR_BIN.trim_start_matches('/')).exists(),
        "{} is not unpacked: run the images check first",
        rootfs.display()
    );
    let run_dir = dist.join("unpacked/run");
    std::fs::create_dir_all(&run_dir)?;

    let out = Command::new("chroot")
        .args(in_image(&rootfs, &[SIDECAR_BIN, "--version"]))
        .output()
        .context("running chroot")?;
    let version = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success() && version.trim() == format!("{SIDECAR} {VERSION}"),
        "the image's sidecar answered --version with {version:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // What the ConfigMap mounts at /etc/kvgate, as the pod sees it.
    let etc = rootfs.join("etc/kvgate");
    std::fs::create_dir_all(&etc)?;
    std::fs::write(etc.join("kvgate.toml"), shipped_config()?)?;
    let out = Command::new("chroot")
        .args(in_image(
            &rootfs,
            &[SIDECAR_BIN, "check", "--config", "/etc/kvgate/kvgate.toml"],
        ))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "`kvgate-sidecar check` refused the shipped kvgate.toml in the image: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let [api, worker] = free_ports(2)?[..] else {
        bail!("no free ports");
    };
    let model = "image-check";
    let _sim = Proc::spawn(
        "image-sim",
        &bin_dir.join("kvgate-sim"),
        &[
            "--listen",
            &format!("127.0.0.1:{worker}"),
            "--worker-id",
            "1",
            "--model",
            model,
            "--block-size",
            "16",
            "--dp-size",
            "1",
        ]
        .map(String::from),
        &run_dir,
    )?;
    std::fs::write(
        etc.join("live.toml"),
        format!(
            "[server]\nlisten = \"127.0.0.1:{api}\"\n\n[scrape]\ninterval_ms = 200\n\n[[models]]\nname = \"{model}\"\n\n[[workers]]\nworker_id = 1\nmodel_name = \"{model}\"\nendpoint = \"127.0.0.1:{worker}\"\n"
        ),
    )?;
    let sidecar = Proc::spawn(
        "image-sidecar",
        Path::new("chroot"),
        &in_image(&rootfs, &[SIDECAR_BIN, "--config", "/etc/kvgate/live.toml"]),
        &run_dir,
    )?;
    let addr = format!("127.0.0.1:{api}");
    http::wait_for_status(&addr, "/ready", 200, Duration::from_secs(60)).with_context(|| {
        format!(
            "the image's sidecar never got ready:\n{}",
            tails(&run_dir, 20)
        )
    })?;
    // chroot execs the sidecar, so the process started is the sidecar.
    let status = std::fs::read_to_string(format!("/proc/{}/status", sidecar.pid()))?;
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .map(|u| u.split_whitespace().collect::<Vec<_>>())
        .unwrap_or_default();
    anyhow::ensure!(
        uid.len() == 4 && uid.iter().all(|u| *u == UID.to_string()),
        "the image's sidecar runs as uid {uid:?}, not {UID}"
    );
    eprintln!(
        "xtask: images check: the unpacked sidecar ran under chroot as {UID}:{UID}, answered /ready 200 against a simulated worker, and `check` accepted the shipped kvgate.toml"
    );
    Ok(())
}

/// The sidecar's `kvgate.toml` as `deploy/kubernetes/kvgate-config.yaml`
/// ships it.
fn shipped_config() -> Result<String> {
    let path = crate::repo().join("deploy/kubernetes/kvgate-config.yaml");
    let text = std::fs::read_to_string(&path)?;
    for doc in serde_norway::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc)?;
        if let Some(t) = v["data"]["kvgate.toml"].as_str() {
            return Ok(t.to_string());
        }
    }
    bail!("{} holds no kvgate.toml", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sidecar_tree(extra: Option<&str>) -> Tree {
        let me = std::env::current_exe().unwrap();
        let mut t = Tree::default();
        t.file(SIDECAR_BIN, true, std::fs::read(&me).unwrap())
            .unwrap();
        for lib in closure::ldd(&me).unwrap() {
            t.file(
                &lib.display().to_string(),
                false,
                std::fs::read(&lib).unwrap(),
            )
            .unwrap();
        }
        t.file("/etc/passwd", false, super::super::passwd().into_bytes())
            .unwrap();
        t.file("/etc/group", false, super::super::group().into_bytes())
            .unwrap();
        if let Some(p) = extra {
            t.file(p, false, b"#!/bin/sh\n".to_vec()).unwrap();
        }
        t
    }

    #[test]
    fn the_file_list_is_the_closure_and_any_other_file_fails() {
        let libs = check_sidecar_files(&sidecar_tree(None)).unwrap();
        assert!(libs.iter().any(|l| l.ends_with("libc.so.6")));
        let e = check_sidecar_files(&sidecar_tree(Some("/bin/sh"))).unwrap_err();
        assert!(e.to_string().contains("/bin/sh"), "{e}");
    }

    #[test]
    fn the_filter_holds_the_wasm_alone_and_no_revision() {
        let mut t = Tree::default();
        t.file("/plugin.wasm", false, b"\0asm".to_vec()).unwrap();
        let config = json!({"config": {"Labels": {"org.opencontainers.image.version": VERSION}}});
        check_filter(&config, &t, b"\0asm").unwrap();
        assert!(check_filter(&config, &t, b"\0asm2").is_err());
        let mut revised = config.clone();
        revised["config"]["Labels"]["org.opencontainers.image.revision"] = json!("abc");
        assert!(check_filter(&revised, &t, b"\0asm").is_err());
        t.file("/extra", false, vec![]).unwrap();
        assert!(check_filter(&config, &t, b"\0asm").is_err());
    }

    #[test]
    fn the_sidecar_config_must_name_user_entrypoint_and_labels() {
        let mut c = json!({"config": {
            "User": "65532:65532",
            "Entrypoint": [SIDECAR_BIN],
            "Cmd": ["--config", "/etc/kvgate/kvgate.toml"],
            "ExposedPorts": {"9190/tcp": {}},
            "Labels": {
                "org.opencontainers.image.source": "s",
                "org.opencontainers.image.version": VERSION,
                "org.opencontainers.image.revision": "r",
                "org.opencontainers.image.title": "t",
            }
        }});
        check_sidecar_config(&c).unwrap();
        c["config"]["User"] = json!("0:0");
        assert!(check_sidecar_config(&c).is_err());
    }

    #[test]
    fn the_shipped_config_is_found() {
        assert!(shipped_config().unwrap().contains("[[models]]"));
    }
}
