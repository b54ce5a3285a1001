//! This node's GPUs through NVML (`nvml-wrapper`, which loads
//! `libnvidia-ml.so` at run time: the sidecar builds and runs without a
//! driver, and [`Nvml::open`] says why there is none).
//!
//! The NVML calls are thin; turning their raw values into a
//! [`GpuReading`] is [`reading`], tested without a GPU. To check the calls
//! on a GPU node: `kvgate-sidecar agent --listen 127.0.0.1:9400`, then
//! `curl -s 127.0.0.1:9400/metrics | grep DCGM_FI_DEV_GPU_TEMP` shows one
//! line per GPU, the temperatures `nvidia-smi` shows.

use super::{GpuReading, ThermalError};
use nvml_wrapper::enum_wrappers::device::{TemperatureSensor, TemperatureThreshold};
use nvml_wrapper::error::NvmlError;
use std::collections::BTreeMap;

pub struct Nvml {
    nvml: nvml_wrapper::Nvml,
}

/// What NVML answered for one device; `None` where the device does not
/// support a field.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Raw {
    pub index: u32,
    pub uuid: String,
    pub temp_c: u32,
    pub slowdown_c: Option<u32>,
    pub shutdown_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    pub clock_reasons: Option<u64>,
}

/// A device's raw answers as a reading: milliwatts to watts.
pub fn reading(raw: Raw) -> GpuReading {
    let watts = |mw: u32| f64::from(mw) / 1000.0;
    GpuReading {
        uuid: raw.uuid,
        index: Some(raw.index),
        labels: BTreeMap::new(),
        temp_c: f64::from(raw.temp_c),
        power_w: raw.power_mw.map(watts),
        power_limit_w: raw.power_limit_mw.map(watts),
        slowdown_c: raw.slowdown_c.map(f64::from),
        shutdown_c: raw.shutdown_c.map(f64::from),
        clock_reasons: raw.clock_reasons,
    }
}

/// A field the device does not support is absent, not an error.
fn optional<T>(r: Result<T, NvmlError>) -> Result<Option<T>, NvmlError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(NvmlError::NotSupported) => Ok(None),
        Err(e) => Err(e),
    }
}

impl Nvml {
    pub fn open() -> Result<Nvml, ThermalError> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| Nvml { nvml })
            .map_err(|e| {
                ThermalError::Nvml(format!(
                    "cannot initialise ({e}); is the NVIDIA driver installed?"
                ))
            })
    }

    /// Every device's reading. A device that fails is skipped and logged:
    /// the others still count.
    pub fn read(&self) -> Result<Vec<GpuReading>, ThermalError> {
        let n = self
            .nvml
            .device_count()
            .map_err(|e| ThermalError::Nvml(e.to_string()))?;
        let mut out = Vec::with_capacity(n as usize);
        for index in 0..n {
            match self.raw(index) {
                Ok(raw) => out.push(reading(raw)),
                Err(e) => tracing::warn!(index, error = %e, "NVML: reading a GPU failed"),
            }
        }
        Ok(out)
    }

    fn raw(&self, index: u32) -> Result<Raw, NvmlError> {
        let d = self.nvml.device_by_index(index)?;
        Ok(Raw {
            index,
            uuid: d.uuid()?,
            temp_c: d.temperature(TemperatureSensor::Gpu)?,
            slowdown_c: optional(d.temperature_threshold(TemperatureThreshold::Slowdown))?,
            shutdown_c: optional(d.temperature_threshold(TemperatureThreshold::Shutdown))?,
            power_mw: optional(d.power_usage())?,
            power_limit_mw: optional(d.enforced_power_limit())?,
            clock_reasons: optional(d.current_throttle_reasons())?.map(|r| r.bits()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_answers_become_readings() {
        let r = reading(Raw {
            index: 3,
            uuid: "GPU-1234".into(),
            temp_c: 84,
            slowdown_c: Some(87),
            shutdown_c: None,
            power_mw: Some(612_345),
            power_limit_mw: Some(700_000),
            clock_reasons: Some(0x40),
        });
        assert_eq!(
            (r.index, r.temp_c, r.slowdown_c, r.shutdown_c),
            (Some(3), 84.0, Some(87.0), None)
        );
        assert_eq!((r.power_w, r.power_limit_w), (Some(612.345), Some(700.0)));
        assert!(r.slowing());
    }

    #[test]
    fn unsupported_fields_are_absent_and_other_errors_are_errors() {
        assert_eq!(optional::<u32>(Err(NvmlError::NotSupported)).unwrap(), None);
        assert!(optional::<u32>(Err(NvmlError::GpuLost)).is_err());
    }

    #[test]
    fn without_a_driver_opening_says_so() {
        // This machine has no NVIDIA driver (CI's neither); where one is
        // present the open succeeds and a read lists its GPUs.
        match Nvml::open() {
            Err(e) => assert!(e.to_string().contains("NVML"), "{e}"),
            Ok(n) => assert!(n.read().is_ok()),
        }
    }
}
