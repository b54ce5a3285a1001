//! A hostile or broken KV event publisher against the real sidecar: a real
//! ZMQ PUB socket on loopback, the engines' 3-frame messages, and what the
//! sidecar must do about them (count, skip, stay up, keep indexing).

use kvgate_sidecar::Sidecar;
use kvgate_sidecar::config::Config;
use kvgate_sidecar::sources::kv::plane::PlaneStats;
use rmpv::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

use support::{Publisher, metric, wait_until};

/// A vLLM batch storing one full 4-token block per hash.
fn stored(hashes: &[u64]) -> Vec<u8> {
    let tokens: Vec<Value> = (0..4 * hashes.len() as u32).map(Value::from).collect();
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        ("parent_block_hash".into(), Value::Nil),
        ("token_ids".into(), Value::Array(tokens)),
        ("block_size".into(), 4.into()),
        ("medium".into(), "GPU".into()),
    ]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(
        &mut buf,
        &Value::Array(vec![1.0f64.into(), Value::Array(vec![ev]), 0.into()]),
    )
    .unwrap();
    buf
}

/// `[ts, [{"type": "BlockStored", "block_hashes": <array32 of 2^32-1>}]]`
/// in 47 bytes: before the fix, decoding reserved 32 GiB and aborted.
fn hostile_batch() -> Vec<u8> {
    let mut b = vec![0x92, 0xcb];
    b.extend_from_slice(&1.5f64.to_be_bytes());
    b.extend_from_slice(&[0x91, 0x82, 0xa4]);
    b.extend_from_slice(b"type");
    b.push(0xab);
    b.extend_from_slice(b"BlockStored");
    b.push(0xac);
    b.extend_from_slice(b"block_hashes");
    b.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert_eq!(b.len(), 47);
    b
}

fn sidecar(events: &str, kv: &str) -> Arc<Sidecar> {
    let toml = format!(
        "[server]\npublish_interval_ms = 10\n[kv]\nshards = 64\n{kv}\n\
         [[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:1\"\n\
         block_size = 4\nkv_events_endpoints = {{ \"0\" = \"{events}\" }}\n"
    );
    Sidecar::start(Config::parse(&toml).unwrap()).unwrap()
}

async fn plane_stats(sc: &Arc<Sidecar>) -> PlaneStats {
    let sc = sc.clone();
    tokio::task::spawn_blocking(move || sc.plane().stats())
        .await
        .unwrap()
        .expect("the index thread answers")
}

async fn indexed_blocks(sc: &Arc<Sidecar>) -> usize {
    plane_stats(sc)
        .await
        .per_model
        .iter()
        .find(|(m, _, _)| m == "m")
        .map_or(0, |(_, _, n)| *n)
}

