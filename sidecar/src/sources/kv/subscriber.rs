//! One subscriber per worker rank: a ZMQ SUB socket on the engine's KV-event
//! endpoint, sequence checking, and replay to fill gaps.
//!
//! Each subscriber runs on its own OS thread (ZMQ sockets are not `Sync`)
//! and hands raw batches to the index thread over a bounded channel. When the
//! index falls behind, the channel fills, the SUB socket's high-water mark
//! drops batches, and the resulting gap is repaired by replay — so a slow
//! index costs freshness, never memory.
//!
//! What the index is told:
//! * `Batch` for every batch in sequence order, replayed or live;
//! * `Resync` when the subscriber can no longer vouch for the slot's state:
//!   the engine restarted (its cache is empty), or batches were lost and
//!   replay could not cover them. The index drops the slot's entries, and
//!   the batches that follow rebuild it.

mod monitor;

use crate::metrics::SubscriberCounters;
use crate::sources::kv::replay::replay;
use crate::sources::kv::seq::{SeqCheck, SeqTracker};
use crate::sources::kv::socket::SocketLimits;
use monitor::Monitor;
use std::collections::HashMap;
use std::ops::{ControlFlow, Range};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::thread::JoinHandle;
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64;

/// Why a slot's index entries were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncReason {
    /// The publisher's sequence went backwards: a new engine process.
    Restart,
    /// Batches were lost and the replay buffer no longer held them.
    GapNotReplayable,
    /// Batches were lost and the worker has no replay endpoint.
    GapNoReplay,
    /// A replay of the publisher's whole buffer failed or was refused
    /// after some of it was applied: a hole follows what it delivered.
    ReplayIncomplete,
}

impl ResyncReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ResyncReason::Restart => "restart",
            ResyncReason::GapNotReplayable => "gap_not_replayable",
            ResyncReason::GapNoReplay => "gap_no_replay",
            ResyncReason::ReplayIncomplete => "replay_incomplete",
        }
    }
}

#[derive(Debug)]
pub enum Ingest {
    Batch {
        slot: u16,
        seq: u64,
        payload: Vec<u8>,
    },
    Resync {
        slot: u16,
        reason: ResyncReason,
    },
}

#[derive(Debug, Clone)]
pub struct SubscriberSpec {
    pub slot: u16,
    /// The rank's PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The rank's replay ROUTER endpoint, if the engine has one.
    pub replay_endpoint: Option<String>,
    pub topic: Vec<u8>,
    pub replay_timeout: Duration,
    /// Payload bytes one replay may take (`kv.max_replay_bytes`).
    pub max_replay_bytes: u64,
    pub limits: SocketLimits,
}

