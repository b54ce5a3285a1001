//! The load ledger as the wiring shares it: one table of what this
//! sidecar's gateways and the selection API book and of the peers'
//! copies, and the replica-sync peers told what is booked and freed here.

use crate::metrics::LedgerMetrics;
use crate::replica::ReplicaSync;
use crate::replica::wire::SyncEvent;
use crate::sources::bookings::Bookings;
use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;

/// The `reason` of a booking a `[load.caps]` cap refused.
pub(super) const LEDGER_FULL: &str = "ledger_full";

#[derive(Clone)]
pub(crate) struct Ledger {
    bookings: Arc<Mutex<Bookings>>,
    /// Present when `[replica_sync] listen` is set.
    replica: Option<Arc<ReplicaSync>>,
    metrics: Arc<LedgerMetrics>,
}

impl Ledger {
    pub(super) fn new(
        bookings: Bookings,
        replica: Option<Arc<ReplicaSync>>,
        metrics: Arc<LedgerMetrics>,
    ) -> Ledger {
        Ledger {
            bookings: Arc::new(Mutex::new(bookings)),
            replica,
            metrics,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Bookings> {
        self.bookings.lock()
    }

    /// The table alone, for what reads it or books nothing peers hear of.
    pub(super) fn bookings(&self) -> &Arc<Mutex<Bookings>> {
        &self.bookings
    }

    pub(super) fn replica(&self) -> Option<&Arc<ReplicaSync>> {
        self.replica.as_ref()
    }

    pub(super) fn metrics(&self) -> &Arc<LedgerMetrics> {
        &self.metrics
    }

    /// Tells the replica-sync peers, if there are any; the event is only
    /// made for them.
    pub(super) fn announce(&self, ev: impl FnOnce() -> SyncEvent) {
        if let Some(r) = &self.replica {
            r.announce(ev());
        }
    }
}
