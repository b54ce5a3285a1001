//! What the filter reports, applied: booking batches and routing
//! decisions; and what replica-sync peers announce (`peers`).
//!
//! A booking batch has four effects, each its own module, in this order:
//! the ledger takes it (`apply`), the peers hear what it booked and
//! released (`announce`, under the same lock, so that they hear each
//! holder's events in the ledger's order), the metrics count it
//! (`tally`), and the planner observes it (`observe`). All four read who
//! each slot is from one look at the fleet ([`Owners`]).

mod announce;
mod apply;
mod observe;
mod peers;
mod tally;

pub(super) use announce::placed;
pub(crate) use peers::FromPeers;

use super::ledger::Ledger;
use crate::api::Reports;
use crate::fleet::{Fleet, RankId};
use crate::metrics::{LatencyMetrics, SelectionMetrics};
use crate::sources::bookings::Bound;
use crate::sources::routed::ApproxIndex;
use kvgate_core::Role;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// What the gateways' reports change, and where they are counted.
#[derive(Clone)]
pub(crate) struct Ingest {
    pub(super) fleet: Arc<Mutex<Fleet>>,
    pub(super) ledger: Ledger,
    pub(super) routed: Arc<Mutex<ApproxIndex>>,
    pub(super) selection: Arc<SelectionMetrics>,
    pub(super) latency: Arc<LatencyMetrics>,
}

impl Reports for Ingest {
    /// Applies a batch of gateway events (bookings, releases, rejections).
    fn book(&self, events: Vec<kvgate_core::booking::Event>) {
        let owners = Owners::of(&self.fleet.lock());
        let applied = {
            let mut b = self.ledger.lock();
            let applied = apply::apply(&mut b, events, &owners, Instant::now());
            announce::gateway(&applied.entries, &owners, &self.ledger);
            applied
        };
        applied.count_refusals(self.ledger.metrics());
        tally::count(&applied.entries, &owners, &self.selection, &self.latency);
        observe::planner(&self.fleet, &applied.entries, &owners);
    }

    /// Learns routing decisions the filter reported, keeping only those
    /// naming a configured model and one of its slots. Returns how many
    /// were kept.
    fn learn(&self, records: &[kvgate_core::approx::Routed]) -> usize {
        let valid: Vec<&kvgate_core::approx::Routed> = {
            let f = self.fleet.lock();
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
        let mut a = self.routed.lock();
        let before = a.learned;
        for r in &valid {
            a.learn(r, now);
        }
        self.selection
            .approx_learned
            .inc_by(a.learned.saturating_sub(before));
        valid.len()
    }
}

/// Who each slot is, read from the fleet once per batch: to validate
/// bookings, to label metrics, for the planner and for peers.
pub(super) struct Owners {
    slots: HashMap<u16, Owner>,
    /// model -> the most one of its bookings may hold.
    bounds: HashMap<String, Bound>,
}

pub(super) struct Owner {
    pub(super) rank: RankId,
    /// Its worker's role: what its legs' times and fits are pooled by.
    pub(super) role: Role,
}

impl Owners {
    fn of(f: &Fleet) -> Owners {
        let slots: HashMap<u16, Owner> = f
            .workers()
            .values()
            .flat_map(|w| {
                w.slots().iter().filter_map(|s| {
                    let rank = f.rank_of(*s)?;
                    Some((
                        *s,
                        Owner {
                            rank,
                            role: w.spec().role,
                        },
                    ))
                })
            })
            .collect();
        let bounds = slots
            .values()
            .map(|o| (o.rank.model.clone(), f.booking_bound(&o.rank.model)))
            .collect();
        Owners { slots, bounds }
    }

    pub(super) fn get(&self, slot: u16) -> Option<&Owner> {
        self.slots.get(&slot)
    }

    /// Whether `slot` is a rank of `model`: a booking is only accepted
    /// for one, so that the rank names the model.
    fn holds(&self, model: &str, slot: u16) -> bool {
        self.get(slot).is_some_and(|o| o.rank.model == model)
    }

    fn bound(&self, model: &str) -> Option<&Bound> {
        self.bounds.get(model)
    }
}
