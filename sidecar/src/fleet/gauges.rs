//! What the fleet shows on `/metrics`: workers' health and engine load,
//! the load booked on them, and the planner's view of each model.

use super::{Fleet, Planned};
use crate::metrics::{LedgerMetrics, PlannerMetrics, SnapshotMetrics};
use crate::sources::bookings::Bookings;
use kvgate_core::{Role, Snapshot};
use std::collections::HashMap;

impl Fleet {
    /// Sets the per-model, per-worker and per-rank gauges from one publish
    /// tick's fleet, bookings and snapshot.
    pub(crate) fn show(
        &self,
        b: &Bookings,
        snap: &Snapshot,
        m: &SnapshotMetrics,
        ledger: &LedgerMetrics,
    ) {
        let mut per_model: HashMap<&str, i64> =
            self.models.keys().map(|k| (k.as_str(), 0)).collect();
        let mut booked: HashMap<&str, i64> = self.models.keys().map(|k| (k.as_str(), 0)).collect();
        // Every role of every model, so that a role with no worker shows 0.
        let mut by_role: HashMap<(&str, Role), (i64, i64)> = self
            .models
            .keys()
            .flat_map(|k| Role::ALL.map(|r| ((k.as_str(), r), (0, 0))))
            .collect();
        for model in &snap.models {
            m.retry_after
                .with_label_values(&[model.name.as_str()])
                .set(i64::from(model.retry_after_s));
            if let Some(e) = self
                .planning
                .latency(&model.name)
                .and_then(|l| l.ttft_error())
            {
                m.ttft_prediction_error
                    .with_label_values(&[model.name.as_str()])
                    .set(e);
            }
            for w in &model.workers {
                let ids = w.id.to_string();
                if let Some((up, busy)) = by_role.get_mut(&(model.name.as_str(), w.role)) {
                    *up += 1;
                    *busy += i64::from(!w.ranks.is_empty() && w.ranks.iter().all(|r| r.busy));
                }
                for r in &w.ranks {
                    let rs = r.rank.to_string();
                    let l = [ids.as_str(), rs.as_str()];
                    ledger
                        .rank_active_prefill
                        .with_label_values(&l)
                        .set(r.active_prefill_tokens as i64);
                    ledger
                        .rank_active_decode
                        .with_label_values(&l)
                        .set(r.active_decode_blocks as i64);
                    m.rank_busy.with_label_values(&l).set(i64::from(r.busy));
                }
            }
        }
        for w in self.workers.values() {
            let n: u64 = w.slots.iter().map(|s| b.slot(*s).requests).sum();
            *booked.entry(w.spec.model_name.as_str()).or_default() += n as i64;
        }
        for (model, n) in booked {
            ledger.bookings_active.with_label_values(&[model]).set(n);
        }
        let (gateway, reserved, peers) = b.census();
        for (kind, n) in [
            ("gateway", gateway),
            ("reservation", reserved),
            ("peer", peers),
        ] {
            ledger.holders.with_label_values(&[kind]).set(n as i64);
        }
        ledger.capacity.set(b.capacity() as i64);
        for (id, w) in &self.workers {
            let ids = id.to_string();
            m.worker_up
                .with_label_values(&[w.spec.model_name.as_str(), &ids])
                .set(i64::from(w.health.up));
            if w.health.up {
                *per_model.entry(w.spec.model_name.as_str()).or_default() += 1;
            }
            let model = w.spec.model_name.as_str();
            for role in Role::ALL {
                let l = [model, ids.as_str(), role.as_str()];
                if role == w.spec.role {
                    m.worker_info.with_label_values(&l).set(1);
                } else {
                    // A PATCH changed the role: the old series goes.
                    let _ = m.worker_info.remove_label_values(&l);
                }
            }
            for (r, rm) in w.ranks.iter().enumerate() {
                let rs = (w.spec.data_parallel_start_rank + r as u32).to_string();
                let l = [ids.as_str(), rs.as_str()];
                m.rank_running
                    .with_label_values(&l)
                    .set(i64::from(rm.running));
                m.rank_waiting
                    .with_label_values(&l)
                    .set(i64::from(rm.waiting));
                m.rank_kv_used
                    .with_label_values(&l)
                    .set(rm.kv_used_blocks() as i64);
                m.rank_kv_total
                    .with_label_values(&l)
                    .set(rm.kv_total_blocks as i64);
            }
        }
        for (model, n) in per_model {
            m.workers_up.with_label_values(&[model]).set(n);
        }
        for ((model, role), (up, busy)) in by_role {
            let l = [model, role.as_str()];
            m.role_workers_up.with_label_values(&l).set(up);
            m.role_workers_busy.with_label_values(&l).set(busy);
        }
    }

