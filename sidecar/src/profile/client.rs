//! One profile request: a streamed `/v1/completions` of random token ids,
//! timed at the client.

use super::sse::{Event, SseParser};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Uri;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rand::Rng;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// Token ids are drawn from this range: inside every common vocabulary
/// (32k and up), clear of the special tokens most put first.
const TOKEN_IDS: std::ops::Range<u32> = 1_000..30_000;

/// Bytes of one answer read at most: a stream of 16k tokens at a few
/// hundred bytes a chunk stays well inside.
const MAX_RESPONSE: usize = 64 << 20;

/// Bytes of an error answer's body quoted.
const MAX_ERROR_BODY: usize = 2 << 10;

/// Why a request did not give a sample.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// No connection: nothing listens there, or the connect timed out.
    Connect(String),
    /// An answer other than 2xx, with the start of its body.
    Status(u16, String),
    /// The answer broke off, was not a stream of completion chunks, or
    /// reported an error inside the stream.
    Stream(String),
    /// No end within the request's timeout.
    Timeout,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Connect(e) => write!(f, "cannot connect: {e}"),
            Failure::Status(s, body) => write!(f, "status {s}: {body}"),
            Failure::Stream(e) => write!(f, "{e}"),
            Failure::Timeout => write!(f, "timed out"),
        }
    }
}

/// One request's timings.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub sent: Instant,
    /// Its last token (or its first, when there was only one).
    pub done: Instant,
    pub ttft: Duration,
    /// `(last - first) / (tokens - 1)`, with two token chunks or more.
    pub itl: Option<Duration>,
}

/// Counts a request as late for its TTFT the moment it is: what lets a
/// step that cannot pass stop before its slowest requests end.
#[derive(Debug, Clone, Copy)]
pub struct Lateness<'a> {
    pub after: Duration,
    pub count: &'a AtomicUsize,
}

/// Sends profile requests to one worker.
#[derive(Debug, Clone)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    uri: Uri,
    /// The model's name as a JSON string.
    model: String,
}

impl Client {
    /// A client for `endpoint` (`http://host:port`, plain HTTP: the sweep
    /// talks to one worker directly, not through a gateway).
    pub fn new(endpoint: &str, model: &str, max_in_flight: usize) -> Result<Client, String> {
        let base = endpoint.trim_end_matches('/');
        if !base.starts_with("http://") {
            return Err(format!(
                "endpoint {endpoint:?}: expected http://HOST:PORT (the worker's plain-HTTP address)"
            ));
        }
        let uri: Uri = format!("{base}/v1/completions")
            .parse()
            .map_err(|e| format!("endpoint {endpoint:?}: {e}"))?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let http = HyperClient::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(max_in_flight)
            .build(connector);
        let model = serde_json::to_string(model).map_err(|e| e.to_string())?;
        Ok(Client { http, uri, model })
    }

    /// A request body: `isl` random token ids (a prompt no cache holds),
    /// `max_tokens` tokens to generate whatever the model would stop at.
    pub fn body(&self, isl: usize, max_tokens: u32, rng: &mut impl Rng) -> Bytes {
        let mut s = String::with_capacity(isl * 6 + 160);
        s.push_str("{\"model\":");
        s.push_str(&self.model);
        s.push_str(",\"prompt\":[");
        for i in 0..isl {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(s, "{}", rng.random_range(TOKEN_IDS));
        }
        let _ = write!(
            s,
            "],\"max_tokens\":{max_tokens},\"stream\":true,\"ignore_eos\":true,\"stream_options\":{{\"include_usage\":true}}}}"
        );
        Bytes::from(s)
    }

