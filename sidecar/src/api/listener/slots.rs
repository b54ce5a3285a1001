//! A listener's connection slots: the cap, the share of it kept for
//! probes and token holders, and the room a new connection gets at the
//! cap by closing the one that has waited longest for a request head.
//!
//! The cap alone let a flood of silent sockets, reconnecting as the
//! header timeout closed them, refuse every new connection (the kubelet's
//! probes, Envoy's) for as long as it ran. A connection waiting for a
//! head holds nothing worth keeping, so at the cap the oldest waiter is
//! closed instead, as nginx drains idle keep-alives when it runs out of
//! connections; a new client then always gets in, and one that sends its
//! head at once is served. Connections with a request in flight are
//! never closed for room, so a flood of requests held open (long polls,
//! slow bodies) could still fill the cap: the last `reserved_connections`
//! of it serve only probes and token holders.

use super::activity::Activity;
use crate::config::ListenerLimits;
use crate::metrics::ListenerSeries;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::Notify;

pub(super) struct Slots {
    /// Slots any request may use.
    general: u32,
    /// Slots past those, for probes and token holders only.
    reserved: u32,
    state: Mutex<State>,
    drained: Notify,
    series: ListenerSeries,
}

#[derive(Default)]
struct State {
    next_id: u64,
    open: HashMap<u64, Entry>,
    general_open: u32,
    reserved_open: u32,
}

struct Entry {
    activity: Arc<Activity>,
    reserved: bool,
}

/// One connection's slot, given back when the connection ends (or taken
/// over by a newer one when it is evicted).
pub(super) struct Slot {
    id: u64,
    /// Whether the slot is of the reserved share.
    pub(super) reserved: bool,
    slots: Arc<Slots>,
}

impl Slots {
    pub(super) fn new(limits: &ListenerLimits, series: ListenerSeries) -> Slots {
        let cap = limits.max_connections.max(1);
        let reserved = reserved_share(cap, limits.reserved_connections);
        Slots {
            general: cap - reserved,
            reserved,
            state: Mutex::new(State::default()),
            drained: Notify::new(),
            series,
        }
    }

    /// The slots of the reserved share.
    pub(super) fn reserved(&self) -> u32 {
        self.reserved
    }

    /// A slot for a new connection: a free one, any request's first, else
    /// one of the reserved share, else the slot of the connection that
    /// has waited longest for a request head, which is told to close.
    /// `None` when every connection has a request in flight.
    pub(super) fn admit(self: &Arc<Self>, activity: Arc<Activity>) -> Option<Slot> {
        let mut s = self.state.lock();
        let reserved = if s.general_open < self.general {
            s.general_open += 1;
            false
        } else if s.reserved_open < self.reserved {
            s.reserved_open += 1;
            true
        } else {
            let (victim, _) = s
                .open
                .iter()
                .filter_map(|(id, e)| Some((*id, e.activity.waiting_since()?)))
                .min_by_key(|(_, since)| *since)?;
            let e = s.open.remove(&victim)?;
            e.activity.evict();
            self.series.evicted.inc();
            self.series.open.dec();
            e.reserved
        };
        let id = s.next_id;
        s.next_id += 1;
        s.open.insert(id, Entry { activity, reserved });
        self.series.open.inc();
        Some(Slot {
            id,
            reserved,
            slots: self.clone(),
        })
    }

    /// Resolves once every connection has ended.
    pub(super) async fn drained(&self) {
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.state.lock().open.is_empty() {
                return;
            }
            notified.await;
        }
    }
}

/// The reserved share of a cap: as configured, but at most half of it, so
/// that lowering the cap to the file limit leaves room for any request.
pub(super) fn reserved_share(cap: u32, configured: u32) -> u32 {
    configured.min(cap / 2)
}

impl Drop for Slot {
    fn drop(&mut self) {
        let slots = &self.slots;
        let mut s = slots.state.lock();
        // An evicted connection's slot is a newer one's already.
        let Some(e) = s.open.remove(&self.id) else {
            return;
        };
        if e.reserved {
            s.reserved_open -= 1;
        } else {
            s.general_open -= 1;
        }
        slots.series.open.dec();
        if s.open.is_empty() {
            slots.drained.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::activity::InFlight;
    use super::*;
    use crate::metrics::Metrics;
    use std::time::Duration;

    fn slots(cap: u32, reserved: u32) -> (Arc<Slots>, ListenerSeries) {
        let series = Metrics::new().unwrap().listener.series("t");
        let limits = ListenerLimits {
            header_read_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(60),
            max_connections: cap,
            reserved_connections: reserved,
            body_budget_bytes: 1 << 20,
            body_timeout: Duration::from_secs(1),
        };
        (Arc::new(Slots::new(&limits, series.clone())), series)
    }

    #[test]
    fn the_last_slots_are_the_reserved_share_and_at_most_half_the_cap() {
        assert_eq!(reserved_share(1024, 64), 64);
        assert_eq!(reserved_share(8, 64), 4);
        assert_eq!(reserved_share(1, 64), 0);
        let (s, series) = slots(4, 1);
        let taken: Vec<Slot> = (0..4)
            .map(|_| s.admit(Arc::new(Activity::new())).unwrap())
            .collect();
        let reserved: Vec<bool> = taken.iter().map(|t| t.reserved).collect();
        assert_eq!(reserved, [false, false, false, true]);
        assert_eq!(series.open.get(), 4);
        drop(taken);
        assert_eq!(series.open.get(), 0);
    }

    #[test]
    fn at_the_cap_a_waiting_connection_makes_room_and_a_busy_one_never_does() {
        let (s, series) = slots(3, 0);
        let busy = Arc::new(Activity::new());
        let _request = InFlight::begin(busy.clone());
        let a = s.admit(busy).unwrap();
        let waiting = [
            s.admit(Arc::new(Activity::new())).unwrap(),
            s.admit(Arc::new(Activity::new())).unwrap(),
        ];
        let newer = s.admit(Arc::new(Activity::new())).unwrap();
        assert_eq!((series.evicted.get(), series.open.get()), (1, 3));
        assert!(
            s.state.lock().open.contains_key(&a.id),
            "the busy one stays"
        );
        // The evicted connection ending gives back nothing: its slot is
        // the newer one's.
        drop(waiting);
        assert_eq!(series.open.get(), 2);
        drop((a, newer));
        assert_eq!(series.open.get(), 0);

        let (s, series) = slots(1, 0);
        let busy = Arc::new(Activity::new());
        let _request = InFlight::begin(busy.clone());
        let _a = s.admit(busy).unwrap();
        assert!(s.admit(Arc::new(Activity::new())).is_none());
        assert_eq!(series.evicted.get(), 0);
    }
}
