//! Worker health: scrape results, and the rule that marks a worker down
//! when its scrapes stop succeeding.

use super::Fleet;
use crate::sources::metrics::promtext::RankMetrics;
use std::time::{Duration, Instant};

/// A worker's scrape record.
#[derive(Debug, Clone)]
pub struct Health {
    pub up: bool,
    pub last_ok: Option<Instant>,
    pub added: Instant,
    pub last_error: Option<String>,
    pub scrapes: u64,
    pub scrape_errors: u64,
}

impl Fleet {
    /// Records a scrape. Returns whether the worker's up state changed.
    pub fn record_scrape(
        &mut self,
        id: u64,
        result: Result<Vec<RankMetrics>, String>,
        now: Instant,
    ) -> bool {
        let Some(w) = self.workers.get_mut(&id) else {
            return false;
        };
        let was_up = w.health.up;
        w.health.scrapes += 1;
        match result {
            Ok(ranks) => {
                w.ranks = ranks;
                w.health.up = true;
                w.health.last_ok = Some(now);
                w.health.last_error = None;
            }
            Err(e) => {
                w.health.scrape_errors += 1;
                w.health.last_error = Some(e);
            }
        }
        was_up != w.health.up
    }

    /// Marks down every worker without a good scrape for `down_after`.
    pub fn expire(&mut self, now: Instant, down_after: Duration) -> Vec<u64> {
        let mut downed = Vec::new();
        for (id, w) in &mut self.workers {
            let since = w.health.last_ok.unwrap_or(w.health.added);
            if w.health.up && now.saturating_duration_since(since) > down_after {
                w.health.up = false;
                downed.push(*id);
            }
        }
        downed
    }

    pub fn up_count(&self) -> usize {
        self.workers.values().filter(|w| w.health.up).count()
    }
}
