//! Replica sync: the sidecars of several gateway pods share the load each
//! of them books, so that N gateways do not each believe the fleet is N
//! times emptier than it is.
//!
//! Each sidecar publishes its admissions, prefill completions and frees
//! (its Envoy's bookings and its selection API's reservations) on a ZMQ PUB
//! socket, and subscribes to its peers' sockets. What a peer announces is
//! booked in the ledger under the peer's process id, so it loads the same
//! ranks here and is freed when the peer frees it, or expires with the
//! booking expiry when that message was lost.
//!
//! As in Dynamo's selection service, this is best effort: no sequencing,
//! acknowledgement or replay. Output-block growth stays local (it is the
//! most frequent event and the least useful elsewhere). Admissions name the
//! worker and rank; a receiver drops those for workers, models, tenants or
//! block sizes its own catalog does not have, so every sidecar must be
//! given the same catalog.
//!
//! Two OS threads own the sockets (ZMQ sockets are not `Sync`): one
//! publishes what the sidecar queues, in batches of whatever is waiting;
//! one receives from the peers and connects or disconnects them as the
//! peer list changes. Neither blocks the sidecar: a full queue drops the
//! event and counts it.

pub mod wire;

use prometheus::IntCounter;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::thread::JoinHandle;
use std::time::Duration;
use wire::{MAX_EVENTS, SyncEvent};

/// Largest replica-sync message a peer may send; a larger one disconnects
/// it (libzmq's limit), it is never buffered.
const MAX_MESSAGE_BYTES: i64 = 1 << 20;
/// Messages a socket queues before it drops (ZMQ high-water marks).
const QUEUE_MESSAGES: i32 = 10_000;
/// Events the sidecar may queue for publishing before it drops them.
const OUTBOX: usize = 65_536;
/// How often the threads look at their channels and the stop flag.
const POLL: Duration = Duration::from_millis(20);

/// Counters of what sync did: the sidecar's Prometheus counters.
#[derive(Debug, Clone)]
pub struct SyncStats {
    pub sent: IntCounter,
    pub received: IntCounter,
    /// Events dropped because the outbox was full or the socket refused.
    pub dropped_outbox: IntCounter,
    /// Messages dropped because the sidecar had not taken the previous ones.
    pub dropped_inbound: IntCounter,
    /// Messages refused whole (malformed, or not signed with our token).
    pub refused: IntCounter,
}

