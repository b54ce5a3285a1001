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
//!
//! Every holder is outside input, so the ledger is capped per origin, per
//! kind and in total (`census`, `[load.caps]`), and a tick's work follows
//! what changed, not what is held: expiry pops only the holders due
//! (`expiry`), and the per-rank sums and the census move with each admit,
//! end and expiry. The tables shrink again once a surge has passed.
//!
//! Each holder also keeps the tenant whose request booked it, and each
//! slot its sums per tenant beside its totals, moved by the same admits,
//! ends and expiries: the snapshot adds them up per model (tenant
//! fairness counts every gateway's bookings). A slot holds an entry only
//! for a tenant with a live holder on it, so the entries are bounded by the
//! holders the caps allow, and a tenant's name by the source that booked
//! it (`booking::MAX_TENANT_LEN` for gateways and peers, the catalog's
//! tenants for reservations).

mod census;
mod expiry;

pub use census::Full;

use crate::config::LedgerCaps;
use census::Census;
use expiry::{Deadlines, Due};
use kvgate_core::Applied;
use kvgate_core::booking::{Event, Key};
use std::collections::HashMap;
use std::hash::Hash;
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

/// What one tenant has booked on a slot right now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantBooked {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// Its live holders there: the entry goes with the last.
    pub requests: u64,
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

impl From<&kvgate_core::dispatch::Target> for Load {
    /// What a dispatched leg books on its rank.
    fn from(t: &kvgate_core::dispatch::Target) -> Load {
        Load {
            slot: t.slot,
            prefill_tokens: t.prefill_tokens,
            decode_blocks: t.decode_blocks,
        }
    }
}

#[derive(Debug, Clone)]
struct Live {
    slot: u16,
    /// Whose request booked it; shared with its slot's entry.
    tenant: Arc<str>,
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
    /// Which admission this is: its deadline entry carries the same.
    serial: u64,
}

#[derive(Debug, Default, Clone)]
struct Slot {
    load: SlotLoad,
    /// `load`'s booked sums split by tenant.
    tenants: HashMap<Arc<str>, TenantBooked>,
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
        /// Whose request it is, for the peers.
        tenant: String,
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
    /// A booking the ledger has no room for.
    Full(Full),
    /// A VM said it is alive.
    Alive,
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
    #[error("the ledger has no room for another reservation: {0}")]
    Full(Full),
}

/// How quickly a drain-rate average forgets: about this long.
const DRAIN_TAU: Duration = Duration::from_secs(5);

/// What one tick's sweep did, and the work it took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Holders expired.
    pub expired: usize,
    /// Deadline entries looked at: those due, whether their holder expired,
    /// was heard of since (pushed back) or had already ended.
    pub visited: usize,
    /// Entries moved to give memory back or to drop deadlines whose holders
    /// ended: paid for by the ends since the last time, not by what is
    /// held.
    pub rebuilt: usize,
    /// Bookings ended because their VM went silent: peers hold copies
    /// of them, to be freed there too.
    pub silenced: Vec<Key>,
}

/// A table is shrunk when it holds less than an eighth of its room (and
/// that room is worth giving back), to twice what it holds: it must lose
/// at least half of that again, or double, before it is rebuilt again.
const SHRINK_ABOVE: usize = 1024;

fn sparse(len: usize, capacity: usize) -> bool {
    capacity > SHRINK_ABOVE && len < capacity / 8
}

/// Shrinks `m` when it is sparse; the entries moved, when its room changed.
fn shrink_map<K: Eq + Hash, V>(m: &mut HashMap<K, V>) -> Option<usize> {
    let before = m.capacity();
    if !sparse(m.len(), before) {
        return None;
    }
    m.shrink_to(m.len().saturating_mul(2));
    (m.capacity() < before).then_some(m.len())
}

#[derive(Debug)]
pub struct Bookings {
    live: HashMap<Holder, Live>,
    slots: HashMap<u16, Slot>,
    marks: HashMap<u64, (u64, Instant)>,
    deadlines: Deadlines,
    census: Census,
    caps: LedgerCaps,
    next_serial: u64,
    /// The caps (`Full::bit`) whose refusal was logged: each is logged the
    /// first time, then only counted.
    warned: u8,
    ttl: Duration,
    pub expired_total: u64,
    /// VMs that say they are alive, and when they last did: one silent
    /// for `vm_silence` is gone (it trapped and was reloaded under a new
    /// tag, or its Envoy went away), and its bookings end with it.
    beats: HashMap<u64, Instant>,
    vm_silence: Duration,
    /// Bookings ended because their VM went silent.
    pub silenced_total: u64,
}

