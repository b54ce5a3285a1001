//! The search for the highest rate that passes: double from a low start
//! until a rate fails (or the cap passes), then bisect between the last
//! pass and the first fail a fixed number of times. A start that fails is
//! halved a few times before the point is given up.
//!
//! It is a state machine, told each verdict, so that the sweep runs the
//! steps and the tests can drive it with a pure function. The number of
//! steps is bounded ([`RateSearch::max_steps`]): a sweep's time is too.

#[derive(Debug, Clone)]
pub struct RateSearch {
    max: f64,
    next: Option<f64>,
    /// The highest rate that passed.
    pass: Option<f64>,
    /// The lowest rate that failed.
    fail: Option<f64>,
    halvings_left: u32,
    bisects_left: u32,
}

impl RateSearch {
    /// Starts at `start` (at most `max`); a failing start is halved up to
    /// `halvings` times; once a pass and a fail bracket the answer,
    /// `bisects` midpoints are tried.
    pub fn new(start: f64, max: f64, halvings: u32, bisects: u32) -> RateSearch {
        RateSearch {
            max,
            next: Some(start.min(max)),
            pass: None,
            fail: None,
            halvings_left: halvings,
            bisects_left: bisects,
        }
    }

    /// The rate to try next; `None` once the search is over.
    pub fn next_rate(&self) -> Option<f64> {
        self.next
    }

    /// Takes the verdict on `rate` and chooses the next one.
    pub fn record(&mut self, rate: f64, passed: bool) {
        if passed {
            self.pass = Some(self.pass.map_or(rate, |p| p.max(rate)));
        } else {
            self.fail = Some(self.fail.map_or(rate, |f| f.min(rate)));
        }
        self.next = match (self.pass, self.fail) {
            (Some(p), None) if p >= self.max => None,
            (Some(p), None) => Some((p * 2.0).min(self.max)),
            (None, Some(f)) if self.halvings_left > 0 => {
                self.halvings_left -= 1;
                Some(f / 2.0)
            }
            // A pass above a fail is noise the bisection cannot narrow:
            // the pass stands, as measured.
            (Some(p), Some(f)) if self.bisects_left > 0 && p < f => {
                self.bisects_left -= 1;
                Some((p + f) / 2.0)
            }
            _ => None,
        };
    }

    /// The highest rate that passed.
    pub fn best(&self) -> Option<f64> {
        self.pass
    }

    /// Whether the best rate is the cap itself: the worker may serve more.
    pub fn capped(&self) -> bool {
        self.fail.is_none() && self.pass.is_some_and(|p| p >= self.max)
    }

    /// The most steps a search from `start` to `max` takes: the first,
    /// then the doublings to the cap or the halvings (whichever could be
    /// more; a search does one or the other), then the bisections.
    pub fn max_steps(start: f64, max: f64, halvings: u32, bisects: u32) -> u32 {
        let doublings = if start > 0.0 && start < max {
            (max / start).log2().ceil().clamp(0.0, 64.0) as u32
        } else {
            0
        };
        1 + doublings.max(halvings) + bisects
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a search against "passes at or below `limit`"; the best rate
    /// and the steps taken.
    fn search(start: f64, max: f64, limit: f64) -> (Option<f64>, u32, bool) {
        let mut s = RateSearch::new(start, max, 2, 3);
        let mut steps = 0;
        while let Some(rate) = s.next_rate() {
            steps += 1;
            assert!(steps <= 100, "the search never ends");
            s.record(rate, rate <= limit);
        }
        (s.best(), steps, s.capped())
    }

    #[test]
    fn it_converges_below_the_limit_within_an_eighth_of_the_bracket() {
        for limit in [0.7, 1.0, 3.3, 10.3, 17.0, 40.0, 63.9] {
            let (best, steps, capped) = search(1.0, 64.0, limit);
            let best = best.unwrap_or_else(|| panic!("limit {limit}: no rate passed"));
            assert!(best <= limit, "limit {limit}: {best} passed above it");
            // The bracket after doubling is [b, 2b] with b <= limit: three
            // bisections leave at most b/8 of it, so at least 7/8 of the
            // limit is found (or of half the start, after halvings).
            assert!(best >= limit * 7.0 / 8.0 - 1e-9, "limit {limit}: {best}");
            assert!(!capped);
            assert!(steps <= RateSearch::max_steps(1.0, 64.0, 2, 3), "{steps}");
        }
    }

    #[test]
    fn a_worker_that_keeps_up_at_the_cap_stops_there() {
        let (best, steps, capped) = search(1.0, 64.0, 1000.0);
        assert_eq!(best, Some(64.0));
        assert!(capped);
        assert_eq!(steps, 7, "1, 2, 4, ..., 64");
        assert_eq!(steps, RateSearch::max_steps(1.0, 64.0, 2, 3) - 3);
        // A start above the cap is the cap.
        assert_eq!(search(100.0, 64.0, 1000.0), (Some(64.0), 1, true));
    }

    #[test]
    fn a_worker_that_never_passes_gives_nothing_after_the_halvings() {
        let (best, steps, _) = search(4.0, 64.0, 0.1);
        assert_eq!(best, None);
        assert_eq!(steps, 3, "4, 2, 1");
    }

    #[test]
    fn a_failing_start_is_halved_then_bisected() {
        let mut s = RateSearch::new(8.0, 64.0, 2, 2);
        let mut tried = Vec::new();
        while let Some(rate) = s.next_rate() {
            tried.push(rate);
            s.record(rate, rate <= 5.0);
        }
        assert_eq!(tried, [8.0, 4.0, 6.0, 5.0]);
        assert_eq!(s.best(), Some(5.0));
    }

    #[test]
    fn the_step_bound_counts_doublings_or_halvings_and_bisections() {
        assert_eq!(RateSearch::max_steps(1.0, 64.0, 2, 3), 1 + 6 + 3);
        assert_eq!(RateSearch::max_steps(48.0, 64.0, 2, 3), 1 + 2 + 3);
        assert_eq!(RateSearch::max_steps(64.0, 64.0, 2, 0), 1 + 2);
    }
}
