//! This VM's bookings that the snapshot does not count yet.
//!
//! A booking reaches the sidecar through the shared queue and comes back in
//! a snapshot a few milliseconds later. A burst is faster than that: without
//! a local view, every request of the burst would see the same idle
//! snapshot and pick the same rank. So each VM adds its own recent bookings
//! to its copy of the snapshot, in place, and drops each one once a
//! snapshot's watermark for this VM (`Snapshot::applied`) covers it. Other
//! VMs' bookings arrive with the next snapshot; between two snapshots each
//! VM spreads its own share of a burst, which spreads the whole.
//!
//! Releases take effect at once too. A release of a booking the snapshot
//! already counts is subtracted from the view, and from every later
//! snapshot until one shows the sidecar has heard it: events of one VM
//! reach the sidecar in order, so a snapshot whose watermark covers a
//! booking made after the release (its `fence`) counts the release too.
//! Without this a finished request kept loading its rank until the release
//! had gone through the sidecar and back, and the next request of its
//! prefix group could be sent away from its cache.

use crate::busy::rank_busy;
use crate::state::Snapshot;
use std::collections::{HashMap, VecDeque};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    seq: u64,
    slot: u16,
    prefill: u64,
    decode: u64,
    at_ms: u64,
}

/// Load released here that the sidecar's snapshots may still count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Released {
    /// The booking: a snapshot counts it once its watermark reaches this.
    seq: u64,
    slot: u16,
    prefill: u64,
    decode: u64,
    /// The first booking sequence issued after the release.
    fence: u64,
    at_ms: u64,
}

/// A release: what to take off a booking's rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    pub seq: u64,
    pub slot: u16,
    pub prefill: u64,
    pub decode: u64,
    /// The request ended: nothing of the booking is left.
    pub done: bool,
    /// The next booking sequence this VM will make: a snapshot whose
    /// watermark reaches it has heard this release too.
    pub fence: u64,
}

/// Releases remembered at most (a few seconds of a busy VM's traffic).
const MAX_RELEASED: usize = 8192;

/// Where a slot's rank sits in a decoded snapshot.
type Place = (usize, usize, usize);

#[derive(Debug, Default)]
pub struct LocalBookings {
    entries: Vec<Entry>,
    /// Oldest first: when full, the oldest goes, in constant time (a
    /// sidecar that stopped publishing leaves it full, and every release
    /// then drops one).
    released: VecDeque<Released>,
    places: HashMap<u16, Place>,
}

impl LocalBookings {
    /// Number of bookings not yet in a snapshot.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A new snapshot replaced the view: forget what it already counts (or
    /// what is too old to matter), and add the rest to it.
    pub fn settle(&mut self, snap: &mut Snapshot, vm: u64, now_ms: u64, max_age_ms: u64) {
        self.places.clear();
        for (mi, m) in snap.models.iter().enumerate() {
            for (wi, w) in m.workers.iter().enumerate() {
                for (ri, r) in w.ranks.iter().enumerate() {
                    self.places.insert(r.slot, (mi, wi, ri));
                }
            }
        }
        let applied = snap
            .applied
            .iter()
            .find(|a| a.vm == vm)
            .map_or(0, |a| a.seq);
        self.entries
            .retain(|e| e.seq > applied && now_ms.saturating_sub(e.at_ms) <= max_age_ms);
        self.released
            .retain(|r| r.fence > applied && now_ms.saturating_sub(r.at_ms) <= max_age_ms);
        for e in &self.entries {
            self.add(snap, e.slot, e.prefill as i64, e.decode as i64, 1);
        }
        // Only where the snapshot counts the booking but not yet its
        // release; a booking it has not seen at all is in `entries`, already
        // net of the release.
        // Requests in flight are not taken off: whether this snapshot
        // already counts the end is unknown until the fence, and a thermal
        // cap must not be overfilled by counting an end twice. Counting it
        // once too long costs the worker a place for one round trip.
        for r in &self.released {
            if r.seq <= applied {
                self.add(snap, r.slot, -(r.prefill as i64), -(r.decode as i64), 0);
            }
        }
    }

