//! The change log: which index shards the last updates rewrote.
//!
//! Under load the sidecar publishes every few milliseconds, and most
//! updates rewrite a few shards of thousands, or none (a snapshot alone,
//! as loads move). A router VM that keeps shards between requests would
//! otherwise have to forget all of them at every update. The snapshot
//! service writes this log after the shards and before the manifest; a VM
//! that sees a newer update reads it once and forgets only the shards
//! listed since the update it last saw.
//!
//! Shards are named by [`key_hash`] of their shared-data key: a collision
//! can only make a VM forget a shard it could have kept.
//!
//! Layout, little-endian:
//!
//! ```text
//! u8  format (1)
//! u64 epoch                the sidecar's, as in the manifest
//! u64 from                 every shard rewritten after update `from`
//! u64 newest               and up to update `newest` is listed
//! u32 entry count
//! per entry: u64 update version, u32 n, [u64; n] key hashes
//! ```

use kvgate_core::wire::{Reader, WireError};
use std::collections::VecDeque;
use thiserror::Error;

pub const KEY: &str = "kvgate.changes";
const FORMAT: u8 = 1;

/// Updates the log lists at most; older ones fall off the front.
const MAX_ENTRIES: usize = 64;
/// Key hashes it lists at most (32 KiB): an update that rewrites more
/// starts the log over, and every VM forgets what it keeps.
const MAX_HASHES: usize = 4096;

