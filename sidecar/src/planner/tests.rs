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
        prefill: Default::default(),
        decode: Default::default(),
        role_switch: false,
        power_budget_w: None,
        replica_watts: None,
    }
}

/// Ready counts of an aggregated model.
fn agg(n: u32) -> [u32; 3] {
    [n, 0, 0]
}

fn tick(p: &mut ModelPlanner, loads: &[WorkerLoad], ready: u32, at: Instant, id: u64) -> Tick {
    p.tick_load(loads, agg(ready), at, id, PowerInput::default())
}

/// (desired, reason, changed) of a one-pool tick.
fn drc(t: &Tick) -> (u32, Reason, bool) {
    (t.desired(), t.reason(), t.changed())
}

/// A planner whose workers' TTFT is 20 ms per thousand prompt tokens in
/// flight and ITL 1 ms per thousand KV tokens.
fn fitted(workers: &[u64]) -> ModelPlanner {
    let mut p = ModelPlanner::new(cfg(), false, agg(workers.len() as u32));
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
    let t = tick(&mut p, &[load(1, 12.0, 0.0), load(2, 12.0, 0.0)], 2, t0, 7);
    assert_eq!(drc(&t), (3, Reason::ScaleUp, true));
    let e = t.estimates[0];
    assert!((e.ttft_ms.unwrap() - 260.0).abs() < 2.0, "{e:?}");
    assert_eq!(p.pending().map(|x| (x.id, x.from, x.to)), Some((7, 2, 3)));
}

#[test]
fn one_worker_under_its_sla_holds() {
    let mut p = fitted(&[1, 2]);
    let t = tick(
        &mut p,
        &[load(1, 12.0, 0.0), load(2, 2.0, 0.0)],
        2,
        Instant::now(),
        1,
    );
    assert_eq!(drc(&t), (2, Reason::Hold, false));
}

#[test]
fn every_worker_under_sla_times_sensitivity_scales_down_and_the_band_holds() {
    let mut p = fitted(&[1, 2, 3]);
    // 20 × (1 + 1) = 40 ms < 100 (200 × 0.5); ITL 1 × ... small.
    let low = [load(1, 1.0, 0.0), load(2, 1.0, 0.0), load(3, 1.0, 0.0)];
    let t = tick(&mut p, &low, 3, Instant::now(), 1);
    assert_eq!((t.desired(), t.reason()), (2, Reason::ScaleDown));
    // 20 × (6 + 1) = 140 ms: under the SLA, over SLA × sensitivity: hold.
    let mut q = fitted(&[1, 2, 3]);
    let mid = [load(1, 6.0, 0.0), load(2, 6.0, 0.0), load(3, 6.0, 0.0)];
    let t = tick(&mut q, &mid, 3, Instant::now(), 1);
    assert_eq!((t.desired(), t.reason()), (3, Reason::Hold));
}

#[test]
fn no_step_while_pending_then_one_after_completion_or_timeout() {
    let mut p = fitted(&[1, 2]);
    let t0 = Instant::now();
    let hot = [load(1, 12.0, 0.0), load(2, 12.0, 0.0)];
    assert_eq!(tick(&mut p, &hot, 2, t0, 1).desired(), 3);
    // Still hot a second later, the new worker not there yet: no step.
    let t = tick(&mut p, &hot, 2, t0 + Duration::from_secs(1), 2);
    assert_eq!(drc(&t), (3, Reason::Pending, false));
    // The orchestrator reports it done: the next tick may step again.
    assert!(!p.complete(99, t0), "another id is not this decision");
    assert!(p.complete(1, t0 + Duration::from_secs(5)));
    assert_eq!(
        p.startup(),
        Duration::from_secs(5),
        "observed, not configured"
    );
    let hot3 = [load(1, 12.0, 0.0), load(2, 12.0, 0.0), load(3, 12.0, 0.0)];
    let t = tick(&mut p, &hot3, 3, t0 + Duration::from_secs(6), 3);
    assert_eq!((t.desired(), t.changed()), (4, true));
    // Never reported: given up after the timeout, and the pool, still
    // over its SLA with fewer workers than it wants, asks again.
    let later = t0 + Duration::from_secs(6) + cfg().pending_timeout;
    let t = tick(&mut p, &hot3, 3, later, 4);
    assert_eq!(drc(&t), (4, Reason::ScaleUp, true), "{t:?}");
    assert_eq!(p.pending().map(|x| (x.id, x.from, x.to)), Some((4, 3, 4)));
}

