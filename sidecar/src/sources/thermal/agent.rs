//! `kvgate-sidecar agent`: on a GPU node without dcgm-exporter, reads NVML
//! every interval and serves the readings at `/metrics` under
//! dcgm-exporter's names, so sidecars scrape it as they would the exporter.
//!
//! Without NVML it says why once, keeps serving (`kvgate_agent_nvml_up 0`
//! and no GPU), and tries again every minute.

use super::nvml::Nvml;
use super::{GpuReading, ThermalError, dcgm};
use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use parking_lot::RwLock;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const RETRY: Duration = Duration::from_secs(60);

/// What the agent serves: the latest readings, and whether NVML answered.
#[derive(Debug, Default)]
pub struct Latest {
    readings: RwLock<(Vec<GpuReading>, bool)>,
}

impl Latest {
    pub fn set(&self, readings: Vec<GpuReading>, nvml_up: bool) {
        *self.readings.write() = (readings, nvml_up);
    }

    /// dcgm-exporter's page, plus the agent's own `kvgate_agent_nvml_up`.
    pub fn page(&self) -> String {
        let (readings, up) = &*self.readings.read();
        let mut page = dcgm::render(readings);
        page.push_str(
            "# HELP kvgate_agent_nvml_up 1 when the agent reads the GPUs through NVML.\n# TYPE kvgate_agent_nvml_up gauge\n",
        );
        page.push_str(&format!("kvgate_agent_nvml_up {}\n", u8::from(*up)));
        page
    }
}

pub fn router(latest: Arc<Latest>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(l): State<Arc<Latest>>| async move {
                ([("content-type", "text/plain; version=0.0.4")], l.page()).into_response()
            }),
        )
        .route("/health", get(|| async { "ok" }))
        .with_state(latest)
}

/// Serves on `listen`, reading NVML every `interval`, until the listener
/// fails.
pub async fn run(listen: SocketAddr, interval: Duration) -> anyhow::Result<()> {
    let latest = Arc::new(Latest::default());
    let reader = latest.clone();
    tokio::spawn(async move {
        let mut nvml: Option<Arc<Nvml>> = None;
        let mut last_try: Option<Instant> = None;
        let mut tick = tokio::time::interval(interval.max(Duration::from_millis(100)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if nvml.is_none() && last_try.is_none_or(|t| t.elapsed() >= RETRY) {
                let first = last_try.is_none();
                last_try = Some(Instant::now());
                match tokio::task::spawn_blocking(Nvml::open).await {
                    Ok(Ok(n)) => {
                        tracing::info!("reading GPUs through NVML");
                        nvml = Some(Arc::new(n));
                    }
                    Ok(Err(e)) if first => {
                        tracing::warn!(error = %e, "no NVML: serving no GPU (retried every minute)");
                    }
                    _ => {}
                }
            }
            let Some(n) = nvml.clone() else {
                reader.set(Vec::new(), false);
                continue;
            };
            match tokio::task::spawn_blocking(move || n.read()).await {
                Ok(Ok(r)) => reader.set(r, true),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "NVML read failed");
                    reader.set(Vec::new(), false);
                }
                Err(e) => {
                    let e = ThermalError::Nvml(e.to_string());
                    tracing::warn!(error = %e, "NVML read failed");
                }
            }
        }
    });
    let l = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(%listen, "kvgate agent serving GPU readings at /metrics");
    axum::serve(l, router(latest)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    async fn get_page(latest: Arc<Latest>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, router(latest)).await });
        let client = crate::sources::metrics::scrape::client();
        let resp = client
            .get(format!("http://{addr}/metrics").parse().unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn serves_readings_as_dcgm_exporter_and_says_when_nvml_is_missing() {
        let latest = Arc::new(Latest::default());
        let page = get_page(latest.clone()).await;
        assert!(page.contains("kvgate_agent_nvml_up 0"), "{page}");
        assert!(dcgm::parse(&page).is_empty());
        let gpu = GpuReading {
            uuid: "GPU-77".into(),
            index: Some(0),
            labels: BTreeMap::from([("Hostname".to_string(), "node-9".to_string())]),
            temp_c: 66.0,
            power_w: Some(410.0),
            power_limit_w: Some(700.0),
            slowdown_c: Some(87.0),
            shutdown_c: Some(92.0),
            clock_reasons: Some(0),
        };
        latest.set(vec![gpu.clone()], true);
        let page = get_page(latest).await;
        assert!(page.contains("kvgate_agent_nvml_up 1"));
        assert_eq!(
            dcgm::parse(&page),
            vec![gpu],
            "the sidecar reads back what NVML said"
        );
    }
}