impl SyncStats {
    pub fn from_metrics(m: &crate::metrics::LedgerMetrics) -> SyncStats {
        let of = |r: &str| m.replica_events.with_label_values(&[r]);
        SyncStats {
            sent: of("sent"),
            received: of("received"),
            dropped_outbox: of("dropped_outbox"),
            dropped_inbound: of("dropped_inbound"),
            refused: m.replica_refused.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("replica-sync socket: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("replica-sync thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// What the receiving thread hands the sidecar: a peer's id and events.
pub type Inbound = (u64, Vec<SyncEvent>);

enum PeerChange {
    Connect(String),
    Disconnect(String),
}

/// The running sync: its process id, its outbox and its peers.
pub struct ReplicaSync {
    origin: u64,
    endpoint: String,
    outbox: SyncSender<SyncEvent>,
    changes: SyncSender<PeerChange>,
    peers: parking_lot::Mutex<BTreeSet<String>>,
    stats: SyncStats,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl ReplicaSync {
    /// Binds the PUB socket at `listen`, connects to `peers`, and starts
    /// both threads. What peers send arrives on `inbound`; when that is
    /// full, a message is dropped. `token` signs what goes out and must
    /// sign what comes in.
    pub fn start(
        listen: SocketAddr,
        peers: &[String],
        token: Option<String>,
        inbound: tokio::sync::mpsc::Sender<Inbound>,
        stats: SyncStats,
    ) -> Result<ReplicaSync, StartError> {
        let origin = rand::random::<u64>() | 1;
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB)?;
        publisher.set_sndhwm(QUEUE_MESSAGES)?;
        publisher.set_linger(0)?;
        // Port 0 asks for any free port, which ZMQ spells `*`.
        let bind = match listen.port() {
            0 => format!("tcp://{}:*", listen.ip()),
            _ => format!("tcp://{listen}"),
        };
        publisher.bind(&bind)?;
        let endpoint = publisher.get_last_endpoint()?.unwrap_or(bind);
        let subscriber = ctx.socket(zmq::SUB)?;
        subscriber.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
        subscriber.set_rcvhwm(QUEUE_MESSAGES)?;
        subscriber.set_linger(0)?;
        subscriber.set_subscribe(b"")?;
        for p in peers {
            subscriber.connect(p)?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (outbox, out_rx) = std::sync::mpsc::sync_channel(OUTBOX);
        let (changes, changes_rx) = std::sync::mpsc::sync_channel(64);
        let threads = vec![
            {
                let (stats, stop, token) = (stats.clone(), stop.clone(), token.clone());
                std::thread::Builder::new()
                    .name("kvgate-sync-pub".into())
                    .spawn(move || publish(publisher, origin, out_rx, token, &stats, &stop))?
            },
            {
                let (stats, stop) = (stats.clone(), stop.clone());
                std::thread::Builder::new()
                    .name("kvgate-sync-sub".into())
                    .spawn(move || {
                        receive(
                            subscriber, origin, changes_rx, token, inbound, &stats, &stop,
                        )
                    })?
            },
        ];
        Ok(ReplicaSync {
            origin,
            endpoint,
            outbox,
            changes,
            peers: parking_lot::Mutex::new(peers.iter().cloned().collect()),
            stats,
            stop,
            threads,
        })
    }

    /// This process's id in what it publishes.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Where peers subscribe: the bound PUB endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Queues an event for the peers; drops it when the outbox is full.
    pub fn announce(&self, ev: SyncEvent) {
        if let Err(TrySendError::Full(_)) = self.outbox.try_send(ev) {
            self.stats.dropped_outbox.inc();
        }
    }

    /// The peers subscribed to, sorted.
    pub fn peers(&self) -> Vec<String> {
        self.peers.lock().iter().cloned().collect()
    }

    /// Subscribes to a peer; false if it already was one.
    pub fn add_peer(&self, endpoint: &str) -> bool {
        let added = self.peers.lock().insert(endpoint.to_string());
        if added
            && self
                .changes
                .try_send(PeerChange::Connect(endpoint.to_string()))
                .is_err()
        {
            // The receiving thread is gone or far behind: keep the list
            // true to the socket.
            self.peers.lock().remove(endpoint);
            tracing::warn!(
                peer = endpoint,
                "replica-sync peer not connected: the receiver is not keeping up"
            );
            return false;
        }
        added
    }

    /// Unsubscribes from a peer; false if it was not one.
    pub fn remove_peer(&self, endpoint: &str) -> bool {
        let removed = self.peers.lock().remove(endpoint);
        if removed
            && self
                .changes
                .try_send(PeerChange::Disconnect(endpoint.to_string()))
                .is_err()
        {
            self.peers.lock().insert(endpoint.to_string());
            tracing::warn!(
                peer = endpoint,
                "replica-sync peer not disconnected: the receiver is not keeping up"
            );
            return false;
        }
        removed
    }
}

impl Drop for ReplicaSync {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Sends whatever is queued, up to [`MAX_EVENTS`] per message.
fn publish(
    sock: zmq::Socket,
    origin: u64,
    outbox: Receiver<SyncEvent>,
    token: Option<String>,
    stats: &SyncStats,
    stop: &AtomicBool,
) {
    let mut batch = Vec::with_capacity(MAX_EVENTS);
    while !stop.load(Ordering::Relaxed) {
        match outbox.recv_timeout(POLL) {
            Ok(ev) => batch.push(ev),
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        }
        while batch.len() < MAX_EVENTS {
            match outbox.try_recv() {
                Ok(ev) => batch.push(ev),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        let msg = wire::encode(origin, &batch, token.as_deref());
        // PUB never blocks: past its high-water mark it drops, which is
        // the contract (best effort).
        match sock.send(msg, zmq::DONTWAIT) {
            Ok(()) => {
                stats.sent.inc_by(batch.len() as u64);
            }
            Err(e) => {
                tracing::debug!(error = %e, "replica-sync message not sent");
                stats.dropped_outbox.inc_by(batch.len() as u64);
            }
        }
        batch.clear();
    }
}

/// Receives peers' messages, and follows changes to the peer list.
fn receive(
    sock: zmq::Socket,
    origin: u64,
    changes: Receiver<PeerChange>,
    token: Option<String>,
    inbound: tokio::sync::mpsc::Sender<Inbound>,
    stats: &SyncStats,
    stop: &AtomicBool,
) {
    let mut warned = false;
    while !stop.load(Ordering::Relaxed) {
        while let Ok(c) = changes.try_recv() {
            let r = match &c {
                PeerChange::Connect(p) => sock.connect(p),
                PeerChange::Disconnect(p) => sock.disconnect(p),
            };
            if let Err(e) = r {
                let (PeerChange::Connect(p) | PeerChange::Disconnect(p)) = &c;
                tracing::warn!(peer = %p, error = %e, "replica-sync peer change failed");
            }
        }
        match sock.poll(zmq::POLLIN, POLL.as_millis() as i64) {
            Ok(n) if n > 0 => {}
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "replica-sync poll failed");
                std::thread::sleep(POLL);
                continue;
            }
        }
        let bytes = match sock.recv_bytes(zmq::DONTWAIT) {
            Ok(b) => b,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "replica-sync receive failed");
                continue;
            }
        };
        match wire::decode(&bytes, token.as_deref()) {
            // A sidecar listed among its own peers hears itself.
            Ok((from, _)) if from == origin => {}
            Ok((from, events)) => {
                stats.received.inc_by(events.len() as u64);
                if inbound.try_send((from, events)).is_err() {
                    stats.dropped_inbound.inc();
                }
            }
            Err(e) => {
                stats.refused.inc();
                if !warned {
                    // Once in the log is enough; the counter tells the rest.
                    warned = true;
                    tracing::warn!(error = %e, "replica-sync message refused");
                }
            }
        }
    }
}