#[test]
fn a_pool_that_lost_a_worker_asks_for_it_again() {
    let mut p = fitted(&[1, 2, 3]);
    let t0 = Instant::now();
    let hot = [load(1, 12.0, 0.0), load(2, 12.0, 0.0), load(3, 12.0, 0.0)];
    assert_eq!(
        drc(&tick(&mut p, &hot, 3, t0, 1)),
        (4, Reason::ScaleUp, true)
    );
    assert!(p.complete(1, t0));
    // Worker 3 went away: the two left are over the SLA and want 3,
    // which the pool already asked for, and nothing is on its way.
    let t = tick(&mut p, &hot[..2], 2, t0, 2);
    assert_eq!(drc(&t), (3, Reason::ScaleUp, true));
    // Found empty at start, a pool waits for its workers to be scraped
    // before it asks for them again.
    let mut q = ModelPlanner::new(cfg(), false, agg(0));
    let t = tick(&mut q, &[], 0, t0, 1);
    assert_eq!(drc(&t), (1, Reason::WarmingUp, false));
    let t = tick(&mut q, &[], 0, t0 + cfg().startup, 2);
    assert_eq!(drc(&t), (1, Reason::Bound, true), "none came in time");
}

#[test]
fn the_ready_count_reaching_the_target_settles_a_decision() {
    let mut p = fitted(&[1, 2]);
    let t0 = Instant::now();
    let hot = [load(1, 12.0, 0.0), load(2, 12.0, 0.0)];
    tick(&mut p, &hot, 2, t0, 1);
    assert!(p.scale_up_eta(t0 + Duration::from_secs(5)).unwrap() <= Duration::from_secs(15));
    p.settle_pending(agg(3), t0 + Duration::from_secs(8));
    assert!(p.pending().is_none());
    assert_eq!(p.startup(), Duration::from_secs(8));
}

#[test]
fn the_throughput_floor_holds_the_load_loop_up() {
    let mut c = cfg();
    c.profile = vec![crate::config::ProfileRow {
        role: Role::Both,
        isl: 1000.0,
        osl: 100.0,
        rps: 1.0,
        ttft_ms: None,
        itl_ms: None,
    }];
    let mut p = ModelPlanner::new(c, false, agg(4));
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
    p.tick_throughput();
    assert_eq!(p.floor(), 3);
    assert_eq!(p.predicted.map(|x| x[0]), Some(30.0));
    let idle: Vec<WorkerLoad> = (1..=4).map(|w| load(w, 0.0, 0.0)).collect();
    let t = tick(&mut p, &idle, 4, Instant::now(), 1);
    assert_eq!(
        (t.desired(), t.reason()),
        (3, Reason::ScaleDown),
        "down by one, to the floor"
    );
    p.complete(1, Instant::now());
    let t = tick(&mut p, &idle[..3], 3, Instant::now(), 2);
    assert_eq!(drc(&t), (3, Reason::Floor, false));
}

#[test]
fn bounds_clamp_and_no_estimate_waits() {
    let mut c = cfg();
    c.max_replicas = 2;
    let mut p = ModelPlanner::new(c, false, agg(2));
    let t = tick(&mut p, &[load(1, 50.0, 0.0)], 2, Instant::now(), 1);
    assert_eq!(
        (t.desired(), t.reason()),
        (2, Reason::WarmingUp),
        "no fit yet"
    );
    for k in 0..40 {
        p.observe_ttft(1, Role::Both, f64::from(k) * 500.0, f64::from(k) * 10.0);
        p.observe_ttft(2, Role::Both, f64::from(k) * 500.0, f64::from(k) * 10.0);
    }
    let t = tick(
        &mut p,
        &[load(1, 50.0, 0.0), load(2, 50.0, 0.0)],
        2,
        Instant::now(),
        2,
    );
    assert_eq!(drc(&t), (2, Reason::Bound, false));
}

