//! The simulated engine's prefix cache: a fixed number of KV blocks, keyed
//! by a chained engine hash, with LRU eviction of blocks no request uses.
//!
//! Like vLLM's, a block is identified by its parent's hash and its own
//! tokens, so equal prefixes share blocks. Blocks used by running requests
//! are pinned. When space is needed the least recently used unpinned block
//! goes first; a request touches its whole chain at once, so a parent is
//! never less recently used than its children, and among blocks touched at
//! the same moment the deepest goes first — eviction therefore always takes
//! leaves before parents, and a cached block's prefix is always cached too.
//!
//! The engine hash is this simulator's own (XXH3 with a different seed over
//! the parent hash and the tokens); kvgate must treat it as opaque, exactly
//! as it treats vLLM's SHA-256 or SGLang's hashes.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use xxhash_rust::xxh3::xxh3_64_with_seed;

const ENGINE_SEED: u64 = 0x5EED_0F51_5151;

/// The engine hash of a block given its parent's.
pub fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(8 + tokens.len() * 4);
    bytes.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, ENGINE_SEED)
}

#[derive(Debug, Clone)]
struct Block {
    depth: u32,
    parent: Option<u64>,
    children: u32,
    pins: u32,
    last_used: u64,
}

/// What besides its tokens a request's blocks are keyed by, as in vLLM:
/// the LoRA adapter it names and its `cache_salt`. Requests of different
/// scopes never share blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
}

impl Scope {
    /// The seed the scope puts under a chain's first block.
    fn root(&self) -> Option<u64> {
        if self.lora_name.is_none() && self.cache_salt.is_none() {
            return None;
        }
        let mut bytes = Vec::new();
        for part in [&self.lora_name, &self.cache_salt] {
            let part = part.as_deref().unwrap_or_default();
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part.as_bytes());
        }
        Some(xxh3_64_with_seed(&bytes, ENGINE_SEED))
    }
}

/// A change to report as a KV event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        /// The adapter, and the salt when the blocks start the chain (vLLM
        /// names the salt on a sequence's first block only).
        scope: Scope,
    },
    Removed {
        hashes: Vec<u64>,
    },
}

/// What a request holds while it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Prompt blocks, pinned, in chain order.
    pub blocks: Vec<u64>,
    /// Leading blocks that were already cached.
    pub cached_blocks: usize,
    /// Blocks reserved for output (not cached, not reported).
    pub decode_blocks: usize,
}

#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    capacity: usize,
    blocks: HashMap<u64, Block>,
    /// Unpinned blocks in eviction order.
    evictable: BTreeSet<(u64, Reverse<u32>, u64)>,
    /// Output blocks held by running requests.
    decode_used: usize,
    clock: u64,
}

impl PrefixCache {
    pub fn new(block_size: usize, capacity: usize) -> Self {
        PrefixCache {
            block_size: block_size.max(1),
            capacity,
            blocks: HashMap::new(),
            evictable: BTreeSet::new(),
            decode_used: 0,
            clock: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks holding cached prompt content (pinned or not).
    pub fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks in use by running requests: what vLLM reports as KV usage.
    pub fn used_blocks(&self) -> usize {
        self.blocks.len() - self.evictable.len() + self.decode_used
    }

    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.used_blocks() as f64 / self.capacity as f64
        }
    }

    /// Engine hashes of the full blocks of `tokens` in `scope`, chained.
    pub fn chain(&self, tokens: &[u32], scope: &Scope) -> Vec<u64> {
        let mut parent = scope.root();
        tokens
            .chunks_exact(self.block_size)
            .map(|b| {
                let h = engine_hash(parent, b);
                parent = Some(h);
                h
            })
            .collect()
    }

