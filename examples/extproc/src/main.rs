//! `kvgate-extproc --config FILE --grpc-listen ADDR [--listen ADDR]`:
//! kvgate's decision behind Envoy's `ext_proc` filter, the architecture
//! peers use (Gateway API Inference Extension, llm-d, AIBrix: an endpoint
//! picker outside the proxy, consulted over a gRPC stream per request).
//!
//! It exists to compare that architecture with the filter's in-proxy
//! decision on equal terms (`cargo xtask bench --only overhead`): the
//! endpoint picker holds the fleet state in its own process, as peers'
//! do, so this binary runs a whole sidecar in-process from the same TOML
//! file (it scrapes the same workers, ingests the same KV events) and
//! decides through the sidecar's own selection path
//! (`kvgate_sidecar::api::route`: the snapshot with the ledger's load, the
//! index shards, `kvgate_core::plan`, a reservation per request). Requests
//! are parsed by `kvgate_core::plan::request::parse`, the filter's parser.
//!
//! The in-process sidecar serves its HTTP API (`/v1/state`, `/metrics`,
//! ...) on `server.listen`, or `--listen` when the normal sidecar runs
//! beside it with the same file.

#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod reply;
mod service;
mod templates;

use anyhow::Context;
use clap::Parser;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use kvgate_core::header;
use kvgate_sidecar::config::Config;
use kvgate_sidecar::{Sidecar, api};
use service::{Names, Processor, Shared};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "kvgate-extproc",
    about = "kvgate's routing decision as an Envoy ext_proc server, with a sidecar in-process"
)]
struct Cli {
    /// The sidecar's TOML configuration.
    #[arg(long)]
    config: PathBuf,
    /// The ext_proc gRPC listener (HTTP/2 without TLS).
    #[arg(long, default_value = "127.0.0.1:9193")]
    grpc_listen: SocketAddr,
    /// Overrides `server.listen`: the in-process sidecar's HTTP API.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// The header Envoy's override-host balancer reads the worker from.
    #[arg(long, default_value = header::DESTINATION)]
    destination_header: String,
    #[arg(long, default_value = header::RANK)]
    rank_header: String,
    /// Set by authentication in front of this filter, never by clients.
    #[arg(long, default_value = header::TENANT)]
    tenant_header: String,
    /// Response header naming the worker and rank chosen; empty: none.
    #[arg(long, default_value = header::SERVED_BY)]
    served_by_header: String,
    /// `Retry-After` of a shed request when the snapshot has no estimate.
    #[arg(long, default_value_t = 1)]
    retry_after_s: u32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvgate_sidecar::init_logging();
    let cli = Cli::parse();
    let mut config = Config::load(&cli.config)?;
    if let Some(l) = cli.listen {
        config.server.listen = l;
    }
    config.resolve_token()?;
    let listen = config.server.listen;
    let sc = Sidecar::start(config)?;
    let http = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen for the sidecar API on {listen}"))?;
    let app = api::router(sc.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(http, app).await {
            tracing::error!(error = %e, "the sidecar API listener failed");
        }
    });
    let processor = Processor::new(Shared {
        sidecar: sc.clone(),
        names: Names {
            destination: cli.destination_header,
            rank: cli.rank_header,
            tenant: cli.tenant_header,
            served_by: cli.served_by_header,
            retry_after_s: cli.retry_after_s,
        },
        templates: templates::Templates::default(),
    });
    tracing::info!(grpc = %cli.grpc_listen, sidecar = %listen, workers = sc.worker_count(), "kvgate-extproc serving");
    let shutdown = kvgate_sidecar::shutdown_signal();
    tonic::transport::Server::builder()
        // Answers are small and each one gates a request in Envoy.
        .tcp_nodelay(true)
        .add_service(ExternalProcessorServer::new(processor))
        .serve_with_shutdown(cli.grpc_listen, shutdown)
        .await
        .context("the ext_proc listener failed")?;
    Ok(())
}
