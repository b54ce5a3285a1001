//! The JSON bodies of the HTTP API, as types: the handlers serialize them,
//! `kvgate-sidecar status` and tests deserialize them.

mod thermal;

pub use thermal::{
    GpuView, ThermalChange, ThermalChangeView, ThermalEffect, ThermalList, WorkerThermal,
};

use crate::config::WorkerSpec;
use crate::fleet::WorkerEntry;
use kvgate_core::{ModelState, Snapshot, Thresholds, ThresholdsPatch, WorkerState};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `GET /v1/state`: the current snapshot, for people and tests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateView {
    pub version: u64,
    pub built_at_ms: u64,
    pub epoch: u64,
    pub models: Vec<ModelView>,
    /// Requests refused 401 (no or wrong control token) per route since
    /// start; absent when none. A count under `/v1/bookings` is a filter
    /// whose `sidecar_token` does not match: routing without its bookings.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unauthorized: BTreeMap<String, u64>,
}

/// One model in [`StateView`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelView {
    pub name: String,
    /// All three, `null` when unset.
    pub thresholds: Thresholds,
    pub shard_count: u32,
    pub retry_after_s: u32,
    /// Requests the model completes per second: the pace of retry places
    /// (absent from older sidecars' answers).
    #[serde(default)]
    pub service_rate_per_s: f64,
    pub mode: Mode,
    /// Only the workers that are up.
    pub workers: Vec<WorkerState>,
    /// The planner's replicas for the model; absent without a planner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<kvgate_core::ModelPlan>,
    /// Its `[models.disaggregation]` as routers apply it; absent when it
    /// has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<kvgate_core::Disaggregation>,
    /// Whether its requests are split now: settings, and a prefill and a
    /// decode worker up; absent when not, so a model served whole keeps
    /// its shape.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disaggregated: bool,
    /// The latencies its requests should see, which its workers' `fits`
    /// are checked against; absent when it has no target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<kvgate_core::Slo>,
    /// What each tenant has booked on it, every gateway's bookings alike
    /// (at most 64 tenants, the largest shares); absent when nothing is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<kvgate_core::TenantLoad>,
}

/// Which prefix index a model's requests are placed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// Token prompts use the engines' events, since the model's workers
    /// publish them; text prompts the index learned from routing decisions.
    #[serde(rename = "precise for token prompts, approximate for text")]
    Precise,
    /// Only the index learned from routing decisions.
    #[serde(rename = "approximate")]
    Approximate,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Precise => "precise for token prompts, approximate for text",
            Mode::Approximate => "approximate",
        }
    }
}

impl StateView {
    pub fn new(s: &Snapshot, epoch: u64) -> StateView {
        StateView {
            version: s.version,
            built_at_ms: s.built_at_ms,
            epoch,
            models: s.models.iter().map(ModelView::from).collect(),
            unauthorized: BTreeMap::new(),
        }
    }
}

impl From<&ModelState> for ModelView {
    fn from(m: &ModelState) -> ModelView {
        ModelView {
            name: m.name.clone(),
            thresholds: m.thresholds,
            shard_count: m.shard_count,
            retry_after_s: m.retry_after_s,
            service_rate_per_s: m.service_rate_per_s,
            plan: (m.plan != kvgate_core::ModelPlan::default()).then_some(m.plan),
            mode: if m.shard_count > 0 {
                Mode::Precise
            } else {
                Mode::Approximate
            },
            workers: m.workers.clone(),
            disaggregation: m.disaggregation,
            disaggregated: m.disaggregated(),
            slo: (m.slo != kvgate_core::Slo::default()).then_some(m.slo),
            tenants: m.tenants.clone(),
        }
    }
}

/// A worker as `/workers` shows it: its registration, its status and the
/// slots of its ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerView {
    #[serde(flatten)]
    pub spec: WorkerSpec,
    /// Dynamo's catalog states: `schedulable` (selections may choose it),
    /// `incomplete` (not scraped successfully yet), `unschedulable` (its
    /// scrapes stopped succeeding).
    pub lifecycle: String,
    pub status: WorkerStatus,
    pub slots: Vec<u16>,
}

/// A worker's scrape health in [`WorkerView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub up: bool,
    pub last_error: Option<String>,
    pub scrapes: u64,
    pub scrape_errors: u64,
}

impl From<&WorkerEntry> for WorkerView {
    fn from(w: &WorkerEntry) -> WorkerView {
        let lifecycle = match (w.health().up, w.health().scrapes > w.health().scrape_errors) {
            (true, _) => "schedulable",
            (false, false) => "incomplete",
            (false, true) => "unschedulable",
        };
        WorkerView {
            spec: w.spec().clone(),
            lifecycle: lifecycle.into(),
            status: WorkerStatus {
                up: w.health().up,
                last_error: w.health().last_error.clone(),
                scrapes: w.health().scrapes,
                scrape_errors: w.health().scrape_errors,
            },
            slots: w.slots().to_vec(),
        }
    }
}

