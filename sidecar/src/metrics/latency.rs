//! The latency family: how long the legs of routed requests took, as
//! their gateways measured them, and how long their clients waited for a
//! first byte. A request served whole is one leg; a disaggregated one a
//! prefill leg and a decode leg, each timed from its own dispatch on the
//! worker it was booked on. By role and leg, not by worker: a worker's
//! series would outlive it and multiply the buckets by the fleet.

use super::{MetricsError, histogram_vec};
use prometheus::{HistogramVec, Registry};

/// From 5 ms (a cached prompt's first byte) to minutes (a long answer).
const SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0,
];

/// The labels of per-leg series: the booked worker's role and the leg.
pub const LEG: &[&str] = &["model", "role", "leg"];

#[derive(Clone)]
pub struct LatencyMetrics {
    /// From a leg's dispatch to its end.
    pub leg: HistogramVec,
    /// From a leg's dispatch to its first response byte.
    pub leg_first_byte: HistogramVec,
    /// From the routing decision to the client's first byte, once per
    /// request.
    pub client_ttft: HistogramVec,
}

impl LatencyMetrics {
    pub(super) fn new(r: &Registry) -> Result<LatencyMetrics, MetricsError> {
        Ok(LatencyMetrics {
            leg: histogram_vec(
                r,
                "kvgate_sidecar_leg_seconds",
                "Routed legs that were served, from their dispatch to their end, as the gateway timed them, by model, the role of the worker booked and leg (whole, prefill, decode).",
                LEG,
                SECONDS,
            )?,
            leg_first_byte: histogram_vec(
                r,
                "kvgate_sidecar_leg_first_byte_seconds",
                "Of those, from their dispatch to their first response byte: a decode leg's is its worker's own time to first token, after the transfer.",
                LEG,
                SECONDS,
            )?,
            client_ttft: histogram_vec(
                r,
                "kvgate_sidecar_client_ttft_seconds",
                "Requests served, from the routing decision to the client's first response byte (on a disaggregated request: both legs and the transfer), by model.",
                &["model"],
                SECONDS,
            )?,
        })
    }
}
