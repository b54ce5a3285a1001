//! vLLM and SGLang KV-event batches, every shape that engines in the field
//! publish (see the wire-format reference in `docs/kv-events.md`):
//!
//! * the batch as `[ts, events]`, `[ts, events, dp_rank]`, or a map
//!   `{ts, events, data_parallel_rank}`;
//! * each event either positional (`["BlockStored", hashes, parent, ...]`,
//!   vLLM ≤ 0.23 and older SGLang) or a tagged map (`{"type": ...}`, newer
//!   engines); a fleet may mix both, so the shape is decided per event;
//! * block hashes as uint64, negative int64 (SGLang) or bytes (vLLM bytes
//!   mode); unknown fields and unknown event tags are skipped.
//!
//! Decoding is a visitor over one frame with caller-owned scratch buffers,
//! so a steady stream of batches allocates nothing.

mod events;
mod fields;

use crate::sources::kv::msgpack::{MsgpackError, Reader};
use events::{positional, tagged};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WireError {
    #[error("malformed msgpack: {0}")]
    Msgpack(#[from] MsgpackError),
    #[error("batch is not an array or map")]
    BatchShape,
    #[error("batch array has {0} elements, expected 2 or 3")]
    BatchLen(usize),
    #[error("batch has no events")]
    NoEvents,
    #[error("event {index} is malformed: {why}")]
    Event { index: usize, why: String },
}

/// Storage tier of a block, normalised across engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// GPU memory (`GPU`, or unset on older engines).
    Device,
    /// Host memory (`CPU`, `CPU_PINNED`, `CPU_TIER1`).
    Host,
    /// Disk or remote storage (`DISK`, `STORAGE`, `CPU_TIER2`, `EXTERNAL`, unknown).
    Disk,
}

impl Medium {
    fn parse(s: Option<&str>) -> Medium {
        match s {
            None | Some("GPU") => Medium::Device,
            Some("CPU" | "CPU_PINNED" | "CPU_TIER1") => Medium::Host,
            Some(_) => Medium::Disk,
        }
    }
}

/// An engine's block hash reduced to a u64 key. Only used to find the block
/// again when the engine removes it, so any injective-enough mapping works:
/// integers keep their bits, byte digests are hashed.
pub type EngineHash = u64;

fn bytes_hash(b: &[u8]) -> EngineHash {
    xxh3_64(b)
}

/// One decoded event. Slices borrow the caller's scratch and the frame.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event<'e> {
    Stored(Stored<'e>),
    Removed {
        hashes: &'e [EngineHash],
        medium: Medium,
        group_idx: i64,
    },
    Cleared,
    /// A tag this build does not know; counted and skipped by the consumer.
    Unknown {
        tag: &'e str,
    },
}

/// Why a stored block cannot be keyed the way a request is: its engine
/// hash covers something kvgate cannot compute from a request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unmatchable {
    /// Multimodal inputs (`mm` extra keys): the engine hashed image or audio
    /// content that kvgate never sees.
    Multimodal,
    /// Prompt embeddings given instead of tokens (`prompt_embeds`).
    PromptEmbeds,
    /// Untyped extra keys of older vLLM (a tuple of strings and bytes that
    /// cannot be told apart), other than the event's own adapter name.
    LegacyExtraKeys,
    /// A typed extra key this build does not know, or one out of place.
    UnknownExtraKey,
    /// An adapter named only by `lora_id`: its seed needs the name.
    LoraIdWithoutName,
    /// The block's parent is itself unmatchable.
    Parent,
}

