//! The planner's state beside the fleet: each planned model's
//! [`ModelPlanner`], what the gateway observed of each routed request, the
//! decisions issued to the orchestrator, and the workers being drained.
//!
//! A scale-down drains the worker whose cache is worth least (fewest KV
//! blocks in use, then fewest requests in flight): it takes no new
//! requests and finishes what it has; the orchestrator removes it. A
//! scale-up while a worker is draining takes that worker back instead of
//! asking for a new one.

use super::Fleet;
use crate::planner::{Estimate, LegEnd, ModelPlanner, Reason, Tick, WorkerLoad};
use kvgate_core::Role;
use kvgate_core::booking::{Key, Timing};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Instant;

/// Routed requests remembered until their end (a gateway losing its end
/// reports costs one observation, never memory).
const MAX_WATCHED: usize = 65_536;
/// Decisions kept for late long polls.
const MAX_DECISIONS: usize = 64;

/// One scaling decision, as the orchestrator reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub id: u64,
    pub model: String,
    /// Replicas the model should have.
    pub desired: u32,
    /// Replicas serving when it was made.
    pub ready: u32,
    /// Workers to remove once they are idle (a scale-down's choice).
    pub drain: Vec<u64>,
    pub reason: Reason,
    /// Unix ms.
    pub issued_at_ms: u64,
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

#[derive(Default)]
pub struct Planning {
    pub models: std::collections::BTreeMap<String, ModelPlanner>,
    watched: HashMap<Key, Watch>,
    pub decisions: VecDeque<Decision>,
    next_id: u64,
    pub draining: BTreeSet<u64>,
    /// Wakes long polls when a decision is issued.
    pub issued: std::sync::Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for Planning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planning")
            .field("models", &self.models.keys().collect::<Vec<_>>())
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

impl Fleet {
    /// Whether any model is planned: without one, nothing observed is
    /// kept.
    pub fn plans(&self) -> bool {
        !self.planning.models.is_empty()
    }

    /// A routed leg, for its model's planner: the worker it was booked on
    /// and that worker's role, and what the worker held then (prompt
    /// tokens and KV tokens, its own `uncached` prompt tokens included).
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
        if !p.models.contains_key(model) {
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
    /// [`ModelPlanner::observe_end`] for what each leg teaches). An end
    /// without timing only stops the watch.
    pub fn planner_ended(&mut self, key: &Key, timing: Option<Timing>) {
        let Some(w) = self.planning.watched.remove(key) else {
            return;
        };
        let (Some(p), Some(timing)) = (self.planning.models.get_mut(&w.model), timing) else {
            return;
        };
        p.observe_end(&LegEnd {
            worker: w.worker,
            role: w.role,
            prefill_tokens: w.prefill_tokens,
            decode_kv_tokens: w.decode_kv_tokens,
            uncached: w.uncached,
            timing,
        });
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
            let ready_ids = self.ready_workers(&model);
            let ready = ready_ids.len() as u32;
            let worker_loads: Vec<WorkerLoad> =
                ready_ids.iter().map(|id| loads(self, *id)).collect();
            let id = self.planning.next_id + 1;
            let Some(p) = self.planning.models.get_mut(&model) else {
                continue;
            };
            if throughput_tick {
                p.tick_throughput(ready);
            }
            if !load_tick {
                continue;
            }
            let tick = p.tick_load(&worker_loads, ready, now, id);
            let mut decision = None;
            if tick.changed {
                let mut drain = Vec::new();
                if tick.desired < ready {
                    drain = self.pick_drain(&ready_ids, (ready - tick.desired) as usize);
                    self.planning.draining.extend(drain.iter().copied());
                } else if tick.desired > ready
                    && let Some(back) = self.undrain_one(&model)
                {
                    tracing::info!(
                        model,
                        worker = back,
                        "scale-up takes back a draining worker"
                    );
                }
                let id = self.planning.next();
                let d = Decision {
                    id,
                    model: model.clone(),
                    desired: tick.desired,
                    ready,
                    drain,
                    reason: tick.reason,
                    issued_at_ms: now_ms,
                };
                tracing::info!(model, id, desired = d.desired, ready, reason = d.reason.as_str(), drain = ?d.drain, "planner decision");
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

    fn undrain_one(&mut self, model: &str) -> Option<u64> {
        let id = self.planning.draining.iter().copied().find(|id| {
            self.workers
                .get(id)
                .is_some_and(|w| w.spec.model_name == model)
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