    /// Sends `body` and times its stream, giving up after `timeout`.
    pub async fn send(
        &self,
        body: Bytes,
        timeout: Duration,
        late: Option<Lateness<'_>>,
    ) -> Result<Sample, Failure> {
        let sent = Instant::now();
        let mut watch = Watch {
            deadline: sent + timeout,
            late_at: late.map(|l| (sent + l.after, l.count)),
        };
        let req = hyper::Request::post(self.uri.clone())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::ACCEPT, "text/event-stream")
            .body(Full::new(body))
            .map_err(|e| Failure::Stream(e.to_string()))?;
        let resp = watch.run(self.http.request(req)).await?.map_err(|e| {
            if e.is_connect() {
                Failure::Connect(chain(&e))
            } else {
                Failure::Stream(chain(&e))
            }
        })?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let mut text = Vec::new();
            while text.len() < MAX_ERROR_BODY {
                match watch.run(body.frame()).await {
                    Ok(Some(Ok(frame))) => {
                        if let Some(d) = frame.data_ref() {
                            text.extend_from_slice(&d[..d.len().min(MAX_ERROR_BODY - text.len())]);
                        }
                    }
                    _ => break,
                }
            }
            let text = String::from_utf8_lossy(&text).trim().to_string();
            return Err(Failure::Status(status.as_u16(), text));
        }
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        let mut timing = Timing::default();
        let mut read = 0usize;
        loop {
            let frame = watch.run(body.frame()).await?;
            let now = Instant::now();
            match frame {
                None => {
                    parser
                        .finish(&mut events)
                        .map_err(|e| Failure::Stream(e.to_string()))?;
                    timing.absorb(&mut events, now)?;
                    break;
                }
                Some(Err(e)) => {
                    return Err(Failure::Stream(format!("the stream broke: {}", chain(&e))));
                }
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        read += data.len();
                        if read > MAX_RESPONSE {
                            return Err(Failure::Stream(format!(
                                "an answer over {MAX_RESPONSE} bytes"
                            )));
                        }
                        parser
                            .push(data, &mut events)
                            .map_err(|e| Failure::Stream(e.to_string()))?;
                    }
                    timing.absorb(&mut events, now)?;
                    if timing.first.is_some() {
                        watch.late_at = None;
                    }
                }
            }
        }
        timing.sample(sent)
    }
}

/// What a stream's events tell of its timing.
#[derive(Debug, Default)]
struct Timing {
    first: Option<Instant>,
    last: Option<Instant>,
    /// Chunks that carried output.
    chunks: u64,
    /// The tokens the server's usage reports, when it does: a server may
    /// put more than one token in a chunk.
    usage: Option<u64>,
}

impl Timing {
    /// Takes the events read at `now`.
    fn absorb(&mut self, events: &mut Vec<Event>, now: Instant) -> Result<(), Failure> {
        for e in events.drain(..) {
            match e {
                Event::Chunk {
                    tokens,
                    completion_tokens,
                } => {
                    if tokens {
                        self.first.get_or_insert(now);
                        self.last = Some(now);
                        self.chunks += 1;
                    }
                    if let Some(n) = completion_tokens {
                        self.usage = Some(self.usage.map_or(n, |u| u.max(n)));
                    }
                }
                Event::Done => {}
                Event::Error(e) => {
                    return Err(Failure::Stream(format!(
                        "the server streamed an error: {e}"
                    )));
                }
            }
        }
        Ok(())
    }

    fn sample(&self, sent: Instant) -> Result<Sample, Failure> {
        let (Some(first), Some(last)) = (self.first, self.last) else {
            return Err(Failure::Stream(
                "the answer ended before its first token (not a completion stream?)".into(),
            ));
        };
        let tokens = self.usage.unwrap_or(0).max(self.chunks);
        let itl = (self.chunks >= 2).then(|| {
            let gaps = u32::try_from(tokens - 1).unwrap_or(u32::MAX);
            (last - first) / gaps
        });
        Ok(Sample {
            sent,
            done: last,
            ttft: first - sent,
            itl,
        })
    }
}

/// Bounds each wait of one request by its deadline, and counts it late
/// once its first token is overdue.
struct Watch<'a> {
    deadline: Instant,
    late_at: Option<(Instant, &'a AtomicUsize)>,
}

impl Watch<'_> {
    async fn run<F: Future>(&mut self, fut: F) -> Result<F::Output, Failure> {
        tokio::pin!(fut);
        loop {
            let late_at = self.late_at.map(|(at, _)| at);
            tokio::select! {
                out = &mut fut => return Ok(out),
                _ = tokio::time::sleep_until(self.deadline) => return Err(Failure::Timeout),
                _ = async { if let Some(at) = late_at { tokio::time::sleep_until(at).await } }, if late_at.is_some() => {
                    if let Some((_, count)) = self.late_at.take() {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}

/// An error and its causes, as one line: hyper's own message alone is
/// often just "client error (Connect)".
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let _ = write!(out, ": {s}");
        source = s.source();
    }
    out
}
