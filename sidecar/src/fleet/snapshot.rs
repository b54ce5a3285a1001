//! Building the snapshot Envoy reads from the fleet and the bookings.

use super::Fleet;
use super::drain::drain_time;
use crate::sources::bookings::Bookings;
use kvgate_core::busy::rank_busy;
use kvgate_core::state::splits;
use kvgate_core::{ModelState, RankLoad, Role, Snapshot, TenantLoad, WorkerState};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

/// The most tenants a model's snapshot record lists: those with the
/// largest shares, the ones fairness holds back. The others' load stays
/// in the ranks' sums and in no entry, and a record stays small however
/// many tenants a model serves.
pub const MAX_TENANTS: usize = 64;

impl Fleet {
    /// Builds the snapshot: engine metrics merged with gateway bookings,
    /// busy flags (with their latches) and each model's `Retry-After` hint.
    /// Version and build time are left 0 for the publisher. Updates each
    /// rank's decode latch, so call it once per publish tick.
    pub fn build_snapshot(&mut self, bookings: &Bookings, max_retry_after_s: u32) -> Snapshot {
        let mut models: BTreeMap<&str, ModelState> = self
            .models
            .iter()
            .map(|(name, m)| {
                (
                    name.as_str(),
                    ModelState {
                        name: name.clone(),
                        thresholds: m.thresholds,
                        shard_count: 0,
                        workers: Vec::new(),
                        retry_after_s: 0,
                        lora_adapters: m.lora_adapters.clone(),
                        policy: m.policy,
                        service_rate_per_s: 0.0,
                        plan: Default::default(),
                        prompt_template: self
                            .prompt_templates
                            .get(name)
                            .copied()
                            .unwrap_or_default(),
                        disaggregation: m.disaggregation.as_ref().map(|d| d.resolve(&m.policy)),
                        retry_after_by_pool_s: [0; 2],
                        slo: m.slo().unwrap_or_default(),
                        tenants: Vec::new(),
                    },
                )
            })
            .collect();
        // The models that split their requests, as the snapshot will show
        // them (`ModelState::disaggregated`): their workers are judged busy
        // by their role's conditions.
        let split: BTreeSet<String> = models
            .values()
            .filter(|m| m.disaggregation.is_some())
            .filter(|m| {
                splits(
                    self.workers
                        .values()
                        .filter(|w| w.health.up && w.spec.model_name == m.name)
                        .map(|w| w.spec.role),
                )
            })
            .map(|m| m.name.clone())
            .collect();
        let now = std::time::Instant::now();
        for w in self.workers.values_mut() {
            let Some(model) = models.get_mut(w.spec.model_name.as_str()) else {
                continue;
            };
            if !w.spec.kv_events_endpoints.is_empty() {
                model.shard_count = self.kv_shards;
            }
            if !w.health.up {
                continue;
            }
            let th = w
                .spec
                .role
                .judged_by(model.thresholds, split.contains(&model.name));
            let mut drain_s: Option<f64> = None;
            let (mut booked_requests, mut engine_requests, mut completions) = (0u64, 0u64, 0.0);
            let ranks: Vec<RankLoad> = w
                .ranks
                .iter()
                .zip(&w.slots)
                .zip(w.latches.iter_mut())
                .enumerate()
                .map(|(r, ((m, slot), latch))| {
                    let booked = bookings.slot(*slot);
                    model.service_rate_per_s += booked.completions_per_s;
                    completions += booked.completions_per_s;
                    booked_requests += booked.requests;
                    engine_requests += u64::from(m.running) + u64::from(m.waiting);
                    let mut load = RankLoad {
                        rank: w.spec.data_parallel_start_rank + r as u32,
                        slot: *slot,
                        // Engines do not report queued prefill; only the
                        // gateway knows what it sent and not yet heard back.
                        active_prefill_tokens: booked.prefill_tokens,
                        // What this gateway has in flight there, as Dynamo's
                        // router counts it. Not the engine's KV usage: that
                        // includes the shared prefix blocks of running
                        // requests, and counting them as load would push
                        // every request away from the cache it could reuse.
                        // Usage still makes a rank busy (`rank_busy` checks
                        // both).
                        active_decode_blocks: booked.decode_blocks,
                        kv_used_blocks: m.kv_used_blocks(),
                        kv_total_blocks: m.kv_total_blocks,
                        max_num_batched_tokens: if w.spec.max_num_batched_tokens > 0 {
                            w.spec.max_num_batched_tokens
                        } else {
                            m.max_num_batched_tokens
                        },
                        running: m.running,
                        waiting: m.waiting,
                        busy: false,
                    };
                    load.busy = rank_busy(&load, &th, latch).is_some();
                    if load.busy
                        && let Some(t) = drain_time(&load, &th, &booked)
                    {
                        drain_s = Some(drain_s.map_or(t, |d| d.min(t)));
                    }
                    load
                })
                .collect();
            // The engine's count lags a scrape behind; the bookings miss
            // what reached the engine another way. Whichever is more.
            w.in_flight = u32::try_from(booked_requests.max(engine_requests)).unwrap_or(u32::MAX);
            let thermal = w.thermal.published(w.in_flight);
            // A worker at its thermal cap takes work again once enough of
            // what it holds has finished.
            if thermal.at_cap() && completions > 0.0 {
                let t = f64::from(thermal.in_flight - thermal.cap + 1) / completions;
                drain_s = Some(drain_s.map_or(t, |d| d.max(t)));
            }
            // So does a decode worker at its bound on requests.
            let bound = th
                .active_decode_requests
                .filter(|_| w.spec.role != Role::Prefill);
            let full = bound.is_some_and(|b| u64::from(w.in_flight) >= b);
            if let Some(b) = bound.filter(|_| full && completions > 0.0) {
                let t = (u64::from(w.in_flight) - b + 1) as f64 / completions;
                drain_s = Some(drain_s.map_or(t, |d| d.max(t)));
            }
            // A worker takes work again when its first rank does; the model,
            // when its first worker does.
            if (ranks.iter().all(|r| r.busy) || thermal.at_cap() || full)
                && let Some(t) = drain_s
            {
                let secs = (t.ceil() as u32).clamp(1, max_retry_after_s.max(1));
                model.retry_after_s = sooner(model.retry_after_s, secs);
                // A split model's leg waits on its own pool alone.
                if split.contains(&model.name) {
                    let pool = usize::from(w.spec.role != Role::Prefill);
                    let p = &mut model.retry_after_by_pool_s[pool];
                    *p = sooner(*p, secs);
                }
            }
            model.workers.push(WorkerState {
                id: w.spec.worker_id,
                endpoint: w.spec.endpoint.clone(),
                block_size: w.spec.block_size,
                ranks,
                tenant: w.spec.tenant_id.clone(),
                thermal,
                draining: self.planning.draining.contains(&w.spec.worker_id),
                role: w.spec.role,
                bootstrap_port: w
                    .spec
                    .bootstrap_port
                    .unwrap_or(kvgate_core::DEFAULT_BOOTSTRAP_PORT),
                fits: self
                    .planning
                    .latency(&model.name)
                    .and_then(|l| l.published(w.spec.worker_id, w.spec.role, now)),
                topology: w.spec.topology.clone(),
            });
        }
        for (name, p) in &self.planning.models {
            let Some(model) = models.get_mut(name.as_str()) else {
                continue;
            };
            let secs = |d: std::time::Duration| {
                (d.as_secs_f64().ceil() as u32).clamp(1, max_retry_after_s.max(1))
            };
            let eta = p.scale_up_eta(now).map(secs);
            model.plan = kvgate_core::ModelPlan {
                desired: p.desired(),
                ready: self.ready_workers(name).len() as u32,
                scale_up_eta_s: eta.unwrap_or(0),
            };
            // A shed request should come back when the new replica serves,
            // if that is sooner than the busy workers drain; a leg, when
            // its own pool's does.
            if let Some(eta) = eta {
                model.retry_after_s = sooner(model.retry_after_s, eta);
            }
            if p.disaggregated {
                for (i, role) in [Role::Prefill, Role::Decode].into_iter().enumerate() {
                    if let Some(eta) = p.pool_eta(role, now).map(secs) {
                        let r = &mut model.retry_after_by_pool_s[i];
                        *r = sooner(*r, eta);
                    }
                }
            }
        }
        for model in models.values_mut() {
            model.tenants = tenant_loads(model, bookings);
        }
        Snapshot {
            version: 0,
            built_at_ms: 0,
            models: models.into_values().collect(),
            applied: bookings.applied(),
        }
    }
}

