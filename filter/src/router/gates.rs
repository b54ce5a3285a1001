//! The bound on a decode worker's requests in flight, held at the moment
//! each request is sent: this VM's side of `kvgate_core::admit::ledger`,
//! the counts every worker thread of this Envoy shares.

use super::RouterState;
use crate::host::Host;
use kvgate_core::admit::ledger;

/// A request's slot on a decode worker, from its sending to its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gate {
    pub model: String,
    pub worker: u64,
    /// The bound the request was sent under (its class's share).
    pub bound: u64,
}

impl RouterState {
    /// Takes a slot on `g`'s worker if it has one free, by compare and
    /// swap: two threads never take the same last slot. A value other
    /// threads kept rewriting, or one not created yet, counts as full (the
    /// request waits or is shed, never over-sent).
    pub(super) fn acquire_gate(&mut self, h: &impl Host, g: &Gate) -> bool {
        let (vm, now) = (self.vm_tag, h.now_ms());
        let mut free = false;
        // The snapshot service creates the value before it publishes the
        // bound (`Service::write`): a missing one counts as full.
        let written = h.update_existing(&ledger::key(&g.model), &mut |v| {
            let entries = ledger::decode(v.unwrap_or_default());
            let next = ledger::acquire(entries, vm, g.worker, g.bound, now).ok();
            free = next.is_some();
            next.map(|e| ledger::encode(&e))
        });
        if written && free {
            *self.gated.entry(g.model.clone()).or_default() += 1;
            return true;
        }
        // Full: this VM's view counts it so, until the next snapshot, and
        // places the request elsewhere.
        if let Some(w) = self
            .view
            .snapshot
            .as_mut()
            .and_then(|s| s.models.iter_mut().find(|m| m.name == g.model))
            .and_then(|m| m.workers.iter_mut().find(|w| w.id == g.worker))
        {
            let at = u32::try_from(g.bound).unwrap_or(u32::MAX);
            self.full
                .push((g.model.clone(), g.worker, w.thermal.in_flight));
            w.thermal.in_flight = w.thermal.in_flight.max(at);
        }
        false
    }

    /// Takes back the marks of workers found full: before the root's tick
    /// offers held requests a worker again, so that a slot freed since
    /// (which no snapshot may report for a while) is found by reading the
    /// count again, not after the next snapshot.
    pub(super) fn unmark_full(&mut self) {
        let marks = std::mem::take(&mut self.full);
        let Some(snap) = self.view.snapshot.as_mut() else {
            return;
        };
        for (model, worker, in_flight) in marks.into_iter().rev() {
            if let Some(w) = snap
                .models
                .iter_mut()
                .find(|m| m.name == model)
                .and_then(|m| m.workers.iter_mut().find(|w| w.id == worker))
            {
                w.thermal.in_flight = in_flight;
            }
        }
    }

    /// Gives a slot back.
    pub(super) fn release_gate(&mut self, h: &impl Host, g: &Gate) {
        self.changes += 1;
        let (vm, now) = (self.vm_tag, h.now_ms());
        h.update_shared(&ledger::key(&g.model), &mut |v| {
            ledger::release(ledger::decode(v.unwrap_or_default()), vm, g.worker, now)
                .map(|e| ledger::encode(&e))
        });
        if let Some(n) = self.gated.get_mut(&g.model) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.gated.remove(&g.model);
            }
        }
    }

    /// Restamps this VM's slots, so that other threads keep counting
    /// them: with its beat, once a second.
    pub(super) fn refresh_gates(&mut self, h: &impl Host) {
        let (vm, now) = (self.vm_tag, h.now_ms());
        for model in self.gated.keys() {
            h.update_shared(&ledger::key(model), &mut |v| {
                ledger::refresh(ledger::decode(v.unwrap_or_default()), vm, now)
                    .map(|e| ledger::encode(&e))
            });
        }
    }
}
