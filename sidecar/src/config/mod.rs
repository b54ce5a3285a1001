//! The sidecar's configuration file (TOML) and the worker shape shared with
//! the `/workers` API.
//!
//! Every key is checked: unknown keys are errors (a typo must not silently
//! turn shedding off), and each error names the entry it is about.

//!
//! * `sections`: `[server]`, `[scrape]`, `[kv]`, `[load]`, `[control]`,
//!   `[selection]`, `[indexer]`.
//! * `worker`: `[[models]]` and `[[workers]]`, the latter also the shape
//!   of `POST /workers`.
//! * `disagg`: `[models.disaggregation]`, prefill/decode disaggregation.
//! * `ledger`: `[load.caps]`, the load ledger's holder caps.
//! * `thermal`: `[thermal]`, GPU readings and the thermal controller's
//!   settings (overridden per model by `[models.thermal]`).
//!
//! Durations are written in whole milliseconds under keys ending in `_ms`,
//! and read into [`std::time::Duration`]s (`millis`).

mod disagg;
mod ledger;
pub(crate) mod millis;
mod planner;
mod sections;
#[cfg(test)]
mod tests;
mod thermal;
mod worker;

pub use disagg::DisaggregationConfig;
pub use ledger::{LEDGER_HOLDERS_CEILING, LedgerCaps};
pub use planner::{
    FleetPlanner, PlannerConfig, PoolBounds, PoolConfig, PredictorKind, ProfileRow, read_trace,
};
pub use sections::{
    Control, DEFAULT_VM_SILENCE, Indexer, Kv, LONGEST_LONG_POLL, ListenerLimits, Load, ReplicaSync,
    Scrape, Selection, Server, validate_peer,
};
pub use thermal::{EvictPolicy, MIN_HYSTERESIS_C, Thermal, ThermalOverride, ThermalSettings};
pub use worker::{DEFAULT_MAX_PROMPT_TOKENS, MAX_PROMPT_TOKENS_CEILING, ModelConfig, WorkerSpec};

use kvgate_core::Thresholds;
use serde::Deserialize;
use std::collections::BTreeSet;
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
    pub selection: Selection,
    #[serde(default)]
    pub replica_sync: ReplicaSync,
    #[serde(default)]
    pub indexer: Indexer,
    #[serde(default)]
    pub thermal: Thermal,
    /// `[planner]`: what the planner weighs across models.
    #[serde(default)]
    pub planner: FleetPlanner,
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    #[serde(default)]
    pub workers: Vec<WorkerSpec>,
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
        self.replica_sync.validate()?;
        self.server.validate()?;
        self.selection.limits().validate("selection")?;
        let mut names = BTreeSet::new();
        for m in &self.models {
            if !names.insert(m.name.clone()) {
                return Err(format!("model {:?} is listed twice", m.name));
            }
            m.thresholds
                .validate()
                .map_err(|e| format!("model {:?}: {e}", m.name))?;
            if !(1..=MAX_PROMPT_TOKENS_CEILING).contains(&m.max_prompt_tokens) {
                return Err(format!(
                    "model {:?}: max_prompt_tokens must be within [1, {MAX_PROMPT_TOKENS_CEILING}], got {}",
                    m.name, m.max_prompt_tokens
                ));
            }
            m.policy
                .validate()
                .map_err(|e| format!("model {:?}: policy: {e}", m.name))?;
            self.thermal_settings(m)
                .validate()
                .map_err(|e| format!("model {:?}: thermal: {e}", m.name))?;
            if let Some(d) = &m.disaggregation {
                d.resolve(&m.policy)
                    .validate()
                    .map_err(|e| format!("model {:?}: disaggregation: {e}", m.name))?;
                if d.pull.is_some() && d.protocol != kvgate_core::Protocol::VllmNixl {
                    return Err(format!(
                        "model {:?}: disaggregation.pull needs protocol \"vllm-nixl\": only NIXL's decode worker pulls KV named in its body",
                        m.name
                    ));
                }
            }
            if let Some(p) = &m.planner {
                p.validate()
                    .map_err(|e| format!("model {:?}: planner: {e}", m.name))?;
            }
            if m.slo.is_some_and(|s| s.ttft_ms == 0 || s.itl_ms == 0) {
                return Err(format!(
                    "model {:?}: slo: ttft_ms and itl_ms must be above 0",
                    m.name
                ));
            }
        }
        self.thermal.validate()?;
        if self
            .planner
            .power_budget_w
            .is_some_and(|w| !(w.is_finite() && w > 0.0))
        {
            return Err("planner: power_budget_w must be above 0".into());
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
        if self.scrape.interval.is_zero() || self.scrape.timeout.is_zero() {
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
        // Below one frame, a replay holding the largest batch would never
        // go through.
        if self.kv.max_replay_bytes < self.kv.max_message_bytes {
            return Err(format!(
                "kv.max_replay_bytes must be at least kv.max_message_bytes ({}), got {}",
                self.kv.max_message_bytes, self.kv.max_replay_bytes
            ));
        }
        if self.load.booking_ttl.is_zero() || self.load.max_retry_after_s == 0 {
            return Err("load.booking_ttl_ms and load.max_retry_after_s must be above 0".into());
        }
        self.load.caps.validate()?;
        self.validate_indexer()
    }

    fn validate_indexer(&self) -> Result<(), String> {
        let ix = &self.indexer;
        if ix.timeout.is_zero() || ix.max_dump_bytes == 0 {
            return Err("indexer.timeout_ms and indexer.max_dump_bytes must be above 0".into());
        }
        for p in &ix.peers {
            // The client speaks plain HTTP; a path would be dropped when
            // `/dump` is appended, so none is taken.
            let ok = p.parse::<hyper::Uri>().is_ok_and(|u| {
                u.scheme_str() == Some("http")
                    && u.authority().is_some()
                    && matches!(u.path(), "" | "/")
                    && u.query().is_none()
            });
            if !ok {
                return Err(format!(
                    "indexer.peers: {p:?} is not an http://host:port URL"
                ));
            }
        }
        Ok(())
    }

    /// The thermal controller's settings for a model's workers.
    pub fn thermal_settings(&self, m: &ModelConfig) -> ThermalSettings {
        ThermalSettings::default().with(&self.thermal.settings.and(&m.thermal))
    }

    /// Replaces `indexer.peers` (the `--indexer-peers` flag beats the file).
    pub fn set_indexer_peers(&mut self, peers: Vec<String>) -> Result<(), ConfigError> {
        self.indexer.peers = peers
            .into_iter()
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect();
        self.validate_indexer().map_err(ConfigError::Invalid)
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
        if let Some(p) = &self.thermal.batch_token_file {
            let t = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                path: p.display().to_string(),
                source,
            })?;
            let t = t.trim();
            if t.is_empty() {
                return Err(ConfigError::Invalid(
                    "thermal.batch_token_file is empty".into(),
                ));
            }
            self.thermal.batch_token = Some(t.to_string());
        }
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
