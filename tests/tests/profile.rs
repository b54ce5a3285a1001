//! The planner's profile sweep (`kvgate_sidecar::profile`, the
//! `kvgate-sidecar profile` command) against simulated workers of known
//! speed: rows for every point, rates that follow the prompt's cost, TOML
//! that a configuration reads back as the same rows, and a clear error
//! when nothing listens.
//!
//! The workers prefill one prompt at a time at 100 µs a token (one lane),
//! so one serves at most 39 prompts of 256 tokens a second and 9.8 of
//! 1024; a step lasts 1.5 s, so each sweep takes some 15-25 s. The two
//! sweeps run at once, each on a worker of its own.

use kvgate_core::Role;
use kvgate_sidecar::config::{Config, ProfileRow};
use kvgate_sidecar::profile::{self, ProfileError, SweepOptions};
use kvgate_stack::{Paths, Proc, free_ports, http};
use std::time::{Duration, Instant};

const MODEL: &str = "demo-model";
const PREFILL_US_PER_TOKEN: f64 = 100.0;

/// A running `kvgate-sim`, killed on drop.
struct Sim {
    _proc: Proc,
    endpoint: String,
}

fn sim(name: &str) -> Sim {
    let paths = Paths::discover().unwrap();
    let bin = paths.bin("kvgate-sim");
    assert!(
        bin.exists(),
        "{} is missing: `cargo build -p kvgate-sim` (or `cargo xtask test`) first",
        bin.display()
    );
    let addr = format!("127.0.0.1:{}", free_ports(1).unwrap()[0]);
    let args: Vec<String> = [
        "--listen",
        &addr,
        "--model",
        MODEL,
        "--prefill-us-per-token",
        &PREFILL_US_PER_TOKEN.to_string(),
        "--prefill-lanes",
        "1",
        "--decode-ms-per-token",
        "2",
        "--decode-ms-per-running",
        "0.05",
        "--max-running",
        "64",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let dir = paths.new_run_dir().unwrap();
    let proc = Proc::spawn(name, &bin, &args, &dir).unwrap();
    http::wait_for_status(&addr, "/health", 200, Duration::from_secs(30)).unwrap();
    Sim {
        _proc: proc,
        endpoint: format!("http://{addr}"),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn options(endpoint: &str, role: Role) -> SweepOptions {
    SweepOptions {
        endpoint: endpoint.into(),
        model: MODEL.into(),
        role,
        isl: vec![256, 1024],
        osl: vec![16],
        ttft_ms: Some(300.0),
        itl_ms: (role != Role::Prefill).then_some(10.0),
        step: Duration::from_millis(1500),
        max_rps: 64.0,
        min_requests: 10,
        bisect_steps: 2,
        max_in_flight: 256,
        request_timeout: None,
    }
}

/// The rows as a model's configuration reads them.
fn read_back(rows: &[ProfileRow], opts: &SweepOptions) -> Vec<ProfileRow> {
    let text = profile::to_toml(rows, &opts.header());
    let config = format!(
        "[[models]]\nname = \"{MODEL}\"\n\n[models.planner]\nttft_ms = 300.0\nitl_ms = 10.0\n{text}"
    );
    let c = Config::parse(&config).unwrap_or_else(|e| panic!("{e}:\n{config}"));
    c.models[0].planner.as_ref().unwrap().profile.clone()
}

/// Most prompts of `isl` tokens one simulated worker computes a second.
fn prefill_capacity(isl: f64) -> f64 {
    1e6 / (isl * PREFILL_US_PER_TOKEN)
}

#[test]
fn sweeps_find_rates_that_follow_the_prompt_s_cost() {
    let (prefill_sim, both_sim) = (sim("profile-prefill"), sim("profile-both"));
    let prefill_opts = options(&prefill_sim.endpoint, Role::Prefill);
    let both_opts = options(&both_sim.endpoint, Role::Both);
    let rt = runtime();
    let timed = |opts: SweepOptions| async move {
        let t = Instant::now();
        let rows = profile::sweep(&opts).await;
        (rows, t.elapsed())
    };
    let started = Instant::now();
    let ((prefill, prefill_took), (both, both_took)) =
        rt.block_on(async { tokio::join!(timed(prefill_opts.clone()), timed(both_opts.clone())) });
    let prefill = prefill.unwrap();
    let both = both.unwrap();
    eprintln!(
        "prefill sweep ({:.1} s): {prefill:?}\nboth sweep ({:.1} s): {both:?}\nboth at once: {:.1} s",
        prefill_took.as_secs_f64(),
        both_took.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );

    for (rows, role) in [(&prefill, Role::Prefill), (&both, Role::Both)] {
        let points: Vec<(f64, f64)> = rows.iter().map(|r| (r.isl, r.osl)).collect();
        let osl = if role == Role::Prefill { 0.0 } else { 16.0 };
        assert_eq!(points, [(256.0, osl), (1024.0, osl)], "{role:?}");
        for r in rows {
            assert_eq!(r.role, role);
            assert!(r.rps > 0.0, "{r:?}");
            // Nothing passes far beyond what the worker can compute.
            assert!(r.rps <= 1.5 * prefill_capacity(r.isl), "{r:?}");
            let ttft = r.ttft_ms.unwrap();
            assert!(ttft > 0.0 && ttft <= 300.0, "{r:?}");
            if role == Role::Prefill {
                assert_eq!(r.itl_ms, None);
            } else {
                let itl = r.itl_ms.unwrap();
                assert!(itl > 0.0 && itl <= 10.0, "{r:?}");
            }
        }
        // A prompt four times as long costs four times the prefill.
        assert!(rows[1].rps <= rows[0].rps, "{role:?}: {rows:?}");
    }

    assert_eq!(read_back(&prefill, &prefill_opts), prefill);
    assert_eq!(read_back(&both, &both_opts), both);
}

#[test]
fn a_dead_endpoint_is_a_clear_error() {
    // A port found free and not listened on.
    let port = free_ports(1).unwrap()[0];
    let endpoint = format!("http://127.0.0.1:{port}");
    let opts = options(&endpoint, Role::Both);
    let t = Instant::now();
    let err = runtime().block_on(profile::sweep(&opts)).unwrap_err();
    assert!(
        matches!(&err, ProfileError::Unreachable { endpoint: e, .. } if *e == endpoint),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("cannot reach the worker") && message.contains(&endpoint),
        "{message}"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

    // The command says the same and fails.
    let bin = Paths::discover().unwrap().bin("kvgate-sidecar");
    if !bin.exists() {
        eprintln!("{} is missing: the command is not run", bin.display());
        return;
    }
    let out = std::process::Command::new(&bin)
        .args([
            "profile",
            "--endpoint",
            &endpoint,
            "--model",
            MODEL,
            "--isl",
            "256",
            "--osl",
            "16",
            "--ttft-ms",
            "300",
            "--itl-ms",
            "10",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("cannot reach the worker"), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_worker_that_refuses_the_model_is_a_clear_error() {
    let s = sim("profile-refuses");
    let opts = SweepOptions {
        model: "no-such-model".into(),
        ..options(&s.endpoint, Role::Prefill)
    };
    let err = runtime().block_on(profile::sweep(&opts)).unwrap_err();
    assert!(
        matches!(&err, ProfileError::Rejected { status: 404, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("no-such-model"), "{err}");
}
