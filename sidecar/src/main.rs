//! `kvgate-sidecar --config FILE`: runs the sidecar.
//! `kvgate-sidecar status [--url URL]`: prints a running sidecar's fleet
//! (and, with `KVGATE_CONTROL_TOKEN` set, the planner's reasons).
//! `kvgate-sidecar agent [--listen ADDR]`: serves this GPU node's NVML
//! readings under dcgm-exporter's metric names.
//! `kvgate-sidecar check --config FILE`: validates a configuration file.
//! `kvgate-sidecar profile --endpoint URL --model NAME ...`: measures the
//! rates one worker serves within an SLA, as `[models.planner]` profile
//! rows.

#![forbid(unsafe_code)]

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use http_body_util::BodyExt;
use kvgate_core::Thresholds;
use kvgate_sidecar::api::views::StateView;
use kvgate_sidecar::api::{listener, status};
use kvgate_sidecar::config::{Config, ListenerLimits};
use kvgate_sidecar::{Sidecar, api};
use std::net::SocketAddr;

/// Memory a burst took (request bodies, whole-index copies) goes back to
/// the system once freed, instead of staying in glibc's arenas.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "kvgate-sidecar",
    version,
    about = "Keeps Envoy's kvgate routing state fresh",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prints the fleet as a running sidecar sees it: workers, ranks, load,
    /// busy state and thresholds.
    Status {
        /// The sidecar's address.
        #[arg(long, default_value = "http://127.0.0.1:9190")]
        url: String,
    },
    /// Runs on a GPU node without dcgm-exporter: reads the node's GPUs
    /// through NVML and serves them at /metrics under dcgm-exporter's
    /// names, for sidecars' `[thermal] dcgm_urls`.
    Agent {
        /// dcgm-exporter's port by default.
        #[arg(long, default_value = "0.0.0.0:9400")]
        listen: SocketAddr,
        #[arg(long, default_value_t = 1000)]
        interval_ms: u64,
    },
    /// Reads and validates a configuration file as a start would, then
    /// exits: 0 when the sidecar would accept it, non-zero with the reason
    /// when not. Opens no socket and reaches no worker.
    Check {
        /// The TOML configuration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Measures, for each prompt and answer length, the highest request
    /// rate one worker serves within the SLA (open-loop Poisson arrivals,
    /// streamed completions timed at the client), and prints the
    /// `profile = [...]` rows of the model's `[models.planner]`.
    Profile(ProfileArgs),
}

#[derive(Debug, Args)]
struct ProfileArgs {
    /// The worker to profile, `http://HOST:PORT`: one worker, not a
    /// gateway, with nothing else sent to it during the sweep.
    #[arg(long)]
    endpoint: String,
    /// The model name the worker serves.
    #[arg(long)]
    model: String,
    /// `both`: whole requests, judged by TTFT and ITL; `prefill`: prompts
    /// only (one token), judged by TTFT; `decode`: judged by ITL (the
    /// worker computes the prompts too, so the figure is conservative).
    #[arg(long, default_value = "both", value_parser = parse_role)]
    role: kvgate_core::Role,
    /// Prompt lengths, tokens.
    #[arg(long, value_delimiter = ',', required = true)]
    isl: Vec<u32>,
    /// Answer lengths, tokens (ignored for `prefill`).
    #[arg(long, value_delimiter = ',', default_value = "128")]
    osl: Vec<u32>,
    /// p90 time to first token a rate must meet (`both`, `prefill`).
    #[arg(long)]
    ttft_ms: Option<f64>,
    /// p90 inter-token latency a rate must meet (`both`, `decode`).
    #[arg(long)]
    itl_ms: Option<f64>,
    /// Seconds each rate is offered for.
    #[arg(long, default_value_t = 20.0)]
    duration_s: f64,
    /// No rate above this is tried (requests per second).
    #[arg(long, default_value_t = 64.0)]
    max_rps: f64,
    /// Requests each rate sends at least (a low rate's step lasts longer).
    #[arg(long, default_value_t = 10)]
    min_requests: usize,
    /// Midpoints tried between the last rate that passed and the first
    /// that failed.
    #[arg(long, default_value_t = 3)]
    bisect_steps: u32,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 256)]
    max_in_flight: usize,
    /// One request's limit, seconds (default: four times what the SLA
    /// allows it, at least 10).
    #[arg(long)]
    request_timeout_s: Option<f64>,
    /// Writes the rows here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn parse_role(s: &str) -> Result<kvgate_core::Role, String> {
    kvgate_core::Role::ALL
        .into_iter()
        .find(|r| r.as_str() == s)
        .ok_or_else(|| format!("expected both, prefill or decode, got {s:?}"))
}

