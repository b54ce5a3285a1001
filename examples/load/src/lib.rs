//! kvgate-load: the load generator behind `cargo xtask demo` and
//! `cargo xtask bench`.
//!
//! * [`run_open_loop`] sends each request at its arrival offset whether or
//!   not earlier ones have finished, so overload shows up as latency and
//!   errors rather than as a slower send rate;
//! * [`run_closed_loop`] keeps a fixed number of requests in flight.
//!
//! TTFT is the time to the first SSE `data:` chunk for streaming requests
//! and to the first body byte otherwise. Workloads are in [`workload`].

pub mod summary;
pub mod workload;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use summary::Summary;

/// One request to send.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub path: String,
    pub body: Bytes,
    pub stream: bool,
    /// Arrival offset from the start of an open-loop run.
    pub at: Duration,
    /// Workload group, carried into the outcome.
    pub tag: String,
    pub prompt_tokens: Option<u64>,
}

/// What happened to one request.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub tag: String,
    /// HTTP status, or 0 when the request failed before one arrived.
    pub status: u16,
    pub error: Option<String>,
    pub ttft_us: Option<u64>,
    pub latency_us: u64,
    pub worker: Option<String>,
    pub rank: Option<String>,
    pub cached_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub reason: Option<String>,
    /// `Retry-After` on a 503, in seconds.
    pub retry_after_s: Option<u32>,
    pub chunks: u32,
    /// Gaps between a stream's tokens as the client saw them, µs, one per
    /// event after the first: what inter-token latency (ITL) is computed
    /// from. Events that arrive in one read have a gap of 0 between them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub itl_us: Vec<u64>,
    /// First bytes of an error body.
    pub error_body: Option<String>,
    /// Start offset from the beginning of the run.
    pub start_us: u64,
}

#[derive(Debug, Clone)]
pub struct Target {
    /// `http://host:port`
    pub base: String,
    pub timeout: Duration,
    pub headers: Vec<(String, String)>,
}

impl Target {
    pub fn new(base: impl Into<String>) -> Target {
        Target {
            base: base.into(),
            timeout: Duration::from_secs(120),
            headers: Vec::new(),
        }
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(c)
}

fn header(resp: &hyper::Response<hyper::body::Incoming>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn send(
    client: &HttpClient,
    target: &Target,
    spec: &RequestSpec,
    run_start: Instant,
) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome {
        tag: spec.tag.clone(),
        status: 0,
        error: None,
        ttft_us: None,
        latency_us: 0,
        worker: None,
        rank: None,
        cached_tokens: None,
        prompt_tokens: spec.prompt_tokens,
        reason: None,
        retry_after_s: None,
        chunks: 0,
        itl_us: Vec::new(),
        error_body: None,
        start_us: start.duration_since(run_start).as_micros() as u64,
    };
    let mut req = hyper::Request::post(format!("{}{}", target.base, spec.path))
        .header("content-type", "application/json");
    for (k, v) in &target.headers {
        req = req.header(k, v);
    }
    let req = match req.body(Full::new(spec.body.clone())) {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    let result = tokio::time::timeout(target.timeout, async {
        let resp = client.request(req).await.map_err(|e| format!("{e:?}"))?;
        out.status = resp.status().as_u16();
        out.worker = header(&resp, "x-kvgate-sim-worker");
        out.rank = header(&resp, "x-kvgate-sim-rank");
        out.cached_tokens =
            header(&resp, "x-kvgate-sim-cached-tokens").and_then(|v| v.parse().ok());
        out.reason = header(&resp, "x-kvgate-reason");
        out.retry_after_s = header(&resp, "retry-after").and_then(|v| v.parse().ok());
        let mut body = resp.into_body();
        let mut error_body = Vec::new();
        let mut sse = SseScanner::default();
        let mut last_event: Option<Instant> = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| e.to_string())?;
            let Some(data) = frame.data_ref() else {
                continue;
            };
            if out.status >= 400 && error_body.len() < 512 {
                error_body.extend_from_slice(&data[..data.len().min(512 - error_body.len())]);
            }
            let events = if spec.stream {
                sse.feed(data)
            } else {
                u32::from(!data.is_empty())
            };
            if events > 0 && out.ttft_us.is_none() {
                out.ttft_us = Some(start.elapsed().as_micros() as u64);
            }
            if spec.stream && events > 0 {
                let now = Instant::now();
                if let Some(prev) = last_event {
                    out.itl_us.push(now.duration_since(prev).as_micros() as u64);
                }
                // The rest of this read's events came with its first.
                out.itl_us
                    .extend(std::iter::repeat_n(0, events as usize - 1));
                last_event = Some(now);
            }
            out.chunks += events;
        }
        if !error_body.is_empty() {
            out.error_body = Some(String::from_utf8_lossy(&error_body).into_owned());
        }
        Ok::<(), String>(())
    })
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => out.error = Some(e),
        Err(_) => out.error = Some(format!("timed out after {:?}", target.timeout)),
    }
    out.latency_us = start.elapsed().as_micros() as u64;
    out
}

