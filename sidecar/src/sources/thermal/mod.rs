//! GPU temperatures and power, from wherever a cluster has them:
//!
//! * [`dcgm`]: NVIDIA dcgm-exporter's Prometheus page (or kvgate's own
//!   node agent, which serves the same names), scraped over HTTP;
//! * [`nvml`]: the GPUs of this node, read through NVML;
//! * [`agent`]: `kvgate-sidecar agent`, which serves a GPU node's NVML
//!   readings under dcgm-exporter's names, for clusters without it.
//!
//! Each yields [`GpuReading`]s keyed by GPU UUID, the name workers give
//! their GPUs in the catalog. What is made of them is `crate::fleet`'s.

pub mod agent;
pub mod dcgm;
pub mod nvml;

use std::collections::BTreeMap;
use thiserror::Error;

/// NVML's clock event reasons that mean the GPU is slowing itself down for
/// heat or power trouble (not idle, not an application clock setting).
pub const HW_SLOWDOWN: u64 = 0x8;
pub const SW_THERMAL_SLOWDOWN: u64 = 0x20;
pub const HW_THERMAL_SLOWDOWN: u64 = 0x40;
pub const HW_POWER_BRAKE_SLOWDOWN: u64 = 0x80;
const SLOWING: u64 =
    HW_SLOWDOWN | SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN;

/// One GPU at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReading {
    /// `GPU-…`, as NVML and dcgm-exporter name it.
    pub uuid: String,
    /// The node-local index (dcgm-exporter's `gpu` label).
    pub index: Option<u32>,
    /// The exporter's other labels (`Hostname`, `modelName`, and with its
    /// Kubernetes mapping `pod`, `namespace`, `container`), for matching
    /// GPUs to workers by label.
    pub labels: BTreeMap<String, String>,
    pub temp_c: f64,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub slowdown_c: Option<f64>,
    pub shutdown_c: Option<f64>,
    /// NVML clock event reasons, a bitmask.
    pub clock_reasons: Option<u64>,
}

impl GpuReading {
    /// The GPU reports a thermal or hardware slowdown.
    pub fn slowing(&self) -> bool {
        self.clock_reasons.is_some_and(|r| r & SLOWING != 0)
    }
}

#[derive(Debug, Error)]
pub enum ThermalError {
    #[error("{url}: {message}")]
    Fetch { url: String, message: String },
    #[error("{url}: status {status}")]
    Status { url: String, status: u16 },
    #[error("{url}: no GPU temperature on the page")]
    Empty { url: String },
    #[error("NVML: {0}")]
    Nvml(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_heat_and_power_trouble_is_a_slowdown() {
        let r = |bits| GpuReading {
            uuid: "GPU-a".into(),
            index: None,
            labels: BTreeMap::new(),
            temp_c: 50.0,
            power_w: None,
            power_limit_w: None,
            slowdown_c: None,
            shutdown_c: None,
            clock_reasons: bits,
        };
        assert!(!r(None).slowing());
        assert!(!r(Some(0x1)).slowing(), "idle");
        assert!(
            !r(Some(0x4)).slowing(),
            "a software power cap is not a slowdown"
        );
        for bit in [
            HW_SLOWDOWN,
            SW_THERMAL_SLOWDOWN,
            HW_THERMAL_SLOWDOWN,
            HW_POWER_BRAKE_SLOWDOWN,
        ] {
            assert!(r(Some(bit | 0x1)).slowing(), "{bit:#x}");
        }
    }
}
