//! The fleet state every part of kvgate reads: defined once here, encoded
//! for Envoy by [`crate::snapshot`], read from configuration and served as
//! JSON by the sidecar (with the `serde` feature).
//!
//! Validation lives on the types, so a threshold or a weight is checked the
//! same way whether it comes from a file, a flag or the control API. The
//! serialized names are Dynamo's (`worker_id`, `tenant_id`, `dp_rank`, the
//! threshold keys), so its clients read kvgate's JSON unchanged.

use crate::disagg::Conditional;
use crate::fit::WorkerFits;
#[cfg(feature = "serde")]
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The tenant of workers and requests that name none (Dynamo's default).
pub const DEFAULT_TENANT: &str = "default";

/// A decoded snapshot of the fleet.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct Snapshot {
    /// Monotonic per sidecar process; a change means "re-read me".
    pub version: u64,
    /// When the sidecar built it, Unix milliseconds.
    pub built_at_ms: u64,
    pub models: Vec<ModelState>,
    /// Per router VM, the highest booking sequence this snapshot's load
    /// includes (minor 1). A VM adds its own later bookings on top.
    #[cfg_attr(feature = "serde", serde(default))]
    pub applied: Vec<Applied>,
}

/// The bookings of one router VM that a snapshot already counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct Applied {
    pub vm: u64,
    pub seq: u64,
}

/// One served model: its shedding thresholds, its cost weights and its
/// schedulable workers.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct ModelState {
    pub name: String,
    pub thresholds: Thresholds,
    /// Number of KV index shards published for this model; 0 when no worker
    /// of the model publishes KV events (no prefix index).
    pub shard_count: u32,
    /// Only workers the sidecar considers up; a configured model with none is
    /// still listed so the filter can tell "no workers" from "unknown model".
    pub workers: Vec<WorkerState>,
    /// Seconds until the first busy worker is expected to take work again,
    /// from the observed drain rate (minor 1); 0 when unknown.
    pub retry_after_s: u32,
    /// LoRA adapters served by this model's workers (minor 3): a request
    /// naming one routes to these workers and is hashed under the adapter.
    #[cfg_attr(feature = "serde", serde(default))]
    pub lora_adapters: Vec<String>,
    /// The cost weights requests of this model are placed with (minor 4;
    /// older snapshots carry the defaults).
    #[cfg_attr(feature = "serde", serde(default))]
    pub policy: Policy,
    /// Requests the model's ranks complete per second, as the sidecar
    /// observes it (minor 5; 0 when unknown): the pace at which shed
    /// requests are given places to retry (`plan::retry`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub service_rate_per_s: f64,
    /// What the planner wants of the model (minor 6; zeros: no planner).
    #[cfg_attr(feature = "serde", serde(default))]
    pub plan: ModelPlan,
    /// Version of the prompt template the sidecar publishes for the model
    /// ([`crate::text::template_key`]) and of its text index (minor 7);
    /// 0: text prompts are matched against the routed-prefix index only.
    #[cfg_attr(feature = "serde", serde(default))]
    pub prompt_template: u64,
    /// How the model splits prefill from decode (minor 8); `None`: every
    /// request is served whole by one worker, whatever the roles.
    #[cfg_attr(feature = "serde", serde(default))]
    pub disaggregation: Option<Disaggregation>,
    /// A disaggregated model's `retry_after_s` for a request its prefill
    /// workers cannot take, and for one its decode workers (with `both`)
    /// cannot: each pool's own drain and scale-up (minor 9); 0: the
    /// model's.
    #[cfg_attr(feature = "serde", serde(default))]
    pub retry_after_by_pool_s: [u32; 2],
    /// The latencies the model's requests should see (minor 10; older
    /// snapshots: no target), checked against each worker's
    /// [`WorkerState::fits`].
    #[cfg_attr(feature = "serde", serde(default))]
    pub slo: Slo,
    /// What each tenant has booked on the model's workers that are up, by
    /// every gateway and the selection API alike (minor 10, after the SLO;
    /// older snapshots: none): what tenant fairness weighs a tenant's share
    /// by. Only tenants with load booked now, at most the 64 with the
    /// largest share (the larger of their part of the model's prompt
    /// tokens and of its decode blocks); the others' load is in the ranks'
    /// and in no entry.
    #[cfg_attr(feature = "serde", serde(default))]
    pub tenants: Vec<TenantLoad>,
}

