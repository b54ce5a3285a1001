//! kvgate-sidecar: keeps Envoy's routing state fresh.
//!
//! It runs next to Envoy in each gateway pod and does everything that must
//! stay off the request path:
//!
//! * keeps the worker catalog ([`fleet`]), from the config file and the
//!   `/workers` API;
//! * scrapes every worker's Prometheus page ([`scrape`]) for load, and marks
//!   workers down when they stop answering;
//! * subscribes to every rank's ZMQ KV events and maintains the prefix index
//!   ([`kv`]);
//! * publishes versioned snapshots and index shards ([`publish`]), which the
//!   snapshot service inside Envoy long-polls and writes into shared data;
//! * serves its APIs and metrics ([`api`]), and the catalog as Envoy's
//!   routed cluster ([`eds`]).

pub mod api;
pub mod config;
pub mod fleet;
pub mod metrics;
pub mod publish;
pub mod sources;

use crate::config::{Config, WorkerSpec};
use crate::fleet::{Fleet, FleetError};
use crate::metrics::Metrics;
use crate::publish::SnapshotStore;
use crate::publish::Versions;
use crate::sources::kv::plane::{Plane, PlaneConfig};
use crate::sources::kv::subscriber::{SocketLimits, Subscriber, SubscriberSpec};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::task::JoinHandle;

pub struct Sidecar {
    pub config: Config,
    fleet: Mutex<Fleet>,
    pub versions: Arc<Versions>,
    pub store: SnapshotStore,
    pub plane: Plane,
    pub metrics: Metrics,
    pub approx: Mutex<sources::routed::ApproxIndex>,
    pub bookings: Mutex<sources::bookings::Bookings>,
    /// Unix ms when a gateway's long poll was last answered.
    pub last_poll_ms: std::sync::atomic::AtomicU64,
    zmq: zmq::Context,
    client: sources::metrics::scrape::HttpClient,
    scrapers: Mutex<HashMap<u64, JoinHandle<()>>>,
    subscribers: Mutex<HashMap<u16, (u64, u32, Subscriber)>>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Sidecar {
    /// Builds the sidecar and starts its background work on the current
    /// tokio runtime. Call [`api::router`] to serve it.
    pub fn start(config: Config) -> anyhow::Result<Arc<Sidecar>> {
        let versions = Arc::new(Versions::new());
        let plane = Plane::start(
            PlaneConfig {
                shard_count: config.kv.shards,
                max_blocks_per_slot: config.kv.max_blocks_per_rank,
                publish_interval: Duration::from_millis(config.kv.publish_interval_ms.max(1)),
                ..Default::default()
            },
            versions.clone(),
        )?;
        let fleet = Fleet::new(&config)?;
        let sc = Arc::new(Sidecar {
            fleet: Mutex::new(fleet),
            versions,
            store: SnapshotStore::default(),
            plane,
            metrics: Metrics::new(),
            approx: Mutex::new(sources::routed::ApproxIndex::new(
                Duration::from_millis(config.kv.approx_ttl_ms),
                Duration::from_millis(config.kv.inflight_ttl_ms),
            )),
            bookings: Mutex::new(sources::bookings::Bookings::new(Duration::from_millis(
                config.load.booking_ttl_ms,
            ))),
            last_poll_ms: std::sync::atomic::AtomicU64::new(now_ms()),
            zmq: zmq::Context::new(),
            client: sources::metrics::scrape::client(),
            scrapers: Mutex::new(HashMap::new()),
            subscribers: Mutex::new(HashMap::new()),
            config,
        });
        let ids: Vec<u64> = sc.fleet().workers.keys().copied().collect();
        for id in ids {
            sc.worker_started(id);
        }
        sc.publish_now();
        tokio::spawn(publish_loop(sc.clone()));
        Ok(sc)
    }

    pub fn fleet(&self) -> MutexGuard<'_, Fleet> {
        self.fleet.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn add_worker(self: &Arc<Self>, spec: WorkerSpec) -> Result<serde_json::Value, FleetError> {
        let id = spec.worker_id;
        let view = {
            let mut f = self.fleet();
            let w = f.add_worker(spec, Instant::now())?;
            api::worker_json(w)
        };
        self.worker_started(id);
        Ok(view)
    }

    pub fn patch_worker(
        self: &Arc<Self>,
        id: u64,
        patch: &serde_json::Value,
    ) -> Result<serde_json::Value, FleetError> {
        let view = {
            let mut f = self.fleet();
            api::worker_json(f.patch_worker(id, patch, Instant::now())?)
        };
        self.worker_stopped(id);
        self.worker_started(id);
        self.publish_now();
        Ok(view)
    }

    pub fn remove_worker(&self, id: u64) -> Result<(), FleetError> {
        let w = self.fleet().remove_worker(id)?;
        let mut b = self.bookings();
        for slot in &w.slots {
            b.drop_slot(*slot);
        }
        drop(b);
        self.worker_stopped(id);
        self.publish_now();
        Ok(())
    }

    /// Starts scraping a worker and subscribing to its KV events.
    fn worker_started(self: &Arc<Self>, id: u64) {
        let Some(spec) = self
            .fleet()
            .workers
            .get(&id)
            .map(|w| (w.spec.clone(), w.slots.clone()))
        else {
            return;
        };
        let (spec, slots) = spec;
        let task = tokio::spawn(scrape_loop(self.clone(), id));
        if let Some(old) = self
            .scrapers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, task)
        {
            old.abort();
        }
        if spec.kv_events_endpoints.is_empty() {
            return;
        }
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        for (r, slot) in slots.iter().enumerate() {
            let r = r as u32;
            let Some(endpoint) = spec.events_endpoint(r) else {
                tracing::warn!(worker = id, rank = r, "no KV event endpoint for this rank");
                continue;
            };
            self.plane
                .add_slot(*slot, &spec.model_name, spec.block_size, 0);
            let sub = Subscriber::spawn(
                self.zmq.clone(),
                SubscriberSpec {
                    slot: *slot,
                    endpoint: endpoint.clone(),
                    replay_endpoint: spec.replay_endpoint_of(r),
                    topic: spec.kv_events_topic.clone().into_bytes(),
                    replay_timeout: Duration::from_millis(self.config.kv.replay_timeout_ms),
                    limits: SocketLimits {
                        max_message_bytes: self.config.kv.max_message_bytes,
                        queue_messages: self.config.kv.queue_messages,
                    },
                },
                self.plane.sender(),
            );
            match sub {
                Ok(s) => {
                    tracing::info!(worker = id, rank = r, slot, %endpoint, "subscribed to KV events");
                    subs.insert(*slot, (id, r, s));
                }
                Err(e) => {
                    tracing::error!(worker = id, rank = r, error = %e, "could not start KV event subscriber")
                }
            }
        }
    }

