//! Worker lifecycle: what runs for each worker in the catalog. A worker
//! gets a scrape task and, per DP rank that publishes KV events, a
//! subscriber feeding the index; both go when it leaves the catalog or is
//! changed.

use crate::config::WorkerSpec;
use crate::metrics::SubscriberSeries;
use crate::sources::kv::plane::{Plane, RankId};
use crate::sources::kv::socket::SocketLimits;
use crate::sources::kv::subscriber::{Subscriber, SubscriberSpec};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::Duration;
use tokio::task::JoinHandle;

/// One rank's KV event subscription.
struct Subscription {
    worker: u64,
    /// The rank's data-parallel rank (the worker's start rank plus its
    /// index), as the snapshot and every per-rank metric name it.
    rank: u32,
    subscriber: Subscriber,
}

/// The tasks and threads running for the workers in the catalog.
pub(crate) struct Lifecycle {
    zmq: zmq::Context,
    replay_timeout: Duration,
    max_replay_bytes: u64,
    limits: SocketLimits,
    /// Where each rank's subscriber counts: a subscriber started again
    /// for the same rank counts on in the same series.
    counters: SubscriberSeries,
    scrapers: Mutex<HashMap<u64, JoinHandle<()>>>,
    /// By slot.
    subscriptions: Mutex<HashMap<u16, Subscription>>,
}

impl Lifecycle {
    pub(crate) fn new(
        replay_timeout: Duration,
        max_replay_bytes: u64,
        limits: SocketLimits,
        counters: SubscriberSeries,
    ) -> Lifecycle {
        Lifecycle {
            zmq: zmq::Context::new(),
            replay_timeout,
            max_replay_bytes,
            limits,
            counters,
            scrapers: Mutex::new(HashMap::new()),
            subscriptions: Mutex::new(HashMap::new()),
        }
    }

    /// Takes `scraper` as the worker's scrape task (aborting one already
    /// running) and subscribes each of its ranks (on `slots`) to its KV
    /// events, registering the slots with the index.
    pub(crate) fn start(
        &self,
        spec: &WorkerSpec,
        slots: &[u16],
        scraper: JoinHandle<()>,
        plane: &Plane,
    ) {
        let id = spec.worker_id;
        if let Some(old) = self.scrapers.lock().insert(id, scraper) {
            old.abort();
        }
        if spec.kv_events_endpoints.is_empty() {
            return;
        }
        let mut subs = self.subscriptions.lock();
        for (i, slot) in slots.iter().enumerate() {
            let i = i as u32;
            let r = spec.data_parallel_start_rank + i;
            let Some(endpoint) = spec.events_endpoint(i) else {
                tracing::warn!(worker = id, rank = r, "no KV event endpoint for this rank");
                continue;
            };
            let rank = RankId {
                worker_id: id,
                dp_rank: r,
            };
            plane.add_slot(*slot, &spec.model_name, rank, spec.block_size, 0);
            let sub = Subscriber::spawn(
                self.zmq.clone(),
                SubscriberSpec {
                    slot: *slot,
                    endpoint: endpoint.clone(),
                    replay_endpoint: spec.replay_endpoint_of(i),
                    topic: spec.kv_events_topic.clone().into_bytes(),
                    replay_timeout: self.replay_timeout,
                    max_replay_bytes: self.max_replay_bytes,
                    limits: self.limits,
                },
                plane.sender(),
                self.counters.of(id, r),
            );
            match sub {
                Ok(subscriber) => {
                    tracing::info!(worker = id, rank = r, slot, %endpoint, "subscribed to KV events");
                    subs.insert(
                        *slot,
                        Subscription {
                            worker: id,
                            rank: r,
                            subscriber,
                        },
                    );
                }
                Err(e) => {
                    tracing::error!(worker = id, rank = r, error = %e, "could not start KV event subscriber")
                }
            }
        }
    }

    /// Stops a worker's scraper and subscribers and drops its slots from
    /// the index.
    pub(crate) fn stop(&self, id: u64, plane: &Plane) {
        if let Some(t) = self.scrapers.lock().remove(&id) {
            t.abort();
        }
        let mut subs = self.subscriptions.lock();
        let slots: Vec<u16> = subs
            .iter()
            .filter(|(_, s)| s.worker == id)
            .map(|(slot, _)| *slot)
            .collect();
        for slot in slots {
            if let Some(mut s) = subs.remove(&slot) {
                // Stopping joins the thread (up to one receive timeout);
                // keep that off the async runtime.
                std::thread::spawn(move || s.subscriber.stop());
            }
            plane.remove_slot(slot);
        }
    }

    /// The worker and rank subscribed on `slot`.
    pub(crate) fn owner(&self, slot: u16) -> Option<(u64, u32)> {
        self.subscriptions
            .lock()
            .get(&slot)
            .map(|s| (s.worker, s.rank))
    }

