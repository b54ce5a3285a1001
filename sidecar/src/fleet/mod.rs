//! The fleet as the sidecar knows it: models, workers, their health and
//! load, and the snapshot built from all of it.
//!
//! Workers come from the config file and from `POST /workers`; API
//! registrations live in memory only and are gone after a restart unless
//! they are also written to the config file. Each DP rank of a worker gets a
//! *slot*, the small number that names it in the KV index shards.
//!
//! * [`catalog`]: registering, changing and removing workers; their slots;
//!   live threshold changes.
//! * [`health`]: scrape results and the down-after rule.
//! * [`snapshot`]: the snapshot Envoy reads, built from all of it.
//! * [`drain`]: how long until a busy rank takes work again (`Retry-After`).
//! * [`thermal`]: GPU readings and each worker's thermal controller.
//! * `gauges`: what the fleet shows on `/metrics`.
//! * [`planner`]: the planner's models, what it observed, its decisions and
//!   the workers it drains.
//!
//! State that a new source adds about a worker or a rank (GPU temperature,
//! say) is recorded in its [`WorkerEntry`] as scrape results are, and
//! reaches the snapshot in [`snapshot`]; state about a model (a planner's
//! targets) sits beside `models`.

mod catalog;
mod drain;
mod gauges;
mod health;
mod planner;
mod snapshot;
#[cfg(test)]
mod tests;
mod thermal;

pub use health::Health;
pub use planner::{Decision, Planned, Planning};
pub use thermal::{Change, Controller, GpuSeen, Hottest, Stepped};

use crate::config::{Config, ModelConfig, WorkerSpec};
use crate::sources::metrics::promtext::RankMetrics;
use catalog::Slots;
use std::collections::BTreeMap;
use std::time::Instant;
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum FleetError {
    #[error("worker {0} already exists")]
    Duplicate(u64),
    #[error("worker {0} does not exist")]
    UnknownWorker(u64),
    #[error("model {0:?} is not configured")]
    UnknownModel(String),
    #[error("{0}")]
    Invalid(String),
    #[error("no slot numbers left for more data-parallel ranks")]
    SlotsExhausted,
}

/// A worker as the fleet keeps it. Read-only outside `fleet/`: its
/// scrape record, slots and controller change only with the fleet.
#[derive(Debug, Clone)]
pub struct WorkerEntry {
    spec: WorkerSpec,
    slots: Vec<u16>,
    health: Health,
    ranks: Vec<RankMetrics>,
    latches: Vec<bool>,
    thermal: Controller,
    /// Requests in flight there at the last snapshot: the engine's running
    /// and waiting, or the gateways' bookings when more.
    in_flight: u32,
}

impl WorkerEntry {
    pub fn spec(&self) -> &WorkerSpec {
        &self.spec
    }

    /// The slot of each of its DP ranks, in rank order.
    pub fn slots(&self) -> &[u16] {
        &self.slots
    }

    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Each rank's metrics from the last good scrape.
    pub fn ranks(&self) -> &[RankMetrics] {
        &self.ranks
    }

    pub fn thermal(&self) -> &Controller {
        &self.thermal
    }

    /// Requests in flight there at the last snapshot.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }
}

/// A rank slot by the names every sidecar and client shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankId {
    pub model: String,
    pub tenant: String,
    pub block_size: u32,
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// The fields are private: the fleet's invariants (slots match workers,
/// a model's workers name a configured model) are kept by the methods in
/// this folder, and what the rest of the sidecar may change is named by
/// those methods.
#[derive(Debug)]
pub struct Fleet {
    models: BTreeMap<String, ModelConfig>,
    workers: BTreeMap<u64, WorkerEntry>,
    /// The latest reading of every GPU, by UUID.
    gpus: BTreeMap<String, GpuSeen>,
    /// The planner's models, observations, decisions and draining workers.
    planning: Planning,
    /// Version of each model's published prompt template (`[models.prompt]`).
    prompt_templates: BTreeMap<String, u64>,
    slots: Slots,
    kv_shards: u32,
}

