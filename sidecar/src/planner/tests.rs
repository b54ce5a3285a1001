//! Test vectors for the planner's rules.

use super::*;
use crate::config::{PredictorKind, read_trace};

fn cfg() -> PlannerConfig {
    PlannerConfig {
        ttft_ms: 200.0,
        itl_ms: 20.0,
        sensitivity: 0.5,
        load_interval: Duration::from_secs(1),
        throughput_interval: Duration::from_secs(10),
        min_replicas: 1,
        max_replicas: 8,
        predictor: PredictorKind::Constant,
        season_intervals: 4,
        profile: Vec::new(),
        pending_timeout: Duration::from_secs(30),
        startup: Duration::from_secs(20),
        warmup_trace: None,
    }
}

/// A planner whose workers' TTFT is 20 ms per thousand prompt tokens in
/// flight and ITL 1 ms per thousand KV tokens.
fn fitted(workers: &[u64]) -> ModelPlanner {
    let mut p = ModelPlanner::new(cfg(), workers.len() as u32);
    for w in workers {
        for k in 0..40 {
            let tokens = f64::from(k) * 500.0;
            p.observe_ttft(*w, Role::Both, tokens, 20.0 * tokens / 1000.0);
            p.observe_itl(*w, Role::Both, tokens * 4.0, 4.0 * tokens / 1000.0);
        }
    }
    p.observe_request(1000, 100);
    p
}

fn load(worker_id: u64, prefill_k: f64, decode_k: f64) -> WorkerLoad {
    WorkerLoad {
        worker_id,
        role: Role::Both,
        prefill_tokens: prefill_k * 1000.0,
        decode_kv_tokens: decode_k * 1000.0,
    }
}

#[test]
fn every_worker_over_its_sla_scales_up_by_one() {
    let mut p = fitted(&[1, 2]);
    let t0 = Instant::now();
    // TTFT 20 × (12 + 1) = 260 ms on both: over 200.
    let t = p.tick_load(&[load(1, 12.0, 0.0), load(2, 12.0, 0.0)], 2, t0, 7);
    assert_eq!((t.desired, t.reason, t.changed), (3, Reason::ScaleUp, true));
    let e = t.estimates[0];
    assert!((e.ttft_ms.unwrap() - 260.0).abs() < 2.0, "{e:?}");
    assert_eq!(p.pending.map(|x| (x.id, x.from, x.to)), Some((7, 2, 3)));
}

#[test]
fn one_worker_under_its_sla_holds() {
    let mut p = fitted(&[1, 2]);
    let t = p.tick_load(
        &[load(1, 12.0, 0.0), load(2, 2.0, 0.0)],
        2,
        Instant::now(),
        1,
    );
    assert_eq!((t.desired, t.reason, t.changed), (2, Reason::Hold, false));
}

#[test]
fn every_worker_under_sla_times_sensitivity_scales_down_and_the_band_holds() {
    let mut p = fitted(&[1, 2, 3]);
    // 20 × (1 + 1) = 40 ms < 100 (200 × 0.5); ITL 1 × ... small.
    let low = [load(1, 1.0, 0.0), load(2, 1.0, 0.0), load(3, 1.0, 0.0)];
    let t = p.tick_load(&low, 3, Instant::now(), 1);
    assert_eq!((t.desired, t.reason), (2, Reason::ScaleDown));
    // 20 × (6 + 1) = 140 ms: under the SLA, over SLA × sensitivity: hold.
    let mut q = fitted(&[1, 2, 3]);
    let mid = [load(1, 6.0, 0.0), load(2, 6.0, 0.0), load(3, 6.0, 0.0)];
    let t = q.tick_load(&mid, 3, Instant::now(), 1);
    assert_eq!((t.desired, t.reason), (3, Reason::Hold));
}