/// One tenant's booked load on a model: the sums, over the model's ranks,
/// of what [`RankLoad::active_prefill_tokens`] and
/// [`RankLoad::active_decode_blocks`] count of its requests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct TenantLoad {
    pub tenant: String,
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
}

/// A model's latency targets, in ms; 0: no target.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct Slo {
    /// Time to first token.
    pub ttft_ms: u32,
    /// Inter-token latency.
    pub itl_ms: u32,
}

/// The planner's view of a model, as routing and shedding use it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct ModelPlan {
    /// Replicas the planner wants.
    pub desired: u32,
    /// Replicas serving (up, not draining).
    pub ready: u32,
    /// Seconds until a scale-up in progress is expected to serve; 0: none
    /// in progress.
    pub scale_up_eta_s: u32,
}

/// One worker (an engine process group behind one HTTP endpoint).
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct WorkerState {
    #[cfg_attr(feature = "serde", serde(rename = "worker_id"))]
    pub id: u64,
    /// `ip:port`, exactly what the routed cluster connects to.
    pub endpoint: String,
    pub block_size: u32,
    /// One entry per data-parallel rank, in rank order.
    pub ranks: Vec<RankLoad>,
    /// Selection scope within the model (minor 2): a request of one tenant
    /// is only ever placed on that tenant's workers.
    #[cfg_attr(feature = "serde", serde(rename = "tenant_id"))]
    pub tenant: String,
    /// The heat of the worker's GPUs and what the sidecar's controller
    /// made of it (minor 6; older snapshots say nothing is known).
    #[cfg_attr(feature = "serde", serde(default))]
    pub thermal: Thermal,
    /// The planner is removing it: it takes no new requests and finishes
    /// what it has (minor 6).
    #[cfg_attr(feature = "serde", serde(default))]
    pub draining: bool,
    /// Which leg of a disaggregated request it serves (minor 8; older
    /// snapshots: both).
    #[cfg_attr(feature = "serde", serde(default))]
    pub role: Role,
    /// The port of its SGLang bootstrap server, on the endpoint's host
    /// (minor 8; older snapshots, and 0: SGLang's default,
    /// [`DEFAULT_BOOTSTRAP_PORT`]). Only an SGLang prefill leg reads it.
    #[cfg_attr(feature = "serde", serde(default = "default_bootstrap_port"))]
    pub bootstrap_port: u16,
    /// Its TTFT and ITL against its load, as the sidecar fitted them
    /// (minor 10); `None`: its model keeps no fits (it has no SLO), or
    /// nothing was learned yet. Left out of JSON then, so a worker
    /// without fits keeps its shape.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub fits: Option<WorkerFits>,
    /// Where it runs (minor 11; older snapshots: unknown): what a KV
    /// transfer between two workers crosses ([`crate::disagg::pull`]).
    /// Left out of JSON when unknown, so a worker without one keeps its
    /// shape.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Topology::is_unknown")
    )]
    pub topology: Topology,
}

/// A worker's place in the fleet, as its operator names it: empty is
/// unknown, and unknown is never the same place as anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct Topology {
    /// The machine (a Kubernetes node): its GPUs share NVLink or PCIe.
    pub node: String,
    /// The rack or network block: its machines share a switch.
    pub rack: String,
}

impl Topology {
    /// Neither place is named.
    pub fn is_unknown(&self) -> bool {
        self.node.is_empty() && self.rack.is_empty()
    }
}

/// SGLang's `--disaggregation-bootstrap-port` default.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

#[cfg(feature = "serde")]
fn default_bootstrap_port() -> u16 {
    DEFAULT_BOOTSTRAP_PORT
}

impl WorkerState {
    /// The bootstrap port an SGLang decode worker is told to connect to.
    pub fn bootstrap_port(&self) -> u16 {
        match self.bootstrap_port {
            0 => DEFAULT_BOOTSTRAP_PORT,
            p => p,
        }
    }
}

