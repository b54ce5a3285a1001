//! Requests held for a worker (admission): this VM's queue of them, and
//! the root's tick that answers the expired and releases the rest in
//! order. The queue is per VM, that is per Envoy worker thread, and
//! bounded per model in each (`admission.max_held`): an Envoy holds at
//! most its concurrency times that per model. A held request stays in
//! its own context, paused; the root reaches it by its context id, made
//! effective for the calls that answer or send it.

use super::RouterState;
use super::request::{Flow, Retried};
use crate::host::Host;
use crate::reply::Reason;
use kvgate_core::admit::queue::Queue;
use proxy_wasm::types::LogLevel;
use std::cell::RefCell;
use std::rc::{Rc, Weak};

/// A held request, as the queue keeps it.
#[derive(Debug)]
pub struct HeldRef {
    pub context_id: u32,
    pub flow: Weak<RefCell<Flow>>,
    pub tenant: String,
}

pub type HeldQueue = Queue<HeldRef>;

/// How often held requests are tried again when nothing this VM sees has
/// changed: another thread's slot given back on a decode worker with a
/// bound shows only in the count they share.
const RETRY_ANYWAY_MS: u64 = 100;

/// A held request's turn on a tick: its class and whether its tenant is
/// over its share, the order it is offered a worker in.
struct Turn {
    key: (u8, bool),
    model: String,
    context_id: u32,
    flow: Weak<RefCell<Flow>>,
}

/// Makes `id` the context the next calls act on; a context Envoy no
/// longer knows fails, and its request is skipped.
fn enter(h: &impl Host, id: u32) -> bool {
    match h.set_effective_context(id) {
        Ok(()) => true,
        Err(f) => {
            h.log(
                LogLevel::Debug,
                &format!("kvgate: held request {id} is gone ({f:?})"),
            );
            false
        }
    }
}

/// On the root's tick, after its look ahead at the newest snapshot (a
/// new one counts as a change): answers the held requests whose deadline
/// passed, then offers the rest, in order, a worker: by class, tenants
/// under their share first, then by deadline. A model's requests stop at
/// the first that still finds none, so none jumps ahead of one that comes
/// first.
pub fn on_tick(state: &Rc<RefCell<RouterState>>, h: &impl Host) {
    let (displaced, expired, order) = {
        let Ok(mut st) = state.try_borrow_mut() else {
            return;
        };
        if st.held.is_empty() && st.displaced.is_empty() {
            return;
        }
        let displaced = std::mem::take(&mut st.displaced);
        st.unmark_full();
        let expired = st.held.expire(h.now_ms());
        // Nothing that could free a worker happened since the last try
        // (no new snapshot, nothing released here): no request is decided
        // again for nothing. Another thread's release shows in the next
        // snapshot, a slot it gave back only in the shared count: read
        // again every `RETRY_ANYWAY_MS` all the same.
        let now = h.now_ms();
        let stale = now.saturating_sub(st.tried_ms) >= RETRY_ANYWAY_MS;
        if st.changes == st.tried_at && !stale && expired.is_empty() && displaced.is_empty() {
            return;
        }
        (st.tried_at, st.tried_ms) = (st.changes, now);
        // Within a class, tenants over their share of the model's booked
        // load go after those under it (a stable sort keeps the deadline
        // order within each).
        let mut order: Vec<Turn> = st
            .held
            .iter()
            .map(|e| Turn {
                key: (e.priority, st.over_share(&e.model, &e.item.tenant)),
                model: e.model.clone(),
                context_id: e.item.context_id,
                flow: e.item.flow.clone(),
            })
            .collect();
        order.sort_by_key(|t| t.key);
        (displaced, expired, order)
    };
    for d in displaced {
        if let Some(f) = d.flow.upgrade()
            && enter(h, d.context_id)
            && let Ok(mut f) = f.try_borrow_mut()
        {
            f.shed_held(h, Reason::PriorityShed);
        }
    }
    for e in expired {
        if let Some(f) = e.item.flow.upgrade()
            && enter(h, e.item.context_id)
            && let Ok(mut f) = f.try_borrow_mut()
        {
            f.expire_held(h);
        }
    }
    let mut stuck: Vec<String> = Vec::new();
    for turn in order {
        if stuck.contains(&turn.model) {
            continue;
        }
        let Some(f) = turn.flow.upgrade() else {
            continue;
        };
        if !enter(h, turn.context_id) {
            continue;
        }
        let Ok(mut f) = f.try_borrow_mut() else {
            continue;
        };
        if f.retry_held(h) == Retried::StillHeld {
            stuck.push(turn.model);
        }
    }
}

/// A callout answer the SDK handed to the root: made by a request the
/// root released from the queue, and passed on to it.
pub fn on_callout_answer(
    state: &Rc<RefCell<RouterState>>,
    h: &impl Host,
    token: u32,
    body_size: usize,
) {
    let found = {
        let Ok(mut st) = state.try_borrow_mut() else {
            return;
        };
        st.forwarded
            .iter()
            .position(|(t, _, _)| *t == token)
            .map(|i| st.forwarded.swap_remove(i))
    };
    let Some((_, id, flow)) = found else {
        return;
    };
    if let Some(f) = flow.upgrade()
        && enter(h, id)
        && let Ok(mut f) = f.try_borrow_mut()
    {
        f.on_forwarded_answer(h, token, body_size);
    }
}

impl RouterState {
    /// Whether `tenant` holds more than its weight's part of `model`'s
    /// booked load, as this VM's view has it (every gateway's bookings),
    /// among the tenants with load and those with requests held here.
    pub(super) fn over_share(&self, model: &str, tenant: &str) -> bool {
        let (Some(a), Some(m)) = (
            &self.config.admission,
            self.view.snapshot.as_ref().and_then(|s| s.model(model)),
        ) else {
            return false;
        };
        let waiting = self
            .held
            .iter()
            .filter(|e| e.model == model)
            .map(|e| e.item.tenant.as_str());
        a.over_share(m, tenant, waiting)
    }

    /// Whether `model` holds a request of priority `priority` or before:
    /// a newcomer then waits its turn rather than take a worker that
    /// frees up before the tick offers it to them.
    pub(super) fn queued_before(&self, model: &str, priority: u8) -> bool {
        self.held
            .iter()
            .any(|e| e.model == model && e.priority <= priority)
    }
}
