//! What the sources report, applied to the sidecar's state: bookings,
//! routing decisions and scrape results.

use crate::Sidecar;
use crate::sources::bookings::Effect;
use crate::sources::metrics::promtext::RankMetrics;
use std::collections::HashMap;
use std::time::Instant;

impl Sidecar {
    /// Applies a batch of gateway events (bookings, releases, rejections).
    pub(crate) fn book(&self, events: Vec<kvgate_core::booking::Event>) {
        // slot -> (model, worker id), for validation and routed-by-worker.
        let owners: HashMap<u16, (String, u64)> = {
            let f = self.fleet();
            f.workers
                .values()
                .flat_map(|w| {
                    w.slots
                        .iter()
                        .map(|s| (*s, (w.spec.model_name.clone(), w.spec.worker_id)))
                })
                .collect()
        };
        let now = Instant::now();
        let metrics = self.metrics();
        let mut b = self.bookings();
        for ev in events {
            let effect = b.apply(ev, now, |model, slot| {
                owners.get(&slot).is_some_and(|(m, _)| m == model)
            });
            match effect {
                Effect::Booked { model, slot } => {
                    if let Some((_, worker)) = owners.get(&slot) {
                        metrics
                            .routed
                            .with_label_values(&[model.as_str(), &worker.to_string()])
                            .inc();
                    }
                }
                Effect::Rejected { model, reason } => {
                    // Requests refused before their body named a model.
                    let model = if model.is_empty() {
                        "-"
                    } else {
                        model.as_str()
                    };
                    metrics
                        .rejected
                        .with_label_values(&[model, reason.as_str()])
                        .inc();
                }
                Effect::Refused => {
                    tracing::debug!("booking for a rank that is gone: ignored");
                }
                Effect::Released | Effect::Unknown => {}
            }
        }
    }

    /// Learns routing decisions the filter reported, keeping only those
    /// naming a configured model and one of its slots. Returns how many
    /// were kept.
    pub(crate) fn learn(&self, records: &[kvgate_core::approx::Routed]) -> usize {
        let valid: Vec<&kvgate_core::approx::Routed> = {
            let f = self.fleet();
            records
                .iter()
                .filter(|r| {
                    f.workers
                        .values()
                        .any(|w| w.spec.model_name == r.model && w.slots.contains(&r.slot))
                })
                .collect()
        };
        let now = Instant::now();
        let mut a = self.routed();
        let before = a.learned;
        for r in &valid {
            a.learn(r, now);
        }
        self.metrics()
            .approx_learned
            .inc_by(a.learned.saturating_sub(before));
        valid.len()
    }

    /// Records a scrape; a worker that went up or down is published
    /// without waiting for the next tick.
    pub(crate) fn scraped(&self, id: u64, result: Result<Vec<RankMetrics>, String>) {
        let ids = id.to_string();
        self.metrics().scrapes.with_label_values(&[&ids]).inc();
        if let Err(e) = &result {
            self.metrics()
                .scrape_errors
                .with_label_values(&[&ids])
                .inc();
            tracing::debug!(worker = id, error = %e, "scrape failed");
        }
        let changed = self.fleet().record_scrape(id, result, Instant::now());
        if changed {
            self.publish_now();
        }
    }
}
