//! What the sources report, applied to the sidecar's state: bookings,
//! routing decisions and scrape results.

use crate::Sidecar;
use crate::fleet::RankId;
use crate::replica::wire::{Placed, SyncEvent, SyncId};
use crate::sources::bookings::{Bound, Effect, Holder, Id, Load, Origin};
use crate::sources::metrics::promtext::RankMetrics;
use std::collections::HashMap;
use std::time::Instant;

impl Sidecar {
    /// Applies a batch of gateway events (bookings, releases, rejections),
    /// and tells the replica-sync peers what was booked and released.
    pub(crate) fn book(&self, events: Vec<kvgate_core::booking::Event>) {
        // slot -> who it is, for validation, metrics and peers; model ->
        // the most one of its bookings may hold.
        let (owners, bounds): (HashMap<u16, RankId>, HashMap<String, Bound>) = {
            let f = self.fleet();
            let owners: HashMap<u16, RankId> = f
                .workers()
                .values()
                .flat_map(|w| w.slots().iter().filter_map(|s| Some((*s, f.rank_of(*s)?))))
                .collect();
            let bounds = owners
                .values()
                .map(|r| (r.model.clone(), f.booking_bound(&r.model)))
                .collect();
            (owners, bounds)
        };
        let (mut out_of_bound, mut full) = (0u64, 0u64);
        let now = Instant::now();
        let metrics = &self.metrics().selection;
        let mut b = self.bookings();
        let mut observed: Vec<Observed> = Vec::new();
        // Per slot: requests routed, then prompt and cached tokens of those
        // that ended. Counted into Prometheus once per batch: a label
        // lookup per event was most of a booking's cost.
        let mut tally: HashMap<u16, [u64; 3]> = HashMap::new();
        for ev in events {
            if let kvgate_core::booking::Event::Book {
                key,
                model,
                prefill_tokens,
                decode_blocks,
                ..
            } = &ev
                && let Some(bound) = bounds.get(model)
                && let Err(why) = bound.check(u64::from(*prefill_tokens), u64::from(*decode_blocks))
            {
                // Not booked, and so not announced to peers; the VM's
                // watermark still passes it (a VM the ledger cannot track
                // has none).
                let _ = b.seen(*key, now);
                out_of_bound += 1;
                tracing::debug!(model, "gateway booking refused: {why}");
                continue;
            }
            // Peers hear what this sidecar's gateways booked and released.
            let copy = self.replica().is_some().then(|| ev.clone());
            let isl = match &ev {
                kvgate_core::booking::Event::Done {
                    timing: Some(t), ..
                } => Some(u64::from(t.isl_tokens)),
                _ => None,
            };
            // The planner learns latency against the load the request met.
            match &ev {
                kvgate_core::booking::Event::Book {
                    key,
                    slot,
                    prefill_tokens,
                    ..
                } => {
                    if let Some(rank) = owners.get(slot) {
                        let met = b.slot(*slot);
                        observed.push(Observed::Booked {
                            key: *key,
                            model: rank.model.clone(),
                            worker: rank.worker_id,
                            prefill: met
                                .prefill_tokens
                                .saturating_add(u64::from(*prefill_tokens))
                                as f64,
                            decode_kv: (met.decode_blocks * u64::from(rank.block_size)) as f64,
                            uncached: u64::from(*prefill_tokens),
                        });
                    }
                }
                kvgate_core::booking::Event::Done { key, timing } => {
                    observed.push(Observed::Ended(*key, *timing));
                }
                kvgate_core::booking::Event::Rejected { model, reason } if reason.is_shed() => {
                    observed.push(Observed::Shed(model.clone()));
                }
                _ => {}
            }
            let effect = b.apply(ev, now, |model, slot| {
                owners.get(&slot).is_some_and(|r| r.model == model)
            });
            match &effect {
                Effect::Booked { slot, .. } => tally.entry(*slot).or_default()[0] += 1,
                Effect::Rejected { model, reason } => {
                    // Requests refused before their body named a model.
                    let model = if model.is_empty() {
                        "-"
                    } else {
                        model.as_str()
                    };
                    metrics
                        .rejected
                        .with_label_values(&[model, reason.as_str()])
                        .inc();
                }
                Effect::Refused => {
                    tracing::debug!("booking for a rank that is gone: ignored");
                }
                // Logged by the ledger the first time.
                Effect::Full(_) => full += 1,
                // The predicted hit rate counts requests whose prompt
                // length the gateway reported, once they end.
                Effect::Ended { slot, uncached } => {
                    if let Some(isl) = isl {
                        let t = tally.entry(*slot).or_default();
                        t[1] = t[1].saturating_add(isl);
                        t[2] = t[2].saturating_add(isl.saturating_sub(*uncached));
                    }
                }
                Effect::Released | Effect::Unknown | Effect::Alive => {}
            }
            if let Some(ev) = copy.and_then(|ev| gateway_sync(ev, &effect, &owners)) {
                self.announce(|| ev);
            }
        }
        drop(b);
        self.refused("gateway", LEDGER_FULL, full);
        if out_of_bound > 0 {
            self.refused("gateway", "out_of_bound", out_of_bound);
            tracing::warn!(
                out_of_bound,
                "gateway bookings over their model's max_prompt_tokens: refused"
            );
        }
        for (slot, [routed, prompt, cached]) in tally {
            // A booking is only accepted for a slot of its model, so the
            // rank names the model.
            let Some(rank) = owners.get(&slot) else {
                continue;
            };
            let model = rank.model.as_str();
            if routed > 0 {
                metrics
                    .routed
                    .with_label_values(&[model, &rank.worker_id.to_string()])
                    .inc_by(routed);
            }
            if prompt > 0 {
                metrics
                    .routed_prompt_tokens
                    .with_label_values(&[model])
                    .inc_by(prompt);
                metrics
                    .routed_cached_tokens
                    .with_label_values(&[model])
                    .inc_by(cached);
            }
        }
        if !observed.is_empty() {
            let mut f = self.fleet();
            if !f.plans() {
                return;
            }
            for o in observed {
                match o {
                    Observed::Booked {
                        key,
                        model,
                        worker,
                        prefill,
                        decode_kv,
                        uncached,
                    } => f.planner_booked(key, &model, worker, (prefill, decode_kv), uncached),
                    Observed::Ended(key, timing) => f.planner_ended(&key, timing),
                    Observed::Shed(model) => f.planner_shed(&model),
                }
            }
        }
    }