impl Fleet {
    /// The configured models by name, with their live thresholds and
    /// thermal overrides.
    pub fn models(&self) -> &BTreeMap<String, ModelConfig> {
        &self.models
    }

    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models.get(name)
    }

    /// The most one booking of `model` may hold; a model not configured
    /// (one whose bookings are refused anyway) gets the default.
    pub fn booking_bound(&self, model: &str) -> crate::sources::bookings::Bound {
        crate::sources::bookings::Bound::of_prompt(
            self.model(model)
                .map_or(crate::config::DEFAULT_MAX_PROMPT_TOKENS, |m| {
                    m.max_prompt_tokens
                }),
        )
    }

    /// The workers by id.
    pub fn workers(&self) -> &BTreeMap<u64, WorkerEntry> {
        &self.workers
    }

    pub fn worker(&self, id: u64) -> Option<&WorkerEntry> {
        self.workers.get(&id)
    }

    /// The latest reading of every GPU, by UUID.
    pub fn gpus(&self) -> &BTreeMap<String, GpuSeen> {
        &self.gpus
    }

    /// The planner's models, decisions and draining workers, to read;
    /// what it observes is recorded through [`Fleet::planner_booked`] and
    /// its siblings.
    pub fn planning(&self) -> &Planning {
        &self.planning
    }

    /// Records that a model's prompt template was published at `version`.
    pub fn prompt_published(&mut self, model: &str, version: u64) {
        self.prompt_templates.insert(model.to_string(), version);
    }

    /// Who a slot is: its worker, rank and scope.
    pub fn rank_of(&self, slot: u16) -> Option<RankId> {
        self.workers.values().find_map(|w| {
            let i = w.slots.iter().position(|s| *s == slot)?;
            Some(RankId {
                model: w.spec.model_name.clone(),
                tenant: w.spec.tenant_id.clone(),
                block_size: w.spec.block_size,
                worker_id: w.spec.worker_id,
                dp_rank: w.spec.data_parallel_start_rank + i as u32,
            })
        })
    }

    /// The slot of a worker's rank, if the worker is in the catalog with
    /// that model, tenant, block size and rank.
    pub fn slot_of(&self, id: &RankId) -> Option<u16> {
        let w = self.workers.get(&id.worker_id)?;
        let s = &w.spec;
        if s.model_name != id.model || s.tenant_id != id.tenant || s.block_size != id.block_size {
            return None;
        }
        let i = id.dp_rank.checked_sub(s.data_parallel_start_rank)?;
        w.slots.get(i as usize).copied()
    }

    pub fn new(config: &Config) -> Result<Fleet, FleetError> {
        let mut f = Fleet {
            models: config
                .models
                .iter()
                .map(|m| (m.name.clone(), m.clone()))
                .collect(),
            workers: BTreeMap::new(),
            gpus: BTreeMap::new(),
            planning: Planning::default(),
            prompt_templates: BTreeMap::new(),
            slots: Slots::default(),
            kv_shards: config.kv.shards,
        };
        for w in &config.workers {
            f.add_worker(w.clone(), Instant::now())?;
        }
        f.planning.fleet_power_budget_w = config.planner.power_budget_w;
        f.planning.gpu_stale_after = config.thermal.stale_after;
        for m in &config.models {
            if let Some(p) = &m.planner {
                // A model with a disaggregation table is planned as two
                // pools, whatever roles its workers have at start: the
                // planner is what gives a pool its first worker.
                let disaggregated = m.disaggregation.is_some();
                let mut ready = [0u32; 3];
                for w in config.workers.iter().filter(|w| w.model_name == m.name) {
                    let pool = crate::planner::pool::of(disaggregated, w.role);
                    ready[usize::from(pool.code())] += 1;
                }
                let mut planner =
                    crate::planner::ModelPlanner::new(p.clone(), disaggregated, ready);
                if let Some(path) = &p.warmup_trace {
                    let rows = std::fs::read_to_string(path)
                        .map_err(|e| e.to_string())
                        .and_then(|t| crate::config::read_trace(&t))
                        .map_err(|e| {
                            FleetError::Invalid(format!(
                                "model {:?}: warmup_trace {}: {e}",
                                m.name,
                                path.display()
                            ))
                        })?;
                    planner.warm_start(&rows);
                }
                f.planning.models.insert(m.name.clone(), planner);
            }
            if m.slo().is_some() {
                f.planning.fit_latency(&m.name);
            }
        }
        Ok(f)
    }
}
