//! The latest snapshot, stored encoded once for every reader.

use super::versions::Versions;
use kvgate_core::Snapshot;
use kvgate_core::snapshot::HEADER_LEN;
use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;

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
    fn lock(&self) -> MutexGuard<'_, Stored> {
        self.inner.lock()
    }

    /// Publishes `snap` if its content differs from the current one.
    /// Returns the new version when it did.
    pub(crate) fn publish(
        &self,
        versions: &Versions,
        mut snap: Snapshot,
        now_ms: u64,
    ) -> Option<u64> {
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

    pub(crate) fn version(&self) -> u64 {
        self.lock().version
    }

    pub(crate) fn bytes(&self) -> Arc<Vec<u8>> {
        self.lock().bytes.clone()
    }

    pub fn snapshot(&self) -> Snapshot {
        self.lock().snapshot.clone()
    }
}