/// What each tenant has booked on `model`'s published ranks (this
/// gateway's bookings, reservations and peers' admissions alike): the
/// [`MAX_TENANTS`] with the largest dominant share (the larger of their
/// part of the prompt tokens and of the decode blocks), by name so that
/// an unchanged ledger encodes the same bytes.
fn tenant_loads(model: &ModelState, bookings: &Bookings) -> Vec<TenantLoad> {
    let mut sums: HashMap<&Arc<str>, (u64, u64)> = HashMap::new();
    for r in model.workers.iter().flat_map(|w| &w.ranks) {
        for (tenant, l) in bookings.slot_tenants(r.slot) {
            let s = sums.entry(tenant).or_default();
            s.0 = s.0.saturating_add(l.prefill_tokens);
            s.1 = s.1.saturating_add(l.decode_blocks);
        }
    }
    // A tenant whose requests hold nothing now has no share to weigh.
    let mut sums: Vec<(&Arc<str>, (u64, u64))> = sums
        .into_iter()
        .filter(|(_, (p, d))| *p > 0 || *d > 0)
        .collect();
    if sums.len() > MAX_TENANTS {
        let (all_p, all_d) = sums.iter().fold((0u64, 0u64), |(p, d), (_, (a, b))| {
            (p.saturating_add(*a), d.saturating_add(*b))
        });
        let part = |x: u64, of: u64| if of == 0 { 0.0 } else { x as f64 / of as f64 };
        let share = |(p, d): (u64, u64)| part(p, all_p).max(part(d, all_d));
        sums.sort_by(|a, b| share(b.1).total_cmp(&share(a.1)).then_with(|| a.0.cmp(b.0)));
        sums.truncate(MAX_TENANTS);
    }
    sums.sort_by(|a, b| a.0.cmp(b.0));
    sums.into_iter()
        .map(|(tenant, (prefill_tokens, decode_blocks))| TenantLoad {
            tenant: tenant.to_string(),
            prefill_tokens,
            decode_blocks,
        })
        .collect()
}

/// The sooner of two Retry-After hints, 0 being none.
fn sooner(a: u32, b: u32) -> u32 {
    match (a, b) {
        (0, x) | (x, 0) => x,
        (a, b) => a.min(b),
    }
}
