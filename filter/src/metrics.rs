//! The filter's metrics. Proxy-wasm metrics carry no labels, so the reason
//! of a local reply is part of the name; Envoy's `/stats/prometheus` drops
//! the `wasmcustom.` prefix, so these appear exactly as named here.

use crate::host::{self, Host};
use crate::reply::Reason;
use kvgate_core::disagg::pull::{Kind, Placed};
use proxy_wasm::types::MetricType;
use std::collections::HashMap;

fn define(kind: MetricType, name: &str) -> Option<u32> {
    host::define_metric(kind as u32, name)
}

pub fn inc(id: Option<u32>) {
    if let Some(id) = id {
        host::increment_metric(id, 1);
    }
}

pub fn record(id: Option<u32>, value: u64) {
    if let Some(id) = id {
        host::record_metric(id, value);
    }
}

#[derive(Debug, Default)]
pub struct RouterMetrics {
    pub requests: Option<u32>,
    pub routed: Option<u32>,
    pub rejected: [Option<u32>; Reason::ALL.len()],
    pub failed_open: Option<u32>,
    pub decision_us: Option<u32>,
    /// The decision's phases, so that a regression shows where: the body
    /// copied out and parsed, a text prompt rendered (`parse_us`); the
    /// prompt's overlap read from the index (`gather_us`, part of
    /// `selection_us`, which adds the placement).
    pub parse_us: Option<u32>,
    pub gather_us: Option<u32>,
    pub selection_us: Option<u32>,
    pub snapshot_decode_errors: Option<u32>,
    pub report_errors: Option<u32>,
    pub booking_errors: Option<u32>,
    /// Requests Envoy retried on the fallback worker.
    pub retried: Option<u32>,
    /// Routed requests no worker answered.
    pub upstream_unavailable: Option<u32>,
    /// Responses cut off by their worker going away mid-stream.
    pub streams_cut: Option<u32>,
    /// Retries admitted on their ticket while every worker was busy.
    pub retry_admitted: Option<u32>,
    /// Text requests of a templated model rendered for the text index.
    pub rendered: Option<u32>,
    /// Those assembled from their conversation shape's skeleton, without
    /// running the template.
    pub assembled: Option<u32>,
    /// Those matched approximately instead: the template is not in shared
    /// data yet, does not compile, or failed on the request.
    pub render_errors: Option<u32>,
    /// Disaggregated requests given a prefill leg on another worker.
    pub prefill_remote: Option<u32>,
    /// Disaggregated requests whose decode worker computes the prompt (the
    /// conditional rule, or no other prefill worker free).
    pub prefill_local: Option<u32>,
    /// Prefill legs tried again on the runner-up after a failure.
    pub prefill_retried: Option<u32>,
    /// Prefill legs that failed on every try (then the decode worker
    /// prefills, or the request is answered 503, as the model says).
    pub prefill_failed: Option<u32>,
    /// Prefill legs a worker refused as the client's error (4xx): its
    /// answer went back to the client, and no decode leg was sent.
    pub prefill_client_errors: Option<u32>,
    /// Prefill legs' time from the callout to its answer (µs).
    pub prefill_us: Option<u32>,
    /// Requests that ended with trailers (HTTP/2), decided at them.
    pub trailers: Option<u32>,
    /// Prefill legs whose client left before the answer: their booking
    /// is kept until the leg's deadline, when Envoy has ended the call.
    pub prefill_orphaned: Option<u32>,
    /// Requests whose time to first token a fit predicted, and the
    /// prediction's absolute error against what the worker took, in
    /// percent of that.
    pub predictions: Option<u32>,
    pub prediction_error_pct: Option<u32>,
    /// Sampled answers' cached prompt tokens: as the index predicted them
    /// for the worker chosen, as the engine reported using them, and the
    /// difference in percent of the prompt.
    pub cached_predicted: Option<u32>,
    pub cached_reported: Option<u32>,
    pub cached_error_pct: Option<u32>,
    /// Requests of models that pull, by where they were placed
    /// ([`kvgate_core::disagg::pull::Kind`]), and the blocks pulls moved
    /// and recomputes computed again.
    pub placed: [Option<u32>; Kind::ALL.len()],
    pub pull_blocks: Option<u32>,
    pub recompute_blocks: Option<u32>,
    /// Admission's metrics per model and class, defined when first used.
    admission: HashMap<String, Option<u32>>,
}