/// The legs of a disaggregated request a worker serves. On a model served
/// whole (no disaggregation, or no worker of one of the two specialised
/// roles) the role changes nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Role {
    /// Either leg, or a whole request: what every worker was before roles.
    #[default]
    Both,
    Prefill,
    Decode,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Both, Role::Prefill, Role::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The wire value (snapshot minor 8).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// A wire value from a newer writer reads as `Both`: a worker whose
    /// role this build does not know is still one of the model's workers,
    /// as it was before roles.
    pub fn from_code(code: u8) -> Role {
        Role::ALL
            .get(usize::from(code))
            .copied()
            .unwrap_or(Role::Both)
    }

    /// It may compute a disaggregated request's prompt.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }

    /// It may generate a disaggregated request's answer.
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// The busy conditions a worker of this role is judged by. In a model
    /// that splits its requests (`split`) a prefill worker holds no decode
    /// load worth shedding for, and a decode worker queues no prompt: each
    /// is judged by its own leg's conditions only (Dynamo's rule). A
    /// `both` worker, or any worker of a model served whole, by all.
    pub fn judged_by(self, th: Thresholds, split: bool) -> Thresholds {
        match (split, self) {
            (true, Role::Prefill) => Thresholds {
                active_decode_blocks: None,
                ..th
            },
            (true, Role::Decode) => Thresholds {
                active_prefill_tokens: None,
                active_prefill_tokens_frac: None,
                ..th
            },
            _ => th,
        }
    }
}

/// Whether workers of these roles split requests: at least one worker only
/// prefills and one only decodes. Without both, the model is served whole
/// as before roles ("both" workers alone gain nothing from a second hop).
pub fn splits(roles: impl IntoIterator<Item = Role>) -> bool {
    let (mut prefill, mut decode) = (false, false);
    for r in roles {
        prefill |= r == Role::Prefill;
        decode |= r == Role::Decode;
    }
    prefill && decode
}

/// A model's disaggregated serving: how its two legs talk, when the
/// prefill leg is skipped, and what a failed prefill leg becomes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct Disaggregation {
    pub protocol: Protocol,
    /// When the decode worker computes the prompt itself.
    pub conditional: Conditional,
    pub on_prefill_failure: OnPrefillFailure,
    /// How long the prefill leg may take before it counts as failed.
    pub prefill_timeout_ms: u64,
    /// Credit per block of the prompt the decode worker already holds on
    /// its device, as [`Policy::overlap_credit`] is for a whole request
    /// (host and disk blocks in the policy's proportion). 0 is Dynamo's
    /// decode choice, by load alone.
    pub decode_affinity: f64,
    /// On a model of `both` workers speaking vLLM's NIXL, when a request
    /// is prefilled on the worker holding its prefix and decoded on
    /// another that pulls the KV (snapshot minor 11); `None`: never.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub pull: Option<crate::disagg::pull::Pull>,
}

/// How a disaggregated request's legs are sent (see `docs/configuration.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Protocol {
    /// vLLM's NixlConnector: prefill first, its `kv_transfer_params` in
    /// the decode leg ([`crate::disagg::nixl`]).
    #[default]
    VllmNixl,
    /// SGLang: the same body with bootstrap fields to both legs at once.
    Sglang,
}

impl Protocol {
    pub const ALL: [Protocol; 2] = [Protocol::VllmNixl, Protocol::Sglang];

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::VllmNixl => "vllm-nixl",
            Protocol::Sglang => "sglang",
        }
    }

    /// The wire value (snapshot minor 8).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// `None` for a protocol this build cannot speak.
    pub fn from_code(code: u8) -> Option<Protocol> {
        Protocol::ALL.get(usize::from(code)).copied()
    }
}

/// What a request whose prefill leg failed (or found no free prefill
/// worker) becomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum OnPrefillFailure {
    /// The decode worker computes the prompt itself (vLLM's proxies do).
    #[default]
    Local,
    /// The request fails: the decode pool is kept for decoding.
    Fail,
}

impl Default for Disaggregation {
    fn default() -> Self {
        Disaggregation {
            protocol: Protocol::default(),
            conditional: Conditional::default(),
            on_prefill_failure: OnPrefillFailure::default(),
            prefill_timeout_ms: 30_000,
            decode_affinity: Policy::default().overlap_credit,
            pull: None,
        }
    }
}

