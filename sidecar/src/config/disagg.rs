//! `[models.disaggregation]`: how a model splits prefill from decode.

use super::millis;
use kvgate_core::disagg::Conditional;
use kvgate_core::disagg::pull::Pull;
use kvgate_core::{Disaggregation, OnPrefillFailure, Policy, Protocol};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The table as written. The model's workers of role `prefill` and
/// `decode` serve the two legs; without one of each the model is served
/// whole, whatever the table says.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DisaggregationConfig {
    /// Required: the legs' bodies differ by engine, and a wrong guess
    /// fails every request.
    pub protocol: Protocol,
    /// The conditional rule: the decode worker computes the prompt when
    /// fewer than this many of its tokens are uncached there...
    #[serde(default = "default_max_uncached_tokens")]
    pub max_uncached_tokens: u64,
    /// ...and they are under this share of the prompt.
    #[serde(default = "default_max_uncached_ratio")]
    pub max_uncached_ratio: f64,
    #[serde(default)]
    pub on_prefill_failure: OnPrefillFailure,
    #[serde(
        rename = "prefill_timeout_ms",
        default = "default_prefill_timeout",
        with = "millis"
    )]
    pub prefill_timeout: Duration,
    /// Credit per cached block of the decode worker's own, when choosing
    /// it; absent, the model's `policy.overlap_credit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_affinity: Option<f64>,
    /// `[models.disaggregation.pull]`: on a model of `both` workers, a
    /// request may be prefilled on the worker holding its prefix and
    /// decoded on another that pulls the KV, when that costs less.
    /// Absent: never. Only `vllm-nixl` pulls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull: Option<Pull>,
}

fn default_max_uncached_tokens() -> u64 {
    Conditional::default().max_uncached_tokens
}

fn default_max_uncached_ratio() -> f64 {
    Conditional::default().max_uncached_ratio
}

fn default_prefill_timeout() -> Duration {
    Duration::from_millis(Disaggregation::default().prefill_timeout_ms)
}

impl DisaggregationConfig {
    /// The settings the snapshot carries, for a model priced by `policy`.
    pub fn resolve(&self, policy: &Policy) -> Disaggregation {
        Disaggregation {
            protocol: self.protocol,
            conditional: Conditional {
                max_uncached_tokens: self.max_uncached_tokens,
                max_uncached_ratio: self.max_uncached_ratio,
            },
            on_prefill_failure: self.on_prefill_failure,
            prefill_timeout_ms: u64::try_from(self.prefill_timeout.as_millis()).unwrap_or(u64::MAX),
            decode_affinity: self.decode_affinity.unwrap_or(policy.overlap_credit),
            pull: self.pull,
        }
    }
}
