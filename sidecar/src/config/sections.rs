//! The sections of the configuration file besides the catalog.

use super::millis;
use serde::Deserialize;
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    /// APIs, `/metrics` and `/v1/snapshot`.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Snapshots are rebuilt at most this often after a change.
    #[serde(
        rename = "publish_interval_ms",
        default = "default_publish_interval",
        deserialize_with = "millis::deserialize"
    )]
    pub publish_interval: Duration,
    /// A request's head must arrive within this of the connection being
    /// opened (or, on a kept-alive one, of its first byte): slowloris.
    #[serde(
        rename = "header_read_timeout_ms",
        default = "default_header_read_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub header_read_timeout: Duration,
    /// A kept-alive connection with no request, or a request with no byte
    /// moving either way, is closed after this long. Must outlast the
    /// longest long poll, which is silent until it answers.
    #[serde(
        rename = "idle_timeout_ms",
        default = "default_idle_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub idle_timeout: Duration,
    /// Connections open at once; one more is accepted and closed at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Of `max_connections`, the last ones, kept for probes and requests
    /// with the control token, so that a flood of other clients cannot
    /// shut out the kubelet or Envoy.
    #[serde(default = "default_reserved_connections")]
    pub reserved_connections: u32,
    /// Request-body bytes held at once across the listener's connections,
    /// for requests without the control token, and as many for those with
    /// it; one more is answered 503.
    #[serde(default = "default_body_budget")]
    pub body_budget_bytes: u64,
    /// A request's body must arrive whole within this of its head, so a
    /// slow body holds its bytes for this long at most.
    #[serde(
        rename = "body_timeout_ms",
        default = "default_body_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub body_timeout: Duration,
    /// Whole-index reads (`GET /dump`, a reset frame of `/v1/snapshot`)
    /// served at once, on both listeners together, to readers without the
    /// control token, and as many to readers with it; one more is answered
    /// 503 with `Retry-After`. Each may hold a copy of the index for as
    /// long as its client reads.
    #[serde(default = "default_max_full_reads")]
    pub max_full_reads: u32,
    /// Whole-index copies of one kind alive at once for readers without
    /// the control token, and as many for those with it: past it a new
    /// reader is sent the newest copy alive, however old, rather than a
    /// new one. Readers spaced out can otherwise each hold a copy.
    #[serde(default = "default_max_full_read_copies")]
    pub max_full_read_copies: u32,
    /// A whole-index copy encoded less than this long ago is served again
    /// rather than encoded anew: under ingest the index changes every few
    /// milliseconds, so readers would otherwise share nothing.
    #[serde(
        rename = "full_read_reuse_ms",
        default = "default_full_read_reuse",
        deserialize_with = "millis::deserialize"
    )]
    pub full_read_reuse: Duration,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            listen: default_listen(),
            publish_interval: default_publish_interval(),
            header_read_timeout: default_header_read_timeout(),
            idle_timeout: default_idle_timeout(),
            max_connections: default_max_connections(),
            reserved_connections: default_reserved_connections(),
            body_budget_bytes: default_body_budget(),
            body_timeout: default_body_timeout(),
            max_full_reads: default_max_full_reads(),
            max_full_read_copies: default_max_full_read_copies(),
            full_read_reuse: default_full_read_reuse(),
        }
    }
}

/// Far more whole-index copies than any fleet of peers needs at once.
const MAX_FULL_READS: u32 = 1024;
/// A reused copy is at most this old: a reader then catches up from it
/// (Envoy by its next poll, a recovering peer by its engines' replay).
const MAX_FULL_READ_REUSE: Duration = Duration::from_secs(60);

