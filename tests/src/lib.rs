//! kvgate's integration-test support: a proxy-wasm host on wasmtime that
//! runs the real filter module ([`host`]). The end-to-end tests on real
//! Envoy use the `kvgate-stack` crate.

pub mod host;

use std::path::PathBuf;

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
