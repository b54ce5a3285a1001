//! The fleet as the sidecar knows it: models, workers, their health and
//! load, and the snapshot built from all of it.
//!
//! Workers come from the config file and from `POST /workers`; API
//! registrations live in memory only and are gone after a restart unless
//! they are also written to the config file. Each DP rank of a worker gets a
//! *slot*, the small number that names it in the KV index shards.

use crate::bookings::{Bookings, SlotLoad};
use crate::config::{Config, ModelConfig, WorkerSpec};
use crate::promtext::RankMetrics;
use kvgate_core::busy::{DECODE_CLEAR_MARGIN, rank_busy};
use kvgate_core::{ModelState, RankLoad, Snapshot, Thresholds, WorkerState};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
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

#[derive(Debug, Clone, Serialize)]
pub struct Health {
    pub up: bool,
    #[serde(skip)]
    pub last_ok: Option<Instant>,
    #[serde(skip)]
    pub added: Instant,
    pub last_error: Option<String>,
    pub scrapes: u64,
    pub scrape_errors: u64,
}

#[derive(Debug, Clone)]
pub struct WorkerEntry {
    pub spec: WorkerSpec,
    pub slots: Vec<u16>,
    pub health: Health,
    pub ranks: Vec<RankMetrics>,
    latches: Vec<bool>,
}

#[derive(Debug, Default)]
struct Slots {
    next: u32,
    free: Vec<u16>,
}

impl Slots {
    fn take(&mut self) -> Option<u16> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let s = u16::try_from(self.next).ok()?;
        self.next += 1;
        Some(s)
    }
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

    /// Records a scrape. Returns whether the worker's up state changed.
    pub fn record_scrape(
        &mut self,
        id: u64,
        result: Result<Vec<RankMetrics>, String>,
        now: Instant,
    ) -> bool {
        let Some(w) = self.workers.get_mut(&id) else {
            return false;
        };
        let was_up = w.health.up;
        w.health.scrapes += 1;
        match result {
            Ok(ranks) => {
                w.ranks = ranks;
                w.health.up = true;
                w.health.last_ok = Some(now);
                w.health.last_error = None;
            }
            Err(e) => {
                w.health.scrape_errors += 1;
                w.health.last_error = Some(e);
            }
        }
        was_up != w.health.up
    }

    /// Marks down every worker without a good scrape for `down_after`.
    pub fn expire(&mut self, now: Instant, down_after: Duration) -> Vec<u64> {
        let mut downed = Vec::new();
        for (id, w) in &mut self.workers {
            let since = w.health.last_ok.unwrap_or(w.health.added);
            if w.health.up && now.saturating_duration_since(since) > down_after {
                w.health.up = false;
                downed.push(*id);
            }
        }
        downed
    }

    pub fn up_count(&self) -> usize {
        self.workers.values().filter(|w| w.health.up).count()
    }

    /// Builds the snapshot (version and time left 0 for the publisher).
    /// Updates each rank's decode latch, so call it once per publish tick.
    /// Builds the snapshot: engine metrics merged with gateway bookings,
    /// busy flags (with their latches) and each model's `Retry-After` hint.
    pub fn build_snapshot(&mut self, bookings: &Bookings, max_retry_after_s: u32) -> Snapshot {
        let mut models: BTreeMap<&str, ModelState> = self
            .models
            .iter()
            .map(|(name, m)| {
                (
                    name.as_str(),
                    ModelState {
                        name: name.clone(),
                        thresholds: m.thresholds,
                        shard_count: 0,
                        workers: Vec::new(),
                        retry_after_s: 0,
                        lora_adapters: m.lora_adapters.clone(),
                        policy: m.policy,
                    },
                )
            })
            .collect();
        for w in self.workers.values_mut() {
            let Some(model) = models.get_mut(w.spec.model_name.as_str()) else {
                continue;
            };
            if !w.spec.kv_events_endpoints.is_empty() {
                model.shard_count = self.kv_shards;
            }
            if !w.health.up {
                continue;
            }
            let th = model.thresholds;
            let mut drain_s: Option<f64> = None;
            let ranks: Vec<RankLoad> = w
                .ranks
                .iter()
                .zip(&w.slots)
                .zip(w.latches.iter_mut())
                .enumerate()
                .map(|(r, ((m, slot), latch))| {
                    let booked = bookings.slot(*slot);
                    let mut load = RankLoad {
                        rank: w.spec.data_parallel_start_rank + r as u32,
                        slot: *slot,
                        // Engines do not report queued prefill; only the
                        // gateway knows what it sent and not yet heard back.
                        active_prefill_tokens: booked.prefill_tokens,
                        // What this gateway has in flight there, as Dynamo's
                        // router counts it. Not the engine's KV usage: that
                        // includes the shared prefix blocks of running
                        // requests, and counting them as load would push
                        // every request away from the cache it could reuse.
                        // Usage still makes a rank busy (`rank_busy` checks
                        // both).
                        active_decode_blocks: booked.decode_blocks,
                        kv_used_blocks: m.kv_used_blocks(),
                        kv_total_blocks: m.kv_total_blocks,
                        max_num_batched_tokens: if w.spec.max_num_batched_tokens > 0 {
                            w.spec.max_num_batched_tokens
                        } else {
                            m.max_num_batched_tokens
                        },
                        running: m.running,
                        waiting: m.waiting,
                        busy: false,
                    };
                    load.busy = rank_busy(&load, &th, latch).is_some();
                    if load.busy
                        && let Some(t) = drain_time(&load, &th, &booked)
                    {
                        drain_s = Some(drain_s.map_or(t, |d| d.min(t)));
                    }
                    load
                })
                .collect();
            // A worker takes work again when its first rank does; the model,
            // when its first worker does.
            if ranks.iter().all(|r| r.busy)
                && let Some(t) = drain_s
            {
                let secs = (t.ceil() as u32).clamp(1, max_retry_after_s.max(1));
                model.retry_after_s = match model.retry_after_s {
                    0 => secs,
                    s => s.min(secs),
                };
            }
            model.workers.push(WorkerState {
                id: w.spec.worker_id,
                endpoint: w.spec.endpoint.clone(),
                block_size: w.spec.block_size,
                ranks,
                tenant: w.spec.tenant_id.clone(),
            });
        }
        Snapshot {
            version: 0,
            built_at_ms: 0,
            models: models.into_values().collect(),
            applied: bookings.applied(),
        }
    }
}

