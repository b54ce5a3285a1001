//! The planner's state beside the fleet: each planned model's
//! [`ModelPlanner`], what the gateway observed of each routed request, the
//! decisions issued to the orchestrator, and the workers being drained.
//! A model with an SLO and no planner is observed too: its latency fits
//! are kept here, for the snapshot to publish.
//!
//! A scale-down drains the worker whose cache is worth least (fewest KV
//! blocks in use, then fewest requests in flight): it takes no new
//! requests and finishes what it has; the orchestrator removes it. A
//! scale-up while a worker is draining takes that worker back instead of
//! asking for a new one.

use super::Fleet;
use crate::planner::fits::Latency;
use crate::planner::pool::PoolTick;
use crate::planner::{
    Estimate, LegEnd, ModelPlanner, PowerInput, PowerView, Reason, Tick, WorkerLoad,
};
use kvgate_core::Role;
use kvgate_core::booking::{Key, Timing};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Routed requests remembered until their end (a gateway losing its end
/// reports costs one observation, never memory).
const MAX_WATCHED: usize = 65_536;
/// Decisions kept for late long polls.
const MAX_DECISIONS: usize = 64;

/// One scaling decision, as the orchestrator reads it. Counts are
/// targets, not steps: a later decision supersedes an earlier one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub id: u64,
    pub model: String,
    /// Replicas the model should have, all pools together.
    pub desired: u32,
    /// Replicas serving when it was made.
    pub ready: u32,
    /// A disaggregated model's prefill workers to have (the seed's
    /// `num_prefill`); absent for a model planned as one pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_prefill: Option<u32>,
    /// Its decode workers to have (`num_decode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_decode: Option<u32>,
    /// Each pool: its target, ready count, floor and reason.
    pub pools: Vec<PoolTick>,
    /// Workers to remove once they are idle (a scale-down's choice).
    pub drain: Vec<u64>,
    /// Workers to move to the other pool (`PATCH /workers/{id}` with
    /// `{"role": to}`) instead of starting one and draining another.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub switch: Vec<RoleSwitch>,
    pub reason: Reason,
    /// The power budget, where one is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<PowerView>,
    /// Unix ms.
    pub issued_at_ms: u64,
}

/// A worker to serve another pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleSwitch {
    pub worker_id: u64,
    pub from: Role,
    pub to: Role,
}

/// What the load loop saw of a routed leg when it was booked.
#[derive(Debug, Clone)]
struct Watch {
    model: String,
    worker: u64,
    role: Role,
    prefill_tokens: f64,
    decode_kv_tokens: f64,
    /// Its own prompt tokens not cached where it went.
    uncached: u64,
    at: Instant,
}

pub struct Planning {
    pub models: BTreeMap<String, ModelPlanner>,
    /// The latency fits of each model with an SLO and no planner; a
    /// planned model's are its planner's.
    latency: BTreeMap<String, Latency>,
    watched: HashMap<Key, Watch>,
    pub decisions: VecDeque<Decision>,
    next_id: u64,
    pub draining: BTreeSet<u64>,
    /// Wakes long polls when a decision is issued.
    pub issued: std::sync::Arc<tokio::sync::Notify>,
    /// `[planner] power_budget_w`: what every planned model may draw
    /// together.
    pub fleet_power_budget_w: Option<f64>,
    /// A GPU reading older than this is no measure of a worker's draw.
    pub gpu_stale_after: Duration,
}

impl Default for Planning {
    fn default() -> Self {
        Planning {
            models: Default::default(),
            latency: BTreeMap::new(),
            watched: HashMap::new(),
            decisions: VecDeque::new(),
            next_id: 0,
            draining: BTreeSet::new(),
            issued: Default::default(),
            fleet_power_budget_w: None,
            gpu_stale_after: Duration::from_secs(10),
        }
    }
}

impl std::fmt::Debug for Planning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planning")
            .field("models", &self.models.keys().collect::<Vec<_>>())
            .field("latency", &self.latency.keys().collect::<Vec<_>>())
            .field("watched", &self.watched.len())
            .field("decisions", &self.decisions.len())
            .field("draining", &self.draining)
            .finish()
    }
}

impl Planning {
    fn issue(&mut self, d: Decision) -> u64 {
        self.decisions.push_back(d);
        while self.decisions.len() > MAX_DECISIONS {
            self.decisions.pop_front();
        }
        self.issued.notify_waiters();
        self.next_id
    }