/// A non-negative, finite number of seconds.
fn seconds(what: &str, s: f64) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("--{what} must be a number of seconds above 0, got {s}"))
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The TOML configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Overrides `server.listen`.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Sheds when active decode blocks exceed this fraction (0-1) of a
    /// rank's KV cache; applies to every model, over the file.
    #[arg(long)]
    active_decode_blocks_threshold: Option<f64>,
    /// Sheds when a rank's active prefill tokens exceed this many.
    #[arg(long)]
    active_prefill_tokens_threshold: Option<u64>,
    /// Sheds when a rank's active prefill tokens exceed this multiple of its
    /// max_num_batched_tokens.
    #[arg(long)]
    active_prefill_tokens_threshold_frac: Option<f64>,
    /// Takes no more requests on a decode worker with this many in flight.
    #[arg(long)]
    active_decode_requests_threshold: Option<u64>,
    /// Binds the replica-sync PUB socket on this port, all interfaces
    /// (overrides `replica_sync.listen`).
    #[arg(long)]
    replica_sync_port: Option<u16>,
    /// Peers' replica-sync endpoints, `tcp://host:port`, comma-separated
    /// (overrides `replica_sync.peers`).
    #[arg(long, value_delimiter = ',')]
    replica_sync_peers: Option<Vec<String>>,
    /// Peers (`http://host:port`, comma-separated, tried in order) whose
    /// `GET /dump` seeds the prefix index at start; over `indexer.peers`.
    #[arg(long, value_name = "URL[,URL...]", value_delimiter = ',')]
    indexer_peers: Option<Vec<String>>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // To stderr: `status` and `profile` print their answers to stdout.
    kvgate_sidecar::init_logging();
    match cli.command {
        Some(Command::Profile(args)) => profile(args).await,
        Some(Command::Status { url }) => print_status(&url).await,
        Some(Command::Agent {
            listen,
            interval_ms,
        }) => {
            kvgate_sidecar::sources::thermal::agent::run(
                listen,
                std::time::Duration::from_millis(interval_ms),
            )
            .await
        }
        Some(Command::Check { config }) => check(&config),
        None => run(cli.run).await,
    }
}

async fn profile(args: ProfileArgs) -> anyhow::Result<()> {
    let opts = kvgate_sidecar::profile::SweepOptions {
        endpoint: args.endpoint,
        model: args.model,
        role: args.role,
        isl: args.isl,
        osl: args.osl,
        ttft_ms: args.ttft_ms,
        itl_ms: args.itl_ms,
        step: seconds("duration-s", args.duration_s)?,
        max_rps: args.max_rps,
        min_requests: args.min_requests,
        bisect_steps: args.bisect_steps,
        max_in_flight: args.max_in_flight,
        request_timeout: args
            .request_timeout_s
            .map(|s| seconds("request-timeout-s", s))
            .transpose()?,
    };
    let header = opts.header();
    let sweep = kvgate_sidecar::profile::run(&opts).await?;
    let mut header_lines = header;
    for note in &sweep.notes {
        header_lines.push_str("\nnote: ");
        header_lines.push_str(note);
    }
    let text = kvgate_sidecar::profile::to_toml(&sweep.rows, &header_lines);
    match args.out {
        Some(path) => {
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            tracing::info!(rows = sweep.rows.len(), out = %path.display(), "profile written");
        }
        None => print!("{text}"),
    }
    Ok(())
}

fn check(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    println!(
        "{}: valid ({} models, {} workers, listens on {})",
        path.display(),
        config.models.len(),
        config.workers.len(),
        config.server.listen
    );
    Ok(())
}

