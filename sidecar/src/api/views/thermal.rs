//! The bodies of `GET/POST /v1/admin/thermal`.

use crate::config::{EvictPolicy, ThermalOverride, ThermalSettings};
use kvgate_core::ThermalState;
use serde::{Deserialize, Serialize};

/// `GET /v1/admin/thermal`: every worker's heat and what its controller
/// does about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThermalList {
    pub workers: Vec<WorkerThermal>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerThermal {
    pub worker_id: u64,
    pub model_name: String,
    pub state: ThermalState,
    /// 0 cool to 1 at the target: how much dearer new work finds it.
    pub heat: f64,
    /// Most requests in flight while throttling; 0 is no cap.
    pub cap: u32,
    pub in_flight: u32,
    /// Running on the engine, its ranks summed.
    pub running: u32,
    /// The hottest fresh GPU, the worker's temperature; null when none is
    /// fresh.
    pub temperature_c: Option<f64>,
    pub hottest_gpu: Option<String>,
    /// The fresh GPUs' power, summed.
    pub power_w: Option<f64>,
    /// Power ÷ running sequences (the seed's §7): what a cut saves.
    pub watts_per_running_seq: Option<f64>,
    pub throttle_entries: u64,
    /// What the controller runs with: file, model, then worker overrides.
    pub settings: ThermalSettings,
    pub gpus: Vec<GpuView>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuView {
    pub uuid: String,
    pub temperature_c: f64,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub slowdown_c: Option<f64>,
    pub shutdown_c: Option<f64>,
    /// A thermal or hardware clock slowdown is on.
    pub slowing: bool,
    /// Since the reading was taken.
    pub age_ms: u64,
}

/// `POST /v1/admin/thermal`: new settings for one model's workers or for
/// one worker; unset fields are kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThermalChange {
    #[serde(default)]
    pub model_name: Option<String>,
    #[serde(default)]
    pub worker_id: Option<u64>,
    #[serde(default)]
    pub target_c: Option<f64>,
    #[serde(default)]
    pub hysteresis_c: Option<f64>,
    #[serde(default)]
    pub gain: Option<f64>,
    #[serde(default)]
    pub integral_s: Option<f64>,
    #[serde(default)]
    pub warm_band_c: Option<f64>,
    #[serde(default)]
    pub policy: Option<EvictPolicy>,
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Answer what the change would do, and change nothing.
    #[serde(default)]
    pub dry_run: bool,
}

impl ThermalChange {
    pub fn settings(&self) -> ThermalOverride {
        ThermalOverride {
            target_c: self.target_c,
            hysteresis_c: self.hysteresis_c,
            gain: self.gain,
            integral_s: self.integral_s,
            warm_band_c: self.warm_band_c,
            policy: self.policy,
            enabled: self.enabled,
        }
    }
}

/// What a change does (or, dry, would do) to each worker it touches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThermalChangeView {
    pub dry_run: bool,
    pub workers: Vec<ThermalEffect>,
    /// Running sequences the new caps would cut, times each worker's
    /// watts per running sequence; negative when caps are raised.
    pub estimated_watts_saved: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThermalEffect {
    pub worker_id: u64,
    pub state: ThermalState,
    pub cap: u32,
    pub new_state: ThermalState,
    pub new_cap: u32,
    pub running: u32,
    pub settings: ThermalSettings,
}
