//! The prefix index in a recovery format (`GET /dump`): what a sidecar
//! starting up replays into its empty index instead of waiting for every
//! engine to store its cache again (`[indexer] peers`).
//!
//! A dump names each rank by `(model, worker_id, dp_rank)`, never by slot:
//! slot numbers are local to one sidecar. Per rank it holds every block
//! the rank's table keeps by engine hash, which is exactly what a later
//! event resolves against: the engine hash (a `BlockRemoved`, a child's
//! `parent_block_hash`), kvgate's sequence hash (the shards), the tiers
//! the block is in, and whether it is unmatchable (kept for removals and
//! children, never matched, and it makes its children unmatchable).
//!
//! Chains an engine stores in pages of another size than the worker's
//! block (SGLang's default page size 1) are not dumped: their pages carry
//! token tails and chain state that would double the format for a case
//! that has a cheaper fix (the engine's page size). Their blocks are
//! relearnt from the events; children of such pages arriving before then
//! are orphans, as they would be after a restart without recovery.
//!
//! # Format, version 1
//!
//! Integers are little-endian; `str16` is a u16 byte length and UTF-8.
//!
//! | field | type | |
//! | --- | --- | --- |
//! | magic | 4 bytes | `KVGD` |
//! | version | u16 | 1 |
//! | flags | u16 | 0; anything else is refused |
//! | created_at_ms | u64 | the producer's Unix time when it snapshotted its index |
//! | groups | u32 | then each group: |
//! | · model | str16 | |
//! | · worker_id | u64 | |
//! | · dp_rank | u32 | |
//! | · block_size | u32 | tokens per block: a rank of another size is not replayed |
//! | · runs | u32 | then each run: |
//! | · · flags | u8 | tier bits (device 1, host 2, disk 4; at least one) and 0x80 unmatchable |
//! | · · count | u32 | then `count` blocks of: |
//! | · · · engine_hash | u64 | the engine's hash as kvgate keys it (byte digests hashed, see `wire::EngineHash`) |
//! | · · · sequence_hash | u64 | kvgate's sequence hash (`kvgate_core::hash::chain`) |
//! | checksum | u64 | xxh3-64 of every byte before it |
//!
//! Groups come in ascending `(model, worker_id, dp_rank)` order, each once;
//! within a group blocks are grouped into runs of equal flags, each run
//! sorted by engine hash, so a dump of the same index is the same bytes.
//! A block costs 16 bytes: 1.6M blocks dump in about 26 MB.
//!
//! The version names the sequence-hash scheme too: a build that hashes
//! blocks differently must bump it, or its peers would replay hashes no
//! request of theirs produces.
//!
//! A dump is outside input. [`decode`] checks the checksum before reading
//! anything else (a truncated body fails there), bounds every count by the
//! bytes present before allocating, refuses unknown flags and trailing
//! bytes, and decodes the whole dump before the caller replays any of it.

use kvgate_core::shard::{TIER_DEVICE, TIER_DISK, TIER_HOST};
use kvgate_core::wire::{Reader, WireError};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

use super::wire::EngineHash;

pub const MAGIC: [u8; 4] = *b"KVGD";
pub const VERSION: u16 = 1;
/// The flag byte's unmatchable bit; the low bits are the tiers.
const UNMATCHABLE: u8 = 0x80;
const TIERS: u8 = TIER_DEVICE | TIER_HOST | TIER_DISK;

/// magic, version, flags, created_at_ms, groups.
const HEADER: usize = 4 + 2 + 2 + 8 + 4;
const CHECKSUM: usize = 8;
/// model (empty), worker_id, dp_rank, block_size, runs.
const MIN_GROUP: usize = 2 + 8 + 4 + 4 + 4;
const RUN_HEADER: usize = 1 + 4;
const BLOCK: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DumpError {
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("{0} bytes is too short for a dump")]
    Short(usize),
    #[error("not a kvgate index dump (magic {0:02x?})")]
    Magic([u8; 4]),
    #[error("dump version {0}, this build reads version {VERSION}")]
    Version(u16),
    #[error("dump flags {0:#06x} are unknown to this build")]
    Flags(u16),
    #[error("checksum mismatch: the dump is truncated or corrupted")]
    Checksum,
    #[error(
        "group {index} ({model:?}, worker {worker_id}, rank {dp_rank}) is out of order or repeated"
    )]
    Order {
        index: usize,
        model: String,
        worker_id: u64,
        dp_rank: u32,
    },
    #[error("block flags {0:#04x} name no tier or an unknown bit")]
    BlockFlags(u8),
    #[error("{0} bytes after the last group")]
    Trailing(usize),
}

/// One block a rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Block {
    pub engine: EngineHash,
    pub seq: u64,
    /// `kvgate_core::shard::TIER_*` bits, at least one.
    pub tiers: u8,
    /// No request can match it; kept so removals and children resolve.
    pub unmatchable: bool,
}

impl Block {
    fn flags(&self) -> u8 {
        self.tiers | if self.unmatchable { UNMATCHABLE } else { 0 }
    }
}

/// A run's flag byte as (tiers, unmatchable).
fn parse_flags(flags: u8) -> Result<(u8, bool), DumpError> {
    let tiers = flags & TIERS;
    if tiers == 0 || flags & !(TIERS | UNMATCHABLE) != 0 {
        return Err(DumpError::BlockFlags(flags));
    }
    Ok((tiers, flags & UNMATCHABLE != 0))
}