/// The shared-data key's hash the log lists and a VM's shard cache is
/// keyed by: a multiply per eight bytes, folded at the end. The keys are
/// the filter's own (`kvgate.idx.<model>.<shard>`), so a hash built to
/// resist chosen keys buys nothing here.
pub fn key_hash(key: &str) -> u64 {
    let mut h = 0u64;
    for chunk in key.as_bytes().chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(0x51_7C_C1_B7_27_22_0A_95);
    }
    // The high bits, where a key's shard number lands, folded down.
    let x = (h ^ (h >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// The snapshot service's side: the log it rewrites with every update.
#[derive(Debug, Default)]
pub struct ChangeLog {
    epoch: u64,
    from: u64,
    newest: u64,
    entries: VecDeque<(u64, Vec<u64>)>,
    hashes: usize,
}

impl ChangeLog {
    /// A log that lists nothing before `version`: a VM that saw an older
    /// update forgets every shard it keeps.
    pub fn starting_at(epoch: u64, version: u64) -> ChangeLog {
        ChangeLog {
            epoch,
            from: version,
            newest: version,
            ..ChangeLog::default()
        }
    }

    /// Records update `version`, which rewrote the shards `keys`. A reset,
    /// another epoch, a version that goes back or more keys than the log
    /// holds start it over at `version`.
    pub fn record<'k>(
        &mut self,
        epoch: u64,
        version: u64,
        reset: bool,
        keys: impl ExactSizeIterator<Item = &'k str>,
    ) {
        if reset || epoch != self.epoch || version < self.newest || keys.len() > MAX_HASHES {
            *self = ChangeLog::starting_at(epoch, version);
            return;
        }
        self.newest = version;
        if keys.len() == 0 {
            return;
        }
        let hashes: Vec<u64> = keys.map(key_hash).collect();
        self.hashes += hashes.len();
        self.entries.push_back((version, hashes));
        while self.entries.len() > MAX_ENTRIES || self.hashes > MAX_HASHES {
            let Some((dropped, h)) = self.entries.pop_front() else {
                break;
            };
            self.hashes -= h.len();
            self.from = dropped;
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(29 + self.entries.len() * 12 + self.hashes * 8);
        out.push(FORMAT);
        for v in [self.epoch, self.from, self.newest] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for (version, hashes) in &self.entries {
            out.extend_from_slice(&version.to_le_bytes());
            out.extend_from_slice(&(hashes.len() as u32).to_le_bytes());
            for h in hashes {
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        out
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ChangesError {
    #[error("change log {0}")]
    Wire(#[from] WireError),
    #[error("change log format {0} is not supported")]
    Format(u8),
}

/// A router VM's side: the log as read from shared data, checked whole.
#[derive(Debug)]
pub struct Changes<'a> {
    pub epoch: u64,
    pub from: u64,
    pub newest: u64,
    /// Each listed update's version and its key hashes' bytes.
    entries: Vec<(u64, &'a [u8])>,
}

impl<'a> Changes<'a> {
    pub fn decode(b: &'a [u8]) -> Result<Changes<'a>, ChangesError> {
        let mut r = Reader::new(b);
        let format = r.u8()?;
        if format != FORMAT {
            return Err(ChangesError::Format(format));
        }
        let (epoch, from, newest) = (r.u64()?, r.u64()?, r.u64()?);
        let count = r.u32()?;
        r.plausible(count, 12, "change log entries")?;
        let mut entries = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let version = r.u64()?;
            let n = r.u32()?;
            r.plausible(n, 8, "changed shards")?;
            entries.push((version, r.take(n as usize * 8)?));
        }
        Ok(Changes {
            epoch,
            from,
            newest,
            entries,
        })
    }

    /// The key hashes of every shard rewritten after update `after`.
    pub fn since(&self, after: u64) -> impl Iterator<Item = u64> + '_ {
        self.entries
            .iter()
            .filter(move |(v, _)| *v > after)
            .flat_map(|(_, b)| b.chunks_exact(8))
            .map(|w| {
                let mut a = [0u8; 8];
                a.copy_from_slice(w);
                u64::from_le_bytes(a)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys<'a>(names: &'a [&'static str]) -> impl ExactSizeIterator<Item = &'static str> + 'a {
        names.iter().copied()
    }

    fn since(log: &ChangeLog, after: u64) -> Vec<u64> {
        let b = log.encode();
        Changes::decode(&b).unwrap().since(after).collect()
    }

    #[test]
    fn lists_what_each_update_rewrote_after_a_version() {
        let mut log = ChangeLog::starting_at(7, 10);
        log.record(7, 11, false, keys(&["a", "b"]));
        log.record(7, 12, false, keys(&[]));
        log.record(7, 14, false, keys(&["c"]));
        let b = log.encode();
        let c = Changes::decode(&b).unwrap();
        assert_eq!((c.epoch, c.from, c.newest), (7, 10, 14));
        let h = |k| key_hash(k);
        assert_eq!(c.since(10).collect::<Vec<_>>(), [h("a"), h("b"), h("c")]);
        assert_eq!(c.since(11).collect::<Vec<_>>(), [h("c")]);
        assert_eq!(c.since(14).count(), 0);
    }

    #[test]
    fn a_reset_another_epoch_or_a_step_back_starts_over() {
        let mut log = ChangeLog::starting_at(7, 10);
        log.record(7, 11, false, keys(&["a"]));
        log.record(7, 12, true, keys(&["a"]));
        assert_eq!((log.from, log.newest, log.entries.len()), (12, 12, 0));
        log.record(7, 13, false, keys(&["a"]));
        log.record(8, 2, false, keys(&["a"]));
        assert_eq!((log.epoch, log.from, log.newest), (8, 2, 2));
        log.record(8, 3, false, keys(&["a"]));
        log.record(8, 1, false, keys(&["b"]));
        assert_eq!((log.from, log.newest, log.entries.len()), (1, 1, 0));
    }

    #[test]
    fn stays_bounded_and_says_from_where_it_is_complete() {
        let mut log = ChangeLog::starting_at(1, 0);
        for v in 1..=(MAX_ENTRIES as u64 + 5) {
            log.record(1, v, false, keys(&["a"]));
        }
        assert_eq!(log.entries.len(), MAX_ENTRIES);
        assert_eq!(log.from, 5, "updates 1 to 5 fell off");
        assert_eq!(since(&log, 5).len(), MAX_ENTRIES);
        let many: Vec<String> = (0..MAX_HASHES - 10).map(|i| i.to_string()).collect();
        log.record(1, 100, false, many.iter().map(String::as_str));
        assert!(log.hashes <= MAX_HASHES);
        assert!(log.encode().len() <= 29 + MAX_ENTRIES * 12 + MAX_HASHES * 8);
        assert_eq!(log.entries.back().map(|e| e.0), Some(100));
        assert!(log.from >= 59, "older entries made room: from {}", log.from);
        let more: Vec<String> = (0..=MAX_HASHES).map(|i| i.to_string()).collect();
        log.record(1, 101, false, more.iter().map(String::as_str));
        assert_eq!((log.from, log.newest, log.hashes), (101, 101, 0));
    }

    #[test]
    fn bad_logs_are_refused() {
        let mut log = ChangeLog::starting_at(1, 0);
        log.record(1, 1, false, keys(&["a", "b"]));
        let good = log.encode();
        for cut in 0..good.len() {
            assert!(Changes::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut other = good.clone();
        other[0] = 2;
        assert_eq!(
            Changes::decode(&other).unwrap_err(),
            ChangesError::Format(2)
        );
        // An entry count the bytes cannot hold allocates nothing.
        let mut huge = good[..25].to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Changes::decode(&huge),
            Err(ChangesError::Wire(WireError::ImplausibleCount { .. }))
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(c) = Changes::decode(&b) {
                let _ = c.since(0).count();
            }
        }
    }
}
