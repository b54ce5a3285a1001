//! `kvgate-sidecar status`: the fleet at a glance, from a running sidecar's
//! `/v1/state`.

use super::views::{ModelView, StateView};
use kvgate_core::{Role, WorkerState};
use serde::Serialize;
use std::fmt::Write as _;

/// Renders `/v1/state` as a table: per model its thresholds and shedding
/// state, per worker and rank the load the router sees.
pub fn render(state: &StateView) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "snapshot version {}  epoch {:x}",
        state.version, state.epoch
    );
    if !state.unauthorized.is_empty() {
        let counts: Vec<String> = state
            .unauthorized
            .iter()
            .map(|(path, n)| format!("{path} {n}"))
            .collect();
        let _ = writeln!(
            out,
            "refused for want of the control token (401): {}",
            counts.join(", ")
        );
        if state
            .unauthorized
            .keys()
            .any(|p| p == "/v1/bookings" || p == "/v1/routed")
        {
            // The one place this shows besides a counter: Envoy's filter
            // routes on without its bookings.
            let _ = writeln!(
                out,
                "  the filter's reports are refused: set sidecar_token in its plugin configuration to this sidecar's control token"
            );
        }
    }
    for m in &state.models {
        model(&mut out, m);
    }
    out
}

fn model(out: &mut String, m: &ModelView) {
    // As JSON writes numbers (1.0, not 1), the way the API shows them.
    fn show<T: Serialize>(v: Option<T>) -> String {
        v.and_then(|v| serde_json::to_string(&v).ok())
            .unwrap_or_else(|| "-".into())
    }
    let th = &m.thresholds;
    let busy = m.workers.iter().filter(|w| worker_busy(w)).count();
    let shedding = !m.workers.is_empty() && busy == m.workers.len();
    let _ = writeln!(
        out,
        "\nmodel {}  ({})\n  thresholds: decode blocks > {}  prefill tokens > {}  prefill > {} x batch\n  workers up {}, busy {}{}",
        m.name,
        m.mode.as_str(),
        show(th.active_decode_blocks),
        show(th.active_prefill_tokens),
        show(th.active_prefill_tokens_frac),
        m.workers.len(),
        busy,
        if shedding {
            format!("  SHEDDING (Retry-After {}s)", m.retry_after_s)
        } else {
            String::new()
        },
    );
    if let Some(p) = &m.plan {
        let _ = writeln!(
            out,
            "  planner: desired {}  ready {}{}",
            p.desired,
            p.ready,
            if p.scale_up_eta_s > 0 {
                format!("  scale-up serving in ~{}s", p.scale_up_eta_s)
            } else {
                String::new()
            },
        );
    }
    if let Some(d) = &m.disaggregation {
        let up = |role| m.workers.iter().filter(|w| w.role == role).count();
        let _ = writeln!(
            out,
            "  disaggregation {}: {}  (prefill workers up {}, decode {}, both {})",
            d.protocol.as_str(),
            if m.disaggregated {
                "split"
            } else {
                "served whole, no prefill or no decode worker up"
            },
            up(Role::Prefill),
            up(Role::Decode),
            up(Role::Both),
        );
    }
    if m.workers.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "  {:>6}  {:<21} {:<7} {:>4} {:>9} {:>8} {:>15} {:>5} {:>5}  state",
        "worker", "endpoint", "role", "rank", "prefill", "decode", "kv used/total", "run", "wait",
    );
    for w in &m.workers {
        for r in &w.ranks {
            let kv = format!("{}/{}", r.kv_used_blocks, r.kv_total_blocks);
            let _ = writeln!(
                out,
                "  {:>6}  {:<21} {:<7} {:>4} {:>9} {:>8} {:>15} {:>5} {:>5}  {}",
                w.id,
                w.endpoint,
                w.role.as_str(),
                r.rank,
                r.active_prefill_tokens,
                r.active_decode_blocks,
                kv,
                r.running,
                r.waiting,
                worker_state(w, r.busy),
            );
        }
    }
}

/// A rank's state: busy or ok, then what the worker is beyond that.
fn worker_state(w: &WorkerState, busy: bool) -> String {
    let mut s = if busy { "BUSY" } else { "ok" }.to_string();
    if w.draining {
        s.push_str(" DRAINING");
    }
    match w.thermal.state {
        kvgate_core::ThermalState::Throttling => {
            let _ = write!(s, " HOT cap {}/{}", w.thermal.in_flight, w.thermal.cap);
        }
        kvgate_core::ThermalState::Warm => s.push_str(" warm"),
        kvgate_core::ThermalState::Unknown => s.push_str(" heat-unknown"),
        _ => {}
    }
    s
}

