//! `kvgate-sidecar status`: the fleet at a glance, from a running sidecar's
//! `/v1/state`.

use serde_json::Value;
use std::fmt::Write as _;

/// Renders `/v1/state` as a table: per model its thresholds and shedding
/// state, per worker and rank the load the router sees.
pub fn render(state: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "snapshot version {}  epoch {:x}",
        state["version"],
        state["epoch"].as_u64().unwrap_or(0)
    );
    for m in state["models"].as_array().into_iter().flatten() {
        let th = &m["thresholds"];
        let show = |v: &Value| match v {
            Value::Null => "-".to_string(),
            v => v.to_string(),
        };
        let workers = m["workers"].as_array().cloned().unwrap_or_default();
        let worker_busy = |w: &Value| {
            let ranks = w["ranks"].as_array().cloned().unwrap_or_default();
            !ranks.is_empty() && ranks.iter().all(|r| r["busy"].as_bool() == Some(true))
        };
        let busy = workers.iter().filter(|w| worker_busy(w)).count();
        let shedding = !workers.is_empty() && busy == workers.len();
        let _ = writeln!(
            out,
            "\nmodel {}  ({})\n  thresholds: decode blocks > {}  prefill tokens > {}  prefill > {} x batch\n  workers up {}, busy {}{}",
            m["name"].as_str().unwrap_or("?"),
            m["mode"].as_str().unwrap_or(""),
            show(&th["active_decode_blocks_threshold"]),
            show(&th["active_prefill_tokens_threshold"]),
            show(&th["active_prefill_tokens_threshold_frac"]),
            workers.len(),
            busy,
            if shedding {
                format!(
                    "  SHEDDING (Retry-After {}s)",
                    m["retry_after_s"].as_u64().unwrap_or(0)
                )
            } else {
                String::new()
            },
        );
        if workers.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "  {:>6}  {:<21} {:>4} {:>9} {:>8} {:>15} {:>5} {:>5}  state",
            "worker", "endpoint", "rank", "prefill", "decode", "kv used/total", "run", "wait",
        );
        for w in &workers {
            for r in w["ranks"].as_array().into_iter().flatten() {
                let kv = format!("{}/{}", r["kv_used_blocks"], r["kv_total_blocks"]);
                let _ = writeln!(
                    out,
                    "  {:>6}  {:<21} {:>4} {:>9} {:>8} {:>15} {:>5} {:>5}  {}",
                    w["worker_id"].to_string(),
                    w["endpoint"].as_str().unwrap_or("?"),
                    r["dp_rank"].to_string(),
                    r["active_prefill_tokens"].to_string(),
                    r["active_decode_blocks"].to_string(),
                    kv,
                    r["running"].to_string(),
                    r["waiting"].to_string(),
                    if r["busy"].as_bool() == Some(true) {
                        "BUSY"
                    } else {
                        "ok"
                    },
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn shows_load_busy_ranks_and_shedding() {
        let state = json!({
            "version": 12, "epoch": 255,
            "models": [{
                "name": "m", "mode": "approximate", "retry_after_s": 3,
                "thresholds": {"active_decode_blocks_threshold": 0.85,
                               "active_prefill_tokens_threshold": null,
                               "active_prefill_tokens_threshold_frac": null},
                "workers": [{"worker_id": 1, "endpoint": "10.0.0.1:8000", "ranks": [
                    {"dp_rank": 0, "active_prefill_tokens": 512, "active_decode_blocks": 90,
                     "kv_used_blocks": 90, "kv_total_blocks": 100, "running": 4, "waiting": 2, "busy": true}
                ]}]
            }]
        });
        let text = render(&state);
        assert!(text.contains("model m"), "{text}");
        assert!(
            text.contains("decode blocks > 0.85  prefill tokens > -"),
            "{text}"
        );
        assert!(text.contains("SHEDDING (Retry-After 3s)"), "{text}");
        assert!(text.contains("90/100"), "{text}");
        assert!(text.contains("BUSY"), "{text}");
    }
}
