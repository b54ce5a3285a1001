//! Thermal control end to end on real Envoy: `kvgate-sim` workers with a
//! simulated thermal plant serve dcgm-exporter pages, the sidecar reads
//! them and caps hot workers, the filter applies the caps per request.

mod common;

use common::*;
use kvgate_stack::{Stack, StackConfig, ThermalStack, http};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const TARGET: f64 = 80.0;

/// Three workers whose GPUs follow their plant within about a second, read
/// every 100 ms; one Envoy worker thread, so a cap is exact.
fn thermal_stack(workers: usize, batch_control: bool) -> Stack {
    start(StackConfig {
        workers,
        envoy_concurrency: 1,
        sim_args: vec![
            "--speedup".into(),
            "20".into(),
            "--thermal-tau-s".into(),
            "0.3".into(),
        ],
        thermal: Some(ThermalStack {
            gpus: 2,
            batch_control,
            toml: format!(
                "interval_ms = 100\nstale_after_ms = 1000\nmin_change_interval_ms = 200\ntarget_c = {TARGET}\nhysteresis_c = 3.0\n"
            ),
        }),
        ..StackConfig::default()
    })
}

/// POSTs JSON; the status and the body.
fn post_to(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, bytes) = http::post_json(addr, path, body.to_string().as_bytes()).unwrap();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, v)
}

/// Sets worker `i`'s cooling (`ambient_c`) or its dcgm page (`dcgm`).
fn plant(stack: &Stack, i: usize, body: Value) {
    let (status, v) = post_to(&stack.workers[i].endpoint(), "/sim/thermal", &body);
    assert_eq!(status, 200, "{v}");
}

