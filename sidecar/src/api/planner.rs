//! The planner's API, for orchestrators without Kubernetes (the seed's
//! VirtualConnector) and for people:
//!
//! * `GET /v1/planner`: per planned model, what it wants and why: desired,
//!   ready and floor replicas, the reason, the pending decision, the
//!   workers draining, each worker's estimated TTFT and ITL, the
//!   predictions.
//! * `GET /v1/planner/decisions?after=ID&wait_ms=MS`: the first decision
//!   after `ID`, waiting for one up to `wait_ms` (204 when none came).
//! * `POST /v1/planner/decisions/{id}/complete`: the orchestrator carried
//!   it out; the model may step again (204, also when the planner already
//!   saw it through; 404 for a decision it does not know).

use super::{error, json_response};
use crate::fleet::Fleet;
use crate::planner::pool::Pending;
use crate::planner::regress::LineView;
use crate::planner::{Capacity, Estimate, PowerView, Reason};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvgate_core::Role;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a decision poll is held; the listeners' idle timeout is
/// validated against it.
const MAX_WAIT: Duration = crate::config::LONGEST_LONG_POLL;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlannerView {
    pub models: Vec<ModelPlanView>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelPlanView {
    pub model: String,
    /// Replicas wanted, all pools together.
    pub desired: u32,
    pub ready: u32,
    pub lower_bound: u32,
    pub reason: Reason,
    /// Planned as a prefill pool and a decode pool.
    pub disaggregated: bool,
    /// Each pool: one (`both`) for an aggregated model.
    pub pools: Vec<PoolView>,
    /// A decision the orchestrator has not reported done.
    pub pending: Option<PendingView>,
    /// Until the soonest pending scale-up is expected to serve.
    pub scale_up_eta_ms: Option<u64>,
    /// How long a scale-up takes, as observed (else configured).
    pub startup_ms: u64,
    pub draining: Vec<u64>,
    pub estimates: Vec<Estimate>,
    /// The latency fits pooled per worker role: TTFT against prompt
    /// tokens in flight, ITL against KV tokens in flight.
    pub fits: Vec<RoleFits>,
    /// Next interval's requests, ISL and OSL.
    pub predicted: Option<[f64; 3]>,
    /// The last closed interval: requests, ISL and OSL sums, cached
    /// prompt tokens, sheds.
    pub last_interval: Option<crate::planner::Interval>,
    pub kv_hit_rate: Option<f64>,
    /// The power budget at the last tick, where one is set.
    pub power: Option<PowerView>,
    pub ttft_sla_ms: f64,
    pub itl_sla_ms: f64,
}

/// One role's pooled fits.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoleFits {
    pub role: Role,
    pub ttft: Option<LineView>,
    pub itl: Option<LineView>,
}

/// One pool of a planned model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolView {
    pub role: Role,
    pub desired: u32,
    pub ready: u32,
    pub lower_bound: u32,
    pub reason: Reason,
    pub pending: Option<PendingView>,
    pub scale_up_eta_ms: Option<u64>,
    /// Capacity per replica at the predicted shape, from the profile and
    /// from the live fits, and their drift.
    pub capacity: Option<Capacity>,
    /// The pool's estimated TTFT and ITL with one request in flight, and
    /// the line a scale-down needs every estimate under (SLA ×
    /// sensitivity): an unloaded latency above it means the pool cannot
    /// scale down by load.
    pub unloaded_ttft_ms: Option<f64>,
    pub unloaded_itl_ms: Option<f64>,
    pub scale_down_below_ttft_ms: f64,
    pub scale_down_below_itl_ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PendingView {
    pub id: u64,
    pub from: u32,
    pub to: u32,
    pub age_ms: u64,
}

impl PendingView {
    fn of(p: &Pending, now: Instant) -> PendingView {
        PendingView {
            id: p.id,
            from: p.from,
            to: p.to,
            age_ms: now.saturating_duration_since(p.since).as_millis() as u64,
        }
    }
}