    /// Leading blocks of `chain` already cached.
    pub fn matched(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Whether `new_blocks + decode_blocks` fit after evicting what can be.
    pub fn fits(&self, new_blocks: usize, decode_blocks: usize) -> bool {
        let free = self
            .capacity
            .saturating_sub(self.blocks.len() + self.decode_used);
        free + self.evictable.len() >= new_blocks + decode_blocks
    }

    /// Pins the request's prompt blocks (caching the missing ones, evicting
    /// if needed) and reserves its output blocks. Returns `None` when it
    /// cannot fit; the caller waits and retries.
    pub fn allocate(
        &mut self,
        tokens: &[u32],
        scope: &Scope,
        chain: &[u64],
        decode_blocks: usize,
        events: &mut Vec<CacheEvent>,
    ) -> Option<Allocation> {
        let matched = self.matched(chain);
        let new = chain.len() - matched;
        if !self.fits(new, decode_blocks) {
            return None;
        }
        self.clock += 1;
        let now = self.clock;
        for h in &chain[..matched] {
            self.pin(*h, now);
        }
        let mut stored = Vec::new();
        let mut parent = matched.checked_sub(1).map(|i| chain[i]);
        let first_parent = parent;
        for (i, h) in chain.iter().enumerate().skip(matched) {
            while self.blocks.len() + self.decode_used >= self.capacity {
                match self.evict_one() {
                    Some(gone) => events.push(CacheEvent::Removed { hashes: vec![gone] }),
                    None => break,
                }
            }
            self.blocks.insert(
                *h,
                Block {
                    depth: i as u32,
                    parent,
                    children: 0,
                    pins: 1,
                    last_used: now,
                },
            );
            if let Some(p) = parent.and_then(|p| self.blocks.get_mut(&p)) {
                p.children += 1;
            }
            stored.push(*h);
            parent = Some(*h);
        }
        if !stored.is_empty() {
            let bs = self.block_size;
            events.push(CacheEvent::Stored {
                tokens: tokens[matched * bs..chain.len() * bs].to_vec(),
                hashes: stored,
                parent: first_parent,
                scope: Scope {
                    lora_name: scope.lora_name.clone(),
                    cache_salt: scope.cache_salt.clone().filter(|_| first_parent.is_none()),
                },
            });
        }
        // Output blocks come out of free space; evict for them too.
        for _ in 0..decode_blocks {
            while self.blocks.len() + self.decode_used >= self.capacity {
                match self.evict_one() {
                    Some(gone) => events.push(CacheEvent::Removed { hashes: vec![gone] }),
                    None => break,
                }
            }
            self.decode_used += 1;
        }
        Some(Allocation {
            blocks: chain.to_vec(),
            cached_blocks: matched,
            decode_blocks,
        })
    }

    /// Releases a finished request: its prompt blocks stay cached but
    /// become evictable; its output blocks are freed.
    pub fn release(&mut self, a: &Allocation) {
        self.clock += 1;
        let now = self.clock;
        for h in &a.blocks {
            if let Some(b) = self.blocks.get_mut(h) {
                b.pins = b.pins.saturating_sub(1);
                b.last_used = now;
                if b.pins == 0 {
                    self.evictable.insert((now, Reverse(b.depth), *h));
                }
            }
        }
        self.decode_used = self.decode_used.saturating_sub(a.decode_blocks);
    }

    /// Pins the cached blocks of `chain` once more, for a holder other
    /// than a running request; [`PrefixCache::release`] undoes it.
    pub fn hold(&mut self, chain: &[u64]) -> Allocation {
        self.clock += 1;
        let now = self.clock;
        let blocks: Vec<u64> = chain
            .iter()
            .copied()
            .filter(|h| self.blocks.contains_key(h))
            .collect();
        for h in &blocks {
            self.pin(*h, now);
        }
        Allocation {
            blocks,
            cached_blocks: 0,
            decode_blocks: 0,
        }
    }

    fn pin(&mut self, h: u64, now: u64) {
        if let Some(b) = self.blocks.get_mut(&h) {
            if b.pins == 0 {
                self.evictable.remove(&(b.last_used, Reverse(b.depth), h));
            }
            b.pins += 1;
            b.last_used = now;
        }
    }

    fn evict_one(&mut self) -> Option<u64> {
        // Leaves first; a block with cached children is skipped (the order
        // makes that rare, but a child pinned by a request can outlive a
        // parent's last use only if it is pinned, which pins the parent too).
        let victim = self
            .evictable
            .iter()
            .find(|(_, _, h)| self.blocks.get(h).is_some_and(|b| b.children == 0))
            .copied()?;
        self.evictable.remove(&victim);
        let h = victim.2;
        if let Some(b) = self.blocks.remove(&h)
            && let Some(p) = b.parent.and_then(|p| self.blocks.get_mut(&p))
        {
            p.children = p.children.saturating_sub(1);
        }
        Some(h)
    }

    /// Drops every unpinned block (vLLM's reset_prefix_cache). Returns
    /// false, changing nothing, while requests hold blocks.
    pub fn reset(&mut self) -> bool {
        if self.used_blocks() > 0 {
            return false;
        }
        self.blocks.clear();
        self.evictable.clear();
        true
    }

    /// Forgets everything, pinned or not (a process restart).
    pub fn wipe(&mut self) {
        self.blocks.clear();
        self.evictable.clear();
        self.decode_used = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none() -> Scope {
        Scope::default()
    }

    fn toks(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn second_request_hits_the_cache() {
        let mut c = PrefixCache::new(4, 16);
        let t = toks(10, 1);
        let chain = c.chain(&t, &none());
        assert_eq!(chain.len(), 2, "partial blocks are not cached");
        let mut ev = Vec::new();
        let a = c.allocate(&t, &none(), &chain, 1, &mut ev).unwrap();
        assert_eq!(a.cached_blocks, 0);
        assert_eq!(
            ev,
            vec![CacheEvent::Stored {
                hashes: chain.clone(),
                parent: None,
                tokens: t[..8].to_vec(),
                scope: none(),
            }]
        );
        assert_eq!(c.used_blocks(), 3);
        c.release(&a);
        assert_eq!(c.used_blocks(), 0);
        assert_eq!(c.cached_blocks(), 2);
        ev.clear();
        let b = c.allocate(&t, &none(), &chain, 0, &mut ev).unwrap();
        assert_eq!(b.cached_blocks, 2);
        assert!(ev.is_empty());
    }

    #[test]
    fn continuation_reports_its_parent() {
        let mut c = PrefixCache::new(4, 16);
        let t = toks(12, 1);
        let mut ev = Vec::new();
        let a = c
            .allocate(&t[..4], &none(), &c.chain(&t[..4], &none()), 0, &mut ev)
            .unwrap();
        c.release(&a);
        ev.clear();
        let chain = c.chain(&t, &none());
        c.allocate(&t, &none(), &chain, 0, &mut ev).unwrap();
        assert_eq!(
            ev,
            vec![CacheEvent::Stored {
                hashes: chain[1..].to_vec(),
                parent: Some(chain[0]),
                tokens: t[4..12].to_vec(),
                scope: none(),
            }]
        );
    }

    #[test]
    fn scopes_never_share_blocks_and_the_salt_names_only_a_chains_start() {
        let mut c = PrefixCache::new(4, 64);
        let t = toks(8, 3);
        let lora = Scope {
            lora_name: Some("sql".into()),
            cache_salt: None,
        };
        let salted = Scope {
            lora_name: Some("sql".into()),
            cache_salt: Some("s".into()),
        };
        let chains = [none(), lora.clone(), salted.clone()].map(|s| c.chain(&t, &s));
        assert_ne!(chains[0], chains[1]);
        assert_ne!(chains[1], chains[2]);
        let mut ev = Vec::new();
        let a = c
            .allocate(&t[..4], &salted, &c.chain(&t[..4], &salted), 0, &mut ev)
            .unwrap();
        c.release(&a);
        c.allocate(&t, &salted, &chains[2], 0, &mut ev).unwrap();
        let scopes: Vec<Scope> = ev
            .iter()
            .map(|e| match e {
                CacheEvent::Stored { scope, .. } => scope.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            scopes,
            [salted, lora],
            "the continuation names the adapter, not the salt"
        );
        let b = c
            .allocate(&t, &none(), &chains[0], 0, &mut Vec::new())
            .unwrap();
        assert_eq!(
            b.cached_blocks, 0,
            "unscoped requests do not match scoped blocks"
        );
    }

    #[test]
    fn lru_evicts_leaves_of_the_oldest_chain_first() {
        let mut c = PrefixCache::new(4, 4);
        let (a, b) = (toks(8, 1), toks(8, 2));
        let mut ev = Vec::new();
        let ca = c.chain(&a, &none());
        let x = c.allocate(&a, &none(), &ca, 0, &mut ev).unwrap();
        c.release(&x);
        let cb = c.chain(&b, &none());
        let y = c.allocate(&b, &none(), &cb, 0, &mut ev).unwrap();
        c.release(&y);
        ev.clear();
        // A third chain needs two blocks: chain a goes, leaf first.
        let t = toks(8, 3);
        let ct = c.chain(&t, &none());
        c.allocate(&t, &none(), &ct, 0, &mut ev).unwrap();
        assert_eq!(
            ev[0],
            CacheEvent::Removed {
                hashes: vec![ca[1]]
            }
        );
        assert_eq!(
            ev[1],
            CacheEvent::Removed {
                hashes: vec![ca[0]]
            }
        );
        assert_eq!(c.matched(&cb), 2, "the more recent chain survives");
    }

    #[test]
    fn pinned_blocks_are_never_evicted_and_full_caches_refuse() {
        let mut c = PrefixCache::new(4, 3);
        let a = toks(8, 1);
        let mut ev = Vec::new();
        let ca = c.chain(&a, &none());
        let _held = c.allocate(&a, &none(), &ca, 1, &mut ev).unwrap();
        let b = toks(8, 2);
        let cb = c.chain(&b, &none());
        assert!(c.allocate(&b, &none(), &cb, 0, &mut ev).is_none());
        assert_eq!(c.matched(&ca), 2);
        assert!(!c.reset(), "reset refuses while requests run");
    }

    #[test]
    fn held_blocks_outlive_their_request_until_released() {
        let mut c = PrefixCache::new(4, 2);
        let a = toks(8, 1);
        let ca = c.chain(&a, &none());
        let req = c.allocate(&a, &none(), &ca, 0, &mut Vec::new()).unwrap();
        let held = c.hold(&ca);
        c.release(&req);
        let b = toks(8, 2);
        let cb = c.chain(&b, &none());
        assert!(
            c.allocate(&b, &none(), &cb, 0, &mut Vec::new()).is_none(),
            "a held block is not evicted"
        );
        c.release(&held);
        let mut ev = Vec::new();
        assert!(c.allocate(&b, &none(), &cb, 0, &mut ev).is_some());
        assert!(matches!(&ev[0], CacheEvent::Removed { .. }));
    }

    #[test]
    fn usage_counts_only_blocks_in_use() {
        let mut c = PrefixCache::new(4, 10);
        let t = toks(16, 1);
        let mut ev = Vec::new();
        let ch = c.chain(&t, &none());
        let a = c.allocate(&t, &none(), &ch, 2, &mut ev).unwrap();
        assert_eq!(c.usage(), 0.6);
        c.release(&a);
        assert_eq!(c.usage(), 0.0);
        assert!(c.reset());
        assert_eq!(c.cached_blocks(), 0);
    }
}
