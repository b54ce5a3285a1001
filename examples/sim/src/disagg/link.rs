//! The KV link of a worker whose blocks are pulled: one `--kv-transfer-gbps`
//! pipe that every pull from this worker's ranks goes through at once. A
//! holder's NIC is what a burst of decode workers contends for, so `n`
//! pulls in flight each move at bandwidth / `n` (processor sharing), and a
//! pull's time depends on who else is pulling, not only on its own size.
//!
//! The sharing is a fluid model kept exact at every arrival and departure,
//! whenever those are noticed: a waiter woken late (a loaded machine, the
//! timer's millisecond grain) replays the departures it missed at the
//! instants they happened, so lateness never skews the others' shares.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// A transfer this close to its end counts as through: float rounding
/// must not leave a waiter sleeping for a nanosecond, over and over.
const SLACK_S: f64 = 1e-6;

pub struct Link {
    /// Bytes a second of simulated time, after `--speedup`; `None` when
    /// transfers take no time (`--instant`, or no bandwidth given).
    rate: Option<f64>,
    state: Mutex<State>,
    /// Each arrival and departure changes every other pull's share.
    changed: Notify,
    bytes: AtomicU64,
    max_concurrent: AtomicUsize,
}

struct State {
    /// Until when `active`'s remaining bytes are accounted.
    at: Instant,
    active: Vec<Active>,
    next_id: u64,
}

struct Active {
    id: u64,
    left: f64,
}

impl State {
    /// Runs the fluid model up to `now`; whether a transfer ended.
    fn advance(&mut self, rate: f64, now: Instant) -> bool {
        let mut ended = false;
        while !self.active.is_empty() {
            let share = rate / self.active.len() as f64;
            let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
            let first = self
                .active
                .iter()
                .map(|a| a.left)
                .fold(f64::INFINITY, f64::min);
            let until_first = first / share;
            if until_first > elapsed + SLACK_S {
                let drained = share * elapsed;
                for a in &mut self.active {
                    a.left -= drained;
                }
                break;
            }
            // Up to the first departure at the old share; the rest of the
            // interval is split among fewer.
            for a in &mut self.active {
                a.left -= first;
            }
            self.at +=
                Duration::try_from_secs_f64(until_first.clamp(0.0, elapsed)).unwrap_or_default();
            self.active.retain(|a| a.left > share * SLACK_S);
            ended = true;
        }
        self.at = now;
        ended
    }
}