    /// The next decision id (ids start at 1).
    fn next(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The first decision after `after`.
    pub fn decision_after(&self, after: u64) -> Option<&Decision> {
        self.decisions.iter().find(|d| d.id > after)
    }
}

/// One model's tick, for metrics.
#[derive(Debug, Clone)]
pub struct Planned {
    pub model: String,
    pub tick: Tick,
    pub ready: u32,
    pub decision: Option<Decision>,
}

/// The model's planned workers serving now, by pool ([`Role::code`] of
/// the pool).
type Ready = [Vec<u64>; 3];

impl Planning {
    /// Keeps latency fits for `model`, which has an SLO and no planner.
    pub(super) fn fit_latency(&mut self, model: &str) {
        if !self.models.contains_key(model) {
            self.latency.entry(model.to_string()).or_default();
        }
    }

    /// `model`'s latency fits: its planner's, else its own; `None` for a
    /// model that keeps none (no SLO).
    pub fn latency(&self, model: &str) -> Option<&Latency> {
        self.models
            .get(model)
            .map(ModelPlanner::latency)
            .or_else(|| self.latency.get(model))
    }
}

impl Fleet {
    /// Whether any model is planned.
    pub fn plans(&self) -> bool {
        !self.planning.models.is_empty()
    }

    /// Whether any model learns from its requests (it is planned, or has
    /// an SLO): without one, nothing observed is kept.
    pub fn observes(&self) -> bool {
        self.plans() || !self.planning.latency.is_empty()
    }

    /// A routed leg, for its model's planner or latency fits: the worker
    /// it was booked on and that worker's role, and what the worker held
    /// then (prompt tokens, its own `uncached` ones included, and KV
    /// tokens, its own not: `kvgate_core::fit`'s `x`s, in tokens).
    pub fn planner_booked(
        &mut self,
        key: Key,
        model: &str,
        (worker, role): (u64, Role),
        load: (f64, f64),
        uncached: u64,
    ) {
        let p = &mut self.planning;
        let (prefill, decode_kv) = load;
        if p.latency(model).is_none() {
            return;
        }
        if p.watched.len() >= MAX_WATCHED {
            // The oldest are requests whose end was lost.
            if let Some(k) = p.watched.iter().min_by_key(|(_, w)| w.at).map(|(k, _)| *k) {
                p.watched.remove(&k);
            }
        }
        p.watched.insert(
            key,
            Watch {
                model: model.to_string(),
                worker,
                role,
                prefill_tokens: prefill,
                decode_kv_tokens: decode_kv,
                uncached,
                at: Instant::now(),
            },
        );
    }

    /// A routed leg's end, for its model's planner (see
    /// [`ModelPlanner::observe_end`] for what each leg teaches) or, with
    /// none, its latency fits. An end without timing only stops the watch.
    pub fn planner_ended(&mut self, key: &Key, timing: Option<Timing>) {
        let p = &mut self.planning;
        let (Some(w), Some(timing)) = (p.watched.remove(key), timing) else {
            return;
        };
        let end = LegEnd {
            worker: w.worker,
            role: w.role,
            prefill_tokens: w.prefill_tokens,
            decode_kv_tokens: w.decode_kv_tokens,
            uncached: w.uncached,
            timing,
            at: Instant::now(),
        };
        if let Some(planner) = p.models.get_mut(&w.model) {
            planner.observe_end(&end);
        } else if let Some(fits) = p.latency.get_mut(&w.model) {
            fits.observe(&end);
        }
    }

    /// The orchestrator reports decision `id` carried out. None when no
    /// such decision is kept; else its model, and whether this report is
    /// what completed it (false when the planner already saw it through).
    pub fn decision_done(&mut self, id: u64, now: Instant) -> Option<(String, bool)> {
        let model = self
            .planning
            .decisions
            .iter()
            .find(|d| d.id == id)
            .map(|d| d.model.clone())?;
        let done = self
            .planning
            .models
            .get_mut(&model)
            .is_some_and(|p| p.complete(id, now));
        Some((model, done))
    }

    /// A request shed for want of a worker, for its model's planner.
    pub fn planner_shed(&mut self, model: &str) {
        if let Some(p) = self.planning.models.get_mut(model) {
            p.observe_shed();
        }
    }