    /// Applies what a replica-sync peer announced. Admissions for ranks
    /// this sidecar's catalog does not have (or has with another model,
    /// tenant or block size) are dropped, as Dynamo's replicas do.
    pub(crate) fn peer_announced(&self, origin: u64, events: Vec<SyncEvent>) {
        let now = Instant::now();
        let (mut unknown, mut out_of_bound, mut full) = (0u64, 0u64, 0u64);
        // An admission's slot, or why it is not booked.
        let placed: Vec<Result<u16, PeerRefusal>> = {
            let f = self.fleet();
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
        let mut b = self.bookings();
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
        self.refused("peer", LEDGER_FULL, full);
        self.peer_refusals(origin, out_of_bound);
        if unknown > 0 {
            self.metrics()
                .ledger
                .replica_events
                .with_label_values(&["unknown_rank"])
                .inc_by(unknown);
            tracing::debug!(
                unknown,
                "replica-sync admissions for ranks not in this catalog: dropped"
            );
        }
    }

    /// Counts `n` bookings from `source` refused for `reason`.
    pub(super) fn refused(&self, source: &str, reason: &str, n: u64) {
        if n > 0 {
            self.metrics()
                .ledger
                .bookings_refused
                .with_label_values(&[source, reason])
                .inc_by(n);
        }
    }

    fn peer_refusals(&self, origin: u64, out_of_bound: u64) {
        if out_of_bound == 0 {
            return;
        }
        self.refused("peer", "out_of_bound", out_of_bound);
        tracing::warn!(
            origin,
            out_of_bound,
            "replica-sync admissions over their model's max_prompt_tokens: refused"
        );
    }

    /// Learns routing decisions the filter reported, keeping only those
    /// naming a configured model and one of its slots. Returns how many
    /// were kept.
    pub(crate) fn learn(&self, records: &[kvgate_core::approx::Routed]) -> usize {
        let valid: Vec<&kvgate_core::approx::Routed> = {
            let f = self.fleet();
            records
                .iter()
                .filter(|r| {
                    f.workers()
                        .values()
                        .any(|w| w.spec().model_name == r.model && w.slots().contains(&r.slot))
                })
                .collect()
        };
        let now = Instant::now();
        let mut a = self.routed();
        let before = a.learned;
        for r in &valid {
            a.learn(r, now);
        }
        self.metrics()
            .selection
            .approx_learned
            .inc_by(a.learned.saturating_sub(before));
        valid.len()
    }

    /// Records a scrape; a worker that went up or down is published
    /// without waiting for the next tick.
    pub(crate) fn scraped(&self, id: u64, result: Result<Vec<RankMetrics>, String>) {
        let changed = self.fleet().record_scrape(id, result, Instant::now());
        if changed {
            self.publish_now();
        }
    }
}

/// The `reason` of a booking a `[load.caps]` cap refused.
pub(super) const LEDGER_FULL: &str = "ledger_full";

/// Why a peer's event books nothing.
enum PeerRefusal {
    UnknownRank,
    OutOfBound(String),
    /// Not an admission: nothing to place.
    NotAnAdmission,
}

/// What the planner hears of a gateway event.
enum Observed {
    Booked {
        key: kvgate_core::booking::Key,
        model: String,
        worker: u64,
        prefill: f64,
        decode_kv: f64,
        uncached: u64,
    },
    Ended(
        kvgate_core::booking::Key,
        Option<kvgate_core::booking::Timing>,
    ),
    Shed(String),
}

/// What peers hear of a gateway event, once applied here.
fn gateway_sync(
    ev: kvgate_core::booking::Event,
    effect: &Effect,
    owners: &HashMap<u16, RankId>,
) -> Option<SyncEvent> {
    use kvgate_core::booking::Event;
    match (ev, effect) {
        (
            Event::Book {
                key,
                prefill_tokens,
                decode_blocks,
                ..
            },
            Effect::Booked { slot, .. },
        ) => Some(SyncEvent::Admit(
            SyncId::Gateway(key),
            placed(
                owners.get(slot)?,
                u64::from(prefill_tokens),
                u64::from(decode_blocks),
            ),
        )),
        (Event::FirstByte { key }, Effect::Released) => {
            Some(SyncEvent::PrefillComplete(SyncId::Gateway(key)))
        }
        (Event::Done { key, .. }, Effect::Ended { .. }) => {
            Some(SyncEvent::Free(SyncId::Gateway(key)))
        }
        _ => None,
    }
}

/// An admission's placement, as peers name it.
pub(crate) fn placed(rank: &RankId, prefill_tokens: u64, decode_blocks: u64) -> Placed {
    Placed {
        model: rank.model.clone(),
        tenant: rank.tenant.clone(),
        block_size: rank.block_size,
        worker_id: rank.worker_id,
        dp_rank: rank.dp_rank,
        prefill_tokens,
        decode_blocks,
    }
}
