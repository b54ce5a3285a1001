//! Helpers shared by the sidecar's HTTP tests: stand-in workers whose
//! Prometheus page each test controls, a sidecar on a loopback port, and a
//! small HTTP client.

#![allow(dead_code)]

use axum::Router;
use axum::routing::get;
use kvgate_sidecar::config::Config;
use kvgate_sidecar::{Sidecar, api};
use parking_lot::Mutex;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A PUB socket on a free loopback port, and its endpoint: a peer or an
/// engine publisher played by a test.
pub fn publisher(ctx: &zmq::Context) -> (zmq::Socket, String) {
    let s = ctx.socket(zmq::PUB).unwrap();
    s.set_linger(0).unwrap();
    s.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = s.get_last_endpoint().unwrap().unwrap();
    (s, endpoint)
}

/// A worker's metrics endpoint; `None` makes it answer 500.
#[derive(Clone)]
pub struct Page(Arc<Mutex<Option<String>>>);

impl Page {
    pub fn set(&self, running: u32, usage: f64) {
        *self.0.lock() = Some(format!(
            "vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} 0\n\
             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage}\n\
             vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"}} 1.0\n"
        ));
    }
    pub fn break_it(&self) {
        *self.0.lock() = None;
    }
    /// Some other program's Prometheus page on the worker's metrics URL.
    pub fn not_an_engine(&self) {
        *self.0.lock() = Some(
            "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n\
             # TYPE process_cpu_seconds_total counter\n\
             process_cpu_seconds_total 1\n\
             node_load1 0.42\n"
                .into(),
        );
    }
}

pub async fn fake_worker() -> (String, Page) {
    let page = Page(Arc::new(Mutex::new(None)));
    page.set(0, 0.0);
    let p = page.clone();
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let p = p.clone();
            async move {
                match p.0.lock().clone() {
                    Some(text) => (axum::http::StatusCode::OK, text),
                    None => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, String::new()),
                }
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, page)
}

pub async fn sidecar(workers: &[&str]) -> (String, Arc<Sidecar>) {
    sidecar_with(workers, None).await
}

pub async fn sidecar_with(workers: &[&str], token: Option<&str>) -> (String, Arc<Sidecar>) {
    let mut toml = String::from(
        "[scrape]\ninterval_ms = 50\ntimeout_ms = 200\ndown_after_ms = 300\n[server]\npublish_interval_ms = 10\n[[models]]\nname = \"m\"\nactive_decode_blocks_threshold = 0.5\n",
    );
    for (i, w) in workers.iter().enumerate() {
        toml.push_str(&format!(
            "[[workers]]\nworker_id = {}\nmodel_name = \"m\"\nendpoint = \"{w}\"\n",
            i + 1
        ));
    }
    sidecar_from(&toml, token).await
}

/// A sidecar from a whole config file, its control API on a loopback port.
pub async fn sidecar_from(toml: &str, token: Option<&str>) -> (String, Arc<Sidecar>) {
    let mut config = Config::parse(toml).unwrap();
    config.control.token = token.map(str::to_string);
    let sc = Sidecar::start(config).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let app = api::router(sc.clone());
    tokio::spawn(async move { axum::serve(l, app).await });
    (format!("http://{addr}"), sc)
}

/// Serves `sc`'s selection API on a loopback port; returns its base URL.
pub async fn selection_api(sc: &Arc<Sidecar>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let app = api::selection_router(sc.clone());
    tokio::spawn(async move { axum::serve(l, app).await });
    format!("http://{addr}")
}

pub async fn call(
    method: &str,
    url: &str,
    body: Option<Value>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let body = body.map(|b| b.to_string()).unwrap_or_default().into_bytes();
    call_raw(method, url, &[("content-type", "application/json")], body).await
}

pub async fn call_raw(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    use http_body_util::{BodyExt, Full};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(bytes::Bytes::from(body))).unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let body = resp
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, headers, body)
}

pub async fn json_of(method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
    let (s, _, b) = call(method, url, body).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

pub async fn wait_until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn workers_up(base: &str) -> usize {
    let (_, s) = json_of("GET", &format!("{base}/v1/state"), None).await;
    s["models"][0]["workers"].as_array().map_or(0, Vec::len)
}

/// A sample's value on the sidecar's `/metrics` page, 0 when absent.
pub fn metric(sc: &Sidecar, series: &str) -> f64 {
    sc.metrics()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A stand-in engine's KV event socket: a PUB socket on a free loopback
/// port, numbering its batches as engines do.
pub struct Publisher {
    pub sock: zmq::Socket,
    pub endpoint: String,
    pub seq: u64,
}

impl Publisher {
    pub fn bind(ctx: &zmq::Context) -> Publisher {
        let sock = ctx.socket(zmq::PUB).unwrap();
        sock.set_linger(0).unwrap();
        sock.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = sock.get_last_endpoint().unwrap().unwrap();
        Publisher {
            sock,
            endpoint,
            seq: 0,
        }
    }

    /// Sends `[topic, seq (u64 BE), payload]` with the next sequence number.
    pub fn publish(&mut self, payload: &[u8]) {
        self.sock
            .send_multipart([&b"kv-events"[..], &self.seq.to_be_bytes(), payload], 0)
            .unwrap();
        self.seq += 1;
    }

    /// Sends `events` as one vLLM batch (`[ts, events, dp_rank]`).
    pub fn publish_events(&mut self, events: Vec<rmpv::Value>) {
        let mut payload = Vec::new();
        let batch = rmpv::Value::Array(vec![1.0f64.into(), rmpv::Value::Array(events), 0.into()]);
        rmpv::encode::write_value(&mut payload, &batch).unwrap();
        self.publish(&payload);
    }
}
