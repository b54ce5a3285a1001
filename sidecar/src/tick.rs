//! The sidecar's loops: one publish loop, one scrape loop per worker, and
//! the planner's loop. Each tick rebuilds what changed and publishes it.
//! Each loop is handed what it reads and changes when it is spawned, as
//! the thermal loop is.

use crate::clock::now_ms;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::lifecycle::Lifecycle;
use crate::metrics::{KvMetrics, PlannerMetrics, SnapshotMetrics, mirror_total};
use crate::sidecar::publisher::Publisher;
use crate::sources::bookings::Bookings;
use crate::sources::kv::plane::{BlockSizeMismatch, Plane, PlaneStats};
use crate::sources::metrics::scrape::{self, HttpClient};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the publish loop reads and changes.
pub(crate) struct PublishHandles {
    pub(crate) interval: Duration,
    pub(crate) publisher: Publisher,
    pub(crate) plane: Arc<Plane>,
    pub(crate) lifecycle: Arc<Lifecycle>,
    pub(crate) metrics: KvMetrics,
}

pub(crate) async fn publish_loop(h: PublishHandles) {
    // At least 1 ms, as tokio requires; at most a second, so index
    // statistics come once every `stats_every` ticks, at least.
    let interval = h.interval.max(Duration::from_millis(1));
    let stats_every = (Duration::from_secs(1).as_nanos()
        / interval.min(Duration::from_secs(1)).as_nanos()) as u64;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0u64;
    // Ranks already logged for a block size mismatch: once each is enough
    // to be found in the log, the counter tells the rest.
    let mut warned_block_size: HashSet<(u64, u32)> = HashSet::new();
    loop {
        tick.tick().await;
        h.publisher.publish_now();
        h.publisher.publish_routed();
        n += 1;
        // Index statistics need a round trip to the index thread; once a
        // second is plenty for gauges.
        if n.is_multiple_of(stats_every)
            && let Some(stats) = {
                let plane = h.plane.clone();
                tokio::task::spawn_blocking(move || plane.stats())
                    .await
                    .ok()
                    .flatten()
            }
        {
            for (worker, rank, m) in mirror_index(&h.metrics, &stats, &h.lifecycle) {
                if warned_block_size.insert((worker, rank)) {
                    tracing::info!(
                        worker = worker,
                        rank = rank,
                        engine_block_size = m.engine_block_size,
                        block_size = m.block_size,
                        "KV events carry pages of {} tokens and the worker's block_size is {}: kvgate re-chunks them into blocks of {} along their chains, keeping an index entry per page; start the engine with pages of {} tokens (SGLang --page-size {}) to save that memory",
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

/// Mirrors the index thread's statistics. Returns each rank, as (worker,
/// rank), whose KV events carry another block size than its worker's.
fn mirror_index(
    m: &KvMetrics,
    stats: &PlaneStats,
    workers: &Lifecycle,
) -> Vec<(u64, u32, BlockSizeMismatch)> {
    for (model, _, blocks) in &stats.per_model {
        m.indexed_blocks
            .with_label_values(&[model])
            .set(*blocks as i64);
    }
    for (model, keys, t) in &stats.text {
        m.text_keys.with_label_values(&[model]).set(*keys as i64);
        for (why, n) in [("orphan", t.orphans), ("undecodable", t.undecodable)] {
            mirror_total(&m.text_skipped_blocks, &[model.as_str(), why], n);
        }
    }
    m.malformed_batches.set(stats.malformed_batches as i64);
    for (slot, why, n) in &stats.unmatchable {
        if let Some((worker, rank)) = workers.owner(*slot) {
            let (w, r) = (worker.to_string(), rank.to_string());
            mirror_total(
                &m.unmatchable_blocks,
                &[w.as_str(), r.as_str(), why.as_str()],
                *n,
            );
        }
    }
    for (slot, lag) in &stats.event_lag {
        if let Some((worker, rank)) = workers.owner(*slot) {
            let (w, r) = (worker.to_string(), rank.to_string());
            m.event_lag
                .with_label_values(&[w.as_str(), r.as_str()])
                .set(*lag);
        }
    }
    let mut mismatched = Vec::new();
    for (slot, mm) in &stats.block_size_mismatch {
        let Some((worker, rank)) = workers.owner(*slot) else {
            continue;
        };
        let (w, r) = (worker.to_string(), rank.to_string());
        mirror_total(&m.block_size_mismatch, &[w.as_str(), r.as_str()], mm.events);
        mismatched.push((worker, rank, *mm));
    }
    mismatched
}

/// What a worker's scrape loop reads and changes; the same for every
/// worker, labelled by the worker's id when the loop starts.
#[derive(Clone)]
pub(crate) struct ScrapeHandles {
    pub(crate) config: Arc<Config>,
    pub(crate) fleet: Arc<Mutex<Fleet>>,
    pub(crate) client: HttpClient,
    pub(crate) metrics: Arc<SnapshotMetrics>,
    /// A worker that went up or down is published without waiting for
    /// the next tick.
    pub(crate) publisher: Publisher,
}

pub(crate) async fn scrape_loop(h: ScrapeHandles, id: u64) {
    let timeout = h.config.scrape.timeout;
    let counters = h.metrics.scrape(id);
    let mut tick = tokio::time::interval(h.config.scrape.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut warned_no_capacity, mut warned_no_batch) = (false, false);
    loop {
        tick.tick().await;
        let Some((url, dp, start, bs, needs_batch)) = ({
            let f = h.fleet.lock();
            f.worker(id).map(|w| {
                let frac = f
                    .model(&w.spec().model_name)
                    .is_some_and(|m| m.thresholds.active_prefill_tokens_frac.is_some());
                (
                    w.spec().metrics_url(),
                    w.spec().data_parallel_size,
                    w.spec().data_parallel_start_rank,
                    w.spec().block_size,
                    frac && w.spec().max_num_batched_tokens == 0,
                )
            })
        }) else {
            return;
        };
        let result = scrape::scrape_once(&h.client, &url, timeout, dp, start, bs).await;
        counters.scrapes.inc();
        if let Err(e) = &result {
            counters.errors.inc();
            tracing::debug!(worker = id, error = %e, "scrape failed");
        }
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
        let changed =
            h.fleet
                .lock()
                .record_scrape(id, result.map(|(ranks, _)| ranks), Instant::now());
        if changed {
            h.publisher.publish_now();
        }
    }
}

/// The planner's two loops, each model at its own intervals; decisions
/// are published at once (a draining worker leaves the snapshot's
/// candidates).
/// What the planner's loop reads and changes.
pub(crate) struct PlannerHandles {
    pub(crate) fleet: Arc<Mutex<Fleet>>,
    /// The load on each worker, booked.
    pub(crate) bookings: Arc<Mutex<Bookings>>,
    pub(crate) metrics: PlannerMetrics,
    pub(crate) publisher: Publisher,
}

pub(crate) async fn planner_loop(h: PlannerHandles) {
    if !h.fleet.lock().plans() {
        return;
    }
    let mut last_load: std::collections::HashMap<String, Instant> = Default::default();
    let mut last_throughput: std::collections::HashMap<String, Instant> = Default::default();
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        let planned = {
            let b = h.bookings.lock();
            let mut f = h.fleet.lock();
            let mut due = std::collections::HashMap::new();
            for (name, p) in &f.planning().models {
                let is_due = |last: &mut std::collections::HashMap<String, Instant>,
                              every: Duration| {
                    let from = last.get(name).copied().unwrap_or(started);
                    let d = now.saturating_duration_since(from) >= every;
                    if d {
                        last.insert(name.clone(), now);
                    }
                    d
                };
                let l = is_due(&mut last_load, p.cfg.load_interval);
                let t = is_due(&mut last_throughput, p.cfg.throughput_interval);
                due.insert(name.clone(), (l, t));
            }
            let loads = |f: &Fleet, id: u64| {
                let (mut prefill, mut decode_kv, mut role) = (0.0, 0.0, Default::default());
                if let Some(w) = f.worker(id) {
                    role = w.spec().role;
                    for s in w.slots() {
                        let l = b.slot(*s);
                        prefill += l.prefill_tokens as f64;
                        decode_kv += (l.decode_blocks * u64::from(w.spec().block_size)) as f64;
                    }
                }
                crate::planner::WorkerLoad {
                    worker_id: id,
                    role,
                    prefill_tokens: prefill,
                    decode_kv_tokens: decode_kv,
                }
            };
            let planned = f.plan(
                now,
                now_ms(),
                &|m| due.get(m).copied().unwrap_or((false, false)),
                &loads,
            );
            f.show_planned(&planned, &h.metrics);
            planned
        };
        if planned.iter().any(|p| p.decision.is_some()) {
            h.publisher.publish_now();
        }
    }
}
