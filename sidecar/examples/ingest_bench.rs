//! Event-ingest benchmark: vLLM-format KV event batches decoded, hashed and
//! indexed on one thread, against a baseline that only decodes the same
//! bytes into `rmpv::Value` (the generic-msgpack approach). Prints one JSON
//! object; `cargo xtask bench` records it.
//!
//! Workload: 16 ranks × 100k blocks of 16 tokens (token ids up to 150k),
//! 16 blocks per event, 64 events per batch, as vLLM 0.33 tagged maps.

use kvgate_sidecar::sources::kv::index::Index;
use kvgate_sidecar::sources::kv::stage::Staged;
use rmpv::Value;
use std::time::Instant;

fn batches(slots: u16, per_slot: usize) -> Vec<(u16, Vec<u8>)> {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut out = Vec::new();
    for slot in 0..slots {
        let mut engine = (slot as u64) << 40;
        let (mut made, mut parent) = (0usize, None::<u64>);
        while made < per_slot {
            let mut events = Vec::new();
            for _ in 0..64 {
                let hashes: Vec<Value> = (0..16)
                    .map(|_| {
                        engine += 1;
                        Value::from(engine)
                    })
                    .collect();
                let toks: Vec<Value> = (0..256).map(|_| Value::from(rnd() % 150_000)).collect();
                // Chains of 512 blocks, then a new root.
                let p = match parent {
                    Some(p) if made % 512 != 0 => Value::from(p),
                    _ => Value::Nil,
                };
                parent = Some(engine);
                events.push(Value::Map(vec![
                    ("type".into(), "BlockStored".into()),
                    ("block_hashes".into(), Value::Array(hashes)),
                    ("parent_block_hash".into(), p),
                    ("token_ids".into(), Value::Array(toks)),
                    ("block_size".into(), 16.into()),
                    ("lora_id".into(), Value::Nil),
                    ("medium".into(), "GPU".into()),
                    ("lora_name".into(), Value::Nil),
                ]));
                made += 16;
            }
            let b = Value::Array(vec![1.5f64.into(), Value::Array(events), 0.into()]);
            let mut buf = Vec::new();
            rmpv::encode::write_value(&mut buf, &b).expect("encoding into a Vec");
            out.push((slot, buf));
        }
    }
    out
}

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