/// A running subscriber; `stop`, or dropping it, stops its thread and
/// waits for it.
pub struct Subscriber {
    /// What its thread counts into, for tests to read.
    #[cfg(test)]
    pub counters: SubscriberCounters,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Subscriber {
    pub fn spawn(
        ctx: zmq::Context,
        spec: SubscriberSpec,
        tx: SyncSender<Ingest>,
        counters: SubscriberCounters,
    ) -> std::io::Result<Subscriber> {
        let stop = Arc::new(AtomicBool::new(false));
        let (st2, stop2) = (counters.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name(format!("kv-sub-{}", spec.slot))
            .spawn(move || {
                if let Err(e) = run(&ctx, &spec, &tx, &st2, &stop2) {
                    tracing::error!(slot = spec.slot, endpoint = %spec.endpoint, error = %e, "kv event subscriber stopped");
                }
            })?;
        Ok(Subscriber {
            #[cfg(test)]
            counters,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it (at most one receive timeout).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replayed {
    /// It ran to its end marker or past its range.
    Done,
    /// The worker has no replay endpoint.
    NoEndpoint,
    /// It failed or was refused after handing `delivered` batches over.
    Failed { delivered: u64 },
    /// The index is gone: shutting down.
    Closed,
}

/// How long a receive waits before checking for shutdown.
const POLL: Duration = Duration::from_millis(100);

struct Ctx<'a> {
    zmq: &'a zmq::Context,
    spec: &'a SubscriberSpec,
    tx: &'a SyncSender<Ingest>,
    stats: &'a SubscriberCounters,
    tracker: SeqTracker,
    /// seq → payload hash of the batches the last replay delivered.
    recent: HashMap<u64, u64>,
}

impl Ctx<'_> {
    fn send(&self, msg: Ingest) -> bool {
        self.tx.send(msg).is_ok()
    }

    fn resync(&mut self, reason: ResyncReason) -> bool {
        self.stats.resyncs.inc();
        tracing::warn!(
            slot = self.spec.slot,
            endpoint = %self.spec.endpoint,
            reason = reason.as_str(),
            "dropping this rank's KV index entries"
        );
        self.send(Ingest::Resync {
            slot: self.spec.slot,
            reason,
        })
    }

    /// What a replay of `range` may take: a gap's span of the largest
    /// frames at most, and never more than `kv.max_replay_bytes`, which
    /// alone bounds a replay of everything buffered.
    fn replay_bound(&self, range: &Range<u64>) -> u64 {
        let cap = self.spec.max_replay_bytes;
        if range.end == u64::MAX {
            return cap;
        }
        (range.end - range.start)
            .saturating_mul(self.spec.limits.max_message_bytes)
            .min(cap)
    }

    /// Replays `range` (`from..u64::MAX`: everything buffered from `from`)
    /// from the publisher's buffer, handing each batch to the index as it
    /// arrives so that nothing accumulates here. `lost`: the resync to send
    /// first when the publisher no longer holds `range.start`, before the
    /// batches it still has rebuild the slot.
    fn replay(&mut self, range: Range<u64>, lost: Option<ResyncReason>) -> Replayed {
        let (zmq, spec) = (self.zmq, self.spec);
        let Some(endpoint) = spec.replay_endpoint.as_deref() else {
            return Replayed::NoEndpoint;
        };
        let bound = self.replay_bound(&range);
        let from = range.start;
        self.recent.clear();
        let (mut first, mut resynced, mut closed, mut delivered) = (true, false, false, 0u64);
        let result = replay(
            zmq,
            endpoint,
            range,
            spec.replay_timeout,
            &spec.limits,
            bound,
            |seq, payload| {
                if std::mem::take(&mut first)
                    && seq > from
                    && let Some(reason) = lost
                {
                    resynced = true;
                    if !self.resync(reason) {
                        closed = true;
                        return ControlFlow::Break(());
                    }
                }
                if self.tracker.last().is_some_and(|l| seq <= l) {
                    return ControlFlow::Continue(());
                }
                self.recent.insert(seq, xxh3_64(payload));
                let batch = Ingest::Batch {
                    slot: spec.slot,
                    seq,
                    payload: payload.to_vec(),
                };
                if !self.send(batch) {
                    closed = true;
                    return ControlFlow::Break(());
                }
                self.tracker.applied(seq);
                self.stats.replayed_batches.inc();
                delivered += 1;
                ControlFlow::Continue(())
            },
        );
        if closed {
            return Replayed::Closed;
        }
        match result {
            Ok(summary) => {
                if summary.first_seq != Some(from)
                    && !resynced
                    && let Some(reason) = lost
                    && !self.resync(reason)
                {
                    return Replayed::Closed;
                }
                Replayed::Done
            }
            Err(e) => {
                self.recent.clear();
                if e.is_refusal() {
                    self.stats.replays_refused.inc();
                    tracing::warn!(slot = spec.slot, endpoint, bound, delivered, error = %e, "kv event replay refused");
                } else {
                    self.stats.replay_failures.inc();
                    tracing::warn!(slot = spec.slot, endpoint, delivered, error = %e, "kv event replay failed");
                }
                Replayed::Failed { delivered }
            }
        }
    }

    /// After a replay of a slot's whole buffer (at connect, or after a
    /// restart): one that failed part-way left a hole after what it
    /// delivered, so the slot starts over from the live batches. Whether
    /// the index is still there.
    fn after_whole_replay(&mut self, outcome: Replayed) -> bool {
        match outcome {
            Replayed::Closed => false,
            Replayed::Failed { delivered } if delivered > 0 => {
                self.tracker.reset();
                self.resync(ResyncReason::ReplayIncomplete)
            }
            _ => true,
        }
    }

    /// Whether a live batch is one the last replay already delivered: live
    /// batches queue on the SUB socket while a replay runs. Equal sequence
    /// numbers alone could also be a restarted engine, so the payload must
    /// match too.
    fn is_replayed_duplicate(&mut self, seq: u64, payload: &[u8]) -> bool {
        if self.recent.is_empty() {
            return false;
        }
        if self.tracker.last().is_some_and(|l| seq > l) {
            self.recent.clear();
            return false;
        }
        self.recent.get(&seq) == Some(&xxh3_64(payload))
    }
}

fn run(
    zmq: &zmq::Context,
    spec: &SubscriberSpec,
    tx: &SyncSender<Ingest>,
    stats: &SubscriberCounters,
    stop: &AtomicBool,
) -> Result<(), zmq::Error> {
    let sub = zmq.socket(zmq::SUB)?;
    sub.set_linger(0)?;
    spec.limits.apply(&sub)?;
    sub.set_rcvtimeo(POLL.as_millis() as i32)?;
    // Attached before connecting so that no disconnection goes unseen; a
    // subscriber without it still ingests, it only counts less.
    let monitor = Monitor::attach(zmq, &sub, spec.slot)
        .inspect_err(|e| {
            tracing::warn!(slot = spec.slot, error = %e, "cannot monitor the KV event socket; disconnections go uncounted");
        })
        .ok();
    sub.connect(&spec.endpoint)?;
    sub.set_subscribe(&spec.topic)?;
    let mut cx = Ctx {
        zmq,
        spec,
        tx,
        stats,
        tracker: SeqTracker::default(),
        recent: HashMap::new(),
    };
    // Learn what the engine cached before we connected.
    let outcome = cx.replay(0..u64::MAX, None);
    if !cx.after_whole_replay(outcome) {
        return Ok(());
    }
    while !stop.load(Ordering::Relaxed) {
        let received = sub.recv_multipart(0);
        if let Some(lost) = monitor.as_ref().map(Monitor::disconnects)
            && lost > 0
        {
            stats.disconnects.inc_by(lost);
            tracing::warn!(
                slot = spec.slot,
                endpoint = %spec.endpoint,
                max_message_bytes = spec.limits.max_message_bytes,
                "lost the KV event connection (publisher gone, or a frame over kv.max_message_bytes); reconnecting"
            );
            // libzmq reconnects after an I/O error but gives the endpoint up
            // for good after a protocol error, which an oversized frame is:
            // one bad message would silence the rank until a restart.
            // Starting the connection over covers both; the batches lost
            // meanwhile are a gap, repaired like any other.
            let _ = sub.disconnect(&spec.endpoint);
            sub.connect(&spec.endpoint)?;
        }
        let frames = match received {
            Ok(f) => f,
            // A signal interrupting the wait is no reason to stop ingesting.
            Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => continue,
            Err(e) => return Err(e),
        };
        let [_topic, seq, payload] = frames.as_slice() else {
            stats.malformed_frames.inc();
            continue;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()) else {
            stats.malformed_frames.inc();
            continue;
        };
        let seq = u64::from_be_bytes(seq);
        stats.batches.inc();
        if cx.is_replayed_duplicate(seq, payload) {
            continue;
        }
        match cx.tracker.check(seq) {
            SeqCheck::InOrder => {}
            SeqCheck::Gap { from, to } => {
                stats.gaps.inc();
                let reason = if spec.replay_endpoint.is_some() {
                    ResyncReason::GapNotReplayable
                } else {
                    ResyncReason::GapNoReplay
                };
                // What the buffer still has after a lost start comes after
                // what was lost: the replay drops the slot first, then
                // rebuilds it from those batches.
                match cx.replay(from..to, Some(reason)) {
                    Replayed::Done => {}
                    Replayed::NoEndpoint | Replayed::Failed { .. } => {
                        if !cx.resync(reason) {
                            return Ok(());
                        }
                    }
                    Replayed::Closed => return Ok(()),
                }
            }
            SeqCheck::Restart => {
                stats.restarts.inc();
                if !cx.resync(ResyncReason::Restart) {
                    return Ok(());
                }
                cx.tracker.reset();
                // The new process may have published before this batch; what
                // its buffer still holds rebuilds the slot.
                if seq > 0 {
                    let outcome = cx.replay(0..seq, None);
                    if !cx.after_whole_replay(outcome) {
                        return Ok(());
                    }
                }
            }
        }
        if !cx.send(Ingest::Batch {
            slot: spec.slot,
            seq,
            payload: payload.clone(),
        }) {
            return Ok(()); // the index is gone: shutting down
        }
        cx.tracker.applied(seq);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