    /// Records a booking and adds it to the view at once.
    pub fn book(
        &mut self,
        snap: &mut Snapshot,
        seq: u64,
        slot: u16,
        prefill: u64,
        decode: u64,
        now_ms: u64,
    ) {
        self.entries.push(Entry {
            seq,
            slot,
            prefill,
            decode,
            at_ms: now_ms,
        });
        self.add(snap, slot, prefill as i64, decode as i64, 1);
    }

    /// Takes a release off the view at once, and off every later snapshot
    /// that counts the booking before it counts the release.
    pub fn release(&mut self, snap: Option<&mut Snapshot>, r: Release, now_ms: u64) {
        if let Some(at) = self.entries.iter().position(|e| e.seq == r.seq) {
            let e = &mut self.entries[at];
            e.prefill = e.prefill.saturating_sub(r.prefill);
            e.decode = e.decode.saturating_sub(r.decode);
            if r.done {
                self.entries.swap_remove(at);
            }
        }
        if r.prefill > 0 || r.decode > 0 || r.done {
            // Only a sidecar that stopped publishing leaves these unpruned;
            // the oldest matter least.
            if self.released.len() >= MAX_RELEASED {
                self.released.pop_front();
            }
            self.released.push_back(Released {
                seq: r.seq,
                slot: r.slot,
                prefill: r.prefill,
                decode: r.decode,
                fence: r.fence,
                at_ms: now_ms,
            });
        }
        if let Some(snap) = snap {
            let requests = -i64::from(r.done);
            self.add(
                snap,
                r.slot,
                -(r.prefill as i64),
                -(r.decode as i64),
                requests,
            );
        }
    }

    /// Shifts a rank's load, and its worker's requests in flight (which
    /// its thermal cap is checked against).
    fn add(&self, snap: &mut Snapshot, slot: u16, prefill: i64, decode: i64, requests: i64) {
        let Some(&(mi, wi, ri)) = self.places.get(&slot) else {
            return;
        };
        let Some(model) = snap.models.get_mut(mi) else {
            return;
        };
        let split = model.disaggregated();
        let th = model.thresholds;
        let Some(worker) = model.workers.get_mut(wi) else {
            return;
        };
        let th = worker.role.judged_by(th, split);
        let in_flight = shift(u64::from(worker.thermal.in_flight), requests);
        worker.thermal.in_flight = u32::try_from(in_flight).unwrap_or(u32::MAX);
        let Some(rank) = worker.ranks.get_mut(ri) else {
            return;
        };
        rank.active_prefill_tokens = shift(rank.active_prefill_tokens, prefill);
        rank.active_decode_blocks = shift(rank.active_decode_blocks, decode);
        // LocalBookings load can make a rank busy before the sidecar says so; only
        // the sidecar, with the engine's view, clears it.
        if !rank.busy {
            let mut latch = false;
            rank.busy = rank_busy(rank, &th, &mut latch).is_some();
        }
    }
}