/// The planner's last tick per model (`GET /v1/planner`): why it wants
/// what it wants.
pub fn render_planner(v: &super::planner::PlannerView) -> String {
    let mut out = String::new();
    for m in &v.models {
        let _ = writeln!(
            out,
            "\nplanner {}: desired {}  ready {}  floor {}  reason {}  (SLA TTFT {} ms, ITL {} ms)",
            m.model,
            m.desired,
            m.ready,
            m.lower_bound,
            m.reason.as_str(),
            m.ttft_sla_ms,
            m.itl_sla_ms
        );
        if let Some(p) = &m.pending {
            let _ = writeln!(
                out,
                "  pending decision {}: {} -> {} for {} ms",
                p.id, p.from, p.to, p.age_ms
            );
        }
        if let Some([n, isl, osl]) = m.predicted {
            let _ = writeln!(
                out,
                "  next interval: {n:.0} requests, ISL {isl:.0}, OSL {osl:.0}"
            );
        }
        for e in &m.estimates {
            let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
            let _ = writeln!(
                out,
                "  worker {:>6}: est. TTFT {} ms  ITL {} ms{}",
                e.worker_id,
                ms(e.ttft_ms),
                ms(e.itl_ms),
                if m.draining.contains(&e.worker_id) {
                    "  draining"
                } else {
                    ""
                }
            );
        }
    }
    out
}

fn worker_busy(w: &WorkerState) -> bool {
    !w.ranks.is_empty() && w.ranks.iter().all(|r| r.busy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn shows_load_busy_ranks_and_shedding() {
        let state: StateView = serde_json::from_value(json!({
            "version": 12, "built_at_ms": 1, "epoch": 255,
            "models": [{
                "name": "m", "mode": "approximate", "retry_after_s": 3, "shard_count": 0,
                "thresholds": {"active_decode_blocks_threshold": 0.85,
                               "active_prefill_tokens_threshold": null,
                               "active_prefill_tokens_threshold_frac": null},
                "workers": [{"worker_id": 1, "tenant_id": "default", "endpoint": "10.0.0.1:8000",
                             "block_size": 16, "ranks": [
                    {"dp_rank": 0, "slot": 0, "active_prefill_tokens": 512, "active_decode_blocks": 90,
                     "kv_used_blocks": 90, "kv_total_blocks": 100, "max_num_batched_tokens": 0,
                     "running": 4, "waiting": 2, "busy": true}
                ]}]
            }]
        }))
        .unwrap();
        let text = render(&state);
        assert!(text.contains("snapshot version 12  epoch ff"), "{text}");
        assert!(text.contains("model m  (approximate)"), "{text}");
        assert!(
            text.contains("decode blocks > 0.85  prefill tokens > -"),
            "{text}"
        );
        let mut one = state.clone();
        one.models[0].thresholds.active_decode_blocks = Some(1.0);
        assert!(render(&one).contains("decode blocks > 1.0 "));
        assert!(text.contains("SHEDDING (Retry-After 3s)"), "{text}");
        assert!(text.contains("90/100"), "{text}");
        assert!(text.contains("BUSY"), "{text}");
        assert!(text.contains("10.0.0.1:8000         both"), "{text}");
        assert!(!text.contains("disaggregation"), "{text}");
        assert!(
            !text.contains("401"),
            "nothing refused, nothing said: {text}"
        );
        let mut refused = state.clone();
        refused.unauthorized = [("/v1/bookings".to_string(), 7)].into();
        let text = render(&refused);
        assert!(text.contains("(401): /v1/bookings 7"), "{text}");
        assert!(text.contains("set sidecar_token"), "{text}");
    }

    #[test]
    fn shows_roles_and_whether_a_model_splits() {
        let worker = |id: u64, role: &str| {
            json!({
                "worker_id": id, "tenant_id": "default", "endpoint": format!("10.0.0.{id}:8000"),
                "block_size": 16, "role": role,
                "ranks": [{"dp_rank": 0, "slot": id, "active_prefill_tokens": 0,
                           "active_decode_blocks": 0, "kv_used_blocks": 0, "kv_total_blocks": 100,
                           "max_num_batched_tokens": 0, "running": 0, "waiting": 0, "busy": false}]
            })
        };
        let mut state: StateView = serde_json::from_value(json!({
            "version": 1, "built_at_ms": 1, "epoch": 1,
            "models": [{
                "name": "m", "mode": "approximate", "retry_after_s": 0, "shard_count": 0,
                "thresholds": {},
                "disaggregated": true,
                "disaggregation": {
                    "protocol": "vllm-nixl",
                    "conditional": {"max_uncached_tokens": 2048, "max_uncached_ratio": 0.7},
                    "on_prefill_failure": "local", "prefill_timeout_ms": 30000,
                    "decode_affinity": 3.0
                },
                "workers": [worker(1, "prefill"), worker(2, "decode")]
            }]
        }))
        .unwrap();
        let text = render(&state);
        assert!(
            text.contains(
                "disaggregation vllm-nixl: split  (prefill workers up 1, decode 1, both 0)"
            ),
            "{text}"
        );
        assert!(text.contains("10.0.0.1:8000         prefill"), "{text}");
        assert!(text.contains("10.0.0.2:8000         decode"), "{text}");
        state.models[0].disaggregated = false;
        assert!(render(&state).contains("served whole"));
    }
}