/// What became of a request admission looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Held for a worker.
    Held,
    /// Sent to a worker after being held.
    Sent,
    /// Answered at its deadline.
    Expired,
    /// Shed: at once (a class never held, a full queue) or displaced.
    Shed,
    /// Shed at once because the client asked not to be held.
    DoNotQueue,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Held => "held",
            Outcome::Sent => "sent",
            Outcome::Expired => "expired",
            Outcome::Shed => "shed",
            Outcome::DoNotQueue => "do_not_queue",
        }
    }
}

impl RouterMetrics {
    pub fn define(h: &impl Host) -> RouterMetrics {
        let define = |kind: MetricType, name: &str| h.define_metric(kind as u32, name);
        let mut rejected = [None; Reason::ALL.len()];
        for r in Reason::ALL {
            rejected[r.index()] = define(
                MetricType::Counter,
                &format!("kvgate_rejected_{}_total", r.as_str()),
            );
        }
        let placed = Kind::ALL.map(|k| {
            define(
                MetricType::Counter,
                &format!("kvgate_placed_{}_total", k.as_str()),
            )
        });
        RouterMetrics {
            placed,
            pull_blocks: define(MetricType::Counter, "kvgate_pull_blocks_moved_total"),
            recompute_blocks: define(MetricType::Counter, "kvgate_recompute_blocks_total"),
            requests: define(MetricType::Counter, "kvgate_requests_total"),
            routed: define(MetricType::Counter, "kvgate_routed_total"),
            rejected,
            failed_open: define(MetricType::Counter, "kvgate_failed_open_total"),
            decision_us: define(MetricType::Histogram, "kvgate_decision_us"),
            parse_us: define(MetricType::Histogram, "kvgate_parse_us"),
            gather_us: define(MetricType::Histogram, "kvgate_gather_us"),
            selection_us: define(MetricType::Histogram, "kvgate_selection_us"),
            snapshot_decode_errors: define(
                MetricType::Counter,
                "kvgate_snapshot_decode_errors_total",
            ),
            report_errors: define(MetricType::Counter, "kvgate_routed_report_errors_total"),
            booking_errors: define(MetricType::Counter, "kvgate_booking_enqueue_errors_total"),
            retried: define(MetricType::Counter, "kvgate_retried_on_fallback_total"),
            upstream_unavailable: define(MetricType::Counter, "kvgate_upstream_unavailable_total"),
            streams_cut: define(MetricType::Counter, "kvgate_streams_cut_total"),
            retry_admitted: define(MetricType::Counter, "kvgate_retry_admitted_total"),
            rendered: define(MetricType::Counter, "kvgate_prompts_rendered_total"),
            assembled: define(MetricType::Counter, "kvgate_prompts_assembled_total"),
            render_errors: define(MetricType::Counter, "kvgate_prompt_render_errors_total"),
            prefill_remote: define(MetricType::Counter, "kvgate_prefill_remote_total"),
            prefill_local: define(MetricType::Counter, "kvgate_prefill_local_total"),
            prefill_retried: define(MetricType::Counter, "kvgate_prefill_retried_total"),
            prefill_failed: define(MetricType::Counter, "kvgate_prefill_failed_total"),
            prefill_client_errors: define(
                MetricType::Counter,
                "kvgate_prefill_client_errors_total",
            ),
            prefill_us: define(MetricType::Histogram, "kvgate_prefill_us"),
            trailers: define(MetricType::Counter, "kvgate_requests_with_trailers_total"),
            prefill_orphaned: define(MetricType::Counter, "kvgate_prefill_orphaned_total"),
            predictions: define(MetricType::Counter, "kvgate_ttft_predictions_total"),
            prediction_error_pct: define(MetricType::Histogram, "kvgate_ttft_prediction_error_pct"),
            cached_predicted: define(MetricType::Counter, "kvgate_cached_tokens_predicted_total"),
            cached_reported: define(MetricType::Counter, "kvgate_cached_tokens_reported_total"),
            cached_error_pct: define(MetricType::Histogram, "kvgate_cached_tokens_error_pct"),
            admission: HashMap::new(),
        }
    }

    /// A sampled answer's cached tokens, where the engine reported them.
    pub fn cached(&self, h: &impl Host, u: &crate::router::Usage) {
        let Some(reported) = u.reported else {
            return;
        };
        h.add(
            self.cached_predicted,
            i64::try_from(u.predicted).unwrap_or(i64::MAX),
        );
        h.add(
            self.cached_reported,
            i64::try_from(reported).unwrap_or(i64::MAX),
        );
        if let Some(pct) = u
            .predicted
            .abs_diff(reported)
            .saturating_mul(100)
            .checked_div(u.isl_tokens)
        {
            h.sample(self.cached_error_pct, pct);
        }
    }

