//! Index shards kept across requests while the index stands still.
//!
//! A 2k-token prompt reads two to four shards from shared data, each a
//! host call that copies the shard into the VM, and requests with a shared
//! prefix read the same ones. The snapshot service writes every shard of
//! an update before the manifest that names the update's version, and a
//! request reads the manifest at its headers, before any shard. So a shard
//! read after seeing version `v` is at least as new as `v`: while no
//! request has seen a later version (or another epoch), what was read may
//! be handed out again instead of read again.
//!
//! A shard is kept only on its second read within an update. Keeping every
//! shard made prompts that share none slower (the kv bench's token ids: 8
//! µs at 2k tokens): each kept shard holds fresh memory, where an unkept
//! one's copy lands in the buffer the last one freed, still in cache.

use crate::manifest::Manifest;
use kvgate_core::plan::ShardSource;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::rc::Rc;

/// Shard bytes held at most; past it the cache starts over. A few hundred
/// shards of a large index, read between two updates.
const MAX_BYTES: usize = 4 << 20;

/// Shards remembered as read once since the update, by key hash.
const SEEN: usize = 64;

/// The shards read since the last update this VM has seen.
#[derive(Debug)]
pub struct Shards {
    /// (epoch, update version) of the newest manifest a request brought.
    at: (u64, u64),
    /// By shared-data key; `None`: the shard is empty.
    held: HashMap<String, Option<Bytes>, BuildHasherDefault<KeyHasher>>,
    bytes: usize,
    /// Hashes of keys read once since the update, a ring; a hash met
    /// again is a shard read twice (or, rarely, a collision: one kept
    /// early, which is only a cost).
    seen: [u64; SEEN],
    next_seen: usize,
}

impl Default for Shards {
    fn default() -> Shards {
        Shards {
            at: (0, 0),
            held: HashMap::default(),
            bytes: 0,
            seen: [0; SEEN],
            next_seen: 0,
        }
    }
}

/// A multiply per eight bytes of a key, folded at the end. The keys are the filter's own
/// (`kvgate.idx.<model>.<shard>`), at most a few hundred a VM holds
/// between two updates, so SipHash's defence against chosen keys buys
/// nothing here; it was half of what the cache added to a 2k prompt's
/// search (`decision_cost`).
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(w))
                .wrapping_mul(0x51_7C_C1_B7_27_22_0A_95);
        }
    }

    /// The map takes its buckets from the low bits, which a multiply
    /// leaves depending on the low bits of the key alone: the high bits,
    /// where a key's shard number lands, are folded down first.
    fn finish(&self) -> u64 {
        let x = (self.0 ^ (self.0 >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    }
}

/// A shard's bytes: the request's own, or shared with the cache.
#[derive(Debug, Clone)]
pub enum Bytes {
    Own(Vec<u8>),
    Kept(Rc<Vec<u8>>),
}

impl AsRef<[u8]> for Bytes {
    fn as_ref(&self) -> &[u8] {
        match self {
            Bytes::Own(b) => b,
            Bytes::Kept(b) => b,
        }
    }
}

impl Shards {
    /// The shards for a request that read `manifest`; `read` fetches one
    /// from shared data. A newer update, or another epoch, empties the
    /// cache first. A request that read an older manifest than the cache
    /// has seen gets the cache's newer shards.
    pub fn source<R>(&mut self, manifest: &Manifest, read: R) -> Source<'_, R>
    where
        R: FnMut(&str) -> Option<Vec<u8>>,
    {
        let at = (manifest.epoch, manifest.update_version);
        if at.0 != self.at.0 || at.1 > self.at.1 {
            self.clear();
            self.at = at;
            self.seen = [0; SEEN];
        }
        Source { shards: self, read }
    }

    fn clear(&mut self) {
        self.held.clear();
        self.bytes = 0;
    }
}

/// One request's view of the cache.
pub struct Source<'a, R> {
    shards: &'a mut Shards,
    read: R,
}

