//! The engine's batch control, `POST /v1/admin/batch` (the seed's §4):
//! what the thermal controller calls when capping new work is not enough,
//! because a running decode batch keeps its heat until it is cut.

use crate::config::EvictPolicy;
use crate::sources::body::read_capped;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use thiserror::Error;

/// An answer is a few counts and the evicted ids; a batch of thousands of
/// ids fits many times over.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BatchRequest {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub force_evict: Option<u32>,
    pub policy: EvictPolicy,
    pub dry_run: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BatchResponse {
    pub previous_running: u32,
    pub new_running: u32,
    #[serde(default)]
    pub evicted_request_ids: Vec<String>,
    #[serde(default)]
    pub estimated_watts_saved: f64,
    pub new_max_num_seqs: u32,
}

#[derive(Debug, Error)]
pub enum BatchError {
    #[error("{0}")]
    Request(String),
    #[error("the engine answered {status}: {body}")]
    Status { status: u16, body: String },
    #[error("the engine's answer is not a batch response: {0}")]
    Body(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Calls engines' batch control; cheap to clone.
#[derive(Clone)]
pub struct BatchClient {
    client: Client<HttpConnector, Full<Bytes>>,
    token: Option<String>,
    timeout: Duration,
}

impl BatchClient {
    pub fn new(token: Option<String>, timeout: Duration) -> BatchClient {
        let mut c = HttpConnector::new();
        c.set_connect_timeout(Some(timeout));
        c.set_nodelay(true);
        BatchClient {
            client: Client::builder(TokioExecutor::new()).build(c),
            token,
            timeout,
        }
    }

    /// Sends `req` to the engine at `endpoint` (`ip:port`, the worker's).
    pub async fn call(
        &self,
        endpoint: &str,
        req: &BatchRequest,
    ) -> Result<BatchResponse, BatchError> {
        let body = serde_json::to_vec(req).map_err(|e| BatchError::Request(e.to_string()))?;
        let mut b = hyper::Request::post(format!("http://{endpoint}/v1/admin/batch"))
            .header("content-type", "application/json");
        if let Some(t) = &self.token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        let request = b
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| BatchError::Request(e.to_string()))?;
        let exchange = async {
            let resp = self
                .client
                .request(request)
                .await
                .map_err(|e| BatchError::Request(e.to_string()))?;
            let status = resp.status();
            let bytes = read_capped(resp.into_body(), MAX_RESPONSE_BYTES)
                .await
                .map_err(|e| BatchError::Body(e.to_string()))?;
            if !status.is_success() {
                let text = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned();
                return Err(BatchError::Status {
                    status: status.as_u16(),
                    body: text,
                });
            }
            serde_json::from_slice(&bytes).map_err(|e| BatchError::Body(e.to_string()))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| BatchError::Timeout(self.timeout))?
    }
}

/// What to ask of a worker's engine when its cap becomes `cap` (0: no
/// cap) while it runs `running`: a lower `max_num_seqs`, and with `evict`
/// the eviction of what runs over it, together (the seed's §5: evicted
/// work comes straight back otherwise). `max_num_seqs` is per engine, so a
/// cap is split over the worker's DP ranks; `restore` is what an uncapped
/// engine gets back.
pub fn request_for(
    cap: u32,
    running: u32,
    ranks: u32,
    restore: u32,
    policy: EvictPolicy,
    evict: bool,
) -> BatchRequest {
    if cap == 0 {
        return BatchRequest {
            max_num_seqs: Some(restore.max(1)),
            policy,
            ..Default::default()
        };
    }
    BatchRequest {
        max_num_seqs: Some(cap.div_ceil(ranks.max(1)).max(1)),
        force_evict: Some(running.saturating_sub(cap)).filter(|n| evict && *n > 0),
        policy,
        dry_run: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_sets_the_batch_and_evicts_together() {
        let r = request_for(10, 16, 2, 32, EvictPolicy::LargestKv, true);
        assert_eq!(
            (r.max_num_seqs, r.force_evict, r.dry_run),
            (Some(5), Some(6), false)
        );
        let body = serde_json::to_value(&r).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"max_num_seqs": 5, "force_evict": 6, "policy": "largest_kv", "dry_run": false})
        );
        let under = request_for(10, 4, 1, 32, EvictPolicy::Lru, true);
        assert_eq!((under.max_num_seqs, under.force_evict), (Some(10), None));
        let gentle = request_for(10, 16, 1, 32, EvictPolicy::Lru, false);
        assert_eq!(
            (gentle.max_num_seqs, gentle.force_evict),
            (Some(10), None),
            "not hot enough to evict: the batch shrinks as requests finish"
        );
        let restore = request_for(0, 4, 1, 32, EvictPolicy::Lru, true);
        assert_eq!(
            (restore.max_num_seqs, restore.force_evict),
            (Some(32), None)
        );
    }

    #[test]
    fn responses_parse_in_the_seeds_shape() {
        let r: BatchResponse = serde_json::from_str(
            r#"{"previous_running": 16, "new_running": 10, "evicted_request_ids": ["a","b"],
                "estimated_watts_saved": 19.2, "new_max_num_seqs": 10}"#,
        )
        .unwrap();
        assert_eq!(
            (r.previous_running, r.new_running, r.new_max_num_seqs),
            (16, 10, 10)
        );
        assert!(serde_json::from_str::<BatchResponse>(r#"{"ok": true}"#).is_err());
    }
}
