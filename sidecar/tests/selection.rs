//! The selection API's reservations, inspection and replica sync, over
//! HTTP and ZMQ, with stand-in workers.

mod support;

use serde_json::{Value, json};
use std::time::Duration;
use support::*;

/// The ranks' booked load, as `GET /loads` shows it: (worker, rank) →
/// (prefill tokens, decode blocks).
async fn loads(api: &str) -> Vec<((u64, u64), (u64, u64))> {
    let (status, v) = json_of("GET", &format!("{api}/loads"), None).await;
    assert_eq!(status, 200, "{v}");
    let mut out = Vec::new();
    for m in v["models"].as_array().unwrap() {
        for r in m["workers"].as_array().unwrap() {
            out.push((
                (
                    r["worker_id"].as_u64().unwrap(),
                    r["dp_rank"].as_u64().unwrap(),
                ),
                (
                    r["active_prefill_tokens"].as_u64().unwrap(),
                    r["active_decode_blocks"].as_u64().unwrap(),
                ),
            ));
        }
    }
    out.sort();
    out
}

async fn two_workers_up() -> (String, String, std::sync::Arc<kvgate_sidecar::Sidecar>) {
    let (a, _) = fake_worker().await;
    let (b, _) = fake_worker().await;
    let (base, sc) = sidecar(&[&a, &b]).await;
    let api = selection_api(&sc).await;
    wait_until("both workers up", async || workers_up(&base).await == 2).await;
    // The selection API reads the published snapshot, which follows the
    // catalog by a publish: wait until it places on each worker, as the
    // tests then assert.
    for id in [1, 2] {
        wait_until("the selection API sees the worker", async || {
            let pinned = json!({"model_name": "m", "token_ids": [1],
                                "pinned_worker": {"worker_id": id, "dp_rank": 0}});
            let (status, v) = json_of("POST", &format!("{api}/select"), Some(pinned)).await;
            status == 200 && v["worker_id"].as_u64() == Some(id)
        })
        .await;
    }
    (base, api, sc)
}

