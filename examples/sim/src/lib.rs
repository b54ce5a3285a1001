//! kvgate-sim: a simulated vLLM worker.
//!
//! It stands in for a GPU worker in kvgate's tests, demo and benchmarks, and
//! speaks a real engine's interfaces: the OpenAI HTTP API (streaming and
//! not), vLLM's Prometheus metric names with values from its own state, and
//! vLLM's ZMQ KV-event wire format with the replay socket. Behind them sit a
//! prefix cache per data-parallel rank ([`cache`]) and a time model
//! ([`engine`]) that make cache hits and batch load show up in latency.

pub mod api;
pub mod cache;
pub mod engine;
pub mod events;
pub mod tokenizer;
pub mod wire;

use anyhow::Context;
use clap::Parser;
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Debug, Clone, Parser)]
#[command(name = "kvgate-sim", about = "A simulated vLLM worker for kvgate")]
pub struct Args {
    #[arg(long, default_value = "127.0.0.1:8101")]
    pub listen: SocketAddr,
    /// Identifies this worker in response headers and logs.
    #[arg(long, default_value_t = 1)]
    pub worker_id: u64,
    /// The served model name; others get 404.
    #[arg(long, default_value = "demo-model")]
    pub model: String,
    /// LoRA adapters served besides `--model` (vLLM's `--lora-modules`,
    /// names only): requests naming one are served, and their blocks are
    /// keyed and published under the adapter.
    #[arg(long, value_delimiter = ',')]
    pub lora_modules: Vec<String>,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks per DP rank.
    #[arg(long, default_value_t = 4096)]
    pub num_gpu_blocks: usize,
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Running-batch cap per rank; further requests queue.
    #[arg(long, default_value_t = 32)]
    pub max_running: usize,
    #[arg(long, default_value_t = 20.0)]
    pub prefill_us_per_token: f64,
    /// Prefills that progress at once per rank, the rest queue (0: all
    /// overlap). 1 models an engine whose prefill compute is shared.
    #[arg(long, default_value_t = 0)]
    pub prefill_lanes: usize,
    #[arg(long, default_value_t = 2.0)]
    pub decode_ms_per_token: f64,
    #[arg(long, default_value_t = 0.05)]
    pub decode_ms_per_running: f64,
    /// Divides every simulated duration.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// No simulated time at all: answer as fast as possible.
    #[arg(long)]
    pub instant: bool,
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: usize,
    /// KV-event PUB endpoint of rank 0; rank r binds port + r.
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// Replay ROUTER endpoint of rank 0; rank r binds port + r.
    #[arg(long)]
    pub kv_replay_endpoint: Option<String>,
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    #[arg(long, value_enum, default_value_t = wire::EventShape::Tagged)]
    pub event_shape: wire::EventShape,
    /// `topic`: vLLM ≥ 0.26 replay replies; `legacy`: without the topic frame.
    #[arg(long, default_value = "topic", value_parser = ["topic", "legacy"])]
    pub replay_shape: String,
    #[arg(long, default_value_t = 10_000)]
    pub replay_buffer_steps: usize,
    #[arg(long, value_enum, default_value_t = wire::HashMode::U64)]
    pub engine_hash: wire::HashMode,
    /// Whose metric names, types and labels `/metrics` speaks.
    #[arg(long, value_enum, default_value_t = api::MetricsFlavor::Vllm)]
    pub metrics_flavor: api::MetricsFlavor,
}

/// The endpoint of DP rank `rank`: TCP port plus the rank, as vLLM does.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> anyhow::Result<String> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    let (head, port) = endpoint
        .rsplit_once(':')
        .with_context(|| format!("endpoint {endpoint} has no port"))?;
    let port: u32 = port
        .parse()
        .with_context(|| format!("endpoint {endpoint} has a bad port"))?;
    Ok(format!("{head}:{}", port + rank))
}

/// Builds the simulator (binding its ZMQ sockets) without serving HTTP.
pub fn build(args: &Args) -> anyhow::Result<Arc<api::Sim>> {
    let ctx = zmq::Context::new();
    let mut ranks = Vec::new();
    for r in 0..args.dp_size.max(1) {
        let publisher = match &args.kv_events_endpoint {
            Some(ep) => Some(events::Publisher::start(
                &ctx,
                events::PublisherConfig {
                    rank: r,
                    endpoint: rank_endpoint(ep, r)?,
                    replay_endpoint: args
                        .kv_replay_endpoint
                        .as_deref()
                        .map(|e| rank_endpoint(e, r))
                        .transpose()?,
                    topic: args.kv_events_topic.clone(),
                    block_size: args.block_size as u32,
                    shape: args.event_shape,
                    hash_mode: args.engine_hash,
                    replay_topic_frame: args.replay_shape == "topic",
                    buffer_steps: args.replay_buffer_steps,
                },
            )?),
            None => None,
        };
        ranks.push(Arc::new(engine::Rank::new(
            r,
            args.block_size,
            args.num_gpu_blocks,
            args.max_running,
            args.prefill_lanes,
            publisher,
        )));
    }
    Ok(Arc::new(api::Sim {
        worker_id: args.worker_id,
        model: args.model.clone(),
        lora_modules: args.lora_modules.clone(),
        default_max_tokens: args.default_max_tokens,
        time: engine::TimeModel {
            prefill_us_per_token: args.prefill_us_per_token,
            decode_ms_per_token: args.decode_ms_per_token,
            decode_ms_per_running: args.decode_ms_per_running,
            speedup: args.speedup,
            instant: args.instant,
        },
        ranks,
        requests: Default::default(),
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        max_num_batched_tokens: args.max_num_batched_tokens,
        metrics_flavor: args.metrics_flavor,
    }))
}

/// Serves until the listener fails or the future is dropped.
pub async fn serve(listener: tokio::net::TcpListener, sim: Arc<api::Sim>) -> anyhow::Result<()> {
    use axum::serve::ListenerExt;
    // Without it a response written in two segments on a kept-alive
    // connection waits for the client's delayed ACK (Nagle): a 40 ms TTFT
    // tail that no vLLM shows.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
        }
    });
    axum::serve(listener, api::router(sim)).await?;
    Ok(())
}
