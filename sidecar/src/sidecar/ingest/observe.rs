//! A booking batch's effect on the planner and the latency fits: each leg
//! booked with the load it met on its worker, each timed end, each request
//! shed.

use super::Owners;
use super::apply::{Entry, Gist};
use crate::fleet::Fleet;
use crate::sources::bookings::Effect;
use parking_lot::Mutex;

pub(super) fn planner(fleet: &Mutex<Fleet>, entries: &[Entry], owners: &Owners) {
    if entries.is_empty() {
        return;
    }
    let mut f = fleet.lock();
    if !f.observes() {
        return;
    }
    for e in entries {
        match (e.gist, &e.effect) {
            (
                Gist::Book {
                    key,
                    slot,
                    prefill_tokens,
                    met,
                    ..
                },
                _,
            ) => {
                // Learned against the load the leg met, whether or not the
                // ledger had room for it: `kvgate_core::fit`'s `x`s, in
                // tokens, which routers read off the snapshot's ranks.
                let Some(o) = owners.get(slot) else { continue };
                let prefill = met.prefill_tokens.saturating_add(u64::from(prefill_tokens));
                let decode_kv = met.decode_blocks * u64::from(o.rank.block_size);
                f.planner_booked(
                    key,
                    &o.rank.model,
                    (o.rank.worker_id, o.role),
                    (prefill as f64, decode_kv as f64),
                    u64::from(prefill_tokens),
                );
            }
            (Gist::Done(key, timing), _) => f.planner_ended(&key, timing),
            (_, Effect::Rejected { model, reason }) if reason.is_shed() => f.planner_shed(model),
            _ => {}
        }
    }
}
