//! Everything the sidecar sends out to gateways.
//!
//! * `versions`: one version counter for snapshots and index shards.
//! * `store`: the current snapshot, encoded.
//! * `frame`: the update frames Envoy's snapshot service long-polls for.
//! * `eds`: the catalog as Envoy's routed cluster.

pub(crate) mod eds;
pub(crate) mod frame;
mod store;
mod versions;

pub use store::SnapshotStore;
pub use versions::Versions;
