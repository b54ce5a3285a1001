//! The binary's own commands that start nothing: `--version` and `check`,
//! which the image's checks and a pod's operators run.

use std::path::PathBuf;
use std::process::{Command, Output};

fn sidecar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"))
        .args(args)
        .output()
        .expect("running kvgate-sidecar")
}

fn file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn version_prints_the_packages_version() {
    let out = sidecar(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("kvgate-sidecar {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn check_accepts_a_valid_file_and_refuses_an_invalid_one_with_the_reason() {
    let good = file(
        "good.toml",
        "[[models]]\nname = \"m\"\n\n[[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:8000\"\n",
    );
    let out = sidecar(&["check", "--config", good.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("valid (1 models, 1 workers"));

    // Two models of one name: parses as TOML, fails validation.
    let bad = file(
        "bad.toml",
        "[[models]]\nname = \"m\"\n\n[[models]]\nname = \"m\"\n",
    );
    let out = sidecar(&["check", "--config", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("listed twice"));

    let out = sidecar(&["check", "--config", "/nonexistent/kvgate.toml"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/kvgate.toml"));
}
