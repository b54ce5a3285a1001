//! Event-ingest benchmark: vLLM-format KV event batches decoded, hashed and
//! indexed on one thread, against a baseline that only decodes the same
//! bytes into `rmpv::Value` (the generic-msgpack approach). Prints one JSON
//! object; `cargo xtask bench` records it.
//!
//! Workload: 16 ranks × 100k blocks of 16 tokens (token ids up to 150k),
//! 16 blocks per event, 64 events per batch, as vLLM 0.33 tagged maps.

#[path = "common/frames.rs"]
mod frames;

use frames::batches;
use kvgate_sidecar::sources::kv::index::Index;
use kvgate_sidecar::sources::kv::stage::Staged;
use std::time::Instant;

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let frames = batches(16, 100_000);
    let bytes: usize = frames.iter().map(|(_, b)| b.len()).sum();
    let mut kvgate = Vec::new();
    let mut decode_only = Vec::new();
    let mut baseline = Vec::new();
    let (mut blocks, mut heap) = (0u64, 0usize);
    for _ in 0..runs {
        let mut idx = Index::new(4096, 1 << 22);
        for s in 0..16 {
            idx.add_slot(s, 16);
        }
        let mut st = Staged::default();
        let t = Instant::now();
        for (slot, buf) in &frames {
            st.stage(buf, 16).expect("benchmark frames decode");
            idx.apply(*slot, &st);
        }
        let dt = t.elapsed().as_secs_f64();
        blocks = idx.stats.stored_blocks;
        heap = idx.heap_bytes() / idx.len().max(1);
        kvgate.push(blocks as f64 / dt);

        let t = Instant::now();
        for (_, buf) in &frames {
            st.stage(buf, 16).expect("benchmark frames decode");
        }
        decode_only.push(blocks as f64 / t.elapsed().as_secs_f64());

        let t = Instant::now();
        let mut n = 0usize;
        for (_, buf) in &frames {
            let v = rmpv::decode::read_value(&mut &buf[..]).expect("benchmark frames decode");
            n += v.as_array().map_or(0, Vec::len);
        }
        std::hint::black_box(n);
        baseline.push(blocks as f64 / t.elapsed().as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let spread =
        |v: &Vec<f64>| v.last().copied().unwrap_or(0.0) - v.first().copied().unwrap_or(0.0);
    let (k, d, b) = (
        median(&mut kvgate),
        median(&mut decode_only),
        median(&mut baseline),
    );
    println!(
        "{}",
        serde_json::json!({
            "name": "ingest",
            "runs": runs,
            "blocks": blocks,
            "frame_bytes": bytes,
            "ingest_blocks_per_s": k,
            "ingest_spread": spread(&kvgate),
            "decode_hash_blocks_per_s": d,
            "baseline_rmpv_decode_blocks_per_s": b,
            "baseline_spread": spread(&baseline),
            "ratio_ingest_vs_baseline_decode": k / b,
            "sidecar_heap_bytes_per_block": heap,
        })
    );
}
