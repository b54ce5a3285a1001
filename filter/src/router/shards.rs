//! Index shards kept across requests while they stand still.
//!
//! A 2k-token prompt reads two to four shards from shared data, each a
//! host call that copies the shard into the VM (3 to 5 µs on the request
//! path), and requests with a shared prefix read the same ones. The
//! snapshot service writes every shard of an update before the manifest
//! that names the update's version, and a request reads the manifest at
//! its headers, before any shard. So a shard read after seeing version
//! `v` is at least as new as `v`.
//!
//! The cache is current as of an update (`at`): every shard it keeps is
//! at least as new as that update. A request that saw no later update
//! may be handed a kept shard instead of reading it. When a request (or
//! the router's tick) brings a later update, the cache reads the service's
//! change log ([`crate::changes`]) once and forgets only the shards
//! rewritten since; without a log that reaches back that far, it forgets
//! them all.
//!
//! A shard is kept only on its second read. Keeping every shard made
//! prompts that share none slower (the kv bench's token ids: 8 µs at 2k
//! tokens): each kept shard holds fresh memory, where an unkept one's copy
//! lands in the buffer the last one freed, still in cache.

use crate::changes::{self, Changes, key_hash};
use crate::manifest::Manifest;
use kvgate_core::plan::ShardSource;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::rc::Rc;

/// Shard bytes held at most; past it the cache starts over. A 1.6M-block
/// index's shards are about 1.5 KB each: some 2,500 shards.
const MAX_BYTES: usize = 4 << 20;

/// Bits of the set of keys read once: a key's hash picks one. A bit
/// already set by another key keeps a shard from its first read, which
/// is only a cost.
const SEEN_WORDS: usize = 1024;

/// The shards this VM keeps.
#[derive(Debug)]
pub struct Shards {
    /// (epoch, update version) every kept shard is at least as new as.
    at: (u64, u64),
    /// By [`key_hash`] of the shared-data key, with the key itself: two
    /// keys of one hash take turns.
    held: HashMap<u64, Held, BuildHasherDefault<Prehashed>>,
    bytes: usize,
    /// Keys read once since the cache last started over.
    seen: Box<[u64; SEEN_WORDS]>,
}

#[derive(Debug)]
struct Held {
    key: Box<str>,
    /// `None`: the shard is empty.
    bytes: Option<Rc<Vec<u8>>>,
}

impl Held {
    fn size(&self) -> usize {
        self.key.len() + self.bytes.as_ref().map_or(0, |b| b.len())
    }
}

impl Default for Shards {
    fn default() -> Shards {
        Shards {
            at: (0, 0),
            held: HashMap::default(),
            bytes: 0,
            seen: Box::new([0; SEEN_WORDS]),
        }
    }
}

