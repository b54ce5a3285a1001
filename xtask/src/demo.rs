//! `cargo xtask demo`: the whole stack on loopback, a short mixed workload
//! through Envoy, and a readable summary. Everything started is stopped on
//! the way out (the stack kills its processes when dropped).

use crate::build::{self, Profile};
use crate::setup;
use anyhow::{Context, Result};
use kvgate_load::workload::mixed_demo;
use kvgate_load::{Summary, Target, run_open_loop};
use kvgate_stack::{Stack, StackConfig, http};
use std::time::Duration;

pub fn run() -> Result<()> {
    setup::all()?;
    build::wasm()?;
    build::bins(Profile::Release)?;
    let paths = build::release_paths()?;

    println!(
        "\nkvgate demo: Envoy 1.40 + kvgate filter + sidecar + 4 simulated vLLM workers (loopback)\n"
    );
    let stack = Stack::start_with(
        paths,
        StackConfig {
            workers: 4,
            kv_events: true,
            sim_args: ["--speedup", "10", "--num-gpu-blocks", "2048"]
                .map(String::from)
                .to_vec(),
            ..StackConfig::default()
        },
    )
    .context("starting the stack")?;
    println!(
        "  envoy      {} (admin {})",
        stack.envoy_url(),
        stack.admin_addr()
    );
    println!("  sidecar    http://{}", stack.sidecar_addr());
    for w in &stack.workers {
        println!("  worker {}   http://{}", w.id, w.endpoint());
    }

    let rt = tokio::runtime::Runtime::new()?;
    let target = Target::new(stack.envoy_url());
    let specs = mixed_demo("demo-model", 200, Duration::from_millis(20), 42);
    println!(
        "\nsending {} requests (chat and completions, a third streaming) at 50 req/s ...\n",
        specs.len()
    );
    let outcomes = rt.block_on(run_open_loop(&target, &specs, 1.0));
    print!("{}", Summary::of(&outcomes).render());

    println!("\nrequests kvgate answers itself (no worker contacted):");
    for (label, body) in [
        (
            "unknown model ",
            r#"{"model":"no-such-model","prompt":"hi"}"#,
        ),
        ("malformed JSON", r#"{"model":"demo-model","prompt":"#),
        ("missing prompt", r#"{"model":"demo-model"}"#),
    ] {
        let (status, headers, body) =
            http::post_json(&stack.envoy_addr(), "/v1/completions", body.as_bytes())?;
        let reason = headers
            .iter()
            .find(|(k, _)| k == "x-kvgate-reason")
            .map(|(_, v)| v.as_str())
            .unwrap_or("-");
        println!(
            "  {label}  -> {status} ({reason}) {}",
            String::from_utf8_lossy(&body)
        );
    }

    println!("\nfilter metrics (Envoy /stats):");
    for name in [
        "kvgate_requests_total",
        "kvgate_routed_total",
        "kvgate_rejected_unknown_model_total",
        "kvgate_rejected_bad_request_total",
        "kvgate_snapshot_version",
    ] {
        println!("  {name:<40} {}", stack.envoy_stat(name).unwrap_or(0));
    }
    let blocks = stack
        .sidecar_metric("kvgate_sidecar_kv_indexed_blocks{model=\"demo-model\"}")
        .unwrap_or(0.0);
    println!("\nsidecar: KV blocks indexed from the workers' ZMQ events: {blocks}");
    println!("\nstopping everything.");
    drop(stack);
    Ok(())
}
