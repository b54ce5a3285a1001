//! kvgate's integration-test support: a proxy-wasm host on wasmtime that
//! runs the real filter module ([`host`]). The end-to-end tests on real
//! Envoy use the `kvgate-stack` crate.

pub mod host;

use kvgate_core::text::template::PromptTemplate;
use kvgate_core::{ModelState, RankLoad, Snapshot, WorkerState};
use std::path::PathBuf;

/// A file of the chat fixtures (`tests/fixtures/chat/`).
pub fn chat_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/chat")
        .join(name)
}

/// A fixture family's prompt template, read from its
/// `tokenizer_config.json` as the sidecar reads a model's:
/// `llama3-style` (a macro, `trim`) or `qwen-style` (contents searched for
/// `</think>`, so every chat pays a guard scan).
pub fn fixture_template(family: &str) -> PromptTemplate {
    let path = chat_fixture(&format!("{family}.tokenizer_config.json"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let cfg: serde_json::Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    let s = |k: &str| cfg[k].as_str().unwrap_or_default().to_string();
    PromptTemplate {
        chat_template: s("chat_template"),
        bos_token: s("bos_token"),
        eos_token: s("eos_token"),
        completion_prefix: s("bos_token"),
    }
}

/// The filter module under test: `KVGATE_FILTER_WASM`, or the release-wasm
/// build in this repository.
pub fn filter_wasm() -> PathBuf {
    std::env::var_os("KVGATE_FILTER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/wasm32-wasip1/release-wasm/kvgate_filter.wasm")
        })
}

/// The filter module, compiled once per test binary (compiling takes most
/// of a wasm test's time).
pub fn shared_filter() -> &'static host::Filter {
    static F: std::sync::OnceLock<host::Filter> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        let path = filter_wasm();
        assert!(
            path.exists(),
            "{} is missing: build the filter first: cargo xtask test builds it (or cargo build -p kvgate-filter --target wasm32-wasip1 --profile release-wasm)",
            path.display()
        );
        host::Filter::load(&path).unwrap_or_else(|e| panic!("loading {}: {e:#}", path.display()))
    })
}

/// The fleet the in-process benches route over: model `m` with `workers`
/// single-rank workers (slot = index, 16-token blocks, 200k KV blocks,
/// idle) at `10.0.0.<index + 1>:8000`.
pub fn bench_snapshot(workers: u16, shard_count: u32) -> Snapshot {
    Snapshot {
        version: 1,
        built_at_ms: 1,
        models: vec![ModelState {
            name: "m".into(),
            shard_count,
            workers: (0..workers)
                .map(|w| WorkerState {
                    id: u64::from(w) + 1,
                    endpoint: format!("10.0.0.{}:8000", w + 1),
                    block_size: 16,
                    ranks: vec![RankLoad {
                        slot: w,
                        kv_total_blocks: 200_000,
                        ..Default::default()
                    }],
                    tenant: "default".into(),
                    thermal: Default::default(),
                    draining: false,
                    role: Default::default(),
                    bootstrap_port: 0,
                    fits: None,
                    topology: Default::default(),
                })
                .collect(),
            ..Default::default()
        }],
        applied: Vec::new(),
    }
}