#[test]
fn no_step_while_pending_then_one_after_completion_or_timeout() {
    let mut p = fitted(&[1, 2]);
    let t0 = Instant::now();
    let hot = [load(1, 12.0, 0.0), load(2, 12.0, 0.0)];
    assert_eq!(p.tick_load(&hot, 2, t0, 1).desired, 3);
    // Still hot a second later, the new worker not there yet: no step.
    let t = p.tick_load(&hot, 2, t0 + Duration::from_secs(1), 2);
    assert_eq!(
        (t.desired, t.reason, t.changed),
        (3, Reason::Pending, false)
    );
    // The orchestrator reports it done: the next tick may step again.
    assert!(!p.complete(99, t0), "another id is not this decision");
    assert!(p.complete(1, t0 + Duration::from_secs(5)));
    assert_eq!(
        p.startup(),
        Duration::from_secs(5),
        "observed, not configured"
    );
    let hot3 = [load(1, 12.0, 0.0), load(2, 12.0, 0.0), load(3, 12.0, 0.0)];
    let t = p.tick_load(&hot3, 3, t0 + Duration::from_secs(6), 3);
    assert_eq!((t.desired, t.changed), (4, true));
    // Never reported: given up after the timeout.
    let later = t0 + Duration::from_secs(6) + cfg().pending_timeout;
    let t = p.tick_load(&hot3, 3, later, 4);
    assert_eq!((t.desired, t.reason), (4, Reason::ScaleUp), "{t:?}");
    assert!(
        p.pending.is_none(),
        "the timed-out decision is given up, none reissued"
    );
}

#[test]
fn the_ready_count_reaching_the_target_settles_a_decision() {
    let mut p = fitted(&[1, 2]);
    let t0 = Instant::now();
    let hot = [load(1, 12.0, 0.0), load(2, 12.0, 0.0)];
    p.tick_load(&hot, 2, t0, 1);
    assert!(p.scale_up_eta(t0 + Duration::from_secs(5)).unwrap() <= Duration::from_secs(15));
    p.settle_pending(3, t0 + Duration::from_secs(8));
    assert!(p.pending.is_none());
    assert_eq!(p.startup(), Duration::from_secs(8));
}

#[test]
fn the_throughput_floor_holds_the_load_loop_up() {
    let mut c = cfg();
    c.profile = vec![crate::config::ProfileRow {
        isl: 1000.0,
        osl: 100.0,
        rps: 1.0,
    }];
    let mut p = ModelPlanner::new(c, 4);
    for w in [1, 2, 3, 4] {
        for k in 0..40 {
            let tokens = f64::from(k) * 500.0;
            p.observe_ttft(w, Role::Both, tokens, 20.0 * tokens / 1000.0);
        }
    }
    // 30 requests in a 10 s interval at the profiled shape: 3 req/s, 3
    // replicas of 1 req/s.
    for _ in 0..30 {
        p.observe_request(1000, 100);
    }
    p.tick_throughput(4);
    assert_eq!(p.floor, 3);
    assert_eq!(p.predicted.map(|x| x[0]), Some(30.0));
    let idle: Vec<WorkerLoad> = (1..=4).map(|w| load(w, 0.0, 0.0)).collect();
    let t = p.tick_load(&idle, 4, Instant::now(), 1);
    assert_eq!(
        (t.desired, t.reason),
        (3, Reason::ScaleDown),
        "down by one, to the floor"
    );
    p.complete(1, Instant::now());
    let t = p.tick_load(&idle[..3], 3, Instant::now(), 2);
    assert_eq!((t.desired, t.reason, t.changed), (3, Reason::Floor, false));
}

#[test]
fn bounds_clamp_and_no_estimate_waits() {
    let mut c = cfg();
    c.max_replicas = 2;
    let mut p = ModelPlanner::new(c, 2);
    let t = p.tick_load(&[load(1, 50.0, 0.0)], 2, Instant::now(), 1);
    assert_eq!((t.desired, t.reason), (2, Reason::WarmingUp), "no fit yet");
    for k in 0..40 {
        p.observe_ttft(1, Role::Both, f64::from(k) * 500.0, f64::from(k) * 10.0);
        p.observe_ttft(2, Role::Both, f64::from(k) * 500.0, f64::from(k) * 10.0);
    }
    let t = p.tick_load(
        &[load(1, 50.0, 0.0), load(2, 50.0, 0.0)],
        2,
        Instant::now(),
        2,
    );
    assert_eq!((t.desired, t.reason, t.changed), (2, Reason::Bound, false));
}

