//! Plugin configuration: the JSON Envoy hands both roots.
//!
//! Every key is optional and unknown keys are refused, so a typo fails the
//! plugin load with a log line instead of silently changing behaviour.

use crate::admission::Admission;
use kvgate_core::header;
use serde::{Deserialize, Deserializer};
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStale {
    /// Let Envoy's own load balancing route the request.
    FailOpen,
    /// Answer 503 without contacting a worker.
    FailClosed,
}

/// Who polls the sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PollerMode {
    /// The bootstrap `WasmService` root (`kvgate_snapshot_service`).
    Singleton,
    /// One of the router roots, by a lease in shared data
    /// ([`crate::lease`]): for hosts that load HTTP filters only.
    Lease,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub sidecar_cluster: String,
    pub sidecar_authority: String,
    /// The sidecar's control token: bookings and routing reports are
    /// writes, so they carry it when the sidecar requires one.
    pub sidecar_token: Option<String>,
    #[serde(rename = "poll_wait_ms", deserialize_with = "millis")]
    pub poll_wait: Duration,
    #[serde(rename = "poll_backoff_ms", deserialize_with = "millis")]
    pub poll_backoff: Duration,
    #[serde(rename = "tick_ms", deserialize_with = "millis")]
    pub tick: Duration,
    /// How long a router VM holds its bookings and routing reports before
    /// handing them to the snapshot service in one queue item; 0 hands
    /// each over as it happens. Other gateways see a booking that much
    /// later; this VM's own view counts it at once.
    #[serde(rename = "flush_ms", deserialize_with = "millis")]
    pub flush: Duration,
    pub destination_header: String,
    pub rank_header: String,
    pub fallback_header: String,
    /// Names the request's tenant (absent: `default`). Set it in Envoy from
    /// what authenticated the client; kvgate trusts it as given.
    pub tenant_header: String,
    /// Response header naming the worker and DP rank that served a routed
    /// request (engines return none); empty: not sent.
    pub served_by_header: String,
    /// Response header giving the time to first token the worker's fit
    /// predicted (ms), where one did; empty (the default): not sent.
    pub predicted_ttft_header: String,
    pub max_body_bytes: usize,
    /// The cluster a disaggregated request's prefill leg is sent to: the
    /// worker catalog, with the host taken from `prefill_host_header` and
    /// no fallback (see `envoy/envoy.yaml`).
    pub prefill_cluster: String,
    pub prefill_host_header: String,
    #[serde(rename = "stale_after_ms", deserialize_with = "millis")]
    pub stale_after: Duration,
    pub on_stale: OnStale,
    pub retry_after_s: u32,
    /// How far over the busy thresholds a retry holding its ticket may
    /// load a rank, in percent of each threshold; 0 turns retry admission
    /// off (see `kvgate_core::plan::retry`).
    pub retry_headroom_pct: u32,
    /// The longest `Retry-After` a shed request is given.
    pub max_retry_after_s: u32,
    /// Times the decision's phases on one request in this many (1: every
    /// request; 0: none). The decision itself is timed on every request.
    pub phase_timing_every: u64,
    /// Reads the answer of one routed request in this many for the cached
    /// prompt tokens the engine reports using (`usage.prompt_tokens_details
    /// .cached_tokens`), against those the index predicted; 0: none.
    pub cached_tokens_every: u64,
    pub poller: PollerMode,
    /// How long a lease holder that stops renewing keeps the lease;
    /// absent: [`Config::lease_term`] derives it from `stale_after_ms`.
    #[serde(rename = "lease_ms", deserialize_with = "millis_opt")]
    pub lease: Option<Duration>,
    /// Failover drills only: the lease holder stops its lease work this
    /// long after taking the lease, as a stuck holder would (it still
    /// serves requests and flushes their events), so that another root
    /// must take over.
    pub lease_drill_stop_after_ms: Option<u64>,
    /// Holding requests no worker may take now, by class and deadline
    /// ([`crate::admission`]); absent: shed at once, as before.
    pub admission: Option<Admission>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            sidecar_cluster: "kvgate_sidecar".into(),
            sidecar_authority: "kvgate-sidecar".into(),
            sidecar_token: None,
            poll_wait: Duration::from_millis(1000),
            poll_backoff: Duration::from_millis(100),
            tick: Duration::from_millis(100),
            flush: Duration::from_millis(5),
            destination_header: header::DESTINATION.into(),
            rank_header: header::RANK.into(),
            fallback_header: header::FALLBACK.into(),
            tenant_header: header::TENANT.into(),
            served_by_header: header::SERVED_BY.into(),
            predicted_ttft_header: String::new(),
            max_body_bytes: 1 << 20,
            prefill_cluster: "kvgate_prefill".into(),
            prefill_host_header: header::PREFILL_HOST.into(),
            stale_after: Duration::from_secs(5),
            on_stale: OnStale::FailOpen,
            retry_after_s: 1,
            retry_headroom_pct: 50,
            max_retry_after_s: 30,
            phase_timing_every: 8,
            cached_tokens_every: 8,
            poller: PollerMode::Singleton,
            lease: None,
            lease_drill_stop_after_ms: None,
            admission: None,
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("plugin configuration is not valid JSON for kvgate: {0}")]
    Json(String),
    #[error("plugin configuration: {0}")]
    Invalid(String),
}