impl Server {
    pub fn limits(&self) -> ListenerLimits {
        ListenerLimits {
            header_read_timeout: self.header_read_timeout,
            idle_timeout: self.idle_timeout,
            max_connections: self.max_connections,
            reserved_connections: self.reserved_connections,
            body_budget_bytes: self.body_budget_bytes,
            body_timeout: self.body_timeout,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        self.limits().validate("server")?;
        if !(1..=MAX_FULL_READS).contains(&self.max_full_reads) {
            return Err(format!(
                "server.max_full_reads must be within [1, {MAX_FULL_READS}], got {}",
                self.max_full_reads
            ));
        }
        if !(1..=MAX_FULL_READS).contains(&self.max_full_read_copies) {
            return Err(format!(
                "server.max_full_read_copies must be within [1, {MAX_FULL_READS}], got {}",
                self.max_full_read_copies
            ));
        }
        if self.full_read_reuse > MAX_FULL_READ_REUSE {
            return Err(format!(
                "server.full_read_reuse_ms must be at most {}, got {}",
                MAX_FULL_READ_REUSE.as_millis(),
                self.full_read_reuse.as_millis()
            ));
        }
        Ok(())
    }
}

/// The longest any route holds a request without writing a byte: the
/// planner's decision poll (Envoy's snapshot poll is held 10 s at most).
pub const LONGEST_LONG_POLL: Duration = Duration::from_secs(30);

/// What bounds one HTTP listener: its connections and how long each may
/// sit without making progress. Together these keep the file descriptors
/// inbound clients can take well under the process's limit, so that
/// scrapes, GPU readings, ZMQ and peers always have theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: u32,
    /// Of `max_connections`, kept for probes and token holders; at most
    /// half the cap is (the listener lowers it).
    pub reserved_connections: u32,
    /// Request-body bytes held at once, per class of request (with the
    /// control token, without).
    pub body_budget_bytes: u64,
    /// From a request's head to its body's last byte.
    pub body_timeout: Duration,
}

impl ListenerLimits {
    /// Checks the limits of the listener configured under `section`.
    pub fn validate(&self, section: &str) -> Result<(), String> {
        if self.header_read_timeout.is_zero() {
            return Err(format!("{section}.header_read_timeout_ms must be above 0"));
        }
        if self.idle_timeout <= LONGEST_LONG_POLL {
            return Err(format!(
                "{section}.idle_timeout_ms must be above {} (the longest long poll, which sends nothing until it answers), got {}",
                LONGEST_LONG_POLL.as_millis(),
                self.idle_timeout.as_millis()
            ));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.max_connections) {
            return Err(format!(
                "{section}.max_connections must be within [1, {MAX_CONNECTIONS}], got {}",
                self.max_connections
            ));
        }
        if self.reserved_connections > MAX_CONNECTIONS {
            return Err(format!(
                "{section}.reserved_connections must be at most {MAX_CONNECTIONS}, got {}",
                self.reserved_connections
            ));
        }
        if !(1..=MAX_BODY_BUDGET).contains(&self.body_budget_bytes) {
            return Err(format!(
                "{section}.body_budget_bytes must be within [1, {MAX_BODY_BUDGET}], got {}",
                self.body_budget_bytes
            ));
        }
        if self.body_timeout.is_zero() {
            return Err(format!("{section}.body_timeout_ms must be above 0"));
        }
        Ok(())
    }
}

/// Far above any file limit a sidecar runs under; the start-up clamps the
/// caps to the actual limit anyway.
const MAX_CONNECTIONS: u32 = 1 << 20;
/// Far above any sidecar's memory.
const MAX_BODY_BUDGET: u64 = 1 << 40;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scrape {
    #[serde(
        rename = "interval_ms",
        default = "default_interval",
        deserialize_with = "millis::deserialize"
    )]
    pub interval: Duration,
    #[serde(
        rename = "timeout_ms",
        default = "default_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub timeout: Duration,
    /// A worker with no successful scrape for this long is down.
    #[serde(
        rename = "down_after_ms",
        default = "default_down_after",
        deserialize_with = "millis::deserialize"
    )]
    pub down_after: Duration,
}

