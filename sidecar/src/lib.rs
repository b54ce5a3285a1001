//! kvgate-sidecar: keeps Envoy's routing state fresh.
//!
//! It runs next to Envoy in each gateway pod and does everything that must
//! stay off the request path. Data flows one way through its folders:
//!
//! * [`sources`]: what comes in. Every worker's Prometheus page, scraped
//!   for load ([`sources::metrics`]); every rank's ZMQ KV events, folded
//!   into the prefix index ([`sources::kv`]); the gateways' bookings and
//!   routing decisions (`sources::bookings`, `sources::routed`).
//! * `fleet`: the state kept from them. The worker catalog (from the
//!   config file and the `/workers` API), health, and the snapshot built
//!   from all of it.
//! * [`publish`] and [`api`]: what goes out. Versioned snapshots and index
//!   shards, long-polled by the snapshot service inside Envoy; the HTTP
//!   APIs, metrics and the catalog as Envoy's routed cluster.
//!
//! * [`replica`]: what other gateway pods' sidecars share: the load each
//!   books, so that several pods see one fleet.
//! * `thermal`: the loop that reads GPU temperatures, steps each worker's
//!   thermal controller and cuts engines' running batches.
//! * [`planner`]: how many replicas each model needs (the decision math;
//!   its state and loop are `fleet`'s and `tick`'s).
//!
//! [`Sidecar`] holds it together; the lifecycle module starts and stops
//! each worker's scraper and KV subscribers as the catalog changes, and
//! the tick module runs the publish and scrape loops.

#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod api;
mod clock;
pub mod config;
mod control;
pub mod fleet;
mod ingest;
mod lifecycle;
pub mod metrics;
pub mod planner;
pub mod prompt;
pub mod publish;
mod recovery;
pub mod replica;
mod reservations;
mod sidecar;
pub mod sources;
mod thermal;
mod tick;

pub use sidecar::Sidecar;

/// Logs to stderr at `RUST_LOG`'s levels (`info` without it): the sidecar
/// and the programs that embed one (`kvgate-extproc`) log alike.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
}

/// Resolves on Ctrl-C or SIGTERM (how Kubernetes stops a pod): the
/// servers' graceful-shutdown signal.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {},
    }
}
