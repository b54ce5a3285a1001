//! Publishing: the current snapshot, and the update frames the snapshot
//! service in Envoy long-polls for.

use crate::kv::plane::ShardLog;
use crate::versions::Versions;
use kvgate_core::Snapshot;
use kvgate_core::snapshot::HEADER_LEN;
use kvgate_core::update;
use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
struct Stored {
    version: u64,
    /// The encoding with version and time zeroed: what "changed" compares.
    content: Vec<u8>,
    bytes: Arc<Vec<u8>>,
    snapshot: Snapshot,
}

/// The latest snapshot and its version.
#[derive(Debug, Default)]
pub struct SnapshotStore {
    inner: Mutex<Stored>,
}

impl SnapshotStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Stored> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes `snap` if its content differs from the current one.
    /// Returns the new version when it did.
    pub fn publish(&self, versions: &Versions, mut snap: Snapshot, now_ms: u64) -> Option<u64> {
        snap.version = 0;
        snap.built_at_ms = 0;
        let content = match snap.encode() {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "snapshot does not encode; keeping the previous one");
                return None;
            }
        };
        if self.lock().content == content {
            return None;
        }
        Some(versions.publish(|v| {
            let mut bytes = content.clone();
            // Version and build time live at fixed header offsets.
            bytes[12..20].copy_from_slice(&v.to_le_bytes());
            bytes[20..HEADER_LEN].copy_from_slice(&now_ms.to_le_bytes());
            snap.version = v;
            snap.built_at_ms = now_ms;
            *self.lock() = Stored {
                version: v,
                content,
                bytes: Arc::new(bytes),
                snapshot: snap,
            };
            v
        }))
    }

    pub fn version(&self) -> u64 {
        self.lock().version
    }

    pub fn bytes(&self) -> Arc<Vec<u8>> {
        self.lock().bytes.clone()
    }

    pub fn snapshot(&self) -> Snapshot {
        self.lock().snapshot.clone()
    }
}

/// The frame for a reader at (`after`, `epoch`), or `None` when it is up to
/// date. A reader from another epoch, or a new one (`after == 0`), gets a
/// reset frame with the full state.
pub fn frame(
    versions: &Versions,
    store: &SnapshotStore,
    shards: Option<&ShardLog>,
    after: u64,
    epoch: u64,
) -> Option<Vec<u8>> {
    let current = versions.current();
    let reset = epoch != versions.epoch || after == 0 || after > current;
    if !reset && current <= after {
        return None;
    }
    let since = if reset { 0 } else { after };
    let snap = (reset || store.version() > after).then(|| store.bytes());
    let changed = shards
        .map(|log| log.changed_since(since))
        .unwrap_or_default();
    Some(update::encode(
        current,
        versions.epoch,
        reset,
        snap.as_deref().map(Vec::as_slice),
        changed
            .iter()
            .map(|u| (u.model.as_str(), u.shard, u.bytes.as_slice())),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::ModelState;

    fn snap(name: &str) -> Snapshot {
        Snapshot {
            models: vec![ModelState {
                name: name.into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn version_moves_only_on_change_and_frames_follow() {
        let v = Versions::new();
        let s = SnapshotStore::default();
        assert_eq!(s.publish(&v, snap("a"), 10), Some(1));
        assert_eq!(
            s.publish(&v, snap("a"), 20),
            None,
            "same content, same version"
        );
        let decoded = Snapshot::decode(&s.bytes()).unwrap();
        assert_eq!((decoded.version, decoded.built_at_ms), (1, 10));

        let f = frame(&v, &s, None, 0, 0).unwrap();
        let u = update::decode(&f).unwrap();
        assert!(u.reset);
        assert_eq!((u.version, u.epoch), (1, v.epoch));
        assert!(u.snapshot.is_some());
        assert!(frame(&v, &s, None, 1, v.epoch).is_none(), "up to date");
        assert!(
            update::decode(&frame(&v, &s, None, 1, v.epoch ^ 1).unwrap())
                .unwrap()
                .reset,
            "another epoch resets"
        );

        assert_eq!(s.publish(&v, snap("b"), 30), Some(2));
        let u2 = frame(&v, &s, None, 1, v.epoch).unwrap();
        let u = update::decode(&u2).unwrap();
        assert!(!u.reset);
        assert_eq!(u.version, 2);
        assert_eq!(
            Snapshot::decode(u.snapshot.unwrap()).unwrap().models[0].name,
            "b"
        );
    }
}