impl Default for Scrape {
    fn default() -> Self {
        Scrape {
            interval: default_interval(),
            timeout: default_timeout(),
            down_after: default_down_after(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kv {
    /// Index shards per model, as the filter reads them.
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// A rank indexing more blocks than this has missed removals and is
    /// resynchronised; bounds the sidecar's memory.
    #[serde(default = "default_max_blocks")]
    pub max_blocks_per_rank: usize,
    /// Changed shards are published at most this often.
    #[serde(
        rename = "publish_interval_ms",
        default = "default_kv_publish",
        deserialize_with = "millis::deserialize"
    )]
    pub publish_interval: Duration,
    #[serde(
        rename = "replay_timeout_ms",
        default = "default_replay_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub replay_timeout: Duration,
    /// How long a routing decision keeps its text prefix in the
    /// approximate index.
    #[serde(
        rename = "approx_ttl_ms",
        default = "default_approx_ttl",
        deserialize_with = "millis::deserialize"
    )]
    pub approx_ttl: Duration,
    /// How long a routing decision credits its rank with a token prompt's
    /// prefix before the engine's KV events must confirm it.
    #[serde(
        rename = "inflight_ttl_ms",
        default = "default_inflight_ttl",
        deserialize_with = "millis::deserialize"
    )]
    pub inflight_ttl: Duration,
    /// Largest frame a KV-event or replay socket accepts. libzmq drops the
    /// connection of a peer that sends a larger one, so a confused or
    /// hostile publisher cannot make the sidecar buffer it. libzmq never
    /// reconnects after that (a protocol error): the subscriber sees the
    /// loss on its socket monitor, counts it and connects again.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: u64,
    /// Messages each rank's sockets queue before dropping (the receive
    /// high-water mark). With `max_message_bytes` it bounds what one
    /// subscriber holds; a drop is a gap that replay repairs.
    #[serde(default = "default_queue_messages")]
    pub queue_messages: u32,
    /// Payload bytes one replay may take: the replay at connect, which
    /// asks for everything the engine buffered, and any gap's (which its
    /// span of `max_message_bytes` frames bounds too). A publisher sending
    /// more is cut off there and the rank resynchronised.
    #[serde(default = "default_max_replay_bytes")]
    pub max_replay_bytes: u64,
}

impl Default for Kv {
    fn default() -> Self {
        Kv {
            shards: default_shards(),
            max_blocks_per_rank: default_max_blocks(),
            publish_interval: default_kv_publish(),
            replay_timeout: default_replay_timeout(),
            approx_ttl: default_approx_ttl(),
            inflight_ttl: default_inflight_ttl(),
            max_message_bytes: default_max_message_bytes(),
            queue_messages: default_queue_messages(),
            max_replay_bytes: default_max_replay_bytes(),
        }
    }
}

/// Gateway bookings and the 503's `Retry-After`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Load {
    /// A booking whose request never reported its end is dropped after
    /// this long (a gateway lost it).
    #[serde(
        rename = "booking_ttl_ms",
        default = "default_booking_ttl",
        deserialize_with = "millis::deserialize"
    )]
    pub booking_ttl: Duration,
    /// `Retry-After` is the expected time until the first busy worker
    /// drains under its threshold, capped at this.
    #[serde(default = "default_max_retry_after")]
    pub max_retry_after_s: u32,
    /// A gateway VM that says it is alive (once a second) and then goes
    /// silent this long is gone: its bookings end then, not after
    /// `booking_ttl_ms`.
    #[serde(
        rename = "vm_silence_ms",
        default = "default_vm_silence",
        deserialize_with = "millis::deserialize"
    )]
    pub vm_silence: Duration,
    /// `[load.caps]`: the most holders the ledger keeps.
    #[serde(default)]
    pub caps: super::LedgerCaps,
}

impl Default for Load {
    fn default() -> Self {
        Load {
            booking_ttl: default_booking_ttl(),
            max_retry_after_s: default_max_retry_after(),
            vm_silence: default_vm_silence(),
            caps: super::LedgerCaps::default(),
        }
    }
}

/// Who may change state: the control API (`/busy_threshold`, `/workers`)
/// and the filter's reports (`/v1/bookings`, `/v1/routed`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Control {
    /// A file holding the bearer token those routes require; no file and
    /// no `KVGATE_CONTROL_TOKEN` means no token is required.
    #[serde(default)]
    pub token_file: Option<std::path::PathBuf>,
    /// Resolved at load time from `token_file` or the environment.
    #[serde(skip)]
    pub token: Option<String>,
}

/// The selection API (`POST /select`) for runtimes without Envoy, on a
/// listener of its own: off unless an address is given, so a gateway pod
/// opens no port it does not use.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selection {
    #[serde(default)]
    pub listen: Option<SocketAddr>,
    /// As `server.header_read_timeout_ms`, for this listener.
    #[serde(
        rename = "header_read_timeout_ms",
        default = "default_header_read_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub header_read_timeout: Duration,
    /// As `server.idle_timeout_ms`, for this listener.
    #[serde(
        rename = "idle_timeout_ms",
        default = "default_idle_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub idle_timeout: Duration,
    /// As `server.max_connections`, for this listener.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// As `server.reserved_connections`, for this listener.
    #[serde(default = "default_reserved_connections")]
    pub reserved_connections: u32,
    /// As `server.body_budget_bytes`, for this listener.
    #[serde(default = "default_body_budget")]
    pub body_budget_bytes: u64,
    /// As `server.body_timeout_ms`, for this listener.
    #[serde(
        rename = "body_timeout_ms",
        default = "default_body_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub body_timeout: Duration,
}

