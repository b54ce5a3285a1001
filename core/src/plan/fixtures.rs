//! Fleets for the pipeline's tests.

use crate::state::{DEFAULT_TENANT, RankLoad, WorkerState};

/// Worker `id` at `10.0.0.<id>:8000`, 16-token blocks, default tenant.
pub(crate) fn worker(id: u64, ranks: Vec<RankLoad>) -> WorkerState {
    WorkerState {
        id,
        endpoint: format!("10.0.0.{id}:8000"),
        block_size: 16,
        ranks,
        tenant: DEFAULT_TENANT.into(),
        thermal: Default::default(),
        draining: false,
        role: Default::default(),
        bootstrap_port: 0,
        fits: None,
        topology: Default::default(),
    }
}

/// A 320-token prompt: 20 blocks of 16.
pub(crate) fn prompt() -> Vec<u32> {
    (0..320).collect()
}

/// A rank in `slot` with `prefill` tokens and `decode` blocks booked, of a
/// 1000-block cache.
pub(crate) fn rank(slot: u16, prefill: u64, decode: u64) -> RankLoad {
    RankLoad {
        slot,
        active_prefill_tokens: prefill,
        active_decode_blocks: decode,
        kv_total_blocks: 1000,
        max_num_batched_tokens: 8192,
        ..Default::default()
    }
}

/// Index shards of model `m` (8 shards) in which each `(slot, blocks)`
/// holds the first `blocks` 16-token blocks of `tokens` on its device.
pub(crate) fn held(
    tokens: &[u32],
    holders: &[(u16, usize)],
) -> std::collections::HashMap<String, Vec<u8>> {
    use crate::hash::{CacheScope, scoped_sequence_hashes};
    use crate::shard::{Holder, TIER_DEVICE, encode, shard_of};
    use std::collections::HashMap;
    let hashes = scoped_sequence_hashes(tokens, 16, CacheScope::default());
    let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
    for (i, h) in hashes.into_iter().enumerate() {
        let holders: Vec<Holder> = holders
            .iter()
            .filter(|(_, blocks)| i < *blocks)
            .map(|(slot, _)| Holder {
                slot: *slot,
                tiers: TIER_DEVICE,
            })
            .collect();
        if !holders.is_empty() {
            per_shard
                .entry(shard_of(h, 8))
                .or_default()
                .push((h, holders));
        }
    }
    per_shard
        .into_iter()
        .map(|(s, mut e)| (crate::update::shard_key("m", s), encode(&mut e)))
        .collect()
}
