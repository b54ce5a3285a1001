//! A booking batch's effect on the metrics: requests routed per worker,
//! the gateways' refusals, the prompt tokens routed and those predicted
//! cached, and how long each leg took. Counted per slot and leg, once per
//! batch: a label lookup per event was most of a booking's cost.

use super::Owners;
use super::apply::{Entry, Gist};
use crate::metrics::{LatencyMetrics, SelectionMetrics};
use crate::planner::served;
use crate::sources::bookings::Effect;
use kvgate_core::booking::Timing;
use kvgate_core::plan::Leg;
use std::collections::HashMap;

/// One slot's share of a batch.
#[derive(Default)]
struct Slot {
    routed: u64,
    prompt: u64,
    cached: u64,
    /// The timed ends of its legs, by [`Leg::code`].
    ended: [Vec<Timing>; 3],
}

pub(super) fn count(
    entries: &[Entry],
    owners: &Owners,
    selection: &SelectionMetrics,
    latency: &LatencyMetrics,
) {
    let mut slots: HashMap<u16, Slot> = HashMap::new();
    for e in entries {
        match (&e.effect, e.gist) {
            (Effect::Booked { slot, .. }, _) => slots.entry(*slot).or_default().routed += 1,
            (Effect::Rejected { model, reason }, _) => {
                // Requests refused before their body named a model.
                let model = if model.is_empty() { "-" } else { model };
                selection
                    .rejected
                    .with_label_values(&[model, reason.as_str()])
                    .inc();
            }
            (Effect::Ended { slot, uncached }, Gist::Done(_, Some(t))) => {
                let s = slots.entry(*slot).or_default();
                // The predicted hit rate counts a prompt once, where it
                // was computed: a decode leg's prompt came with the
                // transfer, and its booking holds none of it.
                if matches!(t.leg, Leg::Whole | Leg::Prefill) {
                    let isl = u64::from(t.isl_tokens);
                    s.prompt = s.prompt.saturating_add(isl);
                    s.cached = s.cached.saturating_add(isl.saturating_sub(*uncached));
                }
                s.ended[usize::from(t.leg.code())].push(t);
            }
            _ => {}
        }
    }
    for (slot, s) in slots {
        // A booking is only accepted for a slot of its model, so the
        // rank names the model.
        let Some(owner) = owners.get(slot) else {
            continue;
        };
        let model = owner.rank.model.as_str();
        if s.routed > 0 {
            selection
                .routed
                .with_label_values(&[model, &owner.rank.worker_id.to_string()])
                .inc_by(s.routed);
        }
        if s.prompt > 0 {
            selection
                .routed_prompt_tokens
                .with_label_values(&[model])
                .inc_by(s.prompt);
            selection
                .routed_cached_tokens
                .with_label_values(&[model])
                .inc_by(s.cached);
        }
        for (leg, ended) in Leg::ALL.into_iter().zip(&s.ended) {
            legs(latency, model, owner.role.as_str(), leg, ended);
        }
    }
}

/// Times the legs that were served, as the planner takes them: a failed
/// leg's time is its failure's.
fn legs(latency: &LatencyMetrics, model: &str, role: &str, leg: Leg, ended: &[Timing]) {
    let mut served = ended.iter().filter(|t| served(t)).peekable();
    if served.peek().is_none() {
        return;
    }
    let labels = [model, role, leg.as_str()];
    let total = latency.leg.with_label_values(&labels);
    let first_byte = latency.leg_first_byte.with_label_values(&labels);
    // The client's wait, once per request: on the leg that answered it.
    let client = (leg != Leg::Prefill).then(|| latency.client_ttft.with_label_values(&[model]));
    for t in served {
        total.observe(seconds(t.total_us));
        if t.first_byte_us > 0 {
            first_byte.observe(seconds(t.first_byte_us));
        }
        if let Some(c) = &client
            && t.client_first_byte_us > 0
        {
            c.observe(seconds(t.client_first_byte_us));
        }
    }
}

fn seconds(us: u32) -> f64 {
    f64::from(us) / 1e6
}
