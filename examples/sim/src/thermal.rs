//! A simulated GPU thermal plant: what a worker's tensor-parallel group of
//! GPUs does with the work it runs, served in dcgm-exporter's format.
//!
//! Per GPU, first order: power is the idle draw plus a fixed cost per
//! running sequence (the seed measured about 3.2 W per decode sequence at
//! 4k context on an H100; the default here is larger so that a simulated
//! batch of 32 moves the temperature as a real one of a few hundred does),
//! capped at the power limit; the temperature relaxes toward
//! `ambient + R × power` with time constant τ. At the slowdown temperature
//! the clocks drop as on real hardware: the GPU's power scales by the
//! slowdown factor, and the whole worker decodes that much slower (one slow
//! GPU stalls every all-reduce of its group). Cooling can degrade at a
//! given time, or at once through `POST /sim/thermal`.

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// NVML's clock event reasons the plant reports while slowing down.
pub const HW_SLOWDOWN: u64 = 0x8;
pub const HW_THERMAL_SLOWDOWN: u64 = 0x40;
pub const SW_POWER_CAP: u64 = 0x4;

/// The plant's parameters; all can change at run time.
#[derive(Debug, Clone, PartialEq)]
pub struct PlantParams {
    pub ambient_c: f64,
    pub r_c_per_w: f64,
    pub tau_s: f64,
    pub idle_w: f64,
    pub w_per_seq: f64,
    pub power_limit_w: f64,
    pub slowdown_c: f64,
    pub shutdown_c: f64,
    /// Clock (and power) factor while slowing, in (0, 1].
    pub slowdown_factor: f64,
    /// GPU `i` runs `i × skew` hotter (its ambient): the hottest GPU of a
    /// group is not always the first.
    pub skew_c: f64,
}

/// A degradation of the cooling at a given time after start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Degrade {
    pub at: Duration,
    pub r_c_per_w: Option<f64>,
    pub ambient_c: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuState {
    pub index: u32,
    pub uuid: String,
    pub temp_c: f64,
    pub power_w: f64,
    pub slowing: bool,
    pub clock_reasons: u64,
}

struct Inner {
    params: PlantParams,
    gpus: Vec<GpuState>,
    degrade: Option<Degrade>,
    /// `/dcgm/metrics` answers 503 while false.
    exporter_up: bool,
    last: Instant,
}

pub struct Plant {
    inner: Mutex<Inner>,
    started: Instant,
    hostname: String,
    pod: Option<(String, String)>,
}

/// A run-time change (`POST /sim/thermal`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlantChange {
    pub r_c_per_w: Option<f64>,
    pub ambient_c: Option<f64>,
    /// `"up"` or `"down"`: whether the dcgm-exporter page answers.
    pub dcgm: Option<String>,
}

