//! One pool of a model's workers, sized on its own: every worker of an
//! aggregated model, or a disaggregated model's prefill workers or its
//! decode workers (seed 003's disaggregated mode). A pool owns its
//! replica count, its throughput floor, its pending decision and the
//! start-up times it has seen; the ±1 rule runs on each pool apart.

use super::Reason;
use crate::config::PoolBounds;
use kvgate_core::Role;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// The pools a model is planned as.
pub fn roles(disaggregated: bool) -> &'static [Role] {
    if disaggregated {
        &[Role::Prefill, Role::Decode]
    } else {
        &[Role::Both]
    }
}

/// The pool a worker of `role` counts in. In a disaggregated model a
/// `both` worker decodes (it also computes a prompt the conditional rule
/// keeps local): it counts with the decode workers.
pub fn of(disaggregated: bool, role: Role) -> Role {
    match (disaggregated, role) {
        (false, _) => Role::Both,
        (true, Role::Prefill) => Role::Prefill,
        (true, _) => Role::Decode,
    }
}

/// A decision waiting for the orchestrator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pending {
    pub id: u64,
    pub from: u32,
    pub to: u32,
    pub since: Instant,
}

/// What a pool's workers' estimates say, against the SLA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Some worker has no estimate yet.
    Unknown,
    /// Every worker is over the SLA.
    Over,
    /// Every worker is under SLA × sensitivity.
    Under,
    /// Within the band, or workers disagree.
    Between,
}

/// One pool's tick, for metrics, the status view and the decision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PoolTick {
    pub role: Role,
    pub desired: u32,
    pub ready: u32,
    pub lower_bound: u32,
    pub reason: Reason,
    /// Whether `desired` changed (or is asked again): a decision to issue.
    pub changed: bool,
}

#[derive(Debug, Clone)]
pub struct Pool {
    pub role: Role,
    pub bounds: PoolBounds,
    pub desired: u32,
    /// The throughput loop's lower bound.
    pub floor: u32,
    pub pending: Option<Pending>,
    pub reason: Reason,
    /// Observed times from a scale-up decision to its worker being ready.
    startups: Vec<Duration>,
    /// When a load tick first found the pool serving: that tick takes the
    /// pool as it finds it (the configuration may list workers that never
    /// came up).
    seen: Option<Instant>,
    /// When the first load tick ran.
    first_tick: Option<Instant>,
}

/// Start-up times kept for the median.
const STARTUPS_KEPT: usize = 16;

impl Pool {
    pub fn new(role: Role, bounds: PoolBounds, ready: u32) -> Pool {
        Pool {
            role,
            bounds,
            desired: ready.clamp(bounds.min_replicas, bounds.max_replicas),
            floor: bounds.min_replicas,
            pending: None,
            reason: Reason::WarmingUp,
            startups: Vec::new(),
            seen: None,
            first_tick: None,
        }
    }

    /// The first load tick that finds the pool serving: what serves is
    /// where the pool starts from.
    pub fn first_sight(&mut self, ready: u32, now: Instant) {
        self.first_tick.get_or_insert(now);
        if self.seen.is_none() && ready > 0 {
            if self.pending.is_none() {
                self.desired = ready.clamp(self.bounds.min_replicas, self.bounds.max_replicas);
            }
            self.seen = Some(now);
        }
    }

    /// Whether the pool has fewer workers serving than it needs and
    /// nothing on its way: a worker left or crashed (it served before),
    /// or none came within `grace` of the first tick. Before either, a
    /// pool found empty may just not have been scraped yet.
    fn short(&self, want: u32, ready: u32, reason: Reason, now: Instant, grace: Duration) -> bool {
        let below = ready < self.bounds.min_replicas || (reason == Reason::ScaleUp && ready < want);
        let known = self.seen.is_some()
            || self
                .first_tick
                .is_some_and(|t| now.saturating_duration_since(t) >= grace);
        want == self.desired && below && known && self.pending.is_none()
    }

    fn started(&mut self, took: Duration) {
        self.startups.push(took);
        if self.startups.len() > STARTUPS_KEPT {
            self.startups.remove(0);
        }
    }

