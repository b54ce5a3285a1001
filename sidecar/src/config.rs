//! The sidecar's configuration file (TOML) and the worker shape shared with
//! the `/workers` API.
//!
//! Every key is checked: unknown keys are errors (a typo must not silently
//! turn shedding off), and each error names the entry it is about.

use kvgate_core::{Policy, Thresholds};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: String,
        source: Box<toml::de::Error>,
    },
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: Server,
    #[serde(default)]
    pub scrape: Scrape,
    #[serde(default)]
    pub kv: Kv,
    #[serde(default)]
    pub load: Load,
    #[serde(default)]
    pub control: Control,
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    #[serde(default)]
    pub workers: Vec<WorkerSpec>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    /// APIs, `/metrics` and `/v1/snapshot`.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Snapshots are rebuilt at most this often after a change.
    #[serde(default = "default_publish_ms")]
    pub publish_interval_ms: u64,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            listen: default_listen(),
            publish_interval_ms: default_publish_ms(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scrape {
    #[serde(default = "default_interval")]
    pub interval_ms: u64,
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
    /// A worker with no successful scrape for this long is down.
    #[serde(default = "default_down_after")]
    pub down_after_ms: u64,
}

impl Default for Scrape {
    fn default() -> Self {
        Scrape {
            interval_ms: default_interval(),
            timeout_ms: default_timeout(),
            down_after_ms: default_down_after(),
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
    #[serde(default = "default_kv_publish")]
    pub publish_interval_ms: u64,
    #[serde(default = "default_replay_timeout")]
    pub replay_timeout_ms: u64,
    /// How long a routing decision keeps its text prefix in the
    /// approximate index.
    #[serde(default = "default_approx_ttl")]
    pub approx_ttl_ms: u64,
    /// How long a routing decision credits its rank with a token prompt's
    /// prefix before the engine's KV events must confirm it.
    #[serde(default = "default_inflight_ttl")]
    pub inflight_ttl_ms: u64,
    /// Largest frame a KV-event or replay socket accepts. libzmq drops the
    /// connection of a peer that sends a larger one (it reconnects), so a
    /// confused or hostile publisher cannot make the sidecar buffer it.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: u64,
    /// Messages each rank's sockets queue before dropping (the receive
    /// high-water mark). With `max_message_bytes` it bounds what one
    /// subscriber holds; a drop is a gap that replay repairs.
    #[serde(default = "default_queue_messages")]
    pub queue_messages: u32,
}

impl Default for Kv {
    fn default() -> Self {
        Kv {
            shards: default_shards(),
            max_blocks_per_rank: default_max_blocks(),
            publish_interval_ms: default_kv_publish(),
            replay_timeout_ms: default_replay_timeout(),
            approx_ttl_ms: default_approx_ttl(),
            inflight_ttl_ms: default_inflight_ttl(),
            max_message_bytes: default_max_message_bytes(),
            queue_messages: default_queue_messages(),
        }
    }
}

/// Gateway bookings and the 503's `Retry-After`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Load {
    /// A booking whose request never reported its end is dropped after
    /// this long (a gateway lost it).
    #[serde(default = "default_booking_ttl")]
    pub booking_ttl_ms: u64,
    /// `Retry-After` is the expected time until the first busy worker
    /// drains under its threshold, capped at this.
    #[serde(default = "default_max_retry_after")]
    pub max_retry_after_s: u32,
}

impl Default for Load {
    fn default() -> Self {
        Load {
            booking_ttl_ms: default_booking_ttl(),
            max_retry_after_s: default_max_retry_after(),
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

fn default_booking_ttl() -> u64 {
    300_000
}
fn default_max_retry_after() -> u32 {
    30
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9190))
}
fn default_publish_ms() -> u64 {
    50
}
fn default_interval() -> u64 {
    500
}
fn default_timeout() -> u64 {
    400
}
fn default_down_after() -> u64 {
    2000
}
fn default_shards() -> u32 {
    16384
}
fn default_max_blocks() -> usize {
    4 << 20
}
fn default_kv_publish() -> u64 {
    5
}
fn default_replay_timeout() -> u64 {
    2000
}
fn default_approx_ttl() -> u64 {
    120_000
}

/// A batch is one engine step's events: a few KiB, a few hundred KiB when
/// a long prompt's blocks are stored with their token ids.
fn default_max_message_bytes() -> u64 {
    8 << 20
}
fn default_queue_messages() -> u32 {
    1000
}

/// Covers a request's wait in the engine's queue and its prefill under
/// ordinary load, after which its blocks are in the events.
fn default_inflight_ttl() -> u64 {
    10_000
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    /// Dynamo's threshold keys, directly in the model's table.
    #[serde(flatten)]
    pub thresholds: Thresholds,
    /// `[models.policy]`: the cost weights; Dynamo's defaults when absent.
    #[serde(default)]
    pub policy: Policy,
    /// LoRA adapters every worker of this model serves (vLLM
    /// `--lora-modules name=...`): a request whose `model` is one of them
    /// goes to this model's workers, hashed under the adapter's seed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lora_adapters: Vec<String>,
}

/// A worker: one engine endpoint serving one model with one or more DP
/// ranks. The same shape comes from the config file and from `POST /workers`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    pub worker_id: u64,
    pub model_name: String,
    #[serde(default = "default_tenant", alias = "routing_group")]
    pub tenant_id: String,
    /// `ip:port` (an `http://` prefix is accepted and dropped): what Envoy's
    /// ORIGINAL_DST cluster connects to.
    pub endpoint: String,
    /// Defaults to `http://{endpoint}/metrics`.
    #[serde(default)]
    pub metrics_url: Option<String>,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    #[serde(default)]
    pub data_parallel_start_rank: u32,
    #[serde(default = "default_dp")]
    pub data_parallel_size: u32,
    /// The engine's `max_num_batched_tokens`, for the fractional prefill
    /// threshold (0 = unknown; then read from metrics when published).
    #[serde(default)]
    pub max_num_batched_tokens: u64,
    /// DP rank → ZMQ PUB endpoint of its KV events.
    #[serde(default)]
    pub kv_events_endpoints: BTreeMap<String, String>,
    /// Replay ROUTER endpoint of rank 0 (rank r: port + r).
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// ZMQ topic prefix to subscribe to on the event endpoints; empty
    /// takes every topic. Engines publish under one (vLLM's
    /// `KVEventsConfig.topic`, e.g. `kv-events`), so a publisher shared by
    /// several streams can be narrowed to this worker's.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kv_events_topic: String,
}

fn default_tenant() -> String {
    "default".into()
}
fn default_block_size() -> u32 {
    16
}
fn default_dp() -> u32 {
    1
}

impl WorkerSpec {
    /// Normalises and validates in place.
    pub fn normalize(&mut self) -> Result<(), String> {
        let id = self.worker_id;
        let ep = self
            .endpoint
            .trim()
            .trim_start_matches("http://")
            .trim_end_matches('/');
        let addr: SocketAddr = ep.parse().map_err(|_| {
            format!(
                "worker {id}: endpoint {:?} must be ip:port (Envoy connects to it directly)",
                self.endpoint
            )
        })?;
        self.endpoint = addr.to_string();
        if self.block_size == 0 {
            return Err(format!("worker {id}: block_size must be above 0"));
        }
        if self.data_parallel_size == 0 {
            return Err(format!("worker {id}: data_parallel_size must be above 0"));
        }
        if self.model_name.is_empty() {
            return Err(format!("worker {id}: model_name is empty"));
        }
        for (rank, ep) in &self.kv_events_endpoints {
            let r: u32 = rank.parse().map_err(|_| {
                format!("worker {id}: kv_events_endpoints key {rank:?} is not a rank number")
            })?;
            if r >= self.data_parallel_size {
                return Err(format!(
                    "worker {id}: kv_events_endpoints has rank {r} but data_parallel_size is {}",
                    self.data_parallel_size
                ));
            }
            if !ep.contains("://") {
                return Err(format!(
                    "worker {id}: kv event endpoint {ep:?} needs a scheme, e.g. tcp://host:5557"
                ));
            }
        }
        self.check_port_layout()
    }

    /// vLLM adds the DP rank to both the event and the replay port, so a
    /// replay base within `events base + data_parallel_size` makes one rank's
    /// replay socket the next rank's publisher (the engine fails to bind).
    fn check_port_layout(&self) -> Result<(), String> {
        let dp = self.data_parallel_size;
        let host_port = |ep: &str| -> Option<(String, u32)> {
            let rest = ep.strip_prefix("tcp://")?;
            let (host, port) = rest.rsplit_once(':')?;
            Some((host.to_string(), port.parse().ok()?))
        };
        let events: Vec<_> = (0..dp)
            .filter_map(|r| host_port(&self.events_endpoint(r)?))
            .collect();
        let replay: Vec<_> = (0..dp)
            .filter_map(|r| host_port(&self.replay_endpoint_of(r)?))
            .collect();
        if !events.iter().any(|e| replay.contains(e)) {
            return Ok(());
        }
        let range = |v: &[(String, u32)]| {
            let lo = v.iter().map(|p| p.1).min().unwrap_or(0);
            let hi = v.iter().map(|p| p.1).max().unwrap_or(0);
            format!("{lo}-{hi}")
        };
        let (host, events_base) = events
            .first()
            .cloned()
            .unwrap_or_else(|| (String::new(), 0));
        Err(format!(
            "worker {}: KV event ports {} and replay ports {} on {host} overlap \
             (the engine adds the DP rank to both); put the replay base at or above \
             the events base + data_parallel_size, e.g. replay_endpoint = \"tcp://{host}:{}\"",
            self.worker_id,
            range(&events),
            range(&replay),
            events_base + dp,
        ))
    }

    pub fn metrics_url(&self) -> String {
        self.metrics_url
            .clone()
            .unwrap_or_else(|| format!("http://{}/metrics", self.endpoint))
    }

    /// The KV event endpoint of DP rank `r` (0-based within this worker):
    /// listed explicitly, or derived from rank 0's by the engines' port
    /// offset.
    pub fn events_endpoint(&self, r: u32) -> Option<String> {
        if let Some(ep) = self.kv_events_endpoints.get(&r.to_string()) {
            return Some(ep.clone());
        }
        let base = self.kv_events_endpoints.get("0")?;
        crate::sources::kv::subscriber::offset_port(base, r)
    }

    pub fn replay_endpoint_of(&self, r: u32) -> Option<String> {
        crate::sources::kv::subscriber::offset_port(self.replay_endpoint.as_deref()?, r)
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::parse(&text).map_err(|e| match e {
            ConfigError::Parse { source, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                source,
            },
            other => other,
        })
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut c: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: "<config>".into(),
            source: Box::new(source),
        })?;
        c.validate().map_err(ConfigError::Invalid)?;
        Ok(c)
    }

    fn validate(&mut self) -> Result<(), String> {
        let mut names = BTreeSet::new();
        for m in &self.models {
            if !names.insert(m.name.clone()) {
                return Err(format!("model {:?} is listed twice", m.name));
            }
            m.thresholds
                .validate()
                .map_err(|e| format!("model {:?}: {e}", m.name))?;
            m.policy
                .validate()
                .map_err(|e| format!("model {:?}: policy: {e}", m.name))?;
        }
        // An adapter name is matched against requests' `model` after the
        // served models: one that is also a model, or listed under two
        // models, would route ambiguously.
        let mut adapters = BTreeSet::new();
        for m in &self.models {
            for a in &m.lora_adapters {
                if a.is_empty() || names.contains(a) || !adapters.insert(a.clone()) {
                    return Err(format!(
                        "model {:?}: lora adapter {a:?} is empty, a model name, or listed twice",
                        m.name
                    ));
                }
            }
        }
        let mut ids = BTreeSet::new();
        for w in &mut self.workers {
            if !ids.insert(w.worker_id) {
                return Err(format!("worker {} is listed twice", w.worker_id));
            }
            if !names.contains(&w.model_name) {
                return Err(format!(
                    "worker {} serves model {:?}, which is not in [[models]]",
                    w.worker_id, w.model_name
                ));
            }
            w.normalize()?;
        }
        if self.scrape.interval_ms == 0 || self.scrape.timeout_ms == 0 {
            return Err("scrape.interval_ms and scrape.timeout_ms must be above 0".into());
        }
        if self.kv.shards == 0 {
            return Err("kv.shards must be above 0".into());
        }
        // libzmq takes both as signed integers; 0 would mean "no limit".
        if !(1..=i64::MAX as u64).contains(&self.kv.max_message_bytes) {
            return Err(format!(
                "kv.max_message_bytes must be within [1, {}], got {}",
                i64::MAX,
                self.kv.max_message_bytes
            ));
        }
        if !(1..=i32::MAX as u32).contains(&self.kv.queue_messages) {
            return Err(format!(
                "kv.queue_messages must be within [1, {}], got {}",
                i32::MAX,
                self.kv.queue_messages
            ));
        }
        if self.load.booking_ttl_ms == 0 || self.load.max_retry_after_s == 0 {
            return Err("load.booking_ttl_ms and load.max_retry_after_s must be above 0".into());
        }
        Ok(())
    }

    /// Reads the control token from `control.token_file`, else from
    /// `KVGATE_CONTROL_TOKEN`. Surrounding whitespace is not part of it.
    pub fn resolve_token(&mut self) -> Result<(), ConfigError> {
        let token = match &self.control.token_file {
            Some(p) => Some(
                std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.display().to_string(),
                    source,
                })?,
            ),
            None => std::env::var("KVGATE_CONTROL_TOKEN").ok(),
        };
        self.control.token = match token.map(|t| t.trim().to_string()) {
            Some(t) if t.is_empty() => {
                return Err(ConfigError::Invalid("the control token is empty".into()));
            }
            other => other,
        };
        Ok(())
    }

    /// Applies threshold flags to every model (flags beat the file).
    pub fn override_thresholds(&mut self, t: &Thresholds) -> Result<(), ConfigError> {
        for m in &mut self.models {
            m.thresholds = m.thresholds.overridden_by(t);
            m.thresholds
                .validate()
                .map_err(|e| ConfigError::Invalid(format!("model {:?}: {e}", m.name)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[server]
listen = "127.0.0.1:9999"

[[models]]
name = "m"
active_decode_blocks_threshold = 0.85

[[workers]]
worker_id = 1
model_name = "m"
endpoint = "http://127.0.0.1:8001/"
data_parallel_size = 2
kv_events_endpoints = { "0" = "tcp://127.0.0.1:5557" }
replay_endpoint = "tcp://127.0.0.1:5567"
"#;

    #[test]
    fn parses_with_defaults_and_normalises() {
        let c = Config::parse(GOOD).unwrap();
        assert_eq!(c.server.listen.port(), 9999);
        assert_eq!(c.scrape.down_after_ms, 2000);
        let w = &c.workers[0];
        assert_eq!(w.endpoint, "127.0.0.1:8001");
        assert_eq!(w.metrics_url(), "http://127.0.0.1:8001/metrics");
        assert_eq!(w.tenant_id, "default");
        assert_eq!(w.block_size, 16);
        assert_eq!(
            w.events_endpoint(1).as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        assert_eq!(
            w.replay_endpoint_of(1).as_deref(),
            Some("tcp://127.0.0.1:5568")
        );
        assert_eq!(c.models[0].thresholds.active_decode_blocks, Some(0.85));
        assert_eq!(
            (c.kv.max_message_bytes, c.kv.queue_messages),
            (8 << 20, 1000)
        );
    }

    #[test]
    fn kv_socket_bounds_are_checked() {
        let c = Config::parse("[kv]\nmax_message_bytes = 65536\nqueue_messages = 10").unwrap();
        assert_eq!((c.kv.max_message_bytes, c.kv.queue_messages), (65536, 10));
        assert!(err("[kv]\nmax_message_bytes = 0").contains("kv.max_message_bytes"));
        assert!(err("[kv]\nqueue_messages = 0").contains("kv.queue_messages"));
        assert!(err("[kv]\nqueue_messages = 2147483648").contains("kv.queue_messages"));
    }

    #[test]
    fn overlapping_derived_dp_ports_are_rejected() {
        let worker = |events: &str, replay: &str, dp: u32| {
            format!(
                "[[models]]\nname = \"m\"\n[[workers]]\nworker_id = 7\nmodel_name = \"m\"\n\
                 endpoint = \"127.0.0.1:8001\"\ndata_parallel_size = {dp}\n\
                 kv_events_endpoints = {{ \"0\" = \"{events}\" }}\nreplay_endpoint = \"{replay}\"\n"
            )
        };
        // The README's old layout: rank 1 publishes on 5558, rank 0 replays there.
        let e = err(&worker("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", 2));
        assert!(e.contains("worker 7"), "{e}");
        assert!(e.contains("5557-5558") && e.contains("5558-5559"), "{e}");
        assert!(e.contains("tcp://10.0.0.5:5559"), "{e}");
        assert!(err(&worker("tcp://h:5557", "tcp://h:5557", 1)).contains("overlap"));
        // Working layouts: replay base at events base + DP size, another
        // host, or one rank with adjacent ports.
        for (ev, rp, dp) in [
            ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5559", 2),
            ("tcp://10.0.0.5:5557", "tcp://10.0.0.6:5558", 2),
            ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", 1),
            ("tcp://10.0.0.5:5560", "tcp://10.0.0.5:5557", 2),
        ] {
            Config::parse(&worker(ev, rp, dp)).unwrap_or_else(|e| panic!("{ev} {rp} {dp}: {e}"));
        }
    }

    #[test]
    fn kv_events_topic_defaults_to_every_topic() {
        let c = Config::parse(GOOD).unwrap();
        assert_eq!(c.workers[0].kv_events_topic, "");
        let c = Config::parse(&format!("{GOOD}kv_events_topic = \"kv-events\"\n")).unwrap();
        assert_eq!(c.workers[0].kv_events_topic, "kv-events");
    }

    fn err(text: &str) -> String {
        Config::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn lora_adapters_are_unique_and_not_models() {
        let c = Config::parse(
            "[[models]]\nname = \"m\"\nlora_adapters = [\"a\", \"b\"]\n[[models]]\nname = \"n\"",
        )
        .unwrap();
        assert_eq!(c.models[0].lora_adapters, ["a", "b"]);
        assert!(c.models[1].lora_adapters.is_empty());
        for bad in [
            "[[models]]\nname = \"m\"\nlora_adapters = [\"a\", \"a\"]",
            "[[models]]\nname = \"m\"\nlora_adapters = [\"\"]",
            "[[models]]\nname = \"m\"\nlora_adapters = [\"n\"]\n[[models]]\nname = \"n\"",
            "[[models]]\nname = \"m\"\nlora_adapters = [\"a\"]\n[[models]]\nname = \"n\"\nlora_adapters = [\"a\"]",
        ] {
            assert!(err(bad).contains("lora adapter"), "{bad}");
        }
    }

    #[test]
    fn each_mistake_is_named() {
        assert!(err("[server]\nlisten = 5").contains("listen"));
        assert!(err("bogus = 1").contains("bogus"));
        let worker = |extra: &str| {
            format!(
                "[[models]]\nname = \"m\"\n[[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:1\"\n{extra}"
            )
        };
        assert!(err(&worker("block_size = 0")).contains("block_size"));
        assert!(err(&worker("data_parallel_size = 0")).contains("data_parallel_size"));
        assert!(err(&worker("kv_events_endpoints = { \"3\" = \"tcp://x:1\" }")).contains("rank 3"));
        assert!(
            err(&format!(
                "{}\n[[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:2\"",
                worker("")
            ))
            .contains("listed twice")
        );
        assert!(
            err("[[workers]]\nworker_id = 1\nmodel_name = \"x\"\nendpoint = \"127.0.0.1:1\"")
                .contains("not in [[models]]")
        );
        assert!(err(&worker("").replace("127.0.0.1:1", "worker-a:8000")).contains("ip:port"));
        assert!(
            err("[[models]]\nname = \"m\"\nactive_decode_blocks_threshold = 1.5")
                .contains("[0, 1]")
        );
        assert!(
            err("[[models]]\nname = \"m\"\nactive_prefill_tokens_threshold_frac = 0")
                .contains("above 0")
        );
        assert!(err("[[models]]\nname = \"m\"\n[[models]]\nname = \"m\"").contains("twice"));
        assert!(
            err("[[models]]\nname = \"m\"\nactive_decode_block_threshold = 0.5")
                .contains("active_decode_block_threshold"),
            "a misspelt threshold is an error, not a disabled condition"
        );
        assert!(
            err("[[models]]\nname = \"m\"\n[models.policy]\nhost_weight = -1")
                .contains("host_weight")
        );
        assert!(
            err("[[models]]\nname = \"m\"\n[models.policy]\nhost_wieght = 1")
                .contains("host_wieght")
        );
    }

    #[test]
    fn models_carry_their_policy() {
        let c = Config::parse(
            "[[models]]\nname = \"m\"\nactive_decode_blocks_threshold = 0.7\n[models.policy]\noverlap_credit = 2.0\ntemperature = 0.1",
        )
        .unwrap();
        let m = &c.models[0];
        assert_eq!(m.thresholds.active_decode_blocks, Some(0.7));
        assert_eq!(m.policy.overlap_credit, 2.0);
        assert_eq!(m.policy.temperature, 0.1);
        assert_eq!(
            m.policy.host_weight,
            kvgate_core::Policy::default().host_weight
        );
    }
}
