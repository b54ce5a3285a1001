//! The thermal family: GPU readings per worker, each worker's thermal
//! controller, and the calls that cut engines' running batches.

use super::{MetricsError, counter, float_gauge_vec, gauge_vec};
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Registry};

#[derive(Clone)]
pub struct ThermalMetrics {
    pub gpu_temperature: GaugeVec,
    pub gpu_power: GaugeVec,
    pub gpu_slowdown: IntGaugeVec,
    pub worker_temperature: GaugeVec,
    pub cap: IntGaugeVec,
    pub state: IntGaugeVec,
    pub entries: IntCounterVec,
    pub source_errors: IntCounterVec,
    pub batch_calls: IntCounterVec,
}

impl ThermalMetrics {
    pub(super) fn new(r: &Registry) -> Result<ThermalMetrics, MetricsError> {
        Ok(ThermalMetrics {
            gpu_temperature: float_gauge_vec(
                r,
                "kvgate_sidecar_gpu_temperature_celsius",
                "A worker's GPU temperature, by UUID, at its last fresh reading (absent once stale).",
                &["model", "worker_id", "gpu"],
            )?,
            gpu_power: float_gauge_vec(
                r,
                "kvgate_sidecar_gpu_power_watts",
                "A worker's GPU power draw, by UUID, at its last fresh reading.",
                &["model", "worker_id", "gpu"],
            )?,
            gpu_slowdown: gauge_vec(
                r,
                "kvgate_sidecar_gpu_slowdown",
                "1 when the GPU reports a thermal or hardware clock slowdown.",
                &["model", "worker_id", "gpu"],
            )?,
            worker_temperature: float_gauge_vec(
                r,
                "kvgate_sidecar_worker_temperature_celsius",
                "The hottest fresh GPU of the worker's tensor-parallel group.",
                &["model", "worker_id"],
            )?,
            cap: gauge_vec(
                r,
                "kvgate_sidecar_thermal_cap",
                "Most requests the worker may hold while throttling; 0 is no cap.",
                &["model", "worker_id"],
            )?,
            state: gauge_vec(
                r,
                "kvgate_sidecar_thermal_state",
                "1 for the worker's thermal state (unmonitored, cool, warm, throttling, unknown), 0 for the others.",
                &["model", "worker_id", "state"],
            )?,
            entries: counter(
                r,
                "kvgate_sidecar_thermal_throttle_entries_total",
                "Times the worker started throttling.",
                &["model", "worker_id"],
            )?,
            source_errors: counter(
                r,
                "kvgate_sidecar_thermal_source_errors_total",
                "GPU reading sources that failed, by kind (dcgm, nvml).",
                &["source"],
            )?,
            batch_calls: counter(
                r,
                "kvgate_sidecar_thermal_batch_calls_total",
                "Calls to engines' POST /v1/admin/batch, by result (ok, error).",
                &["result"],
            )?,
        })
    }
}
