//! Staging: a whole batch decoded and hashed before anything is applied.
//!
//! A malformed frame must leave the index untouched, and decoding fails at
//! the first bad event. So a batch is first decoded into a staging area —
//! computing each block's local hash on the way, which is the expensive part
//! and would be needed anyway — and applied only when the whole frame
//! decoded. Buffers are reused from batch to batch.

use crate::sources::kv::wire::{
    BatchMeta, EngineHash, Event, Medium, Scratch, Unmatchable, WireError, decode_batch,
};
use kvgate_core::hash::{block_hash_with_seed, lora_seed, salted_root};
use std::ops::Range;

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Blocks stored: `engine` and `local` ranges index the staged arrays
    /// and have equal length (full blocks only).
    Stored {
        engine: Range<usize>,
        local: Range<usize>,
        parent: Option<EngineHash>,
        medium: Medium,
        /// From this block of the op on, nothing a request can produce
        /// keys the blocks (see [`Unmatchable`]).
        unmatchable_from: Option<(usize, Unmatchable)>,
    },
    Removed {
        engine: Range<usize>,
        medium: Medium,
    },
    Cleared,
    /// Not indexed (other KV group, sliding window, remote, zero block size).
    Skipped,
    Unknown,
}

#[derive(Debug, Default)]
pub struct Staged {
    pub meta: Option<BatchMeta>,
    pub ops: Vec<Op>,
    pub engine: Vec<EngineHash>,
    pub local: Vec<u64>,
    /// Stored events of the batch whose block size is not the worker's,
    /// and the last such size: their blocks are hashed at the engine's
    /// size, which no request hashed at the worker's can match.
    pub foreign_block_size: (usize, u32),
    scratch: Scratch,
}

impl Staged {
    /// Whether the batch empties the publisher's cache (AllBlocksCleared).
    pub fn clears(&self) -> bool {
        self.ops.iter().any(|o| matches!(o, Op::Cleared))
    }

    /// Decodes and hashes `payload`. `default_block_size` is used when an
    /// event does not carry one.
    pub fn stage(&mut self, payload: &[u8], default_block_size: u32) -> Result<(), WireError> {
        self.meta = None;
        self.ops.clear();
        self.engine.clear();
        self.local.clear();
        self.foreign_block_size = (0, 0);
        let (ops, engine, local) = (&mut self.ops, &mut self.engine, &mut self.local);
        let foreign = &mut self.foreign_block_size;
        let meta = decode_batch(payload, &mut self.scratch, |e| match e {
            Event::Stored(s) => {
                let bs = if s.block_size > 0 {
                    s.block_size
                } else {
                    default_block_size
                } as usize;
                if s.block_size > 0 && default_block_size > 0 && s.block_size != default_block_size
                {
                    *foreign = (foreign.0 + 1, s.block_size);
                }
                if !s.indexable() || bs == 0 {
                    ops.push(Op::Skipped);
                    return;
                }
                let seed = lora_seed(s.lora_name);
                let (e0, l0) = (engine.len(), local.len());
                // Only blocks with all their tokens: a trailing partial block,
                // or hashes beyond the tokens given, end the event.
                for (h, toks) in s.hashes.iter().zip(s.tokens.chunks_exact(bs)) {
                    engine.push(*h);
                    local.push(block_hash_with_seed(toks, seed));
                }
                // The salt enters at the chain's root, as the filter mixes
                // it into a request's first block; a child event inherits
                // it through its parent's sequence hash.
                if let (None, Some(salt), Some(root)) = (s.parent, s.cache_salt, local.get_mut(l0))
                {
                    *root = salted_root(*root, salt);
                }
                ops.push(Op::Stored {
                    engine: e0..engine.len(),
                    local: l0..local.len(),
                    parent: s.parent,
                    medium: s.medium,
                    unmatchable_from: s.unmatchable_from,
                });
            }
            Event::Removed {
                hashes,
                medium,
                group_idx,
            } => {
                if group_idx != 0 {
                    ops.push(Op::Skipped);
                    return;
                }
                let e0 = engine.len();
                engine.extend_from_slice(hashes);
                ops.push(Op::Removed {
                    engine: e0..engine.len(),
                    medium,
                });
            }
            Event::Cleared => ops.push(Op::Cleared),
            Event::Unknown { .. } => ops.push(Op::Unknown),
        })?;
        self.meta = Some(meta);
        Ok(())
    }
}