#[test]
fn capacity_is_learned_from_the_fits_without_a_profile() {
    let mut p = fitted(&[1]);
    // TTFT reaches 200 ms at 10k prompt tokens in flight: 10 requests of
    // 1000 tokens each held 0.2 s → 50 req/s by prefill. ITL reaches 20 ms
    // at 20k KV tokens: 20k / 1050 per request ≈ 19 requests held for
    // 100 × 20 ms → ≈ 9.5 req/s by decode: decode bounds it.
    let cap = p.learned_capacity(1000.0, 100.0).unwrap();
    assert!((cap - 9.52).abs() < 0.3, "{cap}");
    for _ in 0..200 {
        p.observe_request(1000, 100);
    }
    p.tick_throughput(1);
    // 200 requests in 10 s = 20 req/s over ~9.5 per replica: 3.
    assert_eq!(p.floor, 3);
}

#[test]
fn configuration_is_checked() {
    let mut c = cfg();
    assert!(c.validate().is_ok());
    c.sensitivity = 1.2;
    assert!(c.validate().unwrap_err().contains("sensitivity"));
    let mut c = cfg();
    c.min_replicas = 9;
    assert!(c.validate().is_err());
    let mut c = cfg();
    c.ttft_ms = f64::NAN;
    assert!(c.validate().is_err());
}

#[test]
fn a_warmup_trace_reads_and_warms_the_predictors() {
    let rows =
        read_trace("requests,isl,osl\n10,1000,100\n12, 1100, 90\n\n# a comment\n14,1200,80\n")
            .unwrap();
    assert_eq!(
        rows,
        vec![
            (10.0, 1000.0, 100.0),
            (12.0, 1100.0, 90.0),
            (14.0, 1200.0, 80.0)
        ]
    );
    assert!(read_trace("10,1000\n").is_err());
    assert!(
        read_trace("1,2,3\n-1,2,3\n")
            .unwrap_err()
            .contains("line 2")
    );
    let mut c = cfg();
    c.predictor = PredictorKind::Kalman;
    let mut p = ModelPlanner::new(c, 1);
    let ramp: Vec<(f64, f64, f64)> = (0..20)
        .map(|i| (f64::from(i) * 10.0, 1000.0, 100.0))
        .collect();
    p.warm_start(&ramp);
    p.tick_throughput(1);
    // The closed interval had no requests: the ramp's trend still shows in
    // what it predicts next, not a cold 0.
    let [n, isl, _] = p.predicted.unwrap();
    assert!(n > 50.0, "{n}");
    assert_eq!(isl, 1000.0);
}

/// A leg's end on `worker` (of `role`) that met 2000 prompt tokens and
/// 8000 KV tokens there: first byte at 40 ms, then 9 more tokens 5 ms
/// apart, a 1000-token prompt of which 250 were booked uncached.
fn ended(worker: u64, role: Role, leg: Leg, status: u16) -> LegEnd {
    LegEnd {
        worker,
        role,
        prefill_tokens: 2000.0,
        decode_kv_tokens: 8000.0,
        uncached: 250,
        timing: Timing {
            leg,
            first_byte_us: 40_000,
            total_us: 85_000,
            isl_tokens: 1000,
            output_tokens: 10,
            status,
            client_first_byte_us: 60_000,
        },
    }
}

/// Samples each fit holds: (worker 1's TTFT, worker 2's TTFT, worker 1's
/// ITL, worker 2's ITL) and, pooled by role, (TTFT, ITL) of prefill,
/// decode and both.
fn samples(p: &ModelPlanner) -> ([u64; 4], [(u64, u64); 3]) {
    let own = |f: &Fits, w| f.worker(w).map_or(0, Line::samples);
    let pooled = |r| (p.ttft().role(r).samples(), p.itl().role(r).samples());
    (
        [
            own(p.ttft(), 1),
            own(p.ttft(), 2),
            own(p.itl(), 1),
            own(p.itl(), 2),
        ],
        [
            pooled(Role::Prefill),
            pooled(Role::Decode),
            pooled(Role::Both),
        ],
    )
}

