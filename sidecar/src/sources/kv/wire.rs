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

use crate::sources::kv::msgpack::{MsgpackError, Reader};
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

/// Reads a list of block hashes into `out`.
fn hashes(r: &mut Reader<'_>, out: &mut Vec<EngineHash>) -> Result<(), MsgpackError> {
    out.clear();
    // `array_len` bounds the count by the bytes left in the frame, so this
    // reserves at most eight times the frame's size.
    let n = r.array_len()?;
    out.reserve(n);
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(())
}

fn hash(r: &mut Reader<'_>) -> Result<EngineHash, MsgpackError> {
    match r.peek()? {
        0xc4..=0xc6 => Ok(bytes_hash(r.bin()?)),
        _ => Ok(r.int()?.as_u64_bits()),
    }
}

fn opt_hash(r: &mut Reader<'_>) -> Result<Option<EngineHash>, MsgpackError> {
    if r.nil()? {
        Ok(None)
    } else {
        Ok(Some(hash(r)?))
    }
}

fn tokens(r: &mut Reader<'_>, out: &mut Vec<u32>) -> Result<(), MsgpackError> {
    out.clear();
    let n = r.array_len()?;
    out.reserve(n);
    for _ in 0..n {
        out.push(r.u32()?);
    }
    Ok(())
}

fn opt_str<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, MsgpackError> {
    if r.nil()? {
        Ok(None)
    } else {
        Ok(Some(r.str()?))
    }
}

/// Whether a value is there (not nil), skipping it.
fn present(r: &mut Reader<'_>) -> Result<bool, MsgpackError> {
    if r.nil()? {
        return Ok(false);
    }
    r.skip()?;
    Ok(true)
}

fn opt_i64(r: &mut Reader<'_>, default: i64) -> Result<i64, MsgpackError> {
    if r.nil()? {
        Ok(default)
    } else {
        Ok(r.int()?.as_u64_bits() as i64)
    }
}

/// SGLang's salted store puts `{"cache_salt": ...}` where vLLM has
/// `lora_name`; tell them apart by type.
fn lora_or_salt<'a>(r: &mut Reader<'a>, st: &mut StoredFields<'a>) -> Result<(), MsgpackError> {
    if r.is_map()? {
        let n = r.map_len()?;
        for _ in 0..n {
            if r.is_str()? && r.str()? == "cache_salt" {
                st.cache_salt = opt_str(r)?;
            } else {
                r.skip()?;
            }
        }
        Ok(())
    } else {
        st.lora_name = opt_str(r)?;
        Ok(())
    }
}

/// What vLLM's per-block `extra_keys` say, as far as kvgate can use it.
#[derive(Default)]
struct ExtraKeys<'a> {
    lora_name: Option<&'a str>,
    cache_salt: Option<&'a str>,
    unmatchable_from: Option<(usize, Unmatchable)>,
}

/// Reads `extra_keys`: nil, or one entry per block, each nil or a list of
/// keys — typed maps (`{"type": "lora" | "cache_salt" | "mm" |
/// "prompt_embeds" | "legacy", ...}`) in current vLLM, bare values in
/// older releases. Only the adapter name and a salt on the first block can
/// be reproduced from a request; anything else makes that block, and the
/// blocks chained after it, unmatchable. `lora_name` is the event's own
/// (declared, and so encoded, before `extra_keys`).
fn extra_keys<'a>(
    r: &mut Reader<'a>,
    lora_name: Option<&'a str>,
) -> Result<ExtraKeys<'a>, MsgpackError> {
    let mut out = ExtraKeys::default();
    if r.nil()? {
        return Ok(out);
    }
    let blocks = r.array_len()?;
    for block in 0..blocks {
        if r.nil()? {
            continue;
        }
        if !r.is_array()? {
            r.skip()?;
            out.mark(block, Unmatchable::UnknownExtraKey);
            continue;
        }
        let keys = r.array_len()?;
        for _ in 0..keys {
            if !r.is_map()? {
                // An untyped key: only the adapter's own name is known.
                let own = if r.is_str()? {
                    let v = r.str()?;
                    lora_name.is_some_and(|n| n == v)
                } else {
                    r.skip()?;
                    false
                };
                if !own {
                    out.mark(block, Unmatchable::LegacyExtraKeys);
                }
                continue;
            }
            let (mut kind, mut value) = (None, None);
            let n = r.map_len()?;
            for _ in 0..n {
                if !r.is_str()? {
                    r.skip()?;
                    r.skip()?;
                    continue;
                }
                match r.str()? {
                    "type" => kind = Some(r.str()?),
                    "name" | "salt" if r.is_str()? => value = Some(r.str()?),
                    _ => r.skip()?,
                }
            }
            match (kind, value) {
                (Some("lora"), Some(name)) => {
                    out.lora_name.get_or_insert(name);
                }
                // vLLM salts the first block only; elsewhere it would mean
                // a hash rule kvgate does not follow.
                (Some("cache_salt"), Some(salt)) if block == 0 => out.cache_salt = Some(salt),
                (Some("mm"), _) => out.mark(block, Unmatchable::Multimodal),
                (Some("prompt_embeds"), _) => out.mark(block, Unmatchable::PromptEmbeds),
                (Some("legacy"), _) => out.mark(block, Unmatchable::LegacyExtraKeys),
                _ => out.mark(block, Unmatchable::UnknownExtraKey),
            }
        }
    }
    Ok(out)
}

impl ExtraKeys<'_> {
    fn mark(&mut self, block: usize, why: Unmatchable) {
        if self.unmatchable_from.is_none_or(|(b, _)| block < b) {
            self.unmatchable_from = Some((block, why));
        }
    }
}

