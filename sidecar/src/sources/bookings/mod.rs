//! The load ledger: every request in flight that this sidecar knows of,
//! per rank slot, and the drain rates that set `Retry-After`.
//!
//! Three kinds of holder book load here, and they are one ledger so that a
//! fleet served by Envoy and by an external runtime at once is counted
//! once:
//!
//! * gateway bookings, reported by this sidecar's Envoy VMs (see
//!   `kvgate_core::booking`), which arrive in order per VM and whose
//!   per-VM watermarks snapshots echo;
//! * reservations made through the selection API (`POST /reservations`,
//!   `/select_and_reserve`), named by the client's reservation id;
//! * either of those announced by a peer sidecar (replica sync), named by
//!   the peer's process id and its own key, so that several gateway pods
//!   see one fleet load.
//!
//! A holder lives until its end arrives or, when that end was lost (a VM
//! reloaded, a batch or a peer's message was dropped, a client forgot its
//! reservation), until nothing was heard of it for the expiry: nothing
//! outlives its request by more than that.

use kvgate_core::Applied;
use kvgate_core::booking::{Event, Key};
use std::collections::HashMap;
use std::sync::Arc;
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

/// Which process a holder was booked through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Origin {
    Here,
    /// A replica-sync peer, by the process id it announces.
    Peer(u64),
}

/// What names a holder within its origin.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Id {
    /// A request routed by an Envoy VM.
    Gateway(Key),
    /// A selection API reservation, by its client-chosen id.
    Reservation(Arc<str>),
}

/// One entry of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder {
    pub origin: Origin,
    pub id: Id,
}

impl Holder {
    pub fn here(id: Id) -> Holder {
        Holder {
            origin: Origin::Here,
            id,
        }
    }
}

/// The load a holder puts on a slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    pub slot: u16,
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
}

#[derive(Debug, Clone)]
struct Live {
    slot: u16,
    prefill: u64,
    /// The prompt tokens booked as uncached: `prefill` as it was booked,
    /// which the first byte empties.
    uncached: u64,
    /// Blocks the request holds: its prompt's new blocks plus the output
    /// blocks reported since.
    blocks: u64,
    /// The weight of those blocks (a reservation's `decay_fraction`).
    weight: f64,
    /// What `blocks` counts as on the slot now: `blocks × weight`.
    decode: u64,
    /// When the holder was last heard of.
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

/// What applying a gateway event means for the caller's metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    Booked {
        model: String,
        slot: u16,
    },
    Rejected {
        model: String,
        reason: kvgate_core::reply::Reason,
    },
    Released,
    /// A gateway booking's `Done`: its slot, and the prompt tokens it
    /// booked as uncached.
    Ended {
        slot: u16,
        uncached: u64,
    },
    /// A `FirstByte`/`Done` for a booking this process never saw (booked
    /// before a sidecar restart) or one that already expired.
    Unknown,
    /// A booking for a slot that no longer exists.
    Refused,
}

/// The most one holder may book on a slot, per field. Every way load
/// enters the ledger (the selection API, gateway booking batches, replica
/// sync) checks it first, so that one booking cannot stand for the load of
/// billions of requests; the sums saturate besides, so that no number of
/// holders wraps them round to an idle-looking rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// The model's `max_prompt_tokens`.
    pub prefill_tokens: u64,
    /// A prompt's blocks plus its expected output's, each at most
    /// `max_prompt_tokens` (blocks hold at least one token).
    pub decode_blocks: u64,
}

impl Bound {
    pub fn of_prompt(max_prompt_tokens: u64) -> Bound {
        Bound {
            prefill_tokens: max_prompt_tokens,
            decode_blocks: max_prompt_tokens.saturating_mul(2),
        }
    }

