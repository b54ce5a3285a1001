//! The simulated engine: per DP rank, a prefix cache, a running batch of at
//! most `max_running` requests with a FIFO queue in front of it, and a time
//! model.
//!
//! Time model (all durations divided by `speedup`, all skipped in instant
//! mode): prefill takes `prefill_us_per_token` per *uncached* prompt token;
//! each output token takes `decode_ms_per_token + decode_ms_per_running ×
//! running`. By default prefills of different requests overlap freely.
//! With `prefill_lanes = N`, at most N prefills progress at once per rank,
//! the rest wait in FIFO order: prefill is compute-bound, and an engine
//! shares one step budget among the prefills it runs, so a rank's queued
//! prefill tokens are what its next request waits behind — the load that
//! routing weighs.
//!
//! Prefill/decode interference: a rank runs its decodes and its prefills in
//! the same engine steps, as vLLM's chunked prefill does, so a decode step
//! that shares its step with prefill tokens is slower. Each decode step
//! takes, besides the above, `prefill_interference × prefill_us_per_token`
//! per prefill token scheduled with it; a step schedules at most
//! `max_num_batched_tokens − running` of the prompt tokens the rank is
//! prefilling at that moment (its chunk). 0 (the default) keeps decode
//! steps blind to prefills; 1 charges each step the whole chunk's compute.

use crate::cache::{Allocation, PrefixCache, Scope};
use crate::events::Publisher;
use crate::wire::SimEvent;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

#[derive(Debug, Clone)]
pub struct TimeModel {
    pub prefill_us_per_token: f64,
    pub decode_ms_per_token: f64,
    pub decode_ms_per_running: f64,
    pub speedup: f64,
    pub instant: bool,
    /// Share of a co-scheduled prefill chunk's compute a decode step pays.
    pub prefill_interference: f64,
    /// The step's token budget (`--max-num-batched-tokens`): bounds the
    /// chunk of prompt tokens a decode step shares its step with.
    pub max_num_batched_tokens: usize,
}

impl TimeModel {
    pub fn prefill(&self, uncached_tokens: usize) -> Duration {
        if self.instant {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(
            uncached_tokens as f64 * self.prefill_us_per_token * 1e-6 / self.speedup.max(1e-9),
        )
    }

    pub fn decode_step(&self, running: u32) -> Duration {
        if self.instant {
            return Duration::ZERO;
        }
        let ms = self.decode_ms_per_token + self.decode_ms_per_running * running as f64;
        Duration::from_secs_f64(ms * 1e-3 / self.speedup.max(1e-9))
    }

    /// The prompt tokens a decode step shares its step with, when the rank
    /// is prefilling `prefilling` tokens with `running` sequences.
    pub fn chunk(&self, running: u32, prefilling: usize) -> usize {
        prefilling.min(self.max_num_batched_tokens.saturating_sub(running as usize))
    }

    /// A decode step with `running` sequences while the rank prefills
    /// `prefilling` prompt tokens.
    pub fn decode_step_with(&self, running: u32, prefilling: usize) -> Duration {
        let base = self.decode_step(running);
        if self.instant || self.prefill_interference <= 0.0 {
            return base;
        }
        let chunk = self.chunk(running, prefilling) as f64;
        base + Duration::from_secs_f64(
            chunk * self.prefill_interference * self.prefill_us_per_token * 1e-6
                / self.speedup.max(1e-9),
        )
    }
}

pub struct Rank {
    pub index: u32,
    cache: Mutex<PrefixCache>,
    slots: Arc<Semaphore>,
    /// The engine's `max_num_seqs`: at most this many run, at most
    /// `max_running` (the slots) at all.
    limit: AtomicUsize,
    max_running: usize,
    /// Who runs now, for choosing whom to evict.
    runners: Mutex<Vec<Runner>>,
    next_runner: AtomicU64,
    /// Concurrent prefills allowed; `None` lets them all overlap.
    prefill_lanes: Option<Semaphore>,
    space: Notify,
    pub running: AtomicU32,
    pub waiting: AtomicU32,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub finished: AtomicU64,
    /// Prompt tokens being prefilled now, what decode steps share their
    /// steps with.
    pub prefilling: AtomicUsize,
    publisher: Option<Publisher>,
}

/// Counts a prefill's tokens while it runs, however it ends.
struct Prefilling<'a>(&'a AtomicUsize, usize);

