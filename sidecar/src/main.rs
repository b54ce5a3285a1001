//! `kvgate-sidecar --config FILE`: runs the sidecar.

use clap::Parser;
use kvgate_sidecar::config::Config;
use kvgate_sidecar::{Sidecar, api};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "kvgate-sidecar",
    about = "Keeps Envoy's kvgate routing state fresh"
)]
struct Args {
    /// The TOML configuration file.
    #[arg(long)]
    config: PathBuf,
    /// Overrides `server.listen`.
    #[arg(long)]
    listen: Option<SocketAddr>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let mut config = Config::load(&args.config)?;
    if let Some(l) = args.listen {
        config.server.listen = l;
    }
    let listen = config.server.listen;
    let sc = Sidecar::start(config)?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(%listen, workers = sc.fleet().workers.len(), "kvgate-sidecar serving");
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {},
        }
    };
    axum::serve(listener, api::router(sc))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}
