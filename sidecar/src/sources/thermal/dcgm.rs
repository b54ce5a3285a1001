//! dcgm-exporter's page: parsing it into readings, rendering readings as
//! it (for `kvgate-sidecar agent`), and scraping it.
//!
//! Series are keyed by their `UUID` label (dcgm-exporter's spelling;
//! `uuid` is accepted too); one without is skipped, as is a GPU without a
//! temperature, the one field a reading is for. dcgm-exporter's Kubernetes
//! mapping can print a GPU once per pod using it: the first mapping's
//! labels are kept (a GPU shared by several pods is matched by UUID, not
//! by pod). A non-finite value is dropped, not read as zero.

use super::{GpuReading, ThermalError};
use crate::sources::metrics::promtext::{self, Sample};
use crate::sources::metrics::scrape::HttpClient;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

/// A node's page is a few KiB per GPU; anything near this is not one.
const MAX_PAGE: usize = 4 << 20;

const TEMP: &str = "DCGM_FI_DEV_GPU_TEMP";
const POWER: &str = "DCGM_FI_DEV_POWER_USAGE";
const REASONS: &str = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS";
/// The name before DCGM 3.3 renamed throttling to clock events.
const REASONS_OLD: &str = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS";
const SLOWDOWN: &str = "DCGM_FI_DEV_SLOWDOWN_TEMP";
const SHUTDOWN: &str = "DCGM_FI_DEV_SHUTDOWN_TEMP";
const POWER_LIMIT: &str = "DCGM_FI_DEV_POWER_MGMT_LIMIT";

/// Labels that name the series, not the GPU's placement.
const OWN_LABELS: [&str; 3] = ["UUID", "uuid", "gpu"];

