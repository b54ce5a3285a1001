//! Reservations: load that runtimes without Envoy book through the
//! selection API, in the same ledger as the gateways' bookings, and the
//! view of the fleet that selections read.
//!
//! A selection must see the load booked a moment ago, or a burst of
//! `/select_and_reserve` calls would all land on the rank that looked
//! idlest in the last published snapshot. So a selection reads the
//! snapshot (workers, thresholds, engine metrics) with each rank's booked
//! load taken from the ledger at that instant, as the filter adds its own
//! bookings to its copy of the snapshot.

use crate::Sidecar;
use crate::fleet::RankId;
use crate::ingest::placed;
use crate::replica::wire::{SyncEvent, SyncId};
use crate::sources::bookings::{Bookings, Holder, Id, LedgerError, Load};
use kvgate_core::busy::rank_busy;
use kvgate_core::{ModelState, Snapshot};
use std::time::Instant;

/// A reservation's id: non-empty, printable and short, since it is echoed
/// in answers and logs and sent to peers.
pub(crate) fn valid_reservation_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 256 || !id.chars().all(|c| c.is_ascii_graphic()) {
        return Err(format!(
            "reservation_id {:?} must be 1 to 256 printable ASCII characters",
            truncate(id)
        ));
    }
    Ok(())
}

fn truncate(s: &str) -> &str {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `model` of `snap` with each rank's booked load as the ledger has it now,
/// and its busy flag checked again against that load. The published flag
/// stands in for the decode latch: a rank that was busy stays so until its
/// load is under the threshold's lower mark.
pub(crate) fn fresh_model(snap: &Snapshot, name: &str, ledger: &Bookings) -> Option<ModelState> {
    snap.model(name).map(|m| fresh(m, ledger))
}

/// [`fresh_model`] for a model already found.
pub(crate) fn fresh(model: &ModelState, ledger: &Bookings) -> ModelState {
    let mut m = model.clone();
    let th = m.thresholds;
    for w in &mut m.workers {
        for r in &mut w.ranks {
            let booked = ledger.slot(r.slot);
            r.active_prefill_tokens = booked.prefill_tokens;
            r.active_decode_blocks = booked.decode_blocks;
            let mut latched = r.busy;
            r.busy = rank_busy(r, &th, &mut latched).is_some();
        }
    }
    m
}

impl Sidecar {
    /// Books a reservation on `rank`'s `slot` and tells the peers.
    pub(crate) fn reserve(
        &self,
        ledger: &mut Bookings,
        id: &str,
        rank: &RankId,
        load: Load,
    ) -> Result<(), LedgerError> {
        ledger.reserve(id, load, Instant::now())?;
        self.announce(|| {
            SyncEvent::Admit(
                SyncId::Reservation(id.into()),
                placed(rank, load.prefill_tokens, load.decode_blocks),
            )
        });
        Ok(())
    }

    pub(crate) fn reservation_prefill_complete(&self, id: &str) -> Result<(), LedgerError> {
        let done = self
            .bookings()
            .prefill_complete(&reservation(id), Instant::now());
        if !done {
            return Err(LedgerError::Unknown(id.to_string()));
        }
        self.announce(|| SyncEvent::PrefillComplete(SyncId::Reservation(id.into())));
        Ok(())
    }

    /// Output blocks stay local, as in Dynamo: they are the most frequent
    /// event and peers learn the end from the free.
    pub(crate) fn reservation_output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), LedgerError> {
        let done = self
            .bookings()
            .output_block(&reservation(id), decay_fraction, Instant::now());
        if !done {
            return Err(LedgerError::Unknown(id.to_string()));
        }
        Ok(())
    }

    pub(crate) fn free_reservation(&self, id: &str) -> Result<(), LedgerError> {
        if self.bookings().free(&reservation(id)).is_none() {
            return Err(LedgerError::Unknown(id.to_string()));
        }
        self.announce(|| SyncEvent::Free(SyncId::Reservation(id.into())));
        Ok(())
    }
}

fn reservation(id: &str) -> Holder {
    Holder::here(Id::Reservation(id.into()))
}