    /// Workers of `model` that serve: up and not draining.
    pub fn ready_workers(&self, model: &str) -> Vec<u64> {
        self.workers
            .iter()
            .filter(|(id, w)| {
                w.spec.model_name == model && w.health.up && !self.planning.draining.contains(id)
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// `model`'s serving workers by the pool they count in.
    fn ready_by_pool(&self, model: &str, p: &ModelPlanner) -> Ready {
        let mut out: Ready = Default::default();
        for id in self.ready_workers(model) {
            if let Some(w) = self.workers.get(&id) {
                out[usize::from(p.pool_of(w.spec.role).code())].push(id);
            }
        }
        out
    }

    /// Ready counts per pool, for the status view and the snapshot.
    pub fn ready_counts(&self, model: &str) -> [u32; 3] {
        let Some(p) = self.planning.models.get(model) else {
            return [0; 3];
        };
        self.ready_by_pool(model, p).map(|v| v.len() as u32)
    }

    /// What one worker of the pool of `pool` draws, measured: the median
    /// over its serving workers of their fresh GPUs' power together. A
    /// worker the thermal controller has capped draws less than it would
    /// uncapped, so the others' stand for the pool while any are uncapped.
    fn replica_watts(&self, ids: &[u64], now: Instant) -> Option<f64> {
        let stale = self.planning.gpu_stale_after;
        let draws: Vec<(f64, bool)> = ids
            .iter()
            .filter_map(|id| {
                let gpus = self.gpus_of(*id, now, stale);
                let watts: Option<f64> = gpus.iter().map(|g| g.reading.power_w).sum();
                let capped = self.workers.get(id).is_some_and(|w| w.thermal.cap() > 0);
                watts.filter(|_| !gpus.is_empty()).map(|w| (w, capped))
            })
            .collect();
        let uncapped: Vec<f64> = draws.iter().filter(|d| !d.1).map(|d| d.0).collect();
        let mut v = if uncapped.is_empty() {
            draws.iter().map(|d| d.0).collect()
        } else {
            uncapped
        };
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    }

    /// The power a model may plan to: its own budget, and what the fleet's
    /// leaves it after the other planned models' targets.
    fn power_for(&self, model: &str, ready: &Ready, now: Instant) -> PowerInput {
        let Some(p) = self.planning.models.get(model) else {
            return PowerInput::default();
        };
        let mut replica_w = [None; 3];
        for role in Role::ALL {
            replica_w[usize::from(role.code())] = self
                .replica_watts(&ready[usize::from(role.code())], now)
                .or(p.cfg.replica_watts);
        }
        let fleet_left = self.planning.fleet_power_budget_w.map(|b| {
            let others: f64 = self
                .planning
                .models
                .iter()
                .filter(|(name, _)| name.as_str() != model)
                .filter_map(|(_, q)| q.last.as_ref()?.power?.planned_w)
                .sum();
            (b - others).max(0.0)
        });
        let budget_w = match (p.cfg.power_budget_w, fleet_left) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        PowerInput {
            budget_w,
            replica_w,
        }
    }

    /// Runs the planned models' loops that are due. `loads` gives each
    /// worker's prefill tokens and decode KV tokens in flight.
    pub fn plan(
        &mut self,
        now: Instant,
        now_ms: u64,
        load_due: &dyn Fn(&str) -> (bool, bool),
        loads: &dyn Fn(&Fleet, u64) -> WorkerLoad,
    ) -> Vec<Planned> {
        let names: Vec<String> = self.planning.models.keys().cloned().collect();
        let mut out = Vec::new();
        for model in names {
            let (load_tick, throughput_tick) = load_due(&model);
            let Some(ready_ids) = self
                .planning
                .models
                .get(&model)
                .map(|p| self.ready_by_pool(&model, p))
            else {
                continue;
            };
            let counts = ready_ids.clone().map(|v| v.len() as u32);
            let ready: u32 = counts.iter().sum();
            let worker_loads: Vec<WorkerLoad> = ready_ids
                .iter()
                .flatten()
                .map(|id| loads(self, *id))
                .collect();
            let power = self.power_for(&model, &ready_ids, now);
            let id = self.planning.next_id + 1;
            let Some(p) = self.planning.models.get_mut(&model) else {
                continue;
            };
            if throughput_tick {
                p.tick_throughput();
            }
            if !load_tick {
                continue;
            }
            let tick = p.tick_load(&worker_loads, counts, now, id, power);
            let disaggregated = p.disaggregated;
            let mut decision = None;
            if tick.changed() {
                let d = self.decide(&model, &tick, &ready_ids, disaggregated, now_ms);
                tracing::info!(model, id = d.id, desired = d.desired, ready, num_prefill = ?d.num_prefill, num_decode = ?d.num_decode, reason = d.reason.as_str(), drain = ?d.drain, switch = ?d.switch, "planner decision");
                self.planning.issue(d.clone());
                decision = Some(d);
            }
            out.push(Planned {
                model,
                tick,
                ready,
                decision,
            });
        }
        out
    }

    /// The decision a changed tick makes: per pool, the workers to drain
    /// (or a draining one taken back), or the worker to switch.
    fn decide(
        &mut self,
        model: &str,
        tick: &Tick,
        ready_ids: &Ready,
        disaggregated: bool,
        now_ms: u64,
    ) -> Decision {
        let mut drain = Vec::new();
        let mut switch = Vec::new();
        if let Some((from, to)) = tick.switch {
            let pool = &ready_ids[usize::from(from.code())];
            if let Some(worker_id) = self.pick_drain(pool, 1).first().copied() {
                switch.push(RoleSwitch {
                    worker_id,
                    from,
                    to,
                });
            }
        }
        for pt in tick.pools.iter().filter(|p| p.changed) {
            if switch.iter().any(|s| s.from == pt.role || s.to == pt.role) {
                continue;
            }
            if pt.desired < pt.ready {
                let pool = &ready_ids[usize::from(pt.role.code())];
                let d = self.pick_drain(pool, (pt.ready - pt.desired) as usize);
                self.planning.draining.extend(d.iter().copied());
                drain.extend(d);
            } else if pt.desired > pt.ready
                && let Some(back) = self.undrain_one(model, pt.role, disaggregated)
            {
                tracing::info!(
                    model,
                    worker = back,
                    pool = pt.role.as_str(),
                    "scale-up takes back a draining worker"
                );
            }
        }
        let pool = |r: Role| tick.pool(r).map(|p| p.desired);
        Decision {
            id: self.planning.next(),
            model: model.to_string(),
            desired: tick.desired(),
            ready: tick.pools.iter().map(|p| p.ready).sum(),
            num_prefill: pool(Role::Prefill),
            num_decode: pool(Role::Decode),
            pools: tick.pools.clone(),
            drain,
            switch,
            reason: tick.reason(),
            power: tick.power,
            issued_at_ms: now_ms,
        }
    }

    /// The `n` workers whose loss costs least: fewest KV blocks in use
    /// (the least cache to lose), then fewest requests in flight.
    fn pick_drain(&self, candidates: &[u64], n: usize) -> Vec<u64> {
        let mut c: Vec<(u64, u64, u32)> = candidates
            .iter()
            .filter_map(|id| {
                let w = self.workers.get(id)?;
                let kv: u64 = w.ranks.iter().map(|r| r.kv_used_blocks()).sum();
                Some((*id, kv, w.in_flight))
            })
            .collect();
        c.sort_by_key(|(id, kv, inflight)| (*kv, *inflight, *id));
        c.into_iter().take(n).map(|(id, _, _)| id).collect()
    }

    /// A draining worker of `model` that counts in the pool of `pool`,
    /// taken back.
    fn undrain_one(&mut self, model: &str, pool: Role, disaggregated: bool) -> Option<u64> {
        let id = self.planning.draining.iter().copied().find(|id| {
            self.workers.get(id).is_some_and(|w| {
                w.spec.model_name == model
                    && crate::planner::pool::of(disaggregated, w.spec.role) == pool
            })
        })?;
        self.planning.draining.remove(&id);
        Some(id)
    }

    /// A worker left the catalog: it is drained no more, and its fits go.
    pub fn planner_forget(&mut self, id: u64) {
        self.planning.draining.remove(&id);
        for p in self.planning.models.values_mut() {
            p.forget(id);
        }
        for l in self.planning.latency.values_mut() {
            l.forget(id);
        }
    }

    /// The estimates of the last tick, for the status view.
    pub fn estimates(&self, model: &str) -> Vec<Estimate> {
        self.planning
            .models
            .get(model)
            .and_then(|p| p.last.as_ref())
            .map(|t| t.estimates.clone())
            .unwrap_or_default()
    }
}
