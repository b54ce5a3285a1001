//! The sidecar's state, shared by its tasks and its HTTP handlers, and
//! what acts on all of it: publishing, catalog changes (`control`), the
//! sources' reports applied (`ingest`) and reservations told to peers
//! (`reservations`).

mod control;
mod ingest;
mod reservations;

use crate::api::{Backend, FullReads};
use crate::clock::now_ms;
use crate::config::{Config, WorkerSpec};
use crate::fleet::{Fleet, FleetError, RankId, WorkerEntry};
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::publish::{ShardLog, SnapshotStore, Versions};
use crate::replica::ReplicaSync;
use crate::replica::wire::{SyncEvent, SyncId};
use crate::sources::bookings::{Bookings, LedgerError, Load};
use crate::sources::kv::plane::{Plane, PlaneConfig};
use crate::sources::kv::socket::SocketLimits;
use crate::sources::metrics::scrape::{self, HttpClient};
use crate::sources::routed::ApproxIndex;
use crate::{recovery, tick};
use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One sidecar process: its configuration, the fleet, what the sources
/// feed in and what it publishes. Its tasks and HTTP handlers share it
/// behind an `Arc`; each lock guards one part, and none is held while
/// another is taken, except the bookings before the fleet when a snapshot
/// is built.
pub struct Sidecar {
    config: Arc<Config>,
    fleet: Arc<Mutex<Fleet>>,
    versions: Arc<Versions>,
    store: SnapshotStore,
    /// Every model's index shards as last published.
    shards: Arc<ShardLog>,
    plane: Arc<Plane>,
    metrics: Metrics,
    routed: Mutex<ApproxIndex>,
    bookings: Mutex<Bookings>,
    /// Unix ms when a gateway's long poll was last answered.
    last_poll_ms: AtomicU64,
    client: HttpClient,
    workers: Lifecycle,
    /// Present when `[replica_sync] listen` is set.
    replica: Option<ReplicaSync>,
    /// The whole-index copies readers share, and their cap.
    full_reads: FullReads,
    /// Start-up recovery of the index from peers is under way: not ready.
    recovering: Arc<AtomicBool>,
}

