//! Re-chunking: chains an engine stores in pages of another size than the
//! worker's block size (SGLang's default page size is 1 token).
//!
//! Requests are hashed in blocks of the worker's `block_size`, so the index
//! must hold blocks of that size whatever the engine's page. Each page's
//! tokens are appended to where its parent's chain stands (the last whole
//! block and the tokens since); every block that fills is hashed and
//! entered, and belongs to the page that completed it. Engines evict leaves
//! first, so by the time a page goes, every page after it in its chain has
//! gone: removing a page removes the blocks it completed, and a block is
//! never left entered after any of its pages has gone.

use super::{Index, UNMATCHABLE};
use crate::sources::kv::wire::{EngineHash, Unmatchable};
use kvgate_core::hash::{block_hash_with_seed, chain, salted_root};
use smallvec::SmallVec;

/// Where a chain stands after a page.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Chain {
    /// Sequence hash of the last whole block; `None` before the first.
    base: Option<u64>,
    /// Tokens since `base`, fewer than a block.
    tail: Vec<u32>,
    /// The adapter's hash seed.
    seed: u64,
    /// The salt of the chain's first block, until that block is whole.
    salt: Option<Box<str>>,
    /// Set from the first page no request can match.
    unmatchable: Option<Unmatchable>,
}

/// One page of a re-chunked chain.
#[derive(Debug, Clone)]
pub(super) struct Page {
    chain: Chain,
    /// Blocks this page completed, which go when it goes.
    completes: SmallVec<[u64; 1]>,
    tiers: u8,
}

impl Page {
    /// The blocks this page holds in the shards, with their tiers.
    pub(super) fn owned(self) -> impl Iterator<Item = (u64, u8)> {
        let tiers = if self.chain.unmatchable.is_some() {
            0
        } else {
            self.tiers
        };
        self.completes
            .into_iter()
            .filter(move |_| tiers != 0)
            .map(move |seq| (seq, tiers))
    }

    pub(super) fn heap_bytes(&self) -> usize {
        8 + std::mem::size_of::<Page>() + self.chain.tail.capacity() * 4
    }
}

/// A stored event's pages, as staged.
pub(super) struct Stored<'a> {
    pub engine: &'a [EngineHash],
    pub tokens: &'a [u32],
    pub page_size: usize,
    pub parent: Option<EngineHash>,
    pub tier: u8,
    pub seed: u64,
    pub salt: Option<&'a str>,
    pub unmatchable_from: Option<(usize, Unmatchable)>,
}

/// Drops `tier` from a page. `None` when the slot has no such page in that
/// tier; else the blocks to take out of the shards in that tier.
pub(super) fn remove(
    pages: &mut super::FastMap<EngineHash, Page>,
    h: &EngineHash,
    tier: u8,
) -> Option<SmallVec<[u64; 1]>> {
    let page = pages.get_mut(h)?;
    if page.tiers & tier == 0 {
        return None;
    }
    page.tiers &= !tier;
    let owned = if page.chain.unmatchable.is_some() {
        SmallVec::new()
    } else {
        page.completes.clone()
    };
    if page.tiers == 0 {
        pages.remove(h);
    }
    Some(owned)
}

impl Index {
    pub(super) fn store_pages(&mut self, slot: u16, ev: Stored<'_>) {
        let Some(s) = self.slots.get(slot as usize).filter(|s| s.live) else {
            return;
        };
        let block = s.block_size as usize;
        if block == 0 || ev.page_size == 0 {
            return;
        }
        let mut at = match ev.parent {
            None => Chain {
                base: None,
                tail: Vec::new(),
                seed: ev.seed,
                salt: ev.salt.map(Into::into),
                unmatchable: None,
            },
            Some(p) => match (s.pages.get(&p), s.engine.get(&p)) {
                (Some(page), _) => page.chain.clone(),
                // A parent stored at the worker's own size ends on a block
                // boundary.
                (None, Some(&(seq, flags))) => Chain {
                    base: Some(seq),
                    tail: Vec::new(),
                    seed: ev.seed,
                    salt: None,
                    unmatchable: (flags & UNMATCHABLE != 0).then_some(Unmatchable::Parent),
                },
                (None, None) => {
                    self.stats.orphan_events += 1;
                    return;
                }
            },
        };
        for (i, (h, toks)) in ev
            .engine
            .iter()
            .zip(ev.tokens.chunks_exact(ev.page_size))
            .enumerate()
        {
            if let Some((from, why)) = ev.unmatchable_from
                && i >= from
                && at.unmatchable.is_none()
            {
                at.unmatchable = Some(why);
            }
            let mut completes = SmallVec::new();
            at.tail.extend_from_slice(toks);
            while at.tail.len() >= block {
                let mut local = block_hash_with_seed(&at.tail[..block], at.seed);
                if at.base.is_none()
                    && let Some(salt) = at.salt.take()
                {
                    local = salted_root(local, &salt);
                }
                let seq = chain(at.base, local);
                completes.push(seq);
                at.base = Some(seq);
                at.tail.drain(..block);
            }
            self.hold_page(slot, *h, &at, completes, ev.tier);
        }
        if self.slot_len(slot) > self.max_blocks_per_slot {
            self.stats.overflows += 1;
            self.clear_slot(slot);
        }
    }

    /// Records page `h` with the chain as it stands after it, and enters the
    /// blocks it completed in `tier`.
    fn hold_page(
        &mut self,
        slot: u16,
        h: EngineHash,
        at: &Chain,
        completes: SmallVec<[u64; 1]>,
        tier: u8,
    ) {
        let s = &mut self.slots[slot as usize];
        let replaced = match s.pages.get_mut(&h) {
            Some(page) if page.chain == *at && page.completes == completes => {
                if page.tiers & tier != 0 {
                    return; // already known in this tier
                }
                page.tiers |= tier;
                None
            }
            // The engine reused a hash for other content (it restarted
            // without telling us): the old page's blocks are gone.
            Some(page) => Some(std::mem::replace(
                page,
                Page {
                    chain: at.clone(),
                    completes: completes.clone(),
                    tiers: tier,
                },
            )),
            None => {
                s.pages.insert(
                    h,
                    Page {
                        chain: at.clone(),
                        completes: completes.clone(),
                        tiers: tier,
                    },
                );
                None
            }
        };
        if let Some(old) = replaced {
            for (seq, tiers) in old.owned() {
                Self::unhold(&mut self.shards, &mut self.dirty, slot, seq, tiers);
            }
        }
        match at.unmatchable {
            None => {
                for seq in completes {
                    self.enter(slot, seq, tier);
                }
            }
            Some(why) => {
                *self.unmatchable.entry((slot, why)).or_default() += completes.len() as u64;
            }
        }
    }
}
