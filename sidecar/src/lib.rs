//! kvgate-sidecar: keeps Envoy's routing state fresh.
//!
//! It runs next to Envoy in each gateway pod and does everything that must
//! stay off the request path. Data flows one way through its modules, and
//! so do their imports: none imports from a module later in the flow
//! (`tests/data_flow.rs` checks it; docs/architecture.md, "Data flow
//! inside the sidecar", has the table).
//!
//! * Ground, importable by all: [`config`], [`metrics`] (one module per
//!   family), the clock, and [`prompt`] (a model's prompt files, whose
//!   vocabulary the KV index reads).
//! * [`sources`]: what comes in. Every worker's Prometheus page, scraped
//!   for load ([`sources::metrics`]); every rank's ZMQ KV events, folded
//!   into the prefix index ([`sources::kv`]); the gateways' bookings and
//!   routing decisions ([`sources::bookings`], `sources::routed`); GPU
//!   readings ([`sources::thermal`]). [`replica`] is a source too: the
//!   load other gateway pods' sidecars book, so that several pods see one
//!   fleet; and so is the start-up recovery of the index from a peer's
//!   dump.
//! * [`fleet`]: the state kept from them. The worker catalog (from the
//!   config file and the `/workers` API), health, thermal controllers,
//!   the planner's state, and the snapshot built from all of it. Beside
//!   it, the thermal loop, which steps the controllers with the handles
//!   it is given, and [`planner`], the replica planner's decision math.
//! * [`publish`] and [`api`]: what goes out. Versioned snapshots and index
//!   shards, long-polled by the snapshot service inside Envoy; the HTTP
//!   APIs, metrics and the catalog as Envoy's routed cluster. `publish`
//!   reads only the fleet, never a source; the API's handlers take the
//!   handles they use from [`api::Handles`], and reach what only the
//!   wiring can do through traits it implements ([`api::Catalog`],
//!   [`api::Reports`], [`api::Reservations`]).
//! * The wiring, which may import everything: [`Sidecar`] (its start-up,
//!   which builds every part and hands each task and handler its handles,
//!   and what acts on more than one part: publishing, catalog changes,
//!   inputs applied, the ledger told to peers, reservations); the
//!   lifecycle module, which starts and stops each worker's scraper and KV
//!   subscribers as the catalog changes; and the tick module's publish,
//!   scrape and planner loops, each handed its handles.

#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod api;
mod clock;
pub mod config;
pub mod fleet;
mod lifecycle;
pub mod metrics;
pub mod planner;
pub mod profile;
pub mod prompt;
pub mod publish;
mod recovery;
pub mod replica;
mod sidecar;
pub mod sources;
mod thermal;
mod tick;

pub use sidecar::Sidecar;

/// Logs to stderr at `RUST_LOG`'s levels (`info` without it): the sidecar
/// and the programs that embed one (`kvgate-extproc`) log alike.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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
