//! The sidecar's own Prometheus metrics, one module per family. Each
//! family registers its series in one registry; the loops and handlers
//! are handed the family they count into (and, where a source runs per
//! worker or rank, handles already labelled for it), never the whole set.
//!
//! * [`kv`]: the KV event subscribers, the prefix index and its recovery.
//! * [`snapshot`]: scrapes, workers' health and load, what is published.
//! * [`ledger`]: the bookings ledger and replica sync.
//! * [`selection`]: what the gateways routed, refused and taught the
//!   routed-prefix index.
//! * [`latency`]: how long the routed legs took, and their clients' time
//!   to first byte, as the gateways timed them.
//! * [`thermal`]: GPU readings, thermal controllers and batch cuts.
//! * [`planner`]: the replica planner's decisions and estimates.
//! * [`listener`]: connections on the HTTP listeners and the whole-index
//!   reads they serve.

pub mod kv;
pub mod latency;
pub mod ledger;
pub mod listener;
pub mod planner;
pub mod selection;
pub mod snapshot;
pub mod thermal;

use prometheus::core::Collector;
use prometheus::{
    Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry,
};
use thiserror::Error;

pub use kv::{KvMetrics, SubscriberCounters, SubscriberSeries};
pub use latency::LatencyMetrics;
pub use ledger::LedgerMetrics;
pub use listener::{ListenerMetrics, ListenerSeries};
pub use planner::PlannerMetrics;
pub use selection::SelectionMetrics;
pub use snapshot::SnapshotMetrics;
pub use thermal::ThermalMetrics;

/// Every family, registered in one registry that `/metrics` renders.
pub struct Metrics {
    registry: Registry,
    pub kv: KvMetrics,
    pub snapshot: SnapshotMetrics,
    pub ledger: LedgerMetrics,
    pub selection: SelectionMetrics,
    pub latency: LatencyMetrics,
    pub thermal: ThermalMetrics,
    pub planner: PlannerMetrics,
    pub listener: ListenerMetrics,
}

/// A metric that could not be created or registered: a malformed or
/// duplicate name or label, found at start-up.
#[derive(Debug, Error)]
#[error("metric {name}: {source}")]
pub struct MetricsError {
    name: String,
    source: prometheus::Error,
}

impl Metrics {
    /// Creates and registers every metric. Names are constants, so an
    /// error is a programming mistake; it is reported at start-up.
    pub fn new() -> Result<Metrics, MetricsError> {
        let r = Registry::new();
        Ok(Metrics {
            kv: KvMetrics::new(&r)?,
            snapshot: SnapshotMetrics::new(&r)?,
            ledger: LedgerMetrics::new(&r)?,
            selection: SelectionMetrics::new(&r)?,
            latency: LatencyMetrics::new(&r)?,
            thermal: ThermalMetrics::new(&r)?,
            planner: PlannerMetrics::new(&r)?,
            listener: ListenerMetrics::new(&r)?,
            registry: r,
        })
    }

    pub fn render(&self) -> String {
        let enc = prometheus::TextEncoder::new();
        enc.encode_to_string(&self.registry.gather())
            .unwrap_or_default()
    }

    /// The value `/metrics` shows for `name` with exactly `labels`, in any
    /// order; `None` when there is no such series.
    #[cfg(test)]
    pub(crate) fn sample(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        want.sort();
        self.render().lines().find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
            let mut got: Vec<String> = rest
                .strip_suffix('}')?
                .split(',')
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect();
            got.sort();
            (n == name && got == want).then(|| value.parse().ok())?
        })
    }
}

/// The labels of per-worker series.
const WORKER: &[&str] = &["worker_id"];
/// The labels of per-rank series.
const RANK: &[&str] = &["worker_id", "dp_rank"];

fn register<C: Collector + Clone + 'static>(
    r: &Registry,
    name: &str,
    made: prometheus::Result<C>,
) -> Result<C, MetricsError> {
    let fail = |source| MetricsError {
        name: name.to_string(),
        source,
    };
    let c = made.map_err(fail)?;
    r.register(Box::new(c.clone())).map_err(fail)?;
    Ok(c)
}

fn counter(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, MetricsError> {
    register(r, name, IntCounterVec::new(Opts::new(name, help), labels))
}

fn plain_counter(r: &Registry, name: &str, help: &str) -> Result<IntCounter, MetricsError> {
    register(r, name, IntCounter::new(name, help))
}

fn gauge_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, MetricsError> {
    register(r, name, IntGaugeVec::new(Opts::new(name, help), labels))
}

fn gauge(r: &Registry, name: &str, help: &str) -> Result<IntGauge, MetricsError> {
    register(r, name, IntGauge::new(name, help))
}

fn float_gauge_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<GaugeVec, MetricsError> {
    register(r, name, GaugeVec::new(Opts::new(name, help), labels))
}

fn float_gauge(r: &Registry, name: &str, help: &str) -> Result<Gauge, MetricsError> {
    register(r, name, Gauge::new(name, help))
}

fn histogram_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> Result<HistogramVec, MetricsError> {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    register(r, name, HistogramVec::new(opts, labels))
}

/// Mirrors a running total kept elsewhere (the index thread's) into a
/// Prometheus counter: adds what it grew by since the last mirror.
pub(crate) fn mirror_total(c: &IntCounterVec, labels: &[&str], total: u64) {
    let ctr = c.with_label_values(labels);
    let cur = ctr.get();
    if total > cur {
        ctr.inc_by(total - cur);
    }
}

#[cfg(test)]
mod tests;