    /// The pending decision is done (the ready count reached it), or has
    /// timed out.
    pub fn settle(&mut self, ready: u32, now: Instant, timeout: Duration) {
        let Some(p) = self.pending else {
            return;
        };
        let reached = if p.to >= p.from {
            ready >= p.to
        } else {
            ready <= p.to
        };
        if reached {
            if p.to > p.from {
                self.started(now.saturating_duration_since(p.since));
            }
            self.pending = None;
        } else if now.saturating_duration_since(p.since) >= timeout {
            tracing::warn!(
                decision = p.id,
                pool = self.role.as_str(),
                "planner decision not done within its timeout: going on"
            );
            self.pending = None;
        }
    }

    /// The orchestrator reports decision `id` carried out.
    pub fn complete(&mut self, id: u64, now: Instant) -> bool {
        match self.pending {
            Some(p) if p.id == id => {
                if p.to > p.from {
                    self.started(now.saturating_duration_since(p.since));
                }
                self.pending = None;
                true
            }
            _ => false,
        }
    }

    /// How long a scale-up takes: the median observed, else `configured`.
    pub fn startup(&self, configured: Duration) -> Duration {
        if self.startups.is_empty() {
            return configured;
        }
        let mut s = self.startups.clone();
        s.sort();
        s[s.len() / 2]
    }

    /// When a pending scale-up is expected to have its worker ready.
    pub fn scale_up_eta(&self, now: Instant, configured: Duration) -> Option<Duration> {
        let p = self.pending?;
        (p.to > p.from).then(|| (p.since + self.startup(configured)).saturating_duration_since(now))
    }

    /// The seed's rule, on this pool: up by one when every worker is over
    /// its SLA, down by one when every one is under SLA × sensitivity,
    /// never under the floor nor out of bounds, and no step while a
    /// decision is pending, except to lift the pool to its floor (the
    /// throughput loop's need, which the load that a pending worker has
    /// yet to take does not distort). What it wants, before the power
    /// budget.
    pub fn want(&self, verdict: Verdict, ready: u32) -> (u32, Reason) {
        let b = &self.bounds;
        let base = ready.max(1);
        let (mut want, mut reason) = match verdict {
            Verdict::Unknown => (self.desired, Reason::WarmingUp),
            Verdict::Over => (base + 1, Reason::ScaleUp),
            Verdict::Under => (base.saturating_sub(1), Reason::ScaleDown),
            Verdict::Between => (self.desired, Reason::Hold),
        };
        if want < self.floor {
            want = self.floor;
            if reason == Reason::ScaleDown || self.desired < self.floor {
                reason = Reason::Floor;
            }
        }
        let clamped = want.clamp(b.min_replicas, b.max_replicas);
        if clamped != want {
            want = clamped;
            reason = Reason::Bound;
        }
        if self.pending.is_some() && !(reason == Reason::Floor && want > self.desired) {
            return (self.desired, Reason::Pending);
        }
        (want, reason)
    }

    /// Takes `want` as the pool's target; `id` names the decision if it
    /// changes. A pool short of workers with nothing pending (below its
    /// minimum, or over its SLA with fewer serving than it wants: a
    /// worker left or died) asks again for what it already wants;
    /// `grace` is how long a pool found empty at start waits for its
    /// first worker before it asks.
    pub fn set(
        &mut self,
        (want, reason): (u32, Reason),
        ready: u32,
        now: Instant,
        id: u64,
        grace: Duration,
    ) -> PoolTick {
        let lost = self.short(want, ready, reason, now, grace);
        let changed = want != self.desired || lost;
        let reason = if lost && ready < self.bounds.min_replicas {
            Reason::Bound
        } else {
            reason
        };
        if changed {
            self.pending = Some(Pending {
                id,
                from: ready,
                to: want,
                since: now,
            });
            self.desired = want;
        }
        self.reason = reason;
        PoolTick {
            role: self.role,
            desired: self.desired,
            ready,
            lower_bound: self.floor,
            reason,
            changed,
        }
    }
}
