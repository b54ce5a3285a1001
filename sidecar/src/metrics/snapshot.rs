//! The snapshot family: the workers' scrapes and health, the engine load
//! per rank that the snapshot carries, and what is published of it.

use super::{MetricsError, RANK, WORKER, counter, float_gauge, float_gauge_vec, gauge, gauge_vec};
use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

#[derive(Clone)]
pub struct SnapshotMetrics {
    scrapes: IntCounterVec,
    scrape_errors: IntCounterVec,
    pub worker_up: IntGaugeVec,
    pub workers_up: IntGaugeVec,
    pub worker_info: IntGaugeVec,
    pub role_workers_up: IntGaugeVec,
    pub role_workers_busy: IntGaugeVec,
    pub rank_running: IntGaugeVec,
    pub rank_waiting: IntGaugeVec,
    pub rank_kv_used: IntGaugeVec,
    pub rank_kv_total: IntGaugeVec,
    pub rank_busy: IntGaugeVec,
    pub retry_after: IntGaugeVec,
    pub threshold_changes: IntCounterVec,
    pub version: IntGauge,
    pub bytes: IntGauge,
    pub polls: IntCounterVec,
    pub age: Gauge,
    pub ttft_prediction_error: GaugeVec,
}

/// One worker's scrape counters, labelled when its scraper is spawned.
#[derive(Clone)]
pub struct ScrapeCounters {
    pub scrapes: IntCounter,
    pub errors: IntCounter,
}

impl SnapshotMetrics {
    pub(super) fn new(r: &Registry) -> Result<SnapshotMetrics, MetricsError> {
        Ok(SnapshotMetrics {
            scrapes: counter(
                r,
                "kvgate_sidecar_scrapes_total",
                "Metrics scrapes attempted, per worker.",
                WORKER,
            )?,
            scrape_errors: counter(
                r,
                "kvgate_sidecar_scrape_errors_total",
                "Metrics scrapes that failed, per worker.",
                WORKER,
            )?,
            worker_up: gauge_vec(
                r,
                "kvgate_sidecar_worker_up",
                "1 when the worker is schedulable.",
                &["model", "worker_id"],
            )?,
            workers_up: gauge_vec(
                r,
                "kvgate_sidecar_workers_up",
                "Schedulable workers per model.",
                &["model"],
            )?,
            // The role is an info series of its own, not a label on every
            // per-worker series: dashboards and alerts keep their label
            // sets, and join on worker_id where they want the role.
            worker_info: gauge_vec(
                r,
                "kvgate_sidecar_worker_info",
                "1 for each worker in the catalog, labelled with its role (both, prefill, decode).",
                &["model", "worker_id", "role"],
            )?,
            role_workers_up: gauge_vec(
                r,
                "kvgate_sidecar_workers_up_by_role",
                "Schedulable workers per model and role.",
                &["model", "role"],
            )?,
            role_workers_busy: gauge_vec(
                r,
                "kvgate_sidecar_workers_busy_by_role",
                "Schedulable workers per model and role whose every rank is busy (by the conditions its role is judged by).",
                &["model", "role"],
            )?,
            version: gauge(
                r,
                "kvgate_sidecar_snapshot_version",
                "Version of the latest published state.",
            )?,
            bytes: gauge(
                r,
                "kvgate_sidecar_snapshot_bytes",
                "Size of the latest load snapshot.",
            )?,
            polls: counter(
                r,
                "kvgate_sidecar_snapshot_polls_total",
                "Long polls answered, by result (changed, timeout).",
                &["result"],
            )?,
            rank_running: gauge_vec(
                r,
                "kvgate_sidecar_rank_running",
                "Requests running on the rank, from the engine.",
                RANK,
            )?,
            rank_waiting: gauge_vec(
                r,
                "kvgate_sidecar_rank_waiting",
                "Requests queued on the rank, from the engine.",
                RANK,
            )?,
            rank_kv_used: gauge_vec(
                r,
                "kvgate_sidecar_rank_kv_used_blocks",
                "KV blocks in use on the rank.",
                RANK,
            )?,
            rank_kv_total: gauge_vec(
                r,
                "kvgate_sidecar_rank_kv_total_blocks",
                "KV blocks on the rank.",
                RANK,
            )?,
            rank_busy: gauge_vec(
                r,
                "kvgate_sidecar_rank_busy",
                "1 when the rank is over a busy threshold.",
                RANK,
            )?,
            retry_after: gauge_vec(
                r,
                "kvgate_sidecar_retry_after_seconds",
                "Retry-After the gateway sends while every worker of the model is busy (0: the filter's default).",
                &["model"],
            )?,
            threshold_changes: counter(
                r,
                "kvgate_sidecar_threshold_changes_total",
                "Busy thresholds changed through /busy_threshold, per model.",
                &["model"],
            )?,
            age: float_gauge(
                r,
                "kvgate_sidecar_snapshot_age_seconds",
                "Seconds since the gateway last received a snapshot or was told its snapshot is current.",
            )?,
            ttft_prediction_error: float_gauge_vec(
                r,
                "kvgate_sidecar_ttft_prediction_error_ratio",
                "Mean absolute error of the published TTFT fits' prediction for each timed request, before the fit learned from it, as a share of the observed TTFT (recent requests weigh most), per model.",
                &["model"],
            )?,
        })
    }

    /// The scrape counters of worker `id`.
    pub fn scrape(&self, id: u64) -> ScrapeCounters {
        let ids = id.to_string();
        ScrapeCounters {
            scrapes: self.scrapes.with_label_values(&[&ids]),
            errors: self.scrape_errors.with_label_values(&[&ids]),
        }
    }
}
