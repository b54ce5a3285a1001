//! Scraping each worker's Prometheus endpoint on an interval.

use super::promtext::{self, RankMetrics};
use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

pub type HttpClient = Client<HttpConnector, Empty<Bytes>>;

pub fn client() -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(Duration::from_secs(1)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(c)
}

/// Bytes of a metrics page we are willing to read; vLLM's is ~50 KiB.
const MAX_PAGE: usize = 8 << 20;

/// One scrape: fetch, parse, extract the per-rank load.
pub(crate) async fn scrape_once(
    client: &HttpClient,
    url: &str,
    timeout: Duration,
    dp_size: u32,
    start_rank: u32,
    block_size: u32,
) -> Result<(Vec<RankMetrics>, usize), String> {
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| format!("bad metrics URL {url}: {e}"))?;
    let fetch = async {
        let resp = client
            .get(uri)
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("GET {url}: status {}", resp.status()));
        }
        crate::sources::body::read_capped(resp.into_body(), MAX_PAGE)
            .await
            .map_err(|e| format!("reading {url}: {e}"))
    };
    let body = tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("GET {url}: timed out after {timeout:?}"))??;
    let text =
        std::str::from_utf8(&body).map_err(|_| format!("{url}: metrics page is not UTF-8"))?;
    let parsed = promtext::parse(text);
    if parsed.samples.is_empty() {
        return Err(format!("{url}: no samples in the metrics page"));
    }
    if !promtext::is_engine_page(&parsed) {
        return Err(format!(
            "{url}: metrics page has none of vLLM's or SGLang's metrics (is metrics_url the engine's?)"
        ));
    }
    Ok((
        promtext::extract(&parsed, dp_size, start_rank, block_size),
        parsed.malformed_lines,
    ))
}