/// `GET /workers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerList {
    pub workers: Vec<WorkerView>,
}

/// One model's thresholds in Dynamo's `busy_threshold` shape: unset ones
/// are left out, not `null`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelThresholds {
    pub model: String,
    /// Only the conditions set ([`Thresholds::as_patch`]).
    #[serde(flatten)]
    pub thresholds: ThresholdsPatch,
}

impl ModelThresholds {
    pub fn new(model: &str, t: &Thresholds) -> ModelThresholds {
        ModelThresholds {
            model: model.to_string(),
            thresholds: t.as_patch(),
        }
    }
}

/// `GET /busy_threshold`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThresholdsList {
    pub thresholds: Vec<ModelThresholds>,
}

/// `GET /health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthView {
    pub status: String,
}

/// `GET /ready` with a schedulable worker (200).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadyView {
    pub status: String,
    pub workers_up: usize,
}

/// `GET /ready` without one (503): why each worker is not schedulable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotReadyView {
    pub status: String,
    pub reason: String,
    pub workers: Vec<NotReadyWorker>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotReadyWorker {
    pub worker_id: u64,
    pub reason: String,
}

/// Every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorView {
    pub error: String,
}

/// `POST /select`: Dynamo's selection request. The prompt is given one
/// way: `sequence_hashes` (or `block_hashes`, chained here) at the
/// workers' block size with `isl_tokens`, or `token_ids`, or `text`,
/// which kvgate hashes itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection_id: Option<String>,
    /// `/select_and_reserve` only: the reservation's id, generated when
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
    #[serde(default = "default_scope")]
    pub model_name: String,
    #[serde(default = "default_scope")]
    pub tenant_id: String,
    #[serde(flatten)]
    pub prompt: Prompt,
    /// Dynamo's: only these workers may be chosen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_worker_ids: Option<Vec<u64>>,
    /// Dynamo's: this worker and rank or none (503 when it is busy or down).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_worker: Option<PinnedWorker>,
    /// Dynamo's: the output it expects; `/select_and_reserve` books its
    /// blocks as decode load. At most the model's `max_prompt_tokens`.
    #[serde(
        default,
        deserialize_with = "output_tokens",
        skip_serializing_if = "Option::is_none"
    )]
    pub expected_output_tokens: Option<u64>,
    /// Dynamo's scheduler knobs, accepted so its clients work unchanged.
    /// `priority_jump` and `strict_priority` pick the request's class
    /// ([`SelectRequest::critical`]); the others are not applied:
    /// kvgate's cost is the model's `[models.policy]`. The answer names
    /// those a request set ([`SelectRequest::not_applied`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_config_override: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_jump: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict_priority: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_constraints: Option<serde_json::Value>,
    /// Refused by [`parse`]; declared after the flattened prompt, so it
    /// holds only what that did not take.
    #[serde(flatten)]
    pub unknown: Unknown,
}

impl SelectRequest {
    /// Whether the request's class may use the share of the busy
    /// thresholds reserved for critical work, as its Dynamo priority
    /// fields say (`kvgate_core::admit::dynamo_reserve`).
    pub fn critical(&self) -> bool {
        let tier = self.strict_priority.as_ref().and_then(|v| v.as_i64());
        let jump = self.priority_jump.as_ref().and_then(|v| v.as_f64());
        kvgate_core::admit::dynamo_reserve(tier, jump)
    }

    /// The names of Dynamo's scheduler knobs this request set that
    /// kvgate does not apply; `null` is not set.
    pub fn not_applied(&self) -> Vec<&'static str> {
        [
            ("router_config_override", &self.router_config_override),
            ("routing_constraints", &self.routing_constraints),
        ]
        .into_iter()
        .filter(|(_, v)| v.as_ref().is_some_and(|v| !v.is_null()))
        .map(|(name, _)| name)
        .collect()
    }
}

/// A worker and DP rank, as Dynamo names one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinnedWorker {
    pub worker_id: u64,
    #[serde(default)]
    pub dp_rank: u32,
}

/// The prompt fields of a selection-API body, flattened into each.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prompt {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_hashes: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_hashes: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isl_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// vLLM's `cache_salt`, for `token_ids` and `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
}

impl Prompt {
    /// Whether the body gave a prompt in any form (an ISL alone is none).
    pub fn given(&self) -> bool {
        self.block_hashes.is_some()
            || self.sequence_hashes.is_some()
            || self.token_ids.is_some()
            || self.text.is_some()
    }
}

