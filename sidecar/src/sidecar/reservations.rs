//! Reservations: load that runtimes without Envoy book through the
//! selection API, in the same ledger as the gateways' bookings, and told
//! to the replica-sync peers as the gateways' bookings are.

use super::ingest::placed;
use super::ledger::{LEDGER_FULL, Ledger};
use crate::api::Reservations;
use crate::fleet::RankId;
use crate::replica::wire::{SyncEvent, SyncId};
use crate::sources::bookings::{Bookings, Holder, Id, LedgerError, Load};
use std::time::Instant;

impl Reservations for Ledger {
    fn reserve(
        &self,
        ledger: &mut Bookings,
        id: &str,
        rank: &RankId,
        tenant: &str,
        load: Load,
    ) -> Result<(), LedgerError> {
        let booked = ledger.reserve(id, load, tenant, Instant::now());
        if let Err(LedgerError::Full(_)) = booked {
            // Logged by the ledger the first time.
            self.metrics().refused("api", LEDGER_FULL, 1);
        }
        booked?;
        self.announce(|| {
            SyncEvent::Admit(
                SyncId::Reservation(id.into()),
                placed(rank, tenant, load.prefill_tokens, load.decode_blocks),
            )
        });
        Ok(())
    }

    fn prefill_complete(&self, id: &str) -> Result<(), LedgerError> {
        let done = self
            .lock()
            .prefill_complete(&reservation(id), Instant::now());
        if !done {
            return Err(LedgerError::Unknown(id.to_string()));
        }
        self.announce(|| SyncEvent::PrefillComplete(SyncId::Reservation(id.into())));
        Ok(())
    }

    /// Output blocks stay local, as in Dynamo: they are the most frequent
    /// event and peers learn the end from the free.
    fn output_block(&self, id: &str, decay_fraction: Option<f64>) -> Result<(), LedgerError> {
        let done = self
            .lock()
            .output_block(&reservation(id), decay_fraction, Instant::now());
        if !done {
            return Err(LedgerError::Unknown(id.to_string()));
        }
        Ok(())
    }

    fn free(&self, id: &str) -> Result<(), LedgerError> {
        if self.lock().free(&reservation(id)).is_none() {
            return Err(LedgerError::Unknown(id.to_string()));
        }
        self.announce(|| SyncEvent::Free(SyncId::Reservation(id.into())));
        Ok(())
    }
}

fn reservation(id: &str) -> Holder {
    Holder::here(Id::Reservation(id.into()))
}