impl Plant {
    /// `gpus` GPUs named `GPU-<prefix>-<i>`, starting at their idle steady
    /// state.
    pub fn new(
        gpus: u32,
        prefix: &str,
        params: PlantParams,
        degrade: Option<Degrade>,
        pod: Option<(String, String)>,
    ) -> Plant {
        let gpus = (0..gpus.max(1))
            .map(|i| {
                let mut g = GpuState {
                    index: i,
                    uuid: format!("GPU-{prefix}-{i}"),
                    temp_c: 0.0,
                    power_w: params.idle_w,
                    slowing: false,
                    clock_reasons: 0,
                };
                g.temp_c = ambient(&params, i) + params.r_c_per_w * params.idle_w;
                g
            })
            .collect();
        Plant {
            inner: Mutex::new(Inner {
                params,
                gpus,
                degrade,
                exporter_up: true,
                last: Instant::now(),
            }),
            started: Instant::now(),
            hostname: prefix.to_string(),
            pod,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Advances the plant to now with `running` sequences on the worker.
    pub fn step(&self, running: u32) {
        let now = Instant::now();
        let mut g = self.lock();
        if let Some(d) = g.degrade
            && now.duration_since(self.started) >= d.at
        {
            if let Some(r) = d.r_c_per_w {
                g.params.r_c_per_w = r;
            }
            if let Some(a) = d.ambient_c {
                g.params.ambient_c = a;
            }
            g.degrade = None;
        }
        let dt = now.duration_since(g.last).as_secs_f64();
        g.last = now;
        let p = g.params.clone();
        for gpu in &mut g.gpus {
            step_gpu(gpu, &p, running, dt);
        }
    }

    /// What the worker's decode steps are slowed by: the slowest GPU's
    /// clock factor (1 when none is slowing).
    pub fn clock_factor(&self) -> f64 {
        let g = self.lock();
        if g.gpus.iter().any(|x| x.slowing) {
            g.params.slowdown_factor.clamp(0.05, 1.0)
        } else {
            1.0
        }
    }

    pub fn params(&self) -> PlantParams {
        self.lock().params.clone()
    }

    pub fn gpus(&self) -> Vec<GpuState> {
        self.lock().gpus.clone()
    }

    pub fn apply(&self, c: &PlantChange) -> Result<(), String> {
        let finite = |v: Option<f64>, what: &str, lo: f64, hi: f64| match v {
            Some(x) if !(x.is_finite() && (lo..=hi).contains(&x)) => {
                Err(format!("{what} must be within [{lo}, {hi}], got {x}"))
            }
            _ => Ok(()),
        };
        finite(c.r_c_per_w, "r_c_per_w", 0.0, 10.0)?;
        finite(c.ambient_c, "ambient_c", -50.0, 150.0)?;
        let up = match c.dcgm.as_deref() {
            None => None,
            Some("up") => Some(true),
            Some("down") => Some(false),
            Some(other) => return Err(format!("dcgm must be \"up\" or \"down\", got {other:?}")),
        };
        let mut g = self.lock();
        if let Some(r) = c.r_c_per_w {
            g.params.r_c_per_w = r;
        }
        if let Some(a) = c.ambient_c {
            g.params.ambient_c = a;
        }
        if let Some(u) = up {
            g.exporter_up = u;
        }
        Ok(())
    }

    /// The temperature the group settles at with `running` sequences.
    pub fn steady_c(&self, running: u32) -> f64 {
        let p = self.params();
        let last = (self.lock().gpus.len() as u32).saturating_sub(1);
        ambient(&p, last) + p.r_c_per_w * power(&p, running, false)
    }

    /// The most running sequences whose steady temperature stays at or
    /// under `target_c` on the hottest GPU (at least 0).
    pub fn seqs_for(&self, target_c: f64) -> u32 {
        let p = self.params();
        let last = (self.lock().gpus.len() as u32).saturating_sub(1);
        if p.r_c_per_w <= 0.0 || p.w_per_seq <= 0.0 {
            return u32::MAX;
        }
        let watts = (target_c - ambient(&p, last)) / p.r_c_per_w - p.idle_w;
        (watts / p.w_per_seq)
            .floor()
            .clamp(0.0, f64::from(u32::MAX)) as u32
    }

    /// dcgm-exporter's page, or `None` while the exporter is "down".
    pub fn dcgm_page(&self) -> Option<String> {
        let g = self.lock();
        if !g.exporter_up {
            return None;
        }
        let mut out = String::new();
        let p = &g.params;
        type Field<'a> = (&'a str, &'a str, &'a dyn Fn(&GpuState) -> f64);
        let fields: [Field<'_>; 6] = [
            ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", &|x| {
                x.temp_c.round()
            }),
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", &|x| {
                x.power_w
            }),
            (
                "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
                "Current clock event reasons (bitmask).",
                &|x| x.clock_reasons as f64,
            ),
            (
                "DCGM_FI_DEV_SLOWDOWN_TEMP",
                "Slowdown temperature (in C).",
                &|_| p.slowdown_c,
            ),
            (
                "DCGM_FI_DEV_SHUTDOWN_TEMP",
                "Shutdown temperature (in C).",
                &|_| p.shutdown_c,
            ),
            (
                "DCGM_FI_DEV_POWER_MGMT_LIMIT",
                "Power management limit (in W).",
                &|_| p.power_limit_w,
            ),
        ];
        for (name, help, value) in fields {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for gpu in &g.gpus {
                let _ = write!(
                    out,
                    "{name}{{gpu=\"{}\",UUID=\"{}\",device=\"nvidia{}\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"{}\"",
                    gpu.index, gpu.uuid, gpu.index, self.hostname
                );
                if let Some((pod, ns)) = &self.pod {
                    let _ = write!(out, ",container=\"vllm\",namespace=\"{ns}\",pod=\"{pod}\"");
                }
                let _ = writeln!(out, "}} {}", value(gpu));
            }
        }
        Some(out)
    }
}

fn ambient(p: &PlantParams, gpu: u32) -> f64 {
    p.ambient_c + p.skew_c * f64::from(gpu)
}

fn power(p: &PlantParams, running: u32, slowing: bool) -> f64 {
    let w = (p.idle_w + p.w_per_seq * f64::from(running)).min(p.power_limit_w);
    if slowing {
        w * p.slowdown_factor.clamp(0.05, 1.0)
    } else {
        w
    }
}