/// Publishes `payload` (with fresh sequence numbers) until the index holds
/// `blocks` blocks: a PUB socket drops what it sends before the SUB's
/// subscription reaches it, and again while the SUB reconnects.
async fn publish_until_indexed(
    p: &mut Publisher,
    sc: &Arc<Sidecar>,
    payload: &[u8],
    blocks: usize,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        p.publish(payload);
        tokio::time::sleep(Duration::from_millis(50)).await;
        if indexed_blocks(sc).await == blocks {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the index never held {blocks} blocks"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_implausible_batch_is_counted_and_ingest_goes_on() {
    let ctx = zmq::Context::new();
    let mut p = Publisher::bind(&ctx);
    let sc = sidecar(&p.endpoint, "");
    publish_until_indexed(&mut p, &sc, &stored(&[100]), 1).await;
    assert_eq!(plane_stats(&sc).await.malformed_batches, 0);

    p.publish(&hostile_batch());
    wait_until("the hostile batch counted", async || {
        plane_stats(&sc).await.malformed_batches == 1
    })
    .await;
    // The gauge mirrors the index thread's count about once a second.
    wait_until("kvgate_sidecar_kv_malformed_batches", async || {
        metric(&sc, "kvgate_sidecar_kv_malformed_batches") == 1.0
    })
    .await;

    // The same subscriber and index thread take the next batch.
    p.publish(&stored(&[100, 200]));
    wait_until("the next batch indexed", async || {
        indexed_blocks(&sc).await == 2
    })
    .await;
    assert_eq!(plane_stats(&sc).await.malformed_batches, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_malformed_batches_is_counted_in_full_and_logged_once() {
    let ctx = zmq::Context::new();
    let mut p = Publisher::bind(&ctx);
    let sc = sidecar(&p.endpoint, "");
    publish_until_indexed(&mut p, &sc, &stored(&[100]), 1).await;

    // One publisher, many malformed batches at once: before, a WARN line
    // each (572,000 lines in ten seconds from one engine).
    for _ in 0..500 {
        p.publish(&hostile_batch());
    }
    wait_until("every malformed batch counted", async || {
        plane_stats(&sc).await.malformed_batches == 500
    })
    .await;
    wait_until("kvgate_sidecar_kv_malformed_batches", async || {
        metric(&sc, "kvgate_sidecar_kv_malformed_batches") == 500.0
    })
    .await;
    assert_eq!(
        plane_stats(&sc).await.malformed_batches_logged,
        1,
        "the first is logged, the rest wait a minute"
    );

    // Ingest goes on.
    p.publish(&stored(&[100, 200]));
    wait_until("the next batch indexed", async || {
        indexed_blocks(&sc).await == 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_message_drops_the_connection_which_comes_back() {
    let ctx = zmq::Context::new();
    let mut p = Publisher::bind(&ctx);
    let sc = sidecar(&p.endpoint, "max_message_bytes = 65536");
    let disconnects = "kvgate_sidecar_kv_disconnects_total{dp_rank=\"0\",worker_id=\"1\"}";
    publish_until_indexed(&mut p, &sc, &stored(&[100]), 1).await;
    assert_eq!(metric(&sc, disconnects), 0.0);

    p.publish(&vec![0x90; 1 << 20]);
    wait_until("the disconnection counted", async || {
        metric(&sc, disconnects) >= 1.0
    })
    .await;

    // After the reconnection batches flow again. Those lost meanwhile are a
    // gap this worker cannot replay, so its entries are rebuilt: the batch
    // carries both blocks.
    publish_until_indexed(&mut p, &sc, &stored(&[100, 200]), 2).await;
    assert_eq!(
        plane_stats(&sc).await.malformed_batches,
        0,
        "the oversized message never reached the decoder"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_publisher_is_followed_on_one_connection() {
    let ctx = zmq::Context::new();
    let mut p = Publisher::bind(&ctx);
    let endpoint = p.endpoint.clone();
    let sc = sidecar(&endpoint, "");
    let series = |name: &str| format!("{name}{{dp_rank=\"0\",worker_id=\"1\"}}");
    publish_until_indexed(&mut p, &sc, &stored(&[100]), 1).await;

    // The engine restarts on the same port: the sidecar starts its
    // connection over, and must not end up with two.
    drop(p);
    wait_until("the disconnection counted", async || {
        metric(&sc, &series("kvgate_sidecar_kv_disconnects_total")) >= 1.0
    })
    .await;
    let sock = ctx.socket(zmq::PUB).unwrap();
    sock.set_linger(0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Err(e) = sock.bind(&endpoint) {
        assert!(
            Instant::now() < deadline,
            "cannot bind {endpoint} again: {e}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut p = Publisher {
        sock,
        endpoint,
        seq: 0,
    };
    publish_until_indexed(&mut p, &sc, &stored(&[100, 200]), 2).await;

    // Every batch from now on arrives once: a second connection would
    // double them, and each copy would look like another restart.
    let batches = series("kvgate_sidecar_kv_batches_total");
    let resyncs = series("kvgate_sidecar_kv_resyncs_total");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (b0, r0) = (metric(&sc, &batches), metric(&sc, &resyncs));
    for _ in 0..20 {
        p.publish(&stored(&[100, 200]));
    }
    wait_until("20 more batches", async || {
        metric(&sc, &batches) >= b0 + 20.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(metric(&sc, &batches), b0 + 20.0);
    assert_eq!(metric(&sc, &resyncs), r0);
}

/// A sidecar whose one worker's `[[workers]]` entry ends with `extra`.
fn sidecar_worker(events: &str, extra: &str) -> Arc<Sidecar> {
    let toml = format!(
        "[server]\npublish_interval_ms = 10\n[kv]\nshards = 64\n\
         [[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:1\"\n\
         kv_events_endpoints = {{ \"0\" = \"{events}\" }}\n{extra}\n"
    );
    Sidecar::start(Config::parse(&toml).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn events_of_another_block_size_are_counted_per_rank() {
    let ctx = zmq::Context::new();
    let mut p = Publisher::bind(&ctx);
    // The engine pages by 4 (as SGLang's default page size of 1 would),
    // the worker is configured for 16: four pages re-chunk into one block.
    let sc = sidecar_worker(&p.endpoint, "block_size = 16");
    let series = "kvgate_sidecar_kv_block_size_mismatch_total{dp_rank=\"0\",worker_id=\"1\"}";
    publish_until_indexed(&mut p, &sc, &stored(&[100, 101, 102, 103]), 1).await;
    // The counter mirrors the index thread's about once a second.
    wait_until(series, async || metric(&sc, series) >= 1.0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn only_the_configured_topic_is_taken() {
    let ctx = zmq::Context::new();
    let mut p = Publisher::bind(&ctx);
    let other = sidecar_worker(&p.endpoint, "block_size = 4\nkv_events_topic = \"other\"");
    let ours = sidecar_worker(
        &p.endpoint,
        "block_size = 4\nkv_events_topic = \"kv-events\"",
    );
    // The publisher's topic is `kv-events`: once the matching subscriber
    // indexed its batch, the other has had every chance to.
    publish_until_indexed(&mut p, &ours, &stored(&[100]), 1).await;
    for _ in 0..5 {
        p.publish(&stored(&[100]));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(indexed_blocks(&other).await, 0, "another topic was taken");
}
