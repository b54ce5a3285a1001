//! The update frames the snapshot service in Envoy long-polls for.

use super::shard_log::ShardLog;
use super::store::SnapshotStore;
use super::versions::Versions;
use kvgate_core::update;

/// Shard bytes one frame carries at most (more when a single version is
/// larger). Bounds what Envoy buffers and what the snapshot service copies
/// into its VM, whose memory never shrinks.
pub const FRAME_SHARD_BYTES: usize = 1 << 20;

/// Whether a reader at (`after`, `epoch`) is sent a reset frame: it is new
/// (`after == 0`), from another epoch, or ahead of this process.
pub fn is_reset(versions: &Versions, after: u64, epoch: u64) -> bool {
    epoch != versions.epoch || after == 0 || after > versions.current()
}

/// The frame for a reader at (`after`, `epoch`), or `None` when it is up to
/// date. A reader from another epoch, or a new one (`after == 0`), gets a
/// reset frame. Shards are taken in version order up to
/// [`FRAME_SHARD_BYTES`], whole versions only; the frame's version says how
/// far the reader got, and its next poll gets the rest at once.
pub fn frame(
    versions: &Versions,
    store: &SnapshotStore,
    shards: Option<&ShardLog>,
    after: u64,
    epoch: u64,
) -> Option<Vec<u8>> {
    let current = versions.current();
    let reset = is_reset(versions, after, epoch);
    if !reset && current <= after {
        return None;
    }
    let since = if reset { 0 } else { after };
    let snap = (reset || store.version() > after).then(|| store.bytes());
    let changed = shards
        .map(|log| log.changed_since(since))
        .unwrap_or_default();
    let mut taken = 0;
    let mut bytes = 0;
    let mut version = current;
    while taken < changed.len() {
        let v = changed[taken].version;
        let group = changed[taken..]
            .iter()
            .take_while(|u| u.version == v)
            .count();
        let group_bytes: usize = changed[taken..taken + group]
            .iter()
            .map(|u| u.bytes.len())
            .sum();
        if taken > 0 && bytes + group_bytes > FRAME_SHARD_BYTES {
            // Everything up to the previous version is in this frame.
            version = changed[taken - 1].version;
            break;
        }
        taken += group;
        bytes += group_bytes;
    }
    Some(update::encode(
        version,
        versions.epoch,
        reset,
        snap.as_deref().map(Vec::as_slice),
        changed[..taken]
            .iter()
            .map(|u| (u.model.as_str(), u.shard, u.bytes.as_slice())),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::ModelState;
    use kvgate_core::Snapshot;
    use std::sync::Arc;

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
    fn big_updates_come_in_bounded_frames_at_version_boundaries() {
        let v = Arc::new(Versions::new());
        let s = SnapshotStore::default();
        s.publish(&v, snap("a"), 1);
        let log = ShardLog::new(v.clone());
        // Three versions of 0.75 MiB each: a frame takes the first alone
        // (the second would pass the 1 MiB cap), the next poll the next.
        for round in 0..3u32 {
            log.publish(vec![("m".into(), round, 8, vec![1u8; 3 << 18])]);
        }
        let f1 = frame(&v, &s, Some(&log), 0, 0).unwrap();
        let u1 = update::decode(&f1).unwrap();
        assert!(u1.reset);
        assert_eq!(u1.shards.len(), 1);
        assert!(u1.version < v.current());
        let f2 = frame(&v, &s, Some(&log), u1.version, v.epoch).unwrap();
        let u2 = update::decode(&f2).unwrap();
        assert_eq!(
            u2.shards.len(),
            1,
            "still one version per frame at this size"
        );
        let f3 = frame(&v, &s, Some(&log), u2.version, v.epoch).unwrap();
        let u3 = update::decode(&f3).unwrap();
        assert_eq!((u3.shards.len(), u3.version), (1, v.current()));
        assert!(frame(&v, &s, Some(&log), u3.version, v.epoch).is_none());
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
