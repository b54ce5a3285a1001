//! The snapshot service's long-poll state machine, free of host calls.
//!
//! Exactly one poll is in flight. A 200 carries an update frame: it is
//! validated whole (snapshot and every shard) before anything is written,
//! then turned into shared-data writes in a safe order — shards and
//! snapshot first, the manifest last — so a reader that sees a new manifest
//! finds the data it names. A 204 only refreshes freshness. Failures back
//! off exponentially.

use crate::manifest::{self, Manifest};
use kvgate_core::Snapshot;
use kvgate_core::shard::ShardView;
use kvgate_core::text::{self, template::PromptTemplate};
use kvgate_core::update::{self, shard_key};
use std::collections::BTreeSet;

pub const MAX_BACKOFF_MS: u64 = 5000;

#[derive(Debug, Default)]
pub struct Poller {
    manifest: Manifest,
    in_flight: bool,
    backoff_ms: u64,
    retry_at_ms: u64,
    /// Shard keys written non-empty, to clear on a reset.
    held: BTreeSet<String>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum PollError {
    /// The body is not a valid update; nothing was applied.
    Decode(String),
}

impl Poller {
    /// Carries on from the manifest another poller left in shared data
    /// (a lease taken over): the next poll asks for what changed since.
    /// Shards the last holder wrote and a later reset drops are cleared
    /// only if this poller wrote them too (the ABI cannot list keys).
    pub fn resume(manifest: Manifest) -> Poller {
        Poller {
            manifest,
            ..Poller::default()
        }
    }

    pub fn due(&self, now_ms: u64) -> bool {
        !self.in_flight && now_ms >= self.retry_at_ms
    }

    pub fn path(&self, wait_ms: u64) -> String {
        format!(
            "/v1/snapshot?after={}&epoch={}&wait_ms={wait_ms}",
            self.manifest.update_version, self.manifest.epoch
        )
    }

    pub fn sent(&mut self) {
        self.in_flight = true;
    }

    pub fn manifest(&self) -> Manifest {
        self.manifest
    }

    /// A failed poll (transport error, bad status, bad body).
    pub fn failed(&mut self, now_ms: u64, base_backoff_ms: u64) {
        self.in_flight = false;
        self.backoff_ms = (self.backoff_ms * 2).clamp(base_backoff_ms, MAX_BACKOFF_MS);
        self.retry_at_ms = now_ms + self.backoff_ms;
    }

    fn succeeded(&mut self, now_ms: u64) {
        self.in_flight = false;
        self.backoff_ms = 0;
        self.retry_at_ms = 0;
        self.manifest.fresh_at_ms = now_ms;
    }

    /// A 204: nothing changed, the sidecar is alive. A different epoch in
    /// its headers means it restarted: the next poll asks for a reset.
    pub fn no_change(&mut self, now_ms: u64, epoch: Option<u64>) -> Vec<(String, Vec<u8>)> {
        self.succeeded(now_ms);
        if epoch.is_some_and(|e| e != self.manifest.epoch) {
            self.manifest.update_version = 0;
        }
        vec![(manifest::KEY.to_string(), self.manifest.encode().to_vec())]
    }