impl Drop for Prefilling<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

impl Rank {
    pub fn new(
        index: u32,
        block_size: usize,
        blocks: usize,
        max_running: usize,
        prefill_lanes: usize,
        publisher: Option<Publisher>,
    ) -> Rank {
        Rank {
            index,
            cache: Mutex::new(PrefixCache::new(block_size, blocks)),
            slots: Arc::new(Semaphore::new(max_running.max(1))),
            limit: AtomicUsize::new(max_running.max(1)),
            max_running: max_running.max(1),
            runners: Mutex::new(Vec::new()),
            next_runner: AtomicU64::new(1),
            prefill_lanes: (prefill_lanes > 0).then(|| Semaphore::new(prefill_lanes)),
            space: Notify::new(),
            running: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            prefilling: AtomicUsize::new(0),
            publisher,
        }
    }

    /// Prefills `uncached` tokens: waits for a prefill lane if lanes are
    /// limited, then takes the model's time.
    pub async fn prefill(&self, time: &TimeModel, uncached: usize) {
        let _lane = match &self.prefill_lanes {
            Some(lanes) => match lanes.acquire().await {
                Ok(p) => Some(p),
                Err(_) => unreachable!("the semaphore is never closed"),
            },
            None => None,
        };
        let d = time.prefill(uncached);
        if !d.is_zero() {
            self.prefilling.fetch_add(uncached, Ordering::Relaxed);
            let _counted = Prefilling(&self.prefilling, uncached);
            tokio::time::sleep(d).await;
        }
    }

    /// A decode step's duration now, with the rank's running batch and the
    /// prefill chunk it shares the step with.
    pub fn decode_step(&self, time: &TimeModel) -> Duration {
        time.decode_step_with(
            self.running.load(Ordering::Relaxed),
            self.prefilling.load(Ordering::Relaxed),
        )
    }

    /// Pins blocks of `chain` that are cached, beyond any request's pin:
    /// a prefill's blocks held for a remote decode. Release with
    /// [`Rank::unhold`].
    pub fn hold(&self, chain: &[u64]) -> Allocation {
        self.cache().hold(chain)
    }

    /// Releases a [`Rank::hold`]; the blocks become evictable again.
    pub fn unhold(&self, held: &Allocation) {
        self.cache().release(held);
        self.space.notify_waiters();
    }

    pub fn cache(&self) -> MutexGuard<'_, PrefixCache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh id for an admitted request, unique on this rank.
    fn next_request(&self) -> u64 {
        self.next_runner.fetch_add(1, Ordering::Relaxed)
    }

    /// The engine's `max_num_seqs` now.
    pub fn max_num_seqs(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Sets `max_num_seqs`, within [1, the rank's slots]; running work is
    /// not touched, new work waits until fewer run. Returns the value set.
    pub fn set_max_num_seqs(&self, n: usize) -> usize {
        let n = n.clamp(1, self.max_running);
        self.limit.store(n, Ordering::Relaxed);
        self.space.notify_waiters();
        n
    }

    fn runners(&self) -> MutexGuard<'_, Vec<Runner>> {
        self.runners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves `n` running sequences back to waiting, chosen by `policy`;
    /// each resumes where it stopped once fewer than `max_num_seqs` run.
    /// Returns their request ids.
    pub fn evict(&self, n: usize, policy: EvictPolicy) -> Vec<u64> {
        let mut runners = self.runners();
        match policy {
            // Least recently (re)admitted first.
            EvictPolicy::Lru => runners.sort_by_key(|r| std::cmp::Reverse(r.admitted)),
            EvictPolicy::LargestKv => runners.sort_by_key(|r| r.context_tokens),
            // No priorities here: the newest goes first, as vLLM preempts.
            EvictPolicy::LowestPriority => runners.sort_by_key(|r| r.admitted),
        }
        let mut out = Vec::new();
        while out.len() < n {
            let Some(r) = runners.pop() else { break };
            r.evicted.store(true, Ordering::Relaxed);
            self.running.fetch_sub(1, Ordering::Relaxed);
            self.waiting.fetch_add(1, Ordering::Relaxed);
            out.push(r.request);
        }
        drop(runners);
        self.space.notify_waiters();
        out
    }

    /// Waits until fewer than `max_num_seqs` run, then counts one more.
    async fn until_room(&self) {
        loop {
            let notified = self.space.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let limit = self.limit.load(Ordering::Relaxed) as u32;
            if self
                .running
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                    (r < limit).then_some(r + 1)
                })
                .is_ok()
            {
                return;
            }
            notified.await;
        }
    }

