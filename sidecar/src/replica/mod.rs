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
//! As in Dynamo's selection service, this is best effort: no
//! acknowledgement or redelivery. Messages are numbered only so that a
//! recorded one cannot book its load twice (`replay`). Output-block growth
//! stays local (it is the most frequent event and the least useful
//! elsewhere). Admissions name the
//! worker and rank; a receiver drops those for workers, models, tenants or
//! block sizes its own catalog does not have, so every sidecar must be
//! given the same catalog.
//!
//! Two OS threads own the sockets (ZMQ sockets are not `Sync`): one
//! publishes what the sidecar queues, in batches of whatever is waiting
//! split under [`MAX_MESSAGE_BYTES`]; one receives from the peers, a SUB
//! socket each, connects or disconnects them as the peer list changes,
//! and connects again to a peer whose connection libzmq dropped. Neither
//! blocks the sidecar: a full queue drops the event and counts it.

mod monitor;
mod replay;
pub mod wire;

use monitor::Monitor;
use parking_lot::Mutex;
use prometheus::{Gauge, IntCounter, IntGauge};
use replay::{ReplayGuard, Verdict};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use wire::{MAX_EVENTS, Stamp, SyncEvent};

/// Largest replica-sync message a peer may send (libzmq's
/// `ZMQ_MAXMSGSIZE`): a larger one is never buffered, libzmq drops the
/// connection instead, and the receiver connects again. The publisher
/// splits its batches to stay under it.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Messages the PUB socket queues for each peer before it drops.
const QUEUE_MESSAGES: i32 = 10_000;
/// Messages a peer's SUB socket queues before libzmq drops its newest.
/// The queue's memory is this times [`MAX_MESSAGE_BYTES`] at worst, so it
/// is kept short: an honest peer sends a few messages a second, which the
/// receiving thread reads within microseconds, while a flooding peer's
/// backlog would otherwise sit in memory (10,000 full batches of
/// admissions held about 400 MiB in the hostile bench).
pub const RECEIVE_QUEUE_MESSAGES: i32 = 128;
/// Decoded batches waiting for the sidecar to apply them; past it a
/// message is dropped and counted (`dropped_inbound`).
pub const INBOUND_BATCHES: usize = 64;
/// Events the sidecar may queue for publishing before it drops them.
const OUTBOX: usize = 65_536;
/// How often the threads look at their channels and the stop flag.
const POLL: Duration = Duration::from_millis(20);
/// A peer whose connection keeps failing is connected again at most this
/// often, so that a broken peer cannot make the receiver spin.
const RECONNECT_EVERY: Duration = Duration::from_millis(500);
/// A peer's lost connections are logged at most this often.
const LOST_LOG_EVERY: Duration = Duration::from_secs(60);
/// How often the peers' last-message ages are written to the gauges.
const AGE_EVERY: Duration = Duration::from_secs(1);
/// Messages read from one peer before the others get their turn.
const BURST: usize = 256;

/// Counters of what sync did: the sidecar's Prometheus counters.
#[derive(Debug, Clone)]
pub struct SyncStats {
    pub sent: IntCounter,
    pub received: IntCounter,
    /// Events dropped because the outbox was full or the socket refused.
    pub dropped_outbox: IntCounter,
    /// Messages dropped because the sidecar had not taken the previous ones.
    pub dropped_inbound: IntCounter,
    /// Admissions refused because their message was seen already.
    pub replayed: IntCounter,
    /// Admissions refused because their message was sent too long ago.
    pub stale: IntCounter,
    /// Messages refused whole, by reason (`wire::SyncError::reason`).
    refused: prometheus::IntCounterVec,
    peer_connected: prometheus::IntGaugeVec,
    peer_age: prometheus::GaugeVec,
    peer_refused: prometheus::IntCounterVec,
    peer_refused_admissions: prometheus::IntCounterVec,
    peer_reconnects: prometheus::IntCounterVec,
}

impl SyncStats {
    pub fn from_metrics(m: &crate::metrics::LedgerMetrics) -> SyncStats {
        let of = |r: &str| m.replica_events.with_label_values(&[r]);
        SyncStats {
            sent: of("sent"),
            received: of("received"),
            dropped_outbox: of("dropped_outbox"),
            dropped_inbound: of("dropped_inbound"),
            replayed: of("replayed"),
            stale: of("stale"),
            refused: m.replica_refused.clone(),
            peer_connected: m.replica_peer_connected.clone(),
            peer_age: m.replica_peer_last_message_age.clone(),
            peer_refused: m.replica_peer_refused.clone(),
            peer_refused_admissions: m.replica_peer_refused_admissions.clone(),
            peer_reconnects: m.replica_peer_reconnects.clone(),
        }
    }

