//! The sidecar's two kinds of task: one publish loop, and one scrape loop
//! per worker. Each tick rebuilds what changed and publishes it.

use crate::Sidecar;
use crate::metrics::gauges;
use crate::sidecar::now_ms;
use crate::sources::metrics::scrape;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Sidecar {
    /// Rebuilds and publishes the snapshot if it changed; refreshes gauges.
    pub(crate) fn publish_now(&self) {
        let snap = {
            let now = Instant::now();
            let mut b = self.bookings();
            let expired = b.sweep(now);
            if expired > 0 {
                tracing::warn!(expired, "bookings expired without their end being reported");
                self.metrics().bookings_expired.inc_by(expired as u64);
            }
            let mut f = self.fleet();
            f.expire(now, self.config().scrape.down_after);
            let snap = f.build_snapshot(&b, self.config().load.max_retry_after_s);
            gauges::refresh(self.metrics(), &f, &b, &snap);
            snap
        };
        gauges::mirror_subscribers(self.metrics(), self.workers());
        if let Some(v) = self.store().publish(self.versions(), snap, now_ms()) {
            tracing::debug!(version = v, "published snapshot");
            self.metrics()
                .snapshot_bytes
                .set(self.store().bytes().len() as i64);
        }
        self.metrics()
            .snapshot_version
            .set(self.versions().current() as i64);
    }

    /// Expires and publishes the routed-prefix index's changed shards;
    /// ranks whose engine emptied its cache forget their routed prefixes.
    fn publish_routed(&self) {
        let cleared = self.plane().take_cleared();
        let updates = {
            let mut a = self.routed();
            for slot in cleared {
                a.forget_slot(slot);
            }
            a.sweep(Instant::now());
            a.take_updates()
        };
        if !updates.is_empty() {
            self.plane().log.publish(updates);
        }
    }
}

pub(crate) async fn publish_loop(sc: Arc<Sidecar>) {
    // At least 1 ms, as tokio requires; at most a second, so index
    // statistics come once every `stats_every` ticks, at least.
    let interval = sc
        .config()
        .server
        .publish_interval
        .max(Duration::from_millis(1));
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
        sc.publish_now();
        sc.publish_routed();
        n += 1;
        // Index statistics need a round trip to the index thread; once a
        // second is plenty for gauges.
        if n.is_multiple_of(stats_every)
            && let Some(stats) = {
                let sc = sc.clone();
                tokio::task::spawn_blocking(move || sc.plane().stats())
                    .await
                    .ok()
                    .flatten()
            }
        {
            for (worker, rank, m) in gauges::mirror_index(sc.metrics(), &stats, sc.workers()) {
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

pub(crate) async fn scrape_loop(sc: Arc<Sidecar>, id: u64) {
    let timeout = sc.config().scrape.timeout;
    let mut tick = tokio::time::interval(sc.config().scrape.interval);
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
        let result = scrape::scrape_once(sc.client(), &url, timeout, dp, start, bs).await;
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

/// The planner's two loops, each model at its own intervals; decisions
/// are published at once (a draining worker leaves the snapshot's
/// candidates).
pub(crate) async fn planner_loop(sc: Arc<Sidecar>) {
    if sc.fleet().planning.models.is_empty() {
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
            let b = sc.bookings();
            let mut f = sc.fleet();
            let mut due = std::collections::HashMap::new();
            for (name, p) in &f.planning.models {
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
            let loads = |f: &crate::fleet::Fleet, id: u64| {
                let (mut prefill, mut decode_kv) = (0.0, 0.0);
                if let Some(w) = f.workers.get(&id) {
                    for s in &w.slots {
                        let l = b.slot(*s);
                        prefill += l.prefill_tokens as f64;
                        decode_kv += (l.decode_blocks * u64::from(w.spec.block_size)) as f64;
                    }
                }
                crate::planner::WorkerLoad {
                    worker_id: id,
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
            gauges::planner(sc.metrics(), &f, &planned);
            planned
        };
        if planned.iter().any(|p| p.decision.is_some()) {
            sc.publish_now();
        }
    }
}
