//! Gateway bookings as the sidecar keeps them: live requests per rank slot,
//! the per-VM watermarks echoed in snapshots, and the drain rate that sets
//! `Retry-After`.
//!
//! Events arrive from the filter in order per VM (see
//! `kvgate_core::booking`). A booking lives until its `Done` arrives or,
//! when a gateway lost track of it (a VM reloaded, a batch was dropped),
//! until it is older than the expiry: nothing a request booked outlives it
//! by more than that.

use kvgate_core::Applied;
use kvgate_core::booking::{Event, Key};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What one rank slot has booked right now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SlotLoad {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    pub requests: u64,
    /// Observed release rates, per second (exponentially averaged).
    pub prefill_drain_per_s: f64,
    pub decode_drain_per_s: f64,
    /// Requests the rank finished per second (exponentially averaged).
    pub completions_per_s: f64,
}

#[derive(Debug, Clone)]
struct Live {
    slot: u16,
    prefill: u64,
    decode: u64,
    at: Instant,
}

#[derive(Debug, Default, Clone)]
struct Slot {
    load: SlotLoad,
    /// Totals released since start, sampled for the drain rate.
    freed_prefill: u64,
    freed_decode: u64,
    finished: u64,
    sampled: Option<(Instant, u64, u64, u64)>,
}

/// What applying an event means for the caller's metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    Booked {
        model: String,
        slot: u16,
    },
    Rejected {
        model: String,
        reason: String,
    },
    Released,
    /// A `FirstByte`/`Done` for a booking this process never saw (booked
    /// before a sidecar restart) or one that already expired.
    Unknown,
    /// A booking for a slot that no longer exists.
    Refused,
}

/// How quickly a drain-rate average forgets: about this long.
const DRAIN_TAU: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Bookings {
    live: HashMap<Key, Live>,
    slots: HashMap<u16, Slot>,
    marks: HashMap<u64, (u64, Instant)>,
    ttl: Duration,
    pub expired_total: u64,
}

impl Bookings {
    pub fn new(ttl: Duration) -> Bookings {
        Bookings {
            live: HashMap::new(),
            slots: HashMap::new(),
            marks: HashMap::new(),
            ttl,
            expired_total: 0,
        }
    }

    /// Applies one event. `slot_exists` tells whether a booking's slot is a
    /// rank of its model now; bookings for anything else are refused.
    pub fn apply(
        &mut self,
        ev: Event,
        now: Instant,
        slot_exists: impl Fn(&str, u16) -> bool,
    ) -> Effect {
        match ev {
            Event::Book {
                key,
                model,
                slot,
                prefill_tokens,
                decode_blocks,
            } => {
                let mark = self.marks.entry(key.vm).or_insert((0, now));
                *mark = (mark.0.max(key.seq), now);
                if !slot_exists(&model, slot) {
                    return Effect::Refused;
                }
                let live = Live {
                    slot,
                    prefill: u64::from(prefill_tokens),
                    decode: u64::from(decode_blocks),
                    at: now,
                };
                let s = self.slots.entry(slot).or_default();
                s.load.prefill_tokens += live.prefill;
                s.load.decode_blocks += live.decode;
                s.load.requests += 1;
                if let Some(old) = self.live.insert(key, live) {
                    // A VM never reuses a key; if a buggy one did, count it once.
                    self.release(&old, true);
                }
                Effect::Booked { model, slot }
            }
            Event::FirstByte { key } => match self.live.get_mut(&key) {
                Some(l) => {
                    let freed = std::mem::take(&mut l.prefill);
                    let slot = l.slot;
                    if let Some(s) = self.slots.get_mut(&slot) {
                        s.load.prefill_tokens = s.load.prefill_tokens.saturating_sub(freed);
                        s.freed_prefill += freed;
                    }
                    Effect::Released
                }
                None => Effect::Unknown,
            },
            Event::Done { key } => match self.live.remove(&key) {
                Some(l) => {
                    self.release(&l, true);
                    Effect::Released
                }
                None => Effect::Unknown,
            },
            Event::Rejected { model, reason } => Effect::Rejected { model, reason },
        }
    }