#[tokio::test(flavor = "multi_thread")]
async fn reservations_follow_their_lifecycle_and_bad_calls_change_nothing() {
    let (_, api, _sc) = two_workers_up().await;
    let res = format!("{api}/reservations");
    let (status, v) = json_of(
        "POST",
        &res,
        Some(json!({"reservation_id": "r1", "model_name": "m", "worker_id": 1, "isl_tokens": 512})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["effective_prefill_tokens"], 512);
    assert_eq!(v["decode_blocks"], 32);
    assert_eq!(v["dp_rank"], 0, "the worker's only rank");
    let booked = vec![((1, 0), (512, 32)), ((2, 0), (0, 0))];
    assert_eq!(loads(&api).await, booked);

    let huge = format!(
        r#"{{"model_name": "m", "worker_id": 1, "text": "{}"}}"#,
        "x".repeat(3 << 20)
    );
    let bad: Vec<(&str, String, Vec<u8>, u16)> = vec![
        (
            "POST",
            res.clone(),
            json!({"reservation_id": "r1", "model_name": "m", "worker_id": 2, "isl_tokens": 16})
                .to_string()
                .into_bytes(),
            409,
        ),
        (
            "POST",
            res.clone(),
            json!({"reservation_id": "r2", "model_name": "m", "worker_id": 9, "isl_tokens": 16})
                .to_string()
                .into_bytes(),
            404,
        ),
        (
            "POST",
            res.clone(),
            json!({"reservation_id": "r2", "model_name": "m", "worker_id": 1, "dp_rank": 3, "isl_tokens": 16})
                .to_string()
                .into_bytes(),
            404,
        ),
        (
            "POST",
            res.clone(),
            json!({"reservation_id": "r2", "model_name": "other", "worker_id": 1, "isl_tokens": 16})
                .to_string()
                .into_bytes(),
            404,
        ),
        (
            "POST",
            res.clone(),
            json!({"reservation_id": "r2", "model_name": "m", "worker_id": 1, "isl_tokens": 512, "effective_prefill_tokens": 513})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "POST",
            res.clone(),
            json!({"reservation_id": "r2", "model_name": "m", "worker_id": 1})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "POST",
            res.clone(),
            json!({"reservation_id": "", "model_name": "m", "worker_id": 1, "isl_tokens": 16})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "POST",
            res.clone(),
            json!({"reservation_id": "r2", "model_name": "m", "worker_id": 1, "isl_tokens": 16, "cached_tokens": 3})
                .to_string()
                .into_bytes(),
            400,
        ),
        ("POST", res.clone(), b"{not json".to_vec(), 400),
        ("POST", res.clone(), huge.into_bytes(), 413),
        (
            "POST",
            format!("{res}/r1/output_block"),
            br#"{"decay_fraction": 1.5}"#.to_vec(),
            400,
        ),
        (
            "POST",
            format!("{res}/r1/output_block"),
            br#"{"decay_fraction": -0.1}"#.to_vec(),
            400,
        ),
        (
            "POST",
            format!("{res}/r1/output_block"),
            br#"{"decay_fraction": "half"}"#.to_vec(),
            400,
        ),
        (
            "POST",
            format!("{res}/nope/prefill_complete"),
            Vec::new(),
            404,
        ),
        ("POST", format!("{res}/nope/output_block"), Vec::new(), 404),
        ("DELETE", format!("{res}/nope"), Vec::new(), 404),
        (
            "POST",
            format!("{api}/select_and_reserve"),
            json!({"reservation_id": "r1", "model_name": "m", "token_ids": [1, 2, 3]})
                .to_string()
                .into_bytes(),
            409,
        ),
    ];
    for (method, url, body, want) in bad {
        let (status, _, raw) = call_raw(method, &url, &[], body).await;
        let answer: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
        assert_eq!(status, want, "{method} {url} → {answer}");
        // axum's own 413 is plain text; every other refusal names its cause.
        assert!(
            answer["error"].as_str().is_some_and(|e| !e.is_empty())
                || (status == 413 && !raw.is_empty()),
            "{method} {url}: {answer}"
        );
        assert_eq!(
            loads(&api).await,
            booked,
            "{method} {url} changed the ledger"
        );
    }

    let post = async |path: &str, body: Vec<u8>| {
        call_raw("POST", &format!("{res}/r1/{path}"), &[], body)
            .await
            .0
    };
    assert_eq!(post("prefill_complete", Vec::new()).await, 204);
    assert_eq!(loads(&api).await[0], ((1, 0), (0, 32)));
    assert_eq!(
        post("prefill_complete", Vec::new()).await,
        204,
        "repeatable"
    );
    assert_eq!(post("output_block", Vec::new()).await, 204);
    assert_eq!(loads(&api).await[0], ((1, 0), (0, 33)));
    assert_eq!(
        post("output_block", br#"{"decay_fraction": 0.5}"#.to_vec()).await,
        204
    );
    assert_eq!(
        loads(&api).await[0],
        ((1, 0), (0, 17)),
        "34 blocks at half weight"
    );
    assert_eq!(call("DELETE", &format!("{res}/r1"), None).await.0, 204);
    assert_eq!(loads(&api).await[0], ((1, 0), (0, 0)));
    assert_eq!(call("DELETE", &format!("{res}/r1"), None).await.0, 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn select_and_reserve_books_at_once_so_a_burst_spreads() {
    let (_, api, _sc) = two_workers_up().await;
    let mut workers = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..4 {
        let (status, v) = json_of(
            "POST",
            &format!("{api}/select_and_reserve"),
            Some(json!({"model_name": "m", "token_ids": (0..256).collect::<Vec<u32>>()})),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["effective_prefill_tokens"], 256);
        workers.push(v["worker_id"].as_u64().unwrap());
        ids.push(v["reservation_id"].as_str().unwrap().to_string());
    }
    workers.sort();
    assert_eq!(
        workers,
        vec![1, 1, 2, 2],
        "each reservation is seen by the next selection"
    );
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 4, "generated ids are distinct");
    assert_eq!(
        loads(&api).await,
        vec![((1, 0), (512, 32)), ((2, 0), (512, 32))]
    );
    // A plain selection books nothing and echoes no reservation id.
    let (status, v) = json_of(
        "POST",
        &format!("{api}/select"),
        Some(json!({"model_name": "m", "reservation_id": "x", "token_ids": [1, 2]})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert!(v.get("reservation_id").is_none(), "{v}");
    assert_eq!(loads(&api).await.len(), 2);

    let (status, v) = json_of(
        "POST",
        &format!("{api}/potential_loads"),
        Some(json!({"model_name": "m", "isl_tokens": 64, "sequence_hashes": [1, 2]})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let rows = v["loads"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert_eq!(r["potential_prefill_tokens"], 512 + 64, "{r}");
        assert_eq!(r["potential_decode_blocks"], 32 + 4, "{r}");
    }
    let (status, v) = json_of(
        "POST",
        &format!("{api}/overlap_scores"),
        Some(json!({"model_name": "m", "token_ids": [1, 2, 3]})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["block_size"], 16);
    assert_eq!(v["scores"].as_array().unwrap().len(), 2);
    let (status, _) = json_of(
        "POST",
        &format!("{api}/overlap_scores"),
        Some(json!({"model_name": "m"})),
    )
    .await;
    assert_eq!(status, 400, "a prompt is required");
    let (status, v) = json_of("GET", &format!("{api}/loads?model_name=other"), None).await;
    assert_eq!(
        (status, v["models"].as_array().map(Vec::len)),
        (200, Some(0))
    );
    assert_eq!(
        call("GET", &format!("{api}/loads?colour=red"), None)
            .await
            .0,
        400
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_booking_past_max_prompt_tokens_is_refused_and_loads_stay() {
    let (_, api, sc) = two_workers_up().await;
    let idle = vec![((1, 0), (0, 0)), ((2, 0), (0, 0))];
    assert_eq!(loads(&api).await, idle);
    // Two of these, pinned to one rank, would sum to 2^64: a wrapped sum
    // reads as an idle rank (release) or panics in the ledger (debug).
    let huge = 1u64 << 63;
    for i in 0..2 {
        let (status, v) = json_of(
            "POST",
            &format!("{api}/select_and_reserve"),
            Some(
                json!({"model_name": "m", "reservation_id": format!("big-{i}"),
                        "isl_tokens": huge, "sequence_hashes": [1],
                        "pinned_worker": {"worker_id": 1, "dp_rank": 0}}),
            ),
        )
        .await;
        assert_eq!(status, 400, "{v}");
        let m = v["error"].as_str().unwrap_or("");
        assert!(m.contains("max_prompt_tokens"), "{v}");
    }
    let cases = [
        (
            "/reservations",
            json!({"model_name": "m", "worker_id": 1, "isl_tokens": huge}),
        ),
        (
            "/reservations",
            json!({"model_name": "m", "worker_id": 1, "isl_tokens": 16,
                   "expected_output_tokens": u32::MAX}),
        ),
        (
            "/select",
            json!({"model_name": "m", "isl_tokens": huge, "sequence_hashes": [1]}),
        ),
        (
            "/potential_loads",
            json!({"model_name": "m", "isl_tokens": huge, "sequence_hashes": [1]}),
        ),
    ];
    for (path, body) in cases {
        let (status, v) = json_of("POST", &format!("{api}{path}"), Some(body)).await;
        assert_eq!(status, 400, "{path}: {v}");
    }
    assert_eq!(loads(&api).await, idle, "nothing was booked");
    assert_eq!(
        metric(
            &sc,
            "kvgate_sidecar_bookings_refused_total{reason=\"out_of_bound\",source=\"api\"}"
        ),
        6.0
    );
    // Up to the bound is still booked.
    let (status, v) = json_of(
        "POST",
        &format!("{api}/reservations"),
        Some(json!({"model_name": "m", "worker_id": 1, "isl_tokens": 1u64 << 24})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_expected_output_tokens_is_refused_naming_the_field_and_its_bound() {
    let (_, api, sc) = two_workers_up().await;
    let idle = vec![((1, 0), (0, 0)), ((2, 0), (0, 0))];
    let bodies = |tokens: &str| {
        [
            (
                "/select_and_reserve",
                format!(
                    r#"{{"model_name": "m", "reservation_id": "r", "token_ids": [1], "expected_output_tokens": {tokens}}}"#
                ),
            ),
            (
                "/select",
                format!(
                    r#"{{"model_name": "m", "token_ids": [1], "expected_output_tokens": {tokens}}}"#
                ),
            ),
            (
                "/reservations",
                format!(
                    r#"{{"model_name": "m", "worker_id": 1, "isl_tokens": 16, "expected_output_tokens": {tokens}}}"#
                ),
            ),
        ]
    };
    // Past u32, past u64, and a float past u64: each over the model's
    // bound (2^24 by default), which the answer names with the field.
    let oversized = ["4294967296", "18446744073709551616", "1e30"];
    for tokens in oversized {
        for (path, body) in bodies(tokens) {
            let (status, _, b) = call_raw(
                "POST",
                &format!("{api}{path}"),
                &[("content-type", "application/json")],
                body.into_bytes(),
            )
            .await;
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(status, 400, "{path} {tokens}: {v}");
            let m = v["error"].as_str().unwrap_or("");
            assert!(
                m.contains("expected_output_tokens") && m.contains("max_prompt_tokens 16777216"),
                "{path} {tokens}: {v}"
            );
        }
    }
    // Not a count of tokens at all: named too.
    for tokens in ["-1", "2.5", "\"many\""] {
        for (path, body) in bodies(tokens) {
            let (status, _, b) = call_raw(
                "POST",
                &format!("{api}{path}"),
                &[("content-type", "application/json")],
                body.into_bytes(),
            )
            .await;
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(status, 400, "{path} {tokens}: {v}");
            let m = v["error"].as_str().unwrap_or("");
            assert!(m.contains("expected_output_tokens"), "{path} {tokens}: {v}");
        }
    }
    assert_eq!(loads(&api).await, idle, "nothing was booked");
    assert_eq!(
        metric(
            &sc,
            "kvgate_sidecar_bookings_refused_total{reason=\"out_of_bound\",source=\"api\"}"
        ),
        9.0,
        "each oversized one counted"
    );
    // Within the bound, as before: 17 tokens are two blocks of 16.
    let (status, v) = json_of(
        "POST",
        &format!("{api}/reservations"),
        Some(json!({"model_name": "m", "worker_id": 1, "isl_tokens": 16,
                    "expected_output_tokens": 17, "reservation_id": "ok"})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn writes_need_the_token_and_reads_do_not() {
    let (a, _) = fake_worker().await;
    let (_, sc) = sidecar_with(&[&a], Some("s3cret")).await;
    let api = selection_api(&sc).await;
    let body = || json!({"model_name": "m", "worker_id": 1, "isl_tokens": 16});
    for (method, path) in [
        ("POST", "/reservations"),
        ("POST", "/select_and_reserve"),
        ("POST", "/reservations/r/prefill_complete"),
        ("POST", "/reservations/r/output_block"),
        ("DELETE", "/reservations/r"),
        ("POST", "/workers"),
        ("POST", "/replica_sync/register_peer"),
    ] {
        let (status, _, _) = call(method, &format!("{api}{path}"), Some(body())).await;
        assert_eq!(status, 401, "{method} {path}");
    }
    let auth = [("authorization", "Bearer s3cret")];
    let (status, _, b) = call_raw(
        "POST",
        &format!("{api}/reservations"),
        &auth,
        body().to_string().into_bytes(),
    )
    .await;
    assert_ne!(status, 401, "{}", String::from_utf8_lossy(&b));
    assert_eq!(call("GET", &format!("{api}/loads"), None).await.0, 200);
    assert_eq!(call("GET", &format!("{api}/health"), None).await.0, 200);
}

fn replica_config(worker: &str, peers: &[&str]) -> String {
    format!(
        "[server]\npublish_interval_ms = 10\n[scrape]\ninterval_ms = 50\n\
         [load]\nvm_silence_ms = 300\n\
         [replica_sync]\nlisten = \"127.0.0.1:0\"\npeers = {peers:?}\n\
         [[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"{worker}\"\n"
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn replica_sync_shares_admissions_and_frees_between_sidecars() {
    let (w, _) = fake_worker().await;
    let (a_base, a) = sidecar_from(&replica_config(&w, &[]), None).await;
    let a_sync = a.replica().unwrap().endpoint().to_string();
    let (b_base, b) = sidecar_from(&replica_config(&w, &[&a_sync]), None).await;
    let b_sync = b.replica().unwrap().endpoint().to_string();
    let (a_api, b_api) = (selection_api(&a).await, selection_api(&b).await);
    wait_until("the worker up on both", async || {
        workers_up(&a_base).await == 1 && workers_up(&b_base).await == 1
    })
    .await;
    // A learns of B at run time.
    let (status, v) = json_of(
        "POST",
        &format!("{a_api}/replica_sync/register_peer"),
        Some(json!({"endpoint": b_sync})),
    )
    .await;
    assert_eq!((status, v["peers"].clone()), (200, json!([b_sync])));
    let (_, v) = json_of("GET", &format!("{b_api}/replica_sync/peers"), None).await;
    assert_eq!(v["peers"], json!([a_sync]));
    for bad in ["http://x:1", "tcp://nohost", "tcp://:80", "tcp://h:0"] {
        let (status, _) = json_of(
            "POST",
            &format!("{a_api}/replica_sync/register_peer"),
            Some(json!({"endpoint": bad})),
        )
        .await;
        assert_eq!(status, 400, "{bad}");
    }

    // ZMQ subscriptions take a moment to connect (and a message sent before
    // is lost: sync is best effort): reserve until each side sees the
    // other's.
    let reserve = async |api: &str, id: &str| {
        json_of(
            "POST",
            &format!("{api}/reservations"),
            Some(
                json!({"reservation_id": id, "model_name": "m", "worker_id": 1, "isl_tokens": 160}),
            ),
        )
        .await
        .0
    };
    for (from, to) in [(&a_api, &b_api), (&b_api, &a_api)] {
        let mut n = 0;
        wait_until("a peer hears a reservation", async || {
            n += 1;
            assert_eq!(reserve(from, &format!("warm-{n}")).await, 200);
            loads(to).await[0].1.0 > 0
        })
        .await;
        for i in 1..=n {
            let url = format!("{from}/reservations/warm-{i}");
            assert_eq!(call("DELETE", &url, None).await.0, 204);
        }
        wait_until("the peer hears the frees", async || {
            loads(to).await[0].1 == (0, 0)
        })
        .await;
    }

    // Each side's reservation loads the other; prefill completion and free
    // travel too.
    assert_eq!(reserve(&a_api, "from-a").await, 200);
    assert_eq!(reserve(&b_api, "from-b").await, 200);
    let both = ((1, 0), (320, 20));
    wait_until("both see both", async || {
        loads(&a_api).await == vec![both] && loads(&b_api).await == vec![both]
    })
    .await;
    let url = format!("{a_api}/reservations/from-a/prefill_complete");
    assert_eq!(call("POST", &url, None).await.0, 204);
    wait_until("B hears the prefill end", async || {
        loads(&b_api).await == vec![((1, 0), (160, 20))]
    })
    .await;
    // Output blocks stay local.
    let url = format!("{a_api}/reservations/from-a/output_block");
    assert_eq!(call("POST", &url, None).await.0, 204);
    assert_eq!(loads(&a_api).await, vec![((1, 0), (160, 21))]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(loads(&b_api).await, vec![((1, 0), (160, 20))]);
    // A peer's lifecycle calls name its own reservations only.
    let url = format!("{b_api}/reservations/from-a");
    assert_eq!(call("DELETE", &url, None).await.0, 404);
    let url = format!("{a_api}/reservations/from-a");
    assert_eq!(call("DELETE", &url, None).await.0, 204);
    wait_until("B hears the free", async || {
        loads(&b_api).await == vec![((1, 0), (160, 10))]
    })
    .await;

    // Envoy's bookings travel as well: a gateway batch posted to A.
    use kvgate_core::booking::{Event, Key};
    let post_batch = async |events: &[Event]| {
        let mut batch = Vec::new();
        for e in events {
            e.encode_into(&mut batch);
        }
        call_raw("POST", &format!("{a_base}/v1/bookings"), &[], batch)
            .await
            .0
    };
    let book = |vm: u64| Event::Book {
        key: Key { vm, seq: 1 },
        model: "m".into(),
        slot: 0,
        prefill_tokens: 1000,
        decode_blocks: 7,
        tenant: kvgate_core::DEFAULT_TENANT.into(),
    };
    assert_eq!(post_batch(&[book(5)]).await, 204);
    wait_until("B counts A's gateway booking", async || {
        loads(&b_api).await == vec![((1, 0), (1160, 17))]
    })
    .await;
    let done = Event::Done {
        key: Key { vm: 5, seq: 1 },
        timing: None,
    };
    post_batch(&[done]).await;
    wait_until("B hears the booking end", async || {
        loads(&b_api).await == vec![((1, 0), (160, 10))]
    })
    .await;
    // A VM that says it is alive and then goes silent (it died): A ends
    // its bookings after load.vm_silence_ms, and B's copies end with them.
    assert_eq!(post_batch(&[Event::Alive { vm: 6 }, book(6)]).await, 204);
    wait_until("A and B end the silent VM's booking", async || {
        loads(&a_api).await == vec![((1, 0), (160, 10))]
            && loads(&b_api).await == vec![((1, 0), (160, 10))]
    })
    .await;
    let metrics = call("GET", &format!("{a_base}/metrics"), None).await.2;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics.contains("kvgate_sidecar_bookings_silenced_total 1"),
        "{metrics}"
    );

    // Deregistered, A no longer hears B.
    let (status, v) = json_of(
        "POST",
        &format!("{a_api}/replica_sync/deregister_peer"),
        Some(json!({"endpoint": b_sync})),
    )
    .await;
    assert_eq!((status, v["peers"].clone()), (200, json!([])));
    let (status, _) = json_of(
        "POST",
        &format!("{a_api}/replica_sync/deregister_peer"),
        Some(json!({"endpoint": b_sync})),
    )
    .await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_without_the_token_cannot_book_load() {
    let (w, _) = fake_worker().await;
    let (_, a) = sidecar_from(&replica_config(&w, &[]), None).await;
    let a_sync = a.replica().unwrap().endpoint().to_string();
    let (b_base, b) = sidecar_from(&replica_config(&w, &[&a_sync]), Some("s3cret")).await;
    let a_api = selection_api(&a).await;
    let b_api = selection_api(&b).await;
    wait_until("the worker up", async || workers_up(&b_base).await == 1).await;
    let refused = async || {
        let (_, _, m) = call("GET", &format!("{b_base}/metrics"), None).await;
        String::from_utf8_lossy(&m)
            .lines()
            .find(|l| l.starts_with("kvgate_sidecar_replica_sync_refused_messages_total"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let mut n = 0;
    wait_until("B refuses A's unsigned messages", async || {
        n += 1;
        let (status, _) = json_of(
            "POST",
            &format!("{a_api}/reservations"),
            Some(json!({"reservation_id": format!("r{n}"), "model_name": "m", "worker_id": 1, "isl_tokens": 16})),
        )
        .await;
        assert_eq!(status, 200);
        refused().await > 0
    })
    .await;
    assert_eq!(loads(&b_api).await, vec![((1, 0), (0, 0))]);
}

#[tokio::test(flavor = "multi_thread")]
async fn dynamos_optional_selection_fields_are_taken() {
    let (_, api, _sc) = two_workers_up().await;
    let select =
        async |body: serde_json::Value| json_of("POST", &format!("{api}/select"), Some(body)).await;
    for _ in 0..4 {
        let (status, v) =
            select(json!({"model_name": "m", "token_ids": [1, 2], "allowed_worker_ids": [2]}))
                .await;
        assert_eq!((status, v["worker_id"].as_u64()), (200, Some(2)), "{v}");
        let (status, v) = select(
            json!({"model_name": "m", "token_ids": [1, 2], "pinned_worker": {"worker_id": 1, "dp_rank": 0}}),
        )
        .await;
        assert_eq!((status, v["worker_id"].as_u64()), (200, Some(1)), "{v}");
    }
    let (status, v) = select(
        json!({"model_name": "m", "token_ids": [1, 2], "pinned_worker": {"worker_id": 9, "dp_rank": 0}}),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    // Scheduler knobs of Dynamo's are accepted: the priority fields pick
    // the class (tier 2, a jump ahead: critical), the rest is not used.
    let (status, v) = select(json!({
        "model_name": "m", "token_ids": [1, 2], "router_config_override": {"overlap_score_weight": 2.0},
        "priority_jump": 1.5, "strict_priority": 2, "routing_constraints": {}, "expected_output_tokens": null,
    }))
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["class"], "critical", "{v}");
    // Expected output is booked as decode load: 2 prompt blocks + 10.
    let (status, v) = json_of(
        "POST",
        &format!("{api}/select_and_reserve"),
        Some(
            json!({"model_name": "m", "token_ids": (0..32).collect::<Vec<u32>>(),
                    "expected_output_tokens": 160, "pinned_worker": {"worker_id": 2}}),
        ),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = json_of(
        "POST",
        &format!("{api}/reservations"),
        Some(
            json!({"reservation_id": "r", "model_name": "m", "worker_id": 1, "isl_tokens": 16,
                    "expected_output_tokens": 17}),
        ),
    )
    .await;
    assert_eq!(
        (status, v["decode_blocks"].as_u64()),
        (200, Some(1 + 2)),
        "{v}"
    );
    assert_eq!(
        loads(&api).await,
        vec![((1, 0), (16, 3)), ((2, 0), (32, 12))]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_fields_are_refused_by_name_beside_the_prompt() {
    let (_, api, _sc) = two_workers_up().await;
    let select = json!({"model_name": "m", "token_ids": [1, 2, 3]});
    let reserve =
        json!({"reservation_id": "r9", "model_name": "m", "worker_id": 1, "isl_tokens": 16});
    for (path, body) in [
        ("potential_loads", &select),
        ("overlap_scores", &select),
        ("select", &select),
        ("select_and_reserve", &select),
        ("reservations", &reserve),
    ] {
        let url = format!("{api}/{path}");
        let mut typo = body.clone();
        typo["token_idz"] = json!([4]);
        let (status, v) = json_of("POST", &url, Some(typo)).await;
        assert_eq!(status, 400, "{path}: {v}");
        let e = v["error"].as_str().unwrap_or_default();
        assert!(e.contains("unknown field `token_idz`"), "{path}: {e}");
        // A prompt field of the wrong type is refused as before.
        let mut wrong = body.clone();
        wrong["isl_tokens"] = json!("many");
        let (status, v) = json_of("POST", &url, Some(wrong)).await;
        assert_eq!(status, 400, "{path}: {v}");
        let (status, v) = json_of("POST", &url, Some(body.clone())).await;
        assert_eq!(status, 200, "{path}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_disaggregated_model_is_selected_and_reserved_per_leg() {
    let (a, _) = fake_worker().await;
    let (b, _) = fake_worker().await;
    let toml = format!(
        "[scrape]\ninterval_ms = 50\ntimeout_ms = 200\ndown_after_ms = 300\n\
         [server]\npublish_interval_ms = 10\n\
         [[models]]\nname = \"m\"\n\
         [models.disaggregation]\nprotocol = \"vllm-nixl\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"{a}\"\nrole = \"prefill\"\n\
         [[workers]]\nworker_id = 2\nmodel_name = \"m\"\nendpoint = \"{b}\"\nrole = \"decode\"\n"
    );
    let (base, sc) = sidecar_from(&toml, None).await;
    let api = selection_api(&sc).await;
    wait_until("the model splits", async || {
        let (_, v) = json_of("GET", &format!("{base}/v1/state"), None).await;
        v["models"][0]["disaggregated"] == true
    })
    .await;
    // The selection API reads the published snapshot, a publish behind
    // the state: wait until it too places both legs, as asserted below.
    wait_until("the selection API splits the model", async || {
        let ask = json!({"model_name": "m", "token_ids": (0..256).collect::<Vec<u32>>()});
        let (status, v) = json_of("POST", &format!("{api}/select"), Some(ask)).await;
        status == 200 && v["disaggregation"]["prefill"]["worker_id"] == 1
    })
    .await;
    // The roles in the state, the catalog and the info series.
    let (_, v) = json_of("GET", &format!("{base}/v1/state"), None).await;
    let mut roles: Vec<(u64, String)> = v["models"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["worker_id"].as_u64().unwrap(),
                w["role"].as_str().unwrap().into(),
            )
        })
        .collect();
    roles.sort();
    assert_eq!(roles, [(1, "prefill".into()), (2, "decode".into())]);
    assert_eq!(
        v["models"][0]["disaggregation"]["protocol"], "vllm-nixl",
        "{v}"
    );
    let (_, v) = json_of("GET", &format!("{base}/workers"), None).await;
    assert!(
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["role"] == "prefill"),
        "{v}"
    );
    wait_until("the info series", async || {
        metric(
            &sc,
            "kvgate_sidecar_worker_info{model=\"m\",role=\"decode\",worker_id=\"2\"}",
        ) == 1.0
    })
    .await;

    let (status, v) = json_of(
        "POST",
        &format!("{api}/select_and_reserve"),
        Some(json!({"model_name": "m", "reservation_id": "r1",
                    "token_ids": (0..256).collect::<Vec<u32>>(),
                    "expected_output_tokens": 32})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    // The client sends to the decode worker; the prefill leg is its own.
    assert_eq!(
        (v["worker_id"].as_u64(), v["reservation_id"].as_str()),
        (Some(2), Some("r1"))
    );
    assert_eq!(v["effective_prefill_tokens"], 0);
    let d = &v["disaggregation"];
    assert_eq!(d["local_prefill"], false, "{v}");
    assert_eq!(d["prefill"]["worker_id"], 1, "{v}");
    assert_eq!(d["prefill"]["endpoint"], a.as_str(), "{v}");
    assert_eq!(d["prefill"]["reservation_id"], "r1.prefill", "{v}");
    assert_eq!(d["decode"]["decode_blocks"], 16 + 2, "{v}");
    // Each leg booked on its own worker.
    assert_eq!(
        loads(&api).await,
        vec![((1, 0), (256, 0)), ((2, 0), (0, 18))]
    );
    // The prefill leg answered: its reservation goes, the decode leg's
    // stays until the stream ends.
    assert_eq!(
        call("DELETE", &format!("{api}/reservations/r1.prefill"), None)
            .await
            .0,
        204
    );
    assert_eq!(loads(&api).await, vec![((1, 0), (0, 0)), ((2, 0), (0, 18))]);
    // A second call with a live id books nothing more.
    let (status, _) = json_of(
        "POST",
        &format!("{api}/select_and_reserve"),
        Some(json!({"model_name": "m", "reservation_id": "r1", "token_ids": [1, 2, 3]})),
    )
    .await;
    assert_eq!(status, 409);
    assert_eq!(loads(&api).await, vec![((1, 0), (0, 0)), ((2, 0), (0, 18))]);
}
