//! Index shards: the KV index as the filter reads it.
//!
//! The sidecar owns the full prefix index. Envoy gets it cut into a fixed
//! number of shards per model, each stored under its own shared-data key, so
//! that:
//!
//! * a request reads only the few shards its prefix search touches (a binary
//!   search over the request's blocks, see [`overlaps`]), never the whole index;
//! * a change rewrites only the shards it touched, which is what the sidecar
//!   publishes (the delta);
//! * Envoy's memory holds the index once, in shared data, instead of once per
//!   worker VM.
//!
//! A shard maps a block's sequence hash to its *holders*: the slots
//! (worker-rank pairs, numbered by the load snapshot) that cache the block,
//! and in which tiers. Layout, little-endian:
//!
//! ```text
//! u8  format (1)
//! u32 entry count n
//! [u64; n]     sequence hashes, strictly ascending
//! [u32; n + 1] holder offsets into the holder bytes (first 0, last = length)
//! holder bytes: per holder 3 bytes: u16 slot, u8 tier bits (1 device, 2 host, 4 disk)
//! ```
//!
//! Hashes are searched in place; a lookup copies nothing.

use crate::wire::{Reader, WireError};
use thiserror::Error;

pub const SHARD_FORMAT: u8 = 1;
pub const TIER_DEVICE: u8 = 1;
pub const TIER_HOST: u8 = 2;
pub const TIER_DISK: u8 = 4;
const HOLDER_LEN: usize = 3;

/// Which shard a sequence hash lives in. The high bits are used because the
/// low bits also pick hash-table buckets in the sidecar.
pub fn shard_of(seq_hash: u64, shard_count: u32) -> u32 {
    if shard_count == 0 {
        return 0;
    }
    (((seq_hash >> 32) * u64::from(shard_count)) >> 32) as u32
}

/// One block's holder: a slot and its tier bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder {
    pub slot: u16,
    pub tiers: u8,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ShardError {
    #[error("shard {0}")]
    Wire(#[from] WireError),
    #[error("shard format {0} is not supported")]
    Format(u8),
    #[error("shard offsets are inconsistent")]
    Offsets,
    #[error("shard hashes are not strictly ascending")]
    Unsorted,
}

/// Encodes entries given in any order; holders of equal hashes must already
/// be merged by the caller (the sidecar's index has one entry per hash).
pub fn encode(entries: &mut [(u64, Vec<Holder>)]) -> Vec<u8> {
    entries.sort_unstable_by_key(|e| e.0);
    let n = entries.len();
    let holders: usize = entries.iter().map(|e| e.1.len()).sum();
    let mut out = Vec::with_capacity(5 + n * 12 + 4 + holders * HOLDER_LEN);
    out.push(SHARD_FORMAT);
    out.extend_from_slice(&(n as u32).to_le_bytes());
    for (h, _) in entries.iter() {
        out.extend_from_slice(&h.to_le_bytes());
    }
    let mut off = 0u32;
    out.extend_from_slice(&off.to_le_bytes());
    for (_, hs) in entries.iter() {
        off += (hs.len() * HOLDER_LEN) as u32;
        out.extend_from_slice(&off.to_le_bytes());
    }
    for (_, hs) in entries.iter() {
        for h in hs {
            out.extend_from_slice(&h.slot.to_le_bytes());
            out.push(h.tiers);
        }
    }
    out
}

/// A validated, borrowed view of one shard.
#[derive(Debug, Clone, Copy)]
pub struct ShardView<'a> {
    n: usize,
    hashes: &'a [u8],
    offsets: &'a [u8],
    holders: &'a [u8],
}

