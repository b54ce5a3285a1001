//! The load loop's latency fits, one set per latency: each worker's own,
//! and one pooled per role from the samples of every worker of that role.
//! A worker too new for its own fit is estimated with its role's: its
//! engine is the model's and its role's, its load its own. Pooling by
//! role keeps a prefill worker's TTFT (prompts only) apart from a `both`
//! worker's, and a decode worker's ITL apart from one that also prefills:
//! what sizing each role's pool needs.

use super::regress::Line;
use kvgate_core::Role;
use std::collections::BTreeMap;

/// One latency fitted against one kind of load.
#[derive(Debug, Clone, Default)]
pub struct Fits {
    workers: BTreeMap<u64, Line>,
    /// By [`Role::code`].
    roles: [Line; 3],
}

impl Fits {
    /// A sample taken on `worker`, of `role` when the leg was booked.
    pub fn add(&mut self, worker: u64, role: Role, x: f64, y: f64) {
        self.workers.entry(worker).or_default().add(x, y);
        self.roles[usize::from(role.code())].add(x, y);
    }

    /// The worker's own fit.
    pub fn worker(&self, id: u64) -> Option<&Line> {
        self.workers.get(&id)
    }

    /// Every worker's own fit, by worker.
    pub fn workers(&self) -> &BTreeMap<u64, Line> {
        &self.workers
    }

    /// The samples of every worker of `role`, pooled.
    pub fn role(&self, role: Role) -> &Line {
        &self.roles[usize::from(role.code())]
    }

    /// The estimate at `x` on `worker`: its own fit once trusted, else
    /// its role's; `None` while neither is.
    pub fn predict(&self, worker: u64, role: Role, x: f64) -> Option<f64> {
        self.workers
            .get(&worker)
            .filter(|l| l.ready())
            .unwrap_or_else(|| self.role(role))
            .predict(x)
    }

    /// A worker left the fleet: its own fit goes; what it taught its
    /// role's stays, as the role's engine has not changed.
    pub fn forget(&mut self, worker: u64) {
        self.workers.remove(&worker);
    }
}
