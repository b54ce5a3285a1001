//! Changes to the catalog and the thresholds, made through the control
//! API: each takes effect in the fleet, in the workers' tasks and in the
//! next snapshot.

use super::publisher::Publisher;
use crate::api::Catalog;
use crate::config::WorkerSpec;
use crate::fleet::{Fleet, FleetError, WorkerEntry};
use crate::lifecycle::Lifecycle;
use crate::metrics::SnapshotMetrics;
use crate::sources::bookings::Bookings;
use crate::sources::kv::plane::Plane;
use crate::tick::{self, ScrapeHandles};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

/// What a catalog change reaches: the fleet, the ledger's slots, the
/// workers' tasks and the index's slots; and the snapshot, published at
/// once.
#[derive(Clone)]
pub(crate) struct Control {
    pub(super) fleet: Arc<Mutex<Fleet>>,
    pub(super) bookings: Arc<Mutex<Bookings>>,
    pub(super) lifecycle: Arc<Lifecycle>,
    pub(super) plane: Arc<Plane>,
    pub(super) publisher: Publisher,
    /// What each worker's scrape loop is started with.
    pub(super) scrape: ScrapeHandles,
    pub(super) metrics: Arc<SnapshotMetrics>,
}

impl Catalog for Control {
    /// Registers a worker and starts scraping it; returns its entry as
    /// registered.
    fn add_worker(&self, spec: WorkerSpec) -> Result<WorkerEntry, FleetError> {
        let id = spec.worker_id;
        let entry = self.fleet.lock().add_worker(spec, Instant::now())?.clone();
        self.worker_started(id);
        Ok(entry)
    }

    /// Applies a partial update (see [`crate::fleet::Fleet::patch_worker`])
    /// and restarts the worker's tasks.
    fn patch_worker(&self, id: u64, patch: &serde_json::Value) -> Result<WorkerEntry, FleetError> {
        let entry = self
            .fleet
            .lock()
            .patch_worker(id, patch, Instant::now())?
            .clone();
        self.worker_stopped(id);
        self.worker_started(id);
        self.publisher.publish_now();
        Ok(entry)
    }

    fn remove_worker(&self, id: u64) -> Result<(), FleetError> {
        let w = {
            let mut f = self.fleet.lock();
            let w = f.remove_worker(id)?;
            f.planner_forget(id);
            w
        };
        {
            let mut b = self.bookings.lock();
            for slot in w.slots() {
                b.drop_slot(*slot);
            }
        }
        self.worker_stopped(id);
        self.publisher.publish_now();
        Ok(())
    }

    /// Sets thresholds for `model` and publishes at once, so the filter
    /// has them within one snapshot interval.
    fn set_thresholds(&self, model: &str, t: kvgate_core::Thresholds) -> Result<(), FleetError> {
        self.fleet.lock().set_thresholds(model, t)?;
        self.metrics
            .threshold_changes
            .with_label_values(&[model])
            .inc();
        tracing::info!(model, ?t, "busy thresholds changed");
        self.publisher.publish_now();
        Ok(())
    }
}

impl Control {
    /// Starts scraping a worker and subscribing to its KV events.
    pub(super) fn worker_started(&self, id: u64) {
        let Some((spec, slots)) = self
            .fleet
            .lock()
            .worker(id)
            .map(|w| (w.spec().clone(), w.slots().to_vec()))
        else {
            return;
        };
        let scraper = tokio::spawn(tick::scrape_loop(self.scrape.clone(), id));
        self.lifecycle.start(&spec, &slots, scraper, &self.plane);
    }

    /// Stops a worker's scraper and subscribers and drops its index entries.
    fn worker_stopped(&self, id: u64) {
        self.lifecycle.stop(id, &self.plane);
    }
}
