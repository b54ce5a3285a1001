use clap::Parser;
use kvgate_sim::{Args, build, serve};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let sim = build(&args)?;
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(listen = %args.listen, model = %args.model, worker = args.worker_id, ranks = args.dp_size, "kvgate-sim serving");
    tokio::select! {
        r = serve(listener, sim) => r,
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
