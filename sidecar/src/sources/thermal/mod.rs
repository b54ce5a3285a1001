//! Placeholder until the sources land: the reading type only.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq)]
pub struct GpuReading {
    pub uuid: String,
    pub index: Option<u32>,
    pub labels: BTreeMap<String, String>,
    pub temp_c: f64,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub slowdown_c: Option<f64>,
    pub shutdown_c: Option<f64>,
    pub clock_reasons: Option<u64>,
}

impl GpuReading {
    pub fn slowing(&self) -> bool {
        self.clock_reasons
            .is_some_and(|r| r & (0x8 | 0x20 | 0x40 | 0x80) != 0)
    }
}

pub mod dcgm {
    pub async fn scrape(
        _url: &str,
        _timeout: std::time::Duration,
    ) -> Result<Vec<super::GpuReading>, String> {
        Ok(Vec::new())
    }
}
pub mod nvml {
    pub struct Nvml;
    impl Nvml {
        pub fn open() -> Result<Nvml, String> {
            Err("stub".into())
        }
        pub fn read(&self) -> Result<Vec<super::GpuReading>, String> {
            Ok(Vec::new())
        }
    }
}
