//! `kvgate-load`: drive an OpenAI-compatible endpoint and print a summary.

use clap::Parser;
use kvgate_load::workload::{SharedPrefix, mixed_demo, mooncake, shared_prefix};
use kvgate_load::{Summary, Target, run_closed_loop, run_open_loop};
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(name = "kvgate-load", about = "Load generator for kvgate")]
struct Args {
    #[arg(long, default_value = "http://127.0.0.1:10000")]
    target: String,
    #[arg(long, default_value = "mixed", value_parser = ["mixed", "shared-prefix", "mooncake"])]
    workload: String,
    #[arg(long, default_value = "demo-model")]
    model: String,
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Open loop at this mean rate (req/s); without it, closed loop.
    #[arg(long)]
    rate: Option<f64>,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Mooncake trace file (JSON lines).
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Multiplies trace arrival times.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Writes outcomes and the summary as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let rate = a.rate.unwrap_or(20.0);
    let specs = match a.workload.as_str() {
        "mixed" => mixed_demo(
            &a.model,
            a.requests,
            Duration::from_secs_f64(1.0 / rate),
            a.seed,
        ),
        "shared-prefix" => shared_prefix(
            &a.model,
            SharedPrefix {
                groups: (a.requests / 16).max(1),
                per_group: 16.min(a.requests),
                prefix_tokens: 2048,
                question_tokens: 128,
                output_tokens: 256,
                rate,
            },
            a.seed,
        ),
        _ => {
            let path = a
                .trace
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("--trace is required for mooncake"))?;
            mooncake(&std::fs::read_to_string(path)?, &a.model, a.requests, 512)
                .map_err(anyhow::Error::msg)?
        }
    };
    let target = Target::new(a.target.trim_end_matches('/'));
    let outcomes = if a.rate.is_some() || a.workload == "mooncake" {
        run_open_loop(&target, &specs, a.time_scale).await
    } else {
        run_closed_loop(&target, &specs, a.concurrency).await
    };
    let s = Summary::of(&outcomes);
    print!("{}", s.render());
    if let Some(p) = a.json {
        std::fs::write(
            p,
            serde_json::to_vec_pretty(&serde_json::json!({"summary": s, "outcomes": outcomes}))?,
        )?;
    }
    Ok(())
}