fn thermal(stack: &Stack) -> Value {
    let (status, body) = http::get(&stack.control_addr(), "/v1/admin/thermal").unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

fn worker_thermal(stack: &Stack, i: usize) -> Value {
    let id = stack.workers[i].id;
    thermal(stack)["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == id)
        .cloned()
        .unwrap()
}

/// Waits until worker `i`'s controller state is `state`.
fn wait_state(stack: &Stack, i: usize, state: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let w = worker_thermal(stack, i);
        if w["state"] == state {
            return w;
        }
        assert!(
            Instant::now() < deadline,
            "worker {i} never became {state}: {w}\n{}",
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until Envoy's view shows worker `i` with this thermal state.
fn wait_published(stack: &Stack, i: usize, state: &str) {
    let id = stack.workers[i].id;
    let what = format!("snapshot never showed worker {i} {state}");
    common::wait_published(stack, &what, Duration::from_secs(10), |s| {
        s["models"][0]["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|w| w["worker_id"] == id && w["thermal"]["state"] == state)
    });
}

/// Waits until the sidecar counts no request in flight on any worker and
/// Envoy holds a snapshot that says so.
fn wait_idle_published(stack: &Stack) {
    common::wait_published(
        stack,
        "requests stayed in flight",
        Duration::from_secs(10),
        |state| {
            state["models"][0]["workers"]
                .as_array()
                .into_iter()
                .flatten()
                .all(|w| w["thermal"]["in_flight"].as_u64() == Some(0))
        },
    );
}

fn running(stack: &Stack, i: usize) -> u64 {
    let (_, body) = http::get(&stack.workers[i].endpoint(), "/sim/thermal").unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["running"].as_u64().unwrap()
}

/// `n` clients each sending completions back to back for `for_`; how many
/// each worker served, and every status.
fn load(stack: &Stack, n: usize, for_: Duration) -> (BTreeMap<String, usize>, Vec<u16>) {
    let addr = stack.envoy_addr();
    let until = Instant::now() + for_;
    let clients: Vec<_> = (0..n)
        .map(|c| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                let mut k = 0;
                while Instant::now() < until {
                    k += 1;
                    let r =
                        completion(&addr, &unique_prompt((c * 1000 + k) as u32, 64), 24).unwrap();
                    out.push((
                        r.status,
                        r.header("x-kvgate-sim-worker").map(str::to_string),
                    ));
                }
                out
            })
        })
        .collect();
    let mut per_worker = BTreeMap::new();
    let mut statuses = Vec::new();
    for c in clients {
        for (status, worker) in c.join().unwrap() {
            statuses.push(status);
            if let Some(w) = worker {
                *per_worker.entry(w).or_default() += 1;
            }
        }
    }
    (per_worker, statuses)
}

#[test]
fn a_hot_worker_is_capped_its_work_moves_and_comes_back_when_cool() {
    let _g = serial();
    let stack = thermal_stack(3, false);
    let hot_id = stack.workers[0].id.to_string();
    // Cool fleet: everyone serves.
    wait_state(&stack, 0, "cool");
    let (before, _) = load(&stack, 6, Duration::from_secs(2));
    assert!(before.get(&hot_id).copied().unwrap_or(0) > 0, "{before:?}");

    // Worker 0's cooling fails: its hottest GPU passes the target.
    plant(&stack, 0, json!({"ambient_c": 95.0}));
    let w = wait_state(&stack, 0, "throttling");
    let cap = w["cap"].as_u64().unwrap();
    assert!(cap >= 1, "{w}");
    assert!(w["temperature_c"].as_f64().unwrap() >= TARGET, "{w}");
    assert_eq!(
        w["gpus"].as_array().unwrap().len(),
        2,
        "both GPUs read: {w}"
    );
    wait_published(&stack, 0, "throttling");

    // Under load, it never holds more than its cap; the others take the rest.
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let watching = watching.clone();
        let addr = stack.workers[0].endpoint();
        std::thread::spawn(move || {
            let mut most = 0;
            while watching.load(Ordering::Relaxed) {
                if let Ok((200, body)) = http::get(&addr, "/sim/thermal") {
                    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    most = most.max(v["running"].as_u64().unwrap_or(0));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            most
        })
    };
    let (hot, statuses) = load(&stack, 9, Duration::from_secs(3));
    watching.store(false, Ordering::Relaxed);
    let most = watcher.join().unwrap();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let now_cap = worker_thermal(&stack, 0)["cap"].as_u64().unwrap();
    assert!(
        most <= cap.max(now_cap),
        "the hot worker ran {most} at once over its cap {cap}"
    );
    let served_hot = hot.get(&hot_id).copied().unwrap_or(0);
    let total: usize = hot.values().sum();
    assert!(
        served_hot * 6 < total,
        "the hot worker took {served_hot} of {total}: {hot:?}"
    );

    // Cooling restored: it leaves throttling only below target − hysteresis,
    // and gets work again.
    plant(&stack, 0, json!({"ambient_c": 25.0}));
    let w = wait_state(&stack, 0, "cool");
    assert_eq!(w["cap"], 0, "{w}");
    assert!(w["temperature_c"].as_f64().unwrap() < TARGET - 3.0, "{w}");
    assert_eq!(w["throttle_entries"], 1, "one entry, no flapping: {w}");
    wait_published(&stack, 0, "cool");
    let (after, _) = load(&stack, 6, Duration::from_secs(2));
    assert!(
        after.get(&hot_id).copied().unwrap_or(0) * 6 >= after.values().sum::<usize>(),
        "the cooled worker is back to its share: {after:?}"
    );
    assert!(
        stack
            .sidecar_metric(&format!(
                "kvgate_sidecar_thermal_throttle_entries_total{{model=\"demo-model\",worker_id=\"{hot_id}\"}}"
            ))
            .unwrap()
            >= 1.0
    );
}

#[test]
fn a_fleet_hot_everywhere_sheds_with_reason_thermal() {
    let _g = serial();
    let stack = thermal_stack(2, false);
    for i in 0..2 {
        plant(&stack, i, json!({"ambient_c": 95.0}));
    }
    for i in 0..2 {
        wait_state(&stack, i, "throttling");
        wait_published(&stack, i, "throttling");
    }
    // Each worker takes its cap; what is over is shed at once, by Envoy.
    let (_, statuses) = load(&stack, 8, Duration::from_secs(2));
    assert!(statuses.contains(&200), "capped, not closed: {statuses:?}");
    assert!(statuses.contains(&503), "nothing was shed: {statuses:?}");
    // Two long requests hold both caps (1 each: the fleet was idle when
    // it heated); what comes meanwhile is shed. The load's last requests
    // must have left Envoy's view first, or a holder finds its worker
    // still at its cap and is shed itself.
    wait_idle_published(&stack);
    let holders: Vec<_> = (0..2)
        .map(|k| {
            let addr = stack.envoy_addr();
            std::thread::spawn(move || completion(&addr, &unique_prompt(900 + k, 64), 3_000))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while running(&stack, 0) + running(&stack, 1) < 2 {
        assert!(Instant::now() < deadline, "the holders never ran");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut shed = None;
    let deadline = Instant::now() + Duration::from_secs(5);
    while shed.is_none() && Instant::now() < deadline {
        let r = completion(&stack.envoy_addr(), &unique_prompt(7, 64), 4).unwrap();
        if r.status == 503 {
            shed = Some(r);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = shed.expect("a request over both caps is shed");
    assert_eq!(r.header("x-kvgate-reason"), Some("thermal"));
    assert_eq!(
        r.json(),
        json!({"message": "Service temporarily unavailable: All workers are busy, please retry later", "type": "service_unavailable", "code": 503})
    );
    assert!(r.header("retry-after").is_some());
    assert!(r.header("x-kvgate-sim-worker").is_none());
    for h in holders {
        let _ = h.join();
    }
    assert!(stack.envoy_stat("kvgate_rejected_thermal_total").unwrap() >= 1);
}

#[test]
fn a_dry_run_changes_nothing_and_a_real_change_takes_effect() {
    let _g = serial();
    let stack = thermal_stack(2, false);
    wait_state(&stack, 0, "cool");
    let before = thermal(&stack);
    let temp = worker_thermal(&stack, 0)["temperature_c"].as_f64().unwrap();
    // A target under the current temperature would throttle both workers.
    let lower = (temp - 5.0).max(20.0);
    let change = json!({"model_name": "demo-model", "target_c": lower, "dry_run": true});
    let (status, v) = post_to(&stack.control_addr(), "/v1/admin/thermal", &change);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["dry_run"], true);
    let effects = v["workers"].as_array().unwrap();
    assert_eq!(effects.len(), 2);
    assert!(
        effects
            .iter()
            .all(|e| e["new_state"] == "throttling" && e["new_cap"].as_u64() >= Some(1)),
        "{v}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let after = thermal(&stack);
    for (b, a) in before["workers"]
        .as_array()
        .unwrap()
        .iter()
        .zip(after["workers"].as_array().unwrap())
    {
        assert_eq!(a["settings"], b["settings"], "a dry run changed settings");
        assert_eq!(a["state"], "cool");
        assert_eq!(a["cap"], 0);
    }
    // Hostile and malformed input changes nothing either.
    for bad in [
        json!({"model_name": "demo-model", "hysteresis_c": 1.0}),
        json!({"model_name": "demo-model", "target_c": 140.0}),
        json!({"model_name": "demo-model", "wattage": 3}),
        json!({"target_c": 70.0}),
        json!({"model_name": "nope", "target_c": 70.0}),
    ] {
        let (status, v) = post_to(&stack.control_addr(), "/v1/admin/thermal", &bad);
        assert!(matches!(status, 400 | 404), "{bad}: {status} {v}");
    }
    let settings = |v: &Value| -> Vec<Value> {
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["settings"].clone())
            .collect()
    };
    assert_eq!(settings(&thermal(&stack)), settings(&before));
    // The same change for real, on one worker: it throttles, the other not.
    let id = stack.workers[1].id;
    let real = json!({"worker_id": id, "target_c": lower});
    let (status, v) = post_to(&stack.control_addr(), "/v1/admin/thermal", &real);
    assert_eq!(status, 200, "{v}");
    wait_state(&stack, 1, "throttling");
    assert_eq!(worker_thermal(&stack, 0)["state"], "cool");
    assert_eq!(
        worker_thermal(&stack, 1)["settings"]["target_c"].as_f64(),
        Some(lower)
    );
}

#[test]
fn stale_readings_are_unknown_not_cool() {
    let _g = serial();
    let stack = thermal_stack(2, false);
    plant(&stack, 0, json!({"ambient_c": 95.0}));
    let w = wait_state(&stack, 0, "throttling");
    let cap = w["cap"].as_u64().unwrap();
    // Its exporter goes away while it is hot; it cools, unseen.
    plant(&stack, 0, json!({"dcgm": "down", "ambient_c": 25.0}));
    let w = wait_state(&stack, 0, "unknown");
    assert_eq!(w["cap"].as_u64(), Some(cap), "the cap is held: {w}");
    assert_eq!(w["temperature_c"], Value::Null);
    assert_eq!(w["heat"], 1.0);
    wait_published(&stack, 0, "unknown");
    // Still priced as hot: the worker with fresh, cool readings takes
    // sequential work.
    let mut per = BTreeMap::new();
    for k in 0..10 {
        let r = completion(&stack.envoy_addr(), &unique_prompt(300 + k, 64), 4).unwrap();
        *per.entry(served_by(&r).0).or_insert(0) += 1;
    }
    assert_eq!(
        per.get(&stack.workers[0].id.to_string()),
        None,
        "a worker with no fresh reading took work: {per:?}"
    );
    // Readings return: it is seen cool, and released.
    plant(&stack, 0, json!({"dcgm": "up"}));
    let w = wait_state(&stack, 0, "cool");
    assert_eq!(w["cap"], 0);
    assert!(
        stack
            .sidecar_metric("kvgate_sidecar_thermal_source_errors_total{source=\"dcgm\"}")
            .unwrap()
            >= 1.0
    );
}

#[test]
fn engines_with_batch_control_have_their_running_batch_cut() {
    let _g = serial();
    let stack = thermal_stack(2, true);
    wait_state(&stack, 0, "cool");
    // Long requests fill worker 0 before it heats.
    let addr = stack.envoy_addr();
    let long: Vec<_> = (0..8)
        .map(|k| {
            let addr = addr.clone();
            std::thread::spawn(move || completion(&addr, &unique_prompt(500 + k, 64), 600))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while running(&stack, 0) < 3 {
        assert!(Instant::now() < deadline, "worker 0 never filled");
        std::thread::sleep(Duration::from_millis(20));
    }
    plant(&stack, 0, json!({"ambient_c": 95.0}));
    let w = wait_state(&stack, 0, "throttling");
    let cap = w["cap"].as_u64().unwrap();
    // The controller keeps cutting while the GPU stays hot; the engine's
    // running batch follows the cap (evicted work waits, not lost).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = http::get(&stack.workers[0].endpoint(), "/sim/thermal").unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        let cap_now = worker_thermal(&stack, 0)["cap"].as_u64().unwrap();
        if v["max_num_seqs"].as_u64() == Some(cap_now) && v["running"].as_u64() <= Some(cap_now) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the engine never followed the cap {cap_now} (first {cap}): {v}\n{}",
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        stack
            .sidecar_metric("kvgate_sidecar_thermal_batch_calls_total{result=\"ok\"}")
            .unwrap()
            >= 1.0
    );
    // Cooled: the engine gets its batch size back, and every request,
    // evicted or not, completes.
    plant(&stack, 0, json!({"ambient_c": 25.0}));
    wait_state(&stack, 0, "cool");
    for h in long {
        let r = h.join().unwrap().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let (_, body) = http::get(&stack.workers[0].endpoint(), "/sim/thermal").unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert!(v["max_num_seqs"].as_u64() > Some(cap), "{v}");
}
