//! The prefix index: which worker-rank slots cache which blocks, per tier.
//!
//! Blocks are keyed by kvgate's own sequence hash, recomputed from the
//! tokens each `BlockStored` carries (see `kvgate_core::hash`), so requests
//! hashed by the filter find them no matter which hash algorithm the engine
//! uses. Engine hashes are kept only per slot, to resolve a later
//! `BlockRemoved` and a child's `parent_block_hash`.
//!
//! The index is stored as `shard_count` small maps, split exactly as the
//! filter reads them (`kvgate_core::shard::shard_of`): publishing a changed
//! shard is encoding one small map, and a change marks only its shard dirty.
//!
//! Memory is bounded per slot: an engine never holds more blocks than its
//! caches, so a slot that exceeds `max_blocks_per_slot` has missed removals;
//! its entries are dropped (and the caller resynchronises it) rather than
//! letting a flood of stores grow the sidecar without bound.

use crate::prompt::Vocab;
use crate::sources::kv::stage::{Op, Staged};
use crate::sources::kv::wire::{EngineHash, Medium, Unmatchable};
use kvgate_core::hash::chain;
use kvgate_core::shard::{self, Holder, TIER_DEVICE, TIER_DISK, TIER_HOST};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Keys here are already hashes (or small engine counters), so a multiply
/// is all the mixing a table needs; SipHash would dominate ingest.
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (x ^ (x >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

/// Marks a slot's entry for a block no request can match: it is kept so
/// that removals and children resolve, but never enters the shards.
const UNMATCHABLE: u8 = 0x80;
const TIERS: u8 = TIER_DEVICE | TIER_HOST | TIER_DISK;

fn tier_bit(m: Medium) -> u8 {
    match m {
        Medium::Device => TIER_DEVICE,
        Medium::Host => TIER_HOST,
        Medium::Disk => TIER_DISK,
    }
}

/// What one slot (worker, DP rank) holds, by engine hash.
#[derive(Debug, Default)]
struct Slot {
    live: bool,
    block_size: u32,
    /// engine hash → (sequence hash, tier bits)
    engine: FastMap<EngineHash, (u64, u8)>,
    /// Pages of chains stored at a page size other than `block_size`.
    pages: FastMap<EngineHash, pages::Page>,
}

/// Holders of one block, sorted by slot. Most blocks have one or two
/// holders: inline storage avoids an allocation per indexed block, which
/// otherwise dominates ingest.
type Holders = smallvec::SmallVec<[Holder; 2]>;

/// Counters of what ingest did, for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IngestStats {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared: u64,
    /// Stores whose parent this slot never announced (dropped).
    pub orphan_events: u64,
    /// Events for other KV groups, sliding-window caches or remote blocks.
    pub skipped_events: u64,
    /// Unknown event tags.
    pub unknown_events: u64,
    /// Removals of blocks the index did not have.
    pub unknown_removals: u64,
    /// Slots dropped for exceeding the per-slot bound.
    pub overflows: u64,
}

/// Blocks stored unmatchable, per slot and reason (counted per tier
/// they enter, like `stored_blocks`).
pub type UnmatchableCounts = std::collections::BTreeMap<(u16, Unmatchable), u64>;

#[derive(Debug)]
pub struct Index {
    shards: Vec<FastMap<u64, Holders>>,
    dirty: Vec<u64>,
    slots: Vec<Slot>,
    max_blocks_per_slot: usize,
    pub stats: IngestStats,
    pub unmatchable: UnmatchableCounts,
    /// Prefix keys of the engines' cached text, for models with a
    /// vocabulary (`[models.prompt]`).
    text: Option<text::TextIndex>,
}

impl Index {
    pub fn new(shard_count: u32, max_blocks_per_slot: usize) -> Index {
        let n = shard_count.max(1) as usize;
        Index {
            shards: (0..n).map(|_| FastMap::default()).collect(),
            dirty: vec![0; n.div_ceil(64)],
            slots: Vec::new(),
            max_blocks_per_slot,
            stats: IngestStats::default(),
            unmatchable: UnmatchableCounts::new(),
            text: None,
        }
    }

    /// Starts the text index. The model's prompt files are read once, at
    /// start-up, before any event: a second call changes nothing.
    pub fn set_vocab(&mut self, vocab: Arc<Vocab>) {
        if self.text.is_none() {
            self.text = Some(text::TextIndex::new(vocab));
        }
    }

    /// Whether stored blocks' tokens are wanted (the text index is on).
    pub fn has_text(&self) -> bool {
        self.text.is_some()
    }

    /// The text index's changed shards, encoded: (shard, bytes).
    pub fn take_text_updates(&mut self) -> Vec<(u32, Vec<u8>)> {
        let Some(t) = self.text.as_mut() else {
            return Vec::new();
        };
        t.take_dirty()
            .into_iter()
            .map(|shard| (shard, t.encode_shard(shard)))
            .collect()
    }

    /// One text shard, encoded (what a reader holds after every update).
    #[cfg(test)]
    pub fn encode_text_shard(&self, shard: u32) -> Vec<u8> {
        self.text
            .as_ref()
            .map(|t| t.encode_shard(shard))
            .unwrap_or_default()
    }

    /// Distinct prefix keys and the skip counters of the text index.
    pub fn text_stats(&self) -> Option<(usize, text::TextStats)> {
        self.text.as_ref().map(|t| (t.len(), t.stats))
    }

    pub fn shard_count(&self) -> u32 {
        self.shards.len() as u32
    }

    /// Declares a slot (a worker's DP rank) with its block size.
    pub fn add_slot(&mut self, slot: u16, block_size: u32) {
        let i = slot as usize;
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, Slot::default);
        }
        let s = &mut self.slots[i];
        s.live = true;
        s.block_size = block_size;
    }

    /// Sizes a slot's tables for `blocks` entries up front (the engine's
    /// cache size is known from its metrics), so ingest does not pay for
    /// rehashing as the cache fills.
    pub fn reserve(&mut self, slot: u16, blocks: usize) {
        let per_shard = blocks.div_ceil(self.shards.len());
        if let Some(s) = self.slots.get_mut(slot as usize) {
            s.engine.reserve(blocks.saturating_sub(s.engine.len()));
        }
        for m in &mut self.shards {
            m.reserve(per_shard);
        }
    }

    /// Drops everything a slot holds and forgets it (worker removed).
    pub fn remove_slot(&mut self, slot: u16) {
        self.clear_slot(slot);
        // The slot number may go to another worker: its counts start over.
        self.unmatchable.retain(|&(s, _), _| s != slot);
        if let Some(s) = self.slots.get_mut(slot as usize) {
            s.live = false;
        }
    }

    /// The block size a slot was declared with (used when events omit it).
    pub fn block_size(&self, slot: u16) -> u32 {
        self.slots.get(slot as usize).map_or(0, |s| s.block_size)
    }

    /// Number of blocks (engine entries) a slot holds, all tiers.
    pub fn slot_len(&self, slot: u16) -> usize {
        self.slots
            .get(slot as usize)
            .map_or(0, |s| s.engine.len() + s.pages.len())
    }

    /// Distinct blocks in the index.
    pub fn len(&self) -> usize {
        self.shards.iter().map(FastMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies a staged batch from `slot`. Staging already decoded and
    /// hashed everything, so this cannot fail part-way.
    pub fn apply(&mut self, slot: u16, staged: &Staged) {
        for op in &staged.ops {
            if let Some(t) = self.text.as_mut()
                && let Some(stored) = text::Stored::of(op, staged)
            {
                t.store(slot, stored);
            }
            match op {
                Op::Stored {
                    engine,
                    local,
                    parent,
                    medium,
                    unmatchable_from,
                    ..
                } => self.store(
                    slot,
                    &staged.engine[engine.clone()],
                    &staged.local[local.clone()],
                    *parent,
                    *medium,
                    *unmatchable_from,
                ),
                Op::Pages {
                    engine,
                    tokens,
                    page_size,
                    parent,
                    medium,
                    seed,
                    salt,
                    unmatchable_from,
                    ..
                } => self.store_pages(
                    slot,
                    pages::Stored {
                        engine: &staged.engine[engine.clone()],
                        tokens: &staged.tokens[tokens.clone()],
                        page_size: *page_size as usize,
                        parent: *parent,
                        tier: tier_bit(*medium),
                        seed: *seed,
                        salt: salt.clone().map(|r| &staged.text[r]),
                        unmatchable_from: *unmatchable_from,
                    },
                ),
                Op::Removed { engine, medium } => {
                    let hashes = &staged.engine[engine.clone()];
                    if let Some(t) = self.text.as_mut() {
                        t.remove(slot, hashes, tier_bit(*medium));
                    }
                    self.remove(slot, hashes, tier_bit(*medium))
                }
                Op::Cleared => {
                    self.stats.cleared += 1;
                    self.clear_slot(slot);
                }
                Op::Skipped => self.stats.skipped_events += 1,
                Op::Unknown => self.stats.unknown_events += 1,
            }
        }
    }

    fn store(
        &mut self,
        slot: u16,
        engine: &[EngineHash],
        local: &[u64],
        parent: Option<EngineHash>,
        medium: Medium,
        unmatchable_from: Option<(usize, Unmatchable)>,
    ) {
        let Some(s) = self.slots.get(slot as usize).filter(|s| s.live) else {
            return;
        };
        let (mut parent, mut unmatchable) = match parent {
            None => (None, None),
            Some(p) => match s.engine.get(&p) {
                Some(&(seq, flags)) => (
                    Some(seq),
                    (flags & UNMATCHABLE != 0).then_some(Unmatchable::Parent),
                ),
                None => {
                    self.stats.orphan_events += 1;
                    return;
                }
            },
        };
        let tier = tier_bit(medium);
        for (i, (engine_hash, local)) in engine.iter().zip(local).enumerate() {
            if let Some((from, why)) = unmatchable_from
                && i == from
                && unmatchable.is_none()
            {
                unmatchable = Some(why);
            }
            let seq = chain(parent, *local);
            match unmatchable {
                None => self.hold(slot, *engine_hash, seq, tier),
                Some(why) => self.hold_unmatchable(slot, *engine_hash, seq, tier, why),
            }
            parent = Some(seq);
        }
        if self.slot_len(slot) > self.max_blocks_per_slot {
            self.stats.overflows += 1;
            self.clear_slot(slot);
        }
    }

    fn hold(&mut self, slot: u16, engine_hash: EngineHash, seq: u64, tier: u8) {
        let s = &mut self.slots[slot as usize];
        let entry = s.engine.entry(engine_hash).or_insert((seq, 0));
        if entry.0 != seq || entry.1 & UNMATCHABLE != 0 {
            // The engine reused a hash for different content (it restarted
            // without telling us): the old block is gone.
            let (old_seq, old_tiers) = *entry;
            *entry = (seq, 0);
            self.unhold_seq(slot, old_seq, old_tiers);
            let s = &mut self.slots[slot as usize];
            let e = s.engine.entry(engine_hash).or_insert((seq, 0));
            e.1 |= tier;
        } else if entry.1 & tier == 0 {
            entry.1 |= tier;
        } else {
            return; // already known in this tier
        }
        self.enter(slot, seq, tier);
    }

    /// Adds `slot` as a holder of block `seq` in `tier`.
    fn enter(&mut self, slot: u16, seq: u64, tier: u8) {
        self.stats.stored_blocks += 1;
        Self::add_holder(&mut self.shards, &mut self.dirty, slot, seq, tier);
    }

    fn add_holder(
        shards: &mut [FastMap<u64, Holders>],
        dirty: &mut [u64],
        slot: u16,
        seq: u64,
        tiers: u8,
    ) {
        let shard = shard::shard_of(seq, shards.len() as u32) as usize;
        let holders = shards[shard].entry(seq).or_default();
        match holders.binary_search_by_key(&slot, |h| h.slot) {
            Ok(i) => holders[i].tiers |= tiers,
            Err(i) => holders.insert(i, Holder { slot, tiers }),
        }
        dirty[shard / 64] |= 1 << (shard % 64);
    }

    /// Keeps a block the slot holds but no request can match: in the slot's
    /// table (for removals and children), never in the shards.
    fn hold_unmatchable(
        &mut self,
        slot: u16,
        engine_hash: EngineHash,
        seq: u64,
        tier: u8,
        why: Unmatchable,
    ) {
        let s = &mut self.slots[slot as usize];
        let entry = s.engine.entry(engine_hash).or_insert((seq, UNMATCHABLE));
        if entry.0 != seq || entry.1 & UNMATCHABLE == 0 {
            let (old_seq, old_tiers) = *entry;
            *entry = (seq, UNMATCHABLE | tier);
            self.unhold_seq(slot, old_seq, old_tiers);
        } else if entry.1 & tier == 0 {
            entry.1 |= tier;
        } else {
            return;
        }
        *self.unmatchable.entry((slot, why)).or_default() += 1;
    }

    fn remove(&mut self, slot: u16, hashes: &[EngineHash], tier: u8) {
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return;
        };
        for h in hashes {
            let Some(e) = s.engine.get_mut(h) else {
                match pages::remove(&mut s.pages, h, tier) {
                    None => self.stats.unknown_removals += 1,
                    Some(owned) => {
                        for seq in owned {
                            self.stats.removed_blocks += 1;
                            Self::unhold(&mut self.shards, &mut self.dirty, slot, seq, tier);
                        }
                    }
                }
                continue;
            };
            if e.1 & tier == 0 {
                self.stats.unknown_removals += 1;
                continue;
            }
            e.1 &= !tier;
            let (seq, flags) = *e;
            if flags & TIERS == 0 {
                s.engine.remove(h);
            }
            if flags & UNMATCHABLE != 0 {
                continue;
            }
            self.stats.removed_blocks += 1;
            Self::unhold(&mut self.shards, &mut self.dirty, slot, seq, tier);
        }
    }

    fn unhold_seq(&mut self, slot: u16, seq: u64, tiers: u8) {
        // An unmatchable entry never entered the shards; its sequence hash
        // may equal a matchable block's that the slot holds.
        if tiers & UNMATCHABLE != 0 || tiers & TIERS == 0 {
            return;
        }
        Self::unhold(&mut self.shards, &mut self.dirty, slot, seq, tiers);
    }

    fn unhold(
        shards: &mut [FastMap<u64, Holders>],
        dirty: &mut [u64],
        slot: u16,
        seq: u64,
        tiers: u8,
    ) {
        let shard = shard::shard_of(seq, shards.len() as u32) as usize;
        let map = &mut shards[shard];
        if let Some(holders) = map.get_mut(&seq)
            && let Ok(i) = holders.binary_search_by_key(&slot, |h| h.slot)
        {
            holders[i].tiers &= !tiers;
            if holders[i].tiers == 0 {
                holders.remove(i);
            }
            if holders.is_empty() {
                map.remove(&seq);
            }
            dirty[shard / 64] |= 1 << (shard % 64);
        }
    }

    /// Drops every block of `slot` (engine cleared, restarted, or lost sync).
    pub fn clear_slot(&mut self, slot: u16) {
        if let Some(t) = self.text.as_mut() {
            t.clear(slot);
        }
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return;
        };
        let entries = std::mem::take(&mut s.engine);
        let pages = std::mem::take(&mut s.pages);
        for (_, (seq, tiers)) in entries {
            if tiers & UNMATCHABLE != 0 {
                continue;
            }
            Self::unhold(&mut self.shards, &mut self.dirty, slot, seq, tiers);
        }
        for (seq, tiers) in pages.into_values().flat_map(pages::Page::owned) {
            Self::unhold(&mut self.shards, &mut self.dirty, slot, seq, tiers);
        }
    }

    /// Shards changed since the last call, and clears the marks.
    pub fn take_dirty(&mut self) -> Vec<u32> {
        take_dirty_bits(&mut self.dirty)
    }

    /// Encodes one shard in the filter's format.
    pub fn encode_shard(&self, shard: u32) -> Vec<u8> {
        self.shards
            .get(shard as usize)
            .map(encode_map)
            .unwrap_or_default()
    }

    /// Approximate heap bytes held, for the bytes-per-block figure.
    pub fn heap_bytes(&self) -> usize {
        let shard_bytes: usize = self
            .shards
            .iter()
            .map(|m| {
                m.capacity() * (8 + std::mem::size_of::<Holders>() + 1)
                    + m.values()
                        .filter(|h| h.spilled())
                        .map(|h| h.capacity() * std::mem::size_of::<Holder>())
                        .sum::<usize>()
            })
            .sum();
        let slot_bytes: usize = self
            .slots
            .iter()
            .map(|s| {
                s.engine.capacity() * (8 + 16 + 1)
                    + s.pages.values().map(pages::Page::heap_bytes).sum::<usize>()
            })
            .sum();
        shard_bytes + slot_bytes + self.text.as_ref().map_or(0, text::TextIndex::heap_bytes)
    }
}

/// One shard's map in the filter's format; empty when it holds nothing.
fn encode_map(map: &FastMap<u64, Holders>) -> Vec<u8> {
    if map.is_empty() {
        return Vec::new();
    }
    let mut entries: Vec<(u64, Vec<Holder>)> = map.iter().map(|(k, v)| (*k, v.to_vec())).collect();
    shard::encode(&mut entries)
}

/// The shards a dirty bitmap marks, clearing the marks.
fn take_dirty_bits(dirty: &mut [u64]) -> Vec<u32> {
    let mut out = Vec::new();
    for (w, word) in dirty.iter_mut().enumerate() {
        let mut bits = std::mem::take(word);
        while bits != 0 {
            let b = bits.trailing_zeros();
            out.push((w * 64) as u32 + b);
            bits &= bits - 1;
        }
    }
    out
}

mod pages;
mod recover;
#[cfg(test)]
mod tests;
mod text;

pub use recover::Restored;
pub use text::TextStats;
