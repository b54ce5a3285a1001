//! Which peer messages may still book load: a signed admission recorded off
//! the wire and sent again after its free would otherwise book its load
//! once more, for as long as the booking TTL.
//!
//! Each message carries its origin (random at each start: the sender's
//! epoch), its sequence number among the origin's messages and its send
//! time (`wire::Stamp`). A message is fresh when its send time is within
//! `replica_sync.max_message_age_ms` of this sidecar's clock and its
//! number has not been seen: per origin, the highest number and a bitmap
//! of the [`WINDOW`] numbers below it, so messages reordered by less than
//! that are still fresh. Only a fresh message's admissions are booked.
//!
//! Each peer connection has a guard of its own: a message's origin is
//! whatever its signer wrote, and a far-ahead number under another peer's
//! origin must not slide that peer's window past its real numbers.
//!
//! What only lowers load (a free, a prefill completion) applies from any
//! authenticated message: a late free must never be lost, and it can do
//! nothing to a holder that is gone.
//!
//! Origins not heard from in twice the age are forgotten when room is
//! needed; any message of theirs is then too old to pass the age check,
//! which is what makes forgetting safe.

use super::wire::Stamp;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Message numbers below an origin's highest that are told apart; a
/// message further behind is treated as seen.
pub(super) const WINDOW: u64 = 1024;
const WORDS: usize = (WINDOW / 64) as usize;
/// Origins remembered at once, per peer: a peer's process draws one origin
/// per start, so this is far more than one restarts within twice the age,
/// and about 40 KiB. A flood of origins from one peer evicts only its own.
const MAX_ORIGINS: usize = 256;

/// What a message's admissions may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// First seen, within the age: every event applies.
    Fresh,
    /// Its number was seen already, or is further behind than the window.
    Replayed,
    /// Sent further from this sidecar's clock than the age allows (a
    /// replay from long ago, or clocks apart).
    Stale,
}

impl Verdict {
    /// The refusal's reason, as metrics label it.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Verdict::Fresh => "fresh",
            Verdict::Replayed => "replayed",
            Verdict::Stale => "stale",
        }
    }
}

/// One origin's numbers seen: `highest` and, for each number within
/// [`WINDOW`] of it, one bit at `number % WINDOW`.
struct Window {
    highest: u64,
    seen: [u64; WORDS],
    heard: Instant,
}

fn bit(seq: u64) -> (usize, u64) {
    let i = (seq % WINDOW) as usize;
    (i / 64, 1 << (i % 64))
}

impl Window {
    fn new(seq: u64, now: Instant) -> Window {
        let mut w = Window {
            highest: seq,
            seen: [0; WORDS],
            heard: now,
        };
        let (word, mask) = bit(seq);
        w.seen[word] |= mask;
        w
    }

    /// Marks `seq` seen; false when it already was, or is too far behind
    /// to tell.
    fn mark(&mut self, seq: u64) -> bool {
        if seq > self.highest {
            if seq - self.highest >= WINDOW {
                self.seen = [0; WORDS];
            } else {
                // The bits the window slides over belong to numbers not
                // seen yet.
                for s in self.highest + 1..=seq {
                    let (word, mask) = bit(s);
                    self.seen[word] &= !mask;
                }
            }
            self.highest = seq;
        } else if self.highest - seq >= WINDOW {
            return false;
        }
        let (word, mask) = bit(seq);
        let fresh = self.seen[word] & mask == 0;
        self.seen[word] |= mask;
        fresh
    }
}

pub(super) struct ReplayGuard {
    max_age_ms: u64,
    origins: HashMap<u64, Window>,
}

impl ReplayGuard {
    pub(super) fn new(max_age: Duration) -> ReplayGuard {
        ReplayGuard {
            max_age_ms: u64::try_from(max_age.as_millis()).unwrap_or(u64::MAX),
            origins: HashMap::new(),
        }
    }

    /// Judges a message stamped `stamp`, arriving at `now_ms` (Unix) and
    /// `now`, and remembers it when fresh.
    pub(super) fn check(&mut self, stamp: &Stamp, now_ms: u64, now: Instant) -> Verdict {
        if now_ms.abs_diff(stamp.sent_at_ms) > self.max_age_ms {
            return Verdict::Stale;
        }
        if let Some(w) = self.origins.get_mut(&stamp.origin) {
            w.heard = now;
            return if w.mark(stamp.seq) {
                Verdict::Fresh
            } else {
                Verdict::Replayed
            };
        }
        self.make_room(now);
        self.origins
            .insert(stamp.origin, Window::new(stamp.seq, now));
        Verdict::Fresh
    }

    fn make_room(&mut self, now: Instant) {
        if self.origins.len() < MAX_ORIGINS {
            return;
        }
        let forget_after = Duration::from_millis(self.max_age_ms.saturating_mul(2));
        self.origins
            .retain(|_, w| now.duration_since(w.heard) < forget_after);
        if self.origins.len() >= MAX_ORIGINS
            && let Some(oldest) = self
                .origins
                .iter()
                .min_by_key(|(_, w)| w.heard)
                .map(|(o, _)| *o)
        {
            self.origins.remove(&oldest);
        }
    }

    #[cfg(test)]
    fn remembers(&self, origin: u64) -> bool {
        self.origins.contains_key(&origin)
    }
}

#[cfg(test)]
mod tests;
