//! The selection family: what the gateways routed, where, and what they
//! refused, as they report it, and what the routed-prefix index learned.

use super::{MetricsError, counter, plain_counter};
use prometheus::{IntCounter, IntCounterVec, Registry};

#[derive(Clone)]
pub struct SelectionMetrics {
    pub routed: IntCounterVec,
    pub routed_prompt_tokens: IntCounterVec,
    pub routed_cached_tokens: IntCounterVec,
    pub rejected: IntCounterVec,
    pub approx_learned: IntCounter,
    pub fields_ignored: IntCounterVec,
}

impl SelectionMetrics {
    pub(super) fn new(r: &Registry) -> Result<SelectionMetrics, MetricsError> {
        Ok(SelectionMetrics {
            routed: counter(
                r,
                "kvgate_sidecar_routed_total",
                "Requests the gateway routed, by model and worker.",
                &["model", "worker_id"],
            )?,
            routed_prompt_tokens: counter(
                r,
                "kvgate_sidecar_routed_prompt_tokens_total",
                "Prompt tokens of the requests the gateway routed and saw end (estimated for text), by model.",
                &["model"],
            )?,
            routed_cached_tokens: counter(
                r,
                "kvgate_sidecar_routed_cached_tokens_total",
                "Of those, the tokens the gateway found cached where it sent them: over routed_prompt_tokens_total, kvgate's predicted prefix hit rate.",
                &["model"],
            )?,
            rejected: counter(
                r,
                "kvgate_sidecar_rejected_total",
                "Requests the gateway answered itself, by model and reason (all_workers_busy, no_workers, ...).",
                &["model", "reason"],
            )?,
            approx_learned: plain_counter(
                r,
                "kvgate_sidecar_approx_learned_total",
                "Chunk holders learned from routing decisions (routed-prefix index).",
            )?,
            fields_ignored: counter(
                r,
                "kvgate_sidecar_selection_fields_ignored_total",
                "Selection-API requests that set a Dynamo scheduler field kvgate accepts and does not apply, by field (router_config_override, routing_constraints).",
                &["field"],
            )?,
        })
    }
}
