//! What the sim's PD legs saw, for end-to-end tests to check: the last
//! requests' transfer fields and outcomes, bounded.

use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::Mutex;

/// Requests remembered; older ones are forgotten.
pub const KEEP: usize = 64;

#[derive(Debug, Clone)]
pub struct Record {
    pub request_id: String,
    /// `completions` or `chat`.
    pub endpoint: &'static str,
    /// `local`, `prefill`, `decode` or `rejected`.
    pub leg: &'static str,
    pub rank: Option<u32>,
    /// The body's `kv_transfer_params` (null when absent).
    pub kv_transfer_params: Value,
    pub bootstrap_room: Option<u64>,
    /// The HTTP status answered.
    pub status: u16,
    /// Blocks pulled or received for a decode leg.
    pub pulled_blocks: usize,
    /// Whether a decode leg prefilled locally after a failed load.
    pub recomputed: bool,
    /// Why the request failed, if it did.
    pub error: Option<String>,
    /// The body's top-level keys, in order: which fields reached the
    /// worker.
    pub body_keys: Vec<String>,
    /// The body's `vllm_xargs` (null when absent).
    pub vllm_xargs: Value,
    /// From the request's arrival to its response's headers: a prefill
    /// leg's whole compute (its answer is not streamed), a streamed
    /// leg's time to its first event.
    pub took_us: u64,
}

impl Record {
    /// The top-level keys of a JSON body (none when it is not an object).
    pub fn keys_of(body: &Value) -> Vec<String> {
        body.as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default()
    }
}

impl Record {
    fn json(&self) -> Value {
        json!({
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "leg": self.leg,
            "rank": self.rank,
            "kv_transfer_params": self.kv_transfer_params,
            "bootstrap_room": self.bootstrap_room,
            "status": self.status,
            "pulled_blocks": self.pulled_blocks,
            "recomputed": self.recomputed,
            "error": self.error,
            "body_keys": self.body_keys,
            "vllm_xargs": self.vllm_xargs,
            "took_us": self.took_us,
        })
    }
}

#[derive(Debug, Default)]
pub struct Recorder {
    recent: Mutex<VecDeque<Record>>,
}

impl Recorder {
    pub fn push(&self, r: Record) {
        let mut q = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() == KEEP {
            q.pop_front();
        }
        q.push_back(r);
    }

    /// Oldest first.
    pub fn json(&self) -> Vec<Value> {
        let q = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        q.iter().map(Record::json).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_last_requests() {
        let r = Recorder::default();
        for i in 0..KEEP + 5 {
            r.push(Record {
                request_id: i.to_string(),
                endpoint: "chat",
                leg: "local",
                rank: Some(0),
                kv_transfer_params: Value::Null,
                bootstrap_room: None,
                status: 200,
                pulled_blocks: 0,
                recomputed: false,
                error: None,
                body_keys: Vec::new(),
                vllm_xargs: Value::Null,
                took_us: 0,
            });
        }
        let all = r.json();
        assert_eq!(all.len(), KEEP);
        assert_eq!(all[0]["request_id"], "5");
    }
}