impl Bookings {
    pub fn new(ttl: Duration, caps: LedgerCaps) -> Bookings {
        Bookings {
            live: HashMap::new(),
            slots: HashMap::new(),
            marks: HashMap::new(),
            deadlines: Deadlines::default(),
            census: Census::default(),
            caps,
            next_serial: 0,
            warned: 0,
            ttl,
            expired_total: 0,
            beats: HashMap::new(),
            vm_silence: crate::config::DEFAULT_VM_SILENCE,
            silenced_total: 0,
        }
    }

    /// Sets how long a VM that beats may be silent (`load.vm_silence_ms`).
    pub fn with_vm_silence(mut self, silence: Duration) -> Bookings {
        self.vm_silence = silence;
        self
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
                tenant,
            } => {
                let holder = Holder::here(Id::Gateway(key));
                if let Err(full) = self.seen(key, now) {
                    return Effect::Full(self.refused(&holder, full));
                }
                if !slot_exists(&model, slot) {
                    return Effect::Refused;
                }
                let load = Load {
                    slot,
                    prefill_tokens: u64::from(prefill_tokens),
                    decode_blocks: u64::from(decode_blocks),
                };
                match self.admit(holder, load, &tenant, now) {
                    Ok(()) => Effect::Booked {
                        model,
                        slot,
                        tenant,
                    },
                    Err(full) => Effect::Full(full),
                }
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
            Event::Alive { vm } => {
                // Bounded like the watermarks: a VM the ledger cannot
                // track is only expired by the TTL.
                if self.beats.contains_key(&vm) || self.beats.len() < self.caps.gateway_vms {
                    self.beats.insert(vm, now);
                }
                Effect::Alive
            }
        }
    }

    /// Ends every booking of VMs that said they were alive and then went
    /// silent for `vm_silence`. Such a VM is a rare event, so finding its
    /// holders walks the ledger once per silent VM.
    fn end_silent_vms(&mut self, now: Instant) -> Vec<Key> {
        let silence = self.vm_silence;
        let silent: Vec<u64> = self
            .beats
            .iter()
            .filter(|(_, at)| now.saturating_duration_since(**at) > silence)
            .map(|(vm, _)| *vm)
            .collect();
        let mut ended = Vec::new();
        for vm in silent {
            self.beats.remove(&vm);
            self.marks.remove(&vm);
            let gone: Vec<Holder> = self
                .live
                .keys()
                .filter(
                    |h| matches!(&h.id, Id::Gateway(k) if k.vm == vm && h.origin == Origin::Here),
                )
                .cloned()
                .collect();
            let before = ended.len();
            for h in gone {
                if let Some(l) = self.live.remove(&h) {
                    self.census.remove(&h);
                    self.release(&l, false);
                    if let Id::Gateway(key) = h.id {
                        ended.push(key);
                    }
                }
            }
            tracing::warn!(
                vm = format_args!("{vm:016x}"),
                ended = ended.len() - before,
                "an Envoy VM went silent: its bookings are ended"
            );
        }
        self.silenced_total += ended.len() as u64;
        ended
    }

    /// A gateway VM's booking `key` arrived: it counts towards the VM's
    /// watermark whether or not it is booked, so that the VM stops waiting
    /// for a booking the sidecar refused. A VM the ledger has no room to
    /// track is refused: its bookings could never be echoed as applied.
    pub fn seen(&mut self, key: Key, now: Instant) -> Result<(), Full> {
        if !self.marks.contains_key(&key.vm) && self.marks.len() >= self.caps.gateway_vms {
            return Err(Full::GatewayVms(self.caps.gateway_vms));
        }
        let mark = self.marks.entry(key.vm).or_insert((0, now));
        *mark = (mark.0.max(key.seq), now);
        Ok(())
    }

    /// Books `load` for `holder`, a request of `tenant`, when its origin,
    /// its kind and the ledger have room. A holder booked again (a buggy
    /// VM reusing a key, a peer's message seen twice) is counted once: the
    /// old entry goes.
    pub fn admit(
        &mut self,
        holder: Holder,
        load: Load,
        tenant: &str,
        now: Instant,
    ) -> Result<(), Full> {
        if !self.live.contains_key(&holder) {
            if let Err(full) = self.census.room(&holder, self.live.len(), &self.caps) {
                return Err(self.refused(&holder, full));
            }
            self.census.add(&holder);
        }
        let serial = self.next_serial;
        self.next_serial += 1;
        let s = self.slots.entry(load.slot).or_default();
        // One allocation per tenant and slot, not per booking.
        let tenant: Arc<str> = match s.tenants.get_key_value(tenant) {
            Some((name, _)) => name.clone(),
            None => tenant.into(),
        };
        let live = Live {
            slot: load.slot,
            tenant,
            prefill: load.prefill_tokens,
            uncached: load.prefill_tokens,
            blocks: load.decode_blocks,
            weight: 1.0,
            decode: load.decode_blocks,
            at: now,
            serial,
        };
        // Callers bound each booking; saturating keeps a sum that still
        // reached the top at the top, never wrapped round to idle.
        s.load.prefill_tokens = s.load.prefill_tokens.saturating_add(live.prefill);
        s.load.decode_blocks = s.load.decode_blocks.saturating_add(live.decode);
        s.load.requests = s.load.requests.saturating_add(1);
        let t = s.tenants.entry(live.tenant.clone()).or_default();
        t.prefill_tokens = t.prefill_tokens.saturating_add(live.prefill);
        t.decode_blocks = t.decode_blocks.saturating_add(live.decode);
        t.requests = t.requests.saturating_add(1);
        self.deadlines.push(Due {
            at: now,
            serial,
            holder: holder.clone(),
        });
        if let Some(old) = self.live.insert(holder, live) {
            self.release(&old, true);
        }
        Ok(())
    }

    /// Logs a cap's first refusal (later ones are only counted, by the
    /// caller, who knows the source).
    fn refused(&mut self, holder: &Holder, full: Full) -> Full {
        if self.warned & full.bit() == 0 {
            self.warned |= full.bit();
            tracing::warn!(
                ?holder,
                "load ledger full, holder refused: {full}; further refusals are counted in kvgate_sidecar_bookings_refused_total{{reason=\"ledger_full\"}}"
            );
        } else {
            tracing::debug!(?holder, "load ledger full, holder refused: {full}");
        }
        full
    }

    /// Books a reservation made here for a request of `tenant`; its id
    /// must be new.
    pub fn reserve(
        &mut self,
        id: &str,
        load: Load,
        tenant: &str,
        now: Instant,
    ) -> Result<Holder, LedgerError> {
        let holder = Holder::here(Id::Reservation(id.into()));
        if self.live.contains_key(&holder) {
            return Err(LedgerError::Duplicate(id.to_string()));
        }
        self.admit(holder.clone(), load, tenant, now)
            .map_err(LedgerError::Full)?;
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
        if let Some(s) = self.slots.get_mut(&l.slot) {
            s.load.prefill_tokens = s.load.prefill_tokens.saturating_sub(freed);
            s.freed_prefill = s.freed_prefill.saturating_add(freed);
            if let Some(t) = s.tenants.get_mut(&l.tenant) {
                t.prefill_tokens = t.prefill_tokens.saturating_sub(freed);
            }
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
        let new = l.decode;
        if let Some(s) = self.slots.get_mut(&l.slot) {
            s.load.decode_blocks = s.load.decode_blocks.saturating_sub(old).saturating_add(new);
            if let Some(t) = s.tenants.get_mut(&l.tenant) {
                t.decode_blocks = t.decode_blocks.saturating_sub(old).saturating_add(new);
            }
        }
        true
    }

    /// The request ended: all of the holder's load leaves its slot.
    /// Returns the slot, or None when the holder is unknown.
    pub fn free(&mut self, holder: &Holder) -> Option<u16> {
        let l = self.live.remove(holder)?;
        self.census.remove(holder);
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
        if let Some(t) = s.tenants.get_mut(&l.tenant) {
            t.prefill_tokens = t.prefill_tokens.saturating_sub(l.prefill);
            t.decode_blocks = t.decode_blocks.saturating_sub(l.decode);
            t.requests = t.requests.saturating_sub(1);
            if t.requests == 0 {
                s.tenants.remove(&l.tenant);
            }
        }
        if drained {
            s.freed_prefill = s.freed_prefill.saturating_add(l.prefill);
            s.freed_decode = s.freed_decode.saturating_add(l.decode);
            s.finished = s.finished.saturating_add(1);
        }
    }

    /// Expires holders and VM watermarks not heard of for the expiry,
    /// updates drain rates, and gives back memory a surge left behind.
    /// Its work follows the holders due and those that ended since, never
    /// the number held: the watermarks and slots it also walks are bounded
    /// by `gateway_vms` and the catalog.
    pub fn sweep(&mut self, now: Instant) -> Sweep {
        let ttl = self.ttl;
        let due = |at: Instant| now.saturating_duration_since(at) > ttl;
        let mut sweep = Sweep::default();
        while let Some(d) = self.deadlines.pop_if(due) {
            sweep.visited += 1;
            let Some(l) = self.live.get(&d.holder) else {
                continue;
            };
            if l.serial != d.serial {
                // Ended and admitted again: its own entry stands.
                continue;
            }
            if !due(l.at) {
                // Heard of since it was pushed: due later.
                let at = l.at;
                self.deadlines.push(Due { at, ..d });
                continue;
            }
            if let Some(l) = self.live.remove(&d.holder) {
                self.census.remove(&d.holder);
                self.release(&l, false);
                sweep.expired += 1;
            }
        }
        self.expired_total += sweep.expired as u64;
        sweep.silenced = self.end_silent_vms(now);
        self.marks
            .retain(|_, (_, seen)| now.saturating_duration_since(*seen) <= ttl);
        let mut moved = 0;
        for s in self.slots.values_mut() {
            sample_drain(s, now);
            // A surge of tenants on one slot leaves its room behind.
            moved += shrink_map(&mut s.tenants).unwrap_or(0);
        }
        sweep.rebuilt = self.compact() + moved;
        sweep
    }

    /// Drops deadline entries whose holders ended once they outnumber the
    /// live ones, and shrinks the tables a surge grew. Returns the entries
    /// moved.
    fn compact(&mut self) -> usize {
        let mut moved = 0;
        if self.deadlines.needs_rebuild(self.live.len()) {
            self.deadlines.rebuild(self.live.iter().map(|(h, l)| Due {
                at: l.at,
                serial: l.serial,
                holder: h.clone(),
            }));
            moved += self.live.len();
        } else if self.deadlines.shrink() {
            moved += self.deadlines.len();
        }
        moved += shrink_map(&mut self.live).unwrap_or(0);
        moved += self.census.shrink().unwrap_or(0);
        moved += shrink_map(&mut self.marks).unwrap_or(0);
        moved += shrink_map(&mut self.beats).unwrap_or(0);
        moved
    }

    /// A slot's rank is gone (worker removed or resized): forget its load.
    /// A catalog change, not outside input: the scan is the control API's.
    pub fn drop_slot(&mut self, slot: u16) {
        let census = &mut self.census;
        self.live.retain(|h, l| {
            let keep = l.slot != slot;
            if !keep {
                census.remove(h);
            }
            keep
        });
        self.slots.remove(&slot);
    }

    pub fn slot(&self, slot: u16) -> SlotLoad {
        self.slots.get(&slot).map(|s| s.load).unwrap_or_default()
    }

    /// What each tenant with a live holder on `slot` has booked there;
    /// their sums are the slot's (short of a sum that saturated).
    pub fn slot_tenants(&self, slot: u16) -> impl Iterator<Item = (&Arc<str>, &TenantBooked)> {
        self.slots
            .get(&slot)
            .into_iter()
            .flat_map(|s| s.tenants.iter())
    }

    pub fn active(&self) -> usize {
        self.live.len()
    }

    /// Live holders per origin kind: (gateway here, reservations here,
    /// from peers).
    pub fn census(&self) -> (usize, usize, usize) {
        self.census.counts()
    }

    /// Holders the ledger's table has room for before it grows: what a
    /// surge left allocated, until the sweep shrinks it.
    pub fn capacity(&self) -> usize {
        self.live.capacity()
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
