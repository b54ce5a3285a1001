//! Index recovery between two real sidecars: A indexes blocks from KV
//! events on real ZMQ sockets; B starts with `[indexer] peers = [A]`,
//! sees no event, and places prompts as A does.

use axum::Router;
use axum::routing::get;
use kvgate_sidecar::api::views::SelectionView;
use kvgate_sidecar::config::Config;
use kvgate_sidecar::sources::kv::dump::{self, Dump};
use kvgate_sidecar::{Sidecar, api};
use rmpv::Value;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

use support::{Publisher, metric, wait_until};

/// vLLM's BlockStored for whole blocks of 4 tokens.
fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: &str) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        (
            "parent_block_hash".into(),
            parent.map_or(Value::Nil, Value::from),
        ),
        (
            "token_ids".into(),
            Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
        ),
        ("block_size".into(), 4.into()),
        ("medium".into(), medium.into()),
    ])
}

fn removed(hashes: &[u64]) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        ("medium".into(), "GPU".into()),
    ])
}

/// An idle engine's metrics page, two DP ranks (a one-rank worker reads
/// the first).
async fn metrics_page() -> String {
    let mut page = String::new();
    for engine in 0..2 {
        page.push_str(&format!(
            "vllm:num_requests_running{{engine=\"{engine}\"}} 0\n\
             vllm:num_requests_waiting{{engine=\"{engine}\"}} 0\n\
             vllm:kv_cache_usage_perc{{engine=\"{engine}\"}} 0\n\
             vllm:cache_config_info{{block_size=\"4\",engine=\"{engine}\",num_gpu_blocks=\"1000\"}} 1.0\n"
        ));
    }
    page
}

/// Serves `app` on a free loopback port; returns `http://addr`.
async fn serve(app: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    format!("http://{addr}")
}

async fn engine() -> String {
    let page = metrics_page().await;
    let base = serve(Router::new().route("/metrics", get(move || async move { page }))).await;
    base.trim_start_matches("http://").to_string()
}

/// `(worker_id, dp_size, engine address, events endpoint per rank)`.
type Worker<'a> = (u64, u32, &'a str, Vec<&'a str>);

/// A sidecar serving both listeners, with `token` as its control token;
/// returns its base URLs (control, selection).
async fn sidecar(
    workers: &[Worker<'_>],
    indexer: &str,
    token: Option<&str>,
) -> (Arc<Sidecar>, String, String) {
    let mut toml = format!(
        "[server]\npublish_interval_ms = 10\n[scrape]\ninterval_ms = 50\n\
         [kv]\nshards = 64\n[indexer]\n{indexer}\n[[models]]\nname = \"m\"\n"
    );
    for (id, dp, endpoint, events) in workers {
        let events: Vec<String> = events
            .iter()
            .enumerate()
            .map(|(r, e)| format!("\"{r}\" = \"{e}\""))
            .collect();
        toml.push_str(&format!(
            "[[workers]]\nworker_id = {id}\nmodel_name = \"m\"\nendpoint = \"{endpoint}\"\n\
             block_size = 4\ndata_parallel_size = {dp}\nkv_events_endpoints = {{ {} }}\n",
            events.join(", ")
        ));
    }
    let mut config = Config::parse(&toml).unwrap();
    config.control.token = token.map(str::to_string);
    let sc = Sidecar::start(config).unwrap();
    let control = serve(api::router(sc.clone())).await;
    let selection = serve(api::selection_router(sc.clone())).await;
    (sc, control, selection)
}

async fn get_bytes(url: &str) -> (u16, Vec<(String, String)>, Vec<u8>) {
    get_with(url, None).await
}

/// A GET carrying `token` as a bearer token, if any.
async fn get_with(url: &str, token: Option<&str>) -> (u16, Vec<(String, String)>, Vec<u8>) {
    use http_body_util::{BodyExt, Empty};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let mut req = hyper::Request::get(url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = client
        .request(req.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, body.to_vec())
}

async fn post_json(url: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    use http_body_util::{BodyExt, Full};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or_default())
}

async fn select(selection: &str, tokens: &[u32]) -> Option<SelectionView> {
    let (status, v) = post_json(
        &format!("{selection}/select"),
        json!({"model_name": "m", "token_ids": tokens}),
    )
    .await;
    (status == 200).then(|| serde_json::from_value(v).unwrap())
}

async fn dump_of(base: &str) -> Dump {
    dump_with(base, None).await
}

async fn dump_with(base: &str, token: Option<&str>) -> Dump {
    let (status, headers, body) = get_with(&format!("{base}/dump"), token).await;
    assert_eq!(status, 200);
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "content-type" && v == "application/octet-stream")
    );
    dump::decode(&body).unwrap()
}

