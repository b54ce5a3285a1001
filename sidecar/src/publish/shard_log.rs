//! The published shards of every model's index, each tagged with the
//! version it last changed at.

use super::versions::Versions;
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;

/// One model's shards as last published.
#[derive(Debug, Default)]
struct ModelShards {
    /// (version at which it last changed, bytes)
    shards: Vec<(u64, Arc<Vec<u8>>)>,
}

#[derive(Debug, Default)]
struct LogInner {
    models: HashMap<String, ModelShards>,
}

/// A changed shard, ready to send.
#[derive(Debug, Clone)]
pub(crate) struct ShardUpdate {
    /// The version that published it.
    pub version: u64,
    pub model: String,
    pub shard: u32,
    pub bytes: Arc<Vec<u8>>,
}

/// Published shards with versions. Cheap to read from the HTTP side.
pub struct ShardLog {
    inner: Mutex<LogInner>,
    versions: Arc<Versions>,
}

impl ShardLog {
    fn lock(&self) -> MutexGuard<'_, LogInner> {
        self.inner.lock()
    }

    pub(crate) fn new(versions: Arc<Versions>) -> ShardLog {
        ShardLog {
            inner: Mutex::default(),
            versions,
        }
    }

    #[cfg(test)]
    pub(crate) fn version(&self) -> u64 {
        self.versions.current()
    }

    /// Shards changed after `since`; `since = 0` returns every non-empty
    /// shard (what a fresh reader needs).
    pub(crate) fn changed_since(&self, since: u64) -> Vec<ShardUpdate> {
        let inner = self.lock();
        let mut out = Vec::new();
        for (model, m) in &inner.models {
            for (i, (v, bytes)) in m.shards.iter().enumerate() {
                if *v > since && (since > 0 || !bytes.is_empty()) {
                    out.push(ShardUpdate {
                        version: *v,
                        model: model.clone(),
                        shard: i as u32,
                        bytes: bytes.clone(),
                    });
                }
            }
        }
        out.sort_by_key(|u| u.version);
        out
    }

    /// The shard a shared-data key names (`kvgate_core::update::shard_key`),
    /// as last published: what a router VM would read there.
    pub(crate) fn read(&self, key: &str) -> Option<Vec<u8>> {
        let (model, shard) = kvgate_core::update::parse_shard_key(key)?;
        let inner = self.lock();
        let (_, bytes) = inner.models.get(model)?.shards.get(shard as usize)?;
        (!bytes.is_empty()).then(|| bytes.to_vec())
    }

    /// Number of shards per model (models with an index).
    #[cfg(test)]
    pub(crate) fn shard_counts(&self) -> Vec<(String, u32)> {
        self.lock()
            .models
            .iter()
            .map(|(k, m)| (k.clone(), m.shards.len() as u32))
            .collect()
    }

    pub(crate) fn publish(&self, updates: Vec<(String, u32, usize, Vec<u8>)>) {
        if updates.is_empty() {
            return;
        }
        self.versions.publish(|v| {
            let mut inner = self.lock();
            for (model, shard, count, bytes) in updates {
                let m = inner.models.entry(model).or_default();
                if m.shards.len() < count {
                    m.shards.resize_with(count, || (0, Arc::new(Vec::new())));
                }
                if let Some(slot) = m.shards.get_mut(shard as usize) {
                    *slot = (v, Arc::new(bytes));
                }
            }
        });
    }
}
