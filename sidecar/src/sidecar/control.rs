//! Changes to the catalog and the thresholds, made through the control
//! API: each takes effect in the fleet, in the workers' tasks and in the
//! next snapshot.

use crate::Sidecar;
use crate::config::WorkerSpec;
use crate::fleet::{FleetError, WorkerEntry};
use crate::tick;
use std::sync::Arc;
use std::time::Instant;

impl Sidecar {
    /// Registers a worker and starts scraping it; returns its entry as
    /// registered.
    pub(crate) fn add_worker(
        self: &Arc<Self>,
        spec: WorkerSpec,
    ) -> Result<WorkerEntry, FleetError> {
        let id = spec.worker_id;
        let entry = self.fleet().add_worker(spec, Instant::now())?.clone();
        self.worker_started(id);
        Ok(entry)
    }

    /// Applies a partial update (see [`crate::fleet::Fleet::patch_worker`])
    /// and restarts the worker's tasks.
    pub(crate) fn patch_worker(
        self: &Arc<Self>,
        id: u64,
        patch: &serde_json::Value,
    ) -> Result<WorkerEntry, FleetError> {
        let entry = self
            .fleet()
            .patch_worker(id, patch, Instant::now())?
            .clone();
        self.worker_stopped(id);
        self.worker_started(id);
        self.publish_now();
        Ok(entry)
    }

    pub(crate) fn remove_worker(&self, id: u64) -> Result<(), FleetError> {
        let w = {
            let mut f = self.fleet();
            let w = f.remove_worker(id)?;
            f.planner_forget(id);
            w
        };
        {
            let mut b = self.bookings();
            for slot in w.slots() {
                b.drop_slot(*slot);
            }
        }
        self.worker_stopped(id);
        self.publish_now();
        Ok(())
    }

    /// Sets thresholds for `model` and publishes at once, so the filter
    /// has them within one snapshot interval.
    pub(crate) fn set_thresholds(
        &self,
        model: &str,
        t: kvgate_core::Thresholds,
    ) -> Result<(), FleetError> {
        self.fleet().set_thresholds(model, t)?;
        self.metrics()
            .snapshot
            .threshold_changes
            .with_label_values(&[model])
            .inc();
        tracing::info!(model, ?t, "busy thresholds changed");
        self.publish_now();
        Ok(())
    }

    /// Starts scraping a worker and subscribing to its KV events.
    pub(crate) fn worker_started(self: &Arc<Self>, id: u64) {
        let Some((spec, slots)) = self
            .fleet()
            .worker(id)
            .map(|w| (w.spec().clone(), w.slots().to_vec()))
        else {
            return;
        };
        let scraper = tokio::spawn(tick::scrape_loop(self.clone(), id));
        self.workers().start(&spec, &slots, scraper, self.plane());
    }

    /// Stops a worker's scraper and subscribers and drops its index entries.
    fn worker_stopped(&self, id: u64) {
        self.workers().stop(id, self.plane());
    }
}