    /// Whether `prefill_tokens` and `decode_blocks` are within the bound;
    /// the error names the field that is not.
    pub fn check(&self, prefill_tokens: u64, decode_blocks: u64) -> Result<(), String> {
        if prefill_tokens > self.prefill_tokens {
            return Err(format!(
                "{prefill_tokens} prefill tokens are more than the model's max_prompt_tokens {}",
                self.prefill_tokens
            ));
        }
        if decode_blocks > self.decode_blocks {
            return Err(format!(
                "{decode_blocks} decode blocks are more than the model allows ({}: twice its max_prompt_tokens)",
                self.decode_blocks
            ));
        }
        Ok(())
    }
}

/// Why a ledger change was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("reservation {0:?} already exists")]
    Duplicate(String),
    #[error("no reservation {0:?}")]
    Unknown(String),
}

/// How quickly a drain-rate average forgets: about this long.
const DRAIN_TAU: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Bookings {
    live: HashMap<Holder, Live>,
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

    /// Applies one event from this sidecar's gateways. `slot_exists` tells
    /// whether a booking's slot is a rank of its model now; bookings for
    /// anything else are refused.
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
                self.seen(key, now);
                if !slot_exists(&model, slot) {
                    return Effect::Refused;
                }
                self.admit(
                    Holder::here(Id::Gateway(key)),
                    Load {
                        slot,
                        prefill_tokens: u64::from(prefill_tokens),
                        decode_blocks: u64::from(decode_blocks),
                    },
                    now,
                );
                Effect::Booked { model, slot }
            }
            Event::FirstByte { key } => {
                match self.prefill_complete(&Holder::here(Id::Gateway(key)), now) {
                    true => Effect::Released,
                    false => Effect::Unknown,
                }
            }
            Event::Done { key, .. } => {
                let holder = Holder::here(Id::Gateway(key));
                let uncached = self.live.get(&holder).map_or(0, |l| l.uncached);
                match self.free(&holder) {
                    Some(slot) => Effect::Ended { slot, uncached },
                    None => Effect::Unknown,
                }
            }
            Event::Rejected { model, reason } => Effect::Rejected { model, reason },
        }
    }

    /// A gateway VM's booking `key` arrived: it counts towards the VM's
    /// watermark whether or not it is booked, so that the VM stops waiting
    /// for a booking the sidecar refused.
    pub fn seen(&mut self, key: Key, now: Instant) {
        let mark = self.marks.entry(key.vm).or_insert((0, now));
        *mark = (mark.0.max(key.seq), now);
    }

    /// Books `load` for `holder`. A holder booked again (a buggy VM reusing
    /// a key, a peer's message seen twice) is counted once: the old entry
    /// goes.
    pub fn admit(&mut self, holder: Holder, load: Load, now: Instant) {
        let live = Live {
            slot: load.slot,
            prefill: load.prefill_tokens,
            uncached: load.prefill_tokens,
            blocks: load.decode_blocks,
            weight: 1.0,
            decode: load.decode_blocks,
            at: now,
        };
        let s = self.slots.entry(load.slot).or_default();
        // Callers bound each booking; saturating keeps a sum that still
        // reached the top at the top, never wrapped round to idle.
        s.load.prefill_tokens = s.load.prefill_tokens.saturating_add(live.prefill);
        s.load.decode_blocks = s.load.decode_blocks.saturating_add(live.decode);
        s.load.requests = s.load.requests.saturating_add(1);
        if let Some(old) = self.live.insert(holder, live) {
            self.release(&old, true);
        }
    }

    /// Books a reservation made here; its id must be new.
    pub fn reserve(&mut self, id: &str, load: Load, now: Instant) -> Result<Holder, LedgerError> {
        let holder = Holder::here(Id::Reservation(id.into()));
        if self.live.contains_key(&holder) {
            return Err(LedgerError::Duplicate(id.to_string()));
        }
        self.admit(holder.clone(), load, now);
        Ok(holder)
    }

    /// Prefill is over: the holder's prefill tokens leave the slot. False
    /// when the holder is unknown. Repeating it changes nothing.
    pub fn prefill_complete(&mut self, holder: &Holder, now: Instant) -> bool {
        let Some(l) = self.live.get_mut(holder) else {
            return false;
        };
        let freed = std::mem::take(&mut l.prefill);
        l.at = now;
        let slot = l.slot;
        if let Some(s) = self.slots.get_mut(&slot) {
            s.load.prefill_tokens = s.load.prefill_tokens.saturating_sub(freed);
            s.freed_prefill = s.freed_prefill.saturating_add(freed);
        }
        true
    }

    /// One more output block for a holder, optionally reweighting all its
    /// blocks by `decay_fraction` (in [0, 1]; checked by the caller): a
    /// client that knows a request is near its end can say its blocks will
    /// soon be free. False when the holder is unknown.
    pub fn output_block(
        &mut self,
        holder: &Holder,
        decay_fraction: Option<f64>,
        now: Instant,
    ) -> bool {
        let Some(l) = self.live.get_mut(holder) else {
            return false;
        };
        l.blocks = l.blocks.saturating_add(1);
        if let Some(f) = decay_fraction {
            l.weight = f.clamp(0.0, 1.0);
        }
        l.at = now;
        let old = l.decode;
        l.decode = (l.blocks as f64 * l.weight).round() as u64;
        let (slot, new) = (l.slot, l.decode);
        if let Some(s) = self.slots.get_mut(&slot) {
            s.load.decode_blocks = s.load.decode_blocks.saturating_sub(old).saturating_add(new);
        }
        true
    }

    /// The request ended: all of the holder's load leaves its slot.
    /// Returns the slot, or None when the holder is unknown.
    pub fn free(&mut self, holder: &Holder) -> Option<u16> {
        let l = self.live.remove(holder)?;
        self.release(&l, true);
        Some(l.slot)
    }

    /// Takes a holder's load off its slot; `drained` counts it as work the
    /// rank finished (an expiry is not: it says nothing about speed).
    fn release(&mut self, l: &Live, drained: bool) {
        let Some(s) = self.slots.get_mut(&l.slot) else {
            return;
        };
        s.load.prefill_tokens = s.load.prefill_tokens.saturating_sub(l.prefill);
        s.load.decode_blocks = s.load.decode_blocks.saturating_sub(l.decode);
        s.load.requests = s.load.requests.saturating_sub(1);
        if drained {
            s.freed_prefill = s.freed_prefill.saturating_add(l.prefill);
            s.freed_decode = s.freed_decode.saturating_add(l.decode);
            s.finished = s.finished.saturating_add(1);
        }
    }

    /// Expires holders and VM watermarks not heard of for the expiry, and
    /// updates drain rates. Returns how many holders expired.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let ttl = self.ttl;
        let old: Vec<Holder> = self
            .live
            .iter()
            .filter(|(_, l)| now.saturating_duration_since(l.at) > ttl)
            .map(|(k, _)| k.clone())
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

    /// Live holders per origin kind: (gateway here, reservations here,
    /// from peers).
    pub fn census(&self) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for h in self.live.keys() {
            match (&h.origin, &h.id) {
                (Origin::Peer(_), _) => c.2 += 1,
                (Origin::Here, Id::Gateway(_)) => c.0 += 1,
                (Origin::Here, Id::Reservation(_)) => c.1 += 1,
            }
        }
        c
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
    let p_rate = s.freed_prefill.saturating_sub(p0) as f64 / secs;
    let d_rate = s.freed_decode.saturating_sub(d0) as f64 / secs;
    let f_rate = s.finished.saturating_sub(f0) as f64 / secs;
    s.load.prefill_drain_per_s += alpha * (p_rate - s.load.prefill_drain_per_s);
    s.load.decode_drain_per_s += alpha * (d_rate - s.load.decode_drain_per_s);
    s.load.completions_per_s += alpha * (f_rate - s.load.completions_per_s);
    s.sampled = Some((now, s.freed_prefill, s.freed_decode, s.finished));
}

#[cfg(test)]
mod tests;