/// The fields of a body that no field of its type took. serde's
/// `deny_unknown_fields` does not work beside `flatten`, so a body that
/// flattens [`Prompt`] collects the rest here, and [`parse`] refuses it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Unknown(std::collections::BTreeMap<String, serde_json::Value>);

/// A body that flattens [`Prompt`], with what else it was sent.
pub trait WithPrompt: serde::de::DeserializeOwned {
    fn unknown(&self) -> &Unknown;
}

impl WithPrompt for SelectRequest {
    fn unknown(&self) -> &Unknown {
        &self.unknown
    }
}

impl WithPrompt for ReservationRequest {
    fn unknown(&self) -> &Unknown {
        &self.unknown
    }
}

/// Reads `expected_output_tokens` as any whole number of tokens, so that
/// one too large to book is refused by the model's bound, which names the
/// field and the bound (`within_bound`). Read as a `u32`, a larger number
/// failed in the decoder, whose errors inside a flattened body name
/// neither. Past `u64` (which JSON parsers read as a float) it saturates;
/// a negative or fractional count is refused here, naming the field.
fn output_tokens<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    use serde::de::{Error, Visitor};

    struct Tokens;

    impl<'de> Visitor<'de> for Tokens {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("expected_output_tokens as a whole number of tokens")
        }

        fn visit_none<E: Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<Self::Value, E> {
            u64::try_from(v)
                .map(Some)
                .map_err(|_| E::custom(format!("expected_output_tokens {v} is negative")))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<Self::Value, E> {
            if v >= 0.0 && v.fract() == 0.0 {
                // `as` saturates at u64::MAX, which the bound then refuses.
                Ok(Some(v as u64))
            } else {
                Err(E::custom(format!(
                    "expected_output_tokens {v} is not a whole number of tokens"
                )))
            }
        }
    }

    d.deserialize_option(Tokens)
}

/// Parses a selection-API body, refusing fields its type does not have
/// as `deny_unknown_fields` would.
pub fn parse<T: WithPrompt>(body: &[u8]) -> Result<T, String> {
    let t: T = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    match t.unknown().0.keys().next() {
        None => Ok(t),
        Some(name) => Err(format!("unknown field `{name}`")),
    }
}

fn default_scope() -> String {
    kvgate_core::DEFAULT_TENANT.to_string()
}

/// The answer to `POST /select`, in Dynamo's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectionView {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
    pub model_name: String,
    pub tenant_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
    pub block_size: u32,
    pub overlap: OverlapView,
    /// The prefill load the request books there: its prompt minus the
    /// prefix resident on the device, as the filter books it (0 on a
    /// decode worker that a prefill worker computes the prompt for).
    pub effective_prefill_tokens: u64,
    /// On a disaggregated model, both legs; absent on a model served
    /// whole. The worker above is the decode worker: the one the client
    /// sends its request to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<SplitView>,
    /// On a model that pulls, which of its three placements this is; a
    /// pull names both legs in `disaggregation` (the prefill leg on the
    /// holder). Absent on other models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementView>,
    /// The request's class: `critical` (Dynamo's first tier, or a jump
    /// ahead), which may use the reserved share of the busy thresholds,
    /// or `standard`.
    pub class: String,
    /// The request's scheduler knobs that kvgate accepted and did not
    /// apply (`router_config_override`, `routing_constraints`); absent
    /// when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_applied: Vec<String>,
}

/// Where a request of a model that pulls goes, as
/// `kvgate_core::disagg::pull::Placed` says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementView {
    /// `holder`, `recompute` or `pull`.
    pub kind: String,
    /// A pull's blocks moved; a recompute's cached blocks computed again.
    pub blocks: u64,
    /// A pull's transfer time alone on its link, in microseconds.
    pub transfer_us: u64,
}

/// The two legs of a disaggregated selection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitView {
    pub decode: LegView,
    /// Where the prompt is computed first; `null` when the decode worker
    /// computes it itself.
    pub prefill: Option<LegView>,
    /// The prefill leg is skipped: the request goes to the decode worker
    /// whole.
    pub local_prefill: bool,
    /// Why: `conditional` (the decode worker holds enough of the prompt),
    /// `same_worker` (the best prefill worker is the decode worker) or
    /// `no_prefill_worker` (none free, and `on_prefill_failure` is
    /// `local`), as `kvgate_core::dispatch::WholeWhy` names them; `null`
    /// with a prefill leg.
    pub local_reason: Option<String>,
}

