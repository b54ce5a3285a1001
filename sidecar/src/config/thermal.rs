//! `[thermal]`: where GPU readings come from, and the controller's
//! settings with their per-model overrides (`[models.thermal]`) and
//! per-worker ones (`POST /v1/admin/thermal`).

use super::millis;
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Thermal {
    /// dcgm-exporter pages (or `kvgate-sidecar agent`), scraped every
    /// interval; GPUs are matched to workers by UUID or labels.
    #[serde(default)]
    pub dcgm_urls: Vec<String>,
    /// Read the GPUs of this node through NVML as well.
    #[serde(default)]
    pub nvml: bool,
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
    /// A reading older than this is unknown, not cool.
    #[serde(
        rename = "stale_after_ms",
        default = "default_stale_after",
        deserialize_with = "millis::deserialize"
    )]
    pub stale_after: Duration,
    /// A worker's cap changes at most this often, except downwards when a
    /// GPU reports a slowdown.
    #[serde(
        rename = "min_change_interval_ms",
        default = "default_min_change",
        deserialize_with = "millis::deserialize"
    )]
    pub min_change_interval: Duration,
    /// The bearer token engines' `POST /v1/admin/batch` takes, one line.
    /// It is sent only to workers' own endpoints (`batch_control = true`).
    #[serde(default)]
    pub batch_token_file: Option<std::path::PathBuf>,
    /// Read from `batch_token_file` at load time.
    #[serde(skip)]
    pub batch_token: Option<String>,
    /// The controller's settings for every model that does not override
    /// them.
    #[serde(flatten)]
    pub settings: ThermalOverride,
}

impl Default for Thermal {
    fn default() -> Self {
        Thermal {
            dcgm_urls: Vec::new(),
            nvml: false,
            interval: default_interval(),
            timeout: default_timeout(),
            stale_after: default_stale_after(),
            min_change_interval: default_min_change(),
            batch_token_file: None,
            batch_token: None,
            settings: ThermalOverride::default(),
        }
    }
}

impl Thermal {
    pub(super) fn validate(&self) -> Result<(), String> {
        if self.interval.is_zero() || self.timeout.is_zero() || self.stale_after.is_zero() {
            return Err(
                "thermal.interval_ms, timeout_ms and stale_after_ms must be above 0".into(),
            );
        }
        for u in &self.dcgm_urls {
            let ok = u
                .parse::<hyper::Uri>()
                .is_ok_and(|u| u.scheme_str() == Some("http") && u.authority().is_some());
            if !ok {
                return Err(format!("thermal.dcgm_urls: {u:?} is not an http:// URL"));
            }
        }
        ThermalSettings::default()
            .with(&self.settings)
            .validate()
            .map_err(|e| format!("thermal: {e}"))
    }
}

/// Which running sequences an engine evicts first (the seed's
/// `/v1/admin/batch` `policy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictPolicy {
    #[default]
    Lru,
    LargestKv,
    LowestPriority,
}

/// The controller's settings for one worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ThermalSettings {
    /// Throttling starts at or above this temperature of the hottest GPU.
    pub target_c: f64,
    /// ...and ends below `target_c - hysteresis_c` (at least 2 °C).
    pub hysteresis_c: f64,
    /// Requests taken off the cap per °C over the target.
    pub gain: f64,
    /// The integral term's time: over the target by 1 °C for this long
    /// takes `gain` more requests off the cap; 0 turns it off.
    pub integral_s: f64,
    /// Under the target by less than this, a worker is warm: priced up,
    /// not capped.
    pub warm_band_c: f64,
    /// What the engine evicts first when its batch is cut.
    pub policy: EvictPolicy,
    /// Whether the controller may act: off, it still reads and reports.
    pub enabled: bool,
}

impl Default for ThermalSettings {
    fn default() -> Self {
        // Below an H100's slowdown (around 87 °C) by enough that a P
        // controller's overshoot does not reach it.
        ThermalSettings {
            target_c: 82.0,
            hysteresis_c: 3.0,
            gain: 2.0,
            integral_s: 5.0,
            warm_band_c: 8.0,
            policy: EvictPolicy::Lru,
            enabled: true,
        }
    }
}

