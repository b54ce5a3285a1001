//! Models and workers: the catalog as the configuration file and the
//! `/workers` API write it.

use super::thermal::ThermalOverride;
use kvgate_core::{Policy, Role, Slo, Thresholds, Topology};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    /// Dynamo's threshold keys, directly in the model's table.
    #[serde(flatten)]
    pub thresholds: Thresholds,
    /// `[models.policy]`: the cost weights; kvgate's defaults when absent.
    #[serde(default)]
    pub policy: Policy,
    /// LoRA adapters every worker of this model serves (vLLM
    /// `--lora-modules name=...`): a request whose `model` is one of them
    /// goes to this model's workers, hashed under the adapter's seed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lora_adapters: Vec<String>,
    /// `[models.thermal]`: the thermal controller's settings for this
    /// model's workers, over `[thermal]`'s.
    #[serde(default, skip_serializing_if = "is_unset")]
    pub thermal: ThermalOverride,
    /// `[models.planner]`: the model's SLA and scaling bounds; absent, the
    /// planner leaves the model alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<super::PlannerConfig>,
    /// `[models.prompt]`: the model's tokenizer and chat template; with
    /// them, chat and text prompts are matched against the engines' KV
    /// events. Absent, text prompts use the routed-prefix index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<crate::prompt::PromptConfig>,
    /// `[models.disaggregation]`: prefill and decode on different workers
    /// (the workers' `role`); absent, every request is served whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<super::DisaggregationConfig>,
    /// `[models.slo]`: the latencies the model's requests should see,
    /// published with each worker's latency fits for routers to check
    /// against. See [`ModelConfig::slo`] for a model without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<Slo>,
    /// The longest prompt, in tokens, one request of this model may book
    /// (and the most output tokens it may expect). Anything announcing
    /// more is refused: a booking stands for at most this much load, so
    /// that no set of bookings can reach the ledger's numeric limits.
    #[serde(default = "default_max_prompt_tokens")]
    pub max_prompt_tokens: u64,
}

impl ModelConfig {
    /// The model's SLO: `[models.slo]`, else its planner's SLA (in whole
    /// ms, rounded up: never stricter than written); `None`: no target,
    /// and no latency fits are kept for it.
    pub fn slo(&self) -> Option<Slo> {
        self.slo.or_else(|| {
            let p = self.planner.as_ref()?;
            let ms = |v: f64| v.ceil().clamp(1.0, f64::from(u32::MAX)) as u32;
            Some(Slo {
                ttft_ms: ms(p.ttft_ms),
                itl_ms: ms(p.itl_ms),
            })
        })
    }
}

/// 16 Mi tokens: past any context window served today.
pub const DEFAULT_MAX_PROMPT_TOKENS: u64 = 1 << 24;

/// The largest `max_prompt_tokens` accepted: with it, one holder books at
/// most 2^31 prefill tokens and 2^32 decode blocks, so more holders than
/// `load.caps.holders` may ever be (`LEDGER_HOLDERS_CEILING`, 2^30) would
/// be needed to reach 2^63; the sums saturate besides.
pub const MAX_PROMPT_TOKENS_CEILING: u64 = 1 << 31;

fn default_max_prompt_tokens() -> u64 {
    DEFAULT_MAX_PROMPT_TOKENS
}

/// The longest node or rack name: a Kubernetes node name's limit.
const MAX_PLACE_LEN: usize = 253;