/// What one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub model: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub block_size: u32,
    pub blocks: Vec<Block>,
}

impl Group {
    fn key(&self) -> (&str, u64, u32) {
        (&self.model, self.worker_id, self.dp_rank)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dump {
    pub created_at_ms: u64,
    pub groups: Vec<Group>,
}

impl Dump {
    pub fn blocks(&self) -> usize {
        self.groups.iter().map(|g| g.blocks.len()).sum()
    }
}

/// Encodes `dump`, putting its groups and blocks in the canonical order
/// first (which is why it takes the dump: sorting in place saves a copy of
/// a possibly large index).
pub fn encode(mut dump: Dump) -> Vec<u8> {
    dump.groups.sort_unstable_by(|a, b| a.key().cmp(&b.key()));
    let size = HEADER
        + CHECKSUM
        + dump
            .groups
            .iter()
            .map(|g| MIN_GROUP + g.model.len() + 8 * RUN_HEADER + g.blocks.len() * BLOCK)
            .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&dump.created_at_ms.to_le_bytes());
    out.extend_from_slice(&len32(dump.groups.len()).to_le_bytes());
    for g in &mut dump.groups {
        // A model name is a catalog key, far under 64 KiB; cut rather than
        // write a length that lies.
        let name = &g.model.as_bytes()[..g.model.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&g.worker_id.to_le_bytes());
        out.extend_from_slice(&g.dp_rank.to_le_bytes());
        out.extend_from_slice(&g.block_size.to_le_bytes());
        g.blocks
            .sort_unstable_by_key(|b| (b.flags(), b.engine, b.seq));
        let runs: Vec<&[Block]> = g.blocks.chunk_by(|a, b| a.flags() == b.flags()).collect();
        out.extend_from_slice(&len32(runs.len()).to_le_bytes());
        for run in runs {
            // A run of more than u32::MAX blocks (never: the per-rank bound
            // is far lower) would be split by the encoder, not truncated.
            for part in run.chunks(u32::MAX as usize) {
                out.push(part[0].flags());
                out.extend_from_slice(&len32(part.len()).to_le_bytes());
                for b in part {
                    out.extend_from_slice(&b.engine.to_le_bytes());
                    out.extend_from_slice(&b.seq.to_le_bytes());
                }
            }
        }
    }
    let sum = xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Rewrites the checksum at the end of `bytes` over what precedes it, as a
/// producer sealing whatever it wrote would: tests and fuzzing use it to
/// reach the checks behind the checksum.
pub fn reseal(bytes: &mut [u8]) {
    if let Some(body) = bytes.len().checked_sub(CHECKSUM) {
        let sum = xxh3_64(&bytes[..body]);
        bytes[body..].copy_from_slice(&sum.to_le_bytes());
    }
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Decodes a whole dump, or says why it is not one.
pub fn decode(bytes: &[u8]) -> Result<Dump, DumpError> {
    if bytes.len() < HEADER + CHECKSUM {
        return Err(DumpError::Short(bytes.len()));
    }
    let mut r = Reader::new(bytes);
    let magic = r.array::<4>()?;
    if magic != MAGIC {
        return Err(DumpError::Magic(magic));
    }
    let version = r.u16()?;
    if version != VERSION {
        return Err(DumpError::Version(version));
    }
    let (body, sum) = bytes.split_at(bytes.len() - CHECKSUM);
    if u64::from_le_bytes(sum.try_into().map_err(|_| DumpError::Checksum)?) != xxh3_64(body) {
        return Err(DumpError::Checksum);
    }
    let mut r = Reader::at(body, 6);
    let flags = r.u16()?;
    if flags != 0 {
        return Err(DumpError::Flags(flags));
    }
    let created_at_ms = r.u64()?;
    let count = r.u32()?;
    r.plausible(count, MIN_GROUP, "groups")?;
    let mut groups: Vec<Group> = Vec::with_capacity(count as usize);
    for index in 0..count as usize {
        let g = group(&mut r)?;
        if let Some(prev) = groups.last()
            && prev.key() >= g.key()
        {
            return Err(DumpError::Order {
                index,
                model: g.model,
                worker_id: g.worker_id,
                dp_rank: g.dp_rank,
            });
        }
        groups.push(g);
    }
    if !r.is_empty() {
        return Err(DumpError::Trailing(r.remaining()));
    }
    Ok(Dump {
        created_at_ms,
        groups,
    })
}

fn group(r: &mut Reader<'_>) -> Result<Group, DumpError> {
    let model = r.string16()?;
    let worker_id = r.u64()?;
    let dp_rank = r.u32()?;
    let block_size = r.u32()?;
    let runs = r.u32()?;
    r.plausible(runs, RUN_HEADER, "runs")?;
    let mut blocks = Vec::new();
    for _ in 0..runs {
        let (tiers, unmatchable) = parse_flags(r.u8()?)?;
        let count = r.u32()?;
        r.plausible(count, BLOCK, "blocks")?;
        blocks.reserve(count as usize);
        for _ in 0..count {
            blocks.push(Block {
                engine: r.u64()?,
                seq: r.u64()?,
                tiers,
                unmatchable,
            });
        }
    }
    Ok(Group {
        model,
        worker_id,
        dp_rank,
        block_size,
        blocks,
    })
}

#[cfg(test)]
mod tests;
