//! The listener family: connections on the sidecar's HTTP listeners, and
//! the whole-index reads they serve.

use super::{MetricsError, counter, gauge_vec};
use prometheus::core::Collector;
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};
use std::collections::BTreeMap;

#[derive(Clone)]
pub struct ListenerMetrics {
    pub open: IntGaugeVec,
    pub refused: IntCounterVec,
    pub closed: IntCounterVec,
    pub evicted: IntCounterVec,
    pub requests_refused: IntCounterVec,
    pub body_bytes: IntGaugeVec,
    pub unauthorized: IntCounterVec,
    pub full_reads_open: IntGaugeVec,
    pub full_reads_refused: IntCounterVec,
    pub full_read_copies: IntCounterVec,
    pub full_read_copies_alive: IntGaugeVec,
}

/// One listener's series, labelled with its name.
#[derive(Clone)]
pub struct ListenerSeries {
    pub open: IntGauge,
    pub refused: IntCounter,
    pub header_timeouts: IntCounter,
    pub idle_timeouts: IntCounter,
    /// Waiting connections closed to make room for a new one at the cap.
    pub evicted: IntCounter,
    /// Requests refused on a reserved connection: no probe, no token.
    pub refused_reserved: IntCounter,
    /// Request bodies refused: over the body budget, past the body
    /// timeout, or over the body limit.
    pub refused_body_budget: IntCounter,
    pub refused_body_timeout: IntCounter,
    pub refused_body_too_large: IntCounter,
    /// Request-body bytes held by bodies being read.
    pub body_bytes: IntGauge,
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
            evicted: counter(
                r,
                "kvgate_sidecar_connections_evicted_total",
                "Connections closed, while the listener was at max_connections, to make room for a new one: those waiting longest for a request head.",
                &["listener"],
            )?,
            requests_refused: counter(
                r,
                "kvgate_sidecar_requests_refused_total",
                "Requests answered without reaching their route, by reason: reserved (neither a probe nor the control token, on a connection of the reserved share), body_budget (503: body_budget_bytes held already), body_timeout (408: the body was not whole within body_timeout_ms), body_too_large (413).",
                &["listener", "reason"],
            )?,
            body_bytes: gauge_vec(
                r,
                "kvgate_sidecar_request_body_bytes",
                "Bytes held by request bodies being read on the listener, against body_budget_bytes (per class: with the control token, without).",
                &["listener"],
            )?,
            unauthorized: counter(
                r,
                "kvgate_sidecar_unauthorized_total",
                "Requests refused 401 for a missing or wrong control token, by route (/v1/bookings and /v1/routed: a filter whose sidecar_token does not match, so that routing runs without its bookings).",
                &["path"],
            )?,
            full_reads_open: gauge_vec(
                r,
                "kvgate_sidecar_full_reads_open",
                "Whole-index reads being sent, by what (dump: GET /dump; snapshot_reset: a reset frame of /v1/snapshot), on both listeners.",
                &["what"],
            )?,
            full_reads_refused: counter(
                r,
                "kvgate_sidecar_full_reads_refused_total",
                "Whole-index reads answered 503 because server.max_full_reads were being sent to readers like it (with the control token, or without), by what.",
                &["what"],
            )?,
            full_read_copies: counter(
                r,
                "kvgate_sidecar_full_read_copies_total",
                "Whole-index copies encoded, by what; readers within server.full_read_reuse_ms of one share it.",
                &["what"],
            )?,
            full_read_copies_alive: gauge_vec(
                r,
                "kvgate_sidecar_full_read_copies_alive",
                "Whole-index copies in memory, by what: held by the readers sending them or kept for reuse (server.max_full_read_copies per class of reader).",
                &["what"],
            )?,
        })
    }

    /// The 401s so far per route, for `/v1/state`.
    pub fn unauthorized_by_path(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for family in self.unauthorized.collect() {
            for m in family.get_metric() {
                let path = m
                    .get_label()
                    .iter()
                    .find(|l| l.name() == "path")
                    .map(|l| l.value().to_string());
                if let Some(path) = path {
                    out.insert(path, m.get_counter().value() as u64);
                }
            }
        }
        out
    }

    pub fn series(&self, listener: &str) -> ListenerSeries {
        ListenerSeries {
            open: self.open.with_label_values(&[listener]),
            refused: self.refused.with_label_values(&[listener]),
            header_timeouts: self.closed.with_label_values(&[listener, "header_timeout"]),
            idle_timeouts: self.closed.with_label_values(&[listener, "idle_timeout"]),
            evicted: self.evicted.with_label_values(&[listener]),
            refused_reserved: self
                .requests_refused
                .with_label_values(&[listener, "reserved"]),
            refused_body_budget: self
                .requests_refused
                .with_label_values(&[listener, "body_budget"]),
            refused_body_timeout: self
                .requests_refused
                .with_label_values(&[listener, "body_timeout"]),
            refused_body_too_large: self
                .requests_refused
                .with_label_values(&[listener, "body_too_large"]),
            body_bytes: self.body_bytes.with_label_values(&[listener]),
        }
    }
}
