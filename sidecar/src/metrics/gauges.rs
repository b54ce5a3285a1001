//! Gauges and counters that mirror state kept elsewhere: the fleet, the
//! bookings, the snapshot, the KV subscribers and the index thread.

use super::Metrics;
use crate::fleet::Fleet;
use crate::lifecycle::Lifecycle;
use crate::sources::bookings::Bookings;
use crate::sources::kv::plane::{BlockSizeMismatch, PlaneStats};
use kvgate_core::Snapshot;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Sets the per-model, per-worker and per-rank gauges from one publish
/// tick's fleet, bookings and snapshot.
pub(crate) fn refresh(m: &Metrics, f: &Fleet, b: &Bookings, snap: &Snapshot) {
    let mut per_model: HashMap<&str, i64> = f.models.keys().map(|k| (k.as_str(), 0)).collect();
    let mut booked: HashMap<&str, i64> = f.models.keys().map(|k| (k.as_str(), 0)).collect();
    for model in &snap.models {
        m.retry_after
            .with_label_values(&[model.name.as_str()])
            .set(i64::from(model.retry_after_s));
        for w in &model.workers {
            let ids = w.id.to_string();
            for r in &w.ranks {
                let rs = r.rank.to_string();
                let l = [ids.as_str(), rs.as_str()];
                m.rank_active_prefill
                    .with_label_values(&l)
                    .set(r.active_prefill_tokens as i64);
                m.rank_active_decode
                    .with_label_values(&l)
                    .set(r.active_decode_blocks as i64);
                m.rank_busy.with_label_values(&l).set(i64::from(r.busy));
            }
        }
    }
    for w in f.workers.values() {
        let n: u64 = w.slots.iter().map(|s| b.slot(*s).requests).sum();
        *booked.entry(w.spec.model_name.as_str()).or_default() += n as i64;
    }
    for (model, n) in booked {
        m.bookings_active.with_label_values(&[model]).set(n);
    }
    let (gateway, reserved, peers) = b.census();
    for (kind, n) in [
        ("gateway", gateway),
        ("reservation", reserved),
        ("peer", peers),
    ] {
        m.ledger_holders.with_label_values(&[kind]).set(n as i64);
    }
    for (id, w) in &f.workers {
        let ids = id.to_string();
        m.worker_up
            .with_label_values(&[w.spec.model_name.as_str(), &ids])
            .set(i64::from(w.health.up));
        if w.health.up {
            *per_model.entry(w.spec.model_name.as_str()).or_default() += 1;
        }
        for (r, rm) in w.ranks.iter().enumerate() {
            let rs = (w.spec.data_parallel_start_rank + r as u32).to_string();
            let l = [ids.as_str(), rs.as_str()];
            m.rank_running
                .with_label_values(&l)
                .set(i64::from(rm.running));
            m.rank_waiting
                .with_label_values(&l)
                .set(i64::from(rm.waiting));
            m.rank_kv_used
                .with_label_values(&l)
                .set(rm.kv_used_blocks() as i64);
            m.rank_kv_total
                .with_label_values(&l)
                .set(rm.kv_total_blocks as i64);
        }
    }
    for (model, n) in per_model {
        m.workers_up.with_label_values(&[model]).set(n);
    }
}

/// Subscriber counters are atomics owned by their threads; mirrors them.
pub(crate) fn mirror_subscribers(m: &Metrics, workers: &Lifecycle) {
    workers.for_each_subscription(|worker, rank, st| {
        let (ws, rs) = (worker.to_string(), rank.to_string());
        let l = [ws.as_str(), rs.as_str()];
        set_counter(&m.kv_batches, &l, st.batches.load(Ordering::Relaxed));
        set_counter(
            &m.kv_malformed_frames,
            &l,
            st.malformed_frames.load(Ordering::Relaxed),
        );
        set_counter(&m.kv_gaps, &l, st.gaps.load(Ordering::Relaxed));
        set_counter(&m.kv_resyncs, &l, st.resyncs.load(Ordering::Relaxed));
        set_counter(
            &m.kv_replayed,
            &l,
            st.replayed_batches.load(Ordering::Relaxed),
        );
        set_counter(
            &m.kv_disconnects,
            &l,
            st.disconnects.load(Ordering::Relaxed),
        );
    });
}

