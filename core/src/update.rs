//! The update frame: what one long-poll response from the sidecar carries.
//!
//! The sidecar keeps a single version counter for everything it publishes
//! (load snapshots and KV index shards). A reader asks for "everything after
//! version V of epoch E" and gets a frame holding the new snapshot (if it
//! changed) and every shard changed since V. The epoch is random per sidecar
//! process: a reader whose epoch differs (the sidecar restarted, or the
//! reader is new) gets a *reset* frame with the full state, and must treat
//! every shard it holds but the frame does not mention as empty.
//!
//! Layout, little-endian:
//!
//! ```text
//! "KVGU" u16 major u16 minor u32 payload_len
//! u64 version  u64 epoch  u8 flags (1 = reset)
//! u32 snapshot_len, snapshot bytes (0 = snapshot unchanged)
//! u32 shard count, per shard: u16 model_len, model, u32 shard, u32 len, bytes
//! ```

use crate::wire::{Reader, WireError};
use thiserror::Error;

pub const MAGIC: [u8; 4] = *b"KVGU";
pub const MAJOR: u16 = 1;
pub const MINOR: u16 = 0;
const HEADER: usize = 4 + 2 + 2 + 4;
pub const FLAG_RESET: u8 = 1;

/// A decoded update, borrowing from the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update<'a> {
    pub version: u64,
    pub epoch: u64,
    pub reset: bool,
    /// The encoded snapshot (`kvgate_core::snapshot`), when it changed.
    pub snapshot: Option<&'a [u8]>,
    pub shards: Vec<ShardBytes<'a>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardBytes<'a> {
    pub model: &'a str,
    pub shard: u32,
    pub bytes: &'a [u8],
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum UpdateError {
    #[error("update {0}")]
    Wire(#[from] WireError),
    #[error("not a kvgate update (bad magic)")]
    BadMagic,
    #[error("update major version {0} is not supported (this build reads {MAJOR})")]
    UnsupportedMajor(u16),
    #[error("update length {declared} does not match the {actual} bytes present")]
    Length { declared: usize, actual: usize },
}

/// Encodes a frame. `shards` yields (model, shard, bytes).
pub fn encode<'a>(
    version: u64,
    epoch: u64,
    reset: bool,
    snapshot: Option<&[u8]>,
    shards: impl IntoIterator<Item = (&'a str, u32, &'a [u8])>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + snapshot.map_or(0, <[u8]>::len));
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&MAJOR.to_le_bytes());
    out.extend_from_slice(&MINOR.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    out.push(if reset { FLAG_RESET } else { 0 });
    let snap = snapshot.unwrap_or(&[]);
    out.extend_from_slice(&(snap.len() as u32).to_le_bytes());
    out.extend_from_slice(snap);
    let count_at = out.len();
    out.extend_from_slice(&0u32.to_le_bytes());
    let mut count = 0u32;
    for (model, shard, bytes) in shards {
        let name = &model.as_bytes()[..model.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&shard.to_le_bytes());
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
        count += 1;
    }
    out[count_at..count_at + 4].copy_from_slice(&count.to_le_bytes());
    let payload = (out.len() - HEADER) as u32;
    out[8..12].copy_from_slice(&payload.to_le_bytes());
    out
}

pub fn decode(bytes: &[u8]) -> Result<Update<'_>, UpdateError> {
    let mut c = Reader::new(bytes);
    if c.take(4)? != MAGIC {
        return Err(UpdateError::BadMagic);
    }
    let major = c.u16()?;
    if major != MAJOR {
        return Err(UpdateError::UnsupportedMajor(major));
    }
    let _minor = c.u16()?;
    let declared = c.u32()? as usize;
    let actual = bytes.len() - HEADER;
    if declared != actual {
        return Err(UpdateError::Length { declared, actual });
    }
    let version = c.u64()?;
    let epoch = c.u64()?;
    let flags = c.u8()?;
    let snap_len = c.u32()? as usize;
    let snapshot = if snap_len == 0 {
        None
    } else {
        Some(c.take(snap_len)?)
    };
    let count = c.u32()?;
    // Each shard entry is at least 10 bytes.
    c.plausible(count, 10, "shards")?;
    let mut shards = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let model = c.str16()?;
        let shard = c.u32()?;
        let len = c.u32()? as usize;
        let bytes = c.take(len)?;
        shards.push(ShardBytes {
            model,
            shard,
            bytes,
        });
    }
    Ok(Update {
        version,
        epoch,
        reset: flags & FLAG_RESET != 0,
        snapshot,
        shards,
    })
}

/// The shared-data key of one shard. One place defines it so the writer
/// (the snapshot service) and the readers (the router VMs) agree.
pub fn shard_key(model: &str, shard: u32) -> String {
    format!("{SHARD_KEY_PREFIX}{model}.{shard}")
}

const SHARD_KEY_PREFIX: &str = "kvgate.idx.";

/// The model and shard a [`shard_key`] names.
pub fn parse_shard_key(key: &str) -> Option<(&str, u32)> {
    let (model, shard) = key.strip_prefix(SHARD_KEY_PREFIX)?.rsplit_once('.')?;
    Some((model, shard.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let snap = [1u8, 2, 3];
        let f = encode(
            7,
            99,
            true,
            Some(&snap),
            [("m", 3, &b"abc"[..]), ("other", 0, &b""[..])],
        );
        let u = decode(&f).unwrap();
        assert_eq!((u.version, u.epoch, u.reset), (7, 99, true));
        assert_eq!(u.snapshot, Some(&snap[..]));
        assert_eq!(u.shards.len(), 2);
        assert_eq!(
            u.shards[0],
            ShardBytes {
                model: "m",
                shard: 3,
                bytes: b"abc"
            }
        );
        assert_eq!(u.shards[1].bytes, b"");
        let f = encode(8, 99, false, None, []);
        let u = decode(&f).unwrap();
        assert_eq!((u.snapshot, u.shards.len(), u.reset), (None, 0, false));
    }

    #[test]
    fn errors() {
        let f = encode(1, 1, false, Some(&[9; 10]), [("m", 1, &[1u8, 2][..])]);
        for cut in 0..f.len() {
            assert!(decode(&f[..cut]).is_err(), "cut {cut}");
        }
        let mut bad = f.clone();
        bad[4] = 2;
        assert_eq!(decode(&bad), Err(UpdateError::UnsupportedMajor(2)));
        bad[0] = b'X';
        assert_eq!(decode(&bad), Err(UpdateError::BadMagic));
    }

    #[test]
    fn shard_keys_are_stable() {
        assert_eq!(shard_key("llama-3", 12), "kvgate.idx.llama-3.12");
        assert_eq!(
            parse_shard_key(&shard_key("meta/llama-3.1", 7)),
            Some(("meta/llama-3.1", 7))
        );
        assert_eq!(parse_shard_key("kvgate.idx.m"), None);
        assert_eq!(parse_shard_key("kvgate.idx.m.x"), None);
        assert_eq!(parse_shard_key("other.m.1"), None);
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode(&b);
        }
    }
}
