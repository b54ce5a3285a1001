//! The sidecar's own Prometheus metrics.

pub(crate) mod gauges;

use prometheus::core::Collector;
use prometheus::{
    Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};
use thiserror::Error;

pub struct Metrics {
    pub registry: Registry,
    pub scrapes: IntCounterVec,
    pub scrape_errors: IntCounterVec,
    pub worker_up: IntGaugeVec,
    pub workers_up: IntGaugeVec,
    pub snapshot_version: IntGauge,
    pub snapshot_bytes: IntGauge,
    pub snapshot_polls: IntCounterVec,
    pub rank_running: IntGaugeVec,
    pub rank_waiting: IntGaugeVec,
    pub rank_kv_used: IntGaugeVec,
    pub rank_kv_total: IntGaugeVec,
    pub rank_busy: IntGaugeVec,
    pub rank_active_prefill: IntGaugeVec,
    pub rank_active_decode: IntGaugeVec,
    pub bookings_active: IntGaugeVec,
    pub bookings_expired: IntCounter,
    pub ledger_holders: IntGaugeVec,
    pub booking_batches: IntCounterVec,
    pub routed: IntCounterVec,
    pub routed_prompt_tokens: IntCounterVec,
    pub routed_cached_tokens: IntCounterVec,
    pub rejected: IntCounterVec,
    pub retry_after: IntGaugeVec,
    pub threshold_changes: IntCounterVec,
    pub snapshot_age: Gauge,
    pub kv_batches: IntCounterVec,
    pub kv_malformed_frames: IntCounterVec,
    pub kv_gaps: IntCounterVec,
    pub kv_resyncs: IntCounterVec,
    pub kv_replayed: IntCounterVec,
    pub kv_disconnects: IntCounterVec,
    pub kv_indexed_blocks: IntGaugeVec,
    pub text_keys: IntGaugeVec,
    pub text_skipped_blocks: IntCounterVec,
    pub kv_unmatchable_blocks: IntCounterVec,
    pub kv_block_size_mismatch: IntCounterVec,
    pub kv_event_lag: GaugeVec,
    pub kv_malformed_batches: IntGauge,
    pub approx_learned: IntCounter,
    pub replica_events: IntCounterVec,
    pub replica_refused: IntCounter,
    pub index_recovered_blocks: IntCounter,
    pub index_recovery_dropped: IntCounterVec,
    pub index_recovery_seconds: Gauge,
    pub gpu_temperature: GaugeVec,
    pub gpu_power: GaugeVec,
    pub gpu_slowdown: IntGaugeVec,
    pub worker_temperature: GaugeVec,
    pub thermal_cap: IntGaugeVec,
    pub thermal_state: IntGaugeVec,
    pub thermal_entries: IntCounterVec,
    pub thermal_source_errors: IntCounterVec,
    pub thermal_batch_calls: IntCounterVec,
    pub planner_desired: IntGaugeVec,
    pub planner_ready: IntGaugeVec,
    pub planner_lower_bound: IntGaugeVec,
    pub planner_ttft: GaugeVec,
    pub planner_itl: GaugeVec,
    pub planner_reason: IntGaugeVec,
    pub planner_predicted: GaugeVec,
    pub planner_decisions: IntCounterVec,
    pub planner_draining: IntGaugeVec,
}

/// A metric that could not be created or registered: a malformed or
/// duplicate name or label, found at start-up.
#[derive(Debug, Error)]
#[error("metric {name}: {source}")]
pub struct MetricsError {
    name: String,
    source: prometheus::Error,
}

fn register<C: Collector + Clone + 'static>(
    r: &Registry,
    name: &str,
    made: prometheus::Result<C>,
) -> Result<C, MetricsError> {
    let fail = |source| MetricsError {
        name: name.to_string(),
        source,
    };
    let c = made.map_err(fail)?;
    r.register(Box::new(c.clone())).map_err(fail)?;
    Ok(c)
}