/// Seconds until a busy rank is expected under all its thresholds again, at
/// the rate its bookings have been draining; `None` when nothing drained
/// lately (the caller falls back to the configured default).
fn drain_time(load: &RankLoad, th: &Thresholds, booked: &SlotLoad) -> Option<f64> {
    let mut worst: f64 = 0.0;
    if let Some(limit) = th.active_decode_blocks
        && load.kv_total_blocks > 0
    {
        let clear_at = (limit - DECODE_CLEAR_MARGIN).max(0.0) * load.kv_total_blocks as f64;
        let booked_used = load.active_decode_blocks as f64;
        let engine_used = load.kv_used_blocks as f64;
        let used = booked_used.max(engine_used);
        if used > clear_at {
            // The rate of whichever count keeps the rank busy. The engine's
            // usage (which holds shared prefixes and other gateways' work)
            // falls as its running requests finish, each freeing its share;
            // dividing it by the drain of this gateway's bookings alone made
            // the estimate jump to its cap.
            let rate = if engine_used > booked_used {
                booked.completions_per_s * engine_used / f64::from(load.running.max(1))
            } else {
                booked.decode_drain_per_s
            };
            if rate <= 0.0 {
                return None;
            }
            worst = worst.max((used - clear_at) / rate);
        }
    }
    let mut prefill_limit: Option<f64> = th.active_prefill_tokens.map(|t| t as f64);
    if let Some(frac) = th.active_prefill_tokens_frac
        && load.max_num_batched_tokens > 0
    {
        let f = frac * load.max_num_batched_tokens as f64;
        prefill_limit = Some(prefill_limit.map_or(f, |p| p.min(f)));
    }
    if let Some(limit) = prefill_limit
        && load.active_prefill_tokens as f64 > limit
    {
        if booked.prefill_drain_per_s <= 0.0 {
            return None;
        }
        worst = worst.max((load.active_prefill_tokens as f64 - limit) / booked.prefill_drain_per_s);
    }
    Some(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::parse(
            r#"
[[models]]
name = "m"
active_decode_blocks_threshold = 0.5
[[models]]
name = "idle"
[[workers]]
worker_id = 1
model_name = "m"
endpoint = "127.0.0.1:8001"
data_parallel_size = 2
[[workers]]
worker_id = 2
model_name = "m"
endpoint = "127.0.0.1:8002"
"#,
        )
        .unwrap()
    }

    fn metrics(usage: f64) -> RankMetrics {
        RankMetrics {
            kv_usage: usage,
            kv_total_blocks: 100,
            running: 1,
            ..Default::default()
        }
    }

    #[test]
    fn the_snapshot_names_each_models_adapters() {
        let c = Config::parse("[[models]]\nname = \"m\"\nlora_adapters = [\"sql-lora\"]").unwrap();
        let mut f = Fleet::new(&c).unwrap();
        let s = f.build_snapshot(&Bookings::new(Duration::from_secs(300)), 30);
        assert_eq!(s.models[0].lora_adapters, ["sql-lora"]);
        assert_eq!(s.model("sql-lora").map(|m| m.name.as_str()), Some("m"));
    }

    #[test]
    fn only_scraped_workers_are_listed_and_every_model_is() {
        let mut f = Fleet::new(&config()).unwrap();
        let s = f.build_snapshot(&Bookings::new(Duration::from_secs(300)), 30);
        assert_eq!(s.models.len(), 2);
        assert!(s.models.iter().all(|m| m.workers.is_empty()));
        let now = Instant::now();
        f.record_scrape(1, Ok(vec![metrics(0.1), metrics(0.9)]), now);
        let s = f.build_snapshot(&Bookings::new(Duration::from_secs(300)), 30);
        let m = s.model("m").unwrap();
        assert_eq!(m.workers.len(), 1);
        let w = &m.workers[0];
        assert_eq!(w.ranks.len(), 2);
        assert_eq!((w.ranks[0].kv_used_blocks, w.ranks[0].busy), (10, false));
        assert_eq!((w.ranks[1].kv_used_blocks, w.ranks[1].busy), (90, true));
        assert_ne!(w.ranks[0].slot, w.ranks[1].slot);
    }

    #[test]
    fn down_after_bound_and_back() {
        let mut f = Fleet::new(&config()).unwrap();
        let t0 = Instant::now();
        assert!(f.record_scrape(2, Ok(vec![metrics(0.0)]), t0));
        assert!(
            f.expire(t0 + Duration::from_millis(500), Duration::from_secs(1))
                .is_empty()
        );
        assert!(!f.record_scrape(
            2,
            Err("connection refused".into()),
            t0 + Duration::from_millis(600)
        ));
        assert_eq!(
            f.expire(t0 + Duration::from_millis(1500), Duration::from_secs(1)),
            vec![2]
        );
        assert_eq!(f.up_count(), 0);
        assert!(f.record_scrape(2, Ok(vec![metrics(0.0)]), t0 + Duration::from_secs(2)));
        assert_eq!(f.up_count(), 1);
    }

    #[test]
    fn catalog_changes_and_slot_reuse() {
        let mut f = Fleet::new(&config()).unwrap();
        let now = Instant::now();
        let spec = |id: u64, model: &str| -> WorkerSpec {
            serde_json::from_value(serde_json::json!({"worker_id": id, "model_name": model, "endpoint": "127.0.0.1:9000"})).unwrap()
        };
        assert_eq!(
            f.add_worker(spec(1, "m"), now).unwrap_err(),
            FleetError::Duplicate(1)
        );
        assert_eq!(
            f.add_worker(spec(9, "x"), now).unwrap_err(),
            FleetError::UnknownModel("x".into())
        );
        let slot_of_2 = f.workers[&2].slots[0];
        f.remove_worker(2).unwrap();
        assert_eq!(
            f.remove_worker(2).unwrap_err(),
            FleetError::UnknownWorker(2)
        );
        assert_eq!(
            f.add_worker(spec(3, "idle"), now).unwrap().slots,
            vec![slot_of_2],
            "freed slots are reused"
        );
        let w = f
            .patch_worker(3, &serde_json::json!({"data_parallel_size": 2}), now)
            .unwrap();
        assert_eq!(w.slots.len(), 2);
        assert!(
            f.patch_worker(3, &serde_json::json!({"block_size": 0}), now)
                .is_err()
        );
        assert_eq!(
            f.workers[&3].spec.block_size, 16,
            "a rejected patch changes nothing"
        );
        assert!(
            f.patch_worker(3, &serde_json::json!({"worker_id": 4}), now)
                .is_err()
        );
    }

    fn book(b: &mut Bookings, seq: u64, slot: u16, prefill: u32, decode: u32, at: Instant) {
        use kvgate_core::booking::{Event, Key};
        let ev = Event::Book {
            key: Key { vm: 1, seq },
            model: "m".into(),
            slot,
            prefill_tokens: prefill,
            decode_blocks: decode,
        };
        b.apply(ev, at, |_, _| true);
    }

    #[test]
    fn bookings_merge_with_engine_load() {
        let mut f = Fleet::new(&config()).unwrap();
        let now = Instant::now();
        f.record_scrape(1, Ok(vec![metrics(0.1), metrics(0.1)]), now);
        let slots = f.workers[&1].slots.clone();
        let mut b = Bookings::new(Duration::from_secs(300));
        book(&mut b, 1, slots[0], 700, 30, now);
        book(&mut b, 2, slots[1], 50, 4, now);
        let s = f.build_snapshot(&b, 30);
        let r = &s.model("m").unwrap().workers[0].ranks;
        // Booked load is the active load; the engine's usage stays beside it.
        assert_eq!(
            (r[0].active_prefill_tokens, r[0].active_decode_blocks),
            (700, 30)
        );
        assert_eq!(
            (r[1].active_prefill_tokens, r[1].active_decode_blocks),
            (50, 4)
        );
        assert_eq!((r[0].kv_used_blocks, r[1].kv_used_blocks), (10, 10));
        assert_eq!(s.applied, vec![kvgate_core::Applied { vm: 1, seq: 2 }]);
    }

    /// Worker 2's rank at `usage` of 100 blocks with `running` requests,
    /// after 30 s of four `blocks`-block bookings finishing each second.
    fn draining(usage: f64, running: u32, blocks: u32) -> (Fleet, Bookings) {
        use kvgate_core::booking::{Event, Key};
        let mut f = Fleet::new(&config()).unwrap();
        let t = Instant::now();
        f.record_scrape(
            2,
            Ok(vec![RankMetrics {
                running,
                ..metrics(usage)
            }]),
            t,
        );
        let slot = f.workers[&2].slots[0];
        let mut b = Bookings::new(Duration::from_secs(300));
        b.sweep(t);
        let mut seq = 0;
        for s in 1..=30u64 {
            let now = t + Duration::from_secs(s);
            for _ in 0..4 {
                seq += 1;
                book(&mut b, seq, slot, 0, blocks, now);
                b.apply(
                    Event::Done {
                        key: Key { vm: 1, seq },
                    },
                    now,
                    |_, _| true,
                );
            }
            b.sweep(now);
        }
        (f, b)
    }

    #[test]
    fn retry_after_follows_the_engine_when_its_usage_keeps_the_rank_busy() {
        // 90 of 100 blocks in use by 16 running requests, most of them not
        // this gateway's: its own requests are one block each.
        let (mut f, b) = draining(0.9, 16, 1);
        let s = f.build_snapshot(&b, 30);
        let m = s.model("m").unwrap();
        assert!(m.workers[0].ranks[0].busy);
        // 42 blocks over the line; four requests of ~5.6 blocks finish a
        // second: about 1.9 s. The bookings' own drain (4 blocks/s) would
        // have said 11.
        assert_eq!(m.retry_after_s, 2);
    }

    #[test]
    fn retry_after_follows_the_drain_rate_of_the_first_worker_to_free() {
        // Threshold 0.5 of 100 blocks: a rank clears under 48 blocks.
        let (mut f, b) = draining(0.78, 12, 5);
        let s = f.build_snapshot(&b, 30);
        let m = s.model("m").unwrap();
        assert!(m.workers[0].ranks[0].busy);
        // 30 blocks over the clearing line; four of the twelve running
        // requests (6.5 blocks each) finish a second: 1.15 s, rounded up.
        assert_eq!(m.retry_after_s, 2);
        // Nothing drains: the filter's default applies (0 here).
        let s = f.build_snapshot(&Bookings::new(Duration::from_secs(300)), 30);
        assert_eq!(s.model("m").unwrap().retry_after_s, 0);
    }

    #[test]
    fn thresholds_are_validated() {
        let mut f = Fleet::new(&config()).unwrap();
        let bad = Thresholds {
            active_decode_blocks: Some(2.0),
            ..Default::default()
        };
        assert!(matches!(
            f.set_thresholds("m", bad),
            Err(FleetError::Invalid(_))
        ));
        assert_eq!(
            f.set_thresholds("zz", Thresholds::default()),
            Err(FleetError::UnknownModel("zz".into()))
        );
        f.set_thresholds(
            "idle",
            Thresholds {
                active_prefill_tokens: Some(5),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(f.models["idle"].thresholds.active_prefill_tokens, Some(5));
    }
}