impl Sidecar {
    /// Builds the sidecar and starts its background work on the current
    /// tokio runtime. Call [`crate::api::router`] to serve it.
    pub fn start(config: Config) -> anyhow::Result<Arc<Sidecar>> {
        let versions = Arc::new(Versions::new());
        let shards = Arc::new(ShardLog::new(versions.clone()));
        let sink = shards.clone();
        let plane = Plane::start(
            PlaneConfig {
                shard_count: config.kv.shards,
                max_blocks_per_slot: config.kv.max_blocks_per_rank,
                publish_interval: config.kv.publish_interval.max(Duration::from_millis(1)),
                hold: recovery::hold(&config.indexer),
                ..Default::default()
            },
            Box::new(move |changed| sink.publish(changed)),
        )?;
        let mut fleet = Fleet::new(&config)?;
        for m in &config.models {
            let Some(pc) = &m.prompt else { continue };
            let prompt = crate::prompt::Prompt::load(&m.name, pc)?;
            let version = prompt.template.version();
            tracing::info!(
                model = m.name,
                tokens = prompt.vocab.defined_tokens(),
                template = format!("{version:#x}"),
                "text prompts are matched against KV events"
            );
            plane.set_vocab(&m.name, prompt.vocab.clone());
            shards.publish(vec![(
                kvgate_core::text::template_key(&m.name),
                0,
                1,
                prompt.template.encode(),
            )]);
            fleet.prompt_published(&m.name, version);
        }
        let metrics = Metrics::new()?;
        let (inbound_tx, mut inbound) = tokio::sync::mpsc::channel(crate::replica::INBOUND_BATCHES);
        let replica = match config.replica_sync.listen {
            Some(listen) => {
                let r = ReplicaSync::start(
                    listen,
                    &config.replica_sync.peers,
                    config.replica_sync.max_message_age,
                    config.control.token.clone(),
                    inbound_tx,
                    crate::replica::SyncStats::from_metrics(&metrics.ledger),
                )?;
                tracing::info!(endpoint = r.endpoint(), peers = ?config.replica_sync.peers, origin = r.origin(), "replica sync on");
                Some(r)
            }
            None => None,
        };
        let workers = Lifecycle::new(
            config.kv.replay_timeout,
            config.kv.max_replay_bytes,
            SocketLimits {
                max_message_bytes: config.kv.max_message_bytes,
                queue_messages: config.kv.queue_messages,
            },
            metrics.kv.subscribers.clone(),
        );
        let full_reads = FullReads::new(&config.server, &metrics.listener);
        let sc = Arc::new(Sidecar {
            fleet: Arc::new(Mutex::new(fleet)),
            versions,
            store: SnapshotStore::default(),
            shards,
            plane: Arc::new(plane),
            metrics,
            routed: Mutex::new(ApproxIndex::new(
                config.kv.approx_ttl,
                config.kv.inflight_ttl,
            )),
            bookings: Mutex::new(
                Bookings::new(config.load.booking_ttl, config.load.caps)
                    .with_vm_silence(config.load.vm_silence),
            ),
            last_poll_ms: AtomicU64::new(now_ms()),
            client: scrape::client(),
            workers,
            replica,
            full_reads,
            recovering: Arc::new(AtomicBool::new(!config.indexer.peers.is_empty())),
            config: Arc::new(config),
        });
        if sc.replica.is_some() {
            let weak = Arc::downgrade(&sc);
            tokio::spawn(async move {
                while let Some((origin, events)) = inbound.recv().await {
                    let Some(sc) = weak.upgrade() else { return };
                    sc.peer_announced(origin, events);
                }
            });
        }
        let ids: Vec<u64> = sc.fleet().workers().keys().copied().collect();
        for id in ids {
            sc.worker_started(id);
        }
        if !sc.config.indexer.peers.is_empty() {
            // The subscribers above are connecting; their batches wait for
            // this (see `Plane`).
            tokio::spawn(recovery::run(recovery::Handles {
                indexer: sc.config.indexer.clone(),
                client: sc.client.clone(),
                plane: sc.plane.clone(),
                metrics: sc.metrics.kv.clone(),
                recovering: sc.recovering.clone(),
                token: sc.config.control.token.clone(),
            }));
        }
        sc.publish_now();
        tokio::spawn(tick::publish_loop(sc.clone()));
        tokio::spawn(crate::thermal::thermal_loop(crate::thermal::Handles {
            config: sc.config.clone(),
            fleet: sc.fleet.clone(),
            metrics: sc.metrics.thermal.clone(),
            client: sc.client.clone(),
        }));
        tokio::spawn(tick::planner_loop(sc.clone()));
        Ok(sc)
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn fleet(&self) -> MutexGuard<'_, Fleet> {
        self.fleet.lock()
    }

    /// Workers in the catalog, up or not.
    pub fn worker_count(&self) -> usize {
        self.fleet().workers().len()
    }

    pub fn versions(&self) -> &Versions {
        &self.versions
    }

    pub fn store(&self) -> &SnapshotStore {
        &self.store
    }

    /// Every model's index shards as last published.
    pub(crate) fn shards(&self) -> &ShardLog {
        &self.shards
    }

    pub fn plane(&self) -> &Plane {
        &self.plane
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub(crate) fn bookings(&self) -> MutexGuard<'_, Bookings> {
        self.bookings.lock()
    }

    /// Requests the gateways routed that have not ended.
    pub fn active_bookings(&self) -> usize {
        self.bookings().active()
    }

