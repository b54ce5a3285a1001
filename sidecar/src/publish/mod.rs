//! Everything the sidecar sends out to gateways.
//!
//! * `versions`: one version counter for snapshots and index shards.
//! * `store`: the current snapshot, encoded.
//! * `shard_log`: every model's index shards as last published.
//! * `frame`: the update frames Envoy's snapshot service long-polls for.
//! * `eds`: the catalog as Envoy's routed cluster.

pub(crate) mod eds;
pub(crate) mod frame;
mod shard_log;
mod store;
mod versions;

pub use shard_log::ShardLog;
pub use store::SnapshotStore;
pub use versions::Versions;
