//! Index dump and recovery benchmark, 16 ranks × 100k blocks (1.6M): the
//! `GET /dump` size and what recovering from it costs. Prints one JSON
//! object; `cargo xtask bench` records it.
//!
//! * In process, on one thread: the index thread's copy of its tables
//!   (the only part ingest waits for), encoding, decoding and replaying
//!   into an empty index, each the median of `runs`.
//! * Between two real sidecars over loopback HTTP: sidecar A indexes the
//!   blocks from KV events on ZMQ sockets; the client's `GET /dump`; then
//!   sidecars B start with `[indexer] peers = [A]` and report
//!   `kvgate_index_recovery_seconds` (fetch + decode + replay), each run a
//!   fresh B.
//!
//! Workload: the ingest benchmark's events (see `common/frames.rs`).

#[path = "common/frames.rs"]
mod frames;

use http_body_util::BodyExt;
use kvgate_sidecar::config::Config;
use kvgate_sidecar::sources::kv::dump::{self, Dump, Group};
use kvgate_sidecar::sources::kv::index::Index;
use kvgate_sidecar::sources::kv::stage::Staged;
use kvgate_sidecar::{Sidecar, api};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RANKS: u16 = 16;
const BLOCKS_PER_RANK: usize = 100_000;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// The in-process figures.
fn in_process(frames: &[(u16, Vec<u8>)], runs: usize) -> serde_json::Value {
    let mut idx = Index::new(16384, 4 << 20);
    for s in 0..RANKS {
        idx.add_slot(s, 16);
    }
    let mut st = Staged::default();
    for (slot, buf) in frames {
        st.stage(buf, 16).expect("benchmark frames decode");
        idx.apply(*slot, &st);
    }
    let (mut copy, mut encode, mut decode, mut replay) = (vec![], vec![], vec![], vec![]);
    let mut size = 0;
    for _ in 0..runs {
        let t = Instant::now();
        let groups: Vec<Group> = (0..RANKS)
            .map(|s| Group {
                model: "m".into(),
                worker_id: u64::from(s) + 1,
                dp_rank: 0,
                block_size: 16,
                blocks: idx.blocks(s),
            })
            .collect();
        copy.push(ms(t));
        let t = Instant::now();
        let bytes = dump::encode(Dump {
            created_at_ms: 0,
            groups,
        });
        encode.push(ms(t));
        size = bytes.len();
        let t = Instant::now();
        let back = dump::decode(&bytes).expect("the dump decodes");
        decode.push(ms(t));
        let mut fresh = Index::new(16384, 4 << 20);
        for s in 0..RANKS {
            fresh.add_slot(s, 16);
        }
        let t = Instant::now();
        for g in &back.groups {
            fresh.restore((g.worker_id - 1) as u16, &g.blocks);
        }
        replay.push(ms(t));
        assert_eq!(
            fresh.len(),
            idx.len(),
            "the replayed index holds every block"
        );
        for s in (0..16384).step_by(97) {
            assert_eq!(fresh.encode_shard(s), idx.encode_shard(s), "shard {s}");
        }
    }
    serde_json::json!({
        "blocks": idx.len(),
        "dump_bytes": size,
        "bytes_per_block": size as f64 / idx.len() as f64,
        "copy_ms": median(&mut copy),
        "encode_ms": median(&mut encode),
        "decode_ms": median(&mut decode),
        "replay_ms": median(&mut replay),
    })
}

fn config(workers: &[String], peers: Option<&str>) -> Config {
    let mut toml = String::from("[server]\npublish_interval_ms = 50\n[[models]]\nname = \"m\"\n");
    if let Some(p) = peers {
        toml.push_str(&format!(
            "[indexer]\npeers = [\"{p}\"]\ntimeout_ms = 60000\n"
        ));
    }
    for (i, events) in workers.iter().enumerate() {
        toml.push_str(&format!(
            "[[workers]]\nworker_id = {}\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:1\"\n\
             block_size = 16\nkv_events_endpoints = {{ \"0\" = \"{events}\" }}\n",
            i + 1
        ));
    }
    Config::parse(&toml).expect("the benchmark's configuration")
}

async fn serve(sc: Arc<Sidecar>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = l.local_addr().expect("a bound address");
    tokio::spawn(async move { axum::serve(l, api::router(sc)).await });
    format!("http://{addr}")
}

