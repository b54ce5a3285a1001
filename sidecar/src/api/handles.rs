//! What the HTTP API reads and changes, one handle per resource. The
//! routers' state holds them all; each handler extracts only those it
//! uses (axum's `FromRef`). State is shared as it is: the fleet, the
//! ledger, what is published, a metric family. What acts on the running
//! sidecar (catalog changes that start and stop tasks, the gateways'
//! reports applied, reservations told to peers) is a trait here that the
//! wiring implements, so that the API imports nothing from it.

use super::FullReads;
use super::poll::LastPoll;
use crate::config::{Config, WorkerSpec};
use crate::fleet::{Fleet, FleetError, RankId, WorkerEntry};
use crate::metrics::{LedgerMetrics, ListenerMetrics, Metrics, SnapshotMetrics};
use crate::publish::{ShardLog, SnapshotStore, Versions};
use crate::recovery::Recovering;
use crate::replica::ReplicaSync;
use crate::sources::bookings::{Bookings, LedgerError, Load};
use crate::sources::kv::plane::Plane;
use axum::extract::FromRef;
use parking_lot::Mutex;
use std::sync::Arc;

/// The catalog and the thresholds, changed: each change takes effect in
/// the fleet, in the workers' tasks and in the next snapshot.
pub trait Catalog: Send + Sync {
    /// Registers a worker and starts its tasks; its entry as registered.
    fn add_worker(&self, spec: WorkerSpec) -> Result<WorkerEntry, FleetError>;
    /// Applies a partial update and restarts the worker's tasks.
    fn patch_worker(&self, id: u64, patch: &serde_json::Value) -> Result<WorkerEntry, FleetError>;
    fn remove_worker(&self, id: u64) -> Result<(), FleetError>;
    /// Sets a model's busy thresholds and publishes them at once.
    fn set_thresholds(&self, model: &str, t: kvgate_core::Thresholds) -> Result<(), FleetError>;
}

/// What the filter reports, applied.
pub trait Reports: Send + Sync {
    /// Applies a batch of gateway booking events.
    fn book(&self, events: Vec<kvgate_core::booking::Event>);
    /// Learns the routing decisions a gateway reported; how many were kept.
    fn learn(&self, records: &[kvgate_core::approx::Routed]) -> usize;
}

/// Reservations: the selection API's load, in the ledger the gateways
/// book in, and told to the replica-sync peers.
pub trait Reservations: Send + Sync {
    /// Books a reservation on `rank` in `ledger` for a request of
    /// `tenant`, held by the caller from the view it chose by to this
    /// booking.
    fn reserve(
        &self,
        ledger: &mut Bookings,
        id: &str,
        rank: &RankId,
        tenant: &str,
        load: Load,
    ) -> Result<(), LedgerError>;
    fn prefill_complete(&self, id: &str) -> Result<(), LedgerError>;
    fn output_block(&self, id: &str, decay_fraction: Option<f64>) -> Result<(), LedgerError>;
    fn free(&self, id: &str) -> Result<(), LedgerError>;
}

/// What a selection reads and books: the published snapshot and index
/// shards, the fleet for each model's booking bound, the ledger, and the
/// reservations' and reports' effects. The selection API's handlers and
/// [`super::route`] take it.
pub struct Selection {
    pub(crate) store: Arc<SnapshotStore>,
    pub(crate) shards: Arc<ShardLog>,
    pub(crate) fleet: Arc<Mutex<Fleet>>,
    /// The load ledger: gateways' bookings, reservations, peers' load.
    pub(crate) ledger: Arc<Mutex<Bookings>>,
    pub(crate) reservations: Arc<dyn Reservations>,
    /// Where a front door that routes hands its routing decisions.
    pub(crate) reports: Arc<dyn Reports>,
    /// Counts requests refused for their model's bound.
    pub(crate) metrics: Arc<LedgerMetrics>,
}

/// The routers' state.
#[derive(Clone)]
pub struct Handles {
    pub(crate) config: Arc<Config>,
    /// Every family, for `/metrics`; handlers count into their own.
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) listener_metrics: Arc<ListenerMetrics>,
    pub(crate) snapshot_metrics: Arc<SnapshotMetrics>,
    pub(crate) selection: Arc<Selection>,
    pub(crate) versions: Arc<Versions>,
    pub(crate) plane: Arc<Plane>,
    pub(crate) replica: Option<Arc<ReplicaSync>>,
    pub(crate) full_reads: Arc<FullReads>,
    pub(crate) last_poll: LastPoll,
    pub(crate) recovering: Recovering,
    pub(crate) catalog: Arc<dyn Catalog>,
}

/// Each handle is extracted as a clone of the router state's.
macro_rules! handle {
    ($($ty:ty => |$h:ident| $get:expr;)*) => {
        $(impl FromRef<Handles> for $ty {
            fn from_ref($h: &Handles) -> $ty {
                $get.clone()
            }
        })*
    };
}

handle! {
    Arc<Config> => |h| h.config;
    Arc<Metrics> => |h| h.metrics;
    Arc<ListenerMetrics> => |h| h.listener_metrics;
    Arc<SnapshotMetrics> => |h| h.snapshot_metrics;
    Arc<LedgerMetrics> => |h| h.selection.metrics;
    Arc<Selection> => |h| h.selection;
    Arc<SnapshotStore> => |h| h.selection.store;
    Arc<ShardLog> => |h| h.selection.shards;
    Arc<Mutex<Fleet>> => |h| h.selection.fleet;
    Arc<Mutex<Bookings>> => |h| h.selection.ledger;
    Arc<dyn Reservations> => |h| h.selection.reservations;
    Arc<dyn Reports> => |h| h.selection.reports;
    Arc<Versions> => |h| h.versions;
    Arc<Plane> => |h| h.plane;
    Option<Arc<ReplicaSync>> => |h| h.replica;
    Arc<FullReads> => |h| h.full_reads;
    LastPoll => |h| h.last_poll;
    Recovering => |h| h.recovering;
    Arc<dyn Catalog> => |h| h.catalog;
}
