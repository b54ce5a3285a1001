//! The sidecar over HTTP, with stand-in workers whose Prometheus page each
//! test controls.

use kvgate_core::Snapshot;
use kvgate_core::update;
use kvgate_sidecar::api;
use kvgate_sidecar::api::views;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

mod support;

use support::*;

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_long_poll() {
    let (w, page) = fake_worker().await;
    let (base, sc) = sidecar(&[&w]).await;
    wait_until("worker up", async || workers_up(&base).await == 1).await;

    // A new reader gets a reset frame at once.
    let (status, headers, body) = call(
        "GET",
        &format!("{base}/v1/snapshot?after=0&wait_ms=5000"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let u = update::decode(&body).unwrap();
    assert!(u.reset);
    assert_eq!(u.epoch, sc.versions().epoch);
    let snap = Snapshot::decode(u.snapshot.unwrap()).unwrap();
    assert_eq!(snap.model("m").unwrap().workers[0].endpoint, w);
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "x-kvgate-version" && v == &u.version.to_string())
    );

    // Up to date: held, then 204.
    let t = Instant::now();
    let url = format!(
        "{base}/v1/snapshot?after={}&epoch={}&wait_ms=300",
        u.version, u.epoch
    );
    let (status, _, _) = call("GET", &url, None).await;
    assert_eq!(status, 204);
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "answered after {:?}",
        t.elapsed()
    );

    // A change wakes a waiting poll early, with only the snapshot.
    let url = format!(
        "{base}/v1/snapshot?after={}&epoch={}&wait_ms=5000",
        u.version, u.epoch
    );
    let poll = tokio::spawn(async move { call("GET", &url, None).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    page.set(3, 0.9);
    let t = Instant::now();
    let (status, _, body) = poll.await.unwrap();
    assert_eq!(status, 200);
    assert!(t.elapsed() < Duration::from_secs(2));
    let u2 = update::decode(&body).unwrap();
    assert!(!u2.reset);
    let snap = Snapshot::decode(u2.snapshot.unwrap()).unwrap();
    let r = &snap.model("m").unwrap().workers[0].ranks[0];
    assert_eq!(
        (r.running, r.kv_used_blocks, r.busy),
        (3, 900, true),
        "0.9 usage is over the 0.5 threshold"
    );

    // Another epoch (a restarted sidecar's reader) gets a reset.
    let (_, _, body) = call(
        "GET",
        &format!("{base}/v1/snapshot?after={}&epoch=1&wait_ms=0", u2.version),
        None,
    )
    .await;
    assert!(update::decode(&body).unwrap().reset);
}

#[tokio::test(flavor = "multi_thread")]
async fn workers_go_down_and_come_back() {
    let (w, page) = fake_worker().await;
    let (base, _sc) = sidecar(&[&w]).await;
    wait_until("ready", async || {
        call("GET", &format!("{base}/ready"), None).await.0 == 200
    })
    .await;
    page.break_it();
    wait_until("down", async || workers_up(&base).await == 0).await;
    let (status, body) = json_of("GET", &format!("{base}/ready"), None).await;
    assert_eq!(status, 503);
    assert!(
        body["workers"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("500"),
        "{body}"
    );
    page.set(1, 0.1);
    wait_until("back up", async || workers_up(&base).await == 1).await;
    let (_, _, metrics) = call("GET", &format!("{base}/metrics"), None).await;
    let text = String::from_utf8(metrics).unwrap();
    for name in [
        "kvgate_sidecar_scrapes_total{worker_id=\"1\"}",
        "kvgate_sidecar_scrape_errors_total{worker_id=\"1\"}",
        "kvgate_sidecar_worker_up{model=\"m\",worker_id=\"1\"} 1",
        "kvgate_sidecar_workers_up{model=\"m\"} 1",
        "kvgate_sidecar_snapshot_version",
        "kvgate_sidecar_rank_running{dp_rank=\"0\",worker_id=\"1\"} 1",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn worker_catalog_api() {
    let (w, _page) = fake_worker().await;
    let (base, _sc) = sidecar(&[]).await;
    assert_eq!(call("GET", &format!("{base}/ready"), None).await.0, 503);
    let worker = json!({"worker_id": 7, "model_name": "m", "endpoint": format!("http://{w}"), "data_parallel_size": 1});
    let (status, body) = json_of("POST", &format!("{base}/workers"), Some(worker.clone())).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["endpoint"], w);
    assert_eq!(body["tenant_id"], "default");
    assert_eq!(
        json_of("POST", &format!("{base}/workers"), Some(worker))
            .await
            .0,
        409
    );
    let unknown = json!({"worker_id": 8, "model_name": "zz", "endpoint": "127.0.0.1:1"});
    assert_eq!(
        json_of("POST", &format!("{base}/workers"), Some(unknown))
            .await
            .0,
        404
    );
    let bad = json!({"worker_id": 9, "model_name": "m", "endpoint": "not-an-address"});
    assert_eq!(
        json_of("POST", &format!("{base}/workers"), Some(bad))
            .await
            .0,
        400
    );
    let typo =
        json!({"worker_id": 9, "model_name": "m", "endpoint": "127.0.0.1:1", "blok_size": 3});
    assert_eq!(
        json_of("POST", &format!("{base}/workers"), Some(typo))
            .await
            .0,
        400
    );
    wait_until("registered worker up", async || {
        workers_up(&base).await == 1
    })
    .await;
    assert_eq!(call("GET", &format!("{base}/ready"), None).await.0, 200);

    let (status, body) = json_of(
        "PATCH",
        &format!("{base}/workers/7"),
        Some(json!({"block_size": 32})),
    )
    .await;
    assert_eq!((status, body["block_size"].as_u64()), (200, Some(32)));
    assert_eq!(
        json_of(
            "PATCH",
            &format!("{base}/workers/7"),
            Some(json!({"block_size": 0}))
        )
        .await
        .0,
        400
    );
    assert_eq!(
        json_of("PATCH", &format!("{base}/workers/99"), Some(json!({})))
            .await
            .0,
        404
    );
    let (_, list) = json_of("GET", &format!("{base}/workers"), None).await;
    assert_eq!(list["workers"][0]["block_size"], 32);
    assert_eq!(
        call("DELETE", &format!("{base}/workers/7"), None).await.0,
        204
    );
    assert_eq!(
        call("DELETE", &format!("{base}/workers/7"), None).await.0,
        404
    );
    wait_until("removed", async || workers_up(&base).await == 0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn busy_threshold_api_in_dynamos_shapes() {
    let (base, sc) = sidecar(&[]).await;
    let url = format!("{base}/busy_threshold");
    let (status, body) = json_of("GET", &url, None).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"thresholds": [{"model": "m", "active_decode_blocks_threshold": 0.5}]})
    );
    // Partial update: only what is given changes.
    let (status, body) = json_of(
        "POST",
        &url,
        Some(json!({"model": "m", "active_prefill_tokens_threshold": 10000})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"model": "m", "active_decode_blocks_threshold": 0.5, "active_prefill_tokens_threshold": 10000})
    );
    // Only the model: a read.
    let (_, body) = json_of("POST", &url, Some(json!({"model": "m"}))).await;
    assert_eq!(body["active_prefill_tokens_threshold"], 10000);
    // null unsets one condition.
    let (_, body) = json_of(
        "POST",
        &url,
        Some(json!({"model": "m", "active_decode_blocks_threshold": null})),
    )
    .await;
    assert!(
        body.get("active_decode_blocks_threshold").is_none(),
        "{body}"
    );
    // The published snapshot carries the change.
    wait_until("thresholds published", async || {
        sc.store().snapshot().models[0]
            .thresholds
            .active_prefill_tokens
            == Some(10000)
            && sc.store().snapshot().models[0]
                .thresholds
                .active_decode_blocks
                .is_none()
    })
    .await;
    for (bad, want) in [
        (
            json!({"model": "nope", "active_decode_blocks_threshold": 0.9}),
            404,
        ),
        (
            json!({"model": "m", "active_decode_blocks_threshold": 1.5}),
            400,
        ),
        (
            json!({"model": "m", "active_prefill_tokens_threshold": -1}),
            400,
        ),
        (
            json!({"model": "m", "active_prefill_tokens_threshold_frac": 0}),
            400,
        ),
        (
            json!({"model": "m", "active_decode_block_threshold": 0.5}),
            400,
        ),
        (json!({"active_decode_blocks_threshold": 0.5}), 400),
        (json!([1, 2]), 400),
    ] {
        let (status, body) = json_of("POST", &url, Some(bad.clone())).await;
        assert_eq!(status, want, "{bad} -> {body}");
        assert!(body["error"].is_string(), "{body}");
    }
    let (_, body) = json_of(
        "POST",
        &url,
        Some(json!({"model": "m", "active_decode_block_threshold": 0.5})),
    )
    .await;
    let e = body["error"].as_str().unwrap_or_default();
    assert!(e.contains("`active_decode_block_threshold`"), "{e}");
    let (s, _, _) = call_raw("POST", &url, &[], b"{not json".to_vec()).await;
    assert_eq!(s, 400);
    let (_, body) = json_of("GET", &url, None).await;
    assert_eq!(
        body["thresholds"][0],
        json!({"model": "m", "active_prefill_tokens_threshold": 10000}),
        "failed requests changed nothing"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_control_api_requires_the_token_when_one_is_set() {
    let (base, sc) = sidecar_with(&[], Some("s3cret")).await;
    let selection = selection_api(&sc).await;
    // The index dump tells what every engine caches: on both listeners.
    for url in [
        format!("{base}/busy_threshold"),
        format!("{base}/workers"),
        format!("{base}/dump"),
        format!("{selection}/dump"),
    ] {
        let path = &url;
        let (status, headers, _) = call_raw("GET", &url, &[], Vec::new()).await;
        assert_eq!(status, 401, "{path}");
        assert!(
            headers
                .iter()
                .any(|(k, v)| k == "www-authenticate" && v == "Bearer")
        );
        let wrong = [("authorization", "Bearer s3cre")];
        assert_eq!(call_raw("GET", &url, &wrong, Vec::new()).await.0, 401);
        let right = [("authorization", "Bearer s3cret")];
        assert_eq!(call_raw("GET", &url, &right, Vec::new()).await.0, 200);
    }
    // The data plane and health stay open.
    assert_eq!(call("GET", &format!("{base}/health"), None).await.0, 200);
    assert_eq!(call("GET", &format!("{base}/v1/state"), None).await.0, 200);
    assert!(
        metric(&sc, "kvgate_sidecar_unauthorized_total{path=\"/dump\"}") >= 2.0,
        "counted as every refused route is"
    );
}

/// Sends `uri` to the sidecar's router in-process and returns its answer
/// with the body unread: a client that reads nothing yet.
async fn unread(app: &axum::Router, uri: &str) -> axum::response::Response {
    use tower::ServiceExt;
    let req = hyper::Request::get(uri)
        .body(axum::body::Body::empty())
        .unwrap();
    app.clone().oneshot(req).await.unwrap()
}

/// The first bytes a reader is sent, which it has not asked for yet.
async fn first_chunk(r: axum::response::Response) -> (bytes::Bytes, axum::body::Body) {
    use http_body_util::BodyExt;
    let mut body = r.into_body();
    let chunk = body.frame().await.unwrap().unwrap().into_data().unwrap();
    (chunk, body)
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_whole_index_readers_share_one_copy_and_are_capped() {
    let (_base, sc) = sidecar_from(
        "[server]\nmax_full_reads = 3\nfull_read_reuse_ms = 60000\n[[models]]\nname = \"m\"\n",
        None,
    )
    .await;
    let app = api::router(sc.clone());
    let selection = api::selection_router(sc.clone());
    let copies = "kvgate_sidecar_full_read_copies_total{what=\"dump\"}";

    // Three readers that read one chunk and stop, on both listeners.
    let mut held = Vec::new();
    for router in [&app, &selection, &app] {
        let r = unread(router, "/dump").await;
        assert_eq!(r.status(), 200);
        held.push(first_chunk(r).await);
    }
    assert_eq!(metric(&sc, copies), 1.0, "one encode for every reader");
    assert!(
        held.iter().all(|(c, _)| c.as_ptr() == held[0].0.as_ptr()),
        "every reader is sent the same allocation"
    );
    assert_eq!(
        metric(&sc, "kvgate_sidecar_full_reads_open{what=\"dump\"}"),
        3.0
    );

    // A fourth, for the dump or a reset frame, is refused before any copy.
    for (uri, what) in [
        ("/dump", "dump"),
        ("/v1/snapshot?after=0", "snapshot_reset"),
    ] {
        let r = unread(&app, uri).await;
        assert_eq!(r.status(), 503, "{uri}");
        assert_eq!(r.headers()["retry-after"], "1", "{uri}");
        let series = format!("kvgate_sidecar_full_reads_refused_total{{what=\"{what}\"}}");
        assert_eq!(metric(&sc, &series), 1.0);
    }
    assert_eq!(metric(&sc, copies), 1.0);

    // A reader that finishes gives its place back; the copy is decoded
    // whole from its chunks.
    let (first, body) = held.pop().unwrap();
    let rest = {
        use http_body_util::BodyExt;
        body.collect().await.unwrap().to_bytes()
    };
    let whole = [first.as_ref(), rest.as_ref()].concat();
    kvgate_sidecar::sources::kv::dump::decode(&whole).unwrap();
    let r = unread(&app, "/v1/snapshot?after=0").await;
    assert_eq!(r.status(), 200);
    assert!(update::decode(&first_chunk(r).await.0).unwrap().reset);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_booking_past_max_prompt_tokens_is_refused_and_counted() {
    use kvgate_core::booking::{Event, Key};
    let (w, _page) = fake_worker().await;
    let (base, sc) = sidecar(&[&w]).await;
    wait_until("worker up", async || workers_up(&base).await == 1).await;
    let slot = sc.store().snapshot().models[0].workers[0].ranks[0].slot;
    let book = |seq: u64, prefill_tokens: u32, decode_blocks: u32| Event::Book {
        key: Key { vm: 5, seq },
        model: "m".into(),
        slot,
        prefill_tokens,
        decode_blocks,
        tenant: kvgate_core::DEFAULT_TENANT.into(),
    };
    let mut batch = Vec::new();
    // Over the default bound of 2^24 tokens (and 2^25 blocks), then within.
    book(1, u32::MAX, 1).encode_into(&mut batch);
    book(2, 1, u32::MAX).encode_into(&mut batch);
    book(3, 1 << 24, 1 << 25).encode_into(&mut batch);
    let url = format!("{base}/v1/bookings");
    assert_eq!(call_raw("POST", &url, &[], batch).await.0, 204);
    assert_eq!(sc.active_bookings(), 1, "only the booking within the bound");
    assert_eq!(
        metric(
            &sc,
            "kvgate_sidecar_bookings_refused_total{reason=\"out_of_bound\",source=\"gateway\"}"
        ),
        2.0
    );
    wait_until("the watermark passes the refused bookings", async || {
        sc.store().snapshot().applied == vec![kvgate_core::Applied { vm: 5, seq: 3 }]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bookings_load_ranks_until_released() {
    use kvgate_core::booking::{Event, Key};
    let (w, _page) = fake_worker().await;
    let (base, sc) = sidecar(&[&w]).await;
    wait_until("worker up", async || workers_up(&base).await == 1).await;
    let slot = sc.store().snapshot().models[0].workers[0].ranks[0].slot;
    let key = Key { vm: 77, seq: 1 };
    let mut batch = Vec::new();
    Event::Book {
        key,
        model: "m".into(),
        slot,
        prefill_tokens: 3000,
        decode_blocks: 200,
        tenant: kvgate_core::DEFAULT_TENANT.into(),
    }
    .encode_into(&mut batch);
    Event::Rejected {
        model: "m".into(),
        reason: kvgate_core::reply::Reason::AllWorkersBusy,
    }
    .encode_into(&mut batch);
    let bookings_url = format!("{base}/v1/bookings");
    let post = |b: Vec<u8>| call_raw("POST", &bookings_url, &[], b);
    assert_eq!(post(batch).await.0, 204);
    let rank = async || {
        let (_, s) = json_of("GET", &format!("{base}/v1/state"), None).await;
        s["models"][0]["workers"][0]["ranks"][0].clone()
    };
    wait_until("booking visible", async || {
        rank().await["active_prefill_tokens"] == 3000
    })
    .await;
    let r = rank().await;
    // 200 of 1000 blocks booked: under the 0.5 decode threshold.
    assert_eq!(
        (r["active_decode_blocks"].as_u64(), r["busy"].as_bool()),
        (Some(200), Some(false))
    );
    assert_eq!(
        sc.store().snapshot().applied,
        vec![kvgate_core::Applied { vm: 77, seq: 1 }]
    );
    let (_, _, m) = call("GET", &format!("{base}/metrics"), None).await;
    let m = String::from_utf8(m).unwrap();
    assert!(
        m.contains("kvgate_sidecar_routed_total{model=\"m\",worker_id=\"1\"} 1"),
        "{m}"
    );
    assert!(m.contains("kvgate_sidecar_rejected_total{model=\"m\",reason=\"all_workers_busy\"} 1"));
    assert!(m.contains("kvgate_sidecar_bookings_active{model=\"m\"} 1"));
    assert!(
        m.contains("kvgate_sidecar_rank_active_prefill_tokens{dp_rank=\"0\",worker_id=\"1\"} 3000")
    );

    assert_eq!(post(Event::FirstByte { key }.encode()).await.0, 204);
    wait_until("prefill released", async || {
        rank().await["active_prefill_tokens"] == 0
    })
    .await;
    assert_eq!(rank().await["active_decode_blocks"], 200);
    // The request's prompt was 4096 tokens, of which 3000 were booked as
    // uncached: 1096 were predicted cached.
    let timing = kvgate_core::booking::Timing {
        first_byte_us: 20_000,
        total_us: 90_000,
        isl_tokens: 4096,
        output_tokens: 8,
        status: 200,
        client_first_byte_us: 20_000,
        ..Default::default()
    };
    assert_eq!(
        post(
            Event::Done {
                key,
                timing: Some(timing)
            }
            .encode()
        )
        .await
        .0,
        204
    );
    wait_until("decode released", async || {
        rank().await["active_decode_blocks"] == 0
    })
    .await;
    let (_, _, m) = call("GET", &format!("{base}/metrics"), None).await;
    let m = String::from_utf8(m).unwrap();
    assert!(
        m.contains("kvgate_sidecar_routed_prompt_tokens_total{model=\"m\"} 4096"),
        "{m}"
    );
    assert!(
        m.contains("kvgate_sidecar_routed_cached_tokens_total{model=\"m\"} 1096"),
        "{m}"
    );
    // Its one leg, served whole by a `both` worker, is timed by role and
    // leg; the client's wait once, by model.
    let whole = "leg=\"whole\",model=\"m\",role=\"both\"";
    for series in [
        format!("kvgate_sidecar_leg_seconds_count{{{whole}}} 1"),
        format!("kvgate_sidecar_leg_seconds_bucket{{{whole},le=\"0.1\"}} 1"),
        format!("kvgate_sidecar_leg_first_byte_seconds_bucket{{{whole},le=\"0.01\"}} 0"),
        format!("kvgate_sidecar_leg_first_byte_seconds_bucket{{{whole},le=\"0.025\"}} 1"),
        "kvgate_sidecar_client_ttft_seconds_count{model=\"m\"} 1".to_string(),
    ] {
        assert!(m.contains(&series), "{series} in {m}");
    }
    // A malformed batch is refused whole and changes nothing.
    let (status, _, body) = post(vec![42, 1, 2]).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    assert_eq!(sc.active_bookings(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn reports_require_the_token_when_one_is_set() {
    use kvgate_core::approx::{ChunkKind, Routed};
    use kvgate_core::booking::{Event, Key};
    let (w, _page) = fake_worker().await;
    let (base, sc) = sidecar_with(&[&w], Some("s3cret")).await;
    wait_until("worker up", async || workers_up(&base).await == 1).await;
    let slot = sc.store().snapshot().models[0].workers[0].ranks[0].slot;
    // Enough prefill to make the rank busy for the booking TTL, were it
    // accepted from anyone.
    let booking = Event::Book {
        key: Key { vm: 66, seq: 1 },
        model: "m".into(),
        slot,
        prefill_tokens: 1_000_000,
        decode_blocks: 1000,
        tenant: kvgate_core::DEFAULT_TENANT.into(),
    }
    .encode();
    let mut routed = Vec::new();
    Routed {
        model: "m".into(),
        slot,
        kind: ChunkKind::Text,
        hashes: vec![11, 12],
    }
    .encode_into(&mut routed);
    let bookings_url = format!("{base}/v1/bookings");
    let routed_url = format!("{base}/v1/routed");
    for headers in [
        &[][..],
        &[("authorization", "Bearer s3cre")][..],
        &[("authorization", "Bearer s3cret2")][..],
        &[("authorization", "s3cret")][..],
    ] {
        for (url, body) in [(&bookings_url, &booking), (&routed_url, &routed)] {
            let (status, h, _) = call_raw("POST", url, headers, body.clone()).await;
            assert_eq!(status, 401, "{url} with {headers:?}");
            assert!(
                h.iter()
                    .any(|(k, v)| k == "www-authenticate" && v == "Bearer"),
                "{h:?}"
            );
        }
    }
    // Counted per route, where an operator looks: a filter without the
    // token routes on without its bookings, and Envoy says nothing.
    for path in ["/v1/bookings", "/v1/routed"] {
        let series = format!("kvgate_sidecar_unauthorized_total{{path=\"{path}\"}}");
        assert_eq!(metric(&sc, &series), 4.0, "{path}");
    }
    let (_, s) = json_of("GET", &format!("{base}/v1/state"), None).await;
    assert_eq!(
        s["unauthorized"],
        json!({"/v1/bookings": 4, "/v1/routed": 4}),
        "{s}"
    );
    let rank = async || {
        let (_, s) = json_of("GET", &format!("{base}/v1/state"), None).await;
        s["models"][0]["workers"][0]["ranks"][0].clone()
    };
    // Refused batches changed nothing, then or after a few publishes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = rank().await;
    assert_eq!(
        (
            r["active_prefill_tokens"].as_u64(),
            r["active_decode_blocks"].as_u64(),
            r["busy"].as_bool()
        ),
        (Some(0), Some(0), Some(false)),
        "{r}"
    );
    assert_eq!(sc.active_bookings(), 0);
    assert!(sc.store().snapshot().applied.is_empty());
    assert_eq!(sc.metrics().selection.approx_learned.get(), 0);

    let right = [("authorization", "Bearer s3cret")];
    assert_eq!(
        call_raw("POST", &bookings_url, &right, booking).await.0,
        204
    );
    assert_eq!(call_raw("POST", &routed_url, &right, routed).await.0, 204);
    wait_until("booking visible", async || {
        rank().await["active_prefill_tokens"] == 1_000_000
    })
    .await;
    assert_eq!(sc.active_bookings(), 1);
    assert_eq!(sc.metrics().selection.approx_learned.get(), 2);
    // Reading stays open.
    for path in ["/v1/state", "/health", "/metrics", "/v1/snapshot?wait_ms=0"] {
        let (status, _, _) = call_raw("GET", &format!("{base}{path}"), &[], Vec::new()).await;
        assert_eq!(status, 200, "{path}");
    }
    assert_eq!(
        call_raw("GET", &format!("{base}/ready"), &[], Vec::new())
            .await
            .0,
        200
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_is_up_only_when_its_page_is_an_engines() {
    let (real, _page) = fake_worker().await;
    let (other, other_page) = fake_worker().await;
    other_page.not_an_engine();
    let (base, _sc) = sidecar(&[&real, &other]).await;
    let up_ids = async || {
        let (_, s) = json_of("GET", &format!("{base}/v1/state"), None).await;
        s["models"][0]["workers"]
            .as_array()
            .map(|ws| ws.iter().filter_map(|w| w["worker_id"].as_u64()).collect())
            .unwrap_or_else(Vec::new)
    };
    wait_until("the engine up", async || up_ids().await == [1]).await;
    // Many scrapes of the other page later, it is still not routable.
    for _ in 0..15 {
        assert_eq!(up_ids().await, [1]);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, w) = json_of("GET", &format!("{base}/workers/2"), None).await;
    assert_eq!(w["status"]["up"], false, "{w}");
    assert!(w["status"]["scrape_errors"].as_u64() > Some(3), "{w}");
    assert!(
        w["status"]["last_error"]
            .as_str()
            .unwrap_or("")
            .contains("none of vLLM's or SGLang's metrics"),
        "{w}"
    );
    // The same worker serving the engine's page comes up.
    other_page.set(0, 0.0);
    wait_until("the second engine up", async || up_ids().await == [1, 2]).await;
    // And goes down again when the page stops being the engine's.
    other_page.not_an_engine();
    wait_until("down again", async || up_ids().await == [1]).await;
}

/// The JSON bodies clients see, key for key: the typed views must keep
/// them exactly as they were.
#[tokio::test(flavor = "multi_thread")]
async fn json_bodies_keep_their_shapes() {
    let (w, page) = fake_worker().await;
    page.break_it();
    let (base, _sc) = sidecar(&[&w]).await;
    let (status, mut ready) = json_of("GET", &format!("{base}/ready"), None).await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(
        ready["workers"].as_array().map(Vec::len),
        Some(1),
        "{ready}"
    );
    assert!(ready["workers"][0]["reason"].is_string(), "{ready}");
    ready["workers"][0]["reason"] = json!("-");
    assert_eq!(
        ready,
        json!({"status": "not ready", "reason": "no schedulable worker",
               "workers": [{"worker_id": 1, "reason": "-"}]})
    );
    page.set(2, 0.25);
    wait_until("worker up", async || workers_up(&base).await == 1).await;

    let (_, health) = json_of("GET", &format!("{base}/health"), None).await;
    assert_eq!(health, json!({"status": "ok"}));
    let (_, ready) = json_of("GET", &format!("{base}/ready"), None).await;
    assert_eq!(ready, json!({"status": "ready", "workers_up": 1}));

    let (_, state) = json_of("GET", &format!("{base}/v1/state"), None).await;
    let keys = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        k.sort();
        k
    };
    assert_eq!(keys(&state), ["built_at_ms", "epoch", "models", "version"]);
    let m = &state["models"][0];
    assert_eq!(
        keys(m),
        [
            "mode",
            "name",
            "retry_after_s",
            "service_rate_per_s",
            "shard_count",
            "thresholds",
            "workers"
        ]
    );
    assert_eq!(m["mode"], "approximate");
    assert_eq!(
        m["thresholds"],
        json!({"active_decode_blocks_threshold": 0.5,
               "active_prefill_tokens_threshold": null,
               "active_prefill_tokens_threshold_frac": null,
               "active_decode_requests_threshold": null})
    );
    let wk = &m["workers"][0];
    assert_eq!(
        keys(wk),
        [
            "block_size",
            "bootstrap_port",
            "draining",
            "endpoint",
            "ranks",
            "role",
            "tenant_id",
            "thermal",
            "worker_id"
        ]
    );
    assert_eq!(wk["draining"], false);
    assert_eq!(wk["role"], "both");
    assert_eq!(wk["bootstrap_port"], 8998, "SGLang's default");
    assert_eq!(
        wk["thermal"],
        json!({"state": "unmonitored", "heat": 0.0, "cap": 0, "in_flight": 2}),
        "no GPUs named: nothing known, the engine's two running in flight"
    );
    assert_eq!(
        wk["ranks"][0],
        json!({"dp_rank": 0, "slot": 0, "active_prefill_tokens": 0, "active_decode_blocks": 0,
               "kv_used_blocks": 250, "kv_total_blocks": 1000, "max_num_batched_tokens": 0,
               "running": 2, "waiting": 0, "busy": false})
    );

    let (_, worker) = json_of("GET", &format!("{base}/workers/1"), None).await;
    let mut shown = worker.clone();
    let status = shown
        .as_object_mut()
        .and_then(|o| o.remove("status"))
        .unwrap_or(Value::Null);
    assert_eq!(
        shown,
        json!({"worker_id": 1, "model_name": "m", "tenant_id": "default", "role": "both",
               "bootstrap_port": null, "endpoint": w,
               "metrics_url": null, "block_size": 16, "data_parallel_start_rank": 0,
               "data_parallel_size": 1, "max_num_batched_tokens": 0,
               "kv_events_endpoints": {}, "replay_endpoint": null, "slots": [0],
               "lifecycle": "schedulable"})
    );
    assert_eq!(
        keys(&status),
        ["last_error", "scrape_errors", "scrapes", "up"]
    );
    assert_eq!(
        (&status["up"], &status["last_error"]),
        (&json!(true), &Value::Null)
    );
    let (_, list) = json_of("GET", &format!("{base}/workers"), None).await;
    assert_eq!(keys(&list), ["workers"]);
    assert_eq!(keys(&list["workers"][0]), keys(&worker));

    let (_, th) = json_of("GET", &format!("{base}/busy_threshold"), None).await;
    assert_eq!(
        th,
        json!({"thresholds": [{"model": "m", "active_decode_blocks_threshold": 0.5}]})
    );
    let (status, err) = json_of("GET", &format!("{base}/workers/9"), None).await;
    assert_eq!((status, keys(&err)), (404, vec!["error".to_string()]));

    // The typed views read each body and write it back unchanged.
    fn round_trip<T: serde::Serialize + serde::de::DeserializeOwned>(v: &Value) {
        let typed: T = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(&serde_json::to_value(&typed).unwrap(), v);
    }
    round_trip::<views::StateView>(&state);
    round_trip::<views::WorkerView>(&worker);
    round_trip::<views::WorkerList>(&list);
    round_trip::<views::ThresholdsList>(&th);
    round_trip::<views::ReadyView>(&ready);
    round_trip::<views::HealthView>(&health);
    round_trip::<views::ErrorView>(&err);
}

#[tokio::test(flavor = "multi_thread")]
async fn select_places_a_prompt_as_the_filter_would_and_refuses_bad_input() {
    let (busy, busy_page) = fake_worker().await;
    let (idle, _) = fake_worker().await;
    busy_page.set(6, 0.2);
    let (base, sc) = sidecar(&[&busy, &idle]).await;
    // The selection API is on a listener of its own.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/select", l.local_addr().unwrap());
    let app = api::selection_router(sc.clone());
    tokio::spawn(async move { axum::serve(l, app).await });
    assert_eq!(
        call("POST", &format!("{base}/select"), Some(json!({})))
            .await
            .0,
        404,
        "not on the control listener"
    );
    wait_until("both workers up", async || {
        call("GET", &format!("{base}/ready"), None).await.0 == 200
            && json_of("GET", &format!("{base}/v1/state"), None).await.1["models"][0]["workers"]
                .as_array()
                .is_some_and(|w| w.len() == 2)
    })
    .await;
    // No index here: the least-loaded worker, with nothing matched.
    let (status, v) = json_of(
        "POST",
        &url,
        Some(json!({"selection_id": "s-1", "model_name": "m", "token_ids": [1, 2, 3, 4]})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let v: views::SelectionView = serde_json::from_value(v).unwrap();
    assert_eq!(v.selection_id.as_deref(), Some("s-1"));
    assert_eq!((v.tenant_id.as_str(), v.block_size), ("default", 16));
    assert_eq!(
        v.overlap,
        views::OverlapView {
            dp: [("0".to_string(), 0)].into(),
            ..Default::default()
        }
    );
    assert_eq!(v.effective_prefill_tokens, 4);
    let (status, v) = json_of(
        "POST",
        &url,
        Some(json!({"model_name": "m", "text": "a shared system prompt"})),
    )
    .await;
    assert_eq!((status, v["worker_id"].as_u64()), (200, Some(2)), "{v}");
    assert!(v.get("selection_id").is_none(), "omitted when absent");

    for (body, want) in [
        (json!({"model_name": "m"}), 400),
        (
            json!({"model_name": "m", "token_ids": [1], "prompt": "x"}),
            400,
        ),
        (json!({"model_name": "m", "sequence_hashes": [1, 2]}), 400),
        (json!({"model_name": "other", "token_ids": [1]}), 404),
        (
            json!({"model_name": "m", "tenant_id": "t", "token_ids": [1]}),
            503,
        ),
    ] {
        let (status, v) = json_of("POST", &url, Some(body.clone())).await;
        assert_eq!(status, want, "{body} → {v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
    let (status, _, _) = call_raw("POST", &url, &[], b"{not json".to_vec()).await;
    assert_eq!(status, 400);
    assert_eq!(call("GET", &url, None).await.0, 405);
    // Bodies are bounded before they are parsed.
    let huge = format!(
        r#"{{"model_name": "m", "text": "{}"}}"#,
        "x".repeat(3 << 20)
    );
    let (status, _, _) = call_raw("POST", &url, &[], huge.into_bytes()).await;
    assert_eq!(status, 413);
}

/// A disaggregated request's two legs, each booked and ended on its own
/// worker: each is timed by its worker's role, the client's wait and the
/// prompt are counted once, and a leg that failed is not timed.
#[tokio::test(flavor = "multi_thread")]
async fn each_leg_is_timed_by_its_workers_role() {
    use kvgate_core::booking::{Event, Key, Timing};
    use kvgate_core::plan::Leg;
    let (p, _) = fake_worker().await;
    let (d, _) = fake_worker().await;
    let (base, sc) = sidecar_from(
        &format!(
            "[scrape]\ninterval_ms = 50\n[server]\npublish_interval_ms = 10\n\
             [[models]]\nname = \"m\"\n[models.disaggregation]\nprotocol = \"vllm-nixl\"\n\
             [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"{p}\"\nrole = \"prefill\"\n\
             [[workers]]\nworker_id = 2\nmodel_name = \"m\"\nendpoint = \"{d}\"\nrole = \"decode\"\n"
        ),
        None,
    )
    .await;
    wait_until("workers up", async || workers_up(&base).await == 2).await;
    let snap = sc.store().snapshot();
    let slot = |id: u64| {
        snap.models[0]
            .workers
            .iter()
            .find(|w| w.id == id)
            .map(|w| w.ranks[0].slot)
            .unwrap()
    };
    let key = |seq| Key { vm: 5, seq };
    let timing = |leg, status, first_byte_us, client_first_byte_us| Timing {
        leg,
        first_byte_us,
        total_us: first_byte_us,
        isl_tokens: 1000,
        output_tokens: 1,
        status,
        client_first_byte_us,
    };
    let mut batch = Vec::new();
    for (seq, worker, prefill_tokens) in [(1, 1, 600), (2, 2, 0), (3, 2, 0)] {
        Event::Book {
            key: key(seq),
            model: "m".into(),
            slot: slot(worker),
            prefill_tokens,
            decode_blocks: 10,
            tenant: kvgate_core::DEFAULT_TENANT.into(),
        }
        .encode_into(&mut batch);
    }
    for (seq, t) in [
        // The prefill leg answered in 300 ms; the decode leg's own first
        // token came 20 ms after it was sent, the client's 400 ms after
        // the decision.
        (1, timing(Leg::Prefill, 200, 300_000, 0)),
        (2, timing(Leg::Decode, 200, 20_000, 400_000)),
        (3, timing(Leg::Decode, 503, 1_000, 2_000)),
    ] {
        Event::Done {
            key: key(seq),
            timing: Some(t),
        }
        .encode_into(&mut batch);
    }
    let url = format!("{base}/v1/bookings");
    assert_eq!(call_raw("POST", &url, &[], batch).await.0, 204);
    assert_eq!(sc.active_bookings(), 0);
    let m = sc.metrics().render();
    let prefill = "leg=\"prefill\",model=\"m\",role=\"prefill\"";
    let decode = "leg=\"decode\",model=\"m\",role=\"decode\"";
    for series in [
        format!("kvgate_sidecar_leg_seconds_count{{{prefill}}} 1"),
        format!("kvgate_sidecar_leg_seconds_bucket{{{prefill},le=\"0.25\"}} 0"),
        format!("kvgate_sidecar_leg_seconds_bucket{{{prefill},le=\"0.5\"}} 1"),
        format!("kvgate_sidecar_leg_seconds_count{{{decode}}} 1"),
        format!("kvgate_sidecar_leg_first_byte_seconds_bucket{{{decode},le=\"0.025\"}} 1"),
        "kvgate_sidecar_client_ttft_seconds_count{model=\"m\"} 1".into(),
        "kvgate_sidecar_client_ttft_seconds_bucket{model=\"m\",le=\"0.25\"} 0".into(),
        // Where the prompt was computed: 400 of its 1000 tokens cached.
        "kvgate_sidecar_routed_prompt_tokens_total{model=\"m\"} 1000".into(),
        "kvgate_sidecar_routed_cached_tokens_total{model=\"m\"} 400".into(),
    ] {
        assert!(m.contains(&series), "{series} in {m}");
    }
    assert!(
        !m.lines()
            .any(|l| l.starts_with("kvgate_sidecar_leg") && l.contains("role=\"both\"")),
        "no leg on a both worker: {m}"
    );
}

/// A model with `[models.slo]` and no planner learns its workers' latency
/// from the gateways' timed ends and publishes the fits in its snapshot,
/// with the SLO; a router predicts from them with the snapshot's ranks.
#[tokio::test(flavor = "multi_thread")]
async fn an_slo_without_a_planner_publishes_fits_learned_from_timed_ends() {
    use kvgate_core::booking::{Event, Key, Timing};
    use kvgate_core::{RankLoad, Slo};
    let (w, _page) = fake_worker().await;
    let (base, sc) = sidecar_from(
        &format!(
            "[scrape]\ninterval_ms = 50\n[server]\npublish_interval_ms = 10\n\
             [[models]]\nname = \"m\"\n[models.slo]\nttft_ms = 400\nitl_ms = 40\n\
             [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"{w}\"\n"
        ),
        None,
    )
    .await;
    wait_until("worker up", async || workers_up(&base).await == 1).await;
    let slot = sc.store().snapshot().models[0].workers[0].ranks[0].slot;
    let key = |seq| Key { vm: 3, seq };
    // Twelve requests booked together, each meeting the ones before it:
    // request i meets 500·i prompt tokens and 10·i blocks of 16 tokens.
    // TTFT = 20 ms + 10 ms per thousand prompt tokens (its own 500
    // included); ITL = 5 ms + 2 ms per thousand KV tokens.
    let mut batch = Vec::new();
    for i in 0..12u64 {
        Event::Book {
            key: key(i),
            model: "m".into(),
            slot,
            prefill_tokens: 500,
            decode_blocks: 10,
            tenant: kvgate_core::DEFAULT_TENANT.into(),
        }
        .encode_into(&mut batch);
    }
    for i in 0..12u32 {
        let ttft_us = 20_000 + 5_000 * (i + 1);
        let itl_us = 5_000 + 320 * i;
        Event::Done {
            key: key(u64::from(i)),
            timing: Some(Timing {
                first_byte_us: ttft_us,
                total_us: ttft_us + 10 * itl_us,
                isl_tokens: 500,
                output_tokens: 11,
                status: 200,
                client_first_byte_us: ttft_us,
                ..Default::default()
            }),
        }
        .encode_into(&mut batch);
    }
    let url = format!("{base}/v1/bookings");
    assert_eq!(call_raw("POST", &url, &[], batch).await.0, 204);
    wait_until("fits published", async || {
        sc.store().snapshot().models[0].workers[0]
            .fits
            .is_some_and(|f| f.ttft.samples == 12)
    })
    .await;
    let snap = sc.store().snapshot();
    let m = &snap.models[0];
    assert_eq!(
        m.slo,
        Slo {
            ttft_ms: 400,
            itl_ms: 40
        }
    );
    let fits = m.workers[0].fits.unwrap();
    assert_eq!(fits.itl.samples, 12);
    let rank = RankLoad {
        active_prefill_tokens: 1500,
        active_decode_blocks: 125,
        ..Default::default()
    };
    // 1500 booked + 500 its own: 20 + 10 × 2.
    let ttft = fits.ttft_ms(&rank, 500).expect("a trusted TTFT fit");
    assert!((ttft - 40.0).abs() < 0.5, "{ttft}");
    // 125 blocks × 16 tokens: 5 + 2 × 2.
    let itl = fits.itl_ms(&rank, 16).expect("a trusted ITL fit");
    assert!((itl - 9.0).abs() < 0.1, "{itl}");
    // The state view shows both.
    let (_, state) = json_of("GET", &format!("{base}/v1/state"), None).await;
    let m = &state["models"][0];
    assert_eq!(m["slo"], json!({"ttft_ms": 400, "itl_ms": 40}));
    assert_eq!(m["workers"][0]["fits"]["ttft"]["samples"], 12);
}
