//! kvgate-sim: a simulated vLLM worker.
//!
//! It stands in for a GPU worker in kvgate's tests, demo and benchmarks, and
//! speaks a real engine's interfaces: the OpenAI HTTP API (streaming and
//! not), vLLM's Prometheus metric names with values from its own state, and
//! vLLM's ZMQ KV-event wire format with the replay socket. Behind them sit a
//! prefix cache per data-parallel rank ([`cache`]) and a time model
//! ([`engine`]) that make cache hits and batch load show up in latency.
//! Its GPUs are a thermal plant ([`thermal`]) served as dcgm-exporter's
//! page, and it takes the seed's batch control ([`admin`]).

pub mod admin;
pub mod api;
pub mod cache;
pub mod disagg;
pub mod engine;
pub mod events;
pub mod thermal;
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
    /// The engine step's token budget: also the largest prefill chunk a
    /// decode step shares its step with (see `--prefill-interference`).
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
    /// Prefill/decode interference, as chunked prefill shows it on a GPU:
    /// a decode step that shares its engine step with N prompt tokens of
    /// the rank's running prefills (N at most `--max-num-batched-tokens`
    /// minus the running batch) takes N × this × `--prefill-us-per-token`
    /// longer. 0 (the default) keeps decode steps blind to prefills; 1
    /// charges each step its whole chunk's compute.
    #[arg(long, default_value_t = 0.0)]
    pub prefill_interference: f64,
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
    /// GPUs of the worker's tensor-parallel group, named
    /// `GPU-<gpu-uuid-prefix>-<i>`.
    #[arg(long, default_value_t = 1)]
    pub gpus: u32,
    /// Default: `sim-<listen port>`, so two sims' GPUs differ.
    #[arg(long)]
    pub gpu_uuid_prefix: Option<String>,
    #[arg(long, default_value_t = 25.0)]
    pub ambient_c: f64,
    /// °C per watt between a GPU and its ambient (its cooling).
    #[arg(long, default_value_t = 0.1)]
    pub thermal_r_c_per_w: f64,
    /// Thermal time constant; real GPUs take tens of seconds.
    #[arg(long, default_value_t = 20.0)]
    pub thermal_tau_s: f64,
    #[arg(long, default_value_t = 100.0)]
    pub idle_w: f64,
    /// Watts per running sequence. The seed measured about 3.2 W per decode
    /// sequence at 4k context on an H100; 14 W makes a simulated batch of
    /// 32 (idle 35 °C) settle just under 80 °C, as a real full batch does.
    #[arg(long, default_value_t = 14.0)]
    pub w_per_seq: f64,
    #[arg(long, default_value_t = 700.0)]
    pub power_limit_w: f64,
    #[arg(long, default_value_t = 87.0)]
    pub slowdown_c: f64,
    #[arg(long, default_value_t = 92.0)]
    pub shutdown_c: f64,
    /// Clock (and power) factor while slowing down.
    #[arg(long, default_value_t = 0.5)]
    pub slowdown_factor: f64,
    /// GPU i's ambient is i × this hotter.
    #[arg(long, default_value_t = 0.0)]
    pub gpu_skew_c: f64,
    /// Seconds after start at which the cooling degrades to
    /// `--degrade-r-c-per-w` and/or `--degrade-ambient-c`.
    #[arg(long)]
    pub degrade_at_s: Option<f64>,
    #[arg(long)]
    pub degrade_r_c_per_w: Option<f64>,
    #[arg(long)]
    pub degrade_ambient_c: Option<f64>,
    /// dcgm-exporter's pod mapping labels (`pod`, `namespace`).
    #[arg(long)]
    pub pod_name: Option<String>,
    #[arg(long, default_value = "default")]
    pub pod_namespace: String,
    /// `/v1/admin/batch` requires this file's token when given.
    #[arg(long)]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// A HuggingFace `tokenizer.json`: text prompts are tokenized with it
    /// (as vLLM does) instead of the built-in Llama-3-style one.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// `tokenizer_config.json`: the chat template and special tokens.
    #[arg(long)]
    pub tokenizer_config: Option<std::path::PathBuf>,
    /// A Jinja chat template over the config's (vLLM's `--chat-template`).
    #[arg(long)]
    pub chat_template: Option<std::path::PathBuf>,
    /// The worker's part in prefill/decode disaggregation, with vLLM's
    /// `kv_role` names. Unset: not disaggregated, PD fields in bodies are
    /// ignored. `kv_producer` serves prefill legs, `kv_consumer` decode
    /// legs, `kv_both` either (as every vLLM with NixlConnector does);
    /// ordinary requests are served by all. A leg the role cannot serve
    /// is a 400.
    #[arg(long, value_enum)]
    pub kv_role: Option<disagg::KvRole>,
    /// Whose PD protocol: `nixl` (vLLM's `kv_transfer_params` and side
    /// channel) or `sglang` (`bootstrap_host`/`_port`/`_room`; needs
    /// `kv_producer` or `kv_consumer`).
    #[arg(long, value_enum, default_value_t = disagg::PdProtocol::Nixl)]
    pub pd_protocol: disagg::PdProtocol,
    /// NIXL side-channel port of rank 0 on a prefill worker; rank r
    /// listens on this + r (vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`). 0: any
    /// free port per rank, named in prefill answers and `/sim/disagg`.
    #[arg(long, default_value_t = 5600)]
    pub kv_side_channel_port: u16,
    /// The host prefill answers name as `remote_host`. Default: the
    /// `--listen` address, or 127.0.0.1 when that is unspecified.
    #[arg(long)]
    pub kv_side_channel_host: Option<String>,
    /// How long a prefill leg's blocks are held for the decode leg's pull
    /// (wall milliseconds, not divided by `--speedup`); then the hold ends
    /// and a later pull finds them gone.
    #[arg(long, default_value_t = 30_000)]
    pub kv_lease_ms: u64,
    /// KV transfer bandwidth in Gbit/s of the link a worker's blocks are
    /// pulled over. The link is the holder's (the prefill worker's) and is
    /// shared: a lone pull takes blocks × `--kv-bytes-per-block` × 8 / this,
    /// n pulls in flight at once each get 1/n of it, and a decode leg's
    /// first token waits for its pull's bytes to be through. Divided by
    /// `--speedup`; none with `--instant` or 0. (An SGLang decode leg still
    /// waits the lone time, at its own worker's setting.)
    #[arg(long, default_value_t = 100.0)]
    pub kv_transfer_gbps: f64,
    /// Bytes of KV per block: the default is Llama-3-8B's (32 layers × 8
    /// KV heads × 128 dims × K and V × 2 bytes × 16 tokens).
    #[arg(long, default_value_t = 2 * 1024 * 1024)]
    pub kv_bytes_per_block: u64,
    /// A decode worker caches the blocks it receives but publishes no
    /// `BlockStored` for them (as some real decode workers are seen to).
    #[arg(long)]
    pub no_publish_received_blocks: bool,
    /// What a decode leg does when its blocks cannot be loaded (lease
    /// expired, unknown request, side channel or bootstrap unreachable):
    /// `fail` (vLLM's default: a 500) or `recompute` (prefill locally).
    #[arg(long, value_enum, default_value_t = disagg::LoadFailurePolicy::Fail)]
    pub kv_load_failure_policy: disagg::LoadFailurePolicy,
    /// SGLang bootstrap port of a prefill worker (SGLang's default 8998);
    /// 0: any free port, named in `/sim/disagg`.
    #[arg(long, default_value_t = disagg::SGLANG_BOOTSTRAP_PORT)]
    pub bootstrap_port: u16,
    /// SGLang's bootstrap and waiting timeouts (wall seconds): a prefill
    /// whose decode worker never joins, or a decode whose prefill never
    /// comes, fails after this.
    #[arg(long, default_value_t = 300.0)]
    pub bootstrap_timeout_s: f64,
    /// A prefill leg (NIXL's or SGLang's) is answered 200 with its headers
    /// and then no body, ever: the connection stays open until the client
    /// goes away, as a worker that stalls (or dies) mid-answer does. For
    /// tests of a router's prefill timeout.
    #[arg(long)]
    pub prefill_stall_after_headers: bool,
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
    let prefix = args
        .gpu_uuid_prefix
        .clone()
        .unwrap_or_else(|| format!("sim-{}", args.listen.port()));
    let plant = thermal::Plant::new(
        args.gpus,
        &prefix,
        thermal::PlantParams {
            ambient_c: args.ambient_c,
            r_c_per_w: args.thermal_r_c_per_w,
            tau_s: args.thermal_tau_s,
            idle_w: args.idle_w,
            w_per_seq: args.w_per_seq,
            power_limit_w: args.power_limit_w,
            slowdown_c: args.slowdown_c,
            shutdown_c: args.shutdown_c,
            slowdown_factor: args.slowdown_factor,
            skew_c: args.gpu_skew_c,
        },
        args.degrade_at_s.map(|s| thermal::Degrade {
            at: std::time::Duration::from_secs_f64(s.max(0.0)),
            r_c_per_w: args.degrade_r_c_per_w,
            ambient_c: args.degrade_ambient_c,
        }),
        args.pod_name
            .clone()
            .map(|p| (p, args.pod_namespace.clone())),
    );
    let admin_token = match &args.admin_token_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading {}", p.display()))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let text = match &args.tokenizer {
        Some(t) => tokenizer::RealText::load(
            t,
            args.tokenizer_config.as_deref(),
            args.chat_template.as_deref(),
        )?,
        None => tokenizer::RealText::builtin()?,
    };
    let listen_ip = args.listen.ip();
    let advertise_host = args.kv_side_channel_host.clone().unwrap_or_else(|| {
        if listen_ip.is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            listen_ip.to_string()
        }
    });
    let disagg = disagg::Disagg::build(
        disagg::Config {
            role: args.kv_role,
            protocol: args.pd_protocol,
            lease: std::time::Duration::from_millis(args.kv_lease_ms),
            transfer_gbps: args.kv_transfer_gbps,
            bytes_per_block: args.kv_bytes_per_block,
            speedup: args.speedup,
            instant: args.instant,
            publish_received: !args.no_publish_received_blocks,
            failure_policy: args.kv_load_failure_policy,
            bootstrap_timeout: std::time::Duration::from_secs_f64(
                args.bootstrap_timeout_s.max(0.0),
            ),
            advertise_host,
            pull_timeout: std::time::Duration::from_secs(10),
            stall_after_headers: args.prefill_stall_after_headers,
        },
        &ranks,
        listen_ip,
        &engine_id(args),
        args.kv_side_channel_port,
        args.bootstrap_port,
    )?;
    Ok(Arc::new(api::Sim {
        disagg,
        text,
        plant,
        admin_token,
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
            prefill_interference: args.prefill_interference,
            max_num_batched_tokens: args.max_num_batched_tokens,
        },
        ranks,
        requests: Default::default(),
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        max_num_batched_tokens: args.max_num_batched_tokens,
        metrics_flavor: args.metrics_flavor,
    }))
}

/// A prefill engine's id, unique per process as vLLM's (a UUID) is: a
/// decode worker that pulls from a restarted sim must not find it.
fn engine_id(args: &Args) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "kvgate-sim-{}-{}-{:x}",
        args.worker_id,
        args.listen.port(),
        nanos & 0xFFFF_FFFF_FFFF
    )
}

/// Serves until the listener fails or the future is dropped.
pub async fn serve(listener: tokio::net::TcpListener, sim: Arc<api::Sim>) -> anyhow::Result<()> {
    sim.disagg.start()?;
    use axum::serve::ListenerExt;
    // Without it a response written in two segments on a kept-alive
    // connection waits for the client's delayed ACK (Nagle): a 40 ms TTFT
    // tail that no vLLM shows.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
        }
    });
    // The GPUs follow the work in wall time, ten steps a second.
    let plant_sim = sim.clone();
    let stepping = tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
        loop {
            tick.tick().await;
            plant_sim.plant.step(plant_sim.running());
        }
    });
    let served = axum::serve(listener, api::router(sim)).await;
    stepping.abort();
    served?;
    Ok(())
}