impl<'a> ShardView<'a> {
    /// Validates the framing. An empty byte string is an empty shard (the
    /// ABI cannot delete keys, so "cleared" is written as empty).
    pub fn parse(bytes: &'a [u8]) -> Result<ShardView<'a>, ShardError> {
        if bytes.is_empty() {
            return Ok(ShardView {
                n: 0,
                hashes: &[],
                offsets: &[],
                holders: &[],
            });
        }
        let mut r = Reader::new(bytes);
        let format = r.u8()?;
        if format != SHARD_FORMAT {
            return Err(ShardError::Format(format));
        }
        let count = r.u32()?;
        // Each entry is a hash and an offset (one more offset ends them).
        r.plausible(count, 8 + 4, "shard entries")?;
        let n = count as usize;
        let hashes = r.take(n * 8)?;
        let offsets = r.take((n + 1) * 4)?;
        let holders = r.take(r.remaining())?;
        let view = ShardView {
            n,
            hashes,
            offsets,
            holders,
        };
        if view.offset(0) != 0 || view.offset(n) as usize != holders.len() {
            return Err(ShardError::Offsets);
        }
        Ok(view)
    }

    /// Full validation (sorted hashes, monotonic offsets); the sidecar's
    /// encoder guarantees both, so the filter only runs this in tests and
    /// when a shard first arrives.
    pub fn validate(&self) -> Result<(), ShardError> {
        for i in 1..self.n {
            if self.hash(i - 1) >= self.hash(i) {
                return Err(ShardError::Unsorted);
            }
        }
        for i in 0..self.n {
            let (a, b) = (self.offset(i), self.offset(i + 1));
            if a > b || !((b - a) as usize).is_multiple_of(HOLDER_LEN) {
                return Err(ShardError::Offsets);
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn hash(&self, i: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.hashes[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    }

    fn offset(&self, i: usize) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.offsets[i * 4..i * 4 + 4]);
        u32::from_le_bytes(b)
    }

    /// Holders of `seq_hash`, or an empty iterator when no one holds it.
    pub fn holders(&self, seq_hash: u64) -> impl Iterator<Item = Holder> + 'a {
        let range = self.find(seq_hash).and_then(|i| {
            let (a, b) = (self.offset(i) as usize, self.offset(i + 1) as usize);
            // Offsets were checked at the ends only; a corrupt middle offset
            // yields no holders rather than a panic.
            (a <= b && b <= self.holders.len()).then_some((a, b))
        });
        let bytes: &'a [u8] = match range {
            Some((a, b)) => &self.holders[a..b],
            None => &[],
        };
        bytes.chunks_exact(HOLDER_LEN).map(|c| Holder {
            slot: u16::from_le_bytes([c[0], c[1]]),
            tiers: c[2],
        })
    }

    fn find(&self, seq_hash: u64) -> Option<usize> {
        let (mut lo, mut hi) = (0usize, self.n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let h = self.hash(mid);
            if h == seq_hash {
                return Some(mid);
            }
            if h < seq_hash {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        None
    }
}

/// Per-slot overlap in blocks, per tier (cumulative: `host` counts blocks on
/// device or host).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotOverlap {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
}

/// Computes each slot's overlap with a request's chain of sequence hashes.
///
/// `lookup(i, out)` must append the holders of block `i` to `out`; the search
/// calls it for as few positions as it can, because in the filter each call
/// reads a shard from shared data. It relies on the prefix property of
/// caches — a slot holding block `i` holds every block before it — and finds
/// each slot's depth by binary search over positions, remembering what each
/// position returned. With `d` distinct depths among the holders, that is
/// about `d × log2(n)` lookups, usually a handful.
///
/// Results are written to `out[slot]` for slots below `out.len()`.
pub fn overlaps(
    n: usize,
    mut lookup: impl FnMut(usize, &mut Vec<Holder>),
    out: &mut [SlotOverlap],
) -> usize {
    for o in out.iter_mut() {
        *o = SlotOverlap::default();
    }
    if n == 0 || out.is_empty() {
        return 0;
    }
    // memo[i] = holders at position i, once looked up; searches borrow
    // from it instead of copying.
    let mut memo: Vec<Option<Vec<Holder>>> = vec![None; n];
    let mut calls = 0usize;
    let mut fetch = |i: usize, memo: &mut Vec<Option<Vec<Holder>>>| {
        if memo[i].is_none() {
            calls += 1;
            let mut v = Vec::new();
            lookup(i, &mut v);
            memo[i] = Some(v);
        }
    };
    fetch(0, &mut memo);
    let first: Vec<Holder> = memo[0].clone().unwrap_or_default();
    // Each slot present at block 0 is searched for its last position; tiers
    // are searched separately because a block can leave the device and stay
    // on host.
    for h in &first {
        let slot = h.slot as usize;
        if slot >= out.len() {
            continue;
        }
        for (bit, field) in [(TIER_DEVICE, 0usize), (TIER_HOST, 1), (TIER_DISK, 2)] {
            let tier_mask = match bit {
                TIER_DEVICE => TIER_DEVICE,
                TIER_HOST => TIER_DEVICE | TIER_HOST,
                _ => TIER_DEVICE | TIER_HOST | TIER_DISK,
            };
            let holds = |memo: &[Option<Vec<Holder>>], i: usize| {
                memo[i].as_deref().is_some_and(|hs| {
                    hs.iter()
                        .any(|x| x.slot == h.slot && x.tiers & tier_mask != 0)
                })
            };
            if !holds(&memo, 0) {
                continue;
            }
            // Invariant: position lo is held, hi is not (or is n). A full hit
            // is the common case (multi-turn chats, shared system prompts),
            // so the last block is probed first: one read settles it.
            let (mut lo, mut hi) = (0usize, n);
            if n > 1 {
                fetch(n - 1, &mut memo);
                if holds(&memo, n - 1) {
                    lo = n - 1;
                } else {
                    hi = n - 1;
                    // The next most common case is a cached prompt with a
                    // new last block (a short question after a shared
                    // system prompt): one read at the block before the
                    // last settles it, where bisecting 128 blocks takes
                    // seven. A longer new tail pays that read on top of
                    // the bisection.
                    if hi - lo > 1 {
                        fetch(n - 2, &mut memo);
                        if holds(&memo, n - 2) {
                            lo = n - 2;
                        } else {
                            hi = n - 2;
                        }
                    }
                }
            }
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                fetch(mid, &mut memo);
                if holds(&memo, mid) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            let depth = (lo + 1) as u32;
            let o = &mut out[slot];
            match field {
                0 => o.device = depth,
                1 => o.host = depth,
                _ => o.disk = depth,
            }
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(slot: u16, tiers: u8) -> Holder {
        Holder { slot, tiers }
    }

    #[test]
    fn round_trip_and_lookup() {
        let mut entries = vec![
            (30u64, vec![h(1, TIER_DEVICE)]),
            (10, vec![h(0, TIER_DEVICE), h(2, TIER_HOST)]),
            (20, vec![]),
        ];
        let bytes = encode(&mut entries);
        let v = ShardView::parse(&bytes).unwrap();
        v.validate().unwrap();
        assert_eq!(v.len(), 3);
        assert_eq!(v.holders(10).collect::<Vec<_>>(), vec![h(0, 1), h(2, 2)]);
        assert_eq!(v.holders(30).collect::<Vec<_>>(), vec![h(1, 1)]);
        assert_eq!(v.holders(20).count(), 0);
        assert_eq!(v.holders(25).count(), 0);
    }

    #[test]
    fn empty_bytes_are_an_empty_shard() {
        let v = ShardView::parse(&[]).unwrap();
        assert!(v.is_empty());
        assert_eq!(v.holders(1).count(), 0);
    }

    #[test]
    fn bad_shards_are_errors() {
        assert_eq!(ShardView::parse(&[2]).unwrap_err(), ShardError::Format(2));
        let bytes = encode(&mut [(1, vec![h(0, 1)]), (2, vec![h(1, 1)])]);
        for cut in 1..bytes.len() {
            assert!(ShardView::parse(&bytes[..cut]).is_err(), "cut {cut}");
        }
        let mut unsorted = bytes.clone();
        unsorted[5..13].copy_from_slice(&9u64.to_le_bytes());
        assert_eq!(
            ShardView::parse(&unsorted).unwrap().validate(),
            Err(ShardError::Unsorted)
        );
    }

    #[test]
    fn shard_of_spreads_and_stays_in_range() {
        let mut counts = [0u32; 16];
        for i in 0..16_000u64 {
            let s = shard_of(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), 16);
            counts[s as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
        assert_eq!(shard_of(u64::MAX, 7), 6);
        assert_eq!(shard_of(5, 0), 0);
    }

    /// Builds holder lists from per-slot depths (device, host) for n blocks.
    fn chain(n: usize, depths: &[(u16, usize, usize)]) -> Vec<Vec<Holder>> {
        (0..n)
            .map(|i| {
                depths
                    .iter()
                    .filter_map(|&(slot, dev, host)| {
                        let mut t = 0;
                        if i < dev {
                            t |= TIER_DEVICE;
                        }
                        if i < host {
                            t |= TIER_HOST;
                        }
                        (t != 0).then_some(h(slot, t))
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn overlaps_find_each_slots_depth_with_few_lookups() {
        let n = 128;
        let c = chain(n, &[(0, 128, 128), (1, 40, 40), (2, 3, 90), (3, 0, 0)]);
        let mut out = [SlotOverlap::default(); 4];
        let calls = overlaps(n, |i, v| v.extend_from_slice(&c[i]), &mut out);
        assert_eq!(
            out[0],
            SlotOverlap {
                device: 128,
                host: 128,
                disk: 128
            }
        );
        assert_eq!(
            out[1],
            SlotOverlap {
                device: 40,
                host: 40,
                disk: 40
            }
        );
        assert_eq!(
            out[2],
            SlotOverlap {
                device: 3,
                host: 90,
                disk: 90
            }
        );
        assert_eq!(out[3], SlotOverlap::default());
        assert!(calls <= 30, "{calls} lookups");
        // A full hit costs two lookups: block 0 and the last block.
        let full = chain(n, &[(0, 128, 128)]);
        assert_eq!(
            overlaps(n, |i, v| v.extend_from_slice(&full[i]), &mut out),
            2
        );
    }

    #[test]
    fn a_new_tail_is_found_from_the_end() {
        let n = 128;
        let mut out = [SlotOverlap::default(); 1];
        // Block 0, the last (a miss), then the one before it.
        let one = chain(n, &[(0, 127, 127)]);
        assert_eq!(
            overlaps(n, |i, v| v.extend_from_slice(&one[i]), &mut out),
            3
        );
        assert_eq!(out[0].device, 127);
        // A short cached prefix pays that read, then bisects 126 blocks.
        let short = chain(n, &[(0, 5, 5)]);
        let calls = overlaps(n, |i, v| v.extend_from_slice(&short[i]), &mut out);
        assert_eq!(out[0].device, 5);
        assert_eq!(calls, 3 + 7);
    }

    #[test]
    fn no_first_block_means_one_lookup() {
        let mut out = [SlotOverlap::default(); 2];
        let calls = overlaps(64, |_, _| {}, &mut out);
        assert_eq!(calls, 1);
        assert_eq!(out, [SlotOverlap::default(); 2]);
    }

    proptest! {
        #[test]
        fn overlaps_match_a_linear_scan(n in 1usize..200, depths in prop::collection::vec((0usize..200, 0usize..200), 1..6)) {
            let spec: Vec<(u16, usize, usize)> = depths.iter().enumerate().map(|(s, &(d, h))| (s as u16, d.min(n), h.min(n))).collect();
            let c = chain(n, &spec);
            let mut out = vec![SlotOverlap::default(); spec.len()];
            overlaps(n, |i, v| v.extend_from_slice(&c[i]), &mut out);
            for &(slot, dev, host) in &spec {
                let o = out[slot as usize];
                prop_assert_eq!(o.device as usize, dev);
                prop_assert_eq!(o.host as usize, dev.max(host));
            }
        }

        #[test]
        fn random_shard_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200), probe in any::<u64>()) {
            if let Ok(v) = ShardView::parse(&bytes) {
                let _ = v.validate();
                let _ = v.holders(probe).count();
            }
        }
    }
}
