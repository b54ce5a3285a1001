//! The KV event family: each rank's subscriber, the prefix index the
//! index thread keeps, and the index's start-up recovery from a peer.

use super::{
    MetricsError, RANK, counter, float_gauge, float_gauge_vec, gauge, gauge_vec, plain_counter,
};
use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

/// Declares the subscriber's counters once: the per-rank series
/// ([`SubscriberSeries`]), the handles one subscriber counts into
/// ([`SubscriberCounters`]) and their list, so that a counter cannot be
/// added without its series.
macro_rules! subscriber_counters {
    ($($(#[doc = $doc:literal])* $field:ident: $name:literal, $help:literal;)*) => {
        /// Every subscriber counter's series, labelled by worker and rank.
        #[derive(Clone)]
        pub struct SubscriberSeries {
            $($field: IntCounterVec,)*
        }

        /// One rank's subscriber counters, labelled when the subscriber is
        /// spawned. A subscriber started again for the same rank (the
        /// worker patched or re-registered) gets the same series and
        /// counts on from where its predecessor stopped.
        #[derive(Clone)]
        pub struct SubscriberCounters {
            $($(#[doc = $doc])* pub $field: IntCounter,)*
        }

        impl SubscriberSeries {
            fn new(r: &Registry) -> Result<SubscriberSeries, MetricsError> {
                Ok(SubscriberSeries {
                    $($field: counter(r, $name, $help, RANK)?,)*
                })
            }

            /// The handles for `worker`'s data-parallel `rank`.
            pub fn of(&self, worker: u64, rank: u32) -> SubscriberCounters {
                let (w, r) = (worker.to_string(), rank.to_string());
                let l = [w.as_str(), r.as_str()];
                SubscriberCounters {
                    $($field: self.$field.with_label_values(&l),)*
                }
            }
        }

        impl SubscriberCounters {
            /// Each counter with its series' name.
            pub fn each(&self) -> Vec<(&'static str, &IntCounter)> {
                vec![$(($name, &self.$field),)*]
            }
        }
    };
}

subscriber_counters! {
    batches: "kvgate_sidecar_kv_batches_total",
        "KV event batches received, per rank.";
    malformed_frames: "kvgate_sidecar_kv_malformed_frames_total",
        "ZMQ messages that were not a 3-frame KV event batch.";
    gaps: "kvgate_sidecar_kv_gaps_total",
        "Sequence gaps detected, per rank.";
    replayed_batches: "kvgate_sidecar_kv_replayed_batches_total",
        "Batches recovered by replay.";
    replay_failures: "kvgate_sidecar_kv_replay_failures_total",
        "Replay requests to the rank's publisher that failed (no answer in kv.replay_timeout_ms, or a malformed reply).";
    /// Replays abandoned because the publisher's answer broke their
    /// bounds; counted apart from `replay_failures`.
    replays_refused: "kvgate_sidecar_kv_replays_refused_total",
        "Replays from the rank's publisher refused part-way: a sequence repeated or went back, or the answer passed its byte bound (a gap's span times kv.max_message_bytes, at most kv.max_replay_bytes).";
    restarts: "kvgate_sidecar_kv_restarts_total",
        "Times the rank's publisher sequence went backwards: a new engine process.";
    resyncs: "kvgate_sidecar_kv_resyncs_total",
        "Times a rank's index entries were dropped (restart, unreplayable gap).";
    /// Connections to the publisher lost: it went away, or sent a frame
    /// over the size limit.
    disconnects: "kvgate_sidecar_kv_disconnects_total",
        "Connections to the rank's KV event publisher lost: the publisher went away, or sent a frame over kv.max_message_bytes.";
}

/// The KV event family.
#[derive(Clone)]
pub struct KvMetrics {
    /// Counted by the subscribers themselves, each through its own handles.
    pub subscribers: SubscriberSeries,
    pub indexed_blocks: IntGaugeVec,
    pub text_keys: IntGaugeVec,
    pub text_skipped_blocks: IntCounterVec,
    pub unmatchable_blocks: IntCounterVec,
    pub block_size_mismatch: IntCounterVec,
    pub event_lag: GaugeVec,
    pub malformed_batches: IntGauge,
    pub recovered_blocks: IntCounter,
    pub recovery_dropped: IntCounterVec,
    pub recovery_seconds: Gauge,
}

impl KvMetrics {
    pub(super) fn new(r: &Registry) -> Result<KvMetrics, MetricsError> {
        Ok(KvMetrics {
            subscribers: SubscriberSeries::new(r)?,
            unmatchable_blocks: counter(
                r,
                "kvgate_sidecar_kv_unmatchable_blocks_total",
                "Stored blocks kept out of the prefix index because their engine hash covers what no request shows kvgate (multimodal inputs, prompt embeddings, unknown extra keys, an adapter without a name, or such a parent).",
                &["worker_id", "dp_rank", "reason"],
            )?,
            block_size_mismatch: counter(
                r,
                "kvgate_sidecar_kv_block_size_mismatch_total",
                "Stored-block events whose block size is not the worker's block_size (e.g. SGLang's default --page-size 1): re-chunked into the worker's blocks along their chains, at the cost of an index entry per page.",
                RANK,
            )?,
            event_lag: float_gauge_vec(
                r,
                "kvgate_sidecar_kv_event_lag_seconds",
                "Seconds from the engine stamping the rank's latest KV event batch to the prefix index applying it (engine wall clock: host clock skew adds to it).",
                RANK,
            )?,
            indexed_blocks: gauge_vec(
                r,
                "kvgate_sidecar_kv_indexed_blocks",
                "Distinct blocks in the prefix index.",
                &["model"],
            )?,
            text_keys: gauge_vec(
                r,
                "kvgate_sidecar_text_indexed_keys",
                "Distinct prompt-text prefix keys in the text index.",
                &["model"],
            )?,
            text_skipped_blocks: counter(
                r,
                "kvgate_sidecar_text_skipped_blocks_total",
                "Stored blocks the text index could not key: 'orphan' (parent \
                 stored before this sidecar saw it) or 'undecodable' (a token id \
                 outside the vocabulary).",
                &["model", "reason"],
            )?,
            malformed_batches: gauge(
                r,
                "kvgate_sidecar_kv_malformed_batches",
                "KV event batches that failed to decode (skipped whole).",
            )?,
            recovered_blocks: plain_counter(
                r,
                "kvgate_index_recovered_blocks_total",
                "Blocks replayed into the prefix index from a peer's dump at start-up ([indexer] peers).",
            )?,
            recovery_dropped: counter(
                r,
                "kvgate_index_recovery_dropped_blocks_total",
                "Blocks of a peer's dump not replayed, by reason (unknown_rank: no such worker, rank or model here; block_size: the worker's differs here; over_bound: more than kv.max_blocks_per_rank; already_indexed: a live event came first).",
                &["reason"],
            )?,
            recovery_seconds: float_gauge(
                r,
                "kvgate_index_recovery_seconds",
                "How long start-up recovery of the prefix index took: fetching, decoding and replaying a peer's dump, or trying every peer.",
            )?,
        })
    }
}