#[test]
fn a_prefill_leg_teaches_its_workers_ttft_and_the_decode_leg_its_workers_itl() {
    let mut p = ModelPlanner::new(cfg(), 2);
    p.observe_end(&ended(1, Role::Prefill, Leg::Prefill, 200));
    assert_eq!(
        samples(&p),
        ([1, 0, 0, 0], [(1, 0), (0, 0), (0, 0)]),
        "a prefill leg is a TTFT sample of its prefill worker only"
    );
    assert_eq!(
        (p.interval.requests, p.interval.cached_sum),
        (0, 750),
        "its prompt's cache counts; the request waits for its answer"
    );
    p.observe_end(&ended(2, Role::Decode, Leg::Decode, 200));
    assert_eq!(
        samples(&p),
        ([1, 0, 0, 1], [(1, 0), (0, 1), (0, 0)]),
        "a decode leg is an ITL sample of its decode worker, no TTFT"
    );
    let i = p.interval;
    assert_eq!(
        (i.requests, i.isl_sum, i.osl_sum, i.cached_sum),
        (1, 1000, 10, 750),
        "one request, its shape from the decode leg"
    );
    // (85 − 40) ms over 9 tokens after the first.
    let (a, b) = p.itl().worker(2).unwrap().coefficients();
    assert!((a + b * 8.0 - 5.0).abs() < 1e-6, "{a} {b}");
}

#[test]
fn a_failed_leg_is_traffic_but_no_latency() {
    let mut p = ModelPlanner::new(cfg(), 2);
    for leg in Leg::ALL {
        p.observe_end(&ended(1, Role::Both, leg, 503));
    }
    assert_eq!(samples(&p), ([0; 4], [(0, 0); 3]));
    assert_eq!(p.interval.requests, 2, "the whole request and the answer");
    let mut no_byte = ended(1, Role::Both, Leg::Whole, 0);
    no_byte.timing.first_byte_us = 0;
    p.observe_end(&no_byte);
    assert_eq!(
        samples(&p),
        ([0; 4], [(0, 0); 3]),
        "nothing came: no sample"
    );
}

#[test]
fn a_whole_request_teaches_both_fits_as_before_legs() {
    let mut p = ModelPlanner::new(cfg(), 1);
    // Status 0: a filter of the release before leg records.
    p.observe_end(&ended(1, Role::Both, Leg::Whole, 0));
    assert_eq!(samples(&p), ([1, 0, 1, 0], [(0, 0), (0, 0), (1, 1)]));
    let i = p.interval;
    assert_eq!((i.requests, i.isl_sum, i.cached_sum), (1, 1000, 750));
}

#[test]
fn a_worker_without_its_own_fit_is_estimated_by_its_roles() {
    let mut p = ModelPlanner::new(cfg(), 3);
    for k in 0..40 {
        let tokens = f64::from(k) * 500.0;
        // Prefill workers: 20 ms per thousand prompt tokens; both: 40.
        p.observe_ttft(1, Role::Prefill, tokens, 20.0 * tokens / 1000.0);
        p.observe_ttft(3, Role::Both, tokens, 40.0 * tokens / 1000.0);
        p.observe_itl(2, Role::Decode, tokens, tokens / 1000.0);
    }
    let at = |worker_id, role| WorkerLoad {
        worker_id,
        role,
        prefill_tokens: 4000.0,
        decode_kv_tokens: 4000.0,
    };
    // New workers 4 (prefill) and 5 (decode), the shape unknown: no ISL.
    let prefill = p.estimate(&at(4, Role::Prefill), 0.0, 0.0);
    let decode = p.estimate(&at(5, Role::Decode), 0.0, 0.0);
    assert!((prefill.ttft_ms.unwrap() - 80.0).abs() < 1.0, "{prefill:?}");
    assert_eq!(prefill.itl_ms, None, "a prefill worker decodes nothing");
    assert_eq!(decode.ttft_ms, None, "a decode leg's first byte is no TTFT");
    assert!((decode.itl_ms.unwrap() - 4.0).abs() < 0.1, "{decode:?}");
}