    fn peer(&self, endpoint: &str) -> PeerSeries {
        PeerSeries {
            connected: self.peer_connected.with_label_values(&[endpoint]),
            age: self.peer_age.with_label_values(&[endpoint]),
            refused: self.peer_refused.with_label_values(&[endpoint]),
            replayed: self
                .peer_refused_admissions
                .with_label_values(&[endpoint, Verdict::Replayed.reason()]),
            stale: self
                .peer_refused_admissions
                .with_label_values(&[endpoint, Verdict::Stale.reason()]),
            reconnects: self.peer_reconnects.with_label_values(&[endpoint]),
        }
    }

    /// A removed peer's series go with it.
    fn forget(&self, endpoint: &str) {
        let _ = self.peer_connected.remove_label_values(&[endpoint]);
        let _ = self.peer_age.remove_label_values(&[endpoint]);
        let _ = self.peer_refused.remove_label_values(&[endpoint]);
        for v in [Verdict::Replayed, Verdict::Stale] {
            let _ = self
                .peer_refused_admissions
                .remove_label_values(&[endpoint, v.reason()]);
        }
        let _ = self.peer_reconnects.remove_label_values(&[endpoint]);
    }
}

struct PeerSeries {
    connected: IntGauge,
    age: Gauge,
    refused: IntCounter,
    replayed: IntCounter,
    stale: IntCounter,
    reconnects: IntCounter,
}

/// One peer as the receiving thread last saw it.
#[derive(Debug)]
pub struct PeerState {
    added: Instant,
    connected: AtomicBool,
    /// Milliseconds after `added` of the last message; `u64::MAX`: none.
    last_message: AtomicU64,
    messages: AtomicU64,
    refused: AtomicU64,
    replayed: AtomicU64,
    stale: AtomicU64,
    reconnects: AtomicU64,
}

impl PeerState {
    fn new() -> PeerState {
        PeerState {
            added: Instant::now(),
            connected: AtomicBool::new(false),
            last_message: AtomicU64::new(u64::MAX),
            messages: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            replayed: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
        }
    }

    fn heard(&self) {
        let ms = u64::try_from(self.added.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.last_message.store(ms, Ordering::Relaxed);
        self.messages.fetch_add(1, Ordering::Relaxed);
    }

    /// Since the last message, or since the peer was added before any.
    fn silence(&self) -> Duration {
        match self.last_message.load(Ordering::Relaxed) {
            u64::MAX => self.added.elapsed(),
            ms => self
                .added
                .elapsed()
                .saturating_sub(Duration::from_millis(ms)),
        }
    }
}

/// A peer's state, for `GET /replica_sync/peers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatus {
    pub endpoint: String,
    pub connected: bool,
    /// `None` before the first message.
    pub last_message_age: Option<Duration>,
    pub messages: u64,
    pub refused: u64,
    /// Admissions refused: their message was seen already.
    pub admissions_replayed: u64,
    /// Admissions refused: their message was sent too long ago.
    pub admissions_stale: u64,
    pub reconnects: u64,
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
    Connect(String, Arc<PeerState>),
    Disconnect(String),
}

