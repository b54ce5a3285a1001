//! The two shapes of an event: positional arrays and tagged maps.

use super::fields::{
    StoredFields, extra_keys, hashes, lora_or_salt, opt_hash, opt_i64, opt_str, present, tokens,
};
use super::{Event, Medium, Scratch, Stored, Unmatchable, WireError, malformed};
use crate::sources::kv::msgpack::Reader;

pub(super) fn positional(
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

pub(super) fn tagged(
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

pub(super) fn emit_stored(
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