    /// Each subscription's worker, rank and counters.
    #[cfg(test)]
    fn subscriptions(&self) -> Vec<(u64, u32, crate::metrics::SubscriberCounters)> {
        let subs = self.subscriptions.lock();
        let mut all: Vec<_> = subs
            .values()
            .map(|s| (s.worker, s.rank, s.subscriber.counters.clone()))
            .collect();
        all.sort_by_key(|(w, r, _)| (*w, *r));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::sources::kv::plane::PlaneConfig;
    use serde_json::json;
    use tokio::task::AbortHandle;

    fn worker(extra: serde_json::Value) -> WorkerSpec {
        let mut v = json!({"worker_id": 7, "model_name": "m", "endpoint": "127.0.0.1:8000"});
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        let mut spec: WorkerSpec = serde_json::from_value(v).unwrap();
        spec.normalize().unwrap();
        spec
    }

    fn plane() -> Plane {
        Plane::start(PlaneConfig::default(), Box::new(|_| {})).unwrap()
    }

    fn lifecycle() -> Lifecycle {
        let m = Metrics::new().unwrap();
        Lifecycle::new(
            Duration::from_millis(100),
            256 << 20,
            SocketLimits::default(),
            m.kv.subscribers,
        )
    }

    /// A scrape task that runs until aborted.
    fn scraper() -> (JoinHandle<()>, AbortHandle) {
        let t = tokio::spawn(std::future::pending());
        let a = t.abort_handle();
        (t, a)
    }

    async fn ended(task: &AbortHandle) -> bool {
        for _ in 0..100 {
            if task.is_finished() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    fn subscribed(l: &Lifecycle) -> Vec<(u64, u32)> {
        l.subscriptions()
            .into_iter()
            .map(|(w, r, _)| (w, r))
            .collect()
    }

    #[tokio::test]
    async fn each_rank_with_events_is_subscribed_until_the_worker_stops() {
        let (l, p) = (lifecycle(), plane());
        let spec = worker(json!({
            "data_parallel_size": 2,
            "kv_events_endpoints": {"0": "tcp://127.0.0.1:1"},
        }));
        let (task, running) = scraper();
        l.start(&spec, &[4, 5], task, &p);
        assert_eq!((l.owner(4), l.owner(5)), (Some((7, 0)), Some((7, 1))));
        assert_eq!(subscribed(&l), [(7, 0), (7, 1)]);
        assert!(!running.is_finished());

        l.stop(7, &p);
        assert_eq!((l.owner(4), l.owner(5)), (None, None));
        assert!(subscribed(&l).is_empty());
        assert!(ended(&running).await, "the scraper is aborted");
        l.stop(7, &p);
    }

    #[tokio::test]
    async fn ranks_are_named_by_their_data_parallel_rank() {
        let (l, p) = (lifecycle(), plane());
        // The second node of a DP group: ranks 2 and 3.
        let spec = worker(json!({
            "data_parallel_start_rank": 2,
            "data_parallel_size": 2,
            "kv_events_endpoints": {"0": "tcp://127.0.0.1:1"},
        }));
        let (task, _running) = scraper();
        l.start(&spec, &[0, 1], task, &p);
        assert_eq!(subscribed(&l), [(7, 2), (7, 3)]);
        assert_eq!(l.owner(1), Some((7, 3)));
        l.stop(7, &p);
    }

    #[tokio::test]
    async fn a_restart_replaces_the_scraper_and_a_worker_without_events_only_scrapes() {
        let (l, p) = (lifecycle(), plane());
        let spec = worker(json!({}));
        let (first, first_running) = scraper();
        l.start(&spec, &[0], first, &p);
        assert_eq!(l.owner(0), None, "no KV events, no subscriber");
        let (second, second_running) = scraper();
        l.start(&spec, &[0], second, &p);
        assert!(ended(&first_running).await, "the old scraper is aborted");
        assert!(!second_running.is_finished());
        l.stop(7, &p);
        assert!(ended(&second_running).await);
    }

    #[tokio::test]
    async fn stopping_one_worker_leaves_the_others() {
        let (l, p) = (lifecycle(), plane());
        let events = json!({"kv_events_endpoints": {"0": "tcp://127.0.0.1:1"}});
        let a = worker(events.clone());
        let mut b = worker(events);
        b.worker_id = 8;
        let (ta, a_running) = scraper();
        let (tb, b_running) = scraper();
        l.start(&a, &[0], ta, &p);
        l.start(&b, &[1], tb, &p);
        l.stop(8, &p);
        assert_eq!(subscribed(&l), [(7, 0)]);
        assert!(ended(&b_running).await);
        assert!(!a_running.is_finished());
    }

    /// `PATCH /workers` stops a worker's subscribers and starts new ones
    /// for the same ranks: each counter goes on from its old count.
    #[tokio::test]
    async fn every_subscriber_counter_keeps_its_count_across_a_restart() {
        let m = Metrics::new().unwrap();
        let l = Lifecycle::new(
            Duration::from_millis(100),
            256 << 20,
            SocketLimits::default(),
            m.kv.subscribers.clone(),
        );
        let p = plane();
        let spec = worker(json!({"kv_events_endpoints": {"0": "tcp://127.0.0.1:1"}}));
        let mut names = Vec::new();
        for round in [10, 20] {
            let (task, _running) = scraper();
            l.start(&spec, &[0], task, &p);
            let subs = l.subscriptions();
            let [(7, 0, counters)] = subs.as_slice() else {
                panic!(
                    "one subscription for worker 7, rank 0: {:?}",
                    subscribed(&l)
                );
            };
            names.clear();
            for (i, (name, c)) in counters.each().into_iter().enumerate() {
                c.inc_by(round + i as u64);
                names.push(name);
            }
            l.stop(7, &p);
        }
        let rank = [("worker_id", "7"), ("dp_rank", "0")];
        for (i, name) in names.into_iter().enumerate() {
            let both_rounds = (10 + i) + (20 + i);
            assert_eq!(m.sample(name, &rank), Some(both_rounds as f64), "{name}");
        }
    }
}