    /// Stops a removed worker's scraper and subscribers and drops its index
    /// entries.
    fn worker_stopped(&self, id: u64) {
        if let Some(t) = self
            .scrapers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
        {
            t.abort();
        }
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        let slots: Vec<u16> = subs
            .iter()
            .filter(|(_, (w, _, _))| *w == id)
            .map(|(s, _)| *s)
            .collect();
        for slot in slots {
            if let Some((_, _, mut sub)) = subs.remove(&slot) {
                // Stopping joins the thread (up to one receive timeout);
                // keep that off the async runtime.
                std::thread::spawn(move || sub.stop());
            }
            self.plane.remove_slot(slot);
        }
    }

    /// Learns routing decisions the filter reported, keeping only those
    /// naming a configured model and one of its slots.
    /// Notes that a gateway's long poll was answered.
    pub fn polled(&self) {
        self.last_poll_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// How long since a gateway last heard from us.
    pub fn poll_age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.last_poll_ms.load(Ordering::Relaxed)))
    }

    pub fn bookings(&self) -> MutexGuard<'_, sources::bookings::Bookings> {
        self.bookings.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies a batch of gateway events (bookings, releases, rejections).
    pub fn book(&self, events: Vec<kvgate_core::booking::Event>) {
        // slot -> (model, worker id), for validation and routed-by-worker.
        let owners: HashMap<u16, (String, u64)> = {
            let f = self.fleet();
            f.workers
                .values()
                .flat_map(|w| {
                    w.slots
                        .iter()
                        .map(|s| (*s, (w.spec.model_name.clone(), w.spec.worker_id)))
                })
                .collect()
        };
        let now = Instant::now();
        let mut b = self.bookings();
        for ev in events {
            let effect = b.apply(ev, now, |model, slot| {
                owners.get(&slot).is_some_and(|(m, _)| m == model)
            });
            match effect {
                sources::bookings::Effect::Booked { model, slot } => {
                    if let Some((_, worker)) = owners.get(&slot) {
                        self.metrics
                            .routed
                            .with_label_values(&[model.as_str(), &worker.to_string()])
                            .inc();
                    }
                }
                sources::bookings::Effect::Rejected { model, reason } => {
                    // Requests refused before their body named a model.
                    let model = if model.is_empty() {
                        "-"
                    } else {
                        model.as_str()
                    };
                    self.metrics
                        .rejected
                        .with_label_values(&[model, reason.as_str()])
                        .inc();
                }
                sources::bookings::Effect::Refused => {
                    tracing::debug!("booking for a rank that is gone: ignored");
                }
                sources::bookings::Effect::Released | sources::bookings::Effect::Unknown => {}
            }
        }
    }

    /// Sets thresholds for `model` and publishes at once, so the filter
    /// has them within one snapshot interval.
    pub fn set_thresholds(
        &self,
        model: &str,
        t: kvgate_core::Thresholds,
    ) -> Result<(), FleetError> {
        self.fleet().set_thresholds(model, t)?;
        self.metrics
            .threshold_changes
            .with_label_values(&[model])
            .inc();
        tracing::info!(model, ?t, "busy thresholds changed");
        self.publish_now();
        Ok(())
    }

    pub fn learn(&self, records: &[kvgate_core::approx::Routed]) -> usize {
        let valid: Vec<&kvgate_core::approx::Routed> = {
            let f = self.fleet();
            records
                .iter()
                .filter(|r| {
                    f.workers
                        .values()
                        .any(|w| w.spec.model_name == r.model && w.slots.contains(&r.slot))
                })
                .collect()
        };
        let now = Instant::now();
        let mut a = self.approx.lock().unwrap_or_else(|p| p.into_inner());
        let before = a.learned;
        for r in &valid {
            a.learn(r, now);
        }
        self.metrics
            .approx_learned
            .inc_by(a.learned.saturating_sub(before));
        valid.len()
    }

    /// Expires and publishes the routed-prefix index's changed shards;
    /// ranks whose engine emptied its cache forget their routed prefixes.
    fn publish_approx(&self) {
        let cleared = self.plane.take_cleared();
        let updates = {
            let mut a = self.approx.lock().unwrap_or_else(|p| p.into_inner());
            for slot in cleared {
                a.forget_slot(slot);
            }
            a.sweep(Instant::now());
            a.take_updates()
        };
        if !updates.is_empty() {
            self.plane.log.publish(updates);
        }
    }

    /// Rebuilds and publishes the snapshot if it changed; refreshes gauges.
    pub fn publish_now(&self) {
        let snap = {
            let now = Instant::now();
            let mut b = self.bookings();
            let expired = b.sweep(now);
            if expired > 0 {
                tracing::warn!(expired, "bookings expired without their end being reported");
                self.metrics.bookings_expired.inc_by(expired as u64);
            }
            let mut f = self.fleet();
            f.expire(now, Duration::from_millis(self.config.scrape.down_after_ms));
            let snap = f.build_snapshot(&b, self.config.load.max_retry_after_s);
            self.refresh_gauges(&f, &b, &snap);
            snap
        };
        if let Some(v) = self.store.publish(&self.versions, snap, now_ms()) {
            tracing::debug!(version = v, "published snapshot");
            self.metrics
                .snapshot_bytes
                .set(self.store.bytes().len() as i64);
        }
        self.metrics
            .snapshot_version
            .set(self.versions.current() as i64);
    }

    fn refresh_gauges(
        &self,
        f: &Fleet,
        b: &sources::bookings::Bookings,
        snap: &kvgate_core::Snapshot,
    ) {
        let m = &self.metrics;
        let mut per_model: HashMap<&str, i64> = f.models.keys().map(|k| (k.as_str(), 0)).collect();
        let mut booked: HashMap<&str, i64> = f.models.keys().map(|k| (k.as_str(), 0)).collect();
        for model in &snap.models {
            m.retry_after
                .with_label_values(&[model.name.as_str()])
                .set(i64::from(model.retry_after_s));
            for w in &model.workers {
                let ids = w.id.to_string();
                for r in &w.ranks {
                    let rs = r.rank.to_string();
                    let l = [ids.as_str(), rs.as_str()];
                    m.rank_active_prefill
                        .with_label_values(&l)
                        .set(r.active_prefill_tokens as i64);
                    m.rank_active_decode
                        .with_label_values(&l)
                        .set(r.active_decode_blocks as i64);
                    m.rank_busy.with_label_values(&l).set(i64::from(r.busy));
                }
            }
        }
        for w in f.workers.values() {
            let n: u64 = w.slots.iter().map(|s| b.slot(*s).requests).sum();
            *booked.entry(w.spec.model_name.as_str()).or_default() += n as i64;
        }
        for (model, n) in booked {
            m.bookings_active.with_label_values(&[model]).set(n);
        }
        for (id, w) in &f.workers {
            let ids = id.to_string();
            m.worker_up
                .with_label_values(&[w.spec.model_name.as_str(), &ids])
                .set(i64::from(w.health.up));
            if w.health.up {
                *per_model.entry(w.spec.model_name.as_str()).or_default() += 1;
            }
            for (r, rm) in w.ranks.iter().enumerate() {
                let rs = (w.spec.data_parallel_start_rank + r as u32).to_string();
                let l = [ids.as_str(), rs.as_str()];
                m.rank_running
                    .with_label_values(&l)
                    .set(i64::from(rm.running));
                m.rank_waiting
                    .with_label_values(&l)
                    .set(i64::from(rm.waiting));
                m.rank_kv_used
                    .with_label_values(&l)
                    .set(rm.kv_used_blocks() as i64);
                m.rank_kv_total
                    .with_label_values(&l)
                    .set(rm.kv_total_blocks as i64);
            }
        }
        for (model, n) in per_model {
            m.workers_up.with_label_values(&[model]).set(n);
        }
        // Subscriber counters are atomics owned by their threads; mirror them.
        let subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        for (worker, rank, s) in subs.values() {
            let (ws, rs) = (worker.to_string(), rank.to_string());
            let l = [ws.as_str(), rs.as_str()];
            let st = &s.stats;
            set_counter(&m.kv_batches, &l, st.batches.load(Ordering::Relaxed));
            set_counter(
                &m.kv_malformed_frames,
                &l,
                st.malformed_frames.load(Ordering::Relaxed),
            );
            set_counter(&m.kv_gaps, &l, st.gaps.load(Ordering::Relaxed));
            set_counter(&m.kv_resyncs, &l, st.resyncs.load(Ordering::Relaxed));
            set_counter(
                &m.kv_replayed,
                &l,
                st.replayed_batches.load(Ordering::Relaxed),
            );
            set_counter(
                &m.kv_disconnects,
                &l,
                st.disconnects.load(Ordering::Relaxed),
            );
        }
    }

    /// Marks the state changed after a scrape that moved a worker up or down,
    /// so the change goes out without waiting for the next tick.
    fn scraped(
        &self,
        id: u64,
        result: Result<Vec<sources::metrics::promtext::RankMetrics>, String>,
    ) {
        let ids = id.to_string();
        self.metrics.scrapes.with_label_values(&[&ids]).inc();
        if let Err(e) = &result {
            self.metrics.scrape_errors.with_label_values(&[&ids]).inc();
            tracing::debug!(worker = id, error = %e, "scrape failed");
        }
        let changed = self.fleet().record_scrape(id, result, Instant::now());
        if changed {
            self.publish_now();
        }
    }
}