pub fn parse(text: &str) -> Vec<GpuReading> {
    let parsed = promtext::parse(text);
    let mut temps: BTreeMap<String, (f64, &Sample)> = BTreeMap::new();
    let mut fields: BTreeMap<(&str, String), f64> = BTreeMap::new();
    for s in &parsed.samples {
        let Some(uuid) = s.label("UUID").or_else(|| s.label("uuid")) else {
            continue;
        };
        if uuid.is_empty() || !s.value.is_finite() {
            continue;
        }
        match s.name.as_str() {
            TEMP => {
                temps.entry(uuid.to_string()).or_insert((s.value, s));
            }
            POWER | REASONS | REASONS_OLD | SLOWDOWN | SHUTDOWN | POWER_LIMIT => {
                let name = if s.name == REASONS_OLD {
                    REASONS
                } else {
                    s.name.as_str()
                };
                fields.entry((name, uuid.to_string())).or_insert(s.value);
            }
            _ => {}
        }
    }
    temps
        .into_iter()
        .map(|(uuid, (temp_c, s))| {
            let field = |name: &'static str| fields.get(&(name, uuid.clone())).copied();
            GpuReading {
                index: s.label("gpu").and_then(|g| g.parse().ok()),
                labels: s
                    .labels
                    .iter()
                    .filter(|(k, _)| !OWN_LABELS.contains(&k.as_str()))
                    .cloned()
                    .collect(),
                temp_c,
                power_w: field(POWER),
                power_limit_w: field(POWER_LIMIT),
                slowdown_c: field(SLOWDOWN),
                shutdown_c: field(SHUTDOWN),
                clock_reasons: field(REASONS)
                    .filter(|r| *r >= 0.0 && *r <= u64::MAX as f64)
                    .map(|r| r as u64),
                uuid,
            }
        })
        .collect()
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The readings as dcgm-exporter prints them: HELP and TYPE, then a
/// series per GPU with `gpu`, `UUID` and the GPU's other labels.
pub fn render(readings: &[GpuReading]) -> String {
    let mut out = String::new();
    type Field = (&'static str, &'static str, fn(&GpuReading) -> Option<f64>);
    let fields: [Field; 6] = [
        (TEMP, "GPU temperature (in C).", |r| Some(r.temp_c)),
        (POWER, "Power draw (in W).", |r| r.power_w),
        (REASONS, "Current clock event reasons (bitmask).", |r| {
            r.clock_reasons.map(|b| b as f64)
        }),
        (SLOWDOWN, "Slowdown temperature (in C).", |r| r.slowdown_c),
        (SHUTDOWN, "Shutdown temperature (in C).", |r| r.shutdown_c),
        (POWER_LIMIT, "Power management limit (in W).", |r| {
            r.power_limit_w
        }),
    ];
    for (name, help, value) in fields {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for r in readings {
            let Some(v) = value(r) else { continue };
            let mut labels = format!("UUID=\"{}\"", escape(&r.uuid));
            if let Some(i) = r.index {
                labels = format!("gpu=\"{i}\",{labels}");
            }
            for (k, v) in &r.labels {
                let _ = write!(labels, ",{k}=\"{}\"", escape(v));
            }
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    }
    out
}

/// Fetches and parses one page within `timeout`.
pub async fn scrape(
    client: &HttpClient,
    url: &str,
    timeout: Duration,
) -> Result<Vec<GpuReading>, ThermalError> {
    let fail = |message: String| ThermalError::Fetch {
        url: url.to_string(),
        message,
    };
    let uri: hyper::Uri = url.parse().map_err(|e| fail(format!("bad URL: {e}")))?;
    let fetch = async {
        let resp = client.get(uri).await.map_err(|e| fail(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(ThermalError::Status {
                url: url.to_string(),
                status: resp.status().as_u16(),
            });
        }
        crate::sources::body::read_capped(resp.into_body(), MAX_PAGE)
            .await
            .map_err(|e| fail(format!("reading the page: {e}")))
    };
    let body = tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| fail(format!("timed out after {timeout:?}")))??;
    let text = std::str::from_utf8(&body).map_err(|_| fail("the page is not UTF-8".into()))?;
    let readings = parse(text);
    if readings.is_empty() {
        return Err(ThermalError::Empty {
            url: url.to_string(),
        });
    }
    Ok(readings)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-aaa",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",container="vllm",namespace="llm",pod="vllm-0"} 71
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-aaa",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",container="side",namespace="llm",pod="other"} 71
DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-bbb",device="nvidia1",Hostname="node-1"} 88
DCGM_FI_DEV_GPU_TEMP{gpu="2",device="nvidia2",Hostname="node-1"} 50
DCGM_FI_DEV_GPU_TEMP{gpu="3",UUID="GPU-ddd",Hostname="node-1"} NaN
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-aaa",Hostname="node-1"} 512.5
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-bbb",Hostname="node-1"} +Inf
DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0",UUID="GPU-aaa"} 1
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="1",UUID="GPU-bbb"} 72
DCGM_FI_DEV_SLOWDOWN_TEMP{gpu="0",UUID="GPU-aaa"} 87
DCGM_FI_DEV_SHUTDOWN_TEMP{gpu="0",UUID="GPU-aaa"} 92
DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="0",UUID="GPU-aaa"} 700
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-aaa"} 1980
garbage line {
"#;

    #[test]
    fn a_real_page_reads_per_gpu_uuid() {
        let r = parse(PAGE);
        assert_eq!(r.len(), 2, "no UUID and NaN-only GPUs are skipped: {r:?}");
        let a = &r[0];
        assert_eq!(
            (a.uuid.as_str(), a.index, a.temp_c),
            ("GPU-aaa", Some(0), 71.0)
        );
        assert_eq!(
            a.labels.get("pod").map(String::as_str),
            Some("vllm-0"),
            "first mapping kept"
        );
        assert!(!a.labels.contains_key("UUID") && !a.labels.contains_key("gpu"));
        assert_eq!(
            (
                a.power_w,
                a.power_limit_w,
                a.slowdown_c,
                a.shutdown_c,
                a.clock_reasons
            ),
            (Some(512.5), Some(700.0), Some(87.0), Some(92.0), Some(1))
        );
        assert!(!a.slowing(), "idle is not a slowdown");
        let b = &r[1];
        assert_eq!(b.power_w, None, "an infinite power is no reading");
        assert_eq!(b.clock_reasons, Some(72), "the older field name");
        assert!(b.slowing());
    }

    #[test]
    fn rendered_readings_read_back_the_same() {
        let r = parse(PAGE);
        let page = render(&r);
        assert!(page.contains("# TYPE DCGM_FI_DEV_GPU_TEMP gauge"));
        assert_eq!(parse(&page), r);
        let odd = GpuReading {
            labels: [("pod".to_string(), "we\"ird\\".to_string())].into(),
            ..r[0].clone()
        };
        assert_eq!(parse(&render(std::slice::from_ref(&odd))), vec![odd]);
    }

    async fn serve(status: u16, body: String) -> String {
        use axum::routing::get;
        let app = axum::Router::new().route(
            "/metrics",
            get(move || {
                let body = body.clone();
                async move {
                    (
                        axum::http::StatusCode::from_u16(status).unwrap_or_default(),
                        body,
                    )
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        format!("http://{addr}/metrics")
    }

    #[tokio::test]
    async fn scrapes_pages_and_says_why_not() {
        let client = crate::sources::metrics::scrape::client();
        let t = Duration::from_secs(2);
        let ok = serve(200, PAGE.to_string()).await;
        assert_eq!(scrape(&client, &ok, t).await.unwrap().len(), 2);
        let down = serve(503, "exporter down".into()).await;
        assert!(matches!(
            scrape(&client, &down, t).await,
            Err(ThermalError::Status { status: 503, .. })
        ));
        let empty = serve(200, "node_load1 0.5\n".into()).await;
        assert!(matches!(
            scrape(&client, &empty, t).await,
            Err(ThermalError::Empty { .. })
        ));
        let huge = serve(200, "#".repeat(MAX_PAGE + 1)).await;
        let e = scrape(&client, &huge, t).await.unwrap_err();
        assert!(e.to_string().contains("reading the page"), "{e}");
    }
}