impl Disaggregation {
    /// The ratio within [0, 1], a timeout above 0, the affinity finite and
    /// not negative.
    pub fn validate(&self) -> Result<(), InvalidValue> {
        let ratio = self.conditional.max_uncached_ratio;
        if !(0.0..=1.0).contains(&ratio) {
            return Err(InvalidValue {
                field: "max_uncached_ratio",
                rule: "within [0, 1]",
                value: ratio,
            });
        }
        if self.prefill_timeout_ms == 0 {
            return Err(InvalidValue {
                field: "prefill_timeout_ms",
                rule: "above 0",
                value: 0.0,
            });
        }
        if !(self.decode_affinity >= 0.0 && self.decode_affinity.is_finite()) {
            return Err(InvalidValue {
                field: "decode_affinity",
                rule: "finite and not negative",
                value: self.decode_affinity,
            });
        }
        if let Some(p) = &self.pull {
            p.validate()?;
        }
        Ok(())
    }
}

/// A worker's GPU heat as the routers act on it: how dear it is, and the
/// most requests it may hold while throttling. A worker is as hot as the
/// hottest GPU of its tensor-parallel group.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct Thermal {
    pub state: ThermalState,
    /// 0 when cool, rising to 1 as the hottest GPU nears its target: new
    /// work drifts to cooler workers before any is capped.
    pub heat: f64,
    /// While throttling, the most requests the worker may hold; 0 is no cap.
    pub cap: u32,
    /// Requests in flight on the worker as the sidecar counts them: the
    /// engine's running and waiting, or the gateways' bookings when more.
    pub in_flight: u32,
}

/// Where a worker stands with its thermal controller.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum ThermalState {
    /// No GPU of the worker is watched.
    #[default]
    Unmonitored,
    Cool,
    /// Within the warm band under the target: priced, not capped.
    Warm,
    /// At or over the target (or slowing down), until it is back under
    /// target minus hysteresis: capped.
    Throttling,
    /// Watched, but no fresh reading: priced as hot, a cap held.
    Unknown,
}

impl ThermalState {
    pub const ALL: [ThermalState; 5] = [
        ThermalState::Unmonitored,
        ThermalState::Cool,
        ThermalState::Warm,
        ThermalState::Throttling,
        ThermalState::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ThermalState::Unmonitored => "unmonitored",
            ThermalState::Cool => "cool",
            ThermalState::Warm => "warm",
            ThermalState::Throttling => "throttling",
            ThermalState::Unknown => "unknown",
        }
    }

    /// The wire value (snapshot minor 6).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// A wire value from a newer writer reads as unknown, never as cool.
    pub fn from_code(code: u8) -> ThermalState {
        ThermalState::ALL
            .get(usize::from(code))
            .copied()
            .unwrap_or(ThermalState::Unknown)
    }
}

impl Thermal {
    /// The worker holds as many requests as its cap allows.
    pub fn at_cap(&self) -> bool {
        self.cap > 0 && self.in_flight >= self.cap
    }
}

/// Load of one data-parallel rank, merged from engine metrics and gateway
/// bookings by the sidecar.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct RankLoad {
    #[cfg_attr(feature = "serde", serde(rename = "dp_rank"))]
    pub rank: u32,
    /// The rank's number in the KV index shards of its model.
    pub slot: u16,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    pub max_num_batched_tokens: u64,
    pub running: u32,
    pub waiting: u32,
    pub busy: bool,
}

impl ModelState {
    /// Whether the model's requests are split into a prefill and a decode
    /// leg: it has disaggregation settings and, among its workers (the
    /// ones up), a prefill and a decode worker. Otherwise it is served
    /// whole, as before roles.
    pub fn disaggregated(&self) -> bool {
        self.disaggregation.is_some() && splits(self.workers.iter().map(|w| w.role))
    }

    /// The model's pull settings, where a request may be prefilled on the
    /// worker holding its prefix and decoded on another that pulls the KV:
    /// pulls are on, the legs speak vLLM's NIXL, and the model is not
    /// split into prefill and decode pools (only `both` workers take
    /// either leg of a pull).
    pub fn pulls(&self) -> Option<&crate::disagg::pull::Pull> {
        let d = self.disaggregation.as_ref()?;
        if d.protocol != Protocol::VllmNixl || self.disaggregated() {
            return None;
        }
        d.pull.as_ref()
    }
}