impl Default for Selection {
    fn default() -> Self {
        Selection {
            listen: None,
            header_read_timeout: default_header_read_timeout(),
            idle_timeout: default_idle_timeout(),
            max_connections: default_max_connections(),
            reserved_connections: default_reserved_connections(),
            body_budget_bytes: default_body_budget(),
            body_timeout: default_body_timeout(),
        }
    }
}

impl Selection {
    pub fn limits(&self) -> ListenerLimits {
        ListenerLimits {
            header_read_timeout: self.header_read_timeout,
            idle_timeout: self.idle_timeout,
            max_connections: self.max_connections,
            reserved_connections: self.reserved_connections,
            body_budget_bytes: self.body_budget_bytes,
            body_timeout: self.body_timeout,
        }
    }
}

/// Replica sync between the sidecars of several gateway pods: each
/// publishes its admissions, prefill completions and frees on a ZMQ PUB
/// socket and subscribes to its peers', so every pod counts the load the
/// others put on the fleet. Off unless `listen` is set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSync {
    /// Where this sidecar's PUB socket binds (`--replica-sync-port`).
    #[serde(default)]
    pub listen: Option<SocketAddr>,
    /// Peers' PUB endpoints, `tcp://host:port` (`--replica-sync-peers`).
    #[serde(default)]
    pub peers: Vec<String>,
    /// A peer's admission sent longer ago than this (by the peer's clock,
    /// either way) is refused: it is a replay, or the clocks are apart.
    /// Bounds how long a recorded message could be replayed at all.
    #[serde(
        rename = "max_message_age_ms",
        default = "default_max_message_age",
        deserialize_with = "millis::deserialize"
    )]
    pub max_message_age: Duration,
}

impl Default for ReplicaSync {
    fn default() -> Self {
        ReplicaSync {
            listen: None,
            peers: Vec::new(),
            max_message_age: default_max_message_age(),
        }
    }
}

/// Clocks of a fleet's pods agree far better; a message takes
/// milliseconds. Under a second would refuse admissions between pods
/// whose clocks are merely ordinary.
const MESSAGE_AGE_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(3600);

impl ReplicaSync {
    pub fn validate(&self) -> Result<(), String> {
        if !MESSAGE_AGE_RANGE.contains(&self.max_message_age) {
            return Err(format!(
                "replica_sync.max_message_age_ms must be within [{}, {}], got {}",
                MESSAGE_AGE_RANGE.start().as_millis(),
                MESSAGE_AGE_RANGE.end().as_millis(),
                self.max_message_age.as_millis()
            ));
        }
        if !self.peers.is_empty() && self.listen.is_none() {
            return Err(
                "replica_sync.peers needs replica_sync.listen (--replica-sync-port): peers that subscribe to this sidecar need a socket to subscribe to".into(),
            );
        }
        for p in &self.peers {
            validate_peer(p)?;
        }
        Ok(())
    }
}

/// A replica-sync peer endpoint as ZMQ takes it: `tcp://host:port`.
pub fn validate_peer(endpoint: &str) -> Result<(), String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("replica-sync peer {endpoint:?} is not tcp://host:port"))?;
    let ok = endpoint.len() <= 256
        && rest.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        })
        && rest.chars().all(|c| c.is_ascii_graphic());
    if !ok {
        return Err(format!(
            "replica-sync peer {endpoint:?} is not tcp://host:port"
        ));
    }
    Ok(())
}

/// Start-up recovery of the prefix index from peers' `GET /dump`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Indexer {
    /// `http://host:port` of sidecars (or anything serving kvgate's dump
    /// format) to recover from, tried in order; empty: no recovery.
    #[serde(default)]
    pub peers: Vec<String>,
    /// How long one peer may take to answer with its whole dump.
    #[serde(
        rename = "timeout_ms",
        default = "default_indexer_timeout",
        deserialize_with = "millis::deserialize"
    )]
    pub timeout: Duration,
    /// Largest dump read from a peer; a larger one is refused unread.
    #[serde(default = "default_max_dump_bytes")]
    pub max_dump_bytes: usize,
}