/// Counts SSE `data:` events across arbitrary chunk boundaries.
#[derive(Debug, Default)]
pub struct SseScanner {
    line: Vec<u8>,
}

impl SseScanner {
    /// Feeds bytes; returns how many `data:` lines (other than `[DONE]`)
    /// completed in them.
    pub fn feed(&mut self, bytes: &[u8]) -> u32 {
        let mut n = 0;
        for &b in bytes {
            if b == b'\n' {
                let line = std::mem::take(&mut self.line);
                if let Some(rest) = line.strip_prefix(b"data:")
                    && rest.trim_ascii() != b"[DONE]"
                {
                    n += 1;
                }
            } else {
                self.line.push(b);
            }
        }
        n
    }
}

/// Sends every spec at its `at` offset (scaled by `time_scale`), without
/// waiting for earlier ones. Returns outcomes in spec order.
pub async fn run_open_loop(
    target: &Target,
    specs: &[RequestSpec],
    time_scale: f64,
) -> Vec<Outcome> {
    open_loop(target, specs, time_scale, |client, target, spec, run_start| async move {
        send(&client, &target, &spec, run_start).await
    })
    .await
}

/// Like [`run_open_loop`], as a client that honours `Retry-After` would
/// behave: a 503 that carries one (at most `max_wait`) is sent once more
/// after that long. Returns each spec's first outcome and its retry's.
pub async fn run_open_loop_retrying(
    target: &Target,
    specs: &[RequestSpec],
    time_scale: f64,
    max_wait: Duration,
) -> Vec<(Outcome, Option<Outcome>)> {
    open_loop(
        target,
        specs,
        time_scale,
        move |client, target, spec, run_start| async move {
            let first = send(&client, &target, &spec, run_start).await;
            let wait = match (first.status, first.retry_after_s) {
                (503, Some(s)) if Duration::from_secs(u64::from(s)) <= max_wait => {
                    Duration::from_secs(u64::from(s))
                }
                _ => return (first, None),
            };
            tokio::time::sleep(wait).await;
            let retry = send(&client, &target, &spec, run_start).await;
            (first, Some(retry))
        },
    )
    .await
}

/// Starts `one` for every spec at its offset; results in spec order.
async fn open_loop<T, F, Fut>(
    target: &Target,
    specs: &[RequestSpec],
    time_scale: f64,
    one: F,
) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(HttpClient, Arc<Target>, RequestSpec, Instant) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let client = client();
    let target = Arc::new(target.clone());
    let run_start = Instant::now();
    let mut handles = Vec::with_capacity(specs.len());
    for spec in specs {
        let at = spec.at.mul_f64(time_scale.max(0.0));
        tokio::time::sleep_until(tokio::time::Instant::from_std(run_start + at)).await;
        handles.push(tokio::spawn(one(
            client.clone(),
            target.clone(),
            spec.clone(),
            run_start,
        )));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        if let Ok(o) = h.await {
            out.push(o);
        }
    }
    out
}

/// Keeps `concurrency` requests in flight until every spec was sent.
pub async fn run_closed_loop(
    target: &Target,
    specs: &[RequestSpec],
    concurrency: usize,
) -> Vec<Outcome> {
    let client = client();
    let target = Arc::new(target.clone());
    let specs: Arc<Vec<RequestSpec>> = Arc::new(specs.to_vec());
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let run_start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (client, target, specs, next) =
            (client.clone(), target.clone(), specs.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(spec) = specs.get(i) else { break };
                mine.push((i, send(&client, &target, spec, run_start).await));
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        if let Ok(v) = w.await {
            all.extend(v);
        }
    }
    all.sort_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, o)| o).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_across_chunk_boundaries() {
        let mut s = SseScanner::default();
        assert_eq!(s.feed(b"data: {\"a\""), 0);
        assert_eq!(s.feed(b":1}\n\ndata: {}\n\nda"), 2);
        assert_eq!(s.feed(b"ta: [DONE]\n\n"), 0);
    }
}
