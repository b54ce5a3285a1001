//! `GET/POST /v1/admin/thermal`: each worker's GPU heat and its thermal
//! controller; settings per model or per worker, with a dry run.

use super::views::{
    GpuView, ThermalChange, ThermalChangeView, ThermalEffect, ThermalList, WorkerThermal,
};
use super::{error, json_response};
use crate::config::Config;
use crate::fleet::{Fleet, WorkerEntry};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

pub(super) async fn get_thermal(
    State(fleet): State<Arc<Mutex<Fleet>>>,
    State(config): State<Arc<Config>>,
) -> Response {
    let f = fleet.lock();
    let now = Instant::now();
    let workers = f
        .workers()
        .iter()
        .map(|(id, w)| view(&config, &f, *id, w, now))
        .collect();
    json_response(StatusCode::OK, &ThermalList { workers })
}

fn running(w: &WorkerEntry) -> u32 {
    w.ranks().iter().map(|r| r.running).sum()
}

/// Watts per running sequence: the fresh GPUs' power over what runs.
fn watts_per_seq(power: Option<f64>, running: u32) -> Option<f64> {
    power
        .filter(|_| running > 0)
        .map(|p| p / f64::from(running))
}

fn view(config: &Config, f: &Fleet, id: u64, w: &WorkerEntry, now: Instant) -> WorkerThermal {
    let gpus = f.gpus_of(id, now, config.thermal.stale_after);
    let power = gpus
        .iter()
        .filter_map(|g| g.reading.power_w)
        .reduce(|a, b| a + b);
    let running = running(w);
    WorkerThermal {
        worker_id: id,
        model_name: w.spec().model_name.clone(),
        state: w.thermal().state(),
        heat: w.thermal().heat(),
        cap: w.thermal().cap(),
        in_flight: w.in_flight(),
        running,
        temperature_c: gpus.first().map(|g| g.reading.temp_c),
        hottest_gpu: gpus.first().map(|g| g.reading.uuid.clone()),
        power_w: power,
        watts_per_running_seq: watts_per_seq(power, running),
        throttle_entries: w.thermal().entries,
        settings: f.thermal_settings(id, config),
        gpus: gpus
            .iter()
            .map(|g| GpuView {
                uuid: g.reading.uuid.clone(),
                temperature_c: g.reading.temp_c,
                power_w: g.reading.power_w,
                power_limit_w: g.reading.power_limit_w,
                slowdown_c: g.reading.slowdown_c,
                shutdown_c: g.reading.shutdown_c,
                slowing: g.reading.slowing(),
                age_ms: now.saturating_duration_since(g.at).as_millis() as u64,
            })
            .collect(),
    }
}