impl Snapshot {
    /// The model a request's `model` names: a served model, or the base
    /// model of a LoRA adapter (then `name` differs from the result's).
    pub fn model(&self, name: &str) -> Option<&ModelState> {
        self.models.iter().find(|m| m.name == name).or_else(|| {
            self.models
                .iter()
                .find(|m| m.lora_adapters.iter().any(|a| a == name))
        })
    }
}

/// Declares [`Thresholds`] and [`ThresholdsPatch`] from one list, so that
/// each condition's field, type and Dynamo name are written once.
macro_rules! thresholds {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident: $ty:ty, $name:ident = $wire:literal;
    )*) => {
        /// Per-model shedding thresholds. `None` disables that condition;
        /// all `None` means the model never sheds. The serialized names are
        /// Dynamo's, so its `busy_threshold` clients and configuration
        /// carry over.
        #[derive(Debug, Clone, Copy, Default, PartialEq)]
        #[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
        pub struct Thresholds {
            $(
                $(#[doc = $doc])*
                #[cfg_attr(feature = "serde", serde(rename = $wire, default))]
                pub $field: Option<$ty>,
            )*
        }

        /// A change to [`Thresholds`], as `POST /busy_threshold` takes it:
        /// a condition left out is kept, `null` unsets it, a value sets it.
        /// Written, it leaves out what it does not change, which is
        /// Dynamo's shape for the conditions a model sets
        /// ([`Thresholds::as_patch`]).
        #[derive(Debug, Clone, Copy, Default, PartialEq)]
        #[cfg_attr(
            feature = "serde",
            derive(Serialize, Deserialize),
            serde(deny_unknown_fields)
        )]
        pub struct ThresholdsPatch {
            $(
                #[cfg_attr(
                    feature = "serde",
                    serde(
                        rename = $wire,
                        default,
                        deserialize_with = "present",
                        skip_serializing_if = "Option::is_none"
                    )
                )]
                pub $field: Option<Option<$ty>>,
            )*
        }

        impl Thresholds {
            $(
                /// The condition's Dynamo name.
                pub const $name: &'static str = $wire;
            )*

            /// `self` with `patch` applied.
            pub fn patched(self, patch: &ThresholdsPatch) -> Thresholds {
                Thresholds {
                    $($field: patch.$field.unwrap_or(self.$field),)*
                }
            }

            /// The patch that sets what `self` sets and changes nothing else.
            pub fn as_patch(&self) -> ThresholdsPatch {
                ThresholdsPatch {
                    $($field: self.$field.map(Some),)*
                }
            }
        }
    };
}

thresholds! {
    /// Fraction of KV blocks (0–1) above which decode load makes a rank busy.
    active_decode_blocks: f64, DECODE_BLOCKS = "active_decode_blocks_threshold";
    /// Absolute active prefill tokens above which a rank is busy.
    active_prefill_tokens: u64, PREFILL_TOKENS = "active_prefill_tokens_threshold";
    /// Multiple of `max_num_batched_tokens` above which a rank is busy.
    active_prefill_tokens_frac: f64, PREFILL_TOKENS_FRAC = "active_prefill_tokens_threshold_frac";
    /// Requests in flight on one worker that decodes (a decode or `both`
    /// worker; any worker of a model served whole) at which it takes no
    /// more. Checked again, atomically, as each request is sent.
    active_decode_requests: u64, DECODE_REQUESTS = "active_decode_requests_threshold";
}

/// A patch field that is present, `null` or not: absent fields stay
/// `None` through `default`.
#[cfg(feature = "serde")]
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// A value outside the range its field allows.
#[derive(Debug, Clone, Error, PartialEq)]
#[error("{field} must be {rule}, got {value}")]
pub struct InvalidValue {
    pub field: &'static str,
    pub rule: &'static str,
    pub value: f64,
}

impl Thresholds {
    pub fn is_enabled(&self) -> bool {
        self.active_decode_blocks.is_some()
            || self.active_prefill_tokens.is_some()
            || self.active_prefill_tokens_frac.is_some()
            || self.active_decode_requests.is_some()
    }

