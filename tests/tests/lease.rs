//! HTTP-filter-only mode on real Envoy: no bootstrap snapshot service, one
//! router thread polls by holding a lease in shared data. When that thread
//! stops its lease work, another takes the lease over in time for no request to
//! see a stale snapshot, and bookings and reports keep reaching the sidecar.
//!
//! The main suite's routing, shedding and failover tests run in this mode
//! too: `cargo xtask test` runs them again with `KVGATE_HTTP_FILTER_ONLY`.

mod common;

use common::*;
use kvgate_stack::StackConfig;
use serde_json::json;
use std::time::{Duration, Instant};

const DRILL_MS: u64 = 3000;
const LEASE_MS: u64 = 1000;
const TICK_MS: u64 = 100;

fn routed_total(stack: &kvgate_stack::Stack) -> f64 {
    stack
        .workers
        .iter()
        .map(|w| {
            stack
                .sidecar_metric(&format!(
                    "kvgate_sidecar_routed_total{{model=\"demo-model\",worker_id=\"{}\"}}",
                    w.id
                ))
                .unwrap_or(0.0)
        })
        .sum()
}

#[test]
fn a_stuck_lease_holder_is_replaced_before_any_request_sees_stale_state() {
    let _g = serial();
    let stack = start(StackConfig {
        http_filter_only: true,
        envoy_concurrency: 2,
        plugin: json!({
            "lease_ms": LEASE_MS,
            "tick_ms": TICK_MS,
            "stale_after_ms": 3000,
            // A stale snapshot would be refused, not hidden by Envoy's own
            // balancing.
            "on_stale": "fail_closed",
            "lease_drill_stop_after_ms": DRILL_MS,
        }),
        ..StackConfig::default()
    });
    stack.wait_routing_ready(Duration::from_secs(20)).unwrap();
    let takeovers = || {
        stack
            .envoy_stat("kvgate_lease_takeovers_total")
            .unwrap_or(0)
    };
    assert_eq!(takeovers(), 1, "one root polls\n{}", stack.log_tails());
    let start = Instant::now();

    // Requests throughout the drill: the first holder stops within
    // DRILL_MS of taking the lease, its lease runs out LEASE_MS later, and
    // the next tick of the other thread takes it.
    let bound = Duration::from_millis(DRILL_MS + LEASE_MS + 2 * TICK_MS + 1000);
    let mut taken_over_at = None;
    let mut i = 0u32;
    while start.elapsed() < bound + Duration::from_secs(4) {
        let r = completion(&stack.envoy_addr(), &unique_prompt(i, 24), 2).unwrap();
        assert_eq!(
            r.status,
            200,
            "request {i} at {:?}: {}\n{}",
            start.elapsed(),
            r.text(),
            stack.log_tails()
        );
        if taken_over_at.is_none() && takeovers() == 2 {
            taken_over_at = Some(start.elapsed());
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let at = taken_over_at.unwrap_or_else(|| {
        panic!(
            "the lease was never taken over in {bound:?}\n{}",
            stack.log_tails()
        )
    });
    assert!(at <= bound, "taken over after {at:?}, bound {bound:?}");
    assert_eq!(takeovers(), 2, "the new holder keeps the lease");
    assert_eq!(
        stack
            .envoy_stat("kvgate_rejected_stale_state_total")
            .unwrap(),
        0
    );
    assert_eq!(stack.envoy_stat("kvgate_failed_open_total").unwrap(), 0);

    // The new holder forwards what the routers queue: every routed request
    // reached the sidecar's counts, and every booking was released.
    let routed = f64::from(i);
    let deadline = Instant::now() + Duration::from_secs(10);
    while routed_total(&stack) < routed && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(routed_total(&stack), routed, "{}", stack.log_tails());
    wait_bookings_drained(&stack);
}
