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

use crate::sources::kv::stage::{Op, Staged};
use crate::sources::kv::wire::{EngineHash, Medium, Unmatchable};
use kvgate_core::hash::chain;
use kvgate_core::shard::{self, Holder, TIER_DEVICE, TIER_DISK, TIER_HOST};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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
        }
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
        self.slots.get(slot as usize).map_or(0, |s| s.engine.len())
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
            match op {
                Op::Stored {
                    engine,
                    local,
                    parent,
                    medium,
                    unmatchable_from,
                } => self.store(
                    slot,
                    &staged.engine[engine.clone()],
                    &staged.local[local.clone()],
                    *parent,
                    *medium,
                    *unmatchable_from,
                ),
                Op::Removed { engine, medium } => {
                    self.remove(slot, &staged.engine[engine.clone()], tier_bit(*medium))
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
        self.stats.stored_blocks += 1;
        let shard = shard::shard_of(seq, self.shards.len() as u32) as usize;
        let holders = self.shards[shard].entry(seq).or_default();
        match holders.binary_search_by_key(&slot, |h| h.slot) {
            Ok(i) => holders[i].tiers |= tier,
            Err(i) => holders.insert(i, Holder { slot, tiers: tier }),
        }
        self.mark(shard);
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
                self.stats.unknown_removals += 1;
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
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return;
        };
        let entries = std::mem::take(&mut s.engine);
        for (_, (seq, tiers)) in entries {
            if tiers & UNMATCHABLE != 0 {
                continue;
            }
            Self::unhold(&mut self.shards, &mut self.dirty, slot, seq, tiers);
        }
    }

    fn mark(&mut self, shard: usize) {
        self.dirty[shard / 64] |= 1 << (shard % 64);
    }

    /// Shards changed since the last call, and clears the marks.
    pub fn take_dirty(&mut self) -> Vec<u32> {
        let mut out = Vec::new();
        for (w, word) in self.dirty.iter_mut().enumerate() {
            let mut bits = std::mem::take(word);
            while bits != 0 {
                let b = bits.trailing_zeros();
                out.push((w * 64) as u32 + b);
                bits &= bits - 1;
            }
        }
        out
    }

    /// Encodes one shard in the filter's format.
    pub fn encode_shard(&self, shard: u32) -> Vec<u8> {
        let Some(map) = self.shards.get(shard as usize) else {
            return Vec::new();
        };
        if map.is_empty() {
            return Vec::new();
        }
        let mut entries: Vec<(u64, Vec<Holder>)> =
            map.iter().map(|(k, v)| (*k, v.to_vec())).collect();
        shard::encode(&mut entries)
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
            .map(|s| s.engine.capacity() * (8 + 16 + 1))
            .sum();
        shard_bytes + slot_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::hash::{CacheScope, scoped_sequence_hashes};
    use kvgate_core::shard::{ShardView, SlotOverlap, overlaps};
    use rmpv::Value;

    fn v<T: Into<Value>>(x: T) -> Value {
        x.into()
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: &str) -> Value {
        Value::Map(vec![
            (v("type"), v("BlockStored")),
            (
                v("block_hashes"),
                Value::Array(hashes.iter().map(|h| v(*h)).collect()),
            ),
            (v("parent_block_hash"), parent.map_or(Value::Nil, v)),
            (
                v("token_ids"),
                Value::Array(tokens.iter().map(|t| v(*t)).collect()),
            ),
            (v("block_size"), v(4)),
            (v("lora_id"), Value::Nil),
            (v("medium"), v(medium)),
            (v("lora_name"), Value::Nil),
        ])
    }

    fn with(mut ev: Value, key: &str, val: Value) -> Value {
        if let Value::Map(m) = &mut ev {
            m.push((v(key), val));
        }
        ev
    }

    fn removed(hashes: &[u64], medium: &str) -> Value {
        Value::Map(vec![
            (v("type"), v("BlockRemoved")),
            (
                v("block_hashes"),
                Value::Array(hashes.iter().map(|h| v(*h)).collect()),
            ),
            (v("medium"), v(medium)),
        ])
    }

    fn cleared() -> Value {
        Value::Map(vec![(v("type"), v("AllBlocksCleared"))])
    }

    fn apply(idx: &mut Index, slot: u16, events: Vec<Value>) {
        let batch = Value::Array(vec![v(1.0f64), Value::Array(events), v(0)]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &batch).unwrap();
        let mut st = Staged::default();
        st.stage(&buf, idx.block_size(slot)).unwrap();
        idx.apply(slot, &st);
    }

    /// Overlap of `tokens` per slot, read back through encoded shards the
    /// way the filter does.
    fn overlap_via_shards(idx: &Index, tokens: &[u32], slots: usize) -> Vec<SlotOverlap> {
        scoped_overlap(idx, tokens, slots, CacheScope::default())
    }

    /// The same for a request naming an adapter or a salt.
    fn scoped_overlap(
        idx: &Index,
        tokens: &[u32],
        slots: usize,
        scope: CacheScope<'_>,
    ) -> Vec<SlotOverlap> {
        let shards: Vec<Vec<u8>> = (0..idx.shard_count())
            .map(|s| idx.encode_shard(s))
            .collect();
        let seq = scoped_sequence_hashes(tokens, 4, scope);
        let mut out = vec![SlotOverlap::default(); slots];
        overlaps(
            seq.len(),
            |i, hs| {
                let s = shard::shard_of(seq[i], shards.len() as u32) as usize;
                hs.extend(ShardView::parse(&shards[s]).unwrap().holders(seq[i]));
            },
            &mut out,
        );
        out
    }

    fn index(slots: u16, max: usize) -> Index {
        let mut idx = Index::new(8, max);
        for s in 0..slots {
            idx.add_slot(s, 4);
        }
        idx
    }

    #[test]
    fn stored_chains_are_found_by_request_hashes() {
        let mut idx = index(2, 1000);
        let toks: Vec<u32> = (1..=12).collect();
        apply(
            &mut idx,
            0,
            vec![
                stored(&[100, 101], None, &toks[..8], "GPU"),
                stored(&[102], Some(101), &toks[8..], "GPU"),
            ],
        );
        apply(&mut idx, 1, vec![stored(&[7], None, &toks[..4], "GPU")]);
        assert_eq!(idx.len(), 3);
        let o = overlap_via_shards(&idx, &toks, 2);
        assert_eq!((o[0].device, o[1].device), (3, 1));
        let mut other = toks.clone();
        other[9] = 999;
        assert_eq!(
            overlap_via_shards(&idx, &other, 2)[0].device,
            2,
            "only the shared blocks match"
        );
    }

    #[test]
    fn removal_and_tiers() {
        let mut idx = index(1, 1000);
        let toks: Vec<u32> = (1..=8).collect();
        apply(
            &mut idx,
            0,
            vec![
                stored(&[1, 2], None, &toks, "GPU"),
                stored(&[1, 2], None, &toks, "CPU"),
            ],
        );
        apply(&mut idx, 0, vec![removed(&[2], "GPU")]);
        let o = overlap_via_shards(&idx, &toks, 1)[0];
        assert_eq!(
            (o.device, o.host),
            (1, 2),
            "block 2 left the GPU but stays on host"
        );
        apply(
            &mut idx,
            0,
            vec![removed(&[1, 2], "CPU"), removed(&[1], "GPU")],
        );
        assert!(idx.is_empty());
        assert_eq!(idx.slot_len(0), 0);
        apply(&mut idx, 0, vec![removed(&[42], "GPU")]);
        assert_eq!(idx.stats.unknown_removals, 1);
    }

    #[test]
    fn cleared_drops_only_that_slot() {
        let mut idx = index(2, 1000);
        let toks: Vec<u32> = (1..=8).collect();
        apply(&mut idx, 0, vec![stored(&[1, 2], None, &toks, "GPU")]);
        apply(&mut idx, 1, vec![stored(&[5, 6], None, &toks, "GPU")]);
        idx.take_dirty();
        apply(&mut idx, 0, vec![cleared()]);
        let o = overlap_via_shards(&idx, &toks, 2);
        assert_eq!((o[0].device, o[1].device), (0, 2));
        assert!(!idx.take_dirty().is_empty(), "clearing marks shards dirty");
    }

    #[test]
    fn orphans_partial_blocks_and_other_groups_are_not_indexed() {
        let mut idx = index(1, 1000);
        apply(
            &mut idx,
            0,
            vec![stored(&[9], Some(12345), &[1, 2, 3, 4], "GPU")],
        );
        assert_eq!(idx.stats.orphan_events, 1);
        // Two hashes but one full block of tokens: one block indexed.
        apply(
            &mut idx,
            0,
            vec![stored(&[1, 2], None, &[1, 2, 3, 4, 5, 6], "GPU")],
        );
        assert_eq!(idx.len(), 1);
        apply(
            &mut idx,
            0,
            vec![
                with(stored(&[3], None, &[9, 9, 9, 9], "GPU"), "group_idx", v(1)),
                with(
                    stored(&[4], None, &[8, 8, 8, 8], "GPU"),
                    "kv_cache_spec_kind",
                    v("sliding_window"),
                ),
                with(
                    stored(&[5], None, &[7, 7, 7, 7], "GPU"),
                    "locality",
                    v("REMOTE"),
                ),
            ],
        );
        assert_eq!(idx.len(), 1);
        assert_eq!(idx.stats.skipped_events, 3);
        apply(&mut idx, 7, vec![stored(&[1], None, &[1, 2, 3, 4], "GPU")]);
        assert_eq!(idx.len(), 1, "events for unknown slots are ignored");
    }

    #[test]
    fn lora_blocks_do_not_match_base_model_requests() {
        let mut idx = index(1, 1000);
        let toks = [1, 2, 3, 4];
        apply(
            &mut idx,
            0,
            vec![with(
                stored(&[1], None, &toks, "GPU"),
                "lora_name",
                v("adapter"),
            )],
        );
        assert_eq!(idx.len(), 1);
        assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 0);
        assert_eq!(scoped_overlap(&idx, &toks, 1, lora("adapter"))[0].device, 1);
        assert_eq!(scoped_overlap(&idx, &toks, 1, lora("other"))[0].device, 0);
    }

    fn lora(name: &str) -> CacheScope<'_> {
        CacheScope {
            lora_name: Some(name),
            cache_salt: None,
        }
    }

    fn key(kind: &str, field: &str, value: Value) -> Value {
        Value::Map(vec![(v("type"), v(kind)), (v(field), value)])
    }

    fn extra(blocks: Vec<Option<Vec<Value>>>) -> Value {
        Value::Array(
            blocks
                .into_iter()
                .map(|b| b.map_or(Value::Nil, Value::Array))
                .collect(),
        )
    }

    #[test]
    fn vllm_extra_keys_scope_blocks_by_adapter_and_salt() {
        let mut idx = index(2, 1000);
        let toks: Vec<u32> = (1..=12).collect();
        let adapter = || key("lora", "name", v("sql-lora"));
        let salted = with(
            with(
                stored(&[1, 2, 3], None, &toks, "GPU"),
                "lora_name",
                v("sql-lora"),
            ),
            "extra_keys",
            extra(vec![
                Some(vec![adapter(), key("cache_salt", "salt", v("s1"))]),
                Some(vec![adapter()]),
                Some(vec![adapter()]),
            ]),
        );
        // `with` appends, and a map keeps its first `lora_name`: drop the
        // nil one the base event carries.
        let salted = match salted {
            Value::Map(m) => Value::Map(
                m.into_iter()
                    .filter(|(k, val)| !(k.as_str() == Some("lora_name") && val.is_nil()))
                    .collect(),
            ),
            other => other,
        };
        apply(&mut idx, 0, vec![salted]);
        // The adapter named only in extra keys, on slot 1, unsalted.
        apply(
            &mut idx,
            1,
            vec![with(
                stored(&[7, 8], None, &toks[..8], "GPU"),
                "extra_keys",
                extra(vec![Some(vec![adapter()]), Some(vec![adapter()])]),
            )],
        );
        let both = CacheScope {
            lora_name: Some("sql-lora"),
            cache_salt: Some("s1"),
        };
        let o = scoped_overlap(&idx, &toks, 2, both);
        assert_eq!((o[0].device, o[1].device), (3, 0));
        let o = scoped_overlap(&idx, &toks, 2, lora("sql-lora"));
        assert_eq!(
            (o[0].device, o[1].device),
            (0, 2),
            "an unsalted request never matches salted blocks"
        );
        let o = overlap_via_shards(&idx, &toks, 2);
        assert_eq!((o[0].device, o[1].device), (0, 0));
        assert!(idx.unmatchable.is_empty());
    }

    #[test]
    fn sglang_salt_scopes_the_whole_chain() {
        let mut idx = index(1, 1000);
        let toks: Vec<u32> = (1..=8).collect();
        let salted = |ev| with(ev, "cache_salt", v("tenant-x"));
        apply(
            &mut idx,
            0,
            vec![
                salted(stored(&[1], None, &toks[..4], "GPU")),
                // SGLang repeats the salt on every page; the chain already
                // carries it, so a child's salt adds nothing.
                salted(stored(&[2], Some(1), &toks[4..], "GPU")),
            ],
        );
        let scope = CacheScope {
            lora_name: None,
            cache_salt: Some("tenant-x"),
        };
        assert_eq!(scoped_overlap(&idx, &toks, 1, scope)[0].device, 2);
        assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 0);
        let other = CacheScope {
            cache_salt: Some("tenant-y"),
            ..scope
        };
        assert_eq!(scoped_overlap(&idx, &toks, 1, other)[0].device, 0);
    }

    #[test]
    fn blocks_with_extra_keys_kvgate_cannot_compute_never_match() {
        let mut idx = index(1, 1000);
        let toks: Vec<u32> = (1..=12).collect();
        let mm = key("mm", "hash", v("img-1"));
        apply(
            &mut idx,
            0,
            vec![
                // Block 0 is text; the image starts in block 1.
                with(
                    stored(&[1, 2], None, &toks[..8], "GPU"),
                    "extra_keys",
                    extra(vec![None, Some(vec![mm])]),
                ),
                stored(&[3], Some(2), &toks[8..], "GPU"),
            ],
        );
        assert_eq!(
            overlap_via_shards(&idx, &toks, 1)[0].device,
            1,
            "only the text block before the image matches"
        );
        assert_eq!(idx.len(), 1);
        assert_eq!(idx.slot_len(0), 3, "the slot still knows all three");
        assert_eq!(idx.unmatchable.get(&(0, Unmatchable::Multimodal)), Some(&1));
        assert_eq!(idx.unmatchable.get(&(0, Unmatchable::Parent)), Some(&1));
        // Removing unmatchable blocks is no unknown removal, and leaves the
        // matchable one alone.
        apply(&mut idx, 0, vec![removed(&[3, 2], "GPU")]);
        assert_eq!((idx.stats.unknown_removals, idx.slot_len(0)), (0, 1));
        assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 1);

        let others = [
            (
                with(stored(&[10], None, &[5, 5, 5, 5], "GPU"), "lora_id", v(3)),
                Unmatchable::LoraIdWithoutName,
            ),
            (
                with(
                    stored(&[11], None, &[6, 6, 6, 6], "GPU"),
                    "extra_keys",
                    extra(vec![Some(vec![v("opaque")])]),
                ),
                Unmatchable::LegacyExtraKeys,
            ),
            (
                with(
                    stored(&[12], None, &[7, 7, 7, 7], "GPU"),
                    "extra_keys",
                    extra(vec![Some(vec![key("prompt_embeds", "hash", v("e"))])]),
                ),
                Unmatchable::PromptEmbeds,
            ),
            (
                with(
                    stored(&[13], None, &[8, 8, 8, 8], "GPU"),
                    "extra_keys",
                    extra(vec![Some(vec![key("novel", "x", v(1))])]),
                ),
                Unmatchable::UnknownExtraKey,
            ),
        ];
        for (ev, why) in others {
            apply(&mut idx, 0, vec![ev]);
            assert_eq!(idx.unmatchable.get(&(0, why)), Some(&1), "{why:?}");
        }
        for t in [5, 6, 7, 8] {
            assert_eq!(overlap_via_shards(&idx, &[t; 4], 1)[0].device, 0);
        }
        assert_eq!(idx.len(), 1);
        // An old vLLM's untyped key that is just the adapter's name is fine.
        apply(
            &mut idx,
            0,
            vec![with(
                with(stored(&[14], None, &[9, 9, 9, 9], "GPU"), "lora_id", v(1)),
                "extra_keys",
                extra(vec![Some(vec![v("a")])]),
            )],
        );
        assert_eq!(idx.len(), 1, "a lora_id without a name stays unmatchable");
        // Clearing the slot drops unmatchable entries too.
        apply(&mut idx, 0, vec![cleared()]);
        assert_eq!((idx.len(), idx.slot_len(0)), (0, 0));
    }

    #[test]
    fn a_flooding_slot_is_bounded() {
        let mut idx = index(1, 10);
        for i in 0..20u32 {
            apply(
                &mut idx,
                0,
                vec![stored(&[i as u64], None, &[i, i, i, i], "GPU")],
            );
        }
        assert!(idx.slot_len(0) <= 10);
        assert_eq!(idx.stats.overflows, 1);
    }

    #[test]
    fn reused_engine_hash_replaces_the_old_block() {
        let mut idx = index(1, 1000);
        apply(&mut idx, 0, vec![stored(&[1], None, &[1, 2, 3, 4], "GPU")]);
        apply(&mut idx, 0, vec![stored(&[1], None, &[5, 6, 7, 8], "GPU")]);
        assert_eq!(idx.len(), 1);
        assert_eq!(overlap_via_shards(&idx, &[1, 2, 3, 4], 1)[0].device, 0);
        assert_eq!(overlap_via_shards(&idx, &[5, 6, 7, 8], 1)[0].device, 1);
    }

    #[test]
    fn a_malformed_batch_changes_nothing() {
        let idx = index(1, 1000);
        let good = stored(&[1], None, &[1, 2, 3, 4], "GPU");
        let bad = Value::Map(vec![(v("type"), v("BlockStored"))]);
        let batch = Value::Array(vec![v(1.0f64), Value::Array(vec![good, bad]), v(0)]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &batch).unwrap();
        let mut st = Staged::default();
        assert!(st.stage(&buf, 4).is_err());
        assert!(
            idx.is_empty(),
            "nothing applied from a batch that failed to stage"
        );
    }
}