    /// A 200: validates the frame and returns the writes to make, in order.
    pub fn changed(
        &mut self,
        now_ms: u64,
        body: &[u8],
    ) -> Result<Vec<(String, Vec<u8>)>, PollError> {
        let u = update::decode(body).map_err(|e| PollError::Decode(e.to_string()))?;
        let snapshot_version = match u.snapshot {
            Some(b) => Some(
                Snapshot::decode(b)
                    .map_err(|e| PollError::Decode(e.to_string()))?
                    .version,
            ),
            None => None,
        };
        for s in &u.shards {
            let bad = |e: &dyn std::fmt::Display| {
                PollError::Decode(format!("shard {} of {}: {e}", s.shard, s.model))
            };
            if text::is_template_namespace(s.model) {
                if !s.bytes.is_empty() {
                    PromptTemplate::decode(s.bytes).map_err(|e| bad(&e))?;
                }
                continue;
            }
            ShardView::parse(s.bytes)
                .and_then(|v| v.validate())
                .map_err(|e| bad(&e))?;
        }
        let mut writes = Vec::with_capacity(u.shards.len() + 2);
        let mut written = BTreeSet::new();
        for s in &u.shards {
            let key = shard_key(s.model, s.shard);
            if s.bytes.is_empty() {
                self.held.remove(&key);
            } else {
                self.held.insert(key.clone());
            }
            written.insert(key.clone());
            writes.push((key, s.bytes.to_vec()));
        }
        if u.reset {
            // Shards the new state does not mention are empty now. The ABI
            // has no delete; an empty value is how "gone" is written.
            let stale: Vec<String> = self.held.difference(&written).cloned().collect();
            for key in stale {
                self.held.remove(&key);
                writes.push((key, Vec::new()));
            }
        }
        if let (Some(b), Some(v)) = (u.snapshot, snapshot_version) {
            writes.push((manifest::SNAPSHOT_KEY.to_string(), b.to_vec()));
            self.manifest.snapshot_version = v;
        }
        self.manifest.update_version = u.version;
        self.manifest.epoch = u.epoch;
        self.succeeded(now_ms);
        writes.push((manifest::KEY.to_string(), self.manifest.encode().to_vec()));
        Ok(writes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::ModelState;
    use kvgate_core::shard::{Holder, encode};

    fn snap(v: u64) -> Vec<u8> {
        Snapshot {
            version: v,
            built_at_ms: 1,
            models: vec![ModelState {
                name: "m".into(),
                ..Default::default()
            }],
            applied: Vec::new(),
        }
        .encode()
        .unwrap()
    }

    fn shard() -> Vec<u8> {
        encode(&mut [(5, vec![Holder { slot: 0, tiers: 1 }])])
    }

    #[test]
    fn first_poll_then_changes_then_heartbeat() {
        let mut p = Poller::default();
        assert!(p.due(0));
        assert_eq!(p.path(1000), "/v1/snapshot?after=0&epoch=0&wait_ms=1000");
        p.sent();
        assert!(!p.due(0), "one poll at a time");
        let s = snap(3);
        let sh = shard();
        let frame = update::encode(4, 77, true, Some(&s), [("m", 2, &sh[..])]);
        let w = p.changed(100, &frame).unwrap();
        let keys: Vec<&str> = w.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            ["kvgate.idx.m.2", "kvgate.snapshot", "kvgate.manifest"],
            "manifest last"
        );
        let m = Manifest::decode(&w[2].1).unwrap();
        assert_eq!(
            (m.snapshot_version, m.update_version, m.epoch, m.fresh_at_ms),
            (3, 4, 77, 100)
        );
        assert_eq!(p.path(5), "/v1/snapshot?after=4&epoch=77&wait_ms=5");

        let w = p.no_change(200, Some(77));
        assert_eq!(Manifest::decode(&w[0].1).unwrap().fresh_at_ms, 200);
        // The sidecar restarted: ask for a reset.
        p.no_change(300, Some(78));
        assert!(p.path(1).starts_with("/v1/snapshot?after=0&"));
    }

    #[test]
    fn reset_clears_shards_it_does_not_mention() {
        let mut p = Poller::default();
        let sh = shard();
        p.changed(
            1,
            &update::encode(
                1,
                9,
                true,
                Some(&snap(1)),
                [("m", 1, &sh[..]), ("m", 2, &sh[..])],
            ),
        )
        .unwrap();
        let w = p
            .changed(2, &update::encode(2, 9, true, None, [("m", 2, &sh[..])]))
            .unwrap();
        assert!(w.contains(&("kvgate.idx.m.1".to_string(), Vec::new())));
        assert!(!w.iter().any(|(k, v)| k == "kvgate.idx.m.2" && v.is_empty()));
    }

    #[test]
    fn bad_frames_apply_nothing_and_back_off() {
        let mut p = Poller::default();
        p.sent();
        assert!(p.changed(1, b"garbage").is_err());
        let bad_snapshot = update::encode(1, 1, true, Some(&[1, 2, 3]), []);
        assert!(p.changed(1, &bad_snapshot).is_err());
        let bad_shard = update::encode(1, 1, true, None, [("m", 0, &[9u8, 9][..])]);
        assert!(p.changed(1, &bad_shard).is_err());
        assert_eq!(p.manifest(), Manifest::default());
        p.failed(1000, 100);
        assert!(!p.due(1099));
        assert!(p.due(1100));
        p.failed(1100, 100);
        assert!(!p.due(1299));
        for _ in 0..10 {
            p.failed(0, 100);
        }
        assert!(p.due(MAX_BACKOFF_MS), "backoff is capped");
    }
}
