//! The ledger family: the load booked on each rank, by this sidecar's
//! gateways, the selection API's reservations and replica-sync peers.

use super::{MetricsError, RANK, counter, float_gauge_vec, gauge, gauge_vec, plain_counter};
use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

#[derive(Clone)]
pub struct LedgerMetrics {
    pub rank_active_prefill: IntGaugeVec,
    pub rank_active_decode: IntGaugeVec,
    pub bookings_active: IntGaugeVec,
    pub bookings_expired: IntCounter,
    pub bookings_silenced: IntCounter,
    pub holders: IntGaugeVec,
    pub capacity: IntGauge,
    pub sweep_entries: IntCounterVec,
    pub booking_batches: IntCounterVec,
    pub bookings_refused: IntCounterVec,
    pub replica_events: IntCounterVec,
    pub replica_refused: IntCounterVec,
    pub replica_peer_connected: IntGaugeVec,
    pub replica_peer_last_message_age: GaugeVec,
    pub replica_peer_refused: IntCounterVec,
    pub replica_peer_refused_admissions: IntCounterVec,
    pub replica_peer_reconnects: IntCounterVec,
}

impl LedgerMetrics {
    pub(super) fn new(r: &Registry) -> Result<LedgerMetrics, MetricsError> {
        Ok(LedgerMetrics {
            rank_active_prefill: gauge_vec(
                r,
                "kvgate_sidecar_rank_active_prefill_tokens",
                "Prompt tokens routed to the rank and not yet answered (gateway bookings).",
                RANK,
            )?,
            rank_active_decode: gauge_vec(
                r,
                "kvgate_sidecar_rank_active_decode_blocks",
                "KV blocks the gateway has booked on the rank for requests in flight (cached prefix blocks count once).",
                RANK,
            )?,
            bookings_active: gauge_vec(
                r,
                "kvgate_sidecar_bookings_active",
                "Requests the gateway routed that have not ended, per model.",
                &["model"],
            )?,
            holders: gauge_vec(
                r,
                "kvgate_sidecar_ledger_holders",
                "Requests in flight in the load ledger, by kind: gateway (this sidecar's Envoy), reservation (the selection API), peer (announced by replica-sync peers).",
                &["kind"],
            )?,
            capacity: gauge(
                r,
                "kvgate_sidecar_ledger_capacity",
                "Holders the load ledger's table has room for before it grows: what a surge left allocated, until the publish tick shrinks it (below an eighth full).",
            )?,
            sweep_entries: counter(
                r,
                "kvgate_sidecar_ledger_sweep_entries_total",
                "Ledger entries the publish tick's sweep touched, by work: expiry (deadlines due: holders expired, heard of since, or already ended) and rebuild (entries moved to drop ended holders' deadlines or shrink a table after a surge). Grows with holders' churn, never with how many are held.",
                &["work"],
            )?,
            bookings_expired: plain_counter(
                r,
                "kvgate_sidecar_bookings_expired_total",
                "Bookings dropped by the expiry because their end was never reported.",
            )?,
            bookings_silenced: plain_counter(
                r,
                "kvgate_sidecar_bookings_silenced_total",
                "Bookings ended because the Envoy VM that made them stopped saying it is alive (load.vm_silence_ms): it trapped and was reloaded, or its Envoy went away.",
            )?,
            booking_batches: counter(
                r,
                "kvgate_sidecar_booking_batches_total",
                "Booking batches received from the gateway, by result (ok, malformed).",
                &["result"],
            )?,
            bookings_refused: counter(
                r,
                "kvgate_sidecar_bookings_refused_total",
                "Bookings refused before they reached the ledger, by source (gateway: this sidecar's Envoy batches; peer: replica sync; api: the selection API) and reason (out_of_bound: more than the model's max_prompt_tokens allows, answered 400 by the API; ledger_full: a [load.caps] cap was reached, answered 429 by the API for its own share and 503 for the whole ledger's).",
                &["source", "reason"],
            )?,
            replica_events: counter(
                r,
                "kvgate_sidecar_replica_sync_events_total",
                "Replica-sync events, by result: sent, received, dropped_outbox (this sidecar queued more than it could send), dropped_inbound (peers sent faster than it applied), unknown_rank (an admission for a rank not in this catalog), replayed (an admission refused: its message was seen already, or is further behind the origin's latest than the window), stale (an admission refused: its message was sent further from this clock than replica_sync.max_message_age_ms).",
                &["result"],
            )?,
            replica_refused: counter(
                r,
                "kvgate_sidecar_replica_sync_refused_messages_total",
                "Replica-sync messages refused whole, by reason: malformed, version (a peer on a release speaking another version), unauthenticated (not signed with this sidecar's control token).",
                &["reason"],
            )?,
            replica_peer_connected: gauge_vec(
                r,
                "kvgate_sidecar_replica_peer_connected",
                "1 while the connection to the replica-sync peer is up (handshake done), else 0.",
                &["peer"],
            )?,
            replica_peer_last_message_age: float_gauge_vec(
                r,
                "kvgate_sidecar_replica_peer_last_message_age_seconds",
                "Seconds since the last message from the replica-sync peer (since it was added, before any).",
                &["peer"],
            )?,
            replica_peer_refused: counter(
                r,
                "kvgate_sidecar_replica_peer_refused_messages_total",
                "Messages from the replica-sync peer refused whole (malformed, another version, unsigned).",
                &["peer"],
            )?,
            replica_peer_refused_admissions: counter(
                r,
                "kvgate_sidecar_replica_peer_refused_admissions_total",
                "Admissions from the replica-sync peer's socket refused, by reason: replayed (the message was seen already), stale (sent too long ago by the sender's clock). Frees in those messages still apply.",
                &["peer", "reason"],
            )?,
            replica_peer_reconnects: counter(
                r,
                "kvgate_sidecar_replica_peer_reconnects_total",
                "Times the sidecar connected to the replica-sync peer again after losing the connection: the peer went away, a handshake failed, or the peer sent a frame over the 1 MiB cap, which libzmq drops with the connection.",
                &["peer"],
            )?,
        })
    }

    /// Counts `n` bookings from `source` refused for `reason`; a batch
    /// refusing none makes no series.
    pub fn refused(&self, source: &str, reason: &str, n: u64) {
        if n > 0 {
            self.bookings_refused
                .with_label_values(&[source, reason])
                .inc_by(n);
        }
    }
}
