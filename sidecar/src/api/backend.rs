//! What the HTTP API reads and changes: the sidecar behind it, as the API
//! sees it. The running sidecar (`crate::Sidecar`) implements this; the
//! API names only the trait and the state types below it, so that it
//! imports nothing from the wiring that starts it.

use super::FullReads;
use crate::config::{Config, WorkerSpec};
use crate::fleet::{Fleet, FleetError, RankId, WorkerEntry};
use crate::metrics::Metrics;
use crate::publish::{ShardLog, SnapshotStore, Versions};
use crate::replica::ReplicaSync;
use crate::sources::bookings::{Bookings, LedgerError, Load};
use crate::sources::kv::plane::Plane;
use parking_lot::MutexGuard;
use std::sync::Arc;
use std::time::Duration;

pub trait Backend: Send + Sync + 'static {
    fn config(&self) -> &Config;
    fn fleet(&self) -> MutexGuard<'_, Fleet>;
    /// The load ledger: gateways' bookings, reservations, peers' load.
    fn bookings(&self) -> MutexGuard<'_, Bookings>;
    fn metrics(&self) -> &Metrics;
    fn store(&self) -> &SnapshotStore;
    fn versions(&self) -> &Versions;
    /// Every model's index shards as last published.
    fn shards(&self) -> &ShardLog;
    fn plane(&self) -> &Plane;
    fn replica(&self) -> Option<&ReplicaSync>;
    /// The whole-index copies readers share, and their cap.
    fn full_reads(&self) -> &FullReads;
    /// Whether start-up recovery from index peers is still under way.
    fn recovering(&self) -> bool;
    /// Notes that a gateway's long poll was answered.
    fn polled(&self);
    /// How long since a gateway last heard from the sidecar.
    fn poll_age(&self) -> Duration;

    /// Registers a worker and starts its tasks; its entry as registered.
    fn add_worker(self: Arc<Self>, spec: WorkerSpec) -> Result<WorkerEntry, FleetError>;
    /// Applies a partial update and restarts the worker's tasks.
    fn patch_worker(
        self: Arc<Self>,
        id: u64,
        patch: &serde_json::Value,
    ) -> Result<WorkerEntry, FleetError>;
    fn remove_worker(&self, id: u64) -> Result<(), FleetError>;
    /// Sets a model's busy thresholds and publishes them at once.
    fn set_thresholds(&self, model: &str, t: kvgate_core::Thresholds) -> Result<(), FleetError>;

    /// Applies a batch of gateway booking events.
    fn book(&self, events: Vec<kvgate_core::booking::Event>);
    /// Learns the routing decisions a gateway reported; how many were kept.
    fn learn(&self, records: &[kvgate_core::approx::Routed]) -> usize;

    /// Books a reservation on `rank` in `ledger` and tells the peers.
    fn reserve(
        &self,
        ledger: &mut Bookings,
        id: &str,
        rank: &RankId,
        load: Load,
    ) -> Result<(), LedgerError>;
    fn reservation_prefill_complete(&self, id: &str) -> Result<(), LedgerError>;
    fn reservation_output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), LedgerError>;
    fn free_reservation(&self, id: &str) -> Result<(), LedgerError>;
}
