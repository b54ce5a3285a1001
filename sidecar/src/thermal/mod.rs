//! The thermal loop: reads every GPU source each interval, steps each
//! worker's controller (`crate::fleet`), and cuts the running batch of
//! engines that serve batch control.
//!
//! The controller's cap reaches the routers in the next snapshot, which is
//! where most of the effect is: a capped worker gets no new requests. The
//! engine call is what shrinks a decode batch already running (the seed's
//! point: capping admissions does not).

pub mod batch;

use crate::config::Config;
use crate::fleet::{Change, Fleet, Stepped};
use crate::metrics::ThermalMetrics;
use crate::sources::metrics::scrape::HttpClient;
use crate::sources::thermal::{GpuReading, dcgm, nvml::Nvml};
use batch::{BatchClient, BatchRequest, request_for};
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a sidecar without NVML tries to open it again.
const NVML_RETRY: Duration = Duration::from_secs(60);

/// What the thermal loop reads and changes, handed to it at start.
#[derive(Clone)]
pub(crate) struct Handles {
    pub(crate) config: Arc<Config>,
    pub(crate) fleet: Arc<Mutex<Fleet>>,
    pub(crate) metrics: ThermalMetrics,
    pub(crate) client: HttpClient,
}

impl Handles {
    fn config(&self) -> &Config {
        &self.config
    }

    fn fleet(&self) -> MutexGuard<'_, Fleet> {
        self.fleet.lock()
    }
}

pub(crate) async fn thermal_loop(th: Handles) {
    let cfg = th.config().thermal.clone();
    let batch = BatchClient::new(cfg.batch_token.clone(), cfg.timeout);
    let mut nvml = NvmlSource::default();
    let mut failing: HashSet<String> = HashSet::new();
    let mut shown = Shown::default();
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut readings = scrape_all(&th, &cfg.dcgm_urls, cfg.timeout, &mut failing).await;
        if cfg.nvml {
            readings.extend(nvml.read().await);
        }
        let now = Instant::now();
        let acts = {
            let mut f = th.fleet();
            f.record_gpus(readings, now);
            let steps = f.step_thermal(th.config(), now);
            shown.refresh(&th, &f, now);
            steps
                .into_iter()
                .filter(|s| s.change != Change::None)
                .filter_map(|s| {
                    let w = f.worker(s.worker_id)?;
                    let settings = f.thermal_settings(s.worker_id, th.config());
                    report(
                        &th,
                        w.spec().model_name.as_str(),
                        &s,
                        w.thermal().hottest.as_ref(),
                    );
                    w.spec().batch_control.then(|| Actuation {
                        worker_id: s.worker_id,
                        endpoint: w.spec().endpoint.clone(),
                        ranks: w.spec().data_parallel_size,
                        restore: w.thermal().restore_max_num_seqs,
                        policy: settings.policy,
                        step: s,
                    })
                })
                .collect::<Vec<_>>()
        };
        for a in acts {
            tokio::spawn(actuate(th.clone(), batch.clone(), a));
        }
    }
}

fn report(th: &Handles, model: &str, s: &Stepped, hottest: Option<&crate::fleet::Hottest>) {
    let temp = hottest.map(|h| h.temp_c);
    let gpu = hottest.map(|h| h.uuid.as_str());
    let id = s.worker_id.to_string();
    match s.change {
        Change::Entered => {
            th.metrics
                .entries
                .with_label_values(&[model, id.as_str()])
                .inc();
            tracing::warn!(worker = s.worker_id, cap = s.cap, running = s.running, temp_c = ?temp, gpu = ?gpu, "worker is throttling: new requests capped");
        }
        Change::CapChanged => {
            tracing::info!(worker = s.worker_id, cap = s.cap, temp_c = ?temp, "thermal cap changed");
        }
        Change::Exited => {
            tracing::info!(worker = s.worker_id, temp_c = ?temp, "worker cooled down: cap lifted");
        }
        Change::None => {}
    }
}

/// The label sets of the thermal gauges now shown, so that a GPU gone
/// stale or a worker removed stops being shown rather than frozen.
#[derive(Default)]
struct Shown {
    gpus: HashSet<[String; 3]>,
    workers: HashSet<[String; 2]>,
}