pub(super) async fn status(State(fleet): State<Arc<Mutex<Fleet>>>) -> Response {
    let f = fleet.lock();
    let now = Instant::now();
    let ms = |d: Duration| d.as_millis() as u64;
    let models = f
        .planning()
        .models
        .iter()
        .map(|(name, p)| {
            let ready = f.ready_counts(name);
            ModelPlanView {
                model: name.clone(),
                desired: p.desired(),
                ready: ready.iter().sum(),
                lower_bound: p.floor(),
                reason: p.reason(),
                disaggregated: p.disaggregated,
                pools: p
                    .pools
                    .iter()
                    .map(|pool| {
                        let (unloaded_ttft_ms, unloaded_itl_ms) = p.unloaded(pool.role);
                        PoolView {
                            role: pool.role,
                            desired: pool.desired,
                            ready: ready[usize::from(pool.role.code())],
                            lower_bound: pool.floor,
                            reason: pool.reason,
                            pending: pool.pending.map(|x| PendingView::of(&x, now)),
                            scale_up_eta_ms: p.pool_eta(pool.role, now).map(ms),
                            capacity: p.capacity.iter().find(|c| c.role == pool.role).copied(),
                            unloaded_ttft_ms,
                            unloaded_itl_ms,
                            scale_down_below_ttft_ms: p.cfg.ttft_ms * pool.bounds.sensitivity,
                            scale_down_below_itl_ms: p.cfg.itl_ms * pool.bounds.sensitivity,
                        }
                    })
                    .collect(),
                pending: p.pending().map(|x| PendingView::of(&x, now)),
                scale_up_eta_ms: p.scale_up_eta(now).map(ms),
                startup_ms: ms(p.startup()),
                draining: f
                    .planning()
                    .draining
                    .iter()
                    .copied()
                    .filter(|id| f.worker(*id).is_some_and(|w| &w.spec().model_name == name))
                    .collect(),
                estimates: f.estimates(name),
                fits: Role::ALL
                    .iter()
                    .map(|r| RoleFits {
                        role: *r,
                        ttft: p.ttft().role(*r).view(),
                        itl: p.itl().role(*r).view(),
                    })
                    .filter(|f| f.ttft.is_some() || f.itl.is_some())
                    .collect(),
                predicted: p.predicted,
                last_interval: p.observed,
                kv_hit_rate: p.observed.map(|i| i.kv_hit_rate()),
                power: p.last.as_ref().and_then(|t| t.power),
                ttft_sla_ms: p.cfg.ttft_ms,
                itl_sla_ms: p.cfg.itl_ms,
            }
        })
        .collect();
    json_response(StatusCode::OK, &PlannerView { models })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DecisionQuery {
    #[serde(default)]
    after: u64,
    #[serde(default)]
    wait_ms: u64,
}

pub(super) async fn next_decision(
    State(fleet): State<Arc<Mutex<Fleet>>>,
    Query(q): Query<DecisionQuery>,
) -> Response {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(q.wait_ms).min(MAX_WAIT);
    loop {
        let notify = {
            let f = fleet.lock();
            if let Some(d) = f.planning().decision_after(q.after) {
                return json_response(StatusCode::OK, d);
            }
            f.planning().issued.clone()
        };
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // A decision issued between the look and `enable` is seen now.
        if let Some(d) = fleet.lock().planning().decision_after(q.after).cloned() {
            return json_response(StatusCode::OK, &d);
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return StatusCode::NO_CONTENT.into_response();
        }
    }
}

pub(super) async fn complete(
    State(fleet): State<Arc<Mutex<Fleet>>>,
    Path(id): Path<u64>,
) -> Response {
    let Some((model, seen_now)) = fleet.lock().decision_done(id, Instant::now()) else {
        return error(StatusCode::NOT_FOUND, format!("no decision {id}"));
    };
    // Reporting a decision the planner already saw through (the ready
    // count reached it) is not an error: the orchestrator cannot know.
    if seen_now {
        tracing::info!(id, model, "planner decision reported done");
    }
    StatusCode::NO_CONTENT.into_response()
}