/// Mirrors a monotonically increasing atomic into a Prometheus counter.
fn set_counter(c: &prometheus::IntCounterVec, labels: &[&str], value: u64) {
    let ctr = c.with_label_values(labels);
    let cur = ctr.get();
    if value > cur {
        ctr.inc_by(value - cur);
    }
}

async fn scrape_loop(sc: Arc<Sidecar>, id: u64) {
    let interval = Duration::from_millis(sc.config.scrape.interval_ms);
    let timeout = Duration::from_millis(sc.config.scrape.timeout_ms);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut warned_no_capacity, mut warned_no_batch) = (false, false);
    loop {
        tick.tick().await;
        let Some((url, dp, start, bs, needs_batch)) = ({
            let f = sc.fleet();
            f.workers.get(&id).map(|w| {
                let frac = f
                    .models
                    .get(&w.spec.model_name)
                    .is_some_and(|m| m.thresholds.active_prefill_tokens_frac.is_some());
                (
                    w.spec.metrics_url(),
                    w.spec.data_parallel_size,
                    w.spec.data_parallel_start_rank,
                    w.spec.block_size,
                    frac && w.spec.max_num_batched_tokens == 0,
                )
            })
        }) else {
            return;
        };
        let result =
            sources::metrics::scrape::scrape_once(&sc.client, &url, timeout, dp, start, bs).await;
        if !warned_no_capacity
            && let Ok((ranks, _)) = &result
            && ranks
                .iter()
                .any(|r| r.kv_usage > 0.0 && r.kv_total_blocks == 0)
        {
            // Without a capacity the decode-blocks rule skips the worker:
            // it would take work at any KV usage.
            warned_no_capacity = true;
            tracing::warn!(
                worker = id,
                url,
                "the engine reports KV usage but no KV capacity (vLLM: cache_config_info num_gpu_blocks; SGLang: max_total_num_tokens, or num_pages and page_size): the decode-blocks threshold cannot make this worker busy"
            );
        }
        if needs_batch
            && !warned_no_batch
            && let Ok((ranks, _)) = &result
            && ranks.iter().any(|r| r.max_num_batched_tokens == 0)
        {
            // SGLang publishes no batch budget: the fractional prefill
            // threshold has nothing to take a fraction of.
            warned_no_batch = true;
            tracing::warn!(
                worker = id,
                "active_prefill_tokens_threshold_frac is set but the engine publishes no max_num_batched_tokens: set max_num_batched_tokens in [[workers]] (SGLang: its --chunked-prefill-size)"
            );
        }
        sc.scraped(id, result.map(|(ranks, _)| ranks));
    }
}

