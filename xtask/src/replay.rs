//! What routing could achieve with the fleet's own caches: each workload
//! replayed offline through the simulator's cache model.
//!
//! * `reference`: perfect knowledge, load ignored. Every request goes to
//!   the worker where it finds its longest cached prefix, one request at a
//!   time; a match shorter than a floor counts as cold, and a cold request
//!   goes to the worker chosen least recently (otherwise a prefix every
//!   prompt shares, a chat template's header, would pile the workload onto
//!   one worker and the reference would measure that pile-up rather than
//!   the caches). No one floor suits every workload: a long prompt's
//!   shared system block is worth following, a short shared header is not.
//!   The reference is the best of the floors in [`FLOORS`], so a policy's
//!   share of it is measured against the best of these offline policies;
//! * `ideal`: one cache without a bound, the ceiling of any routing.
//!
//! A policy's hit rate over `reference` says how much of what the caches
//! allow it reaches; `ideal` over `reference` how much the cache size costs.

use kvgate_sim::cache::{PrefixCache, Scope};
use std::collections::HashSet;

/// The cold floors tried: a match shorter than `max(blocks, prompt /
/// fraction)` blocks draws no request.
pub const FLOORS: [(usize, usize); 3] = [(4, usize::MAX), (32, usize::MAX), (4, 10)];

#[derive(Debug, Clone, Copy)]
pub struct Reference {
    pub reference: f64,
    pub ideal: f64,
    /// The floor that gave `reference`: (blocks, prompt fraction).
    pub floor: (usize, usize),
}

/// Hit rates (prompt tokens served from cache) of `prompts`, in order.
/// A prompt longer than a worker's cache is left out, as the simulator
/// refuses it and counts it nowhere.
pub fn replay(
    prompts: &[Vec<u32>],
    workers: usize,
    kv_blocks: usize,
    block_size: usize,
) -> Reference {
    let ideal = ideal(prompts, block_size, kv_blocks);
    FLOORS
        .iter()
        .map(|&floor| Reference {
            reference: routed(prompts, workers, kv_blocks, block_size, floor),
            ideal,
            floor,
        })
        .max_by(|a, b| a.reference.total_cmp(&b.reference))
        .unwrap_or(Reference {
            reference: 0.0,
            ideal,
            floor: FLOORS[0],
        })
}

fn ideal(prompts: &[Vec<u32>], block_size: usize, kv_blocks: usize) -> f64 {
    let cache = PrefixCache::new(block_size, 1);
    let scope = Scope::default();
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut tokens, mut hit) = (0u64, 0u64);
    for p in prompts {
        let chain = cache.chain(p, &scope);
        if chain.len() >= kv_blocks {
            continue;
        }
        tokens += p.len() as u64;
        hit += (chain.iter().take_while(|h| seen.contains(h)).count() * block_size) as u64;
        seen.extend(chain.iter().copied());
    }
    hit as f64 / tokens.max(1) as f64
}

fn routed(
    prompts: &[Vec<u32>],
    workers: usize,
    kv_blocks: usize,
    block_size: usize,
    (floor_blocks, fraction): (usize, usize),
) -> f64 {
    let mut caches: Vec<PrefixCache> = (0..workers.max(1))
        .map(|_| PrefixCache::new(block_size, kv_blocks))
        .collect();
    let (mut tokens, mut hit) = (0u64, 0u64);
    let scope = Scope::default();
    let mut events = Vec::new();
    let mut chosen_at = vec![0u64; caches.len()];
    let mut clock = 0u64;
    for p in prompts {
        let chain = caches[0].chain(p, &scope);
        if chain.len() >= kv_blocks {
            continue; // the engine refuses it: no hit, no query
        }
        tokens += p.len() as u64;
        let floor = floor_blocks.max(chain.len() / fraction);
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
    hit as f64 / tokens.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_reused_and_a_prompt_that_cannot_fit_counts_nowhere() {
        let prefix: Vec<u32> = (0..64).collect();
        let mut prompts: Vec<Vec<u32>> = (0..4u32)
            .map(|i| {
                let mut p = prefix.clone();
                p.extend((0..16).map(|k| 1000 + i * 100 + k));
                p
            })
            .collect();
        let r = replay(&prompts, 2, 64, 16);
        // Three of four requests find the 64-token prefix: 192 of 320.
        assert!((r.reference - 192.0 / 320.0).abs() < 1e-9, "{r:?}");
        assert!((r.ideal - r.reference).abs() < 1e-9);
        // A prompt longer than a worker's cache is refused, as the
        // simulator refuses it: neither a query nor a hit.
        let mut giant = prefix.clone();
        giant.extend(5000..7000);
        prompts.insert(1, giant);
        let with_giant = replay(&prompts, 2, 64, 16);
        assert!(
            (with_giant.reference - r.reference).abs() < 1e-9,
            "{with_giant:?}"
        );
        assert!((with_giant.ideal - r.ideal).abs() < 1e-9);
    }

    #[test]
    fn a_shared_block_shorter_than_a_tenth_of_long_prompts_is_followed() {
        // 400-block prompts sharing a 32-block system prompt: a floor of a
        // tenth of the prompt (40 blocks) would spread them cold.
        let system: Vec<u32> = (0..512).collect();
        let prompts: Vec<Vec<u32>> = (0..8u32)
            .map(|i| {
                let mut p = system.clone();
                p.extend((0..6400).map(|k| 100_000 + i * 10_000 + k));
                p
            })
            .collect();
        let r = replay(&prompts, 4, 100_000, 16);
        let tokens = 8.0 * 6912.0;
        assert!((r.reference - 7.0 * 512.0 / tokens).abs() < 1e-9, "{r:?}");
        assert_eq!(
            r.floor.1,
            usize::MAX,
            "a floor in blocks, not a tenth of the prompt"
        );
        assert!((r.ideal - r.reference).abs() < 1e-9);
    }
}