    pub(crate) fn routed(&self) -> MutexGuard<'_, ApproxIndex> {
        self.routed.lock()
    }

    pub(crate) fn client(&self) -> &HttpClient {
        &self.client
    }

    pub(crate) fn workers(&self) -> &Lifecycle {
        &self.workers
    }

    pub fn replica(&self) -> Option<&ReplicaSync> {
        self.replica.as_ref()
    }

    /// Tells the replica-sync peers, if there are any.
    pub(crate) fn announce(&self, ev: impl FnOnce() -> SyncEvent) {
        if let Some(r) = &self.replica {
            r.announce(ev());
        }
    }

    pub(crate) fn full_reads(&self) -> &FullReads {
        &self.full_reads
    }

    /// Whether start-up recovery from index peers is still under way.
    pub(crate) fn recovering(&self) -> bool {
        self.recovering.load(Ordering::Acquire)
    }

    /// Notes that a gateway's long poll was answered.
    pub(crate) fn polled(&self) {
        self.last_poll_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// How long since a gateway last heard from us.
    pub(crate) fn poll_age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.last_poll_ms.load(Ordering::Relaxed)))
    }

    /// Rebuilds and publishes the snapshot if it changed; refreshes gauges.
    pub(crate) fn publish_now(&self) {
        let (snap, silenced) = {
            let now = Instant::now();
            let mut b = self.bookings();
            let sweep = b.sweep(now);
            let ledger = &self.metrics().ledger;
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
            let mut f = self.fleet();
            f.expire(now, self.config().scrape.down_after);
            let snap = f.build_snapshot(&b, self.config().load.max_retry_after_s);
            let m = self.metrics();
            f.show(&b, &snap, &m.snapshot, &m.ledger);
            (snap, sweep.silenced)
        };
        // Peers booked copies of those bookings when they were admitted.
        for key in silenced {
            self.announce(|| SyncEvent::Free(SyncId::Gateway(key)));
        }
        let m = &self.metrics().snapshot;
        if let Some(v) = self.store().publish(self.versions(), snap, now_ms()) {
            tracing::debug!(version = v, "published snapshot");
            m.bytes.set(self.store().bytes().len() as i64);
        }
        m.version.set(self.versions().current() as i64);
    }

    /// Expires and publishes the routed-prefix index's changed shards;
    /// ranks whose engine emptied its cache forget their routed prefixes.
    pub(crate) fn publish_routed(&self) {
        let cleared = self.plane().take_cleared();
        let updates = {
            let mut a = self.routed();
            for slot in cleared {
                a.forget_slot(slot);
            }
            a.sweep(Instant::now());
            a.take_updates()
        };
        if !updates.is_empty() {
            self.shards().publish(updates);
        }
    }
}

/// The API's view of the sidecar: each method is the sidecar's own.
impl Backend for Sidecar {
    fn config(&self) -> &Config {
        Sidecar::config(self)
    }

    fn fleet(&self) -> MutexGuard<'_, Fleet> {
        Sidecar::fleet(self)
    }

    fn bookings(&self) -> MutexGuard<'_, Bookings> {
        Sidecar::bookings(self)
    }

    fn metrics(&self) -> &Metrics {
        Sidecar::metrics(self)
    }

    fn store(&self) -> &SnapshotStore {
        Sidecar::store(self)
    }

    fn versions(&self) -> &Versions {
        Sidecar::versions(self)
    }

    fn shards(&self) -> &ShardLog {
        Sidecar::shards(self)
    }

    fn plane(&self) -> &Plane {
        Sidecar::plane(self)
    }

    fn replica(&self) -> Option<&ReplicaSync> {
        Sidecar::replica(self)
    }

    fn full_reads(&self) -> &FullReads {
        Sidecar::full_reads(self)
    }

    fn recovering(&self) -> bool {
        Sidecar::recovering(self)
    }

    fn polled(&self) {
        Sidecar::polled(self)
    }

    fn poll_age(&self) -> Duration {
        Sidecar::poll_age(self)
    }

    fn add_worker(self: Arc<Self>, spec: WorkerSpec) -> Result<WorkerEntry, FleetError> {
        Sidecar::add_worker(&self, spec)
    }

    fn patch_worker(
        self: Arc<Self>,
        id: u64,
        patch: &serde_json::Value,
    ) -> Result<WorkerEntry, FleetError> {
        Sidecar::patch_worker(&self, id, patch)
    }

    fn remove_worker(&self, id: u64) -> Result<(), FleetError> {
        Sidecar::remove_worker(self, id)
    }

    fn set_thresholds(&self, model: &str, t: kvgate_core::Thresholds) -> Result<(), FleetError> {
        Sidecar::set_thresholds(self, model, t)
    }

    fn book(&self, events: Vec<kvgate_core::booking::Event>) {
        Sidecar::book(self, events)
    }

    fn learn(&self, records: &[kvgate_core::approx::Routed]) -> usize {
        Sidecar::learn(self, records)
    }

    fn reserve(
        &self,
        ledger: &mut Bookings,
        id: &str,
        rank: &RankId,
        load: Load,
    ) -> Result<(), LedgerError> {
        Sidecar::reserve(self, ledger, id, rank, load)
    }

    fn reservation_prefill_complete(&self, id: &str) -> Result<(), LedgerError> {
        Sidecar::reservation_prefill_complete(self, id)
    }

    fn reservation_output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), LedgerError> {
        Sidecar::reservation_output_block(self, id, decay_fraction)
    }

    fn free_reservation(&self, id: &str) -> Result<(), LedgerError> {
        Sidecar::free_reservation(self, id)
    }
}
