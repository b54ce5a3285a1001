//! The listener family: connections on the sidecar's HTTP listeners.

use super::{MetricsError, counter, gauge_vec};
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

pub struct ListenerMetrics {
    pub open: IntGaugeVec,
    pub refused: IntCounterVec,
    pub closed: IntCounterVec,
}

/// One listener's series, labelled with its name.
#[derive(Clone)]
pub struct ListenerSeries {
    pub open: IntGauge,
    pub refused: IntCounter,
    pub header_timeouts: IntCounter,
    pub idle_timeouts: IntCounter,
}

impl ListenerMetrics {
    pub(super) fn new(r: &Registry) -> Result<ListenerMetrics, MetricsError> {
        Ok(ListenerMetrics {
            open: gauge_vec(
                r,
                "kvgate_sidecar_connections_open",
                "Connections open on the listener (api: the main one; selection: the selection API).",
                &["listener"],
            )?,
            refused: counter(
                r,
                "kvgate_sidecar_connections_refused_total",
                "Connections closed as soon as accepted because the listener had max_connections open.",
                &["listener"],
            )?,
            closed: counter(
                r,
                "kvgate_sidecar_connections_timed_out_total",
                "Connections the sidecar closed, by reason: header_timeout (a request head arrived too slowly), idle_timeout (nothing moved for idle_timeout_ms).",
                &["listener", "reason"],
            )?,
        })
    }

    pub fn series(&self, listener: &str) -> ListenerSeries {
        ListenerSeries {
            open: self.open.with_label_values(&[listener]),
            refused: self.refused.with_label_values(&[listener]),
            header_timeouts: self.closed.with_label_values(&[listener, "header_timeout"]),
            idle_timeouts: self.closed.with_label_values(&[listener, "idle_timeout"]),
        }
    }
}