async fn indexed(sc: &Arc<Sidecar>) -> usize {
    let sc = sc.clone();
    tokio::task::spawn_blocking(move || sc.plane().stats())
        .await
        .ok()
        .flatten()
        .map_or(0, |s| s.per_model.iter().map(|(_, _, n)| n).sum())
}

fn metric(sc: &Sidecar, series: &str) -> f64 {
    sc.metrics()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn over_http(frames: &[(u16, Vec<u8>)], want: usize, runs: usize) -> serde_json::Value {
    let ctx = zmq::Context::new();
    let socks: Vec<(zmq::Socket, String)> = (0..RANKS)
        .map(|_| {
            let s = ctx.socket(zmq::PUB).expect("a PUB socket");
            s.set_sndhwm(1_000_000).expect("a send queue");
            s.bind("tcp://127.0.0.1:*").expect("a loopback port");
            let ep = s.get_last_endpoint().expect("endpoint").expect("UTF-8");
            (s, ep)
        })
        .collect();
    let endpoints: Vec<String> = socks.iter().map(|(_, e)| e.clone()).collect();
    let a = Sidecar::start(config(&endpoints, None)).expect("sidecar A");
    let a_url = serve(a.clone()).await;
    // A PUB socket drops what it sends before a subscription reaches it:
    // one probe block per rank until each is indexed, then the workload.
    // Each rank's first batch starts a chain, so it stands alone; stores
    // are idempotent, so it is sent again with the rest.
    let mut seq = vec![0u64; RANKS as usize];
    let per_rank = frames.len() / RANKS as usize;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for (r, (s, _)) in socks.iter().enumerate() {
            let first = &frames[r * per_rank].1;
            s.send_multipart([&b""[..], &seq[r].to_be_bytes(), first], 0)
                .expect("publish");
            seq[r] += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        if indexed(&a).await >= RANKS as usize * 1024 {
            break;
        }
        assert!(Instant::now() < deadline, "A never subscribed");
    }
    let t = Instant::now();
    for (slot, buf) in frames {
        let r = *slot as usize;
        socks[r]
            .0
            .send_multipart([&b""[..], &seq[r].to_be_bytes(), buf], 0)
            .expect("publish");
        seq[r] += 1;
    }
    while indexed(&a).await < want {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "A never indexed everything"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let index_s = t.elapsed().as_secs_f64();

    let client = kvgate_sidecar::sources::metrics::scrape::client();
    let mut fetch = Vec::new();
    let mut size = 0;
    for _ in 0..runs {
        let t = Instant::now();
        let resp = client
            .get(format!("{a_url}/dump").parse().expect("a URL"))
            .await
            .expect("A answers");
        let body = resp.into_body().collect().await.expect("a body").to_bytes();
        fetch.push(ms(t));
        size = body.len();
    }
    let mut recovery = Vec::new();
    let mut recovered = 0.0;
    for _ in 0..runs {
        let b = Sidecar::start(config(&endpoints, Some(&a_url))).expect("sidecar B");
        while metric(&b, "kvgate_index_recovery_seconds") == 0.0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        recovery.push(metric(&b, "kvgate_index_recovery_seconds") * 1e3);
        recovered = metric(&b, "kvgate_index_recovered_blocks_total");
        assert_eq!(indexed(&b).await, indexed(&a).await, "B holds what A holds");
    }
    serde_json::json!({
        "blocks": indexed(&a).await,
        "index_from_events_s": index_s,
        "dump_bytes": size,
        "get_dump_ms": median(&mut fetch),
        "recovery_ms": median(&mut recovery),
        "recovered_blocks": recovered,
    })
}

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let frames = frames::batches(RANKS, BLOCKS_PER_RANK);
    let local = in_process(&frames, runs);
    let rt = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let blocks = local["blocks"].as_u64().unwrap_or(0) as usize;
    let http = rt.block_on(over_http(&frames, blocks, runs));
    println!(
        "{}",
        serde_json::json!({
            "name": "dump",
            "runs": runs,
            "ranks": RANKS,
            "blocks_per_rank": BLOCKS_PER_RANK,
            "in_process": local,
            "over_http": http,
        })
    );
}
