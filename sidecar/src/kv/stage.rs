//! Staging: a whole batch decoded and hashed before anything is applied.
//!
//! A malformed frame must leave the index untouched, and decoding fails at
//! the first bad event. So a batch is first decoded into a staging area —
//! computing each block's local hash on the way, which is the expensive part
//! and would be needed anyway — and applied only when the whole frame
//! decoded. Buffers are reused from batch to batch.

use crate::kv::wire::{BatchMeta, EngineHash, Event, Medium, Scratch, WireError, decode_batch};
use kvgate_core::hash::{block_hash_with_seed, lora_seed};
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
        let (ops, engine, local) = (&mut self.ops, &mut self.engine, &mut self.local);
        let meta = decode_batch(payload, &mut self.scratch, |e| match e {
            Event::Stored(s) => {
                let bs = if s.block_size > 0 {
                    s.block_size
                } else {
                    default_block_size
                } as usize;
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
                ops.push(Op::Stored {
                    engine: e0..engine.len(),
                    local: l0..local.len(),
                    parent: s.parent,
                    medium: s.medium,
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