#[test]
fn capacity_is_learned_from_the_fits_without_a_profile() {
    let mut p = fitted(&[1]);
    // TTFT reaches 200 ms at 10k prompt tokens in flight: 10 requests of
    // 1000 tokens each held 0.2 s → 50 req/s by prefill. ITL reaches 20 ms
    // at 20k KV tokens: 20k / 1050 per request ≈ 19 requests held for
    // 100 × 20 ms → ≈ 9.5 req/s by decode: decode bounds it.
    let cap = p.learned_capacity(Role::Both, 1000.0, 100.0).unwrap();
    assert!((cap - 9.52).abs() < 0.3, "{cap}");
    for _ in 0..200 {
        p.observe_request(1000, 100);
    }
    p.tick_throughput();
    // 200 requests in 10 s = 20 req/s over ~9.5 per replica: 3.
    assert_eq!(p.floor(), 3);
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
    let mut c = cfg();
    c.decode.sensitivity = Some(1.0);
    assert!(c.validate().unwrap_err().starts_with("decode: sensitivity"));
    let mut c = cfg();
    c.prefill.min_replicas = Some(9);
    assert!(
        c.validate()
            .unwrap_err()
            .starts_with("prefill: min_replicas")
    );
    let mut c = cfg();
    c.prefill.max_replicas = Some(0);
    assert!(c.validate().is_err());
    for bad in [-1.0, 0.0, f64::INFINITY] {
        let mut c = cfg();
        c.power_budget_w = Some(bad);
        assert!(c.validate().unwrap_err().contains("power_budget_w"));
        let mut c = cfg();
        c.replica_watts = Some(bad);
        assert!(c.validate().unwrap_err().contains("replica_watts"));
    }
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
    let mut p = ModelPlanner::new(c, false, agg(1));
    let ramp: Vec<(f64, f64, f64)> = (0..20)
        .map(|i| (f64::from(i) * 10.0, 1000.0, 100.0))
        .collect();
    p.warm_start(&ramp);
    p.tick_throughput();
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
        at: Instant::now(),
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
    let mut p = ModelPlanner::new(cfg(), false, agg(2));
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
    let mut p = ModelPlanner::new(cfg(), false, agg(2));
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
    let mut p = ModelPlanner::new(cfg(), false, agg(1));
    // Status 0: a filter of the release before leg records.
    p.observe_end(&ended(1, Role::Both, Leg::Whole, 0));
    assert_eq!(samples(&p), ([1, 0, 1, 0], [(0, 0), (0, 0), (1, 1)]));
    let i = p.interval;
    assert_eq!((i.requests, i.isl_sum, i.cached_sum), (1, 1000, 750));
}

