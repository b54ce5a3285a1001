//! The routed-prefix index: which rank was sent which prompt chunks,
//! learned from the filter's routing decisions and forgotten after a TTL.
//!
//! Engines tell kvgate nothing about text prompts it cannot tokenize, so
//! kvgate assumes a rank still holds the prefix of a prompt it was routed
//! recently. Text entries expire after `kv.approx_ttl_ms` (Dynamo's router
//! uses 120 s) since the engine may have evicted the blocks by then.
//!
//! Token prompts are reported too, but only to bridge the moments before
//! the engine's KV events describe the blocks (a request still queued at
//! the engine has published nothing): their entries live for
//! `kv.inflight_ttl_ms`, after which the events alone speak for the rank.
//! A rank whose engine reports its cache emptied (AllBlocksCleared, an
//! engine restart, a lost event stream) forgets everything routed to it.
//!
//! Shards are published under `kvgate_core::approx::model_key(model)`, in
//! the same format and version stream as the precise index.

use crate::sources::kv::index::FastMap;
use kvgate_core::approx::{ChunkKind, Routed, SHARDS, model_key};
use kvgate_core::shard::{self, Holder, TIER_DEVICE};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::time::{Duration, Instant};

type Holders = SmallVec<[(u16, Instant); 2]>;

struct ModelIndex {
    shards: Vec<FastMap<u64, Holders>>,
    dirty: Vec<u64>,
}

impl ModelIndex {
    fn new() -> Self {
        ModelIndex {
            shards: (0..SHARDS).map(|_| FastMap::default()).collect(),
            dirty: vec![0; (SHARDS as usize).div_ceil(64)],
        }
    }
    fn mark(&mut self, s: usize) {
        self.dirty[s / 64] |= 1 << (s % 64);
    }
}

pub struct ApproxIndex {
    text_ttl: Duration,
    inflight_ttl: Duration,
    models: HashMap<String, ModelIndex>,
    /// Entries learned (new holder of a chunk) since start.
    pub learned: u64,
}

impl ApproxIndex {
    pub fn new(text_ttl: Duration, inflight_ttl: Duration) -> Self {
        ApproxIndex {
            text_ttl,
            inflight_ttl,
            models: HashMap::new(),
            learned: 0,
        }
    }

    /// Records that `r.slot` was sent `r.hashes`. Refreshing a known holder
    /// only extends its expiry (the published shard does not change).
    pub fn learn(&mut self, r: &Routed, now: Instant) {
        let expiry = now
            + match r.kind {
                ChunkKind::Text => self.text_ttl,
                ChunkKind::Tokens => self.inflight_ttl,
            };
        let m = self
            .models
            .entry(r.model.clone())
            .or_insert_with(ModelIndex::new);
        for &h in &r.hashes {
            let s = shard::shard_of(h, SHARDS) as usize;
            let holders = m.shards[s].entry(h).or_default();
            match holders.iter_mut().find(|(slot, _)| *slot == r.slot) {
                Some(e) => e.1 = e.1.max(expiry),
                None => {
                    holders.push((r.slot, expiry));
                    self.learned += 1;
                    m.mark(s);
                }
            }
        }
    }

    /// Forgets everything routed to `slot`: its engine's cache is empty.
    pub fn forget_slot(&mut self, slot: u16) {
        self.retain_holders(|held, _| held != slot);
    }

    /// Drops expired holders.
    pub fn sweep(&mut self, now: Instant) {
        self.retain_holders(|_, expiry| expiry > now);
    }

    /// Keeps the holders `keep` accepts; shards that lost one are marked
    /// for publishing.
    fn retain_holders(&mut self, keep: impl Fn(u16, Instant) -> bool) {
        for m in self.models.values_mut() {
            let mut changed = Vec::new();
            for (s, map) in m.shards.iter_mut().enumerate() {
                let mut touched = false;
                map.retain(|_, hs| {
                    let n = hs.len();
                    hs.retain(|(slot, expiry)| keep(*slot, *expiry));
                    touched |= hs.len() != n;
                    !hs.is_empty()
                });
                if touched {
                    changed.push(s);
                }
            }
            for s in changed {
                m.mark(s);
            }
        }
    }

    /// Changed shards as (namespace, shard, shard count, bytes), and clears
    /// the marks.
    pub fn take_updates(&mut self) -> Vec<(String, u32, usize, Vec<u8>)> {
        let mut out = Vec::new();
        for (model, m) in &mut self.models {
            let key = model_key(model);
            for w in 0..m.dirty.len() {
                let mut bits = std::mem::take(&mut m.dirty[w]);
                while bits != 0 {
                    let s = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let map = &m.shards[s];
                    let bytes = if map.is_empty() {
                        Vec::new()
                    } else {
                        let mut entries: Vec<(u64, Vec<Holder>)> = map
                            .iter()
                            .map(|(h, hs)| {
                                let mut v: Vec<Holder> = hs
                                    .iter()
                                    .map(|(slot, _)| Holder {
                                        slot: *slot,
                                        tiers: TIER_DEVICE,
                                    })
                                    .collect();
                                v.sort();
                                (*h, v)
                            })
                            .collect();
                        shard::encode(&mut entries)
                    };
                    out.push((key.clone(), s as u32, SHARDS as usize, bytes));
                }
            }
        }
        out
    }
}