    /// Decode within [0, 1], fraction above 0.
    pub fn validate(&self) -> Result<(), InvalidValue> {
        if let Some(d) = self.active_decode_blocks
            && !(0.0..=1.0).contains(&d)
        {
            return Err(InvalidValue {
                field: Thresholds::DECODE_BLOCKS,
                rule: "within [0, 1]",
                value: d,
            });
        }
        if let Some(f) = self.active_prefill_tokens_frac
            && !(f > 0.0 && f.is_finite())
        {
            return Err(InvalidValue {
                field: Thresholds::PREFILL_TOKENS_FRAC,
                rule: "above 0",
                value: f,
            });
        }
        if self.active_decode_requests == Some(0) {
            return Err(InvalidValue {
                field: Thresholds::DECODE_REQUESTS,
                rule: "above 0",
                value: 0.0,
            });
        }
        Ok(())
    }

    /// Every condition times `factor`: above 1 a retry's headroom over the
    /// thresholds, under 1 what a class without the reserve may use. The
    /// decode fraction stays at most 1 and a request bound at least 1.
    pub fn scaled(&self, factor: f64) -> Thresholds {
        let f = factor.max(0.0);
        Thresholds {
            active_decode_blocks: self.active_decode_blocks.map(|t| (t * f).min(1.0)),
            active_prefill_tokens: self
                .active_prefill_tokens
                .map(|t| (t as f64 * f).min(u64::MAX as f64) as u64),
            active_prefill_tokens_frac: self.active_prefill_tokens_frac.map(|t| t * f),
            active_decode_requests: self
                .active_decode_requests
                .map(|t| ((t as f64 * f).min(u64::MAX as f64) as u64).max(1)),
        }
    }

    /// `self` with every condition `over` sets replaced by it.
    pub fn overridden_by(self, over: &Thresholds) -> Thresholds {
        Thresholds {
            active_decode_blocks: over.active_decode_blocks.or(self.active_decode_blocks),
            active_prefill_tokens: over.active_prefill_tokens.or(self.active_prefill_tokens),
            active_prefill_tokens_frac: over
                .active_prefill_tokens_frac
                .or(self.active_prefill_tokens_frac),
            active_decode_requests: over.active_decode_requests.or(self.active_decode_requests),
        }
    }
}

/// Cost weights of [`crate::plan::select`]: Dynamo's, except that a cached
/// block is credited three blocks of load by default instead of one
/// (measured in `docs/selection.md`). Configured per model and published in
/// the snapshot, so an operator tunes them in one place and every router
/// uses the same ones.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct Policy {
    /// Credit per device-resident prefix block, in prefill blocks.
    pub overlap_credit: f64,
    /// Credit per block held only in host memory.
    pub host_weight: f64,
    /// Credit per block held only on disk.
    pub disk_weight: f64,
    /// Weight of the prefill term against the decode term.
    pub prefill_load_scale: f64,
    /// Cost per running request on the rank.
    pub decode_active_request_weight: f64,
    /// 0 picks the minimum; above 0 samples from a softmax over the
    /// range-normalised, negated logits.
    pub temperature: f64,
    /// How much dearer a worker at its thermal target is: the cost is
    /// multiplied by `1 + thermal_weight × heat` (minor 6).
    pub thermal_weight: f64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            overlap_credit: 3.0,
            host_weight: 0.75,
            disk_weight: 0.25,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            temperature: 0.0,
            thermal_weight: 1.0,
        }
    }
}