/// Mirrors the index thread's statistics. Returns each rank, as (worker,
/// rank), whose KV events carry another block size than its worker's.
pub(crate) fn mirror_index(
    m: &Metrics,
    stats: &PlaneStats,
    workers: &Lifecycle,
) -> Vec<(u64, u32, BlockSizeMismatch)> {
    for (model, _, blocks) in &stats.per_model {
        m.kv_indexed_blocks
            .with_label_values(&[model])
            .set(*blocks as i64);
    }
    for (model, keys, t) in &stats.text {
        m.text_keys.with_label_values(&[model]).set(*keys as i64);
        for (why, n) in [("orphan", t.orphans), ("undecodable", t.undecodable)] {
            set_counter(&m.text_skipped_blocks, &[model.as_str(), why], n);
        }
    }
    m.kv_malformed_batches.set(stats.malformed_batches as i64);
    for (slot, why, n) in &stats.unmatchable {
        if let Some((worker, rank)) = workers.owner(*slot) {
            let (w, r) = (worker.to_string(), rank.to_string());
            set_counter(
                &m.kv_unmatchable_blocks,
                &[w.as_str(), r.as_str(), why.as_str()],
                *n,
            );
        }
    }
    for (slot, lag) in &stats.event_lag {
        if let Some((worker, rank)) = workers.owner(*slot) {
            let (w, r) = (worker.to_string(), rank.to_string());
            m.kv_event_lag
                .with_label_values(&[w.as_str(), r.as_str()])
                .set(*lag);
        }
    }
    let mut mismatched = Vec::new();
    for (slot, mm) in &stats.block_size_mismatch {
        let Some((worker, rank)) = workers.owner(*slot) else {
            continue;
        };
        let (w, r) = (worker.to_string(), rank.to_string());
        set_counter(
            &m.kv_block_size_mismatch,
            &[w.as_str(), r.as_str()],
            mm.events,
        );
        mismatched.push((worker, rank, *mm));
    }
    mismatched
}

/// Mirrors a monotonically increasing count into a Prometheus counter.
fn set_counter(c: &prometheus::IntCounterVec, labels: &[&str], value: u64) {
    let ctr = c.with_label_values(labels);
    let cur = ctr.get();
    if value > cur {
        ctr.inc_by(value - cur);
    }
}

/// The planner's gauges after a tick.
pub(crate) fn planner(m: &Metrics, f: &Fleet, planned: &[crate::fleet::Planned]) {
    for p in planned {
        let model = p.model.as_str();
        let t = &p.tick;
        m.planner_desired
            .with_label_values(&[model])
            .set(i64::from(t.desired));
        m.planner_ready
            .with_label_values(&[model])
            .set(i64::from(p.ready));
        m.planner_lower_bound
            .with_label_values(&[model])
            .set(i64::from(t.lower_bound));
        let worst = |f: fn(&crate::planner::Estimate) -> Option<f64>| {
            t.estimates.iter().filter_map(f).fold(f64::NAN, f64::max)
        };
        m.planner_ttft
            .with_label_values(&[model])
            .set(worst(|e| e.ttft_ms));
        m.planner_itl
            .with_label_values(&[model])
            .set(worst(|e| e.itl_ms));
        for r in crate::planner::Reason::ALL {
            m.planner_reason
                .with_label_values(&[model, r.as_str()])
                .set(i64::from(r == t.reason));
        }
        if let Some(d) = &p.decision {
            let dir = if d.desired > d.ready { "up" } else { "down" };
            m.planner_decisions.with_label_values(&[model, dir]).inc();
        }
        if let Some([n, isl, osl]) = f.planning.models.get(model).and_then(|x| x.predicted) {
            for (q, v) in [("requests", n), ("isl", isl), ("osl", osl)] {
                m.planner_predicted.with_label_values(&[model, q]).set(v);
            }
        }
        let draining = f
            .planning
            .draining
            .iter()
            .filter(|id| {
                f.workers
                    .get(id)
                    .is_some_and(|w| w.spec.model_name == model)
            })
            .count();
        m.planner_draining
            .with_label_values(&[model])
            .set(draining as i64);
    }
}
