//! What replica-sync peers announce, applied to the ledger. Admissions
//! for ranks this sidecar's catalog does not have (or has with another
//! model, tenant or block size) are dropped, as Dynamo's replicas do.

use crate::fleet::{Fleet, RankId};
use crate::metrics::LedgerMetrics;
use crate::replica::wire::{SyncEvent, SyncId};
use crate::sidecar::ledger::LEDGER_FULL;
use crate::sources::bookings::{Bookings, Holder, Id, Load, Origin};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

/// What applying the peers' announcements reads and changes. Not the
/// shared `Ledger`: that holds the replica sync, whose inbound channel
/// the task holding this drains, and would keep it open forever.
#[derive(Clone)]
pub(crate) struct FromPeers {
    pub(crate) fleet: Arc<Mutex<Fleet>>,
    pub(crate) bookings: Arc<Mutex<Bookings>>,
    pub(crate) metrics: Arc<LedgerMetrics>,
}

/// Why a peer's event books nothing.
enum PeerRefusal {
    UnknownRank,
    OutOfBound(String),
    /// Not an admission: nothing to place.
    NotAnAdmission,
}

impl FromPeers {
    pub(crate) fn apply(&self, origin: u64, events: Vec<SyncEvent>) {
        let now = Instant::now();
        let (mut unknown, mut out_of_bound, mut full) = (0u64, 0u64, 0u64);
        // An admission's slot, or why it is not booked.
        let placed: Vec<Result<u16, PeerRefusal>> = {
            let f = self.fleet.lock();
            events
                .iter()
                .map(|e| match e {
                    SyncEvent::Admit(_, p) => {
                        let slot = f
                            .slot_of(&RankId {
                                model: p.model.clone(),
                                tenant: p.tenant.clone(),
                                block_size: p.block_size,
                                worker_id: p.worker_id,
                                dp_rank: p.dp_rank,
                            })
                            .ok_or(PeerRefusal::UnknownRank)?;
                        // A peer is trusted with its token, not with its
                        // numbers: a huge admission would hide a rank's load.
                        f.booking_bound(&p.model)
                            .check(p.prefill_tokens, p.decode_blocks)
                            .map_err(PeerRefusal::OutOfBound)?;
                        Ok(slot)
                    }
                    _ => Err(PeerRefusal::NotAnAdmission),
                })
                .collect()
        };
        let mut b = self.bookings.lock();
        for (e, slot) in events.into_iter().zip(placed) {
            let holder = |id: SyncId| Holder {
                origin: Origin::Peer(origin),
                id: match id {
                    SyncId::Gateway(k) => Id::Gateway(k),
                    SyncId::Reservation(r) => Id::Reservation(r),
                },
            };
            match e {
                SyncEvent::Admit(id, p) => match slot {
                    Ok(slot) => {
                        let load = Load {
                            slot,
                            prefill_tokens: p.prefill_tokens,
                            decode_blocks: p.decode_blocks,
                        };
                        // Logged by the ledger the first time.
                        if b.admit(holder(id), load, now).is_err() {
                            full += 1;
                        }
                    }
                    Err(PeerRefusal::OutOfBound(why)) => {
                        out_of_bound += 1;
                        tracing::debug!(origin, "replica-sync admission refused: {why}");
                    }
                    Err(_) => unknown += 1,
                },
                SyncEvent::PrefillComplete(id) => {
                    b.prefill_complete(&holder(id), now);
                }
                SyncEvent::Free(id) => {
                    b.free(&holder(id));
                }
            }
        }
        drop(b);
        self.metrics.refused("peer", LEDGER_FULL, full);
        if out_of_bound > 0 {
            self.metrics.refused("peer", "out_of_bound", out_of_bound);
            tracing::warn!(
                origin,
                out_of_bound,
                "replica-sync admissions over their model's max_prompt_tokens: refused"
            );
        }
        if unknown > 0 {
            self.metrics
                .replica_events
                .with_label_values(&["unknown_rank"])
                .inc_by(unknown);
            tracing::debug!(
                unknown,
                "replica-sync admissions for ranks not in this catalog: dropped"
            );
        }
    }
}