#[cfg(test)]
impl ApproxIndex {
    /// Holders (chunk, rank) currently indexed, all models.
    fn len(&self) -> usize {
        self.models
            .values()
            .flat_map(|m| m.shards.iter())
            .flat_map(|map| map.values())
            .map(|hs| hs.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::shard::ShardView;

    fn holders(updates: &[(String, u32, usize, Vec<u8>)], h: u64) -> Vec<u16> {
        let s = shard::shard_of(h, SHARDS);
        updates
            .iter()
            .filter(|u| u.1 == s)
            .flat_map(|u| {
                ShardView::parse(&u.3)
                    .unwrap()
                    .holders(h)
                    .map(|x| x.slot)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn learns_publishes_and_forgets() {
        let t0 = Instant::now();
        let mut a = ApproxIndex::new(Duration::from_secs(10), Duration::from_secs(1));
        a.learn(
            &Routed {
                model: "m".into(),
                slot: 3,
                kind: ChunkKind::Text,
                hashes: vec![11, 12],
            },
            t0,
        );
        a.learn(
            &Routed {
                model: "m".into(),
                slot: 5,
                kind: ChunkKind::Text,
                hashes: vec![11],
            },
            t0,
        );
        let u = a.take_updates();
        assert!(u.iter().all(|x| x.0 == "~approx~m"));
        assert_eq!(holders(&u, 11), vec![3, 5]);
        assert_eq!(holders(&u, 12), vec![3]);
        assert_eq!(a.learned, 3);
        // A refresh changes nothing to publish.
        a.learn(
            &Routed {
                model: "m".into(),
                slot: 3,
                kind: ChunkKind::Text,
                hashes: vec![11],
            },
            t0 + Duration::from_secs(8),
        );
        assert!(a.take_updates().is_empty());
        // Slot 5 expires at 10 s, slot 3's refreshed entry at 18 s.
        a.sweep(t0 + Duration::from_secs(11));
        let u = a.take_updates();
        assert_eq!(holders(&u, 11), vec![3]);
        assert!(holders(&u, 12).is_empty(), "12 expired at 10 s");
        a.sweep(t0 + Duration::from_secs(19));
        let u = a.take_updates();
        assert!(
            u.iter().all(|x| x.3.is_empty()),
            "everything expired, shards emptied"
        );
    }

    fn routed(slot: u16, kind: ChunkKind, hashes: &[u64]) -> Routed {
        Routed {
            model: "m".into(),
            slot,
            kind,
            hashes: hashes.to_vec(),
        }
    }

    #[test]
    fn token_prefixes_only_bridge_until_events_arrive() {
        let t0 = Instant::now();
        let mut a = ApproxIndex::new(Duration::from_secs(120), Duration::from_secs(2));
        a.learn(&routed(1, ChunkKind::Tokens, &[21, 22]), t0);
        a.learn(&routed(2, ChunkKind::Text, &[31]), t0);
        let u = a.take_updates();
        assert_eq!(holders(&u, 21), vec![1]);
        a.sweep(t0 + Duration::from_secs(3));
        let u = a.take_updates();
        assert!(holders(&u, 21).is_empty(), "the in-flight window is over");
        assert_eq!(a.len(), 1, "the text prefix stays for its own TTL");
        // A token report never shortens a text entry's expiry.
        a.learn(
            &routed(2, ChunkKind::Tokens, &[31]),
            t0 + Duration::from_secs(3),
        );
        a.sweep(t0 + Duration::from_secs(60));
        assert_eq!(a.len(), 1);
    }

    #[test]
    fn a_cleared_rank_forgets_what_was_routed_to_it() {
        let t0 = Instant::now();
        let mut a = ApproxIndex::new(Duration::from_secs(120), Duration::from_secs(10));
        a.learn(&routed(1, ChunkKind::Tokens, &[41, 42]), t0);
        a.learn(&routed(1, ChunkKind::Text, &[51]), t0);
        a.learn(&routed(2, ChunkKind::Tokens, &[41]), t0);
        a.take_updates();
        a.forget_slot(1);
        let u = a.take_updates();
        assert_eq!(holders(&u, 41), vec![2], "other ranks keep theirs");
        assert!(holders(&u, 42).is_empty());
        assert!(
            holders(&u, 51).is_empty(),
            "text prefixes went with the cache"
        );
        assert_eq!(a.len(), 1);
        a.forget_slot(9);
        assert!(
            a.take_updates().is_empty(),
            "an unknown rank changes nothing"
        );
    }
}
