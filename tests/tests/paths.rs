//! Paths the filter does not decide never reach a worker undecided, on real
//! Envoy with `envoy/envoy.yaml`: the request's path bytes go out verbatim
//! (no client-side normalization), and each request is either answered by
//! Envoy (404 for a path outside the allow-list, 400 for an escaped slash)
//! or reaches a worker carrying the filter's decision. docs/fleet.md,
//! "Paths"; tests/tests/deploy.rs checks the other templates' tables.

mod common;

use common::*;
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};

/// What Envoy must do with a request.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// Normalized to an inference path, decided by the filter, served.
    Decided,
    /// Answered by Envoy itself with this status; no worker sees it.
    Refused(u16),
}

fn completion_body() -> Vec<u8> {
    json!({"model": "demo-model", "prompt": "where does this go", "max_tokens": 2})
        .to_string()
        .into_bytes()
}

fn chat_body() -> Vec<u8> {
    json!({
        "model": "demo-model",
        "messages": [{"role": "user", "content": "where does this go"}],
        "max_tokens": 2,
    })
    .to_string()
    .into_bytes()
}

/// SGLang's native endpoint with the fields of a disaggregated decode leg:
/// a worker would wait on a prefill no one chose.
fn sglang_generate_body() -> Vec<u8> {
    json!({
        "model": "demo-model",
        "text": "where does this go",
        "sampling_params": {"max_new_tokens": 2},
        "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 42,
    })
    .to_string()
    .into_bytes()
}

/// POSTs a worker would serve if it got them, as clients may spell them.
fn probes() -> Vec<(&'static str, Vec<u8>, Expect)> {
    use Expect::*;
    vec![
        // vLLM's SageMaker route serves completions: not a kvgate path.
        ("/invocations", completion_body(), Refused(404)),
        ("/generate", sglang_generate_body(), Refused(404)),
        // Percent-encoded unreserved characters are decoded by Envoy's
        // normalize_path: the route, the filter and the worker all see
        // the inference path, and the filter decides it.
        ("/v1/%63ompletions", completion_body(), Decided),
        ("/%761/completions", completion_body(), Decided),
        ("/v1/chat/%63ompletions", chat_body(), Decided),
        // Merged slashes, resolved dot segments.
        ("//v1/completions", completion_body(), Decided),
        ("/v1//chat/completions", chat_body(), Decided),
        ("/v1/./completions", completion_body(), Decided),
        // An escaped slash is refused, never unescaped on the way.
        ("/v1%2Fcompletions", completion_body(), Refused(400)),
        ("/v1%2fchat%2Fcompletions", chat_body(), Refused(400)),
        // Dot segments cannot climb out of the allow-list either.
        (
            "/v1/completions/../../invocations",
            completion_body(),
            Refused(404),
        ),
        ("/v1/completions/", completion_body(), Refused(404)),
        ("/V1/completions", completion_body(), Refused(404)),
        ("/v1/models", completion_body(), Refused(404)),
    ]
}

/// One of Envoy's own stats (not the filter's), from the admin API.
fn admin_stat(stack: &Stack, name: &str) -> u64 {
    let (status, body) =
        http::get(&stack.admin_addr(), &format!("/stats?filter=^{name}$")).unwrap();
    assert_eq!(status, 200);
    String::from_utf8_lossy(&body)
        .lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(k, _)| k.trim() == name)
        .map_or(0, |(_, v)| v.trim().parse().unwrap())
}

/// Requests the workers' connections carried, by cluster: the routed
/// cluster (the filter's decision) and the fallback (Envoy's own
/// balancing: fail-open requests and the allowed reads).
fn upstream_requests(stack: &Stack) -> (u64, u64) {
    (
        admin_stat(stack, "cluster.kvgate_workers.upstream_rq_total"),
        admin_stat(stack, "cluster.kvgate_fallback.upstream_rq_total"),
    )
}

#[test]
fn only_decided_requests_and_the_allowed_reads_reach_a_worker() {
    let _g = serial();
    let stack = start(StackConfig {
        workers: 2,
        ..StackConfig::default()
    });
    let served_before = served_total(&stack);
    let routed_before = stack.envoy_stat("kvgate_routed_total").unwrap();
    let (workers_before, fallback_before) = upstream_requests(&stack);

    let mut decided = 0;
    for (path, body, expect) in probes() {
        let (status, headers, reply) = http::request_full(
            &stack.envoy_addr(),
            "POST",
            path,
            &[("content-type", "application/json")],
            Some(&body),
        )
        .unwrap_or_else(|e| panic!("POST {path}: {e:#}\n{}", stack.log_tails()));
        let r = Reply {
            status,
            headers,
            body: reply,
        };
        // Envoy names the upstream's time on whatever a worker answered.
        let reached = r.header("x-envoy-upstream-service-time").is_some();
        let decision = r.header("x-kvgate-served-by");
        assert!(
            !reached || decision.is_some(),
            "POST {path} reached a worker undecided ({}): {}",
            r.status,
            r.text()
        );
        match expect {
            Expect::Decided => {
                let (worker, _) = served_by(&r);
                assert!(
                    decision.is_some_and(|s| s.contains(&format!("worker_id={worker};"))),
                    "POST {path}: served by {worker}, decided {decision:?}"
                );
                decided += 1;
            }
            Expect::Refused(want) => {
                assert!(!reached, "POST {path} reached a worker ({})", r.status);
                assert_eq!(r.status, want, "POST {path}: {}", r.text());
                if want == 404 {
                    assert_eq!(r.header("content-type"), Some("application/json"));
                    assert!(r.json()["error"]["message"].is_string(), "{}", r.text());
                }
            }
        }
    }

    // What the workers saw: exactly the decided requests, all through the
    // routed cluster, none through Envoy's own balancing.
    let (workers_after, fallback_after) = upstream_requests(&stack);
    assert_eq!(served_total(&stack) - served_before, decided);
    assert_eq!(
        stack.envoy_stat("kvgate_routed_total").unwrap() - routed_before,
        decided
    );
    assert_eq!(workers_after - workers_before, decided);
    assert_eq!(
        fallback_after - fallback_before,
        0,
        "a request reached a worker by Envoy's own balancing"
    );

    // The allowed reads still reach a worker, by Envoy's own balancing.
    let (status, body) = http::get(&stack.envoy_addr(), "/v1/models").unwrap();
    assert_eq!(status, 200);
    let models: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(models["data"][0]["id"], "demo-model");
    let (status, _) = http::get(&stack.envoy_addr(), "/health").unwrap();
    assert_eq!(status, 200);
    assert_eq!(upstream_requests(&stack).1 - fallback_after, 2);
    // Other reads do not.
    for path in [
        "/metrics",
        "/v1/models/demo-model",
        "/sim/state",
        "/invocations",
    ] {
        let (status, _) = http::get(&stack.envoy_addr(), path).unwrap();
        assert_eq!(status, 404, "GET {path}");
    }
    assert_eq!(upstream_requests(&stack).1 - fallback_after, 2);
    assert_eq!(served_total(&stack) - served_before, decided);
}