/// The map's keys are [`key_hash`]es already.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        self.0
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
    /// The shards for a request that read `manifest`; `read` fetches a
    /// key from shared data. The cache first catches up with a later
    /// update ([`Shards::sync`]). A request that read an older manifest
    /// than the cache has seen gets the cache's newer shards.
    pub fn source<R>(&mut self, manifest: &Manifest, mut read: R) -> Source<'_, R>
    where
        R: FnMut(&str) -> Option<Vec<u8>>,
    {
        self.sync(manifest, &mut read);
        Source { shards: self, read }
    }

    /// Brings the cache up to `manifest`'s update: another epoch forgets
    /// every shard; a later update forgets those the change log lists as
    /// rewritten since the cache's, or every shard when the log does not
    /// reach back to it. Reads the log only when it keeps something.
    pub fn sync(&mut self, manifest: &Manifest, read: &mut impl FnMut(&str) -> Option<Vec<u8>>) {
        let (epoch, version) = (manifest.epoch, manifest.update_version);
        if epoch != self.at.0 {
            self.start_over();
            self.at = (epoch, version);
            return;
        }
        if version <= self.at.1 {
            return;
        }
        if self.held.is_empty() {
            self.at.1 = version;
            return;
        }
        let log = read(changes::KEY);
        match log.as_deref().map(Changes::decode) {
            Some(Ok(c)) if c.epoch == epoch && c.from <= self.at.1 && c.newest >= version => {
                for h in c.since(self.at.1) {
                    if let Some(gone) = self.held.remove(&h) {
                        self.bytes -= gone.size();
                    }
                }
                self.at.1 = c.newest;
            }
            _ => {
                self.held.clear();
                self.bytes = 0;
                self.at.1 = version;
            }
        }
    }

    /// Forgets every shard, and which keys were read once.
    fn start_over(&mut self) {
        self.held.clear();
        self.bytes = 0;
        self.seen.fill(0);
    }

    /// Whether `hash`'s key was read before; marks it read.
    fn seen_before(&mut self, hash: u64) -> bool {
        let bit = (hash >> 48) as usize;
        let (word, mask) = (bit / 64 % SEEN_WORDS, 1u64 << (bit % 64));
        let seen = self.seen[word] & mask != 0;
        self.seen[word] |= mask;
        seen
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
        let hash = key_hash(key);
        if let Some(held) = shards.held.get(&hash).filter(|h| &*h.key == key) {
            return held.bytes.clone().map(Bytes::Kept);
        }
        let read = (self.read)(key);
        if !shards.seen_before(hash) {
            return read.map(Bytes::Own);
        }
        let held = Held {
            key: key.into(),
            bytes: read.map(Rc::new),
        };
        let size = held.size();
        if shards.bytes + size > MAX_BYTES {
            shards.start_over();
        }
        let bytes = held.bytes.clone();
        shards.bytes += size;
        if let Some(other) = shards.held.insert(hash, held) {
            shards.bytes -= other.size();
        }
        bytes.map(Bytes::Kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::changes::ChangeLog;
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
    #[derive(Default)]
    struct Shared {
        values: RefCell<HashMap<String, Vec<u8>>>,
        reads: RefCell<HashMap<String, usize>>,
    }

    impl Shared {
        fn with(pairs: &[(&str, &[u8])]) -> Shared {
            let s = Shared::default();
            for (k, v) in pairs {
                s.set(k, v);
            }
            s
        }

        fn set(&self, key: &str, value: &[u8]) {
            self.values
                .borrow_mut()
                .insert(key.to_string(), value.to_vec());
        }

        fn read(&self, key: &str) -> Option<Vec<u8>> {
            *self.reads.borrow_mut().entry(key.to_string()).or_default() += 1;
            self.values.borrow().get(key).cloned()
        }

        fn reads(&self, key: &str) -> usize {
            self.reads.borrow().get(key).copied().unwrap_or(0)
        }

        /// The service's update `version`: shards rewritten, then the log.
        fn update(&self, log: &mut ChangeLog, epoch: u64, version: u64, shards: &[(&str, &[u8])]) {
            for (k, v) in shards {
                self.set(k, v);
            }
            log.record(epoch, version, false, shards.iter().map(|(k, _)| *k));
            self.set(changes::KEY, &log.encode());
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
            .map(|n| key_hash(&format!("kvgate.idx.~text~m.{n}")) & 1023)
            .collect();
        assert!(buckets.len() > 512, "{} of 1024 buckets", buckets.len());
    }

    #[test]
    fn a_shard_is_kept_from_its_second_read() {
        let shared = Shared::with(&[("a", b"one")]);
        let mut s = Shards::default();
        let m = manifest(7, 3);
        for _ in 0..3 {
            assert_eq!(get(&mut s, &m, &shared, "a").as_deref(), Some(&b"one"[..]));
        }
        assert_eq!(shared.reads("a"), 2, "read once, read and kept, held");
        for _ in 0..3 {
            assert_eq!(get(&mut s, &m, &shared, "absent"), None);
        }
        assert_eq!(shared.reads("absent"), 2, "an empty shard is kept too");
    }

    #[test]
    fn shards_the_log_does_not_list_are_kept_across_updates() {
        let shared = Shared::with(&[("a", b"a1"), ("b", b"b1")]);
        let mut log = ChangeLog::starting_at(7, 3);
        shared.set(changes::KEY, &log.encode());
        let mut s = Shards::default();
        for _ in 0..2 {
            get(&mut s, &manifest(7, 3), &shared, "a");
            get(&mut s, &manifest(7, 3), &shared, "b");
        }
        // Update 4 carries a snapshot only; update 5 rewrites `b`.
        shared.update(&mut log, 7, 4, &[]);
        shared.update(&mut log, 7, 5, &[("b", b"b2")]);
        assert_eq!(
            get(&mut s, &manifest(7, 5), &shared, "a").as_deref(),
            Some(&b"a1"[..])
        );
        assert_eq!(
            get(&mut s, &manifest(7, 5), &shared, "b").as_deref(),
            Some(&b"b2"[..])
        );
        assert_eq!((shared.reads("a"), shared.reads("b")), (2, 3));
        assert_eq!(shared.reads(changes::KEY), 1, "the log read once for both");
        // `b` was read again after it changed, and kept: its bit is set.
        get(&mut s, &manifest(7, 5), &shared, "b");
        assert_eq!(shared.reads("b"), 3);
        // The router's tick catches up between requests.
        shared.update(&mut log, 7, 6, &[("a", b"a3")]);
        s.sync(&manifest(7, 6), &mut |k: &str| shared.read(k));
        assert_eq!(
            get(&mut s, &manifest(7, 6), &shared, "a").as_deref(),
            Some(&b"a3"[..])
        );
        assert_eq!(
            get(&mut s, &manifest(7, 6), &shared, "b").as_deref(),
            Some(&b"b2"[..])
        );
        assert_eq!((shared.reads("a"), shared.reads("b")), (3, 3));
        assert_eq!(shared.reads(changes::KEY), 2);
    }

    #[test]
    fn without_a_log_that_reaches_back_every_shard_is_forgotten() {
        let shared = Shared::with(&[("a", b"one")]);
        let mut s = Shards::default();
        let keep = |s: &mut Shards, m: &Manifest| {
            get(s, m, &shared, "a");
            get(s, m, &shared, "a");
        };
        keep(&mut s, &manifest(7, 3));
        assert_eq!(shared.reads("a"), 2);
        // No log at all. A key read before is kept again at once.
        get(&mut s, &manifest(7, 4), &shared, "a");
        get(&mut s, &manifest(7, 4), &shared, "a");
        assert_eq!(shared.reads("a"), 3);
        // A log that starts after the cache's update.
        let log = ChangeLog::starting_at(7, 5);
        shared.set(changes::KEY, &log.encode());
        get(&mut s, &manifest(7, 6), &shared, "a");
        assert_eq!(shared.reads("a"), 4, "a gap: forgotten");
        // A log of another epoch, or one that is not a log.
        get(&mut s, &manifest(7, 6), &shared, "a");
        shared.set(changes::KEY, &ChangeLog::starting_at(8, 0).encode());
        get(&mut s, &manifest(7, 7), &shared, "a");
        shared.set(changes::KEY, b"not a log");
        get(&mut s, &manifest(7, 8), &shared, "a");
        assert_eq!(shared.reads("a"), 6);
        // A log that ends before the request's update.
        let mut log = ChangeLog::starting_at(7, 8);
        log.record(7, 9, false, std::iter::empty());
        shared.set(changes::KEY, &log.encode());
        get(&mut s, &manifest(7, 10), &shared, "a");
        assert_eq!(shared.reads("a"), 7);
    }

    #[test]
    fn a_request_that_saw_an_older_update_gets_newer_shards() {
        let shared = Shared::with(&[("a", b"two")]);
        let mut log = ChangeLog::starting_at(7, 4);
        shared.set(changes::KEY, &log.encode());
        let mut s = Shards::default();
        get(&mut s, &manifest(7, 4), &shared, "a");
        get(&mut s, &manifest(7, 4), &shared, "a");
        shared.update(&mut log, 7, 5, &[]);
        shared.set("a", b"three");
        assert_eq!(
            get(&mut s, &manifest(7, 3), &shared, "a").as_deref(),
            Some(&b"two"[..])
        );
        assert_eq!(shared.reads("a"), 2);
        // A restarted sidecar numbers its updates anew.
        assert_eq!(
            get(&mut s, &manifest(8, 1), &shared, "a").as_deref(),
            Some(&b"three"[..])
        );
        assert_eq!(shared.reads("a"), 3);
        assert_eq!(
            shared.reads(changes::KEY),
            0,
            "an empty cache or a new epoch reads no log"
        );
    }

    #[test]
    fn an_empty_cache_reads_no_log() {
        let shared = Shared::default();
        let mut s = Shards::default();
        for v in 1..5 {
            get(&mut s, &manifest(7, v), &shared, &format!("k{v}"));
        }
        assert_eq!(shared.reads(changes::KEY), 0);
        assert_eq!(s.at, (7, 4));
    }

    #[test]
    fn the_cache_starts_over_past_its_bound() {
        let big = vec![1u8; MAX_BYTES / 3];
        let shared = Shared::with(&[("a", &big), ("b", &big), ("c", &big)]);
        let mut s = Shards::default();
        let m = manifest(1, 1);
        for key in ["a", "a", "b", "b", "c", "c"] {
            get(&mut s, &m, &shared, key);
        }
        assert!(s.bytes <= MAX_BYTES);
        assert_eq!(s.held.len(), 1, "the third shard kept started it over");
        get(&mut s, &m, &shared, "c");
        assert_eq!(shared.reads("c"), 2, "held since");
        get(&mut s, &m, &shared, "a");
        get(&mut s, &m, &shared, "a");
        assert_eq!(
            shared.reads("a"),
            4,
            "read once more before it is kept again"
        );
    }
}