/// Sets a model's or a worker's settings (exactly one of `model_name` and
/// `worker_id`). Every worker it touches must end with valid settings, or
/// nothing changes. The controller applies them at its next reading.
pub(super) async fn post_thermal(
    State(fleet): State<Arc<Mutex<Fleet>>>,
    State(config): State<Arc<Config>>,
    body: Bytes,
) -> Response {
    let change: ThermalChange = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid body: {e}")),
    };
    let over = change.settings();
    let mut f = fleet.lock();
    let ids: Vec<u64> = match (&change.model_name, change.worker_id) {
        (Some(m), None) => {
            if !f.models().contains_key(m) {
                return error(
                    StatusCode::NOT_FOUND,
                    format!("model {m:?} is not served here"),
                );
            }
            f.workers()
                .iter()
                .filter(|(_, w)| &w.spec().model_name == m)
                .map(|(id, _)| *id)
                .collect()
        }
        (None, Some(id)) => {
            if !f.workers().contains_key(&id) {
                return error(StatusCode::NOT_FOUND, format!("worker {id} does not exist"));
            }
            vec![id]
        }
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "exactly one of \"model_name\" and \"worker_id\" is required",
            );
        }
    };
    // Apply to a copy first: validation covers every worker touched.
    let mut trial = Trial::of(&f, &change, &over);
    if let Some(m) = &change.model_name {
        let model = trial.model(&f, m);
        if let Err(e) = config.thermal_settings(&model).validate() {
            return error(StatusCode::BAD_REQUEST, e);
        }
    }
    let mut effects = Vec::with_capacity(ids.len());
    let mut saved = 0.0;
    let now = Instant::now();
    for id in &ids {
        let Some(w) = f.worker(*id) else { continue };
        let settings = trial.settings(&f, *id, &config);
        if let Err(e) = settings.validate() {
            return error(StatusCode::BAD_REQUEST, format!("worker {id}: {e}"));
        }
        let (new_state, new_cap) = w.thermal().preview(w.in_flight(), &settings);
        let run = running(w);
        let power = f
            .gpus_of(*id, now, config.thermal.stale_after)
            .iter()
            .filter_map(|g| g.reading.power_w)
            .reduce(|a, b| a + b);
        let held = |cap: u32| if cap == 0 { run } else { cap.min(run) };
        if let Some(wps) = watts_per_seq(power, run) {
            saved += (f64::from(held(w.thermal().cap())) - f64::from(held(new_cap))) * wps;
        }
        effects.push(ThermalEffect {
            worker_id: *id,
            state: w.thermal().state(),
            cap: w.thermal().cap(),
            new_state,
            new_cap,
            running: run,
            settings,
        });
    }
    if !change.dry_run {
        trial.commit(&mut f);
        tracing::info!(model = ?change.model_name, worker = ?change.worker_id, settings = ?over, "thermal settings changed");
    }
    json_response(
        StatusCode::OK,
        &ThermalChangeView {
            dry_run: change.dry_run,
            workers: effects,
            estimated_watts_saved: saved,
        },
    )
}

/// A change, not yet applied.
struct Trial {
    model: Option<(String, crate::config::ThermalOverride)>,
    worker: Option<(u64, crate::config::ThermalOverride)>,
}

impl Trial {
    fn of(f: &Fleet, c: &ThermalChange, over: &crate::config::ThermalOverride) -> Trial {
        Trial {
            model: c.model_name.as_ref().and_then(|m| {
                let cur = f.model(m)?.thermal;
                Some((m.clone(), cur.and(over)))
            }),
            worker: c.worker_id.and_then(|id| {
                let cur = f.worker(id)?.thermal().overrides;
                Some((id, cur.and(over)))
            }),
        }
    }

    fn model(&mut self, f: &Fleet, name: &str) -> crate::config::ModelConfig {
        let mut m = f
            .model(name)
            .cloned()
            .unwrap_or_else(|| crate::config::ModelConfig {
                name: name.to_string(),
                thresholds: Default::default(),
                policy: Default::default(),
                lora_adapters: Vec::new(),
                thermal: Default::default(),
                planner: None,
                prompt: None,
                disaggregation: None,
                slo: None,
                max_prompt_tokens: crate::config::DEFAULT_MAX_PROMPT_TOKENS,
            });
        if let Some((n, o)) = &self.model
            && n == name
        {
            m.thermal = *o;
        }
        m
    }

    fn settings(
        &mut self,
        f: &Fleet,
        id: u64,
        file: &crate::config::Config,
    ) -> crate::config::ThermalSettings {
        let Some(w) = f.worker(id) else {
            return Default::default();
        };
        let model = self.model(f, &w.spec().model_name);
        let worker = match &self.worker {
            Some((wid, o)) if *wid == id => *o,
            _ => w.thermal().overrides,
        };
        file.thermal_settings(&model).with(&worker)
    }

    fn commit(self, f: &mut Fleet) {
        if let Some((name, o)) = self.model {
            f.set_model_thermal(&name, o);
        }
        if let Some((id, o)) = self.worker {
            f.set_worker_thermal(id, o);
        }
    }
}
