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
    pub pool_desired: IntGaugeVec,
    pub pool_ready: IntGaugeVec,
    pub pool_lower_bound: IntGaugeVec,
    pub pool_reason: IntGaugeVec,
    pub capacity: GaugeVec,
    pub power_budget: GaugeVec,
    pub planned_power: GaugeVec,
    pub power_binding: IntGaugeVec,
    pub expected_attainment: GaugeVec,
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
            pool_desired: gauge_vec(
                r,
                "kvgate_planner_pool_desired_replicas",
                "Replicas the planner wants in one pool of the model (role both for a model planned as one pool; prefill and decode for a disaggregated one): what one autoscaler per role should run.",
                &["model", "role"],
            )?,
            pool_ready: gauge_vec(
                r,
                "kvgate_planner_pool_ready_replicas",
                "Replicas of the pool serving: up and not draining.",
                &["model", "role"],
            )?,
            pool_lower_bound: gauge_vec(
                r,
                "kvgate_planner_pool_lower_bound_replicas",
                "The throughput loop's floor under the pool.",
                &["model", "role"],
            )?,
            pool_reason: gauge_vec(
                r,
                "kvgate_planner_pool_decision",
                "1 for the reason of the pool's last load tick, 0 for the others.",
                &["model", "role", "reason"],
            )?,
            capacity: float_gauge_vec(
                r,
                "kvgate_planner_capacity_rps",
                "Requests per second one replica of the pool serves within the SLA at the predicted shape, by source (profile, learned): their gap is the live fits' drift from the profile.",
                &["model", "role", "source"],
            )?,
            power_budget: float_gauge_vec(
                r,
                "kvgate_planner_power_budget_watts",
                "The watts the model may plan to: its own budget, within what the fleet's leaves it.",
                &["model"],
            )?,
            planned_power: float_gauge_vec(
                r,
                "kvgate_planner_planned_watts",
                "What the planned replicas would draw at each pool's measured draw per replica.",
                &["model"],
            )?,
            power_binding: gauge_vec(
                r,
                "kvgate_planner_power_binding",
                "1 while the power budget holds a pool below what its load asks for.",
                &["model"],
            )?,
            expected_attainment: float_gauge_vec(
                r,
                "kvgate_planner_expected_sla_attainment",
                "With the power budget binding: the share of the predicted request rate the planned replicas serve within the SLA.",
                &["model"],
            )?,
        })
    }
}