impl Link {
    /// A link of `gbps` Gbit/s whose times are divided by `speedup`, as
    /// every simulated duration is; instant with `instant` or no positive
    /// bandwidth, as the transfer was before links were shared.
    pub fn new(gbps: f64, speedup: f64, instant: bool) -> Link {
        let rate = gbps * 1e9 / 8.0 * speedup.max(1e-9);
        let timed = !instant && gbps > 0.0 && rate.is_finite() && rate > 0.0;
        Link {
            rate: timed.then_some(rate),
            state: Mutex::new(State {
                at: Instant::now(),
                active: Vec::new(),
                next_id: 0,
            }),
            changed: Notify::new(),
            bytes: AtomicU64::new(0),
            max_concurrent: AtomicUsize::new(0),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes of pulls carried to their end.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The most pulls ever sharing the link at once.
    pub fn max_concurrent(&self) -> usize {
        self.max_concurrent.load(Ordering::Relaxed)
    }

    /// Returns once `bytes` are through, sharing the link fairly with
    /// every other carry in flight. Dropped early, the pull leaves the
    /// link and its share goes to the others.
    pub async fn carry(&self, bytes: u64) {
        let Some(rate) = self.rate.filter(|_| bytes > 0) else {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
            return;
        };
        let id = {
            let mut s = self.state();
            s.advance(rate, Instant::now());
            let id = s.next_id;
            s.next_id += 1;
            s.active.push(Active {
                id,
                left: bytes as f64,
            });
            self.max_concurrent
                .fetch_max(s.active.len(), Ordering::Relaxed);
            id
        };
        self.changed.notify_waiters();
        let _leave = Leave {
            link: self,
            rate,
            id,
        };
        loop {
            // Registered before the state is read, so a change made between
            // the read and the sleep still wakes this pull.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let due = {
                let mut s = self.state();
                if s.advance(rate, Instant::now()) {
                    self.changed.notify_waiters();
                }
                let n = s.active.len() as f64;
                match s.active.iter().find(|a| a.id == id) {
                    None => break,
                    // Its end if nobody comes or goes meanwhile.
                    Some(a) => Duration::try_from_secs_f64(a.left * n / rate)
                        .ok()
                        .and_then(|d| s.at.checked_add(d)),
                }
            };
            match due {
                Some(due) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(due) => {}
                        () = &mut changed => {}
                    }
                }
                None => changed.await,
            }
        }
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Takes a pull off the link however its carry ends.
struct Leave<'a> {
    link: &'a Link,
    rate: f64,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut s = self.link.state();
        let ended = s.advance(self.rate, Instant::now());
        let before = s.active.len();
        s.active.retain(|a| a.id != self.id);
        if ended || s.active.len() != before {
            drop(s);
            self.link.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// 1000 bytes a second: 8 µGbit/s.
    fn link() -> Arc<Link> {
        Arc::new(Link::new(8e-6, 1.0, false))
    }

    /// How long `bytes` take on `link`, counted from `t0`.
    async fn carried(link: &Link, bytes: u64, t0: Instant) -> Duration {
        link.carry(bytes).await;
        t0.elapsed()
    }

    /// Within the timer's millisecond grain (it rounds deadlines up).
    fn near(got: Duration, ms: u64) {
        let want = Duration::from_millis(ms);
        let off = got.abs_diff(want);
        assert!(
            off <= Duration::from_millis(2),
            "took {got:?}, want {want:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_pull_takes_its_bytes_over_the_bandwidth() {
        let l = link();
        near(carried(&l, 1000, Instant::now()).await, 1000);
        near(carried(&l, 250, Instant::now()).await, 250);
        assert_eq!(l.bytes(), 1250);
        assert_eq!(l.max_concurrent(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn two_equal_pulls_started_together_both_take_twice_as_long() {
        let l = link();
        let t0 = Instant::now();
        let (a, b) = tokio::join!(carried(&l, 1000, t0), carried(&l, 1000, t0));
        near(a, 2000);
        near(b, 2000);
        assert_eq!(l.bytes(), 2000);
        assert_eq!(l.max_concurrent(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_pull_joining_a_long_one_shares_until_it_ends() {
        let l = link();
        let t0 = Instant::now();
        let long = tokio::spawn({
            let l = l.clone();
            async move { carried(&l, 1000, t0).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        // 500 bytes of the long one left; from here each gets 500 B/s: the
        // short one's 250 take 0.5 s, then the long one's last 250 go alone.
        let short = carried(&l, 250, t0).await;
        near(short, 1000);
        near(long.await.unwrap(), 1250);
        assert_eq!(l.max_concurrent(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn three_staggered_pulls_are_shared_at_every_arrival_and_departure() {
        let l = link();
        let t0 = Instant::now();
        let spawn = |bytes, after_ms| {
            let l = l.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                carried(&l, bytes, t0).await
            })
        };
        // a: 600 B at 0, b: 600 B at 200 ms, c: 100 B at 400 ms.
        // 0-200: a alone, 200 done. 200-400: halves, a 300 / b 500 left.
        // 400-700: thirds, c done, a 200 / b 400 left. 700-1100: halves,
        // a done, b 200 left. 1100-1300: b alone.
        let (a, b, c) = (spawn(600, 0), spawn(600, 200), spawn(100, 400));
        near(c.await.unwrap(), 700);
        near(a.await.unwrap(), 1100);
        near(b.await.unwrap(), 1300);
        assert_eq!(l.max_concurrent(), 3);
        assert_eq!(l.bytes(), 1300);
    }

    #[test]
    fn a_late_look_replays_the_departures_it_missed() {
        let t0 = Instant::now();
        let mut s = State {
            at: t0,
            active: vec![Active { id: 0, left: 100.0 }, Active { id: 1, left: 300.0 }],
            next_id: 2,
        };
        // At 100 B/s: halves until 0 ends at 2 s, then 1 alone for 1 s.
        // Draining at halves for all 3 s would leave 150.
        assert!(s.advance(100.0, t0 + Duration::from_secs(3)));
        assert_eq!(s.active.len(), 1);
        assert_eq!(s.active[0].id, 1);
        assert!(
            (s.active[0].left - 100.0).abs() < 1e-6,
            "{}",
            s.active[0].left
        );
        assert_eq!(s.at, t0 + Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_pull_gives_its_share_back() {
        let l = link();
        let t0 = Instant::now();
        let gave_up = tokio::time::timeout(Duration::from_millis(500), l.carry(1000));
        let (kept, gave_up) = tokio::join!(carried(&l, 1000, t0), gave_up);
        assert!(gave_up.is_err());
        // 750 left at 0.5 s, then alone.
        near(kept, 1250);
        assert_eq!(l.bytes(), 1000, "only what got through is counted");
    }

    #[tokio::test(start_paused = true)]
    async fn speedup_instant_and_empty_pulls() {
        let fast = Link::new(8e-6, 4.0, false);
        near(carried(&fast, 1000, Instant::now()).await, 250);
        for l in [
            Link::new(8e-6, 1.0, true),
            Link::new(0.0, 1.0, false),
            Link::new(f64::NAN, 1.0, false),
        ] {
            let t0 = Instant::now();
            l.carry(1 << 30).await;
            assert_eq!(t0.elapsed(), Duration::ZERO);
            assert_eq!(l.bytes(), 1 << 30);
        }
        let l = link();
        let t0 = Instant::now();
        tokio::join!(l.carry(0), l.carry(0));
        assert_eq!(t0.elapsed(), Duration::ZERO);
        assert_eq!(l.max_concurrent(), 0, "an empty pull never holds the link");
    }
}