fn shift(v: u64, by: i64) -> u64 {
    if by >= 0 {
        v.saturating_add(by as u64)
    } else {
        v.saturating_sub(by.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Applied, ModelState, RankLoad, Thresholds, WorkerState};

    fn snap(applied: u64) -> Snapshot {
        let rank = |rank: u32, slot: u16| RankLoad {
            rank,
            slot,
            kv_total_blocks: 100,
            ..Default::default()
        };
        Snapshot {
            version: 1,
            built_at_ms: 0,
            models: vec![ModelState {
                name: "m".into(),
                thresholds: Thresholds {
                    active_decode_blocks: Some(0.5),
                    ..Default::default()
                },
                workers: vec![WorkerState {
                    id: 1,
                    endpoint: "10.0.0.1:80".into(),
                    block_size: 16,
                    ranks: vec![rank(0, 4), rank(1, 5)],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            applied: vec![Applied {
                vm: 9,
                seq: applied,
            }],
        }
    }

    fn load(s: &Snapshot, r: usize) -> (u64, u64, bool) {
        let r = &s.models[0].workers[0].ranks[r];
        (r.active_prefill_tokens, r.active_decode_blocks, r.busy)
    }

    #[test]
    fn bookings_show_at_once_and_leave_when_released() {
        let mut f = LocalBookings::default();
        let mut s = snap(0);
        f.settle(&mut s, 9, 0, 1000);
        f.book(&mut s, 1, 5, 300, 20, 0);
        assert_eq!(load(&s, 1), (300, 20, false));
        f.release(Some(&mut s), first_byte(1, 5, 300, 2), 1);
        assert_eq!(load(&s, 1), (0, 20, false));
        f.release(Some(&mut s), done(1, 5, 0, 20, 2), 2);
        assert_eq!(load(&s, 1), (0, 0, false));
        assert!(f.is_empty());
    }

    fn first_byte(seq: u64, slot: u16, prefill: u64, fence: u64) -> Release {
        Release {
            seq,
            slot,
            prefill,
            decode: 0,
            done: false,
            fence,
        }
    }

    fn done(seq: u64, slot: u16, prefill: u64, decode: u64, fence: u64) -> Release {
        Release {
            seq,
            slot,
            prefill,
            decode,
            done: true,
            fence,
        }
    }

    #[test]
    fn no_snapshot_brings_back_a_release() {
        let mut f = LocalBookings::default();
        let mut s = snap(0);
        f.settle(&mut s, 9, 0, 1000);
        f.book(&mut s, 1, 5, 0, 20, 0);
        // The sidecar counts booking 1: its snapshot carries the load.
        let mut counted = snap(1);
        counted.models[0].workers[0].ranks[1].active_decode_blocks = 20;
        f.settle(&mut counted, 9, 10, 1000);
        assert_eq!(load(&counted, 1), (0, 20, false));
        // The request ends: the view drops its load at once...
        f.release(Some(&mut counted), done(1, 5, 0, 20, 2), 20);
        assert_eq!(load(&counted, 1), (0, 0, false));
        // ...and a snapshot built before the sidecar heard of the release
        // does not bring it back...
        let mut before = snap(1);
        before.models[0].workers[0].ranks[1].active_decode_blocks = 20;
        f.settle(&mut before, 9, 30, 1000);
        assert_eq!(load(&before, 1), (0, 0, false));
        // ...while one that covers a later booking (the fence) has the
        // release in it already: nothing is taken twice.
        f.book(&mut before, 2, 4, 0, 7, 40);
        let mut after = snap(2);
        after.models[0].workers[0].ranks[0].active_decode_blocks = 7;
        f.settle(&mut after, 9, 50, 1000);
        assert_eq!(load(&after, 0), (0, 7, false));
        assert_eq!(load(&after, 1), (0, 0, false));
        assert!(f.released.is_empty());
    }

    #[test]
    fn a_sidecar_that_stops_publishing_leaves_the_newest_releases() {
        let mut f = LocalBookings::default();
        let mut s = snap(0);
        f.settle(&mut s, 9, 0, u64::MAX);
        let extra = 3;
        for seq in 1..=(MAX_RELEASED + extra) as u64 {
            f.book(&mut s, seq, 5, 0, 1, 0);
            f.release(Some(&mut s), done(seq, 5, 0, 1, seq + 1), 0);
        }
        assert_eq!(f.released.len(), MAX_RELEASED);
        assert_eq!(f.released.front().map(|r| r.seq), Some(extra as u64 + 1));
        assert_eq!(
            f.released.back().map(|r| r.seq),
            Some((MAX_RELEASED + extra) as u64)
        );
        assert_eq!(load(&s, 1), (0, 0, false));
    }

    #[test]
    fn a_release_before_the_sidecar_saw_the_booking_stays_released() {
        let mut f = LocalBookings::default();
        let mut s = snap(0);
        f.settle(&mut s, 9, 0, 1000);
        f.book(&mut s, 1, 5, 100, 20, 0);
        f.release(Some(&mut s), done(1, 5, 100, 20, 2), 5);
        assert_eq!(load(&s, 1), (0, 0, false));
        // A snapshot with neither the booking nor its release: unchanged.
        let mut none = snap(0);
        f.settle(&mut none, 9, 10, 1000);
        assert_eq!(load(&none, 1), (0, 0, false));
        // One with the booking but not yet the release: taken off.
        let mut booked = snap(1);
        booked.models[0].workers[0].ranks[1].active_prefill_tokens = 100;
        booked.models[0].workers[0].ranks[1].active_decode_blocks = 20;
        f.settle(&mut booked, 9, 20, 1000);
        assert_eq!(load(&booked, 1), (0, 0, false));
    }

    #[test]
    fn a_new_snapshot_keeps_only_what_it_does_not_count() {
        let mut f = LocalBookings::default();
        let mut s = snap(0);
        f.settle(&mut s, 9, 0, 1000);
        f.book(&mut s, 1, 4, 100, 10, 0);
        f.book(&mut s, 2, 4, 100, 10, 0);
        f.book(&mut s, 3, 5, 100, 10, 0);
        // The sidecar has seen bookings up to 2 (its load already holds them).
        let mut next = snap(2);
        f.settle(&mut next, 9, 10, 1000);
        assert_eq!(f.len(), 1);
        assert_eq!(load(&next, 0), (0, 0, false));
        assert_eq!(load(&next, 1), (100, 10, false));
        // Another VM's watermark says nothing about ours.
        let mut other = snap(0);
        other.applied[0].vm = 8;
        f.settle(&mut other, 9, 10, 1000);
        assert_eq!(f.len(), 1);
        // Too old: the sidecar never answered; let it go.
        let mut late = snap(0);
        f.settle(&mut late, 9, 2000, 1000);
        assert!(f.is_empty());
        assert_eq!(load(&late, 1), (0, 0, false));
    }

    #[test]
    fn a_workers_requests_in_flight_follow_bookings_and_their_ends() {
        let in_flight = |s: &Snapshot| s.models[0].workers[0].thermal.in_flight;
        let mut f = LocalBookings::default();
        let mut s = snap(0);
        s.models[0].workers[0].thermal.in_flight = 3;
        f.settle(&mut s, 9, 0, 1000);
        f.book(&mut s, 1, 4, 100, 10, 0);
        f.book(&mut s, 2, 5, 100, 10, 0);
        assert_eq!(
            in_flight(&s),
            5,
            "both ranks' bookings count for the worker"
        );
        f.release(Some(&mut s), first_byte(1, 4, 100, 3), 1);
        assert_eq!(in_flight(&s), 5, "a first byte ends nothing");
        f.release(Some(&mut s), done(1, 4, 0, 10, 3), 2);
        assert_eq!(in_flight(&s), 4);
        // A snapshot that counts booking 1 may or may not count its end:
        // the view keeps the sidecar's count (never below what runs) and
        // adds booking 2, which the sidecar has not seen.
        let mut next = snap(1);
        next.models[0].workers[0].thermal.in_flight = 4;
        f.settle(&mut next, 9, 10, 1000);
        assert_eq!(
            in_flight(&next),
            5,
            "+1 for booking 2, the end of 1 not taken twice"
        );
    }

    #[test]
    fn fresh_load_can_make_a_rank_busy() {
        let mut f = LocalBookings::default();
        let mut s = snap(0);
        f.settle(&mut s, 9, 0, 1000);
        f.book(&mut s, 1, 4, 0, 40, 0);
        assert!(!load(&s, 0).2);
        f.book(&mut s, 2, 4, 0, 20, 0);
        assert!(load(&s, 0).2, "60 of 100 blocks is over 0.5");
        // Releasing does not clear it: the sidecar decides that.
        f.release(Some(&mut s), done(2, 4, 0, 20, 3), 1);
        assert!(load(&s, 0).2);
    }

    #[test]
    fn unknown_slots_and_sequences_are_ignored() {
        let mut f = LocalBookings::default();
        let mut s = snap(0);
        f.settle(&mut s, 9, 0, 1000);
        f.book(&mut s, 1, 77, 10, 1, 0);
        f.release(Some(&mut s), first_byte(42, 77, 10, 2), 1);
        f.release(None, done(42, 77, 0, 1, 2), 1);
        assert_eq!(load(&s, 0), (0, 0, false));
        assert_eq!(f.len(), 1);
    }
}