impl Policy {
    /// Every weight finite and not negative: a negative weight would turn a
    /// cached prefix or a loaded rank into an attraction.
    pub fn validate(&self) -> Result<(), InvalidValue> {
        for (field, value) in [
            ("overlap_credit", self.overlap_credit),
            ("host_weight", self.host_weight),
            ("disk_weight", self.disk_weight),
            ("prefill_load_scale", self.prefill_load_scale),
            (
                "decode_active_request_weight",
                self.decode_active_request_weight,
            ),
            ("temperature", self.temperature),
            ("thermal_weight", self.thermal_weight),
        ] {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(InvalidValue {
                    field,
                    rule: "finite and not negative",
                    value,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_thresholds_keep_decode_within_the_cache_and_a_request_bound() {
        let t = Thresholds {
            active_decode_blocks: Some(0.8),
            active_prefill_tokens: Some(1000),
            active_prefill_tokens_frac: None,
            active_decode_requests: Some(8),
        };
        let w = t.scaled(1.5);
        assert_eq!(w.active_decode_blocks, Some(1.0));
        assert_eq!(w.active_prefill_tokens, Some(1500));
        assert_eq!(w.active_prefill_tokens_frac, None);
        assert_eq!(w.active_decode_requests, Some(12));
        let n = t.scaled(0.9);
        assert_eq!(n.active_prefill_tokens, Some(900));
        assert_eq!(n.active_decode_requests, Some(7));
        assert_eq!(t.scaled(0.01).active_decode_requests, Some(1));
        assert_eq!(
            Thresholds {
                active_decode_requests: Some(0),
                ..t
            }
            .validate()
            .unwrap_err()
            .field,
            "active_decode_requests_threshold"
        );
    }

    #[test]
    fn thresholds_validate_their_ranges() {
        let t = |d, f| Thresholds {
            active_decode_blocks: d,
            active_prefill_tokens_frac: f,
            ..Thresholds::default()
        };
        assert!(t(Some(0.0), Some(0.1)).validate().is_ok());
        assert!(t(Some(1.0), None).validate().is_ok());
        let e = t(Some(1.5), None).validate().unwrap_err();
        assert_eq!(e.field, "active_decode_blocks_threshold");
        assert_eq!(
            e.to_string(),
            "active_decode_blocks_threshold must be within [0, 1], got 1.5"
        );
        assert!(t(None, Some(0.0)).validate().is_err());
        assert!(t(None, Some(f64::INFINITY)).validate().is_err());
        assert!(t(Some(f64::NAN), None).validate().is_err());
    }

    #[test]
    fn overrides_replace_only_what_they_set() {
        let file = Thresholds {
            active_decode_requests: None,
            active_decode_blocks: Some(0.9),
            active_prefill_tokens: Some(100),
            active_prefill_tokens_frac: None,
        };
        let flags = Thresholds {
            active_decode_blocks: Some(0.5),
            ..Default::default()
        };
        assert_eq!(
            file.overridden_by(&flags),
            Thresholds {
                active_decode_requests: None,
                active_decode_blocks: Some(0.5),
                active_prefill_tokens: Some(100),
                active_prefill_tokens_frac: None,
            }
        );
    }

    #[test]
    fn a_patch_sets_unsets_and_keeps() {
        let now = Thresholds {
            active_decode_requests: None,
            active_decode_blocks: Some(0.9),
            active_prefill_tokens: Some(100),
            active_prefill_tokens_frac: Some(2.0),
        };
        let patch = ThresholdsPatch {
            active_decode_requests: None,
            active_decode_blocks: Some(Some(0.5)),
            active_prefill_tokens: Some(None),
            active_prefill_tokens_frac: None,
        };
        assert_eq!(
            now.patched(&patch),
            Thresholds {
                active_decode_requests: None,
                active_decode_blocks: Some(0.5),
                active_prefill_tokens: None,
                active_prefill_tokens_frac: Some(2.0),
            }
        );
        assert_eq!(now.patched(&ThresholdsPatch::default()), now);
        let some = Thresholds {
            active_prefill_tokens: None,
            ..now
        };
        assert_eq!(Thresholds::default().patched(&some.as_patch()), some);
    }

    #[cfg(feature = "serde")]
    #[test]
    fn a_patch_reads_dynamos_names_absent_null_or_set() {
        let p: ThresholdsPatch = serde_json::from_str(
            r#"{"active_decode_blocks_threshold": 0.5, "active_prefill_tokens_threshold": null}"#,
        )
        .unwrap();
        assert_eq!(
            p,
            ThresholdsPatch {
                active_decode_requests: None,
                active_decode_blocks: Some(Some(0.5)),
                active_prefill_tokens: Some(None),
                active_prefill_tokens_frac: None,
            }
        );
        for bad in [
            r#"{"active_decode_block_threshold": 0.5}"#,
            r#"{"active_prefill_tokens_threshold": -1}"#,
            r#"{"active_prefill_tokens_threshold_frac": "2"}"#,
        ] {
            assert!(
                serde_json::from_str::<ThresholdsPatch>(bad).is_err(),
                "{bad}"
            );
        }
        let set = Thresholds {
            active_prefill_tokens: Some(7),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&set.as_patch()).unwrap(),
            r#"{"active_prefill_tokens_threshold":7}"#,
            "unset conditions are left out"
        );
        let names = serde_json::to_value(Thresholds::default()).unwrap();
        for name in [
            Thresholds::DECODE_BLOCKS,
            Thresholds::PREFILL_TOKENS,
            Thresholds::PREFILL_TOKENS_FRAC,
        ] {
            assert!(names.get(name).is_some(), "{name}");
        }
    }

    #[test]
    fn policy_weights_must_be_finite_and_not_negative() {
        assert!(Policy::default().validate().is_ok());
        let bad = Policy {
            host_weight: -0.1,
            ..Policy::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "host_weight");
        let bad = Policy {
            temperature: f64::NAN,
            ..Policy::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "temperature");
    }

    #[test]
    fn in_a_split_model_each_role_is_judged_by_its_legs_conditions() {
        let all = Thresholds {
            active_decode_requests: None,
            active_decode_blocks: Some(0.9),
            active_prefill_tokens: Some(100),
            active_prefill_tokens_frac: Some(2.0),
        };
        assert_eq!(
            Role::Prefill.judged_by(all, true),
            Thresholds {
                active_decode_blocks: None,
                ..all
            }
        );
        assert_eq!(
            Role::Decode.judged_by(all, true),
            Thresholds {
                active_decode_blocks: Some(0.9),
                ..Default::default()
            }
        );
        assert_eq!(Role::Both.judged_by(all, true), all);
        for role in Role::ALL {
            assert_eq!(role.judged_by(all, false), all, "served whole: as before");
        }
    }

    #[test]
    fn a_model_splits_only_with_settings_and_both_specialised_roles() {
        let w = |role| WorkerState {
            role,
            ..Default::default()
        };
        let mut m = ModelState {
            workers: vec![w(Role::Prefill), w(Role::Both)],
            ..Default::default()
        };
        assert!(!splits([Role::Both, Role::Prefill]));
        assert!(splits([Role::Decode, Role::Both, Role::Prefill]));
        m.disaggregation = Some(Disaggregation::default());
        assert!(!m.disaggregated(), "no decode worker");
        m.workers.push(w(Role::Decode));
        assert!(m.disaggregated());
        m.disaggregation = None;
        assert!(!m.disaggregated(), "no settings");
    }

    #[test]
    fn disaggregation_settings_are_checked() {
        assert!(Disaggregation::default().validate().is_ok());
        let d = Disaggregation::default();
        assert_eq!(d.conditional, Conditional::default());
        assert_eq!(d.decode_affinity, Policy::default().overlap_credit);
        let bad = |f: fn(&mut Disaggregation)| {
            let mut d = Disaggregation::default();
            f(&mut d);
            d.validate().unwrap_err().field
        };
        assert_eq!(
            bad(|d| d.conditional.max_uncached_ratio = 1.5),
            "max_uncached_ratio"
        );
        assert_eq!(bad(|d| d.prefill_timeout_ms = 0), "prefill_timeout_ms");
        assert_eq!(bad(|d| d.decode_affinity = f64::NAN), "decode_affinity");
    }

    #[cfg(feature = "serde")]
    #[test]
    fn roles_and_protocols_have_their_configured_names() {
        for role in Role::ALL {
            assert_eq!(
                serde_json::to_value(role).unwrap(),
                serde_json::json!(role.as_str())
            );
        }
        for p in Protocol::ALL {
            assert_eq!(
                serde_json::to_value(p).unwrap(),
                serde_json::json!(p.as_str())
            );
        }
        let w: WorkerState = serde_json::from_str(
            r#"{"worker_id":1,"endpoint":"","block_size":16,"ranks":[],"tenant_id":"t"}"#,
        )
        .unwrap();
        assert_eq!(w.role, Role::Both, "a view without a role: both");
        assert_eq!(
            w.bootstrap_port, DEFAULT_BOOTSTRAP_PORT,
            "and SGLang's port"
        );
        let unset = WorkerState::default();
        assert_eq!(unset.bootstrap_port(), DEFAULT_BOOTSTRAP_PORT);
    }

    #[test]
    fn adapters_resolve_to_their_base_model() {
        let snap = Snapshot {
            models: vec![ModelState {
                name: "base".into(),
                lora_adapters: vec!["sql".into()],
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(snap.model("base").map(|m| m.name.as_str()), Some("base"));
        assert_eq!(snap.model("sql").map(|m| m.name.as_str()), Some("base"));
        assert!(snap.model("other").is_none());
    }
}
