//! Fleets for the pipeline's tests.

use crate::state::{DEFAULT_TENANT, RankLoad, WorkerState};

/// Worker `id` at `10.0.0.<id>:8000`, 16-token blocks, default tenant.
pub(crate) fn worker(id: u64, ranks: Vec<RankLoad>) -> WorkerState {
    WorkerState {
        id,
        endpoint: format!("10.0.0.{id}:8000"),
        block_size: 16,
        ranks,
        tenant: DEFAULT_TENANT.into(),
        thermal: Default::default(),
        draining: false,
    }
}