    /// Where a request of a model that pulls was placed.
    pub fn placed(&self, h: &impl Host, p: &Placed) {
        let i = Kind::ALL.iter().position(|k| *k == p.kind).unwrap_or(0);
        h.count(self.placed[i]);
        let blocks = i64::try_from(p.blocks).unwrap_or(i64::MAX);
        match p.kind {
            Kind::Pull => h.add(self.pull_blocks, blocks),
            Kind::Recompute => h.add(self.recompute_blocks, blocks),
            Kind::Holder => {}
        }
    }

    /// A predicted time to first token against the one observed (ms).
    pub fn predicted(&self, h: &impl Host, predicted_ms: f64, observed_ms: f64) {
        h.count(self.predictions);
        if observed_ms > 0.0 {
            let pct = ((predicted_ms - observed_ms).abs() / observed_ms * 100.0).min(1e6);
            h.sample(self.prediction_error_pct, pct.round() as u64);
        }
    }

    /// A metric of admission's for `model` and `class`: its name carries
    /// both as `.model.<m>.class.<c>`, which the Envoy template's
    /// `stats_tags` turn into labels (proxy-wasm metrics have none).
    fn admission_metric(
        &mut self,
        h: &impl Host,
        kind: MetricType,
        family: &str,
        model: &str,
        class: &str,
    ) -> Option<u32> {
        let name = format!("{family}.model.{model}.class.{class}");
        if let Some(id) = self.admission.get(&name) {
            return *id;
        }
        let id = h.define_metric(kind as u32, &name);
        self.admission.insert(name, id);
        id
    }

    /// Counts an admission outcome; a held request's depth moves with it.
    pub fn admitted(&mut self, h: &impl Host, model: &str, class: &str, o: Outcome) {
        let family = format!("kvgate_admission_{}_total", o.as_str());
        let id = self.admission_metric(h, MetricType::Counter, &family, model, class);
        h.count(id);
        let depth =
            self.admission_metric(h, MetricType::Gauge, "kvgate_admission_held", model, class);
        match o {
            Outcome::Held => h.add(depth, 1),
            Outcome::Sent | Outcome::Expired => h.add(depth, -1),
            Outcome::Shed | Outcome::DoNotQueue => {}
        }
    }

    /// A held request left the queue without being sent or expiring
    /// (displaced, or its client left): its depth goes.
    pub fn unheld(&mut self, h: &impl Host, model: &str, class: &str) {
        let depth =
            self.admission_metric(h, MetricType::Gauge, "kvgate_admission_held", model, class);
        h.add(depth, -1);
    }

    /// How long a request was held (ms), whatever became of it.
    pub fn waited(&mut self, h: &impl Host, model: &str, class: &str, ms: u64) {
        let id = self.admission_metric(
            h,
            MetricType::Histogram,
            "kvgate_admission_wait_ms",
            model,
            class,
        );
        h.sample(id, ms);
    }

    pub fn rejected(&self, h: &impl Host, r: Reason) {
        h.count(self.rejected.get(r.index()).copied().flatten());
    }
}

/// Times a router root took the poller lease (lease mode).
pub fn lease_takeovers() -> Option<u32> {
    define(MetricType::Counter, "kvgate_lease_takeovers_total")
}

#[derive(Debug, Default)]
pub struct ServiceMetrics {
    pub polls: Option<u32>,
    pub poll_errors: Option<u32>,
    pub decode_errors: Option<u32>,
    pub snapshot_version: Option<u32>,
    pub reports: Option<u32>,
    pub report_errors: Option<u32>,
    pub booking_batches: Option<u32>,
    pub booking_batch_errors: Option<u32>,
}

impl ServiceMetrics {
    pub fn define() -> ServiceMetrics {
        ServiceMetrics {
            polls: define(MetricType::Counter, "kvgate_snapshot_polls_total"),
            poll_errors: define(MetricType::Counter, "kvgate_snapshot_poll_errors_total"),
            decode_errors: define(MetricType::Counter, "kvgate_snapshot_decode_errors_total"),
            snapshot_version: define(MetricType::Gauge, "kvgate_snapshot_version"),
            reports: define(MetricType::Counter, "kvgate_routed_reports_total"),
            report_errors: define(MetricType::Counter, "kvgate_routed_report_errors_total"),
            booking_batches: define(MetricType::Counter, "kvgate_booking_batches_total"),
            booking_batch_errors: define(MetricType::Counter, "kvgate_booking_batch_errors_total"),
        }
    }
}