    /// The planner's gauges after a tick.
    pub(crate) fn show_planned(&self, planned: &[Planned], m: &PlannerMetrics) {
        for p in planned {
            let model = p.model.as_str();
            let t = &p.tick;
            m.desired
                .with_label_values(&[model])
                .set(i64::from(t.desired()));
            m.ready.with_label_values(&[model]).set(i64::from(p.ready));
            m.lower_bound
                .with_label_values(&[model])
                .set(i64::from(t.lower_bound()));
            let worst = |f: fn(&crate::planner::Estimate) -> Option<f64>| {
                t.estimates.iter().filter_map(f).fold(f64::NAN, f64::max)
            };
            m.ttft.with_label_values(&[model]).set(worst(|e| e.ttft_ms));
            m.itl.with_label_values(&[model]).set(worst(|e| e.itl_ms));
            let reason = t.reason();
            for r in crate::planner::Reason::ALL {
                m.reason
                    .with_label_values(&[model, r.as_str()])
                    .set(i64::from(r == reason));
            }
            for pool in &t.pools {
                let l = [model, pool.role.as_str()];
                m.pool_desired
                    .with_label_values(&l)
                    .set(i64::from(pool.desired));
                m.pool_ready
                    .with_label_values(&l)
                    .set(i64::from(pool.ready));
                m.pool_lower_bound
                    .with_label_values(&l)
                    .set(i64::from(pool.lower_bound));
                for r in crate::planner::Reason::ALL {
                    m.pool_reason
                        .with_label_values(&[model, pool.role.as_str(), r.as_str()])
                        .set(i64::from(r == pool.reason));
                }
            }
            if let Some(d) = &p.decision {
                let dir = if !d.switch.is_empty() {
                    "switch"
                } else if d.desired > d.ready {
                    "up"
                } else {
                    "down"
                };
                m.decisions.with_label_values(&[model, dir]).inc();
            }
            if let Some(x) = self.planning.models.get(model) {
                if let Some([n, isl, osl]) = x.predicted {
                    for (q, v) in [("requests", n), ("isl", isl), ("osl", osl)] {
                        m.predicted.with_label_values(&[model, q]).set(v);
                    }
                }
                for c in &x.capacity {
                    for (source, v) in [("profile", c.profile_rps), ("learned", c.learned_rps)] {
                        if let Some(v) = v {
                            m.capacity
                                .with_label_values(&[model, c.role.as_str(), source])
                                .set(v);
                        }
                    }
                }
            }
            if let Some(w) = &t.power {
                m.power_budget.with_label_values(&[model]).set(w.budget_w);
                m.planned_power
                    .with_label_values(&[model])
                    .set(w.planned_w.unwrap_or(f64::NAN));
                m.power_binding
                    .with_label_values(&[model])
                    .set(i64::from(w.binding));
                m.expected_attainment
                    .with_label_values(&[model])
                    .set(w.expected_sla_attainment.unwrap_or(f64::NAN));
            }
            let draining = self
                .planning
                .draining
                .iter()
                .filter(|id| {
                    self.workers
                        .get(id)
                        .is_some_and(|w| w.spec.model_name == model)
                })
                .count();
            m.draining.with_label_values(&[model]).set(draining as i64);
        }
    }
}
