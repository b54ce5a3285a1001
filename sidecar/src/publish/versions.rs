//! One version counter for everything the sidecar publishes.
//!
//! Load snapshots and KV index shards are published independently, but a
//! reader asks for "everything after version V" with a single number. So
//! every publication takes the next version under one lock, stores its data
//! tagged with it, and only then makes the version current. A reader that
//! sees version V finds every item up to V stored (it may also see items of
//! a publication still in progress, which it then gets again: harmless).

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::watch;

pub struct Versions {
    lock: Mutex<()>,
    current: AtomicU64,
    tx: watch::Sender<u64>,
    /// Random per process; readers from another epoch need a full reset.
    pub epoch: u64,
}

impl Default for Versions {
    fn default() -> Self {
        Self::new()
    }
}

impl Versions {
    pub(crate) fn new() -> Versions {
        let (tx, _) = watch::channel(0);
        Versions {
            lock: Mutex::new(()),
            current: AtomicU64::new(0),
            tx,
            epoch: random_epoch(),
        }
    }

    pub fn current(&self) -> u64 {
        self.current.load(Ordering::Acquire)
    }

    /// Runs `store(v)` with the next version and makes it current.
    pub(crate) fn publish<R>(&self, store: impl FnOnce(u64) -> R) -> R {
        let _g = self.lock.lock();
        let v = self.current() + 1;
        let r = store(v);
        self.current.store(v, Ordering::Release);
        self.tx.send_replace(v);
        r
    }

    /// Wakes when a new version is published.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.tx.subscribe()
    }
}

fn random_epoch() -> u64 {
    // std seeds RandomState from the OS per process: enough for an epoch,
    // which only has to differ between two runs of the sidecar.
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now();
    std::collections::hash_map::RandomState::new()
        .hash_one(now)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publications_are_ordered_and_announced() {
        let v = Versions::new();
        let mut rx = v.subscribe();
        assert_eq!(v.current(), 0);
        let seen = v.publish(|n| n);
        assert_eq!((seen, v.current()), (1, 1));
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), 1);
        assert_ne!(v.epoch, 0);
        assert_ne!(Versions::new().epoch, v.epoch);
    }
}
