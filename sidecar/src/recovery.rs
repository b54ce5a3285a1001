//! Start-up recovery of the prefix index (`[indexer] peers`,
//! `--indexer-peers`): the first peer whose `GET /dump` arrives whole and
//! decodes is replayed into the index before any KV event is applied;
//! events then follow as they would have (the engines' replay sockets
//! repair what the subscribers missed meanwhile, as after any gap).
//!
//! A peer that does not answer in `indexer.timeout_ms`, answers an error
//! (a peer still recovering answers 503), declares or sends more than
//! `indexer.max_dump_bytes` or a dump that does not decode, is skipped for
//! the next one. When none gives a dump the sidecar carries on with an
//! empty index, as without recovery; that is a warning, not an error.
//!
//! With a control token the request carries it: a sidecar with a token
//! serves `/dump` to its holders only. A peer that needs none (a Dynamo
//! selector) ignores it.

use crate::config::Indexer;
use crate::metrics::KvMetrics;
use crate::sources::body::{BodyError, read_capped};
use crate::sources::kv::dump::{self, Dump, DumpError};
use crate::sources::kv::plane::{Plane, RestoreReport};
use crate::sources::metrics::scrape::HttpClient;
use bytes::Bytes;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use thiserror::Error;

/// What decoding and replaying may add to fetching: seconds for the
/// largest dumps a body cap lets in.
const REPLAY_SLACK: Duration = Duration::from_secs(30);

/// How long the index thread holds batches back for a recovery: every peer
/// tried in turn, then the replay. `None` when no peer is configured.
pub(crate) fn hold(ix: &Indexer) -> Option<Duration> {
    let peers = u32::try_from(ix.peers.len()).ok().filter(|n| *n > 0)?;
    Some(
        ix.timeout
            .saturating_mul(peers)
            .saturating_add(REPLAY_SLACK),
    )
}

#[derive(Debug, Error)]
enum FetchError {
    #[error("bad URL: {0}")]
    Url(String),
    #[error("{0}")]
    Request(String),
    #[error("answered {0}")]
    Status(hyper::StatusCode),
    #[error("reading the body: {0} (indexer.max_dump_bytes is {1})")]
    Body(String, usize),
    #[error(
        "the dump declares {declared} bytes (Content-Length), over indexer.max_dump_bytes ({cap}): refused unread"
    )]
    Declared { declared: u64, cap: usize },
    #[error("no whole answer within {0:?}")]
    Timeout(Duration),
    #[error("the dump does not decode: {0}")]
    Decode(#[from] DumpError),
    #[error("decoding stopped: {0}")]
    Task(String),
}

/// What recovery reads and feeds, handed to it at start.
pub(crate) struct Handles {
    pub(crate) indexer: Indexer,
    pub(crate) client: HttpClient,
    pub(crate) plane: Arc<Plane>,
    pub(crate) metrics: KvMetrics,
    /// Set while recovery is under way: the sidecar is not ready.
    pub(crate) recovering: Recovering,
    /// The control token, sent to every peer.
    pub(crate) token: Option<String>,
}

pub(crate) async fn run(h: Handles) {
    recover(&h).await;
    h.recovering.0.store(false, Ordering::Release);
}

/// Whether start-up recovery is still under way; readiness reads it.
#[derive(Debug, Clone)]
pub(crate) struct Recovering(Arc<AtomicBool>);

impl Recovering {
    /// Under way from the start when there are peers to recover from.
    pub(crate) fn new(ix: &Indexer) -> Recovering {
        Recovering(Arc::new(AtomicBool::new(!ix.peers.is_empty())))
    }