/// One leg of a disaggregated selection and the load it books.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegView {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
    pub effective_prefill_tokens: u64,
    pub decode_blocks: u64,
    /// `/select_and_reserve`: the reservation holding this leg's load. A
    /// prefill leg's is its own (free it when the leg answers); a decode
    /// leg's is the answer's `reservation_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
}

/// Matched tokens of the selected worker as the engines' events report
/// them, cumulative over tiers (a block on the GPU counts for CPU and
/// disk too); `dp` is the GPU overlap of each of its ranks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapView {
    pub longest_matched: u64,
    pub gpu: u64,
    pub dp: std::collections::BTreeMap<String, u64>,
    pub cpu: u64,
    pub disk: u64,
}

/// `POST /reservations`: load booked on a worker the client chose (after
/// `POST /select`), in Dynamo's shape. The prompt is optional: with one,
/// the prefill booked is what the worker's cache does not hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
    #[serde(default = "default_scope")]
    pub model_name: String,
    #[serde(default = "default_scope")]
    pub tenant_id: String,
    pub worker_id: u64,
    /// Required when the worker has several ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    #[serde(flatten)]
    pub prompt: Prompt,
    /// Authoritative when given (`/select`'s answer); at most the ISL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_prefill_tokens: Option<u64>,
    /// Dynamo's: its blocks are booked as decode load. At most the
    /// model's `max_prompt_tokens`.
    #[serde(
        default,
        deserialize_with = "output_tokens",
        skip_serializing_if = "Option::is_none"
    )]
    pub expected_output_tokens: Option<u64>,
    /// Refused by [`parse`]; declared after the flattened prompt, so it
    /// holds only what that did not take.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// A reservation as booked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationView {
    pub reservation_id: String,
    pub model_name: String,
    pub tenant_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub effective_prefill_tokens: u64,
    pub decode_blocks: u64,
}

/// `POST /reservations/{id}/output_block`; the body may be empty.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputBlockRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decay_fraction: Option<f64>,
}

/// `GET /loads`: the load each rank carries now, per model and tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadsView {
    pub models: Vec<ModelLoadView>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelLoadView {
    pub model_name: String,
    pub tenant_id: String,
    pub workers: Vec<RankLoadView>,
}

/// One rank's load: what the ledger has booked there (this gateway's
/// requests, reservations and peers' admissions) and what its engine says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLoadView {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    pub running: u32,
    pub waiting: u32,
    pub busy: bool,
}

/// `POST /potential_loads`: each rank's load if the prompt went there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PotentialLoadsView {
    pub model_name: String,
    pub tenant_id: String,
    pub loads: Vec<PotentialLoadView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PotentialLoadView {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
}

/// `POST /overlap_scores`: matched tokens per rank and tier, cumulative
/// over tiers as in [`OverlapView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapScoresView {
    pub model_name: String,
    pub tenant_id: String,
    pub block_size: u32,
    pub scores: Vec<OverlapRowView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapRowView {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub longest_matched: u64,
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
}

/// `POST /replica_sync/register_peer` and `/deregister_peer`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerRequest {
    pub endpoint: String,
}

/// `GET /replica_sync/peers`: sorted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeersView {
    pub peers: Vec<String>,
    /// Each peer's connection and traffic, in the same order.
    #[serde(default)]
    pub state: Vec<PeerStateView>,
}

/// One replica-sync peer as the receiving thread last saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerStateView {
    pub endpoint: String,
    /// The connection is up (its handshake done).
    pub connected: bool,
    /// Since the last message; absent before the first.
    pub last_message_age_ms: Option<u64>,
    pub messages: u64,
    /// Messages refused whole (malformed, another version, unsigned).
    pub messages_refused: u64,
    /// Admissions refused because their message was seen already: a
    /// replay, or a peer re-sending.
    #[serde(default)]
    pub admissions_replayed: u64,
    /// Admissions refused because their message was sent longer ago
    /// than `replica_sync.max_message_age_ms`.
    #[serde(default)]
    pub admissions_stale: u64,
    /// Times the connection was lost and started over (an oversized
    /// frame is one such loss).
    pub reconnects: u64,
}

impl PeersView {
    pub fn of(r: &crate::replica::ReplicaSync) -> PeersView {
        let state: Vec<PeerStateView> = r
            .peer_status()
            .into_iter()
            .map(|s| PeerStateView {
                last_message_age_ms: s
                    .last_message_age
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                endpoint: s.endpoint,
                connected: s.connected,
                messages: s.messages,
                messages_refused: s.refused,
                admissions_replayed: s.admissions_replayed,
                admissions_stale: s.admissions_stale,
                reconnects: s.reconnects,
            })
            .collect();
        PeersView {
            peers: state.iter().map(|s| s.endpoint.clone()).collect(),
            state,
        }
    }
}