fn is_unset(o: &ThermalOverride) -> bool {
    *o == ThermalOverride::default()
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
    /// The legs of a disaggregated request it serves: `both` (the
    /// default), `prefill` or `decode`.
    #[serde(default)]
    pub role: Role,
    /// The port of the worker's SGLang bootstrap server
    /// (`--disaggregation-bootstrap-port`), on the endpoint's host; unset:
    /// SGLang's default, 8998. Only a model with `protocol = "sglang"`
    /// reads it.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Where it runs (`{ node = "...", rack = "..." }`): the link a KV pull
    /// between two workers crosses is priced by it (same node, same rack,
    /// elsewhere). Unset: elsewhere from every worker.
    #[serde(default, skip_serializing_if = "Topology::is_unknown")]
    pub topology: Topology,
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
    /// UUIDs of the worker's GPUs (its tensor-parallel group), as NVML
    /// and dcgm-exporter name them: the worker is as hot as the hottest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
    /// Or the labels a dcgm-exporter series carries on this worker's GPUs
    /// (its Kubernetes pod mapping: `pod`, `namespace`); every label must
    /// match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_labels: BTreeMap<String, String>,
    /// The engine serves `POST /v1/admin/batch` on its endpoint: the
    /// thermal controller cuts its running batch, not only new work.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub batch_control: bool,
}

/// At most this many GPUs or GPU labels per worker: a TP group is at most
/// a node's worth.
const MAX_GPUS: usize = 64;

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
        if self.bootstrap_port == Some(0) {
            return Err(format!("worker {id}: bootstrap_port must be above 0"));
        }
        for (what, name) in [("node", &self.topology.node), ("rack", &self.topology.rack)] {
            if name.len() > MAX_PLACE_LEN || name.chars().any(char::is_control) {
                return Err(format!(
                    "worker {id}: topology.{what} must be at most {MAX_PLACE_LEN} bytes without control characters"
                ));
            }
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
        self.check_gpus()?;
        self.check_port_layout()
    }

    fn check_gpus(&self) -> Result<(), String> {
        let id = self.worker_id;
        if self.gpus.len() > MAX_GPUS || self.gpu_labels.len() > MAX_GPUS {
            return Err(format!(
                "worker {id}: at most {MAX_GPUS} gpus and {MAX_GPUS} gpu_labels"
            ));
        }
        let bad = |s: &str| s.is_empty() || s.len() > 256 || s.chars().any(char::is_control);
        if let Some(g) = self.gpus.iter().find(|g| bad(g)) {
            return Err(format!("worker {id}: gpu {g:?} is not a GPU UUID"));
        }
        if let Some((k, v)) = self
            .gpu_labels
            .iter()
            .find(|(k, v)| bad(k) || v.len() > 256)
        {
            return Err(format!(
                "worker {id}: gpu label {k:?} = {v:?} is not a label"
            ));
        }
        Ok(())
    }

    /// Whether any GPU reading can be this worker's.
    pub fn watches_gpus(&self) -> bool {
        !self.gpus.is_empty() || !self.gpu_labels.is_empty()
    }

    /// Whether a GPU with this UUID and these labels is one of the
    /// worker's.
    pub fn owns_gpu(&self, uuid: &str, labels: &BTreeMap<String, String>) -> bool {
        if self.gpus.iter().any(|g| g == uuid) {
            return true;
        }
        !self.gpu_labels.is_empty()
            && self
                .gpu_labels
                .iter()
                .all(|(k, v)| labels.get(k).is_some_and(|l| l == v))
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
        offset_port(base, r)
    }

    pub fn replay_endpoint_of(&self, r: u32) -> Option<String> {
        offset_port(self.replay_endpoint.as_deref()?, r)
    }
}

/// The endpoint of DP rank `rank`, as engines derive it: the port after the
/// last colon plus the rank for TCP, a `_dp{rank}` suffix for inproc.
pub(super) fn offset_port(endpoint: &str, rank: u32) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_string());
    }
    if let Some(name) = endpoint.strip_prefix("inproc://") {
        return Some(format!("inproc://{name}_dp{rank}"));
    }
    if !endpoint.starts_with("tcp://") {
        return None;
    }
    let (host, port) = endpoint.rsplit_once(':')?;
    let port: u32 = port.parse().ok()?;
    Some(format!("{host}:{}", port + rank))
}