impl Unmatchable {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Unmatchable::Multimodal => "multimodal",
            Unmatchable::PromptEmbeds => "prompt_embeds",
            Unmatchable::LegacyExtraKeys => "legacy_extra_keys",
            Unmatchable::UnknownExtraKey => "unknown_extra_key",
            Unmatchable::LoraIdWithoutName => "lora_id_without_name",
            Unmatchable::Parent => "unmatchable_parent",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stored<'e> {
    pub hashes: &'e [EngineHash],
    pub parent: Option<EngineHash>,
    pub tokens: &'e [u32],
    pub block_size: u32,
    pub medium: Medium,
    pub lora_name: Option<&'e str>,
    /// The chain's salt: SGLang's `cache_salt`, or vLLM's `cache_salt`
    /// extra key on the first block.
    pub cache_salt: Option<&'e str>,
    /// The first block (index into this event's blocks) whose hash covers
    /// something kvgate cannot compute, and why; it and every block after
    /// it (they chain from it) must never match a request.
    pub unmatchable_from: Option<(usize, Unmatchable)>,
    /// KV-cache group; only group 0 describes the full-attention cache.
    pub group_idx: i64,
    pub spec_kind: Option<&'e str>,
    /// `false` for blocks the publisher reports as held elsewhere.
    pub local: bool,
}

impl Stored<'_> {
    /// Whether a prefix index should use this event: full-attention-like
    /// groups only (sliding-window or Mamba caches do not give prefix reuse
    /// in the same way), group 0, and local blocks.
    pub fn indexable(&self) -> bool {
        self.group_idx == 0
            && self.local
            && match self.spec_kind {
                None => true,
                Some(k) => k.starts_with("full") || k.starts_with("mla") || k.starts_with("sink"),
            }
    }
}

/// Reusable buffers for decoding; keep one per subscriber.
#[derive(Debug, Default)]
pub struct Scratch {
    hashes: Vec<EngineHash>,
    tokens: Vec<u32>,
}

/// What the batch says besides its events.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchMeta {
    pub ts: f64,
    pub dp_rank: Option<i64>,
    pub events: usize,
}

/// Decodes one batch payload, calling `visit` for every event in order.
///
/// A malformed event stops decoding with an error naming its index; the
/// events before it have been visited. Callers that must be all-or-nothing
/// decode into a staging area first.
pub fn decode_batch(
    payload: &[u8],
    scratch: &mut Scratch,
    mut visit: impl FnMut(Event<'_>),
) -> Result<BatchMeta, WireError> {
    let mut r = Reader::new(payload);
    if r.is_array()? {
        let n = r.array_len()?;
        if !(2..=3).contains(&n) {
            return Err(WireError::BatchLen(n));
        }
        let ts = r.f64()?;
        let events = decode_events(&mut r, scratch, &mut visit)?;
        let dp_rank = if n == 3 { opt_int(&mut r)? } else { None };
        Ok(BatchMeta {
            ts,
            dp_rank,
            events,
        })
    } else if r.is_map()? {
        let n = r.map_len()?;
        let (mut ts, mut dp_rank, mut events) = (0.0, None, None);
        for _ in 0..n {
            match r.str()? {
                "ts" => ts = r.f64()?,
                // The events are applied as they decode, so a second list
                // cannot replace the first: a batch has one or is refused.
                "events" if events.is_some() => return Err(malformed("two \"events\" keys")),
                "events" => events = Some(decode_events(&mut r, scratch, &mut visit)?),
                "data_parallel_rank" | "attn_dp_rank" => dp_rank = opt_int(&mut r)?,
                _ => r.skip()?,
            }
        }
        let events = events.ok_or(WireError::NoEvents)?;
        Ok(BatchMeta {
            ts,
            dp_rank,
            events,
        })
    } else {
        Err(WireError::BatchShape)
    }
}

fn malformed(why: &str) -> WireError {
    WireError::Event {
        index: 0,
        why: why.to_string(),
    }
}

fn opt_int(r: &mut Reader<'_>) -> Result<Option<i64>, MsgpackError> {
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(r.int()?.as_u64_bits() as i64))
}

fn decode_events(
    r: &mut Reader<'_>,
    scratch: &mut Scratch,
    visit: &mut impl FnMut(Event<'_>),
) -> Result<usize, WireError> {
    let n = r.array_len()?;
    for index in 0..n {
        let result = if r.is_array()? {
            positional(r, scratch, visit)
        } else if r.is_map()? {
            tagged(r, scratch, visit)
        } else {
            Err(malformed("event is neither an array nor a map"))
        };
        // Give every failure the index of the event it happened in.
        result.map_err(|e| WireError::Event {
            index,
            why: match e {
                WireError::Event { why, .. } => why,
                other => other.to_string(),
            },
        })?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests;