#[derive(Default)]
struct StoredFields<'a> {
    parent: Option<EngineHash>,
    block_size: u32,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    lora_id: bool,
    cache_salt: Option<&'a str>,
    extra: ExtraKeys<'a>,
    group_idx: i64,
    spec_kind: Option<&'a str>,
    local: bool,
    have_hashes: bool,
    have_tokens: bool,
}

fn positional(
    r: &mut Reader<'_>,
    s: &mut Scratch,
    visit: &mut impl FnMut(Event<'_>),
) -> Result<(), WireError> {
    let n = r.array_len()?;
    if n == 0 {
        return Err(malformed("empty positional event"));
    }
    let tag = r.str()?;
    match tag {
        "BlockStored" => {
            let mut f = StoredFields {
                local: true,
                ..Default::default()
            };
            for i in 1..n {
                match i {
                    1 => {
                        hashes(r, &mut s.hashes)?;
                        f.have_hashes = true;
                    }
                    2 => f.parent = opt_hash(r)?,
                    3 => {
                        tokens(r, &mut s.tokens)?;
                        f.have_tokens = true;
                    }
                    4 => f.block_size = r.u32()?,
                    5 => f.lora_id = present(r)?,
                    6 => f.medium = opt_str(r)?,
                    7 => lora_or_salt(r, &mut f)?,
                    8 => f.extra = extra_keys(r, f.lora_name)?,
                    9 => f.group_idx = opt_i64(r, 0)?,
                    10 => f.spec_kind = opt_str(r)?,
                    _ => r.skip()?, // sliding window, newer fields
                }
            }
            emit_stored(f, s, visit)
        }
        "BlockRemoved" => {
            let (mut medium, mut group_idx, mut have) = (None, 0, false);
            for i in 1..n {
                match i {
                    1 => {
                        hashes(r, &mut s.hashes)?;
                        have = true;
                    }
                    2 => medium = opt_str(r)?,
                    3 => group_idx = opt_i64(r, 0)?,
                    _ => r.skip()?,
                }
            }
            if !have {
                return Err(malformed("BlockRemoved without block_hashes"));
            }
            visit(Event::Removed {
                hashes: &s.hashes,
                medium: Medium::parse(medium),
                group_idx,
            });
            Ok(())
        }
        "AllBlocksCleared" => {
            for _ in 1..n {
                r.skip()?;
            }
            visit(Event::Cleared);
            Ok(())
        }
        other => {
            for _ in 1..n {
                r.skip()?;
            }
            visit(Event::Unknown { tag: other });
            Ok(())
        }
    }
}

fn tagged(
    r: &mut Reader<'_>,
    s: &mut Scratch,
    visit: &mut impl FnMut(Event<'_>),
) -> Result<(), WireError> {
    let n = r.map_len()?;
    let mut tag = None;
    let mut f = StoredFields {
        local: true,
        ..Default::default()
    };
    for _ in 0..n {
        if !r.is_str()? {
            r.skip()?;
            r.skip()?;
            continue;
        }
        match r.str()? {
            "type" => tag = Some(r.str()?),
            "block_hashes" => {
                hashes(r, &mut s.hashes)?;
                f.have_hashes = true;
            }
            "parent_block_hash" => f.parent = opt_hash(r)?,
            "token_ids" => {
                tokens(r, &mut s.tokens)?;
                f.have_tokens = true;
            }
            "block_size" => f.block_size = r.u32()?,
            "medium" => f.medium = opt_str(r)?,
            "lora_name" => f.lora_name = opt_str(r)?,
            "lora_id" => f.lora_id = present(r)?,
            "cache_salt" => f.cache_salt = opt_str(r)?,
            "extra_keys" => f.extra = extra_keys(r, f.lora_name)?,
            "group_idx" => f.group_idx = opt_i64(r, 0)?,
            "kv_cache_spec_kind" => f.spec_kind = opt_str(r)?,
            "locality" => f.local = !matches!(opt_str(r)?, Some("REMOTE")),
            _ => r.skip()?,
        }
    }
    match tag {
        Some("BlockStored") => emit_stored(f, s, visit),
        Some("BlockRemoved") => {
            if !f.have_hashes {
                return Err(malformed("BlockRemoved without block_hashes"));
            }
            visit(Event::Removed {
                hashes: &s.hashes,
                medium: Medium::parse(f.medium),
                group_idx: f.group_idx,
            });
            Ok(())
        }
        Some("AllBlocksCleared") => {
            visit(Event::Cleared);
            Ok(())
        }
        Some(other) => {
            visit(Event::Unknown { tag: other });
            Ok(())
        }
        None => Err(malformed("tagged event without \"type\"")),
    }
}

fn emit_stored(
    f: StoredFields<'_>,
    s: &Scratch,
    visit: &mut impl FnMut(Event<'_>),
) -> Result<(), WireError> {
    if !f.have_hashes || !f.have_tokens {
        return Err(malformed("BlockStored without block_hashes or token_ids"));
    }
    let lora_name = f.lora_name.or(f.extra.lora_name).filter(|n| !n.is_empty());
    let mut unmatchable_from = f.extra.unmatchable_from;
    if f.lora_id && lora_name.is_none() {
        unmatchable_from = Some((0, Unmatchable::LoraIdWithoutName));
    }
    visit(Event::Stored(Stored {
        hashes: &s.hashes,
        parent: f.parent,
        tokens: &s.tokens,
        block_size: f.block_size,
        medium: Medium::parse(f.medium),
        lora_name,
        cache_salt: f
            .cache_salt
            .or(f.extra.cache_salt)
            .filter(|s| !s.is_empty()),
        unmatchable_from,
        group_idx: f.group_idx,
        spec_kind: f.spec_kind,
        local: f.local,
    }));
    Ok(())
}

#[cfg(test)]
mod tests;