fn counter(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, MetricsError> {
    register(r, name, IntCounterVec::new(Opts::new(name, help), labels))
}

fn plain_counter(r: &Registry, name: &str, help: &str) -> Result<IntCounter, MetricsError> {
    register(r, name, IntCounter::new(name, help))
}

fn gauge_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, MetricsError> {
    register(r, name, IntGaugeVec::new(Opts::new(name, help), labels))
}

fn gauge(r: &Registry, name: &str, help: &str) -> Result<IntGauge, MetricsError> {
    register(r, name, IntGauge::new(name, help))
}

fn float_gauge_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<GaugeVec, MetricsError> {
    register(r, name, GaugeVec::new(Opts::new(name, help), labels))
}

fn float_gauge(r: &Registry, name: &str, help: &str) -> Result<Gauge, MetricsError> {
    register(r, name, Gauge::new(name, help))
}

impl Metrics {
    /// Creates and registers every metric. Names are constants, so an
    /// error is a programming mistake; it is reported at start-up.
    pub fn new() -> Result<Metrics, MetricsError> {
        let r = Registry::new();
        let w = &["worker_id"];
        let wr = &["worker_id", "dp_rank"];
        Ok(Metrics {
            scrapes: counter(
                &r,
                "kvgate_sidecar_scrapes_total",
                "Metrics scrapes attempted, per worker.",
                w,
            )?,
            scrape_errors: counter(
                &r,
                "kvgate_sidecar_scrape_errors_total",
                "Metrics scrapes that failed, per worker.",
                w,
            )?,
            worker_up: gauge_vec(
                &r,
                "kvgate_sidecar_worker_up",
                "1 when the worker is schedulable.",
                &["model", "worker_id"],
            )?,
            workers_up: gauge_vec(
                &r,
                "kvgate_sidecar_workers_up",
                "Schedulable workers per model.",
                &["model"],
            )?,
            snapshot_version: gauge(
                &r,
                "kvgate_sidecar_snapshot_version",
                "Version of the latest published state.",
            )?,
            snapshot_bytes: gauge(
                &r,
                "kvgate_sidecar_snapshot_bytes",
                "Size of the latest load snapshot.",
            )?,
            snapshot_polls: counter(
                &r,
                "kvgate_sidecar_snapshot_polls_total",
                "Long polls answered, by result (changed, timeout).",
                &["result"],
            )?,
            rank_running: gauge_vec(
                &r,
                "kvgate_sidecar_rank_running",
                "Requests running on the rank, from the engine.",
                wr,
            )?,
            rank_waiting: gauge_vec(
                &r,
                "kvgate_sidecar_rank_waiting",
                "Requests queued on the rank, from the engine.",
                wr,
            )?,
            rank_kv_used: gauge_vec(
                &r,
                "kvgate_sidecar_rank_kv_used_blocks",
                "KV blocks in use on the rank.",
                wr,
            )?,
            rank_kv_total: gauge_vec(
                &r,
                "kvgate_sidecar_rank_kv_total_blocks",
                "KV blocks on the rank.",
                wr,
            )?,
            rank_busy: gauge_vec(
                &r,
                "kvgate_sidecar_rank_busy",
                "1 when the rank is over a busy threshold.",
                wr,
            )?,
            rank_active_prefill: gauge_vec(
                &r,
                "kvgate_sidecar_rank_active_prefill_tokens",
                "Prompt tokens routed to the rank and not yet answered (gateway bookings).",
                wr,
            )?,
            rank_active_decode: gauge_vec(
                &r,
                "kvgate_sidecar_rank_active_decode_blocks",
                "KV blocks the gateway has booked on the rank for requests in flight (cached prefix blocks count once).",
                wr,
            )?,
            bookings_active: gauge_vec(
                &r,
                "kvgate_sidecar_bookings_active",
                "Requests the gateway routed that have not ended, per model.",
                &["model"],
            )?,
            ledger_holders: gauge_vec(
                &r,
                "kvgate_sidecar_ledger_holders",
                "Requests in flight in the load ledger, by kind: gateway (this sidecar's Envoy), reservation (the selection API), peer (announced by replica-sync peers).",
                &["kind"],
            )?,
            bookings_expired: plain_counter(
                &r,
                "kvgate_sidecar_bookings_expired_total",
                "Bookings dropped by the expiry because their end was never reported.",
            )?,
            booking_batches: counter(
                &r,
                "kvgate_sidecar_booking_batches_total",
                "Booking batches received from the gateway, by result (ok, malformed).",
                &["result"],
            )?,
            routed: counter(
                &r,
                "kvgate_sidecar_routed_total",
                "Requests the gateway routed, by model and worker.",
                &["model", "worker_id"],
            )?,
            routed_prompt_tokens: counter(
                &r,
                "kvgate_sidecar_routed_prompt_tokens_total",
                "Prompt tokens of the requests the gateway routed and saw end (estimated for text), by model.",
                &["model"],
            )?,
            routed_cached_tokens: counter(
                &r,
                "kvgate_sidecar_routed_cached_tokens_total",
                "Of those, the tokens the gateway found cached where it sent them: over routed_prompt_tokens_total, kvgate's predicted prefix hit rate.",
                &["model"],
            )?,
            rejected: counter(
                &r,
                "kvgate_sidecar_rejected_total",
                "Requests the gateway answered itself, by model and reason (all_workers_busy, no_workers, ...).",
                &["model", "reason"],
            )?,
            retry_after: gauge_vec(
                &r,
                "kvgate_sidecar_retry_after_seconds",
                "Retry-After the gateway sends while every worker of the model is busy (0: the filter's default).",
                &["model"],
            )?,
            threshold_changes: counter(
                &r,
                "kvgate_sidecar_threshold_changes_total",
                "Busy thresholds changed through /busy_threshold, per model.",
                &["model"],
            )?,
            snapshot_age: float_gauge(
                &r,
                "kvgate_sidecar_snapshot_age_seconds",
                "Seconds since the gateway last received a snapshot or was told its snapshot is current.",
            )?,
            kv_batches: counter(
                &r,
                "kvgate_sidecar_kv_batches_total",
                "KV event batches received, per rank.",
                wr,
            )?,
            kv_malformed_frames: counter(
                &r,
                "kvgate_sidecar_kv_malformed_frames_total",
                "ZMQ messages that were not a 3-frame KV event batch.",
                wr,
            )?,
            kv_gaps: counter(
                &r,
                "kvgate_sidecar_kv_gaps_total",
                "Sequence gaps detected, per rank.",
                wr,
            )?,
            kv_resyncs: counter(
                &r,
                "kvgate_sidecar_kv_resyncs_total",
                "Times a rank's index entries were dropped (restart, unreplayable gap).",
                wr,
            )?,
            kv_replayed: counter(
                &r,
                "kvgate_sidecar_kv_replayed_batches_total",
                "Batches recovered by replay.",
                wr,
            )?,
            kv_disconnects: counter(
                &r,
                "kvgate_sidecar_kv_disconnects_total",
                "Connections to the rank's KV event publisher lost: the publisher went away, or sent a frame over kv.max_message_bytes.",
                wr,
            )?,
            kv_unmatchable_blocks: counter(
                &r,
                "kvgate_sidecar_kv_unmatchable_blocks_total",
                "Stored blocks kept out of the prefix index because their engine hash covers what no request shows kvgate (multimodal inputs, prompt embeddings, unknown extra keys, an adapter without a name, or such a parent).",
                &["worker_id", "dp_rank", "reason"],
            )?,
            kv_block_size_mismatch: counter(
                &r,
                "kvgate_sidecar_kv_block_size_mismatch_total",
                "Stored-block events whose block size is not the worker's block_size (e.g. SGLang's default --page-size 1): re-chunked into the worker's blocks along their chains, at the cost of an index entry per page.",
                wr,
            )?,
            kv_event_lag: float_gauge_vec(
                &r,
                "kvgate_sidecar_kv_event_lag_seconds",
                "Seconds from the engine stamping the rank's latest KV event batch to the prefix index applying it (engine wall clock: host clock skew adds to it).",
                wr,
            )?,
            kv_indexed_blocks: gauge_vec(
                &r,
                "kvgate_sidecar_kv_indexed_blocks",
                "Distinct blocks in the prefix index.",
                &["model"],
            )?,
            text_keys: gauge_vec(
                &r,
                "kvgate_sidecar_text_indexed_keys",
                "Distinct prompt-text prefix keys in the text index.",
                &["model"],
            )?,
            text_skipped_blocks: counter(
                &r,
                "kvgate_sidecar_text_skipped_blocks_total",
                "Stored blocks the text index could not key: 'orphan' (parent \
                 stored before this sidecar saw it) or 'undecodable' (a token id \
                 outside the vocabulary).",
                &["model", "reason"],
            )?,
            kv_malformed_batches: gauge(
                &r,
                "kvgate_sidecar_kv_malformed_batches",
                "KV event batches that failed to decode (skipped whole).",
            )?,
            approx_learned: plain_counter(
                &r,
                "kvgate_sidecar_approx_learned_total",
                "Chunk holders learned from routing decisions (routed-prefix index).",
            )?,
            replica_events: counter(
                &r,
                "kvgate_sidecar_replica_sync_events_total",
                "Replica-sync events, by result: sent, received, dropped_outbox (this sidecar queued more than it could send), dropped_inbound (peers sent faster than it applied), unknown_rank (an admission for a rank not in this catalog).",
                &["result"],
            )?,
            replica_refused: plain_counter(
                &r,
                "kvgate_sidecar_replica_sync_refused_messages_total",
                "Replica-sync messages refused whole: malformed, another version, or not signed with this sidecar's control token.",
            )?,
            index_recovered_blocks: plain_counter(
                &r,
                "kvgate_index_recovered_blocks_total",
                "Blocks replayed into the prefix index from a peer's dump at start-up ([indexer] peers).",
            )?,
            index_recovery_dropped: counter(
                &r,
                "kvgate_index_recovery_dropped_blocks_total",
                "Blocks of a peer's dump not replayed, by reason (unknown_rank: no such worker, rank or model here; block_size: the worker's differs here; over_bound: more than kv.max_blocks_per_rank; already_indexed: a live event came first).",
                &["reason"],
            )?,
            index_recovery_seconds: float_gauge(
                &r,
                "kvgate_index_recovery_seconds",
                "How long start-up recovery of the prefix index took: fetching, decoding and replaying a peer's dump, or trying every peer.",
            )?,
            gpu_temperature: float_gauge_vec(
                &r,
                "kvgate_sidecar_gpu_temperature_celsius",
                "A worker's GPU temperature, by UUID, at its last fresh reading (absent once stale).",
                &["model", "worker_id", "gpu"],
            )?,
            gpu_power: float_gauge_vec(
                &r,
                "kvgate_sidecar_gpu_power_watts",
                "A worker's GPU power draw, by UUID, at its last fresh reading.",
                &["model", "worker_id", "gpu"],
            )?,
            gpu_slowdown: gauge_vec(
                &r,
                "kvgate_sidecar_gpu_slowdown",
                "1 when the GPU reports a thermal or hardware clock slowdown.",
                &["model", "worker_id", "gpu"],
            )?,
            worker_temperature: float_gauge_vec(
                &r,
                "kvgate_sidecar_worker_temperature_celsius",
                "The hottest fresh GPU of the worker's tensor-parallel group.",
                &["model", "worker_id"],
            )?,
            thermal_cap: gauge_vec(
                &r,
                "kvgate_sidecar_thermal_cap",
                "Most requests the worker may hold while throttling; 0 is no cap.",
                &["model", "worker_id"],
            )?,
            thermal_state: gauge_vec(
                &r,
                "kvgate_sidecar_thermal_state",
                "1 for the worker's thermal state (unmonitored, cool, warm, throttling, unknown), 0 for the others.",
                &["model", "worker_id", "state"],
            )?,
            thermal_entries: counter(
                &r,
                "kvgate_sidecar_thermal_throttle_entries_total",
                "Times the worker started throttling.",
                &["model", "worker_id"],
            )?,
            thermal_source_errors: counter(
                &r,
                "kvgate_sidecar_thermal_source_errors_total",
                "GPU reading sources that failed, by kind (dcgm, nvml).",
                &["source"],
            )?,
            thermal_batch_calls: counter(
                &r,
                "kvgate_sidecar_thermal_batch_calls_total",
                "Calls to engines' POST /v1/admin/batch, by result (ok, error).",
                &["result"],
            )?,
            planner_desired: gauge_vec(
                &r,
                "kvgate_planner_desired_replicas",
                "Replicas the planner wants for the model (what an autoscaler should run).",
                &["model"],
            )?,
            planner_ready: gauge_vec(
                &r,
                "kvgate_planner_ready_replicas",
                "Replicas of the model serving: up and not draining.",
                &["model"],
            )?,
            planner_lower_bound: gauge_vec(
                &r,
                "kvgate_planner_lower_bound_replicas",
                "The throughput loop's floor under the load loop.",
                &["model"],
            )?,
            planner_ttft: float_gauge_vec(
                &r,
                "kvgate_planner_estimated_ttft_ms",
                "The highest estimated time to first token among the model's workers at their load now.",
                &["model"],
            )?,
            planner_itl: float_gauge_vec(
                &r,
                "kvgate_planner_estimated_itl_ms",
                "The highest estimated inter-token latency among the model's workers at their load now.",
                &["model"],
            )?,
            planner_reason: gauge_vec(
                &r,
                "kvgate_planner_decision",
                "1 for the reason of the planner's last load tick (warming_up, scale_up, scale_down, hold, pending, floor, bound), 0 for the others.",
                &["model", "reason"],
            )?,
            planner_predicted: float_gauge_vec(
                &r,
                "kvgate_planner_predicted",
                "The throughput loop's prediction for the next interval, by quantity (requests, isl, osl).",
                &["model", "quantity"],
            )?,
            planner_decisions: counter(
                &r,
                "kvgate_planner_decisions_total",
                "Scaling decisions issued, by direction (up, down).",
                &["model", "direction"],
            )?,
            planner_draining: gauge_vec(
                &r,
                "kvgate_planner_draining_workers",
                "Workers the planner is draining for removal.",
                &["model"],
            )?,
            registry: r,
        })
    }

    pub fn render(&self) -> String {
        let enc = prometheus::TextEncoder::new();
        enc.encode_to_string(&self.registry.gather())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn all_metrics_register_with_help() {
        let m = super::Metrics::new().unwrap();
        m.scrapes.with_label_values(&["1"]).inc();
        m.snapshot_polls.with_label_values(&["changed"]).inc();
        let text = m.render();
        assert!(text.contains("# HELP kvgate_sidecar_scrapes_total"));
        assert!(text.contains("kvgate_sidecar_snapshot_polls_total{result=\"changed\"} 1"));
    }

    #[test]
    fn a_bad_metric_is_an_error_naming_it() {
        let r = prometheus::Registry::new();
        super::counter(&r, "kvgate_x_total", "x", &["a"]).unwrap();
        let dup = super::counter(&r, "kvgate_x_total", "x", &["a"]).unwrap_err();
        assert!(dup.to_string().contains("kvgate_x_total"), "{dup}");
        assert!(super::gauge(&r, "not a name", "x").is_err());
    }
}
