//! Publishing: the snapshot rebuilt from the fleet and the ledger, and the
//! routed-prefix index's changed shards, handed to what Envoy polls. The
//! publish loop runs it each tick; catalog changes, scrapes that change a
//! worker's health and planner decisions run it at once.

use super::ledger::Ledger;
use crate::clock::now_ms;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::metrics::SnapshotMetrics;
use crate::publish::{ShardLog, SnapshotStore, Versions};
use crate::replica::wire::{SyncEvent, SyncId};
use crate::sources::kv::plane::Plane;
use crate::sources::routed::ApproxIndex;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone)]
pub(crate) struct Publisher {
    pub(super) config: Arc<Config>,
    pub(super) fleet: Arc<Mutex<Fleet>>,
    pub(super) ledger: Ledger,
    pub(super) store: Arc<SnapshotStore>,
    pub(super) versions: Arc<Versions>,
    pub(super) shards: Arc<ShardLog>,
    pub(super) plane: Arc<Plane>,
    pub(super) routed: Arc<Mutex<ApproxIndex>>,
    pub(super) metrics: Arc<SnapshotMetrics>,
}

impl Publisher {
    /// Rebuilds and publishes the snapshot if it changed; refreshes gauges.
    pub(crate) fn publish_now(&self) {
        let (snap, silenced) = {
            let now = Instant::now();
            let mut b = self.ledger.lock();
            let sweep = b.sweep(now);
            let ledger = self.ledger.metrics();
            if sweep.expired > 0 {
                let expired = sweep.expired;
                tracing::warn!(expired, "bookings expired without their end being reported");
                ledger.bookings_expired.inc_by(expired as u64);
            }
            if !sweep.silenced.is_empty() {
                ledger.bookings_silenced.inc_by(sweep.silenced.len() as u64);
            }
            for (work, n) in [("expiry", sweep.visited), ("rebuild", sweep.rebuilt)] {
                if n > 0 {
                    ledger
                        .sweep_entries
                        .with_label_values(&[work])
                        .inc_by(n as u64);
                }
            }
            let mut f = self.fleet.lock();
            f.expire(now, self.config.scrape.down_after);
            let snap = f.build_snapshot(&b, self.config.load.max_retry_after_s);
            f.show(&b, &snap, &self.metrics, ledger);
            (snap, sweep.silenced)
        };
        // Peers booked copies of those bookings when they were admitted.
        for key in silenced {
            self.ledger
                .announce(|| SyncEvent::Free(SyncId::Gateway(key)));
        }
        let m = &self.metrics;
        if let Some(v) = self.store.publish(&self.versions, snap, now_ms()) {
            tracing::debug!(version = v, "published snapshot");
            m.bytes.set(self.store.bytes().len() as i64);
        }
        m.version.set(self.versions.current() as i64);
    }

    /// Expires and publishes the routed-prefix index's changed shards;
    /// ranks whose engine emptied its cache forget their routed prefixes.
    pub(crate) fn publish_routed(&self) {
        let cleared = self.plane.take_cleared();
        let updates = {
            let mut a = self.routed.lock();
            for slot in cleared {
                a.forget_slot(slot);
            }
            a.sweep(Instant::now());
            a.take_updates()
        };
        if !updates.is_empty() {
            self.shards.publish(updates);
        }
    }
}
