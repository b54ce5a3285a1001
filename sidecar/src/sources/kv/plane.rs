//! The KV event plane: subscribers feed one index thread, which applies
//! batches to each model's index and publishes the shards they changed.
//!
//! One thread owns every index, so applying a batch takes no lock; the
//! subscribers only decode frames off the socket. Changed shards are encoded
//! at most once per `publish_interval` and handed to the [`ShardSink`] the
//! plane was started with (the sidecar's published shard log, which the
//! snapshot long poll serves: "every shard changed after version N").
//!
//! The thread also snapshots the index for `GET /dump` and replays a
//! peer's dump at start-up (`recovery`). While a recovery is pending it
//! holds batches back, so that events arriving meanwhile apply after the
//! recovered blocks, as they happened after them.

mod recovery;

pub use recovery::{Dropped, RestoreReport};

use crate::sources::kv::dump::Dump;
use crate::sources::kv::index::{Index, IngestStats};
use crate::sources::kv::stage::Staged;
use crate::sources::kv::subscriber::{Ingest, ResyncReason};
use crate::sources::kv::wire::Unmatchable;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender, channel, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::oneshot;

/// A rank as every sidecar names it; slot numbers are this process's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankId {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// Who holds a slot.
#[derive(Debug, Clone)]
struct SlotOwner {
    model: String,
    rank: RankId,
}

/// Commands from the catalog to the index thread.
#[derive(Debug)]
enum Control {
    AddSlot {
        slot: u16,
        owner: SlotOwner,
        block_size: u32,
        expected_blocks: usize,
    },
    RemoveSlot {
        slot: u16,
    },
    /// Starts a model's text index with its vocabulary.
    Vocab {
        model: String,
        vocab: Arc<crate::prompt::Vocab>,
    },
    Stats(Sender<PlaneStats>),
    /// A copy of every slot's blocks; `None` while a recovery is pending
    /// (the index is not what it will be).
    Dump(oneshot::Sender<Option<Dump>>),
    /// A peer's dump to replay; ends the hold.
    Restore(Dump, oneshot::Sender<RestoreReport>),
    /// Recovery gave up: ends the hold.
    Release,
}

/// Why the index cannot be dumped now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum DumpUnavailable {
    #[error("the index is being recovered from a peer")]
    Recovering,
    #[error("the index thread did not answer")]
    NoAnswer,
}

