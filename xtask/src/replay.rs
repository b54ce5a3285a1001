//! What routing could achieve with the fleet's own caches: each workload
//! replayed offline through the simulator's cache model.
//!
//! * `reference`: every request goes to the worker where it finds its
//!   longest cached prefix (perfect knowledge, load ignored), one request
//!   at a time. A match shorter than [`MIN_MATCH_BLOCKS`] or a tenth of the
//!   prompt counts as cold, and a cold request goes to the worker chosen
//!   least recently: otherwise a prefix every prompt shares (a chat
//!   template's header) would draw the whole workload onto one worker and
//!   the reference would measure that pile-up rather than the caches;
//! * `ideal`: one cache without a bound, the ceiling of any routing.
//!
//! A policy's hit rate over `reference` says how much of what the caches
//! allow it reaches; `ideal` over `reference` how much the cache size costs.

use kvgate_sim::cache::{PrefixCache, Scope};
use std::collections::HashSet;

/// Shortest match, in blocks, that draws a request to a worker.
pub const MIN_MATCH_BLOCKS: usize = 4;

#[derive(Debug, Clone, Copy)]
pub struct Reference {
    pub reference: f64,
    pub ideal: f64,
}

/// Hit rates (prompt tokens served from cache) of `prompts`, in order.
pub fn replay(
    prompts: &[Vec<u32>],
    workers: usize,
    kv_blocks: usize,
    block_size: usize,
) -> Reference {
    let mut caches: Vec<PrefixCache> = (0..workers.max(1))
        .map(|_| PrefixCache::new(block_size, kv_blocks))
        .collect();
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut tokens, mut hit, mut ideal_hit) = (0u64, 0u64, 0u64);
    let scope = Scope::default();
    let mut events = Vec::new();
    let mut chosen_at = vec![0u64; caches.len()];
    let mut clock = 0u64;
    for p in prompts {
        let chain = caches[0].chain(p, &scope);
        tokens += p.len() as u64;
        let ideal = chain.iter().take_while(|h| seen.contains(h)).count();
        ideal_hit += (ideal * block_size) as u64;
        seen.extend(chain.iter().copied());
        let floor = MIN_MATCH_BLOCKS.max(chain.len() / 10);
        let best = (0..caches.len())
            .max_by_key(|&w| {
                let m = caches[w].matched(&chain);
                (
                    if m >= floor { m } else { 0 },
                    std::cmp::Reverse(chosen_at[w]),
                )
            })
            .unwrap_or(0);
        clock += 1;
        chosen_at[best] = clock;
        hit += (caches[best].matched(&chain) * block_size) as u64;
        events.clear();
        if let Some(a) = caches[best].allocate(p, &scope, &chain, 0, &mut events) {
            caches[best].release(&a);
        }
    }
    let rate = |h: u64| h as f64 / tokens.max(1) as f64;
    Reference {
        reference: rate(hit),
        ideal: rate(ideal_hit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_reused_and_a_small_cache_loses_it() {
        let prefix: Vec<u32> = (0..64).collect();
        let prompts: Vec<Vec<u32>> = (0..4u32)
            .map(|i| {
                let mut p = prefix.clone();
                p.extend((0..16).map(|k| 1000 + i * 100 + k));
                p
            })
            .collect();
        let r = replay(&prompts, 2, 1024, 16);
        // Three of four requests find the 64-token prefix: 192 of 320.
        assert!((r.reference - 192.0 / 320.0).abs() < 1e-9, "{r:?}");
        assert!((r.ideal - r.reference).abs() < 1e-9);
        // Four blocks of cache hold one prompt's prefix only: the next
        // prompt's new blocks evict it (leaves first), ideal is unchanged.
        let small = replay(&prompts, 1, 4, 16);
        assert!(small.reference < r.reference, "{small:?}");
        assert!((small.ideal - r.ideal).abs() < 1e-9);
    }
}
