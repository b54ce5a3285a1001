//! A prefill engine's blocks held for remote decodes: each prefill leg's
//! blocks stay pinned under its request id until the decode worker has
//! pulled them (their bytes through the holder's [`super::link::Link`]) or
//! the lease runs out, as vLLM's NixlConnector holds them for
//! `kv_lease_duration`. Either way the hold ends and the blocks fall back
//! to the cache's ordinary eviction.

use super::Counters;
use super::frame::BlockIdentity;
use crate::cache::Allocation;
use crate::engine::Rank;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

struct Lease {
    generation: u64,
    blocks: Vec<BlockIdentity>,
    hold: Allocation,
}

/// Why a pull gets no blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TakeError {
    #[error("no blocks held for request {0} (lease expired, already pulled or never prefilled)")]
    Gone(String),
    #[error("block {0} is not one of request {1}'s")]
    Foreign(u32, String),
}

/// One rank's leases.
pub struct Leases {
    rank: Arc<Rank>,
    counters: Arc<Counters>,
    map: Mutex<HashMap<String, Lease>>,
    next_block: AtomicU32,
    next_generation: AtomicU64,
    held_blocks: AtomicUsize,
}

impl Leases {
    pub fn new(rank: Arc<Rank>, counters: Arc<Counters>) -> Leases {
        Leases {
            rank,
            counters,
            map: Mutex::new(HashMap::new()),
            next_block: AtomicU32::new(0),
            next_generation: AtomicU64::new(1),
            held_blocks: AtomicUsize::new(0),
        }
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Lease>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks held by leases now.
    pub fn held_blocks(&self) -> usize {
        self.held_blocks.load(Ordering::Relaxed)
    }

    /// Holds a just-prefilled request's blocks (`chain`, still pinned by the
    /// request, plus a partial tail block when the prompt has one) for
    /// `ttl`, and returns the block ids its answer names. A second prefill
    /// with the same request id replaces the first, whose hold ends.
    pub fn grant(
        self: &Arc<Self>,
        request_id: &str,
        chain: &[u64],
        partial_tail: bool,
        ttl: Duration,
    ) -> Vec<u32> {
        let n = chain.len() + usize::from(partial_tail);
        // Ids are opaque to the decode side; consecutive ones per lease
        // look like an engine's block table.
        let first = self.next_block.fetch_add(n as u32, Ordering::Relaxed);
        let mut blocks: Vec<BlockIdentity> = chain
            .iter()
            .enumerate()
            .map(|(i, h)| BlockIdentity {
                id: first.wrapping_add(i as u32),
                hash: Some(*h),
            })
            .collect();
        if partial_tail {
            blocks.push(BlockIdentity {
                id: first.wrapping_add(chain.len() as u32),
                hash: None,
            });
        }
        let ids = blocks.iter().map(|b| b.id).collect();
        let hold = self.rank.hold(chain);
        self.held_blocks
            .fetch_add(hold.blocks.len(), Ordering::Relaxed);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let replaced = self.map().insert(
            request_id.to_string(),
            Lease {
                generation,
                blocks,
                hold,
            },
        );
        if let Some(old) = replaced {
            tracing::warn!(request_id, "a second prefill reused a held request id");
            self.end(old);
        }
        let me = self.clone();
        let id = request_id.to_string();
        tokio::spawn(async move {
            tokio::time::sleep(ttl).await;
            me.expire(&id, generation);
        });
        ids
    }

    fn end(&self, lease: Lease) {
        self.held_blocks
            .fetch_sub(lease.hold.blocks.len(), Ordering::Relaxed);
        self.rank.unhold(&lease.hold);
    }

    fn expire(&self, request_id: &str, generation: u64) {
        let mut map = self.map();
        if map
            .get(request_id)
            .is_some_and(|l| l.generation == generation)
            && let Some(lease) = map.remove(request_id)
        {
            drop(map);
            tracing::info!(request_id, "KV lease expired before a pull");
            self.counters.lease_expiries.fetch_add(1, Ordering::Relaxed);
            self.end(lease);
        }
    }

    /// A pull: the asked blocks' identities, in the order asked. The lease
    /// ends with it, but the blocks stay held until the [`Taken`] is
    /// dropped: the prefill engine frees them once the decode worker has
    /// read them, which is after the transfer, not when it is asked for.
    pub fn take(&self, request_id: &str, ids: &[u32]) -> Result<Taken<'_>, TakeError> {
        let mut map = self.map();
        let lease = map
            .get(request_id)
            .ok_or_else(|| TakeError::Gone(request_id.to_string()))?;
        let mut blocks = Vec::with_capacity(ids.len().min(lease.blocks.len()));
        for id in ids {
            let b = lease
                .blocks
                .iter()
                .find(|b| b.id == *id)
                .ok_or_else(|| TakeError::Foreign(*id, request_id.to_string()))?;
            blocks.push(*b);
        }
        let lease = map.remove(request_id);
        Ok(Taken {
            blocks,
            leases: self,
            lease,
        })
    }
}

/// A pulled lease's blocks, held until this is dropped.
pub struct Taken<'a> {
    pub blocks: Vec<BlockIdentity>,
    leases: &'a Leases,
    lease: Option<Lease>,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.leases.end(lease);
        }
    }
}
