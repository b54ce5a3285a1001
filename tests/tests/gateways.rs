//! Several gateway pods in front of one fleet, end to end on real Envoy:
//! two Envoys and two sidecars sharing their load over replica sync, and
//! the selection API's select-then-reserve flow against `kvgate-sim`
//! workers.

mod common;

use common::*;
use kvgate_stack::{Gateway, Stack, StackConfig, http};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Workers whose booked decode load a gateway's sidecar shows.
fn loaded_workers(g: &Gateway) -> Vec<String> {
    let s = g.sidecar_state().unwrap();
    s["models"][0]["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["ranks"][0]["active_decode_blocks"].as_u64().unwrap_or(0) > 0)
        .map(|w| w["worker_id"].to_string())
        .collect()
}

/// Waits until gateway `g`'s sidecar shows `n` loaded workers and its
/// Envoy holds that snapshot.
fn wait_loaded(g: &Gateway, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = g.sidecar_state().unwrap();
        if loaded_workers(g).len() == n {
            let version = s["version"].as_u64().unwrap();
            while g.envoy_stat("kvgate_snapshot_version").unwrap_or(0) < version {
                assert!(Instant::now() < deadline, "Envoy never caught up");
                std::thread::sleep(Duration::from_millis(10));
            }
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never saw {n} loaded workers: {s}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Three long requests with large uncached prompts load three workers
/// through gateway A; then a burst of small cached requests arrives split
/// across both gateways. Returns how many of the burst went to the worker
/// without a long request, and the per-worker counts.
fn split_burst(sync: bool) -> (usize, BTreeMap<String, usize>) {
    let stack = start(StackConfig {
        workers: 4,
        gateways: 2,
        replica_sync: sync,
        kv_events: true,
        sim_args: burst_sim_args(),
        ..StackConfig::default()
    });
    let (a, b) = (&stack.gateways[0], &stack.gateways[1]);
    // The burst's prompt is cached everywhere, so only load tells workers
    // apart.
    let prompt: Vec<u32> = (0..64).collect();
    for w in &stack.workers {
        assert_eq!(completion(&w.endpoint(), &prompt, 1).unwrap().status, 200);
    }
    std::thread::sleep(Duration::from_millis(300));
    // Each long request books its 64 prompt blocks where it goes.
    let mut hogs = Vec::new();
    for i in 0..3u32 {
        let addr = a.envoy_addr();
        hogs.push(std::thread::spawn(move || {
            completion(&addr, &unique_prompt(i, 1024), 400)
        }));
        wait_loaded(a, i as usize + 1);
    }
    if sync {
        wait_loaded(b, 3);
    }
    let hogged = loaded_workers(a);
    let idle = stack
        .workers
        .iter()
        .map(|w| w.id.to_string())
        .find(|id| !hogged.contains(id))
        .expect("a worker without a long request");
    // Sixty requests of one block each: all of them fit in the idle
    // worker's 64-block gap.
    let gateways: Vec<String> = stack.gateways.iter().map(Gateway::envoy_addr).collect();
    let per_worker = burst(&gateways, 60, &prompt, 16);
    for h in hogs {
        assert_eq!(h.join().unwrap().unwrap().status, 200);
    }
    (per_worker.get(&idle).copied().unwrap_or(0), per_worker)
}

#[test]
fn gateways_that_share_their_load_spread_a_split_burst_as_one_gateway_would() {
    let _g = serial();
    let (alone, spread_alone) = split_burst(false);
    let (synced, spread_synced) = split_burst(true);
    eprintln!(
        "to the worker without a long request, of 60: without sync {alone} {spread_alone:?}, with sync {synced} {spread_synced:?}"
    );
    // One gateway would send all 60 there. Without sync, gateway B does
    // not know of A's long requests and spreads its half over all four
    // workers; with it, B sees them too.
    assert!(
        synced >= 50,
        "with sync the burst still went to loaded workers: {spread_synced:?}"
    );
    assert!(
        synced >= alone + 10,
        "sync made no difference: {alone} without, {synced} with"
    );
}

fn select(g: &Gateway, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, body) =
        http::post_json(&g.selection_addr(), path, body.to_string().as_bytes()).unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn reserved_load(g: &Gateway, worker: u64) -> (u64, u64) {
    let (status, body) = http::get(&g.selection_addr(), "/loads").unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["models"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["worker_id"] == worker)
        .map(|r| {
            (
                r["active_prefill_tokens"].as_u64().unwrap(),
                r["active_decode_blocks"].as_u64().unwrap(),
            )
        })
        .unwrap()
}

/// The seed's Ray flow: select, send the request to the selected worker
/// yourself, reserve, report prefill completion and output blocks, free.
#[test]
fn a_runtime_without_envoy_selects_reserves_and_frees_through_the_api() {
    let _g = serial();
    let stack: Stack = start(StackConfig {
        workers: 2,
        kv_events: true,
        selection_api: true,
        ..StackConfig::default()
    });
    let g = &stack.gateways[0];
    // A prefix cached on worker 2 only.
    let prompt: Vec<u32> = (1000..1256).collect();
    assert_eq!(
        completion(&stack.workers[1].endpoint(), &prompt, 1)
            .unwrap()
            .status,
        200
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let chosen = loop {
        let (status, v) = select(
            g,
            "/select",
            &json!({"selection_id": "s1", "model_name": "demo-model", "token_ids": prompt}),
        );
        assert_eq!(status, 200, "{v}");
        if v["overlap"]["gpu"] == 256 {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "the index never showed the prefix: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(chosen["worker_id"], 2, "{chosen}");
    assert_eq!(chosen["selection_id"], "s1");
    assert_eq!(chosen["effective_prefill_tokens"], 0, "all of it is cached");
    let worker = chosen["worker_id"].as_u64().unwrap();
    // Contact the worker at the endpoint the selection named.
    let endpoint = chosen["endpoint"].as_str().unwrap().to_string();
    let reply = completion(&endpoint, &prompt, 4).unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-kvgate-sim-worker"),
        Some(worker.to_string().as_str())
    );
    let (status, v) = select(
        g,
        "/reservations",
        &json!({
            "reservation_id": "ray-1",
            "model_name": "demo-model",
            "worker_id": worker,
            "dp_rank": chosen["dp_rank"],
            "token_ids": prompt,
            "effective_prefill_tokens": chosen["effective_prefill_tokens"],
        }),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        reserved_load(g, worker),
        (0, 1),
        "one new block, none to prefill"
    );
    let lifecycle =
        |path: String, body: &[u8]| http::post_json(&g.selection_addr(), &path, body).unwrap().0;
    assert_eq!(
        lifecycle("/reservations/ray-1/prefill_complete".into(), b""),
        204
    );
    assert_eq!(
        lifecycle("/reservations/ray-1/output_block".into(), b""),
        204
    );
    assert_eq!(reserved_load(g, worker), (0, 2));
    let (status, _) = http::request(
        &g.selection_addr(),
        "DELETE",
        "/reservations/ray-1",
        &[],
        None,
    )
    .unwrap();
    assert_eq!(status, 204);
    assert_eq!(reserved_load(g, worker), (0, 0));

    // Atomic selection and booking: uncached prompts, so load alone
    // decides, and two in a row land on different workers.
    let mut seen = Vec::new();
    for i in 0..2 {
        let (status, v) = select(
            g,
            "/select_and_reserve",
            &json!({"model_name": "demo-model", "token_ids": unique_prompt(i, 512)}),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["effective_prefill_tokens"], 512);
        seen.push(v["worker_id"].as_u64().unwrap());
    }
    seen.sort();
    assert_eq!(seen, vec![1, 2]);
    // Envoy's snapshot carries the reservations: a routed request weighs
    // them as it weighs its own bookings.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = stack.sidecar_state().unwrap();
        let booked: u64 = s["models"][0]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["ranks"][0]["active_prefill_tokens"].as_u64().unwrap())
            .sum();
        if booked == 1024 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "snapshot never counted them: {s}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Blocks gateway `g`'s sidecar has indexed.
fn indexed(g: &Gateway) -> f64 {
    g.sidecar_metric("kvgate_sidecar_kv_indexed_blocks{model=\"demo-model\"}")
        .unwrap_or(0.0)
}

/// Which worker gateway `g` sends each group's next request to.
fn routed_groups(g: &Gateway, groups: &[Vec<u32>]) -> Vec<String> {
    groups
        .iter()
        .map(|p| {
            let mut prompt = p.clone();
            prompt.extend([7, 7, 7]);
            let r = completion(&g.envoy_addr(), &prompt, 1).unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            r.header("x-kvgate-sim-worker").unwrap().to_string()
        })
        .collect()
}

/// Kill one gateway's sidecar and start it again: alone it starts with an
/// empty index (these engines keep one step of replay), with
/// `--indexer-peers` it takes the other sidecar's and routes by it from its
/// first decisions. The sidecars have a control token, which the dump
/// needs and the recovery sends.
#[test]
fn a_restarted_sidecar_recovers_the_index_from_its_peer() {
    let _g = serial();
    let mut stack = start(StackConfig {
        workers: 4,
        gateways: 2,
        kv_events: true,
        control_token: Some("gateways-dump".into()),
        sim_args: ["--speedup", "20", "--replay-buffer-steps", "1"]
            .map(String::from)
            .to_vec(),
        ..StackConfig::default()
    });
    // Group i (32 blocks) is cached on worker i + 1 only; then a small
    // request on every worker moves its replay buffer past the group.
    let groups: Vec<Vec<u32>> = (0..4).map(|i| unique_prompt(100 + i, 512)).collect();
    for (w, g) in stack.workers.iter().zip(&groups) {
        assert_eq!(completion(&w.endpoint(), g, 1).unwrap().status, 200);
        assert_eq!(
            completion(&w.endpoint(), &unique_prompt(900 + w.id as u32, 16), 1)
                .unwrap()
                .status,
            200
        );
    }
    let holders: Vec<String> = stack.workers.iter().map(|w| w.id.to_string()).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while indexed(&stack.gateways[0]) < 4.0 * 33.0 || indexed(&stack.gateways[1]) < 4.0 * 33.0 {
        assert!(Instant::now() < deadline, "the groups were never indexed");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(routed_groups(&stack.gateways[1], &groups), holders);

    // Alone, the restarted sidecar knows only what replay still holds.
    stack.restart_sidecar_of(1, &[]).unwrap();
    stack
        .wait_gateway_ready(1, Duration::from_secs(30))
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let alone = indexed(&stack.gateways[1]);
    assert!(alone < 4.0 * 32.0, "replay alone recovered {alone} blocks");

    // With its peer, it starts from the peer's dump, which a client
    // without the token does not get.
    let (status, _) = http::get(&stack.gateways[0].sidecar_addr(), "/dump").unwrap();
    assert_eq!(status, 401);
    let peer = format!("http://{}", stack.gateways[0].sidecar_addr());
    let t = Instant::now();
    stack
        .restart_sidecar_of(1, &["--indexer-peers".into(), peer])
        .unwrap();
    stack
        .wait_gateway_ready(1, Duration::from_secs(30))
        .unwrap();
    let ready = t.elapsed();
    let recovered = stack.gateways[1]
        .sidecar_metric("kvgate_index_recovered_blocks_total")
        .unwrap();
    let took = stack.gateways[1]
        .sidecar_metric("kvgate_index_recovery_seconds")
        .unwrap();
    eprintln!(
        "restart with --indexer-peers: {recovered} blocks recovered in {:.1} ms; Envoy routing on the new sidecar's snapshot {:.0} ms after the restart",
        took * 1e3,
        ready.as_secs_f64() * 1e3
    );
    assert!(recovered >= 4.0 * 32.0, "{recovered} blocks recovered");
    // Its first decisions follow the prefixes cached before the kill. The
    // shards reach Envoy with the first long-poll answers.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let routed = routed_groups(&stack.gateways[1], &groups);
        if routed == holders {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after recovery the groups went to {routed:?}, not {holders:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("routed by the recovered index after {attempts} round(s) of 4 requests");
}
