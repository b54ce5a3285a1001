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
                        if b.admit(holder(id), load, &p.request_tenant, now).is_err() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, LedgerCaps};
    use crate::replica::wire::Placed;
    use crate::sources::bookings::Effect;
    use crate::sources::metrics::promtext::RankMetrics;
    use kvgate_core::TenantLoad;
    use kvgate_core::booking::{Event, Key};
    use std::time::Duration;

    /// A gateway booking here and a peer's admission, of two tenants on
    /// one model's two workers, are both in the model's tenants; released,
    /// neither is.
    #[test]
    fn the_snapshot_sums_each_tenants_bookings_here_and_at_peers() {
        let c = Config::parse(
            r#"
[[models]]
name = "m"
[[workers]]
worker_id = 1
model_name = "m"
endpoint = "127.0.0.1:8001"
[[workers]]
worker_id = 2
model_name = "m"
endpoint = "127.0.0.1:8002"
"#,
        )
        .unwrap();
        let fleet = Arc::new(Mutex::new(Fleet::new(&c).unwrap()));
        let now = Instant::now();
        let slots: Vec<u16> = {
            let mut f = fleet.lock();
            for id in [1, 2] {
                f.record_scrape(id, Ok(vec![RankMetrics::default()]), now);
            }
            [1, 2].map(|id| f.workers()[&id].slots()[0]).to_vec()
        };
        let bookings = Arc::new(Mutex::new(Bookings::new(
            Duration::from_secs(300),
            LedgerCaps::default(),
        )));
        let peers = FromPeers {
            fleet: fleet.clone(),
            bookings: bookings.clone(),
            metrics: Arc::new(crate::metrics::Metrics::new().unwrap().ledger),
        };
        let key = Key { vm: 3, seq: 1 };
        let booked = bookings.lock().apply(
            Event::Book {
                key,
                model: "m".into(),
                slot: slots[0],
                prefill_tokens: 300,
                decode_blocks: 20,
                tenant: "team-a".into(),
            },
            now,
            |_, _| true,
        );
        assert!(matches!(booked, Effect::Booked { .. }), "{booked:?}");
        let admit = |tenant: &str, seq: u64| {
            SyncEvent::Admit(
                SyncId::Gateway(Key { vm: 9, seq }),
                Placed {
                    model: "m".into(),
                    tenant: kvgate_core::DEFAULT_TENANT.into(),
                    request_tenant: tenant.into(),
                    block_size: 16,
                    worker_id: 2,
                    dp_rank: 0,
                    prefill_tokens: 50,
                    decode_blocks: 4,
                },
            )
        };
        peers.apply(77, vec![admit("team-b", 1), admit("team-a", 2)]);
        let tenants = || {
            let b = bookings.lock();
            fleet.lock().build_snapshot(&b, 30).models[0]
                .tenants
                .clone()
        };
        let load = |tenant: &str, prefill_tokens, decode_blocks| TenantLoad {
            tenant: tenant.into(),
            prefill_tokens,
            decode_blocks,
        };
        assert_eq!(
            tenants(),
            [load("team-a", 350, 24), load("team-b", 50, 4)],
            "team-a's booking here and at the peer, on both workers"
        );
        // The ends: the booking here, then the peer's frees.
        bookings
            .lock()
            .apply(Event::Done { key, timing: None }, now, |_, _| true);
        assert_eq!(tenants(), [load("team-a", 50, 4), load("team-b", 50, 4)]);
        peers.apply(
            77,
            (1..=2)
                .map(|seq| SyncEvent::Free(SyncId::Gateway(Key { vm: 9, seq })))
                .collect(),
        );
        assert_eq!(tenants(), []);
        let b = bookings.lock();
        assert!(slots.iter().all(|s| b.slot_tenants(*s).next().is_none()));
    }
}
