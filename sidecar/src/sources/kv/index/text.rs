//! The text index: which ranks hold which prefix keys of rendered prompts
//! (`kvgate_core::text`), kept from the same KV events as the token index.
//!
//! Each stored block's tokens are decoded with the model's vocabulary and
//! fed into the prefix hash resumed from its parent's [`Cursor`]; the keys of the
//! chunk boundaries it passes belong to it, and go when it goes. Entries
//! are per slot and keyed by engine hash, like the engines' own tables, so
//! any page size works (SGLang's one-token pages included) and a removal
//! needs no lookup beyond its hash.

use super::{FastMap, Holders, Index, tier_bit};
use crate::prompt::Vocab;
use crate::sources::kv::stage::{Op, Staged};
use crate::sources::kv::wire::EngineHash;
use kvgate_core::text::{Cursor, SHARDS};
use smallvec::SmallVec;
use std::sync::Arc;

#[derive(Debug, Clone)]
struct Entry {
    /// Where the text stands after this block.
    cursor: Cursor,
    /// Keys of the chunk boundaries this block passed.
    keys: SmallVec<[u64; 1]>,
    tiers: u8,
}

/// Counters of what the text index skipped, for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TextStats {
    /// Blocks whose parent has no text entry (stored before this sidecar
    /// started, recovered from a dump, or unmatchable).
    pub orphans: u64,
    /// Blocks holding a token id the vocabulary lacks.
    pub undecodable: u64,
}

#[derive(Debug)]
pub(super) struct TextIndex {
    vocab: Arc<Vocab>,
    slots: Vec<FastMap<EngineHash, Entry>>,
    shards: Vec<FastMap<u64, Holders>>,
    dirty: Vec<u64>,
    bytes: Vec<u8>,
    keys: Vec<u64>,
    pub stats: TextStats,
}

/// One stored event's blocks, as the text index takes them.
pub(super) struct Stored<'a> {
    pub engine: &'a [EngineHash],
    pub tokens: &'a [u32],
    /// Tokens per engine block (the page size).
    pub per_block: usize,
    pub parent: Option<EngineHash>,
    /// Where a chain without a parent starts (its adapter and salt).
    pub root: Cursor,
    pub tier: u8,
    /// Blocks from here on are unmatchable: not keyed.
    pub matchable: usize,
}

impl<'a> Stored<'a> {
    /// The blocks a staged op stores, in engine blocks or pages.
    pub(super) fn of(op: &Op, staged: &'a Staged) -> Option<Stored<'a>> {
        let (engine, tokens, root, parent, medium, from) = match op {
            Op::Stored {
                engine,
                tokens,
                root,
                parent,
                medium,
                unmatchable_from,
                ..
            }
            | Op::Pages {
                engine,
                tokens,
                root,
                parent,
                medium,
                unmatchable_from,
                ..
            } => (engine, tokens, root, parent, medium, unmatchable_from),
            _ => return None,
        };
        let (engine, tokens) = (
            &staged.engine[engine.clone()],
            &staged.tokens[tokens.clone()],
        );
        Some(Stored {
            engine,
            tokens,
            per_block: tokens.len() / engine.len().max(1),
            parent: *parent,
            root: *root,
            tier: tier_bit(*medium),
            matchable: from.map_or(usize::MAX, |(i, _)| i),
        })
    }
}

impl TextIndex {
    pub(super) fn new(vocab: Arc<Vocab>) -> TextIndex {
        let n = SHARDS as usize;
        TextIndex {
            vocab,
            slots: Vec::new(),
            shards: (0..n).map(|_| FastMap::default()).collect(),
            dirty: vec![0; n.div_ceil(64)],
            bytes: Vec::new(),
            keys: Vec::new(),
            stats: TextStats::default(),
        }
    }

    fn slot(&mut self, slot: u16) -> &mut FastMap<EngineHash, Entry> {
        let i = slot as usize;
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, FastMap::default);
        }
        &mut self.slots[i]
    }

    pub(super) fn store(&mut self, slot: u16, s: Stored<'_>) {
        if s.per_block == 0 {
            return;
        }
        let mut cursor = match s.parent {
            None => s.root,
            Some(p) => match self.slot(slot).get(&p) {
                Some(e) => e.cursor,
                None => {
                    self.stats.orphans += 1;
                    return;
                }
            },
        };
        let blocks = s.engine.iter().zip(s.tokens.chunks_exact(s.per_block));
        for (h, toks) in blocks.take(s.matchable) {
            if let Some(e) = self.slot(slot).get_mut(h) {
                // Known (another tier, or a repeat): the same text.
                cursor = e.cursor;
                if e.tiers & s.tier == 0 {
                    e.tiers |= s.tier;
                    let keys = e.keys.clone();
                    for k in keys {
                        Index::add_holder(&mut self.shards, &mut self.dirty, slot, k, s.tier);
                    }
                }
                continue;
            }
            if !cursor.open() {
                return; // past the keyed bound: nothing below adds keys
            }
            self.bytes.clear();
            if !self.vocab.decode_into(toks, &mut self.bytes) {
                self.stats.undecodable += 1;
                return;
            }
            self.keys.clear();
            cursor.feed(&self.bytes, &mut self.keys);
            for &k in &self.keys {
                Index::add_holder(&mut self.shards, &mut self.dirty, slot, k, s.tier);
            }
            let entry = Entry {
                cursor,
                keys: SmallVec::from_slice(&self.keys),
                tiers: s.tier,
            };
            self.slot(slot).insert(*h, entry);
        }
    }

    pub(super) fn remove(&mut self, slot: u16, hashes: &[EngineHash], tier: u8) {
        let Some(map) = self.slots.get_mut(slot as usize) else {
            return;
        };
        for h in hashes {
            let Some(e) = map.get_mut(h) else { continue };
            if e.tiers & tier == 0 {
                continue;
            }
            e.tiers &= !tier;
            for &k in &e.keys {
                Index::unhold(&mut self.shards, &mut self.dirty, slot, k, tier);
            }
            if e.tiers == 0 {
                map.remove(h);
            }
        }
    }

    pub(super) fn clear(&mut self, slot: u16) {
        let Some(map) = self.slots.get_mut(slot as usize) else {
            return;
        };
        for (_, e) in std::mem::take(map) {
            for k in e.keys {
                Index::unhold(&mut self.shards, &mut self.dirty, slot, k, e.tiers);
            }
        }
    }

    pub(super) fn take_dirty(&mut self) -> Vec<u32> {
        super::take_dirty_bits(&mut self.dirty)
    }

    pub(super) fn encode_shard(&self, shard: u32) -> Vec<u8> {
        self.shards
            .get(shard as usize)
            .map(super::encode_map)
            .unwrap_or_default()
    }

    /// Distinct keys held.
    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(FastMap::len).sum()
    }

    pub(super) fn heap_bytes(&self) -> usize {
        let entries: usize = self
            .slots
            .iter()
            .map(|m| m.capacity() * (8 + std::mem::size_of::<Entry>() + 1))
            .sum();
        let shards: usize = self
            .shards
            .iter()
            .map(|m| m.capacity() * (8 + std::mem::size_of::<Holders>() + 1))
            .sum();
        entries + shards + self.vocab.heap_bytes()
    }
}