impl<R: FnMut(&str) -> Option<Vec<u8>>> ShardSource for Source<'_, R> {
    type Bytes = Bytes;

    fn read(&mut self, key: &str) -> Option<Bytes> {
        let shards = &mut *self.shards;
        if let Some(held) = shards.held.get(key) {
            return held.clone();
        }
        let read = (self.read)(key);
        let mut h = KeyHasher::default();
        h.write(key.as_bytes());
        // Never zero, the ring's empty slot.
        let hash = h.finish() | 1;
        if !shards.seen.contains(&hash) {
            shards.seen[shards.next_seen] = hash;
            shards.next_seen = (shards.next_seen + 1) % SEEN;
            return read.map(Bytes::Own);
        }
        let bytes = read.map(|b| Bytes::Kept(Rc::new(b)));
        let size = key.len() + bytes.as_ref().map_or(0, |b| b.as_ref().len());
        if shards.bytes + size > MAX_BYTES {
            shards.clear();
        }
        shards.bytes += size;
        shards.held.insert(key.to_owned(), bytes.clone());
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    fn manifest(epoch: u64, update_version: u64) -> Manifest {
        Manifest {
            snapshot_version: 1,
            update_version,
            epoch,
            fresh_at_ms: 0,
        }
    }

    /// Shared data as the snapshot service leaves it, counting reads.
    struct Shared {
        value: RefCell<Vec<u8>>,
        reads: RefCell<usize>,
    }

    impl Shared {
        fn new(v: &[u8]) -> Shared {
            Shared {
                value: RefCell::new(v.to_vec()),
                reads: RefCell::new(0),
            }
        }

        fn read(&self, key: &str) -> Option<Vec<u8>> {
            *self.reads.borrow_mut() += 1;
            (key != "absent").then(|| self.value.borrow().clone())
        }
    }

    fn get(s: &mut Shards, m: &Manifest, shared: &Shared, key: &str) -> Option<Vec<u8>> {
        s.source(m, |k: &str| shared.read(k))
            .read(key)
            .map(|b| b.as_ref().to_vec())
    }

    #[test]
    fn shard_keys_spread_over_the_low_bits() {
        let buckets: std::collections::HashSet<u64> = (0..1024u32)
            .map(|n| {
                let mut h = KeyHasher::default();
                h.write(format!("kvgate.idx.~text~m.{n}").as_bytes());
                h.finish() & 1023
            })
            .collect();
        assert!(buckets.len() > 512, "{} of 1024 buckets", buckets.len());
    }

    #[test]
    fn a_shard_is_kept_from_its_second_read_in_an_update() {
        let shared = Shared::new(b"one");
        let mut s = Shards::default();
        let m = manifest(7, 3);
        for _ in 0..3 {
            assert_eq!(get(&mut s, &m, &shared, "a").as_deref(), Some(&b"one"[..]));
        }
        assert_eq!(*shared.reads.borrow(), 2, "read once, read and kept, held");
        for _ in 0..3 {
            assert_eq!(get(&mut s, &m, &shared, "absent"), None);
        }
        assert_eq!(*shared.reads.borrow(), 4, "an empty shard is kept too");
    }

    #[test]
    fn a_newer_update_or_another_epoch_reads_again() {
        let shared = Shared::new(b"one");
        let mut s = Shards::default();
        get(&mut s, &manifest(7, 3), &shared, "a");
        get(&mut s, &manifest(7, 3), &shared, "a");
        *shared.value.borrow_mut() = b"two".to_vec();
        for _ in 0..2 {
            assert_eq!(
                get(&mut s, &manifest(7, 4), &shared, "a").as_deref(),
                Some(&b"two"[..])
            );
        }
        assert_eq!(
            *shared.reads.borrow(),
            4,
            "the update forgot the first reads"
        );
        // A request that read the manifest before the update was applied
        // gets the newer shard: never older than what it saw.
        *shared.value.borrow_mut() = b"three".to_vec();
        assert_eq!(
            get(&mut s, &manifest(7, 3), &shared, "a").as_deref(),
            Some(&b"two"[..])
        );
        assert_eq!(*shared.reads.borrow(), 4);
        // A restarted sidecar numbers its updates anew.
        assert_eq!(
            get(&mut s, &manifest(8, 1), &shared, "a").as_deref(),
            Some(&b"three"[..])
        );
        assert_eq!(*shared.reads.borrow(), 5);
    }

    #[test]
    fn the_cache_starts_over_past_its_bound() {
        let shared = Shared::new(&vec![1u8; MAX_BYTES / 3]);
        let mut s = Shards::default();
        let m = manifest(1, 1);
        for key in ["a", "a", "b", "b", "c", "c"] {
            get(&mut s, &m, &shared, key);
        }
        assert!(s.bytes <= MAX_BYTES);
        assert_eq!(s.held.len(), 1, "the third shard kept started it over");
        get(&mut s, &m, &shared, "c");
        assert_eq!(*shared.reads.borrow(), 6, "held since");
        get(&mut s, &m, &shared, "a");
        assert_eq!(*shared.reads.borrow(), 7, "read again");
    }
}