impl Shown {
    fn refresh(&mut self, th: &Handles, f: &Fleet, now: Instant) {
        let m = &th.metrics;
        let stale_after = th.config().thermal.stale_after;
        let mut gpus = HashSet::new();
        let mut workers = HashSet::new();
        for (id, w) in f.workers() {
            let ids = id.to_string();
            let model = w.spec().model_name.clone();
            let wl = [model.as_str(), ids.as_str()];
            let c = w.thermal();
            m.cap.with_label_values(&wl).set(i64::from(c.cap()));
            for st in kvgate_core::ThermalState::ALL {
                m.state
                    .with_label_values(&[wl[0], wl[1], st.as_str()])
                    .set(i64::from(c.state() == st));
            }
            let fresh = f.gpus_of(*id, now, stale_after);
            if let Some(h) = fresh.first() {
                m.worker_temperature
                    .with_label_values(&wl)
                    .set(h.reading.temp_c);
                workers.insert([model.clone(), ids.clone()]);
            }
            for g in fresh {
                let l = [wl[0], wl[1], g.reading.uuid.as_str()];
                m.gpu_temperature
                    .with_label_values(&l)
                    .set(g.reading.temp_c);
                if let Some(p) = g.reading.power_w {
                    m.gpu_power.with_label_values(&l).set(p);
                }
                m.gpu_slowdown
                    .with_label_values(&l)
                    .set(i64::from(g.reading.slowing()));
                gpus.insert([model.clone(), ids.clone(), g.reading.uuid.clone()]);
            }
        }
        for gone in self.gpus.difference(&gpus) {
            let l = [gone[0].as_str(), gone[1].as_str(), gone[2].as_str()];
            let _ = m.gpu_temperature.remove_label_values(&l);
            let _ = m.gpu_power.remove_label_values(&l);
            let _ = m.gpu_slowdown.remove_label_values(&l);
        }
        for gone in self.workers.difference(&workers) {
            let _ = m
                .worker_temperature
                .remove_label_values(&[gone[0].as_str(), gone[1].as_str()]);
        }
        self.gpus = gpus;
        self.workers = workers;
    }
}

/// dcgm-exporter pages, all at once; a source that fails is logged when
/// it starts failing and when it recovers, and counted every time.
async fn scrape_all(
    th: &Handles,
    urls: &[String],
    timeout: Duration,
    failing: &mut HashSet<String>,
) -> Vec<GpuReading> {
    let results = futures_join(urls.iter().cloned().map(|u| {
        let client = th.client.clone();
        async move {
            let r = dcgm::scrape(&client, &u, timeout).await;
            (u, r)
        }
    }))
    .await;
    let mut out = Vec::new();
    for (url, r) in results {
        match r {
            Ok(readings) => {
                if failing.remove(&url) {
                    tracing::info!(url, "GPU readings are back");
                }
                out.extend(readings);
            }
            Err(e) => {
                th.metrics.source_errors.with_label_values(&["dcgm"]).inc();
                if failing.insert(url.clone()) {
                    tracing::warn!(url, error = %e, "GPU readings failed: its GPUs go unknown once stale");
                }
            }
        }
    }
    out
}

/// Runs the futures concurrently and returns their outputs in order.
async fn futures_join<F>(fs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = fs.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        if let Ok(v) = h.await {
            out.push(v);
        }
    }
    out
}

/// This node's GPUs through NVML, opened lazily: a sidecar without a
/// driver says so once and carries on.
#[derive(Default)]
struct NvmlSource {
    nvml: Option<Arc<Nvml>>,
    last_try: Option<Instant>,
    warned: bool,
}

impl NvmlSource {
    async fn read(&mut self) -> Vec<GpuReading> {
        if self.nvml.is_none() && self.last_try.is_none_or(|t| t.elapsed() >= NVML_RETRY) {
            self.last_try = Some(Instant::now());
            match tokio::task::spawn_blocking(Nvml::open).await {
                Ok(Ok(n)) => {
                    tracing::info!("reading GPU temperatures through NVML");
                    self.nvml = Some(Arc::new(n));
                }
                Ok(Err(e)) if !self.warned => {
                    self.warned = true;
                    tracing::warn!(error = %e, "thermal.nvml is set but NVML cannot be opened: no local GPU readings (retried every minute)");
                }
                _ => {}
            }
        }
        let Some(n) = self.nvml.clone() else {
            return Vec::new();
        };
        match tokio::task::spawn_blocking(move || n.read()).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "NVML read failed");
                Vec::new()
            }
            Err(_) => Vec::new(),
        }
    }
}

struct Actuation {
    worker_id: u64,
    endpoint: String,
    ranks: u32,
    restore: Option<u32>,
    policy: crate::config::EvictPolicy,
    step: Stepped,
}

/// Tells the engine what the controller decided. The first cut asks the
/// engine (dry run) what its `max_num_seqs` is, so that it can be given
/// back when the worker cools.
async fn actuate(th: Handles, batch: BatchClient, a: Actuation) {
    if a.step.cap == 0 && a.restore.is_none() {
        // Never cut (every call failed): nothing to give back.
        return;
    }
    let outcome = async {
        let restore = match a.restore {
            Some(r) => r,
            None => {
                let probe = BatchRequest {
                    dry_run: true,
                    policy: a.policy,
                    ..Default::default()
                };
                let r = batch.call(&a.endpoint, &probe).await?.new_max_num_seqs;
                th.fleet().remember_restore(a.worker_id, r);
                r
            }
        };
        let req = request_for(
            a.step.cap,
            a.step.running,
            a.ranks,
            restore,
            a.policy,
            a.step.evict,
        );
        batch.call(&a.endpoint, &req).await.map(|r| (req, r))
    }
    .await;
    let result = match &outcome {
        Ok((req, r)) => {
            tracing::info!(
                worker = a.worker_id,
                max_num_seqs = ?req.max_num_seqs,
                evicted = r.evicted_request_ids.len(),
                running = r.new_running,
                watts_saved = r.estimated_watts_saved,
                "engine batch set"
            );
            "ok"
        }
        Err(e) => {
            tracing::warn!(worker = a.worker_id, error = %e, "engine batch control failed");
            "error"
        }
    };
    th.metrics.batch_calls.with_label_values(&[result]).inc();
}