#[test]
fn a_worker_without_its_own_fit_is_estimated_by_its_roles() {
    let mut p = ModelPlanner::new(cfg(), false, agg(3));
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

/// A disaggregated model: prefill workers 1 and 2 whose TTFT is 20 ms
/// per thousand prompt tokens in flight, decode workers 3 and 4 whose ITL
/// is 1 ms per thousand KV tokens.
fn split(c: PlannerConfig) -> ModelPlanner {
    let mut p = ModelPlanner::new(c, true, [0, 2, 2]);
    for k in 0..40 {
        let tokens = f64::from(k) * 500.0;
        for w in [1, 2] {
            p.observe_ttft(w, Role::Prefill, tokens, 20.0 * tokens / 1000.0);
        }
        for w in [3, 4] {
            p.observe_itl(w, Role::Decode, tokens * 4.0, 4.0 * tokens / 1000.0);
        }
    }
    p.observe_request(1000, 100);
    p
}

fn at(worker_id: u64, role: Role, prefill_k: f64, decode_k: f64) -> WorkerLoad {
    WorkerLoad {
        role,
        ..load(worker_id, prefill_k, decode_k)
    }
}

/// Prefill workers at `prefill_k` thousand tokens in flight, decode
/// workers at `decode_k` thousand KV tokens.
fn pools_at(prefill_k: f64, decode_k: f64) -> Vec<WorkerLoad> {
    vec![
        at(1, Role::Prefill, prefill_k, 0.0),
        at(2, Role::Prefill, prefill_k, 0.0),
        at(3, Role::Decode, 0.0, decode_k),
        at(4, Role::Decode, 0.0, decode_k),
    ]
}

fn pool_drc(t: &Tick, role: Role) -> (u32, Reason, bool) {
    let p = t.pool(role).unwrap();
    (p.desired, p.reason, p.changed)
}

#[test]
fn a_disaggregated_model_sizes_its_pools_apart_each_by_its_own_latency() {
    let mut p = split(cfg());
    let t0 = Instant::now();
    // Prefill: TTFT 20 × (12 + 1) = 260 ms > 200 on both. Decode: ITL
    // (15 + 1.05) ms, under 20 and over 20 × 0.5: hold.
    let t = p.tick_load(
        &pools_at(12.0, 15.0),
        [0, 2, 2],
        t0,
        1,
        PowerInput::default(),
    );
    assert_eq!(pool_drc(&t, Role::Prefill), (3, Reason::ScaleUp, true));
    assert_eq!(pool_drc(&t, Role::Decode), (2, Reason::Hold, false));
    assert_eq!(t.desired(), 5);
    let e = t.estimates.iter().find(|e| e.worker_id == 1).unwrap();
    assert_eq!((e.pool, e.itl_ms), (Role::Prefill, None));
    // The decode pool is not held by the prefill pool's pending decision:
    // every decode worker under 10 ms steps it down at once.
    let t = p.tick_load(
        &pools_at(12.0, 2.0),
        [0, 2, 2],
        t0,
        2,
        PowerInput::default(),
    );
    assert_eq!(pool_drc(&t, Role::Prefill), (3, Reason::Pending, false));
    assert_eq!(pool_drc(&t, Role::Decode), (1, Reason::ScaleDown, true));
    // Completing decision 1 frees the prefill pool only.
    assert!(p.complete(1, t0 + Duration::from_secs(3)));
    let pending: Vec<Option<u64>> = p.pools.iter().map(|x| x.pending.map(|q| q.id)).collect();
    assert_eq!(pending, vec![None, Some(2)]);
    assert_eq!(
        p.pool_eta(Role::Decode, t0),
        None,
        "a scale-down has no ETA"
    );
}

#[test]
fn a_pool_with_one_worker_in_the_band_holds_and_each_pool_has_its_own_bounds() {
    let mut c = cfg();
    c.prefill.max_replicas = Some(2);
    c.decode.sensitivity = Some(0.9);
    let mut p = split(c);
    let t0 = Instant::now();
    let mut loads = pools_at(12.0, 15.0);
    loads[1].prefill_tokens = 2000.0;
    let t = p.tick_load(&loads, [0, 2, 2], t0, 1, PowerInput::default());
    assert_eq!(pool_drc(&t, Role::Prefill), (2, Reason::Hold, false));
    // Every decode worker under 20 × 0.9 = 18 ms (16 ms), but one worker
    // fewer would take each to 31 ms, over the SLA: no step down that
    // would step back up.
    assert_eq!(pool_drc(&t, Role::Decode), (2, Reason::Hold, false));
    // At 10 ms each (over 20 × 0.5, the model's sensitivity, under the
    // decode pool's own 18), and 19 ms with one fewer: down.
    let t = p.tick_load(&pools_at(6.0, 9.0), [0, 2, 2], t0, 3, PowerInput::default());
    assert_eq!(pool_drc(&t, Role::Decode), (1, Reason::ScaleDown, true));
    // The prefill pool at its own maximum.
    let t = p.tick_load(
        &pools_at(12.0, 15.0),
        [0, 2, 2],
        t0,
        2,
        PowerInput::default(),
    );
    assert_eq!(pool_drc(&t, Role::Prefill), (2, Reason::Bound, false));
}

#[test]
fn each_pool_gets_its_floor_from_its_roles_profile_and_the_floor_passes_a_pending_step() {
    let mut c = cfg();
    let row = |role, osl, rps| crate::config::ProfileRow {
        role,
        isl: 1000.0,
        osl,
        rps,
        ttft_ms: None,
        itl_ms: None,
    };
    c.profile = vec![row(Role::Prefill, 0.0, 4.0), row(Role::Decode, 100.0, 1.5)];
    c.max_replicas = 16;
    let mut p = split(c);
    let t0 = Instant::now();
    // A pending prefill step.
    let t = p.tick_load(
        &pools_at(12.0, 15.0),
        [0, 2, 2],
        t0,
        1,
        PowerInput::default(),
    );
    assert!(t.pool(Role::Prefill).unwrap().changed);
    // 60 requests in 10 s: 6 req/s → ⌈6 / 4⌉ = 2 prefill, ⌈6 / 1.5⌉ = 4
    // decode.
    for _ in 0..59 {
        p.observe_request(1000, 100);
    }
    p.tick_throughput();
    let floors: Vec<u32> = p.pools.iter().map(|x| x.floor).collect();
    assert_eq!(floors, vec![2, 4]);
    let cap = p.capacity.iter().find(|c| c.role == Role::Decode).unwrap();
    assert_eq!(cap.profile_rps, Some(1.5));
    assert!(cap.learned_rps.is_some() && cap.drift.is_some(), "{cap:?}");
    let t = p.tick_load(
        &pools_at(12.0, 15.0),
        [0, 2, 2],
        t0,
        2,
        PowerInput::default(),
    );
    assert_eq!(pool_drc(&t, Role::Prefill), (3, Reason::Pending, false));
    assert_eq!(
        pool_drc(&t, Role::Decode),
        (4, Reason::Floor, true),
        "straight to the floor, in one decision"
    );
    // And the floor passes a pending decision: the decode pool's floor
    // rises while its step to 4 is pending.
    for _ in 0..90 {
        p.observe_request(1000, 100);
    }
    p.tick_throughput();
    let t = p.tick_load(
        &pools_at(12.0, 15.0),
        [0, 2, 2],
        t0,
        3,
        PowerInput::default(),
    );
    assert_eq!(pool_drc(&t, Role::Decode), (6, Reason::Floor, true));
}

#[test]
fn an_empty_pool_below_its_minimum_is_asked_for_again() {
    let mut p = split(cfg());
    let t0 = Instant::now();
    let t = p.tick_load(
        &pools_at(6.0, 15.0),
        [0, 2, 2],
        t0,
        1,
        PowerInput::default(),
    );
    assert!(!t.changed());
    let decode_only = &pools_at(0.0, 15.0)[2..];
    let t = p.tick_load(decode_only, [0, 0, 2], t0, 1, PowerInput::default());
    let prefill = t.pool(Role::Prefill).unwrap();
    assert_eq!(
        (
            prefill.desired,
            prefill.ready,
            prefill.changed,
            prefill.reason
        ),
        (2, 0, true, Reason::Bound),
        "its workers died: the decision is issued again"
    );
    let t = p.tick_load(decode_only, [0, 0, 2], t0, 2, PowerInput::default());
    assert_eq!(pool_drc(&t, Role::Prefill), (2, Reason::Pending, false));
}

#[test]
fn with_role_switching_a_worker_moves_to_the_pool_that_needs_it() {
    let mut c = cfg();
    c.role_switch = true;
    let mut p = split(c.clone());
    // Prefill over its SLA, decode under SLA × sensitivity.
    let t = p.tick_load(
        &pools_at(12.0, 2.0),
        [0, 2, 2],
        Instant::now(),
        1,
        PowerInput::default(),
    );
    assert_eq!(t.switch, Some((Role::Decode, Role::Prefill)));
    assert_eq!(pool_drc(&t, Role::Prefill), (3, Reason::ScaleUp, true));
    assert_eq!(pool_drc(&t, Role::Decode), (1, Reason::ScaleDown, true));
    assert_eq!(t.desired(), 4, "no worker started, none removed");
    // The other way round.
    let mut p = split(c.clone());
    let t = p.tick_load(
        &pools_at(1.0, 30.0),
        [0, 2, 2],
        Instant::now(),
        1,
        PowerInput::default(),
    );
    assert_eq!(t.switch, Some((Role::Prefill, Role::Decode)));
    // Not allowed: a start and a drain.
    c.role_switch = false;
    let mut p = split(c);
    let t = p.tick_load(
        &pools_at(12.0, 2.0),
        [0, 2, 2],
        Instant::now(),
        1,
        PowerInput::default(),
    );
    assert_eq!(t.switch, None);
    assert_eq!(t.desired(), 4);
}

#[test]
fn the_power_budget_holds_growth_and_says_what_it_costs() {
    let mut c = cfg();
    c.profile = vec![crate::config::ProfileRow {
        role: Role::Both,
        isl: 1000.0,
        osl: 100.0,
        rps: 1.0,
        ttft_ms: None,
        itl_ms: None,
    }];
    let mut p = ModelPlanner::new(c, false, agg(2));
    for w in [1, 2] {
        for k in 0..40 {
            let tokens = f64::from(k) * 500.0;
            p.observe_ttft(w, Role::Both, tokens, 20.0 * tokens / 1000.0);
        }
    }
    // 40 requests in 10 s: 4 req/s, 1 per replica.
    for _ in 0..40 {
        p.observe_request(1000, 100);
    }
    p.tick_throughput();
    let power = |budget| PowerInput {
        budget_w: Some(budget),
        replica_w: [Some(700.0), None, None],
    };
    let hot = [load(1, 12.0, 0.0), load(2, 12.0, 0.0)];
    // The floor asks for 4 and the load for 3: 4 × 700 W over 2000 W.
    let t = p.tick_load(&hot, agg(2), Instant::now(), 1, power(2000.0));
    assert_eq!(drc(&t), (2, Reason::Power, false));
    let w = t.power.unwrap();
    assert!(w.binding);
    assert_eq!(w.planned_w, Some(1400.0));
    assert_eq!(w.expected_sla_attainment, Some(0.5), "2 of the 4 req/s");
    // Room for one more: 3 × 700 = 2100 W.
    let t = p.tick_load(&hot, agg(2), Instant::now(), 2, power(2100.0));
    assert_eq!(drc(&t), (3, Reason::Power, true));
    // The draw per replica rose past the budget: one step down, at most
    // one per tick, never under the minimum.
    p.complete(2, Instant::now());
    let t = p.tick_load(&hot[..1], agg(3), Instant::now(), 3, power(1000.0));
    assert_eq!(drc(&t), (2, Reason::Power, true));
    // Unmeasured draw: the budget cannot bind.
    let t = p.tick_load(
        &hot,
        agg(2),
        Instant::now(),
        4,
        PowerInput {
            budget_w: Some(1.0),
            replica_w: [None; 3],
        },
    );
    assert_eq!(
        t.power.map(|w| (w.binding, w.planned_w)),
        Some((false, None))
    );
}

#[test]
fn a_disaggregated_models_pools_share_its_maximum() {
    let mut c = cfg();
    c.max_replicas = 4;
    let mut p = split(c);
    // Both pools over their SLAs: 3 + 3 wanted, 4 workers at most: no
    // room to grow.
    let t = p.tick_load(
        &pools_at(12.0, 30.0),
        [0, 2, 2],
        Instant::now(),
        1,
        PowerInput::default(),
    );
    assert_eq!(pool_drc(&t, Role::Prefill), (2, Reason::Bound, false));
    assert_eq!(pool_drc(&t, Role::Decode), (2, Reason::Bound, false));
    assert_eq!(t.desired(), 4);
    // Room for one: the prefill pool's growth is trimmed first.
    let mut c = cfg();
    c.max_replicas = 5;
    let mut p = split(c);
    let t = p.tick_load(
        &pools_at(12.0, 30.0),
        [0, 2, 2],
        Instant::now(),
        1,
        PowerInput::default(),
    );
    assert_eq!(pool_drc(&t, Role::Prefill), (2, Reason::Bound, false));
    assert_eq!(pool_drc(&t, Role::Decode), (3, Reason::ScaleUp, true));
}