    /// Takes a booking's load off its slot; `drained` counts it as work the
    /// rank finished (an expiry is not: it says nothing about speed).
    fn release(&mut self, l: &Live, drained: bool) {
        let Some(s) = self.slots.get_mut(&l.slot) else {
            return;
        };
        s.load.prefill_tokens = s.load.prefill_tokens.saturating_sub(l.prefill);
        s.load.decode_blocks = s.load.decode_blocks.saturating_sub(l.decode);
        s.load.requests = s.load.requests.saturating_sub(1);
        if drained {
            s.freed_prefill += l.prefill;
            s.freed_decode += l.decode;
            s.finished += 1;
        }
    }

    /// Expires bookings and VM watermarks older than the expiry, and
    /// updates drain rates. Returns how many bookings expired.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let ttl = self.ttl;
        let old: Vec<Key> = self
            .live
            .iter()
            .filter(|(_, l)| now.saturating_duration_since(l.at) > ttl)
            .map(|(k, _)| *k)
            .collect();
        for k in &old {
            if let Some(l) = self.live.remove(k) {
                self.release(&l, false);
            }
        }
        self.expired_total += old.len() as u64;
        self.marks
            .retain(|_, (_, seen)| now.saturating_duration_since(*seen) <= ttl);
        for s in self.slots.values_mut() {
            sample_drain(s, now);
        }
        old.len()
    }

    /// A slot's rank is gone (worker removed or resized): forget its load.
    pub fn drop_slot(&mut self, slot: u16) {
        self.live.retain(|_, l| l.slot != slot);
        self.slots.remove(&slot);
    }

    pub fn slot(&self, slot: u16) -> SlotLoad {
        self.slots.get(&slot).map(|s| s.load).unwrap_or_default()
    }

    pub fn active(&self) -> usize {
        self.live.len()
    }

    /// Per VM, the highest booking applied: what snapshots echo.
    pub fn applied(&self) -> Vec<Applied> {
        let mut v: Vec<Applied> = self
            .marks
            .iter()
            .map(|(vm, (seq, _))| Applied { vm: *vm, seq: *seq })
            .collect();
        v.sort_by_key(|a| a.vm);
        v
    }
}