async fn print_status(url: &str) -> anyhow::Result<()> {
    let uri: hyper::Uri = format!("{}/v1/state", url.trim_end_matches('/'))
        .parse()
        .with_context(|| format!("bad --url {url:?}"))?;
    let client = kvgate_sidecar::sources::metrics::scrape::client();
    let resp = client
        .get(uri.clone())
        .await
        .with_context(|| format!("cannot reach the sidecar at {uri}"))?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    anyhow::ensure!(status.is_success(), "{uri} answered {status}");
    let state: StateView = serde_json::from_slice(&body)
        .with_context(|| format!("{uri} did not answer the state as JSON"))?;
    print!("{}", status::render(&state));
    // The planner's reasons sit behind the control token, when one is set.
    // Without a token in hand they are not asked for: a sidecar that has
    // one would answer 401 and count it in
    // kvgate_sidecar_unauthorized_total, the series operators watch for a
    // filter whose token does not match.
    let token = std::env::var("KVGATE_CONTROL_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    let Some(token) = token else {
        if state.models.iter().any(|m| m.plan.is_some()) {
            println!(
                "\nthe planner's reasons: run with KVGATE_CONTROL_TOKEN set (the sidecar's token, any value if it has none)"
            );
        }
        return Ok(());
    };
    let uri: hyper::Uri = format!("{}/v1/planner", url.trim_end_matches('/')).parse()?;
    let req = hyper::Request::get(uri).header("authorization", format!("Bearer {token}"));
    if let Ok(req) = req.body(http_body_util::Empty::new())
        && let Ok(resp) = client.request(req).await
        && resp.status().is_success()
    {
        let body = resp.into_body().collect().await?.to_bytes();
        if let Ok(v) = serde_json::from_slice::<api::planner::PlannerView>(&body) {
            print!("{}", status::render_planner(&v));
        }
    }
    Ok(())
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let path = args
        .config
        .context("--config FILE is required to run the sidecar")?;
    let mut config = Config::load(&path)?;
    if let Some(l) = args.listen {
        config.server.listen = l;
    }
    config.override_thresholds(&Thresholds {
        active_decode_blocks: args.active_decode_blocks_threshold,
        active_prefill_tokens: args.active_prefill_tokens_threshold,
        active_prefill_tokens_frac: args.active_prefill_tokens_threshold_frac,
        active_decode_requests: args.active_decode_requests_threshold,
    })?;
    if let Some(port) = args.replica_sync_port {
        config.replica_sync.listen = Some(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    if let Some(peers) = args.replica_sync_peers {
        config.replica_sync.peers = peers;
    }
    config
        .replica_sync
        .validate()
        .map_err(|e| anyhow::anyhow!(e))?;
    if let Some(peers) = args.indexer_peers {
        config.set_indexer_peers(peers)?;
    }
    config.resolve_token()?;
    let listen = config.server.listen;
    let selection = config.selection.listen;
    let (api_limits, selection_limits) =
        fd_bounded(config.server.limits(), config.selection.limits());
    let token = config.control.token.clone();
    let guarded = token.is_some();
    let sc = Sidecar::start(config)?;
    let api_listener = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(%listen, workers = sc.worker_count(), control_token = guarded, "kvgate-sidecar serving");
    if let Some(addr) = selection {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for the selection API on {addr}"))?;
        tracing::info!(listen = %addr, "selection API serving");
        let app = api::selection_router(sc.clone());
        let series = sc.metrics().listener.series("selection");
        tokio::spawn(listener::serve(
            l,
            "selection",
            app,
            selection_limits,
            token.clone(),
            series,
            std::future::pending(),
        ));
    }
    let shutdown = kvgate_sidecar::shutdown_signal();
    let series = sc.metrics().listener.series("api");
    listener::serve(
        api_listener,
        "api",
        api::router(sc),
        api_limits,
        token,
        series,
        shutdown,
    )
    .await;
    Ok(())
}

/// Lowers each listener's connection cap to a quarter of the soft file
/// limit: at their caps both listeners together hold half the process's
/// descriptors, and the other half stays with the sidecar's scrapes, GPU
/// readings, ZMQ sockets and peers, which inbound clients must never
/// starve.
fn fd_bounded(api: ListenerLimits, selection: ListenerLimits) -> (ListenerLimits, ListenerLimits) {
    let nofile = listener::open_files_limit();
    let bound = |mut l: ListenerLimits, name: &str| {
        let cap = listener::cap_for_file_limit(l.max_connections, nofile);
        if cap < l.max_connections {
            tracing::warn!(
                listener = name,
                max_connections = l.max_connections,
                open_files_limit = nofile,
                cap,
                "max_connections lowered to a quarter of the open-files limit; raise the limit (ulimit -n) for more"
            );
        }
        l.max_connections = cap;
        l
    };
    let (api, selection) = (bound(api, "api"), bound(selection, "selection"));
    tracing::info!(
        open_files_limit = nofile,
        api_max_connections = api.max_connections,
        selection_max_connections = selection.max_connections,
        header_read_timeout_ms = api.header_read_timeout.as_millis() as u64,
        idle_timeout_ms = api.idle_timeout.as_millis() as u64,
        "listener limits"
    );
    (api, selection)
}
