//! The planner family: per model, the replicas the planner wants and why,
//! and the estimates and predictions behind it.

use super::{MetricsError, counter, float_gauge_vec, gauge_vec};
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Registry};

#[derive(Clone)]
pub struct PlannerMetrics {
    pub desired: IntGaugeVec,
    pub ready: IntGaugeVec,
    pub lower_bound: IntGaugeVec,
    pub ttft: GaugeVec,
    pub itl: GaugeVec,
    pub reason: IntGaugeVec,
    pub predicted: GaugeVec,
    pub decisions: IntCounterVec,
    pub draining: IntGaugeVec,
}

impl PlannerMetrics {
    pub(super) fn new(r: &Registry) -> Result<PlannerMetrics, MetricsError> {
        Ok(PlannerMetrics {
            desired: gauge_vec(
                r,
                "kvgate_planner_desired_replicas",
                "Replicas the planner wants for the model (what an autoscaler should run).",
                &["model"],
            )?,
            ready: gauge_vec(
                r,
                "kvgate_planner_ready_replicas",
                "Replicas of the model serving: up and not draining.",
                &["model"],
            )?,
            lower_bound: gauge_vec(
                r,
                "kvgate_planner_lower_bound_replicas",
                "The throughput loop's floor under the load loop.",
                &["model"],
            )?,
            ttft: float_gauge_vec(
                r,
                "kvgate_planner_estimated_ttft_ms",
                "The highest estimated time to first token among the model's workers at their load now.",
                &["model"],
            )?,
            itl: float_gauge_vec(
                r,
                "kvgate_planner_estimated_itl_ms",
                "The highest estimated inter-token latency among the model's workers at their load now.",
                &["model"],
            )?,
            reason: gauge_vec(
                r,
                "kvgate_planner_decision",
                "1 for the reason of the planner's last load tick (warming_up, scale_up, scale_down, hold, pending, floor, bound), 0 for the others.",
                &["model", "reason"],
            )?,
            predicted: float_gauge_vec(
                r,
                "kvgate_planner_predicted",
                "The throughput loop's prediction for the next interval, by quantity (requests, isl, osl).",
                &["model", "quantity"],
            )?,
            decisions: counter(
                r,
                "kvgate_planner_decisions_total",
                "Scaling decisions issued, by direction (up, down).",
                &["model", "direction"],
            )?,
            draining: gauge_vec(
                r,
                "kvgate_planner_draining_workers",
                "Workers the planner is draining for removal.",
                &["model"],
            )?,
        })
    }
}