#[derive(Debug, Clone, Default)]
pub struct PlaneStats {
    pub per_model: Vec<(String, IngestStats, usize)>,
    /// Per model with a text index: prefix keys held, and what it skipped.
    pub text: Vec<(String, usize, crate::sources::kv::index::TextStats)>,
    /// Blocks indexed as unmatchable, per slot and reason (running totals).
    pub unmatchable: Vec<(u16, Unmatchable, u64)>,
    pub malformed_batches: u64,
    /// Log lines written about them: each slot's first, then at most one
    /// a minute per slot (running total).
    pub malformed_batches_logged: u64,
    pub resyncs: Vec<(u16, ResyncReason)>,
    /// Per slot: stored events whose block size is not the slot's (running
    /// total), the last such size, and the slot's.
    pub block_size_mismatch: std::collections::BTreeMap<u16, BlockSizeMismatch>,
    /// Per slot: seconds from the engine stamping its latest batch to the
    /// index applying it (publisher, network, and this thread's queue).
    /// Engines stamp with their own wall clock, so skew between hosts adds
    /// to it; a batch stamped in our future counts as no lag.
    pub event_lag: std::collections::BTreeMap<u16, f64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BlockSizeMismatch {
    pub events: u64,
    pub engine_block_size: u32,
    pub block_size: u32,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct PlaneConfig {
    pub shard_count: u32,
    pub max_blocks_per_slot: usize,
    pub publish_interval: Duration,
    /// Batches buffered between subscribers and the index thread.
    pub queue: usize,
    /// Starts holding batches back for a recovery, for at most this long
    /// (see [`Plane::restore`]).
    pub hold: Option<Duration>,
}

impl Default for PlaneConfig {
    fn default() -> Self {
        PlaneConfig {
            shard_count: 16384,
            max_blocks_per_slot: 4 << 20,
            publish_interval: Duration::from_millis(5),
            queue: 4096,
            hold: None,
        }
    }
}

/// One changed shard: the model's index key (or its text index key), the
/// shard, how many shards that index has, and the shard's bytes.
pub(crate) type ShardChange = (String, u32, usize, Vec<u8>);

/// Where the index thread puts changed shards; each call is one version.
pub(crate) type ShardSink = Box<dyn Fn(Vec<ShardChange>) + Send>;

/// Handle to the index thread.
pub struct Plane {
    /// Slots whose engine cache emptied (AllBlocksCleared, or a resync)
    /// since the last [`Plane::take_cleared`].
    cleared: Arc<Mutex<Vec<u16>>>,
    ingest: SyncSender<Ingest>,
    control: Sender<Control>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Plane {
    pub(crate) fn start(config: PlaneConfig, sink: ShardSink) -> std::io::Result<Plane> {
        let (ingest, rx) = sync_channel(config.queue);
        let (control, crx) = channel();
        let stop = Arc::new(AtomicBool::new(false));
        let cleared = Arc::new(Mutex::new(Vec::new()));
        let (s2, c2) = (stop.clone(), cleared.clone());
        let thread = std::thread::Builder::new()
            .name("kv-index".into())
            .spawn(move || run(config, rx, crx, &sink, &s2, c2))?;
        Ok(Plane {
            cleared,
            ingest,
            control,
            stop,
            thread: Some(thread),
        })
    }

    /// Where subscribers send batches.
    pub(crate) fn sender(&self) -> SyncSender<Ingest> {
        self.ingest.clone()
    }

    pub(crate) fn add_slot(
        &self,
        slot: u16,
        model: &str,
        rank: RankId,
        block_size: u32,
        expected_blocks: usize,
    ) {
        let _ = self.control.send(Control::AddSlot {
            slot,
            owner: SlotOwner {
                model: model.to_string(),
                rank,
            },
            block_size,
            expected_blocks,
        });
    }

    /// Starts `model`'s text index; before its workers' events, so that
    /// their chains are keyed from the root.
    pub(crate) fn set_vocab(&self, model: &str, vocab: Arc<crate::prompt::Vocab>) {
        let _ = self.control.send(Control::Vocab {
            model: model.to_string(),
            vocab,
        });
    }

    pub(crate) fn remove_slot(&self, slot: u16) {
        let _ = self.control.send(Control::RemoveSlot { slot });
    }

    /// Slots whose engine reported its cache emptied since the last call:
    /// whatever else kvgate believes they hold is gone too.
    pub(crate) fn take_cleared(&self) -> Vec<u16> {
        std::mem::take(&mut *self.cleared.lock())
    }

    pub fn stats(&self) -> Option<PlaneStats> {
        let (tx, rx) = channel();
        self.control.send(Control::Stats(tx)).ok()?;
        rx.recv_timeout(Duration::from_secs(2)).ok()
    }

    /// A copy of every rank's blocks. The index thread only copies its
    /// tables (ingest waits that long); the caller encodes.
    pub(crate) async fn dump(&self) -> Result<Dump, DumpUnavailable> {
        let (tx, rx) = oneshot::channel();
        self.control
            .send(Control::Dump(tx))
            .map_err(|_| DumpUnavailable::NoAnswer)?;
        // The thread may be applying a large batch; a copy of the index
        // itself takes well under a second.
        match tokio::time::timeout(Duration::from_secs(10), rx).await {
            Ok(Ok(Some(d))) => Ok(d),
            Ok(Ok(None)) => Err(DumpUnavailable::Recovering),
            _ => Err(DumpUnavailable::NoAnswer),
        }
    }

    /// Replays a peer's dump into the ranks of this catalog and ends the
    /// hold; `None` if the index thread is gone.
    pub(crate) async fn restore(&self, dump: Dump) -> Option<RestoreReport> {
        let (tx, rx) = oneshot::channel();
        self.control.send(Control::Restore(dump, tx)).ok()?;
        rx.await.ok()
    }

    /// Ends the hold without a dump: batches apply from here on.
    pub(crate) fn release(&self) {
        let _ = self.control.send(Control::Release);
    }
}

impl Drop for Plane {
    fn drop(&mut self) {
        // Subscribers may still hold senders, so the thread is told to stop
        // rather than waiting for its channel to close.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct State {
    config: PlaneConfig,
    models: HashMap<String, Index>,
    slot_model: HashMap<u16, SlotOwner>,
    staged: Staged,
    stats: PlaneStats,
    cleared: Arc<Mutex<Vec<u16>>>,
    /// Batches wait until a recovery restores or releases, or this passes.
    hold_until: Option<Instant>,
    /// Per slot, when its malformed batches were last logged.
    malformed_log: HashMap<u16, LogEvery>,
}

/// How often one slot's malformed batches are logged at most, as the
/// listeners' refusals and replica sync's lost connections are: a broken
/// or hostile publisher sends tens of thousands a second (96 MB of log in
/// ten seconds before this), and each is counted in
/// `kvgate_sidecar_kv_malformed_batches` whether logged or not.
const MALFORMED_LOG_EVERY: Duration = Duration::from_secs(60);

/// Logs the first event, then at most once per period, with the count of
/// events since the last line.
#[derive(Debug, Default)]
struct LogEvery {
    last: Option<Instant>,
    since: u64,
}

impl LogEvery {
    /// Counts an event at `now`; when a line is due, the events it
    /// stands for (this one and those left unlogged before it).
    fn due(&mut self, now: Instant, every: Duration) -> Option<u64> {
        self.since += 1;
        if self.last.is_some_and(|t| now.duration_since(t) < every) {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since))
    }
}

impl State {
    fn index_of(&mut self, slot: u16) -> Option<&mut Index> {
        let owner = self.slot_model.get(&slot)?;
        self.models.get_mut(&owner.model)
    }

    /// Whether batches are held back now; a hold that outlived its bound
    /// ends here.
    fn holding(&mut self) -> bool {
        match self.hold_until {
            Some(t) if Instant::now() >= t => {
                tracing::warn!(
                    "index recovery did not finish in time: applying KV events without it"
                );
                self.hold_until = None;
                false
            }
            Some(_) => true,
            None => false,
        }
    }

    fn control(&mut self, c: Control) {
        match c {
            Control::AddSlot {
                slot,
                owner,
                block_size,
                expected_blocks,
            } => {
                let (shards, max) = (self.config.shard_count, self.config.max_blocks_per_slot);
                let idx = self
                    .models
                    .entry(owner.model.clone())
                    .or_insert_with(|| Index::new(shards, max));
                idx.add_slot(slot, block_size);
                if expected_blocks > 0 {
                    idx.reserve(slot, expected_blocks);
                }
                self.slot_model.insert(slot, owner);
            }
            Control::Vocab { model, vocab } => {
                let (shards, max) = (self.config.shard_count, self.config.max_blocks_per_slot);
                self.models
                    .entry(model)
                    .or_insert_with(|| Index::new(shards, max))
                    .set_vocab(vocab);
            }
            Control::RemoveSlot { slot } => {
                if let Some(idx) = self.index_of(slot) {
                    idx.remove_slot(slot);
                }
                self.slot_model.remove(&slot);
                self.malformed_log.remove(&slot);
                self.stats.block_size_mismatch.remove(&slot);
                self.stats.event_lag.remove(&slot);
            }
            Control::Stats(tx) => {
                let mut s = self.stats.clone();
                s.per_model = self
                    .models
                    .iter()
                    .map(|(k, i)| (k.clone(), i.stats, i.len()))
                    .collect();
                s.text = self
                    .models
                    .iter()
                    .filter_map(|(k, i)| i.text_stats().map(|(n, t)| (k.clone(), n, t)))
                    .collect();
                s.unmatchable = self
                    .models
                    .values()
                    .flat_map(|i| {
                        i.unmatchable
                            .iter()
                            .map(|(&(slot, why), &n)| (slot, why, n))
                    })
                    .collect();
                let _ = tx.send(s);
            }
            Control::Dump(tx) => {
                let d = self.hold_until.is_none().then(|| self.dump());
                let _ = tx.send(d);
            }
            Control::Restore(dump, tx) => {
                let report = self.restore(dump);
                self.hold_until = None;
                let _ = tx.send(report);
            }
            Control::Release => self.hold_until = None,
        }
    }

    fn ingest(&mut self, msg: Ingest) {
        match msg {
            Ingest::Batch { slot, seq, payload } => {
                let Some(owner) = self.slot_model.get(&slot) else {
                    return;
                };
                let Some(idx) = self.models.get_mut(&owner.model) else {
                    return;
                };
                let block_size = idx.block_size(slot);
                self.staged.keep_tokens = idx.has_text();
                match self.staged.stage(&payload, block_size) {
                    Ok(()) => {
                        idx.apply(slot, &self.staged);
                        let (events, engine_block_size) = self.staged.foreign_block_size;
                        if events > 0 {
                            let m = self.stats.block_size_mismatch.entry(slot).or_default();
                            m.events += events as u64;
                            m.engine_block_size = engine_block_size;
                            m.block_size = block_size;
                        }
                        if self.staged.clears() {
                            self.note_cleared(slot);
                        }
                        if let Some(lag) = self.staged.meta.and_then(|m| lag_seconds(m.ts)) {
                            self.stats.event_lag.insert(slot, lag);
                        }
                    }
                    Err(e) => {
                        self.stats.malformed_batches += 1;
                        let log = self.malformed_log.entry(slot).or_default();
                        if let Some(batches) = log.due(Instant::now(), MALFORMED_LOG_EVERY) {
                            self.stats.malformed_batches_logged += 1;
                            // The sequence number finds the batch in the
                            // engine's log; `batches` says how many this
                            // line stands for.
                            tracing::warn!(
                                slot,
                                seq,
                                batches,
                                error = %e,
                                "skipping malformed KV event batches (logged once a minute at most per rank; batches: skipped since the last line, this one included)"
                            );
                        }
                    }
                }
            }
            Ingest::Resync { slot, reason } => {
                self.stats.resyncs.push((slot, reason));
                if self.stats.resyncs.len() > 256 {
                    self.stats.resyncs.remove(0);
                }
                if let Some(idx) = self.index_of(slot) {
                    idx.clear_slot(slot);
                }
                self.note_cleared(slot);
            }
        }
    }

    fn note_cleared(&self, slot: u16) {
        let mut c = self.cleared.lock();
        if !c.contains(&slot) {
            c.push(slot);
        }
    }

    /// Publishes changed shards, at most `MAX_SHARDS_PER_VERSION` per
    /// version so that readers can take them in bounded frames. Returns the
    /// bytes published.
    fn publish(&mut self, sink: &ShardSink) -> usize {
        let mut updates = Vec::new();
        let mut bytes = 0;
        for (model, idx) in &mut self.models {
            let count = idx.shard_count() as usize;
            for shard in idx.take_dirty() {
                let b = idx.encode_shard(shard);
                bytes += b.len();
                updates.push((model.clone(), shard, count, b));
            }
            let text_key = kvgate_core::text::index_key(model);
            for (shard, b) in idx.take_text_updates() {
                bytes += b.len();
                updates.push((
                    text_key.clone(),
                    shard,
                    kvgate_core::text::SHARDS as usize,
                    b,
                ));
            }
        }
        while !updates.is_empty() {
            let rest = updates.split_off(updates.len().min(MAX_SHARDS_PER_VERSION));
            sink(std::mem::replace(&mut updates, rest));
        }
        bytes
    }
}

/// Shards per published version: bounds the smallest frame a reader must
/// take whole.
const MAX_SHARDS_PER_VERSION: usize = 64;

/// Bytes per second of shard updates the plane publishes at most. In steady
/// state a publish is a few shards and goes out every interval; during a
/// bulk load every round touches nearly every shard, and re-sending the
/// whole index every 5 ms would only burn CPU and Envoy memory.
const PUBLISH_BUDGET_BYTES_PER_S: f64 = 32.0 * 1024.0 * 1024.0;

/// How long ago an engine stamped a batch (`ts`, Unix seconds), or None
/// when it carries no usable stamp (0 or not finite: some shapes omit it).
fn lag_seconds(ts: f64) -> Option<f64> {
    if !ts.is_finite() || ts <= 0.0 {
        return None;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs_f64();
    Some((now - ts).max(0.0))
}

fn run(
    config: PlaneConfig,
    rx: Receiver<Ingest>,
    crx: Receiver<Control>,
    sink: &ShardSink,
    stop: &AtomicBool,
    cleared: Arc<Mutex<Vec<u16>>>,
) {
    let mut st = State {
        config,
        models: HashMap::new(),
        slot_model: HashMap::new(),
        staged: Staged::default(),
        stats: PlaneStats::default(),
        cleared,
        hold_until: config.hold.map(|d| Instant::now() + d),
        malformed_log: HashMap::new(),
    };
    let mut last_publish = Instant::now();
    let mut interval = config.publish_interval;
    while !stop.load(Ordering::Relaxed) {
        while let Ok(c) = crx.try_recv() {
            st.control(c);
        }
        let wait = interval
            .saturating_sub(last_publish.elapsed())
            .max(Duration::from_micros(100));
        if st.holding() {
            // Batches wait in the channel, and behind it in the subscribers,
            // until the recovered blocks are in: applied first, a child of
            // a recovered block would be dropped as an orphan and a removal
            // of one would find nothing.
            if let Ok(c) = crx.recv_timeout(wait.max(Duration::from_millis(10))) {
                st.control(c);
            }
            continue;
        }
        match rx.recv_timeout(wait) {
            Ok(msg) => {
                // A slot is announced before its subscriber starts, but the
                // announcement may still be queued behind this batch.
                if let Ingest::Batch { slot, .. } = &msg
                    && !st.slot_model.contains_key(slot)
                {
                    while let Ok(c) = crx.try_recv() {
                        st.control(c);
                    }
                }
                st.ingest(msg)
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                st.publish(sink);
                return;
            }
        }
        if last_publish.elapsed() >= interval {
            // Control messages (new slots) must land before their batches'
            // effects are published.
            while let Ok(c) = crx.try_recv() {
                st.control(c);
            }
            let bytes = st.publish(sink);
            last_publish = Instant::now();
            interval = config.publish_interval.max(Duration::from_secs_f64(
                bytes as f64 / PUBLISH_BUDGET_BYTES_PER_S,
            ));
        }
    }
}

#[cfg(test)]
mod tests;