fn step_gpu(gpu: &mut GpuState, p: &PlantParams, running: u32, dt: f64) {
    // Slowing down from the slowdown temperature until a degree under it,
    // as the hardware's own hysteresis does.
    gpu.slowing = if gpu.slowing {
        gpu.temp_c >= p.slowdown_c - 1.0
    } else {
        gpu.temp_c >= p.slowdown_c
    };
    let uncapped = p.idle_w + p.w_per_seq * f64::from(running);
    gpu.power_w = power(p, running, gpu.slowing);
    gpu.clock_reasons = 0;
    if gpu.slowing {
        gpu.clock_reasons |= HW_SLOWDOWN | HW_THERMAL_SLOWDOWN;
    }
    if uncapped > p.power_limit_w {
        gpu.clock_reasons |= SW_POWER_CAP;
    }
    let target = ambient(p, gpu.index) + p.r_c_per_w * gpu.power_w;
    let alpha = if p.tau_s > 0.0 {
        1.0 - (-dt / p.tau_s).exp()
    } else {
        1.0
    };
    gpu.temp_c += (target - gpu.temp_c) * alpha;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> PlantParams {
        PlantParams {
            ambient_c: 25.0,
            r_c_per_w: 0.1,
            tau_s: 10.0,
            idle_w: 100.0,
            w_per_seq: 15.0,
            power_limit_w: 700.0,
            slowdown_c: 87.0,
            shutdown_c: 92.0,
            slowdown_factor: 0.5,
            skew_c: 1.0,
        }
    }

    #[test]
    fn temperature_relaxes_with_its_time_constant_to_its_steady_state() {
        let p = params();
        let mut g = GpuState {
            index: 0,
            uuid: "GPU-x-0".into(),
            temp_c: 35.0,
            power_w: 100.0,
            slowing: false,
            clock_reasons: 0,
        };
        // 20 running: 400 W, steady 65 °C; one τ covers 63 % of the way.
        step_gpu(&mut g, &p, 20, 10.0);
        assert!((g.temp_c - (35.0 + 30.0 * (1.0 - (-1.0f64).exp()))).abs() < 1e-9);
        for _ in 0..200 {
            step_gpu(&mut g, &p, 20, 1.0);
        }
        assert!((g.temp_c - 65.0).abs() < 1e-6, "{}", g.temp_c);
        assert_eq!(g.clock_reasons, 0);
    }

    #[test]
    fn a_hot_gpu_slows_down_with_hysteresis_and_halves_its_power() {
        let p = PlantParams {
            ambient_c: 60.0,
            ..params()
        };
        let mut g = GpuState {
            index: 0,
            uuid: "GPU-x-0".into(),
            temp_c: 87.0,
            power_w: 0.0,
            slowing: false,
            clock_reasons: 0,
        };
        step_gpu(&mut g, &p, 20, 0.1);
        assert!(g.slowing);
        assert_eq!(g.clock_reasons, HW_SLOWDOWN | HW_THERMAL_SLOWDOWN);
        assert_eq!(g.power_w, 200.0, "400 W at half clocks");
        g.temp_c = 86.5;
        step_gpu(&mut g, &p, 20, 0.0);
        assert!(g.slowing, "within a degree under: still slowing");
        g.temp_c = 85.9;
        step_gpu(&mut g, &p, 20, 0.0);
        assert!(!g.slowing);
        step_gpu(&mut g, &p, 60, 0.0);
        assert_eq!(
            g.clock_reasons & SW_POWER_CAP,
            SW_POWER_CAP,
            "1000 W asked of 700"
        );
    }

    #[test]
    fn the_page_speaks_dcgm_exporter_and_goes_down_on_request() {
        let plant = Plant::new(
            2,
            "sim-8101",
            params(),
            None,
            Some(("vllm-0".into(), "llm".into())),
        );
        let page = plant.dcgm_page().unwrap();
        assert!(page.contains("# TYPE DCGM_FI_DEV_GPU_TEMP gauge"));
        let temp: Vec<&str> = page
            .lines()
            .filter(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{"))
            .collect();
        assert_eq!(temp.len(), 2);
        assert!(temp[1].contains("UUID=\"GPU-sim-8101-1\""), "{}", temp[1]);
        assert!(temp[1].contains("pod=\"vllm-0\""));
        // Idle steady state, GPU 1 a degree hotter: 25 + 1 + 10.
        assert!(temp[1].ends_with(" 36"), "{}", temp[1]);
        assert!(page.contains("DCGM_FI_DEV_POWER_MGMT_LIMIT{"));
        plant
            .apply(&PlantChange {
                dcgm: Some("down".into()),
                ..Default::default()
            })
            .unwrap();
        assert!(plant.dcgm_page().is_none());
        assert!(
            plant
                .apply(&PlantChange {
                    ambient_c: Some(f64::NAN),
                    ..Default::default()
                })
                .is_err()
        );
    }

    #[test]
    fn cooling_degrades_at_its_time_and_sizes_the_batch() {
        let plant = Plant::new(
            1,
            "x",
            params(),
            Some(Degrade {
                at: Duration::ZERO,
                r_c_per_w: None,
                ambient_c: Some(45.0),
            }),
            None,
        );
        assert_eq!(plant.seqs_for(80.0), 30, "(80 − 25) / 0.1 − 100 = 450 W");
        plant.step(0);
        assert_eq!(plant.params().ambient_c, 45.0);
        assert_eq!(plant.seqs_for(80.0), 16, "250 W");
        assert!((plant.steady_c(10) - (45.0 + 25.0)).abs() < 1e-9);
    }
}