    pub fn load(&self) -> u32 {
        self.running.load(Ordering::Relaxed) + self.waiting.load(Ordering::Relaxed)
    }

    fn publish(&self, ev: SimEvent) {
        if let Some(p) = &self.publisher {
            p.send(ev);
        }
    }

    /// vLLM's reset_prefix_cache: refuses while requests hold blocks.
    pub fn reset_prefix_cache(&self) -> bool {
        let ok = self.cache().reset();
        if ok {
            self.publish(SimEvent::AllCleared);
        }
        ok
    }

    /// An engine restart: the cache is gone and the event sequence starts
    /// over, with no AllBlocksCleared (a crashed process says nothing).
    pub fn restart(&self) {
        self.cache().wipe();
        if let Some(p) = &self.publisher {
            p.restart();
        }
        self.space.notify_waiters();
    }
}

/// Why a request cannot be served at all.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    #[error("prompt needs {need} KV blocks but the cache holds {capacity}")]
    TooLong { need: usize, capacity: usize },
}

/// What the seed's `/v1/admin/batch` `policy` evicts first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictPolicy {
    #[default]
    Lru,
    LargestKv,
    LowestPriority,
}

/// A running sequence, as eviction sees it.
struct Runner {
    request: u64,
    /// When it was (re)admitted, in the rank's admission order.
    admitted: u64,
    context_tokens: usize,
    evicted: Arc<AtomicBool>,
}

/// A running request's hold on its rank; dropping it releases everything,
/// so a client that disconnects mid-stream frees its blocks.
pub struct Admitted {
    rank: Arc<Rank>,
    alloc: Allocation,
    _permit: OwnedSemaphorePermit,
    pub cached_tokens: usize,
    pub request: u64,
    context_tokens: usize,
    evicted: Arc<AtomicBool>,
}

impl Admitted {
    pub fn rank(&self) -> &Rank {
        &self.rank
    }

    /// The request's full prompt blocks' engine hashes, in chain order.
    pub fn blocks(&self) -> &[u64] {
        &self.alloc.blocks
    }

    fn register(&self) {
        let admitted = self.rank.next_runner.fetch_add(1, Ordering::Relaxed);
        self.rank.runners().push(Runner {
            request: self.request,
            admitted,
            context_tokens: self.context_tokens,
            evicted: self.evicted.clone(),
        });
    }

    /// Called before each decode step: an evicted sequence waits here,
    /// holding its blocks (swapped out, in an engine), until it may run
    /// again.
    pub async fn checkpoint(&mut self) {
        self.context_tokens += 1;
        if !self.evicted.load(Ordering::Relaxed) {
            return;
        }
        self.rank.until_room().await;
        self.rank.waiting.fetch_sub(1, Ordering::Relaxed);
        self.evicted.store(false, Ordering::Relaxed);
        self.register();
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.rank.cache().release(&self.alloc);
        self.rank.runners().retain(|r| r.request != self.request);
        if self.evicted.load(Ordering::Relaxed) {
            self.rank.waiting.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.rank.running.fetch_sub(1, Ordering::Relaxed);
        }
        self.rank.finished.fetch_add(1, Ordering::Relaxed);
        self.rank.space.notify_waiters();
    }
}

/// Waits for a running slot and KV space, then pins the request's blocks.
pub async fn admit(
    rank: Arc<Rank>,
    tokens: &[u32],
    scope: &Scope,
    max_tokens: usize,
) -> Result<Admitted, AdmitError> {
    admit_publishing(rank, tokens, scope, max_tokens, true).await
}

