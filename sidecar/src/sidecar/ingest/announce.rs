//! A booking batch's effect on the replica-sync peers: what this
//! sidecar's gateways booked, released and ended, told to them as the
//! ledger took it.

use super::Owners;
use super::apply::{Entry, Gist};
use crate::fleet::RankId;
use crate::replica::wire::{Placed, SyncEvent, SyncId};
use crate::sidecar::ledger::Ledger;
use crate::sources::bookings::Effect;

pub(super) fn gateway(entries: &[Entry], owners: &Owners, ledger: &Ledger) {
    if ledger.replica().is_none() {
        return;
    }
    for e in entries {
        if let Some(ev) = sync_event(e, owners) {
            ledger.announce(|| ev);
        }
    }
}

/// What peers hear of a gateway event, once applied here: only what the
/// ledger took.
fn sync_event(e: &Entry, owners: &Owners) -> Option<SyncEvent> {
    match (e.gist, &e.effect) {
        (
            Gist::Book {
                key,
                prefill_tokens,
                decode_blocks,
                ..
            },
            Effect::Booked { slot, tenant, .. },
        ) => Some(SyncEvent::Admit(
            SyncId::Gateway(key),
            placed(
                &owners.get(*slot)?.rank,
                tenant,
                u64::from(prefill_tokens),
                u64::from(decode_blocks),
            ),
        )),
        (Gist::FirstByte(key), Effect::Released) => {
            Some(SyncEvent::PrefillComplete(SyncId::Gateway(key)))
        }
        (Gist::Done(key, _), Effect::Ended { .. }) => Some(SyncEvent::Free(SyncId::Gateway(key))),
        _ => None,
    }
}

/// An admission's placement, as peers name it: booked on `rank` by a
/// request of `tenant`.
pub(crate) fn placed(
    rank: &RankId,
    tenant: &str,
    prefill_tokens: u64,
    decode_blocks: u64,
) -> Placed {
    Placed {
        model: rank.model.clone(),
        tenant: rank.tenant.clone(),
        request_tenant: tenant.to_string(),
        block_size: rank.block_size,
        worker_id: rank.worker_id,
        dp_rank: rank.dp_rank,
        prefill_tokens,
        decode_blocks,
    }
}
