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
//!
//! State that a new source adds about a worker or a rank (GPU temperature,
//! say) is recorded in its [`WorkerEntry`] as scrape results are, and
//! reaches the snapshot in [`snapshot`]; state about a model (a planner's
//! targets) sits beside `models`.

mod catalog;
mod drain;
mod health;
mod snapshot;
#[cfg(test)]
mod tests;

pub use health::Health;

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

#[derive(Debug, Clone)]
pub struct WorkerEntry {
    pub spec: WorkerSpec,
    pub slots: Vec<u16>,
    pub health: Health,
    pub ranks: Vec<RankMetrics>,
    latches: Vec<bool>,
}

#[derive(Debug)]
pub struct Fleet {
    pub models: BTreeMap<String, ModelConfig>,
    pub workers: BTreeMap<u64, WorkerEntry>,
    slots: Slots,
    kv_shards: u32,
}

impl Fleet {
    pub fn new(config: &Config) -> Result<Fleet, FleetError> {
        let mut f = Fleet {
            models: config
                .models
                .iter()
                .map(|m| (m.name.clone(), m.clone()))
                .collect(),
            workers: BTreeMap::new(),
            slots: Slots::default(),
            kv_shards: config.kv.shards,
        };
        for w in &config.workers {
            f.add_worker(w.clone(), Instant::now())?;
        }
        Ok(f)
    }
}