impl Default for Indexer {
    fn default() -> Self {
        Indexer {
            peers: Vec::new(),
            timeout: default_indexer_timeout(),
            max_dump_bytes: default_max_dump_bytes(),
        }
    }
}

/// A replay is possible only this long after the message was sent, and
/// clocks may differ by up to this much.
fn default_max_message_age() -> Duration {
    Duration::from_millis(30_000)
}

/// A 1.6M-block dump (16 ranks of 100k) is 26 MB: a second on a slow link.
fn default_indexer_timeout() -> Duration {
    Duration::from_millis(10_000)
}

/// 16 bytes a block: about 67M blocks.
fn default_max_dump_bytes() -> usize {
    1 << 30
}

/// How long a gateway VM that says it is alive (once a second) may go
/// without saying it again before its bookings are ended.
pub const DEFAULT_VM_SILENCE: Duration = Duration::from_secs(10);

fn default_vm_silence() -> Duration {
    DEFAULT_VM_SILENCE
}

fn default_booking_ttl() -> Duration {
    Duration::from_millis(300_000)
}
fn default_max_retry_after() -> u32 {
    30
}

/// Envoy sends a request's head in one write; a client that needs more
/// than this is broken or holding the connection on purpose.
fn default_header_read_timeout() -> Duration {
    Duration::from_millis(10_000)
}
/// Twice the longest long poll: Envoy's pooled connections stay open
/// between its polls and bookings.
fn default_idle_timeout() -> Duration {
    Duration::from_millis(60_000)
}
/// A gateway pod's Envoy holds a few dozen connections (a long poll per
/// worker thread, booking posts, scrapes); the start-up lowers the cap to
/// a quarter of the file limit when that is smaller.
fn default_max_connections() -> u32 {
    1024
}
/// Room for the kubelet's probes, a Prometheus scrape and Envoy's long
/// polls and booking connections, whatever else holds the cap.
fn default_reserved_connections() -> u32 {
    64
}
/// Thirty-two bodies of the largest size (2 MiB) at once; selections and
/// bookings are a few KiB.
fn default_body_budget() -> u64 {
    64 << 20
}
/// As the header timeout: a 2 MiB body within it is 200 KiB a second,
/// far under any network a sidecar is reached over.
fn default_body_timeout() -> Duration {
    Duration::from_millis(10_000)
}

/// A few peers recovering at once; at 16 bytes a block, four copies of a
/// 12M-block index are 0.8 GB.
fn default_max_full_reads() -> u32 {
    4
}
/// One copy per kind and class: readers of a class share it until the
/// last of them is done.
fn default_max_full_read_copies() -> u32 {
    1
}
/// Longer than encoding a large index takes, so that readers arriving
/// during a burst share one copy; short enough that a reader catches up
/// within a poll.
fn default_full_read_reuse() -> Duration {
    Duration::from_millis(1000)
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9190))
}
fn default_publish_interval() -> Duration {
    Duration::from_millis(50)
}
fn default_interval() -> Duration {
    Duration::from_millis(500)
}
fn default_timeout() -> Duration {
    Duration::from_millis(400)
}
fn default_down_after() -> Duration {
    Duration::from_millis(2000)
}
fn default_shards() -> u32 {
    16384
}
fn default_max_blocks() -> usize {
    4 << 20
}
fn default_kv_publish() -> Duration {
    Duration::from_millis(5)
}
fn default_replay_timeout() -> Duration {
    Duration::from_millis(2000)
}
fn default_approx_ttl() -> Duration {
    Duration::from_millis(120_000)
}

/// A batch is one engine step's events: a few KiB, a few hundred KiB when
/// a long prompt's blocks are stored with their token ids.
fn default_max_message_bytes() -> u64 {
    8 << 20
}
fn default_queue_messages() -> u32 {
    1000
}
/// An engine buffers its last steps for replay (vLLM: 10,000), typically a
/// few KiB each; what a buffer holds beyond this is rebuilt from live
/// events instead.
fn default_max_replay_bytes() -> u64 {
    256 << 20
}

/// Covers a request's wait in the engine's queue and its prefill under
/// ordinary load, after which its blocks are in the events.
fn default_inflight_ttl() -> Duration {
    Duration::from_millis(10_000)
}