/// The cap on `poll_wait_ms`: the sidecar holds a poll at most 10 s.
pub const MAX_POLL_WAIT: Duration = Duration::from_secs(10);

/// The cap on `flush_ms`: held longer, bookings would reach the other
/// gateways after the load they announce has come and gone.
pub const MAX_FLUSH: Duration = Duration::from_millis(100);

/// Durations are whole milliseconds in the JSON, as the `_ms` keys say.
fn millis<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    u64::deserialize(d).map(Duration::from_millis)
}

fn millis_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    Option::<u64>::deserialize(d).map(|v| v.map(Duration::from_millis))
}

/// A duration in the host clock's unit.
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Config {
    /// Parses the plugin configuration; absent or empty means defaults.
    pub fn parse(bytes: Option<&[u8]>) -> Result<Config, ConfigError> {
        let bytes = bytes.unwrap_or_default();
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Config::default());
        }
        let mut c: Config =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// The poller lease's term: as configured, else a second, or a third
    /// of `stale_after_ms` when that is shorter (but two ticks at least),
    /// so that a takeover always lands before the state goes stale.
    pub fn lease_term(&self) -> Duration {
        self.lease.unwrap_or_else(|| {
            (self.stale_after / 3)
                .min(Duration::from_secs(1))
                .max(self.tick * 2)
        })
    }

    fn validate(&mut self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        for (name, h) in [
            ("destination_header", &mut self.destination_header),
            ("rank_header", &mut self.rank_header),
            ("fallback_header", &mut self.fallback_header),
            ("tenant_header", &mut self.tenant_header),
            ("served_by_header", &mut self.served_by_header),
            ("predicted_ttft_header", &mut self.predicted_ttft_header),
            ("prefill_host_header", &mut self.prefill_host_header),
        ] {
            if matches!(name, "served_by_header" | "predicted_ttft_header") && h.is_empty() {
                continue;
            }
            // Envoy keeps header names lower-case.
            *h = h.to_ascii_lowercase();
            if h.is_empty() || h.starts_with(':') || !h.bytes().all(|b| b.is_ascii_graphic()) {
                return invalid(format!("{name} {h:?} is not a usable header name"));
            }
        }
        if let Some(t) = &self.sidecar_token
            && (t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()))
        {
            return invalid("sidecar_token must be non-empty printable ASCII".into());
        }
        if self.sidecar_cluster.is_empty() || self.prefill_cluster.is_empty() {
            return invalid("sidecar_cluster and prefill_cluster must not be empty".into());
        }
        if self.max_body_bytes == 0 {
            return invalid("max_body_bytes must be above 0".into());
        }
        if self.poll_wait > MAX_POLL_WAIT {
            return invalid(format!(
                "poll_wait_ms must be at most {}",
                ms(MAX_POLL_WAIT)
            ));
        }
        if self.max_retry_after_s == 0 || self.retry_after_s > self.max_retry_after_s {
            return invalid(format!(
                "max_retry_after_s ({}) must be above 0 and at least retry_after_s ({})",
                self.max_retry_after_s, self.retry_after_s
            ));
        }
        if self.retry_headroom_pct > 1000 {
            return invalid("retry_headroom_pct must be at most 1000".into());
        }
        if self.tick.is_zero() || self.poll_backoff.is_zero() {
            return invalid("tick_ms and poll_backoff_ms must be above 0".into());
        }
        if self.flush > MAX_FLUSH {
            return invalid(format!("flush_ms must be at most {}", ms(MAX_FLUSH)));
        }
        if self.stale_after <= self.poll_wait {
            return invalid(format!(
                "stale_after_ms ({}) must exceed poll_wait_ms ({}), or every quiet poll would look stale",
                ms(self.stale_after),
                ms(self.poll_wait)
            ));
        }
        if let Some(a) = &mut self.admission {
            a.validate().map_err(ConfigError::Invalid)?;
        }
        // A lost holder is replaced within a lease and a tick, and the new
        // holder's first poll does not wait: freshness survives it.
        let lease = self.lease_term();
        if self.poller == PollerMode::Lease
            && (lease < self.tick * 2 || lease + self.tick >= self.stale_after)
        {
            return invalid(format!(
                "lease_ms ({}) must be at least twice tick_ms ({}) and, with a tick, under stale_after_ms ({})",
                ms(lease),
                ms(self.tick),
                ms(self.stale_after)
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_when_empty() {
        assert_eq!(Config::parse(None).unwrap(), Config::default());
        assert_eq!(Config::parse(Some(b"  ")).unwrap(), Config::default());
        assert_eq!(Config::parse(Some(b"{}")).unwrap(), Config::default());
    }

    #[test]
    fn overrides_and_normalises() {
        let c = Config::parse(Some(
            br#"{"on_stale":"fail_closed","destination_header":"X-Dest","max_body_bytes":10}"#,
        ))
        .unwrap();
        assert_eq!(c.on_stale, OnStale::FailClosed);
        assert_eq!(c.destination_header, "x-dest");
        assert_eq!(c.max_body_bytes, 10);
        let c = Config::parse(Some(br#"{"served_by_header":""}"#)).unwrap();
        assert_eq!(c.served_by_header, "", "empty turns the header off");
        let c = Config::parse(Some(br#"{"admission":{"class_header":"X-Tier"}}"#)).unwrap();
        assert_eq!(c.admission.unwrap().class_header, "x-tier");
        let c = Config::parse(Some(br#"{"flush_ms":0}"#)).unwrap();
        assert!(c.flush.is_zero(), "0 sends each event at once");
        let c = Config::parse(Some(br#"{"sidecar_token":"s3cret"}"#)).unwrap();
        assert_eq!(c.sidecar_token.as_deref(), Some("s3cret"));
        let c = Config::parse(Some(br#"{"poller":"lease","lease_ms":2000}"#)).unwrap();
        assert_eq!(
            (c.poller, c.lease_term()),
            (PollerMode::Lease, Duration::from_secs(2))
        );
        let c = Config::parse(Some(br#"{"poller":"lease"}"#)).unwrap();
        assert_eq!(c.lease_term(), Duration::from_secs(1));
        let c = Config::parse(Some(
            br#"{"poller":"lease","stale_after_ms":800,"poll_wait_ms":300}"#,
        ))
        .unwrap();
        assert_eq!(ms(c.lease_term()), 266);
        assert!(
            Config::parse(Some(br#"{"lease_ms":50}"#)).is_ok(),
            "the lease is not checked in singleton mode"
        );
    }

    #[test]
    fn mistakes_are_refused() {
        for bad in [
            &br#"{"bogus": 1}"#[..],
            br#"{"on_stale": "maybe"}"#,
            br#"not json"#,
            br#"{"max_body_bytes": 0}"#,
            br#"{"rank_header": ""}"#,
            br#"{"destination_header": ":authority"}"#,
            br#"{"tenant_header": "x tenant"}"#,
            br#"{"poll_wait_ms": 60000}"#,
            br#"{"stale_after_ms": 500}"#,
            br#"{"sidecar_token": ""}"#,
            br#"{"sidecar_token": "two words"}"#,
            br#"{"max_retry_after_s": 0}"#,
            br#"{"retry_after_s": 40, "max_retry_after_s": 30}"#,
            br#"{"retry_headroom_pct": 5000}"#,
            br#"{"poller": "elected"}"#,
            br#"{"poller": "lease", "lease_ms": 150}"#,
            br#"{"poller": "lease", "lease_ms": 5000}"#,
            br#"{"flush_ms": 1000}"#,
            br#"{"admission": {"shed_status": 500}}"#,
        ] {
            assert!(
                Config::parse(Some(bad)).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