/// The least hysteresis the controller takes: with less, a GPU hovering at
/// its target enters and leaves throttling with every reading.
pub const MIN_HYSTERESIS_C: f64 = 2.0;

impl ThermalSettings {
    /// `self` with what `over` sets replaced.
    pub fn with(self, over: &ThermalOverride) -> ThermalSettings {
        ThermalSettings {
            target_c: over.target_c.unwrap_or(self.target_c),
            hysteresis_c: over.hysteresis_c.unwrap_or(self.hysteresis_c),
            gain: over.gain.unwrap_or(self.gain),
            integral_s: over.integral_s.unwrap_or(self.integral_s),
            warm_band_c: over.warm_band_c.unwrap_or(self.warm_band_c),
            policy: over.policy.unwrap_or(self.policy),
            enabled: over.enabled.unwrap_or(self.enabled),
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.target_c.is_finite() && (20.0..=95.0).contains(&self.target_c)) {
            return Err(format!(
                "target_c must be within [20, 95], got {}",
                self.target_c
            ));
        }
        if !(self.hysteresis_c.is_finite()
            && (MIN_HYSTERESIS_C..=20.0).contains(&self.hysteresis_c))
        {
            return Err(format!(
                "hysteresis_c must be within [{MIN_HYSTERESIS_C}, 20], got {}",
                self.hysteresis_c
            ));
        }
        if !(self.gain.is_finite() && self.gain >= 0.0 && self.gain <= 1000.0) {
            return Err(format!("gain must be within [0, 1000], got {}", self.gain));
        }
        if !(self.integral_s.is_finite() && (0.0..=3600.0).contains(&self.integral_s)) {
            return Err(format!(
                "integral_s must be within [0, 3600], got {}",
                self.integral_s
            ));
        }
        if !(self.warm_band_c.is_finite() && self.warm_band_c > 0.0 && self.warm_band_c <= 50.0) {
            return Err(format!(
                "warm_band_c must be within (0, 50], got {}",
                self.warm_band_c
            ));
        }
        Ok(())
    }
}

/// Settings a model or a worker overrides; unset fields inherit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ThermalOverride {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_c: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hysteresis_c: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gain: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integral_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_band_c: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<EvictPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}

impl ThermalOverride {
    /// `self` with what `over` sets replaced.
    pub fn and(self, over: &ThermalOverride) -> ThermalOverride {
        ThermalOverride {
            target_c: over.target_c.or(self.target_c),
            hysteresis_c: over.hysteresis_c.or(self.hysteresis_c),
            gain: over.gain.or(self.gain),
            integral_s: over.integral_s.or(self.integral_s),
            warm_band_c: over.warm_band_c.or(self.warm_band_c),
            policy: over.policy.or(self.policy),
            enabled: over.enabled.or(self.enabled),
        }
    }
}

fn default_interval() -> Duration {
    Duration::from_millis(1000)
}
fn default_timeout() -> Duration {
    Duration::from_millis(800)
}
/// Several missed readings: one late scrape is not an outage.
fn default_stale_after() -> Duration {
    Duration::from_millis(5000)
}
fn default_min_change() -> Duration {
    Duration::from_millis(2000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_layer_and_validate() {
        let model = ThermalOverride {
            target_c: Some(80.0),
            gain: Some(2.0),
            ..Default::default()
        };
        let worker = ThermalOverride {
            target_c: Some(78.0),
            ..Default::default()
        };
        let s = ThermalSettings::default().with(&model.and(&worker));
        assert_eq!((s.target_c, s.gain, s.hysteresis_c), (78.0, 2.0, 3.0));
        let off = ThermalSettings {
            integral_s: -1.0,
            ..s
        };
        assert!(off.validate().is_err());
        assert!(s.validate().is_ok());
        let narrow = ThermalSettings {
            hysteresis_c: 1.5,
            ..s
        };
        assert!(
            narrow.validate().unwrap_err().contains("hysteresis_c"),
            "under 2 °C it would flap"
        );
        let hot = ThermalSettings {
            target_c: 99.0,
            ..s
        };
        assert!(hot.validate().is_err());
        let nan = ThermalSettings {
            gain: f64::NAN,
            ..s
        };
        assert!(nan.validate().is_err());
    }
}
