//! A booking batch's effect on the ledger: each event checked against its
//! model's bound, then applied; what the other effects need of it kept.

use super::Owners;
use crate::metrics::LedgerMetrics;
use crate::sidecar::ledger::LEDGER_FULL;
use crate::sources::bookings::{Bookings, Effect, SlotLoad};
use kvgate_core::booking::{Event, Key, Timing};
use std::time::Instant;

/// A batch as the ledger took it.
pub(super) struct Applied {
    /// The events within their bounds, in order.
    pub(super) entries: Vec<Entry>,
    out_of_bound: u64,
    full: u64,
}

/// An event as the ledger took it: what it did, and what the effects
/// after the ledger need of the event (the ledger takes the event itself,
/// and its strings with it).
pub(super) struct Entry {
    pub(super) gist: Gist,
    pub(super) effect: Effect,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Gist {
    Book {
        key: Key,
        slot: u16,
        prefill_tokens: u32,
        decode_blocks: u32,
        /// What its slot held before it: the load the request met.
        met: SlotLoad,
    },
    FirstByte(Key),
    Done(Key, Option<Timing>),
    /// A rejection or a VM's heartbeat: all there is is in its effect.
    Other,
}

impl Gist {
    fn of(ev: &Event, b: &Bookings) -> Gist {
        match ev {
            Event::Book {
                key,
                slot,
                prefill_tokens,
                decode_blocks,
                ..
            } => Gist::Book {
                key: *key,
                slot: *slot,
                prefill_tokens: *prefill_tokens,
                decode_blocks: *decode_blocks,
                met: b.slot(*slot),
            },
            Event::FirstByte { key } => Gist::FirstByte(*key),
            Event::Done { key, timing } => Gist::Done(*key, *timing),
            Event::Rejected { .. } | Event::Alive { .. } => Gist::Other,
        }
    }
}

pub(super) fn apply(
    b: &mut Bookings,
    events: Vec<Event>,
    owners: &Owners,
    now: Instant,
) -> Applied {
    let mut applied = Applied {
        entries: Vec::with_capacity(events.len()),
        out_of_bound: 0,
        full: 0,
    };
    for ev in events {
        if let Event::Book {
            key,
            model,
            prefill_tokens,
            decode_blocks,
            ..
        } = &ev
            && let Some(bound) = owners.bound(model)
            && let Err(why) = bound.check(u64::from(*prefill_tokens), u64::from(*decode_blocks))
        {
            // Not booked, and so not announced to peers nor observed; the
            // VM's watermark still passes it (a VM the ledger cannot
            // track has none).
            let _ = b.seen(*key, now);
            applied.out_of_bound += 1;
            tracing::debug!(model, "gateway booking refused: {why}");
            continue;
        }
        let gist = Gist::of(&ev, b);
        let effect = b.apply(ev, now, |model, slot| owners.holds(model, slot));
        match &effect {
            // Logged by the ledger the first time.
            Effect::Full(_) => applied.full += 1,
            Effect::Refused => tracing::debug!("booking for a rank that is gone: ignored"),
            _ => {}
        }
        applied.entries.push(Entry { gist, effect });
    }
    applied
}

impl Applied {
    /// Counts the bookings refused before the ledger, or for want of room
    /// in it; once the ledger is let go.
    pub(super) fn count_refusals(&self, metrics: &LedgerMetrics) {
        metrics.refused("gateway", LEDGER_FULL, self.full);
        if self.out_of_bound > 0 {
            metrics.refused("gateway", "out_of_bound", self.out_of_bound);
            tracing::warn!(
                out_of_bound = self.out_of_bound,
                "gateway bookings over their model's max_prompt_tokens: refused"
            );
        }
    }
}