/// [`admit`], publishing `BlockStored` for the blocks it caches only when
/// `publish_stored` (evictions are always published): a decode worker
/// that caches blocks it received may not announce them.
pub async fn admit_publishing(
    rank: Arc<Rank>,
    tokens: &[u32],
    scope: &Scope,
    max_tokens: usize,
    publish_stored: bool,
) -> Result<Admitted, AdmitError> {
    let (chain, decode_blocks, capacity) = {
        let c = rank.cache();
        let bs = c.block_size();
        (
            c.chain(tokens, scope),
            max_tokens.div_ceil(bs),
            c.capacity(),
        )
    };
    if chain.len() + decode_blocks > capacity {
        return Err(AdmitError::TooLong {
            need: chain.len() + decode_blocks,
            capacity,
        });
    }
    rank.waiting.fetch_add(1, Ordering::Relaxed);
    // The semaphore is FIFO, so the queue is too.
    let permit = match rank.slots.clone().acquire_owned().await {
        Ok(p) => p,
        Err(_) => unreachable!("the semaphore is never closed"),
    };
    let alloc = loop {
        let notified = rank.space.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let mut events = Vec::new();
        let got = rank
            .cache()
            .allocate(tokens, scope, &chain, decode_blocks, &mut events);
        for e in events {
            if publish_stored || !matches!(e, crate::cache::CacheEvent::Stored { .. }) {
                rank.publish(SimEvent::Cache(e));
            }
        }
        if let Some(a) = got {
            break a;
        }
        notified.await;
    };
    // Under a lowered max_num_seqs, new work waits with its slot.
    rank.until_room().await;
    rank.waiting.fetch_sub(1, Ordering::Relaxed);
    let bs = rank.cache().block_size();
    let cached_tokens = alloc.cached_blocks * bs;
    rank.prefix_queries
        .fetch_add(tokens.len() as u64, Ordering::Relaxed);
    rank.prefix_hits
        .fetch_add(cached_tokens as u64, Ordering::Relaxed);
    let a = Admitted {
        request: rank.next_request(),
        rank,
        alloc,
        _permit: permit,
        cached_tokens,
        context_tokens: tokens.len(),
        evicted: Arc::new(AtomicBool::new(false)),
    };
    a.register();
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_model_arithmetic() {
        let t = TimeModel {
            prefill_us_per_token: 20.0,
            decode_ms_per_token: 2.0,
            decode_ms_per_running: 0.5,
            speedup: 2.0,
            instant: false,
            prefill_interference: 0.0,
            max_num_batched_tokens: 8192,
        };
        assert_eq!(t.prefill(1000), Duration::from_millis(10));
        assert_eq!(t.decode_step(4), Duration::from_millis(2));
        let instant = TimeModel { instant: true, ..t };
        assert_eq!(instant.prefill(1000), Duration::ZERO);
        assert_eq!(instant.decode_step(100), Duration::ZERO);
    }

    #[tokio::test]
    async fn admission_waits_for_space_and_release_wakes_it() {
        let rank = Arc::new(Rank::new(0, 4, 4, 8, 0, None));
        let a: Vec<u32> = (0..12).collect();
        let first = admit(rank.clone(), &a, &Scope::default(), 4).await.unwrap();
        assert_eq!(rank.cache().used_blocks(), 4);
        let b: Vec<u32> = (100..108).collect();
        let r2 = rank.clone();
        let waiter = tokio::spawn(async move {
            admit(r2, &b, &Scope::default(), 0)
                .await
                .map(|a| a.cached_tokens)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(rank.waiting.load(Ordering::Relaxed), 1);
        drop(first);
        assert_eq!(waiter.await.unwrap().unwrap(), 0);
        assert!(matches!(
            admit(
                rank.clone(),
                &(0..40).collect::<Vec<_>>(),
                &Scope::default(),
                0
            )
            .await,
            Err(AdmitError::TooLong { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn one_prefill_lane_serialises_prefills() {
        let time = TimeModel {
            prefill_us_per_token: 1000.0,
            decode_ms_per_token: 0.0,
            decode_ms_per_running: 0.0,
            speedup: 1.0,
            instant: false,
            prefill_interference: 0.0,
            max_num_batched_tokens: 8192,
        };
        for (lanes, expect_ms) in [(1, 200), (0, 100)] {
            let rank = Arc::new(Rank::new(0, 4, 100, 8, lanes, None));
            let start = tokio::time::Instant::now();
            let (a, b) = (rank.clone(), rank.clone());
            let (t1, t2) = (time.clone(), time.clone());
            let _ = tokio::join!(async move { a.prefill(&t1, 100).await }, async move {
                b.prefill(&t2, 100).await
            });
            assert_eq!(
                start.elapsed(),
                Duration::from_millis(expect_ms),
                "two 100-token prefills with {lanes} lanes"
            );
        }
    }

    /// The p90 inter-token latency of one decoding sequence over 200
    /// steps, in paused (simulated) time, with or without a rank that keeps
    /// prefilling 4000-token prompts beside it.
    async fn itl_p90(interference: f64, prefills: bool) -> Duration {
        let time = TimeModel {
            prefill_us_per_token: 20.0,
            decode_ms_per_token: 2.0,
            decode_ms_per_running: 0.0,
            speedup: 1.0,
            instant: false,
            prefill_interference: interference,
            max_num_batched_tokens: 2048,
        };
        let rank = Arc::new(Rank::new(0, 16, 100, 8, 0, None));
        let prefiller = prefills.then(|| {
            let (rank, time) = (rank.clone(), time.clone());
            tokio::spawn(async move {
                loop {
                    rank.prefill(&time, 4000).await;
                    tokio::time::sleep(Duration::from_millis(40)).await;
                }
            })
        });
        let mut itl = Vec::new();
        for _ in 0..200 {
            let start = tokio::time::Instant::now();
            tokio::time::sleep(rank.decode_step(&time)).await;
            itl.push(start.elapsed());
        }
        if let Some(p) = prefiller {
            p.abort();
        }
        itl.sort();
        itl[itl.len() * 9 / 10]
    }

    #[tokio::test(start_paused = true)]
    async fn co_scheduled_prefill_chunks_slow_decode_steps() {
        let quiet = itl_p90(0.5, false).await;
        let busy = itl_p90(0.5, true).await;
        assert_eq!(quiet, Duration::from_millis(2));
        // A 2048-token chunk at 20 µs per token, half charged: +20.48 ms
        // (the timer wheel rounds up to its millisecond).
        assert!(
            (Duration::from_micros(22_480)..=Duration::from_millis(23)).contains(&busy),
            "{busy:?}"
        );
        assert_eq!(
            itl_p90(0.0, true).await,
            quiet,
            "no interference unless asked for"
        );
    }

    #[test]
    fn the_chunk_is_what_the_step_budget_leaves() {
        let t = TimeModel {
            prefill_us_per_token: 10.0,
            decode_ms_per_token: 1.0,
            decode_ms_per_running: 0.0,
            speedup: 1.0,
            instant: false,
            prefill_interference: 1.0,
            max_num_batched_tokens: 512,
        };
        assert_eq!(t.chunk(12, 100), 100);
        assert_eq!(t.chunk(12, 10_000), 500);
        assert_eq!(t.chunk(600, 10_000), 0);
        assert_eq!(t.decode_step_with(12, 10_000), Duration::from_millis(6));
    }

    #[tokio::test]
    async fn max_running_queues_requests() {
        let rank = Arc::new(Rank::new(0, 4, 100, 1, 0, None));
        let first = admit(rank.clone(), &[1, 2, 3, 4], &Scope::default(), 1)
            .await
            .unwrap();
        let r2 = rank.clone();
        let waiter = tokio::spawn(async move {
            admit(r2, &[1, 2, 3, 4], &Scope::default(), 1)
                .await
                .map(|a| a.cached_tokens)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            (
                rank.running.load(Ordering::Relaxed),
                rank.waiting.load(Ordering::Relaxed)
            ),
            (1, 1)
        );
        drop(first);
        assert_eq!(
            waiter.await.unwrap().unwrap(),
            4,
            "the second request hits the first's blocks"
        );
    }
}