    pub(crate) fn under_way(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

async fn recover(h: &Handles) {
    let ix = &h.indexer;
    let started = Instant::now();
    let mut got = None;
    for peer in &ix.peers {
        match fetch(&h.client, peer, ix, h.token.as_deref()).await {
            Ok((dump, bytes)) => {
                got = Some((peer, dump, bytes));
                break;
            }
            Err(e) => tracing::warn!(peer = %peer, error = %e, "no index dump from this peer"),
        }
    }
    let Some((peer, dump, bytes)) = got else {
        h.plane.release();
        h.metrics
            .recovery_seconds
            .set(started.elapsed().as_secs_f64());
        tracing::warn!(
            peers = ?ix.peers,
            "no peer gave an index dump: starting with an empty prefix index, which KV events fill"
        );
        return;
    };
    let age_ms = crate::clock::now_ms().saturating_sub(dump.created_at_ms);
    let offered = dump.blocks();
    let Some(report) = h.plane.restore(dump).await else {
        tracing::error!(peer = %peer, "the index thread is gone: nothing recovered");
        return;
    };
    let seconds = started.elapsed().as_secs_f64();
    record(&h.metrics, &report, seconds);
    tracing::info!(
        peer = %peer,
        blocks = report.recovered,
        offered,
        dropped = ?report.dropped,
        dropped_ranks = ?report.dropped_ranks,
        bytes,
        dump_age_ms = age_ms,
        seconds,
        "prefix index recovered from a peer"
    );
}

fn record(m: &KvMetrics, report: &RestoreReport, seconds: f64) {
    m.recovered_blocks.inc_by(report.recovered);
    for (why, n) in &report.dropped {
        m.recovery_dropped
            .with_label_values(&[why.as_str()])
            .inc_by(*n);
    }
    m.recovery_seconds.set(seconds);
}

/// One peer's dump, decoded, and its size in bytes.
async fn fetch(
    client: &HttpClient,
    peer: &str,
    ix: &Indexer,
    token: Option<&str>,
) -> Result<(Dump, usize), FetchError> {
    let url = format!("{}/dump", peer.trim_end_matches('/'));
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| FetchError::Url(format!("{url}: {e}")))?;
    let body = tokio::time::timeout(ix.timeout, get(client, uri, token, ix.max_dump_bytes))
        .await
        .map_err(|_| FetchError::Timeout(ix.timeout))??;
    let size = body.len();
    // Decoding a large dump takes tens of milliseconds: off the runtime.
    let dump = tokio::task::spawn_blocking(move || dump::decode(&body))
        .await
        .map_err(|e| FetchError::Task(e.to_string()))??;
    Ok((dump, size))
}

async fn get(
    client: &HttpClient,
    uri: hyper::Uri,
    token: Option<&str>,
    cap: usize,
) -> Result<Bytes, FetchError> {
    let mut req = hyper::Request::get(uri);
    if let Some(t) = token {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = req
        .body(http_body_util::Empty::new())
        .map_err(|e| FetchError::Request(e.to_string()))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| FetchError::Request(e.to_string()))?;
    if resp.status() != hyper::StatusCode::OK {
        return Err(FetchError::Status(resp.status()));
    }
    read_capped(resp.into_body(), cap)
        .await
        .map_err(|e| match e {
            BodyError::Declared { declared, cap } => FetchError::Declared { declared, cap },
            BodyError::Read(e) => FetchError::Body(e, cap),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::metrics::scrape::client;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that answers every request with `answer` and then holds the
    /// connection open, sending nothing more.
    async fn stalling_peer(answer: Vec<u8>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut s, _)) = l.accept().await {
                let mut request = [0u8; 4096];
                let _ = s.read(&mut request).await;
                let _ = s.write_all(&answer).await;
                held.push(s);
            }
        });
        format!("http://{addr}")
    }

    fn indexer(max_dump_bytes: usize) -> Indexer {
        Indexer {
            peers: Vec::new(),
            timeout: Duration::from_secs(60),
            max_dump_bytes,
        }
    }

    /// The fetch's error, which must come well before `indexer.timeout_ms`.
    async fn refusal(peer: &str, ix: &Indexer) -> FetchError {
        tokio::time::timeout(Duration::from_secs(5), fetch(&client(), peer, ix, None))
            .await
            .expect("a refusal long before the peer's timeout")
            .map(|_| ())
            .unwrap_err()
    }

    #[tokio::test]
    async fn a_dump_declared_over_the_cap_is_refused_before_its_body() {
        let peer =
            stalling_peer(b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\nKVGD".to_vec())
                .await;
        let e = refusal(&peer, &indexer(1 << 30)).await;
        assert!(
            matches!(
                e,
                FetchError::Declared {
                    declared: 1099511627776,
                    cap: 1073741824
                }
            ),
            "{e}"
        );
        let why = e.to_string();
        assert!(
            why.contains("Content-Length") && why.contains("indexer.max_dump_bytes"),
            "{why}"
        );
    }

    #[tokio::test]
    async fn a_dump_without_a_length_is_cut_off_at_the_cap() {
        let mut answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for _ in 0..32 {
            answer.extend_from_slice(b"1000\r\n");
            answer.extend_from_slice(&[0u8; 0x1000]);
            answer.extend_from_slice(b"\r\n");
        }
        let peer = stalling_peer(answer).await;
        let e = refusal(&peer, &indexer(64 << 10)).await;
        assert!(matches!(e, FetchError::Body(_, 65536)), "{e}");
    }
}