fn sample_drain(s: &mut Slot, now: Instant) {
    let Some((at, p0, d0, f0)) = s.sampled else {
        s.sampled = Some((now, s.freed_prefill, s.freed_decode, s.finished));
        return;
    };
    let dt = now.saturating_duration_since(at);
    // Short intervals make noisy rates; publish loops can run every few ms.
    if dt < Duration::from_millis(250) {
        return;
    }
    let secs = dt.as_secs_f64();
    let alpha = 1.0 - (-secs / DRAIN_TAU.as_secs_f64()).exp();
    let p_rate = (s.freed_prefill - p0) as f64 / secs;
    let d_rate = (s.freed_decode - d0) as f64 / secs;
    let f_rate = (s.finished - f0) as f64 / secs;
    s.load.prefill_drain_per_s += alpha * (p_rate - s.load.prefill_drain_per_s);
    s.load.decode_drain_per_s += alpha * (d_rate - s.load.decode_drain_per_s);
    s.load.completions_per_s += alpha * (f_rate - s.load.completions_per_s);
    s.sampled = Some((now, s.freed_prefill, s.freed_decode, s.finished));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seq: u64) -> Key {
        Key { vm: 7, seq }
    }

    fn book(seq: u64, slot: u16, prefill: u32, decode: u32) -> Event {
        Event::Book {
            key: key(seq),
            model: "m".into(),
            slot,
            prefill_tokens: prefill,
            decode_blocks: decode,
        }
    }

    fn any_slot(_: &str, _: u16) -> bool {
        true
    }

    #[test]
    fn a_request_books_prefill_then_decode_and_releases_everything() {
        let mut b = Bookings::new(Duration::from_secs(300));
        let t = Instant::now();
        assert_eq!(
            b.apply(book(1, 3, 1000, 70), t, any_slot),
            Effect::Booked {
                model: "m".into(),
                slot: 3
            }
        );
        b.apply(book(2, 3, 500, 40), t, any_slot);
        let l = b.slot(3);
        assert_eq!(
            (l.prefill_tokens, l.decode_blocks, l.requests),
            (1500, 110, 2)
        );
        b.apply(Event::FirstByte { key: key(1) }, t, any_slot);
        assert_eq!(b.slot(3).prefill_tokens, 500);
        b.apply(Event::Done { key: key(1) }, t, any_slot);
        b.apply(Event::Done { key: key(2) }, t, any_slot);
        let l = b.slot(3);
        assert_eq!((l.prefill_tokens, l.decode_blocks, l.requests), (0, 0, 0));
        assert_eq!(b.active(), 0);
        assert_eq!(b.applied(), vec![Applied { vm: 7, seq: 2 }]);
    }

    #[test]
    fn unknown_releases_and_missing_slots_change_nothing() {
        let mut b = Bookings::new(Duration::from_secs(300));
        let t = Instant::now();
        assert_eq!(
            b.apply(Event::Done { key: key(9) }, t, any_slot),
            Effect::Unknown
        );
        assert_eq!(
            b.apply(book(1, 4, 10, 1), t, |_, s| s != 4),
            Effect::Refused
        );
        assert_eq!(b.slot(4), SlotLoad::default());
        // The watermark still moves: the VM must stop adding it locally.
        assert_eq!(b.applied(), vec![Applied { vm: 7, seq: 1 }]);
    }

    #[test]
    fn stale_bookings_expire() {
        let mut b = Bookings::new(Duration::from_secs(300));
        let t = Instant::now();
        b.apply(book(1, 1, 100, 10), t, any_slot);
        b.apply(book(2, 1, 100, 10), t + Duration::from_secs(200), any_slot);
        assert_eq!(b.sweep(t + Duration::from_secs(301)), 1);
        assert_eq!(b.slot(1).decode_blocks, 10);
        assert_eq!(b.sweep(t + Duration::from_secs(501)), 1);
        assert_eq!(b.slot(1).decode_blocks, 0);
        assert_eq!(b.expired_total, 2);
        assert!(b.applied().is_empty(), "a silent VM's mark goes too");
    }

    #[test]
    fn drain_rate_follows_completions() {
        let mut b = Bookings::new(Duration::from_secs(300));
        let t = Instant::now();
        b.sweep(t);
        // 20 requests of 10 blocks finish each second for 10 s.
        let mut seq = 0;
        for s in 1..=10u64 {
            let now = t + Duration::from_secs(s);
            for _ in 0..20 {
                seq += 1;
                b.apply(book(seq, 2, 0, 10), now, any_slot);
                b.apply(Event::Done { key: key(seq) }, now, any_slot);
            }
            b.sweep(now);
        }
        let rate = b.slot(2).decode_drain_per_s;
        assert!((150.0..=200.0).contains(&rate), "{rate}");
        let done = b.slot(2).completions_per_s;
        assert!((15.0..=20.0).contains(&done), "{done}");
    }

    #[test]
    fn dropping_a_slot_forgets_its_bookings() {
        let mut b = Bookings::new(Duration::from_secs(300));
        let t = Instant::now();
        b.apply(book(1, 5, 100, 10), t, any_slot);
        b.apply(book(2, 6, 100, 10), t, any_slot);
        b.drop_slot(5);
        assert_eq!(b.active(), 1);
        assert_eq!(b.slot(5), SlotLoad::default());
        assert_eq!(b.slot(6).requests, 1);
    }
}
