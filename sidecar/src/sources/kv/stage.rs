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
use kvgate_core::hash::{CacheScope, block_hash_with_seed, lora_seed, salted_root};
use kvgate_core::text::Cursor;
use std::ops::Range;

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Blocks stored: `engine` and `local` ranges index the staged arrays
    /// and have equal length (full blocks only).
    Stored {
        engine: Range<usize>,
        local: Range<usize>,
        /// The blocks' tokens, when the model has a text index (empty
        /// otherwise).
        tokens: Range<usize>,
        /// Where a chain without a parent starts in the text index.
        root: Cursor,
        parent: Option<EngineHash>,
        medium: Medium,
        /// From this block of the op on, nothing a request can produce
        /// keys the blocks (see [`Unmatchable`]).
        unmatchable_from: Option<(usize, Unmatchable)>,
    },
    /// Pages stored at the engine's page size where it is not the
    /// worker's block size (SGLang's default page size is 1): the index
    /// re-chunks their tokens into the worker's blocks along the parent
    /// chain. `tokens` indexes the staged tokens, `page_size` per engine
    /// hash; `salt` indexes the staged text.
    Pages {
        engine: Range<usize>,
        tokens: Range<usize>,
        page_size: u32,
        parent: Option<EngineHash>,
        medium: Medium,
        seed: u64,
        root: Cursor,
        salt: Option<Range<usize>>,
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
    /// Token ids of [`Op::Pages`].
    pub tokens: Vec<u32>,
    /// Salts of [`Op::Pages`].
    pub text: String,
    /// Stored events of the batch whose block size is not the worker's,
    /// and the last such size: re-chunked, at a cost in memory (the index
    /// keeps every page's unfinished block).
    pub foreign_block_size: (usize, u32),
    /// Keep stored blocks' tokens (the model has a text index).
    pub keep_tokens: bool,
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
        self.tokens.clear();
        self.text.clear();
        self.foreign_block_size = (0, 0);
        let (ops, engine, local) = (&mut self.ops, &mut self.engine, &mut self.local);
        let (page_tokens, text) = (&mut self.tokens, &mut self.text);
        let foreign = &mut self.foreign_block_size;
        let keep_tokens = self.keep_tokens;
        let meta = decode_batch(payload, &mut self.scratch, |e| match e {
            Event::Stored(s) => {
                let bs = if s.block_size > 0 {
                    s.block_size
                } else {
                    default_block_size
                } as usize;
                let foreign_size = s.block_size > 0
                    && default_block_size > 0
                    && s.block_size != default_block_size;
                if foreign_size {
                    *foreign = (foreign.0 + 1, s.block_size);
                }
                if !s.indexable() || bs == 0 {
                    ops.push(Op::Skipped);
                    return;
                }
                let seed = lora_seed(s.lora_name);
                let root = Cursor::root(CacheScope {
                    lora_name: s.lora_name.filter(|n| !n.is_empty()),
                    cache_salt: s.cache_salt,
                });
                if foreign_size {
                    let (e0, t0) = (engine.len(), page_tokens.len());
                    for (h, toks) in s.hashes.iter().zip(s.tokens.chunks_exact(bs)) {
                        engine.push(*h);
                        page_tokens.extend_from_slice(toks);
                    }
                    let salt = s.cache_salt.filter(|_| s.parent.is_none()).map(|salt| {
                        let at = text.len();
                        text.push_str(salt);
                        at..text.len()
                    });
                    ops.push(Op::Pages {
                        engine: e0..engine.len(),
                        tokens: t0..page_tokens.len(),
                        page_size: s.block_size,
                        parent: s.parent,
                        medium: s.medium,
                        seed,
                        root,
                        salt,
                        unmatchable_from: s.unmatchable_from,
                    });
                    return;
                }
                let (e0, l0, t0) = (engine.len(), local.len(), page_tokens.len());
                // Only blocks with all their tokens: a trailing partial block,
                // or hashes beyond the tokens given, end the event.
                for (h, toks) in s.hashes.iter().zip(s.tokens.chunks_exact(bs)) {
                    engine.push(*h);
                    local.push(block_hash_with_seed(toks, seed));
                    if keep_tokens {
                        page_tokens.extend_from_slice(toks);
                    }
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
                    tokens: t0..page_tokens.len(),
                    root,
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