async fn publish_loop(sc: Arc<Sidecar>) {
    let mut tick = tokio::time::interval(Duration::from_millis(
        sc.config.server.publish_interval_ms.max(1),
    ));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0u64;
    // Ranks already warned about a block size mismatch: once each is enough
    // to be found in the log, the counter tells the rest.
    let mut warned_block_size: std::collections::HashSet<(u64, u32)> = Default::default();
    loop {
        tick.tick().await;
        sc.publish_now();
        sc.publish_approx();
        n += 1;
        // Index statistics need a round trip to the index thread; once a
        // second is plenty for gauges.
        if n.is_multiple_of(1000 / sc.config.server.publish_interval_ms.clamp(1, 1000))
            && let Some(stats) = {
                let sc = sc.clone();
                tokio::task::spawn_blocking(move || sc.plane.stats())
                    .await
                    .ok()
                    .flatten()
            }
        {
            for (model, _, blocks) in &stats.per_model {
                sc.metrics
                    .kv_indexed_blocks
                    .with_label_values(&[model])
                    .set(*blocks as i64);
            }
            sc.metrics
                .kv_malformed_batches
                .set(stats.malformed_batches as i64);
            let subs = sc.subscribers.lock().unwrap_or_else(|p| p.into_inner());
            for (slot, why, n) in &stats.unmatchable {
                if let Some((worker, rank, _)) = subs.get(slot) {
                    let (w, r) = (worker.to_string(), rank.to_string());
                    set_counter(
                        &sc.metrics.kv_unmatchable_blocks,
                        &[w.as_str(), r.as_str(), why.as_str()],
                        *n,
                    );
                }
            }
            for (slot, m) in &stats.block_size_mismatch {
                let Some((worker, rank, _)) = subs.get(slot) else {
                    continue;
                };
                let (w, r) = (worker.to_string(), rank.to_string());
                set_counter(
                    &sc.metrics.kv_block_size_mismatch,
                    &[w.as_str(), r.as_str()],
                    m.events,
                );
                if warned_block_size.insert((*worker, *rank)) {
                    tracing::warn!(
                        worker = worker,
                        rank = rank,
                        engine_block_size = m.engine_block_size,
                        block_size = m.block_size,
                        "KV events carry block size {} but the worker's block_size is {}: prefix routing cannot match these blocks; start the engine with blocks of {} tokens (SGLang --page-size {}, vLLM --block-size {}) or set the worker's block_size to the engine's",
                        m.engine_block_size,
                        m.block_size,
                        m.block_size,
                        m.block_size,
                        m.block_size,
                    );
                }
            }
        }
    }
}
