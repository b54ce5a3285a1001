//! Selection cost inside the filter: the real `.wasm` in the wasmtime host,
//! 16 workers × 100k indexed blocks (16-token blocks) in shard keys, 2k-token
//! prompts that share a cached prefix with one worker. Baseline in the same
//! run: the same requests against the same fleet with no index (the filter
//! hashes nothing and reads no shard). Prints one JSON object.
//!
//! Wall time per request through the host includes the host's own work
//! (header and shared-data calls); the difference between the two runs is
//! what the prefix search adds.

use kvgate_core::hash::{XXH3_SEED, block_hashes, sequence_hashes};
use kvgate_core::shard::{Holder, TIER_DEVICE, encode, shard_of};
use kvgate_core::update;
use kvgate_tests::host::{Filter, Shared, Vm};
use kvgate_tests::{bench_snapshot, filter_wasm};
use std::collections::HashMap;
use std::time::Instant;

const WORKERS: u16 = 16;
const BLOCKS_PER_WORKER: usize = 100_000;
const CHAIN: usize = 128; // 2048 tokens
const SHARDS: u32 = 4096;

fn tokens(worker: u16, chain: usize) -> Vec<u32> {
    let base = (worker as u32) << 24 | (chain as u32) << 8;
    (0..(CHAIN * 16) as u32)
        .map(|i| base.wrapping_add(i * 7919) % 150_000 + (worker as u32 * 150_000))
        .collect()
}

fn run(with_index: bool, prompts: &[String], shards: &HashMap<u32, Vec<u8>>) -> (Vec<f64>, usize) {
    let filter = Filter::load(&filter_wasm()).expect("filter module");
    let shared = Shared::new();
    let mut svc =
        Vm::start(&filter, &shared, "kvgate", "kvgate_snapshot_service", "").expect("service VM");
    let snap = bench_snapshot(WORKERS, if with_index { SHARDS } else { 0 })
        .encode()
        .expect("snapshot");
    let frame = if with_index {
        update::encode(
            1,
            1,
            true,
            Some(&snap),
            shards.iter().map(|(s, b)| ("m", *s, b.as_slice())),
        )
    } else {
        update::encode(1, 1, true, Some(&snap), [])
    };
    let token = svc.pending().pop().expect("poll").token;
    svc.respond(token, 200, &[], &frame)
        .expect("update applied");
    let mut vm = Vm::start(
        &filter,
        &shared,
        "kvgate",
        "kvgate_router",
        r#"{"max_body_bytes": 4194304}"#,
    )
    .expect("router VM");
    let headers = [(":method", "POST"), (":path", "/v1/completions")];
    let mut times = Vec::with_capacity(prompts.len());
    let mut hits = 0;
    for (i, p) in prompts.iter().enumerate() {
        let t = Instant::now();
        let ex = vm.request(&headers, &[p.as_bytes()]);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        assert!(
            ex.continued,
            "{:?} {:?}\n{}",
            ex.reply,
            ex.trapped,
            vm.logs()
        );
        // The destination list names the chosen worker first, then the
        // runner-up a refused connection is retried on.
        let want = format!("10.0.0.{}:8000", (i % WORKERS as usize) + 1);
        let chosen = ex
            .header("x-gateway-destination-endpoint")
            .and_then(|d| d.split(',').next());
        if chosen == Some(want.as_str()) {
            hits += 1;
        }
    }
    (times, hits)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // Build the index as the sidecar publishes it: per shard, sorted hashes
    // with their holders.
    let chains = BLOCKS_PER_WORKER / CHAIN;
    let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
    for w in 0..WORKERS {
        for c in 0..chains {
            let seq = sequence_hashes(&block_hashes(&tokens(w, c), 16, XXH3_SEED));
            for h in seq {
                per_shard.entry(shard_of(h, SHARDS)).or_default().push((
                    h,
                    vec![Holder {
                        slot: w,
                        tiers: TIER_DEVICE,
                    }],
                ));
            }
        }
    }
    let blocks: usize = per_shard.values().map(Vec::len).sum();
    let shards: HashMap<u32, Vec<u8>> = per_shard
        .into_iter()
        .map(|(s, mut e)| (s, encode(&mut e)))
        .collect();
    let bytes: usize = shards.values().map(Vec::len).sum();
    // Request i shares the whole 2k-token prefix of a chain on worker i % 16.
    let prompts: Vec<String> = (0..1000)
        .map(|i| {
            let mut t = tokens((i % WORKERS as usize) as u16, (i * 37) % chains);
            t.extend([1, 2, 3]);
            serde_json::json!({"model": "m", "prompt": t, "max_tokens": 1}).to_string()
        })
        .collect();
    let (mut base, _) = run(false, &prompts, &shards);
    let (mut idx, hits) = run(true, &prompts, &shards);
    let (b, k) = (median(&mut base), median(&mut idx));
    let p99 = |v: &[f64]| v[(v.len() * 99 / 100).min(v.len() - 1)];
    println!(
        "{}",
        serde_json::json!({
            "name": "selection",
            "workers": WORKERS,
            "indexed_blocks": blocks,
            "shard_bytes": bytes,
            "prompt_tokens": CHAIN * 16,
            "requests": prompts.len(),
            "baseline_no_index_us_p50": b,
            "baseline_no_index_us_p99": p99(&base),
            "with_index_us_p50": k,
            "with_index_us_p99": p99(&idx),
            "prefix_search_added_us_p50": k - b,
            "routed_to_prefix_holder": hits,
        })
    );
}
