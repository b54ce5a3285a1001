//! kvgate-core: everything kvgate decides, with no I/O.
//!
//! The same code runs natively in the sidecar (which builds snapshots and
//! serves the selection API) and as wasm32-wasip1 inside Envoy (where the
//! filter decodes snapshots and picks a worker per request). Keeping it free of
//! Envoy, tokio and ZMQ is what lets both hosts give the same answer for the
//! same inputs.
//!
//! * [`state`]: the fleet state types, defined once (serde behind the
//!   `serde` feature), with their validation;
//! * [`plan`]: the decision for one request, from its body to a placement
//!   or a rejection, with the cost in [`plan::select`];
//! * [`busy`]: the shedding rules; [`admit`]: holding what no worker may
//!   take now, by class and deadline; [`hash`]: block and prefix hashes;
//! * [`disagg`]: disaggregated prefill and decode: the legs' bodies and
//!   when a request needs no prefill leg;
//! * [`fit`]: a worker's latency at a load, from the fits the sidecar
//!   publishes;
//! * the contracts with clients and Envoy: the [`reply`]s kvgate sends
//!   itself, and the [`header`] names;
//! * the binary formats between the parts, all read through one
//!   bounds-checked reader: [`snapshot`], [`update`] frames, [`booking`]
//!   events, [`approx`] routing reports and index [`shard`]s.
#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod admit;
pub mod approx;
pub mod booking;
pub mod busy;
pub mod disagg;
pub mod dispatch;
pub mod fit;
pub mod hash;
pub mod header;
pub mod plan;
pub mod reply;
pub mod shard;
pub mod snapshot;
pub mod state;
pub mod text;
pub mod update;
/// Public so that the sidecar reads its own formats (index dumps) through
/// the same checks.
pub mod wire;

pub use fit::{Fit, WorkerFits};
pub use plan::{LocalReason, Placement, Plan, Prefill, PrefillLeg, Rejection, Route};
pub use snapshot::SnapshotError;
pub use state::{
    Applied, DEFAULT_BOOTSTRAP_PORT, DEFAULT_TENANT, Disaggregation, InvalidValue, ModelPlan,
    ModelState, OnPrefillFailure, Policy, Protocol, RankLoad, Role, Slo, Snapshot, TenantLoad,
    Thermal, ThermalState, Thresholds, ThresholdsPatch, Topology, WorkerState,
};
pub use wire::WireError;
