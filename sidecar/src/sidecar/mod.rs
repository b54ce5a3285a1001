//! The running sidecar: its start-up, which builds every part and hands
//! each task and handler the handles it uses, and what acts on more than
//! one part: publishing (`publisher`), catalog changes (`control`), the
//! sources' reports applied (`ingest`), the shared ledger told to peers
//! (`ledger`) and reservations in it (`reservations`).

mod control;
mod ingest;
mod ledger;
pub(crate) mod publisher;
mod reservations;

use crate::api::{FullReads, Handles, LastPoll, Selection};
use crate::config::Config;
use crate::fleet::Fleet;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::publish::{ShardLog, SnapshotStore, Versions};
use crate::recovery::Recovering;
use crate::replica::ReplicaSync;
use crate::sources::bookings::Bookings;
use crate::sources::kv::plane::{Plane, PlaneConfig};
use crate::sources::kv::socket::SocketLimits;
use crate::sources::metrics::scrape;
use crate::sources::routed::ApproxIndex;
use crate::tick::{self, PlannerHandles, PublishHandles, ScrapeHandles};
use crate::{recovery, thermal};
use control::Control;
use ingest::{FromPeers, Ingest};
use ledger::Ledger;
use parking_lot::Mutex;
use publisher::Publisher;
use std::sync::Arc;
use std::time::Duration;

/// One sidecar process: its configuration, the fleet, what the sources
/// feed in and what it publishes. Its tasks and HTTP handlers hold the
/// parts they use; each lock guards one part, and none is held while
/// another is taken, except the bookings before the fleet when a snapshot
/// is built or the planner weighs the load.
pub struct Sidecar {
    fleet: Arc<Mutex<Fleet>>,
    ledger: Ledger,
    plane: Arc<Plane>,
    metrics: Arc<Metrics>,
    /// Everything the HTTP API reads and changes.
    api: Handles,
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
        let metrics = Arc::new(Metrics::new()?);
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
                Some(Arc::new(r))
            }
            None => None,
        };
        let lifecycle = Arc::new(Lifecycle::new(
            config.kv.replay_timeout,
            config.kv.max_replay_bytes,
            SocketLimits {
                max_message_bytes: config.kv.max_message_bytes,
                queue_messages: config.kv.queue_messages,
            },
            metrics.kv.subscribers.clone(),
        ));
        let full_reads = Arc::new(FullReads::new(&config.server, &metrics.listener));
        let recovering = Recovering::new(&config.indexer);
        let config = Arc::new(config);
        let fleet = Arc::new(Mutex::new(fleet));
        let plane = Arc::new(plane);
        let client = scrape::client();
        let ledger_metrics = Arc::new(metrics.ledger.clone());
        let snapshot_metrics = Arc::new(metrics.snapshot.clone());
        let ledger = Ledger::new(
            Bookings::new(config.load.booking_ttl, config.load.caps)
                .with_vm_silence(config.load.vm_silence),
            replica.clone(),
            ledger_metrics.clone(),
        );
        let routed = Arc::new(Mutex::new(ApproxIndex::new(
            config.kv.approx_ttl,
            config.kv.inflight_ttl,
        )));
        let store = Arc::new(SnapshotStore::default());
        let publisher = Publisher {
            config: config.clone(),
            fleet: fleet.clone(),
            ledger: ledger.clone(),
            store: store.clone(),
            versions: versions.clone(),
            shards: shards.clone(),
            plane: plane.clone(),
            routed: routed.clone(),
            metrics: snapshot_metrics.clone(),
        };
        let control = Control {
            fleet: fleet.clone(),
            bookings: ledger.bookings().clone(),
            lifecycle: lifecycle.clone(),
            plane: plane.clone(),
            publisher: publisher.clone(),
            scrape: ScrapeHandles {
                config: config.clone(),
                fleet: fleet.clone(),
                client: client.clone(),
                metrics: snapshot_metrics.clone(),
                publisher: publisher.clone(),
            },
            metrics: snapshot_metrics.clone(),
        };
        let ingest = Ingest {
            fleet: fleet.clone(),
            ledger: ledger.clone(),
            routed,
            selection: Arc::new(metrics.selection.clone()),
            latency: Arc::new(metrics.latency.clone()),
        };
        let api = Handles {
            config: config.clone(),
            metrics: metrics.clone(),
            listener_metrics: Arc::new(metrics.listener.clone()),
            snapshot_metrics,
            selection: Arc::new(Selection {
                store,
                shards,
                fleet: fleet.clone(),
                ledger: ledger.bookings().clone(),
                reservations: Arc::new(ledger.clone()),
                reports: Arc::new(ingest),
                metrics: ledger_metrics.clone(),
            }),
            versions,
            plane: plane.clone(),
            replica,
            full_reads,
            last_poll: LastPoll::now(),
            recovering: recovering.clone(),
            catalog: Arc::new(control.clone()),
        };
        if ledger.replica().is_some() {
            let peers = FromPeers {
                fleet: fleet.clone(),
                bookings: ledger.bookings().clone(),
                metrics: ledger_metrics,
            };
            tokio::spawn(async move {
                while let Some((origin, events)) = inbound.recv().await {
                    peers.apply(origin, events);
                }
            });
        }
        let ids: Vec<u64> = fleet.lock().workers().keys().copied().collect();
        for id in ids {
            control.worker_started(id);
        }
        if !config.indexer.peers.is_empty() {
            // The subscribers above are connecting; their batches wait for
            // this (see `Plane`).
            tokio::spawn(recovery::run(recovery::Handles {
                indexer: config.indexer.clone(),
                client: client.clone(),
                plane: plane.clone(),
                metrics: metrics.kv.clone(),
                recovering,
                token: config.control.token.clone(),
            }));
        }
        publisher.publish_now();
        tokio::spawn(tick::publish_loop(PublishHandles {
            interval: config.server.publish_interval,
            publisher: publisher.clone(),
            plane: plane.clone(),
            lifecycle,
            metrics: metrics.kv.clone(),
        }));
        tokio::spawn(thermal::thermal_loop(thermal::Handles {
            config: config.clone(),
            fleet: fleet.clone(),
            metrics: metrics.thermal.clone(),
            client,
        }));
        tokio::spawn(tick::planner_loop(PlannerHandles {
            fleet: fleet.clone(),
            bookings: ledger.bookings().clone(),
            metrics: metrics.planner.clone(),
            publisher,
        }));
        Ok(Arc::new(Sidecar {
            fleet,
            ledger,
            plane,
            metrics,
            api,
        }))
    }

    /// Workers in the catalog, up or not.
    pub fn worker_count(&self) -> usize {
        self.fleet.lock().workers().len()
    }

    pub fn versions(&self) -> &Versions {
        &self.api.versions
    }

    pub fn store(&self) -> &SnapshotStore {
        &self.api.selection.store
    }

    pub fn plane(&self) -> &Plane {
        &self.plane
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Requests the gateways routed that have not ended.
    pub fn active_bookings(&self) -> usize {
        self.ledger.lock().active()
    }

    pub fn replica(&self) -> Option<&ReplicaSync> {
        self.ledger.replica().map(|r| &**r)
    }

    /// What a selection reads and books, for a front door that routes
    /// ([`crate::api::route`]).
    pub fn selection(&self) -> &Selection {
        &self.api.selection
    }
}

/// The HTTP API of a running sidecar: `api::router(sc.clone())`.
impl From<Arc<Sidecar>> for Handles {
    fn from(sc: Arc<Sidecar>) -> Handles {
        sc.api.clone()
    }
}