/// Publishes `events` (fresh sequence numbers each time) until `done`: a
/// PUB socket drops what it sends before the subscription reaches it.
async fn publish_until(
    p: &mut Publisher,
    events: impl Fn() -> Vec<Value>,
    what: &str,
    mut done: impl AsyncFnMut() -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        p.publish_events(events());
        tokio::time::sleep(Duration::from_millis(50)).await;
        if done().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
    }
}

fn overlap_tokens(v: &Option<SelectionView>) -> Option<(u64, u32, u64)> {
    v.as_ref()
        .map(|s| (s.worker_id, s.dp_rank, s.overlap.longest_matched))
}

/// The prompt every rank of workers 1 and 2 caches some of (4 blocks),
/// and worker 5's own prompt.
fn prompts() -> (Vec<u32>, Vec<u32>) {
    ((1..=16).collect(), (101..=116).collect())
}

/// Sidecar A with workers 1 (two ranks), 2 and 5, each rank fed until A
/// places `prompts().0` on worker 1 rank 0 with three blocks matched.
async fn indexed_peer(ctx: &zmq::Context) -> (Arc<Sidecar>, String, String, [String; 3]) {
    indexed_peer_with(ctx, None).await
}

/// The same, with `token` as A's control token.
async fn indexed_peer_with(
    ctx: &zmq::Context,
    token: Option<&str>,
) -> (Arc<Sidecar>, String, String, [String; 3]) {
    let (t, u) = prompts();
    let engines = [engine().await, engine().await, engine().await];
    let mut pubs: Vec<Publisher> = (0..4).map(|_| Publisher::bind(ctx)).collect();
    let (a, a_control, a_selection) = sidecar(
        &[
            (
                1,
                2,
                &engines[0],
                vec![&pubs[0].endpoint, &pubs[1].endpoint],
            ),
            (2, 1, &engines[1], vec![&pubs[2].endpoint]),
            (5, 1, &engines[2], vec![&pubs[3].endpoint]),
        ],
        "",
        token,
    )
    .await;
    let feeds: [(usize, Vec<Value>); 4] = [
        (0, vec![stored(&[10, 11, 12], None, &t[..12], "GPU")]),
        (1, vec![stored(&[20, 21], None, &t[..8], "CPU")]),
        (2, vec![stored(&[30, 31], None, &t[..8], "GPU")]),
        (3, vec![stored(&[50, 51, 52, 53], None, &u, "GPU")]),
    ];
    for (i, events) in feeds {
        publish_until(
            &mut pubs[i],
            || events.clone(),
            "A to index a rank",
            async || {
                let dump = dump_with(&a_control, token).await;
                dump.blocks() >= [3, 5, 7, 11][i]
            },
        )
        .await;
    }
    // The shards are published a moment after the index has them.
    wait_until("A places the prompt", async || {
        overlap_tokens(&select(&a_selection, &t).await) == Some((1, 0, 12))
    })
    .await;
    (a, a_control, a_selection, engines)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sidecar_recovers_its_peers_index_and_places_prompts_as_the_peer_does() {
    let ctx = zmq::Context::new();
    let (t, u) = prompts();
    let (_a, a_control, a_selection, engines) = indexed_peer(&ctx).await;
    let from_a = select(&a_selection, &t).await;
    assert_eq!(
        overlap_tokens(&select(&a_selection, &u).await),
        Some((5, 0, 16))
    );

    // B: another worker first, so every slot number differs from A's;
    // no worker 5; KV event sockets that stay silent until said otherwise.
    let extra = engine().await;
    let mut silent: Vec<Publisher> = (0..4).map(|_| Publisher::bind(&ctx)).collect();
    let (b, b_control, b_selection) = sidecar(
        &[
            (9, 1, &extra, vec![&silent[3].endpoint]),
            (2, 1, &engines[1], vec![&silent[2].endpoint]),
            (
                1,
                2,
                &engines[0],
                vec![&silent[0].endpoint, &silent[1].endpoint],
            ),
        ],
        &format!("peers = [\"{a_control}\"]\ntimeout_ms = 2000"),
        None,
    )
    .await;
    wait_until("B's recovery", async || {
        metric(&b, "kvgate_index_recovered_blocks_total") > 0.0
    })
    .await;
    assert_eq!(metric(&b, "kvgate_index_recovered_blocks_total"), 7.0);
    assert_eq!(
        metric(
            &b,
            "kvgate_index_recovery_dropped_blocks_total{reason=\"unknown_rank\"}"
        ),
        4.0,
        "worker 5's blocks"
    );
    assert!(metric(&b, "kvgate_index_recovery_seconds") > 0.0);

    wait_until("B places the prompt as A does", async || {
        select(&b_selection, &t).await == from_a
    })
    .await;
    let from_b = select(&b_selection, &t).await.unwrap();
    assert_eq!(
        (from_b.worker_id, from_b.dp_rank, from_b.overlap.gpu),
        (1, 0, 12)
    );
    assert_eq!(
        from_b.overlap.dp,
        [("0".to_string(), 12), ("1".to_string(), 0)].into()
    );
    assert_eq!(
        select(&b_selection, &u)
            .await
            .unwrap()
            .overlap
            .longest_matched,
        0,
        "worker 5 is not B's"
    );
    // Same names, other slots.
    let slots = async |base: &str| {
        let (_, _, body) = get_bytes(&format!("{base}/v1/state")).await;
        let state: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let worker = state["models"][0]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == 1)
            .cloned()
            .unwrap();
        (
            state["models"][0]["mode"].clone(),
            worker["ranks"][0]["slot"].clone(),
        )
    };
    let (a_state, b_state) = (slots(&a_control).await, slots(&b_control).await);
    assert_eq!(a_state.0, b_state.0);
    assert_ne!(a_state.1, b_state.1, "slot numbers are each sidecar's own");
    // B dumps what it recovered under the same names: A's dump without
    // worker 5, on either listener.
    let mut want = dump_of(&a_control).await;
    want.groups.retain(|g| g.worker_id != 5);
    assert_eq!(dump_of(&b_control).await.groups, want.groups);
    assert_eq!(dump_of(&b_selection).await.groups, want.groups);

    // Live events resolve against the recovered blocks: a child of
    // recovered block 12, then the removal of recovered block 10.
    publish_until(
        &mut silent[0],
        || vec![stored(&[13], Some(12), &t[12..], "GPU")],
        "a child of a recovered block",
        async || overlap_tokens(&select(&b_selection, &t).await) == Some((1, 0, 16)),
    )
    .await;
    publish_until(
        &mut silent[0],
        || vec![removed(&[10])],
        "the removal of a recovered block",
        async || overlap_tokens(&select(&b_selection, &t).await) == Some((2, 0, 8)),
    )
    .await;
    let orphans = b
        .plane()
        .stats()
        .unwrap()
        .per_model
        .iter()
        .map(|(_, s, _)| s.orphan_events)
        .sum::<u64>();
    assert_eq!(orphans, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn peers_that_fail_are_skipped_and_without_one_the_sidecar_starts_empty() {
    let ctx = zmq::Context::new();
    let (_a, a_control, _, engines) = indexed_peer(&ctx).await;
    let (_, _, good) = get_bytes(&format!("{a_control}/dump")).await;
    let half = good[..good.len() / 2].to_vec();
    let garbage = serve(Router::new().route(
        "/dump",
        get(|| async { "not a dump, but long enough to look" }),
    ))
    .await;
    let truncated = serve(Router::new().route("/dump", get(move || async move { half }))).await;
    let huge = serve(Router::new().route("/dump", get(|| async { vec![0u8; 1 << 20] }))).await;
    // Nothing listens there any more.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };

    let p = Publisher::bind(&ctx);
    let workers = |events: &str| -> Vec<(u64, u32, String, Vec<String>)> {
        vec![(2, 1, engines[1].clone(), vec![events.to_string()])]
    };
    let start = async |peers: &[&str]| {
        let list: Vec<String> = peers.iter().map(|p| format!("\"{p}\"")).collect();
        let w = workers(&p.endpoint);
        let w: Vec<Worker<'_>> = w
            .iter()
            .map(|(id, dp, e, ev)| {
                (
                    *id,
                    *dp,
                    e.as_str(),
                    ev.iter().map(String::as_str).collect(),
                )
            })
            .collect();
        let (sc, _, selection) = sidecar(
            &w,
            &format!(
                "peers = [{}]\ntimeout_ms = 2000\nmax_dump_bytes = 65536",
                list.join(", ")
            ),
            None,
        )
        .await;
        wait_until("the recovery to end", async || {
            metric(&sc, "kvgate_index_recovery_seconds") > 0.0
        })
        .await;
        (sc, selection)
    };

    // Every peer fails its own way: nothing recovered, the sidecar serves.
    let (sc, selection) = start(&[&closed, &garbage, &truncated, &huge]).await;
    assert_eq!(metric(&sc, "kvgate_index_recovered_blocks_total"), 0.0);
    let (t, _) = prompts();
    wait_until("the worker up", async || {
        select(&selection, &t).await.is_some()
    })
    .await;
    assert_eq!(
        select(&selection, &t)
            .await
            .unwrap()
            .overlap
            .longest_matched,
        0
    );

    // The first peer that gives a whole dump is the one recovered from.
    let (sc, selection) = start(&[&garbage, &closed, &a_control]).await;
    assert_eq!(
        metric(&sc, "kvgate_index_recovered_blocks_total"),
        2.0,
        "worker 2's blocks"
    );
    assert_eq!(
        metric(
            &sc,
            "kvgate_index_recovery_dropped_blocks_total{reason=\"unknown_rank\"}"
        ),
        9.0
    );
    wait_until("worker 2's recovered prefix placed", async || {
        overlap_tokens(&select(&selection, &t).await) == Some((2, 0, 8))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sidecar_is_not_ready_until_its_recovery_ends() {
    let ctx = zmq::Context::new();
    // A peer that takes its time and then sends nothing usable.
    let slow = serve(Router::new().route(
        "/dump",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            "not a dump"
        }),
    ))
    .await;
    let p = Publisher::bind(&ctx);
    let engine = engine().await;
    let (sc, control, _) = sidecar(
        &[(1, 1, &engine, vec![&p.endpoint])],
        &format!("peers = [\"{slow}\"]\ntimeout_ms = 5000"),
        None,
    )
    .await;
    let ready = async || {
        let (status, _, body) = get_bytes(&format!("{control}/ready")).await;
        (
            status,
            serde_json::from_slice::<serde_json::Value>(&body).unwrap_or_default(),
        )
    };
    // The worker is up long before the peer answers.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, v) = ready().await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(
        v["reason"],
        "recovering the prefix index from [indexer] peers"
    );
    assert_eq!(
        v["workers"],
        serde_json::json!([]),
        "the worker itself is up"
    );
    wait_until("ready once recovery ends", async || ready().await.0 == 200).await;
    assert!(metric(&sc, "kvgate_index_recovery_seconds") >= 1.5);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_control_token_only_a_peer_sending_it_recovers() {
    let ctx = zmq::Context::new();
    let token = "s3cret";
    let (a, a_control, a_selection, engines) = indexed_peer_with(&ctx, Some(token)).await;
    // The dump is the whole index: without the token, neither listener
    // gives it.
    for base in [&a_control, &a_selection] {
        assert_eq!(get_bytes(&format!("{base}/dump")).await.0, 401, "{base}");
    }

    // A sidecar with worker 2, recovering from A with `token`.
    let p = Publisher::bind(&ctx);
    let recover = async |token: Option<&str>| {
        let (sc, _, _) = sidecar(
            &[(2, 1, &engines[1], vec![&p.endpoint])],
            &format!("peers = [\"{a_control}\"]\ntimeout_ms = 2000"),
            token,
        )
        .await;
        wait_until("the recovery to end", async || {
            metric(&sc, "kvgate_index_recovery_seconds") > 0.0
        })
        .await;
        metric(&sc, "kvgate_index_recovered_blocks_total")
    };
    assert_eq!(recover(Some(token)).await, 2.0, "worker 2's blocks");
    let refused = metric(&a, "kvgate_sidecar_unauthorized_total{path=\"/dump\"}");
    assert_eq!(recover(None).await, 0.0, "no token: nothing recovered");
    assert_eq!(recover(Some("guess")).await, 0.0, "a wrong token neither");
    assert_eq!(
        metric(&a, "kvgate_sidecar_unauthorized_total{path=\"/dump\"}"),
        refused + 2.0,
        "each refusal counted on the peer"
    );
}
