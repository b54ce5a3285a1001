//! A slot's blocks out (for `GET /dump`) and a peer's blocks in (startup
//! recovery): the slot's table by engine hash, which is what later events
//! resolve against, and the shards rebuilt from it.

use super::{FastMap, Index, TIERS, UNMATCHABLE};
use crate::sources::kv::dump::Block;
use std::collections::hash_map::Entry;

/// What replaying a peer's blocks into one slot did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Restored {
    /// Blocks entered in the slot's table (and, when matchable, the shards).
    pub blocks: u64,
    /// Blocks whose engine hash the slot already held: a live event got
    /// there first, or the dump named it twice. The slot's own entry wins.
    pub known: u64,
    /// Blocks refused because the slot would exceed its bound.
    pub over_bound: u64,
}

impl Index {
    /// Every block `slot` holds by engine hash. Re-chunked pages are left
    /// out (see `sources::kv::dump`); [`Index::pages_len`] counts them.
    pub fn blocks(&self, slot: u16) -> Vec<Block> {
        let Some(s) = self.slots.get(slot as usize).filter(|s| s.live) else {
            return Vec::new();
        };
        s.engine
            .iter()
            .filter(|(_, (_, flags))| flags & TIERS != 0)
            .map(|(&engine, &(seq, flags))| Block {
                engine,
                seq,
                tiers: flags & TIERS,
                unmatchable: flags & UNMATCHABLE != 0,
            })
            .collect()
    }

    /// Pages of re-chunked chains a slot holds (not in [`Index::blocks`]).
    pub fn pages_len(&self, slot: u16) -> usize {
        self.slots.get(slot as usize).map_or(0, |s| s.pages.len())
    }

    /// Replays blocks a peer dumped for this slot's rank, as if their
    /// stores had been seen live: a later removal by engine hash, or a
    /// child naming one as its parent, finds it. `None` when the slot is
    /// not declared. A slot the blocks would take past its bound takes
    /// none of them: those blocks were never all in one engine's cache.
    pub fn restore(&mut self, slot: u16, blocks: &[Block]) -> Option<Restored> {
        let held = self
            .slots
            .get(slot as usize)
            .filter(|s| s.live)?
            .engine
            .len()
            + self.pages_len(slot);
        let mut done = Restored::default();
        if held + blocks.len() > self.max_blocks_per_slot {
            done.over_bound = blocks.len() as u64;
            return Some(done);
        }
        self.reserve(slot, held + blocks.len());
        let Index {
            slots,
            shards,
            dirty,
            ..
        } = self;
        let table: &mut FastMap<_, _> = &mut slots.get_mut(slot as usize)?.engine;
        for b in blocks {
            let Entry::Vacant(e) = table.entry(b.engine) else {
                done.known += 1;
                continue;
            };
            let flags = b.tiers & TIERS;
            if flags == 0 {
                // The decoder refuses such a block; a table entry with no
                // tier would never be removed.
                continue;
            }
            e.insert((b.seq, flags | if b.unmatchable { UNMATCHABLE } else { 0 }));
            done.blocks += 1;
            if !b.unmatchable {
                Index::add_holder(shards, dirty, slot, b.seq, flags);
            }
        }
        Some(done)
    }
}

/// The shards' holder lists, for tests comparing two indexes.
#[cfg(test)]
pub(super) fn holders(idx: &Index) -> Vec<Vec<(u64, Vec<kvgate_core::shard::Holder>)>> {
    idx.shards
        .iter()
        .map(|m: &FastMap<u64, super::Holders>| {
            let mut v: Vec<_> = m.iter().map(|(k, h)| (*k, h.to_vec())).collect();
            v.sort_by_key(|(k, _)| *k);
            v
        })
        .collect()
}

#[cfg(test)]
mod tests;