/// The running sync: its process id, its outbox and its peers.
pub struct ReplicaSync {
    origin: u64,
    endpoint: String,
    outbox: SyncSender<SyncEvent>,
    changes: SyncSender<PeerChange>,
    peers: Mutex<BTreeMap<String, Arc<PeerState>>>,
    stats: SyncStats,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl ReplicaSync {
    /// Binds the PUB socket at `listen`, connects to `peers`, and starts
    /// both threads. What peers send arrives on `inbound`; when that is
    /// full, a message is dropped. `token` signs what goes out and must
    /// sign what comes in; an admission sent longer than `max_age` ago
    /// (by the sender's clock) is refused.
    pub fn start(
        listen: SocketAddr,
        peers: &[String],
        max_age: Duration,
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
        let mut receiver = Receiving {
            ctx,
            sink: Sink {
                origin,
                token: token.clone(),
                inbound,
                stats: stats.clone(),
                max_age,
                warned: BTreeSet::new(),
            },
            peers: Vec::new(),
        };
        let mut states = BTreeMap::new();
        for p in peers {
            let state = Arc::new(PeerState::new());
            receiver.open(p.clone(), state.clone())?;
            states.insert(p.clone(), state);
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
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name("kvgate-sync-sub".into())
                    .spawn(move || receiver.run(changes_rx, &stop))?
            },
        ];
        Ok(ReplicaSync {
            origin,
            endpoint,
            outbox,
            changes,
            peers: Mutex::new(states),
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
        self.peers.lock().keys().cloned().collect()
    }

    /// Each peer's connection and traffic, sorted by endpoint.
    pub fn peer_status(&self) -> Vec<PeerStatus> {
        self.peers
            .lock()
            .iter()
            .map(|(endpoint, s)| PeerStatus {
                endpoint: endpoint.clone(),
                connected: s.connected.load(Ordering::Relaxed),
                last_message_age: (s.last_message.load(Ordering::Relaxed) != u64::MAX)
                    .then(|| s.silence()),
                messages: s.messages.load(Ordering::Relaxed),
                refused: s.refused.load(Ordering::Relaxed),
                admissions_replayed: s.replayed.load(Ordering::Relaxed),
                admissions_stale: s.stale.load(Ordering::Relaxed),
                reconnects: s.reconnects.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Subscribes to a peer; false if it already was one.
    pub fn add_peer(&self, endpoint: &str) -> bool {
        let state = Arc::new(PeerState::new());
        let mut peers = self.peers.lock();
        if peers.contains_key(endpoint) {
            return false;
        }
        if self
            .changes
            .try_send(PeerChange::Connect(endpoint.to_string(), state.clone()))
            .is_err()
        {
            // The receiving thread is gone or far behind: keep the list
            // true to the sockets.
            tracing::warn!(
                peer = endpoint,
                "replica-sync peer not connected: the receiver is not keeping up"
            );
            return false;
        }
        peers.insert(endpoint.to_string(), state);
        true
    }

    /// Unsubscribes from a peer; false if it was not one.
    pub fn remove_peer(&self, endpoint: &str) -> bool {
        let mut peers = self.peers.lock();
        if !peers.contains_key(endpoint) {
            return false;
        }
        if self
            .changes
            .try_send(PeerChange::Disconnect(endpoint.to_string()))
            .is_err()
        {
            tracing::warn!(
                peer = endpoint,
                "replica-sync peer not disconnected: the receiver is not keeping up"
            );
            return false;
        }
        peers.remove(endpoint);
        true
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

/// Sends whatever is queued, up to [`MAX_EVENTS`] per message and split
/// so that no message exceeds [`MAX_MESSAGE_BYTES`].
fn publish(
    sock: zmq::Socket,
    origin: u64,
    outbox: Receiver<SyncEvent>,
    token: Option<String>,
    stats: &SyncStats,
    stop: &AtomicBool,
) {
    let mut batch = Vec::with_capacity(MAX_EVENTS);
    let mut seq = 0u64;
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
        for run in wire::split(&batch, MAX_MESSAGE_BYTES, token.is_some()) {
            seq += 1;
            let msg = wire::encode(&Stamp::now(origin, seq), run, token.as_deref());
            if msg.len() > MAX_MESSAGE_BYTES {
                // One event alone over the cap: peers would drop it with
                // the connection. The API's limits on names make this
                // unreachable; counted all the same.
                tracing::warn!(bytes = msg.len(), "replica-sync event too large to send");
                stats.dropped_outbox.inc_by(run.len() as u64);
                continue;
            }
            // PUB never blocks: past its high-water mark it drops, which is
            // the contract (best effort).
            match sock.send(msg, zmq::DONTWAIT) {
                Ok(()) => {
                    stats.sent.inc_by(run.len() as u64);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "replica-sync message not sent");
                    stats.dropped_outbox.inc_by(run.len() as u64);
                }
            }
        }
        batch.clear();
    }
}

/// What the receiving thread does with a peer's messages.
struct Sink {
    origin: u64,
    token: Option<String>,
    inbound: tokio::sync::mpsc::Sender<Inbound>,
    stats: SyncStats,
    /// Each peer's replay guard is made with it.
    max_age: Duration,
    /// Refusal reasons logged already: the first of each is, the
    /// counters tell the rest.
    warned: BTreeSet<&'static str>,
}

impl Sink {
    fn warn_once(&mut self, reason: &'static str) -> bool {
        self.warned.insert(reason)
    }
}

/// One peer's SUB socket: a socket per peer, so that each connection is
/// watched, counted and started over on its own (one socket for all would
/// not say which peer a loss or a refused message came from).
struct Peer {
    endpoint: String,
    sock: zmq::Socket,
    monitor: Option<Monitor>,
    state: Arc<PeerState>,
    series: PeerSeries,
    /// The message numbers heard from this peer, per origin. Keyed by the
    /// peer as well as the origin a message names: the origin is only what
    /// the sender wrote, so with one window per origin a token holder could
    /// sign a message under another peer's origin with a number far ahead,
    /// and that peer's own messages would then read as replays until it
    /// restarted. Here it can only move the windows of its own connection.
    guard: ReplayGuard,
    /// A lost connection waiting to be started over, and when.
    reconnect_at: Option<Instant>,
    /// Losses since the last handshake done: the backoff's exponent.
    failures: u32,
    last_reconnect: Option<Instant>,
    logged: Option<Instant>,
    lost_unlogged: u64,
}

/// The receiving thread: peers' messages in, peer-list changes applied.
struct Receiving {
    ctx: zmq::Context,
    sink: Sink,
    peers: Vec<Peer>,
}

impl Receiving {
    fn open(&mut self, endpoint: String, state: Arc<PeerState>) -> Result<(), zmq::Error> {
        let sock = self.ctx.socket(zmq::SUB)?;
        sock.set_maxmsgsize(MAX_MESSAGE_BYTES as i64)?;
        sock.set_rcvhwm(RECEIVE_QUEUE_MESSAGES)?;
        sock.set_linger(0)?;
        sock.set_subscribe(b"")?;
        let monitor = Monitor::attach(&self.ctx, &sock)
            .inspect_err(|e| {
                tracing::warn!(peer = %endpoint, error = %e, "cannot monitor the replica-sync peer's socket; a lost connection is not restarted");
            })
            .ok();
        sock.connect(&endpoint)?;
        let series = self.sink.stats.peer(&endpoint);
        series.connected.set(0);
        series.age.set(0.0);
        self.peers.push(Peer {
            endpoint,
            sock,
            monitor,
            state,
            series,
            guard: ReplayGuard::new(self.sink.max_age),
            reconnect_at: None,
            failures: 0,
            last_reconnect: None,
            logged: None,
            lost_unlogged: 0,
        });
        Ok(())
    }

    fn close(&mut self, endpoint: &str) {
        self.peers.retain(|p| p.endpoint != endpoint);
        self.sink.stats.forget(endpoint);
    }

    fn run(mut self, changes: Receiver<PeerChange>, stop: &AtomicBool) {
        let mut aged = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            while let Ok(c) = changes.try_recv() {
                match c {
                    PeerChange::Connect(p, state) => {
                        if let Err(e) = self.open(p.clone(), state) {
                            tracing::warn!(peer = %p, error = %e, "replica-sync peer change failed");
                        }
                    }
                    PeerChange::Disconnect(p) => self.close(&p),
                }
            }
            if self.peers.is_empty() {
                std::thread::sleep(POLL);
                continue;
            }
            let readable: Vec<bool> = {
                let mut items: Vec<zmq::PollItem<'_>> = self
                    .peers
                    .iter()
                    .map(|p| p.sock.as_poll_item(zmq::POLLIN))
                    .collect();
                match zmq::poll(&mut items, POLL.as_millis() as i64) {
                    Ok(_) => items.iter().map(zmq::PollItem::is_readable).collect(),
                    Err(e) => {
                        tracing::warn!(error = %e, "replica-sync poll failed");
                        std::thread::sleep(POLL);
                        continue;
                    }
                }
            };
            let now = Instant::now();
            for (p, readable) in self.peers.iter_mut().zip(readable) {
                if readable {
                    p.drain(&mut self.sink);
                }
                p.watch(now);
            }
            if now.duration_since(aged) >= AGE_EVERY {
                aged = now;
                for p in &self.peers {
                    p.series.age.set(p.state.silence().as_secs_f64());
                }
            }
        }
    }
}

impl Peer {
    /// Reads what the peer sent, up to [`BURST`] messages.
    fn drain(&mut self, sink: &mut Sink) {
        for _ in 0..BURST {
            let bytes = match self.sock.recv_bytes(zmq::DONTWAIT) {
                Ok(b) => b,
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    tracing::warn!(peer = %self.endpoint, error = %e, "replica-sync receive failed");
                    return;
                }
            };
            self.state.heard();
            if self.monitor.is_none() {
                self.set_connected(true);
            }
            match wire::decode(&bytes, sink.token.as_deref()) {
                // A sidecar listed among its own peers hears itself.
                Ok((stamp, _)) if stamp.origin == sink.origin => {}
                Ok((stamp, mut events)) => {
                    sink.stats.received.inc_by(events.len() as u64);
                    let verdict = self
                        .guard
                        .check(&stamp, crate::clock::now_ms(), Instant::now());
                    if verdict != Verdict::Fresh {
                        self.refuse_admissions(sink, &stamp, verdict, &mut events);
                    }
                    if !events.is_empty() && sink.inbound.try_send((stamp.origin, events)).is_err()
                    {
                        sink.stats.dropped_inbound.inc();
                    }
                }
                Err(e) => {
                    sink.stats.refused.with_label_values(&[e.reason()]).inc();
                    self.series.refused.inc();
                    self.state.refused.fetch_add(1, Ordering::Relaxed);
                    if sink.warn_once(e.reason()) {
                        tracing::warn!(peer = %self.endpoint, error = %e, "replica-sync message refused");
                    }
                }
            }
        }
    }

    /// Takes the admissions out of a message that is not fresh, counting
    /// them: what is left (frees, prefill completions) only lowers the
    /// load of holders still live, which a late one must always do.
    fn refuse_admissions(
        &self,
        sink: &mut Sink,
        stamp: &Stamp,
        verdict: Verdict,
        events: &mut Vec<SyncEvent>,
    ) {
        let before = events.len();
        events.retain(|e| !matches!(e, SyncEvent::Admit(..)));
        let refused = (before - events.len()) as u64;
        if refused == 0 {
            return;
        }
        let (total, series, state) = match verdict {
            Verdict::Stale => (&sink.stats.stale, &self.series.stale, &self.state.stale),
            Verdict::Replayed | Verdict::Fresh => (
                &sink.stats.replayed,
                &self.series.replayed,
                &self.state.replayed,
            ),
        };
        total.inc_by(refused);
        series.inc_by(refused);
        state.fetch_add(refused, Ordering::Relaxed);
        if sink.warn_once(verdict.reason()) {
            tracing::warn!(
                peer = %self.endpoint,
                origin = stamp.origin,
                seq = stamp.seq,
                sent_at_ms = stamp.sent_at_ms,
                refused,
                why = verdict.reason(),
                window = replay::WINDOW,
                "replica-sync admissions refused: their message was seen already or is further behind the origin's latest than the window (replayed), or was sent further from this clock than replica_sync.max_message_age_ms (stale: a replay, or clocks apart); frees in it still apply"
            );
        }
    }

    fn set_connected(&self, up: bool) {
        self.state.connected.store(up, Ordering::Relaxed);
        self.series.connected.set(i64::from(up));
    }

    /// Follows the monitor, and starts a lost connection over: libzmq
    /// gives the endpoint up for good after a protocol error, which an
    /// oversized frame is.
    fn watch(&mut self, now: Instant) {
        if let Some(seen) = self.monitor.as_ref().map(Monitor::read) {
            if let Some(up) = seen.connected {
                self.set_connected(up);
                if up {
                    self.failures = 0;
                }
            }
            if seen.lost && self.reconnect_at.is_none() {
                self.lost(now);
            }
        }
        if self.reconnect_at.is_some_and(|at| now >= at) {
            self.reconnect_at = None;
            self.last_reconnect = Some(now);
            let _ = self.sock.disconnect(&self.endpoint);
            if let Err(e) = self.sock.connect(&self.endpoint) {
                tracing::warn!(peer = %self.endpoint, error = %e, "cannot connect to the replica-sync peer again");
                self.reconnect_at = Some(now + RECONNECT_EVERY);
                return;
            }
            self.state.reconnects.fetch_add(1, Ordering::Relaxed);
            self.series.reconnects.inc();
        }
    }

    fn lost(&mut self, now: Instant) {
        // A peer that fails every handshake is retried less and less
        // often: twice the wait per failure, up to about half a minute.
        let wait = RECONNECT_EVERY * 2u32.pow(self.failures.min(6));
        self.failures = self.failures.saturating_add(1);
        self.reconnect_at = Some(match self.last_reconnect {
            Some(t) if self.failures > 1 => (t + wait).max(now),
            _ => now,
        });
        self.lost_unlogged += 1;
        if self
            .logged
            .is_none_or(|t| now.duration_since(t) >= LOST_LOG_EVERY)
        {
            self.logged = Some(now);
            tracing::warn!(
                peer = %self.endpoint,
                lost = std::mem::take(&mut self.lost_unlogged),
                max_message_bytes = MAX_MESSAGE_BYTES,
                "lost the replica-sync connection (peer gone, handshake failed, or a frame over max_message_bytes that libzmq dropped with the connection); connecting again"
            );
        }
    }
}
