//! The binary's own commands that start nothing: `--version`, `check` and
//! `status`, which the image's checks and a pod's operators run.

use std::path::PathBuf;
use std::process::{Command, Output};

mod support;

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

/// Every 401 the sidecar counted, over all routes.
fn unauthorized(sc: &kvgate_sidecar::Sidecar) -> f64 {
    sc.metrics()
        .render()
        .lines()
        .filter(|l| l.starts_with("kvgate_sidecar_unauthorized_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `kvgate-sidecar status --url base`, with `token` as the only
/// `KVGATE_CONTROL_TOKEN` it sees.
async fn status(base: &str, token: Option<&'static str>) -> Output {
    let base = base.to_string();
    tokio::task::spawn_blocking(move || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"));
        c.args(["status", "--url", &base])
            .env_remove("KVGATE_CONTROL_TOKEN");
        if let Some(t) = token {
            c.env("KVGATE_CONTROL_TOKEN", t);
        }
        c.output().expect("running kvgate-sidecar status")
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn status_without_the_token_adds_nothing_to_the_unauthorized_count() {
    let (base, sc) = support::sidecar_with(&[], Some("s3cret")).await;
    let out = status(&base, None).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("model m"));
    assert_eq!(unauthorized(&sc), 0.0, "an operator's look was counted");

    // With the token it also reads the planner: authorized, not counted.
    let out = status(&base, Some("s3cret")).await;
    assert!(out.status.success());
    assert_eq!(unauthorized(&sc), 0.0);

    // A wrong token is counted as ever: the read is refused, the rest of
    // the status still printed.
    let out = status(&base, Some("wrong")).await;
    assert!(out.status.success());
    assert_eq!(
        support::metric(
            &sc,
            "kvgate_sidecar_unauthorized_total{path=\"/v1/planner\"}"
        ),
        1.0
    );
}
