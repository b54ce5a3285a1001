//! The catalog: which workers exist, the slots their ranks hold, and the
//! models' live thresholds.

use super::{Fleet, FleetError, Health, WorkerEntry};
use crate::config::WorkerSpec;
use crate::sources::metrics::promtext::RankMetrics;
use kvgate_core::Thresholds;
use std::time::Instant;

#[derive(Debug, Default)]
pub(super) struct Slots {
    next: u32,
    free: Vec<u16>,
}

impl Slots {
    pub(super) fn take(&mut self) -> Option<u16> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let s = u16::try_from(self.next).ok()?;
        self.next += 1;
        Some(s)
    }
}

impl Fleet {
    /// Registers a worker. It is not schedulable until its first scrape.
    pub fn add_worker(
        &mut self,
        mut spec: WorkerSpec,
        now: Instant,
    ) -> Result<&WorkerEntry, FleetError> {
        spec.normalize().map_err(FleetError::Invalid)?;
        if self.workers.contains_key(&spec.worker_id) {
            return Err(FleetError::Duplicate(spec.worker_id));
        }
        if !self.models.contains_key(&spec.model_name) {
            return Err(FleetError::UnknownModel(spec.model_name.clone()));
        }
        let mut slots = Vec::new();
        for _ in 0..spec.data_parallel_size {
            match self.slots.take() {
                Some(s) => slots.push(s),
                None => {
                    self.slots.free.extend(slots);
                    return Err(FleetError::SlotsExhausted);
                }
            }
        }
        let n = spec.data_parallel_size as usize;
        let id = spec.worker_id;
        self.workers.insert(
            id,
            WorkerEntry {
                spec,
                slots,
                health: Health {
                    up: false,
                    last_ok: None,
                    added: now,
                    last_error: None,
                    scrapes: 0,
                    scrape_errors: 0,
                },
                ranks: vec![RankMetrics::default(); n],
                latches: vec![false; n],
                thermal: Default::default(),
                in_flight: 0,
            },
        );
        Ok(&self.workers[&id])
    }

    pub fn remove_worker(&mut self, id: u64) -> Result<WorkerEntry, FleetError> {
        let w = self
            .workers
            .remove(&id)
            .ok_or(FleetError::UnknownWorker(id))?;
        self.slots.free.extend(w.slots.iter().copied());
        Ok(w)
    }

    /// Applies a partial update (a JSON object of `WorkerSpec` fields). The
    /// worker is re-registered, so a changed DP size gets new slots and a
    /// changed endpoint waits for a fresh scrape.
    pub fn patch_worker(
        &mut self,
        id: u64,
        patch: &serde_json::Value,
        now: Instant,
    ) -> Result<&WorkerEntry, FleetError> {
        let current = self.workers.get(&id).ok_or(FleetError::UnknownWorker(id))?;
        let mut merged =
            serde_json::to_value(&current.spec).map_err(|e| FleetError::Invalid(e.to_string()))?;
        let (Some(m), Some(p)) = (merged.as_object_mut(), patch.as_object()) else {
            return Err(FleetError::Invalid(
                "a PATCH body must be a JSON object".into(),
            ));
        };
        for (k, v) in p {
            if k == "worker_id" && v.as_u64() != Some(id) {
                return Err(FleetError::Invalid("worker_id cannot be changed".into()));
            }
            m.insert(k.clone(), v.clone());
        }
        let spec: WorkerSpec =
            serde_json::from_value(merged).map_err(|e| FleetError::Invalid(e.to_string()))?;
        let old = self.remove_worker(id)?;
        match self.add_worker(spec, now) {
            Ok(_) => {}
            Err(e) => {
                // Put the old registration back untouched.
                self.add_worker(old.spec, now)?;
                return Err(e);
            }
        }
        let w = self
            .workers
            .get_mut(&id)
            .ok_or(FleetError::UnknownWorker(id))?;
        if w.spec.endpoint == old.spec.endpoint
            && w.spec.data_parallel_size == old.spec.data_parallel_size
        {
            w.health = old.health;
            w.ranks = old.ranks;
        }
        Ok(w)
    }

    /// Sets a model's thresholds (live tuning); validates ranges.
    pub fn set_thresholds(&mut self, model: &str, t: Thresholds) -> Result<(), FleetError> {
        t.validate()
            .map_err(|e| FleetError::Invalid(e.to_string()))?;
        let m = self
            .models
            .get_mut(model)
            .ok_or_else(|| FleetError::UnknownModel(model.into()))?;
        m.thresholds = t;
        Ok(())
    }
}
