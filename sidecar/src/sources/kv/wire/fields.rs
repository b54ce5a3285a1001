//! Readers for the fields of one event, shared by both event shapes.

use super::{EngineHash, Unmatchable, bytes_hash};
use crate::sources::kv::msgpack::{MsgpackError, Reader};

/// Reads a list of block hashes into `out`.
pub(super) fn hashes(r: &mut Reader<'_>, out: &mut Vec<EngineHash>) -> Result<(), MsgpackError> {
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

pub(super) fn hash(r: &mut Reader<'_>) -> Result<EngineHash, MsgpackError> {
    match r.peek()? {
        0xc4..=0xc6 => Ok(bytes_hash(r.bin()?)),
        _ => Ok(r.int()?.as_u64_bits()),
    }
}

pub(super) fn opt_hash(r: &mut Reader<'_>) -> Result<Option<EngineHash>, MsgpackError> {
    if r.nil()? {
        Ok(None)
    } else {
        Ok(Some(hash(r)?))
    }
}

pub(super) fn tokens(r: &mut Reader<'_>, out: &mut Vec<u32>) -> Result<(), MsgpackError> {
    out.clear();
    let n = r.array_len()?;
    out.reserve(n);
    for _ in 0..n {
        out.push(r.u32()?);
    }
    Ok(())
}

pub(super) fn opt_str<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, MsgpackError> {
    if r.nil()? {
        Ok(None)
    } else {
        Ok(Some(r.str()?))
    }
}

/// Whether a value is there (not nil), skipping it.
pub(super) fn present(r: &mut Reader<'_>) -> Result<bool, MsgpackError> {
    if r.nil()? {
        return Ok(false);
    }
    r.skip()?;
    Ok(true)
}

pub(super) fn opt_i64(r: &mut Reader<'_>, default: i64) -> Result<i64, MsgpackError> {
    if r.nil()? {
        Ok(default)
    } else {
        Ok(r.int()?.as_u64_bits() as i64)
    }
}

/// SGLang's salted store puts `{"cache_salt": ...}` where vLLM has
/// `lora_name`; tell them apart by type.
pub(super) fn lora_or_salt<'a>(
    r: &mut Reader<'a>,
    st: &mut StoredFields<'a>,
) -> Result<(), MsgpackError> {
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
pub(super) struct ExtraKeys<'a> {
    pub(super) lora_name: Option<&'a str>,
    pub(super) cache_salt: Option<&'a str>,
    pub(super) unmatchable_from: Option<(usize, Unmatchable)>,
}

/// Reads `extra_keys`: nil, or one entry per block, each nil or a list of
/// keys — typed maps (`{"type": "lora" | "cache_salt" | "mm" |
/// "prompt_embeds" | "legacy", ...}`) in current vLLM, bare values in
/// older releases. Only the adapter name and a salt on the first block can
/// be reproduced from a request; anything else makes that block, and the
/// blocks chained after it, unmatchable. `lora_name` is the event's own
/// (declared, and so encoded, before `extra_keys`).
pub(super) fn extra_keys<'a>(
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
pub(super) struct StoredFields<'a> {
    pub(super) parent: Option<EngineHash>,
    pub(super) block_size: u32,
    pub(super) medium: Option<&'a str>,
    pub(super) lora_name: Option<&'a str>,
    pub(super) lora_id: bool,
    pub(super) cache_salt: Option<&'a str>,
    pub(super) extra: ExtraKeys<'a>,
    pub(super) group_idx: i64,
    pub(super) spec_kind: Option<&'a str>,
    pub(super) local: bool,
    pub(super) have_hashes: bool,
    pub(super) have_tokens: bool,
}
