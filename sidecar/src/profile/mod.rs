//! The planner's profiling step, before deployment: how many requests per
//! second one worker serves within the SLA, at each prompt and answer
//! length asked for (`kvgate-sidecar profile`). Its output is the
//! `profile` rows of a model's `[models.planner]`
//! ([`crate::config::ProfileRow`]), which the planner's throughput loop
//! starts from.
//!
//! For each point the sweep offers the worker open-loop Poisson arrivals
//! at a rate and judges the step ([`sweep`]'s rules), searching for the
//! highest rate that passes ([`search`]). Requests are streamed
//! `/v1/completions` of random token ids, so no prefix cache helps, and
//! are timed at the client: TTFT at the first streamed chunk, ITL as the
//! time from the first token to the last over the tokens between.
//!
//! What each role's rows mean:
//! * `both`: whole requests of `isl` prompt and `osl` answer tokens,
//!   judged by TTFT and ITL.
//! * `prefill`: prompts only (`max_tokens = 1`; the row's `osl` is 0),
//!   judged by TTFT.
//! * `decode`: judged by ITL. The sweep sends whole requests, so the
//!   worker computes each prompt itself: the ITL measured includes the
//!   interference of its own prefills, which a decode worker behind a
//!   prefill pool does not pay. The figure is conservative. A worker that
//!   serves only disaggregated decode legs (SGLang's decode mode) cannot
//!   take such requests; profile one started without its disaggregation
//!   role, on the same engine flags otherwise.

mod client;
pub mod search;
pub mod sse;
mod sweep;

pub use sweep::{Sweep, run, sweep};

use crate::config::ProfileRow;
use kvgate_core::Role;
use std::fmt::Write as _;
use std::time::Duration;

/// What to sweep, and the limits that bound it.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// The worker, `http://host:port`.
    pub endpoint: String,
    /// The model name requests carry.
    pub model: String,
    pub role: Role,
    /// Prompt lengths, tokens.
    pub isl: Vec<u32>,
    /// Answer lengths, tokens (not read for `prefill`).
    pub osl: Vec<u32>,
    /// The p90 TTFT a rate must meet (`both`, `prefill`).
    pub ttft_ms: Option<f64>,
    /// The p90 ITL a rate must meet (`both`, `decode`).
    pub itl_ms: Option<f64>,
    /// How long each rate is offered for.
    pub step: Duration,
    /// No rate above this is tried.
    pub max_rps: f64,
    /// Requests each step sends at least; a low rate's step lasts longer
    /// to send them.
    pub min_requests: usize,
    /// Midpoints tried once a pass and a fail bracket the answer.
    pub bisect_steps: u32,
    /// Requests in flight at most: an open loop that would send past it
    /// has outrun the worker, and the step fails.
    pub max_in_flight: usize,
    /// One request's limit; by default four times what the SLA allows it
    /// (`ttft_ms + osl × itl_ms`), at least 10 s.
    pub request_timeout: Option<Duration>,
}

impl Default for SweepOptions {
    fn default() -> SweepOptions {
        SweepOptions {
            endpoint: "http://127.0.0.1:8000".into(),
            model: String::new(),
            role: Role::Both,
            isl: vec![512, 2048, 8192],
            osl: vec![128, 512],
            ttft_ms: Some(500.0),
            itl_ms: Some(25.0),
            step: Duration::from_secs(20),
            max_rps: 64.0,
            min_requests: 10,
            bisect_steps: 3,
            max_in_flight: 256,
            request_timeout: None,
        }
    }
}

/// Points a sweep may have at most.
const MAX_POINTS: usize = 256;
/// The longest prompt or answer a point may ask for.
const MAX_LEN: u32 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profile options: {0}")]
    Options(String),
    #[error("cannot reach the worker at {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    #[error("the worker at {endpoint} refused a profile request (status {status}): {body}{hint}")]
    Rejected {
        endpoint: String,
        status: u16,
        body: String,
        /// What to do about it, when the role suggests something.
        hint: &'static str,
    },
    #[error("the worker at {endpoint} did not stream a completion: {reason}")]
    BadStream { endpoint: String, reason: String },
    #[error(
        "no point met the SLA, not even with one request at a time (see the log for each point's figures)"
    )]
    NothingMet,
}

impl SweepOptions {
    pub fn validate(&self) -> Result<(), ProfileError> {
        let bad = |m: String| Err(ProfileError::Options(m));
        let sla = |v: Option<f64>| v.is_some_and(|v| v.is_finite() && v > 0.0);
        if self.model.trim().is_empty() {
            return bad("a model name is required".into());
        }
        if self.isl.is_empty() || self.isl.iter().any(|&l| l == 0 || l > MAX_LEN) {
            return bad(format!(
                "isl: one length or more, each within 1..={MAX_LEN}"
            ));
        }
        if self.role != Role::Prefill
            && (self.osl.is_empty() || self.osl.iter().any(|&l| !(2..=MAX_LEN).contains(&l)))
        {
            return bad(format!(
                "osl: one length or more, each within 2..={MAX_LEN} (an ITL needs two tokens)"
            ));
        }
        if self.role != Role::Decode && !sla(self.ttft_ms) {
            return bad(format!(
                "role {} needs a TTFT limit (ttft_ms, --ttft-ms) above 0",
                self.role.as_str()
            ));
        }
        if self.role != Role::Prefill && !sla(self.itl_ms) {
            return bad(format!(
                "role {} needs an ITL limit (itl_ms, --itl-ms) above 0",
                self.role.as_str()
            ));
        }
        if self.step.is_zero() || self.step > Duration::from_secs(3600) {
            return bad("the step lasts more than 0 s and at most an hour".into());
        }
        if !(self.max_rps.is_finite() && self.max_rps > 0.0 && self.max_rps <= 100_000.0) {
            return bad("max_rps must be within (0, 100000]".into());
        }
        if !(1..=100_000).contains(&self.min_requests) {
            return bad("min_requests must be within 1..=100000".into());
        }
        if self.bisect_steps > 10 {
            return bad("bisect_steps must be at most 10".into());
        }
        if !(1..=100_000).contains(&self.max_in_flight) {
            return bad("max_in_flight must be within 1..=100000".into());
        }
        if self.request_timeout.is_some_and(|t| t.is_zero()) {
            return bad("request_timeout must be above 0".into());
        }
        if self.points().len() > MAX_POINTS {
            return bad(format!("at most {MAX_POINTS} (isl, osl) points"));
        }
        Ok(())
    }

    /// The (isl, osl) points swept, in order; `prefill`'s osl is 0.
    pub fn points(&self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for &isl in &self.isl {
            if self.role == Role::Prefill {
                out.push((isl, 0));
            } else {
                out.extend(self.osl.iter().map(|&osl| (isl, osl)));
            }
        }
        out.dedup();
        out
    }

    /// The standard header of a sweep's output: where, what, when, and
    /// the SLA it was judged by.
    pub fn header(&self) -> String {
        let mut sla = Vec::new();
        if let (true, Some(t)) = (self.role != Role::Decode, self.ttft_ms) {
            sla.push(format!("p90 TTFT <= {t} ms"));
        }
        if let (true, Some(i)) = (self.role != Role::Prefill, self.itl_ms) {
            sla.push(format!("p90 ITL <= {i} ms"));
        }
        let mut out = format!(
            "kvgate-sidecar profile, {} UTC\nendpoint {}, model {}, role {}\nSLA: {}; {} s per rate, up to {} rps\n\
             rps: requests per second one worker served within the SLA; paste under the model's [models.planner]",
            utc_now(),
            self.endpoint,
            self.model,
            self.role.as_str(),
            sla.join(", "),
            self.step.as_secs_f64(),
            self.max_rps,
        );
        if self.role == Role::Decode {
            out.push_str(
                "\ndecode rows: the worker computed each prompt itself, so ITL includes its own prefills (conservative)",
            );
        }
        out
    }
}

/// The rows as a TOML `profile = [...]` array, one inline table a line,
/// under `header` as comments: what `[models.planner]` reads back as
/// `Vec<ProfileRow>`, figures exactly as given.
pub fn to_toml(rows: &[ProfileRow], header: &str) -> String {
    let mut out = String::new();
    for line in header.lines() {
        if line.trim().is_empty() {
            out.push_str("#\n");
        } else {
            let _ = writeln!(out, "# {line}");
        }
    }
    out.push_str("profile = [\n");
    for r in rows {
        let _ = write!(
            out,
            "  {{ role = \"{}\", isl = {}, osl = {}, rps = {}",
            r.role.as_str(),
            float(r.isl),
            float(r.osl),
            float(r.rps)
        );
        if let Some(t) = r.ttft_ms {
            let _ = write!(out, ", ttft_ms = {}", float(t));
        }
        if let Some(i) = r.itl_ms {
            let _ = write!(out, ", itl_ms = {}", float(i));
        }
        out.push_str(" },\n");
    }
    out.push_str("]\n");
    out
}

/// A TOML float. Rust's `Debug` of a finite f64 is the shortest text that
/// reads back as the same value, always with a `.` or an exponent, which
/// TOML reads as a float; the rest are TOML's own words.
fn float(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{v:?}")
    }
}

/// `YYYY-MM-DD HH:MM` now, in UTC, without a date library.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    utc(secs)
}

fn utc(secs: u64) -> String {
    kvgate_core::text::strftime("%Y-%m-%d %H:%M", secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Planner {
        profile: Vec<ProfileRow>,
    }

    #[test]
    fn the_toml_reads_back_as_the_same_rows() {
        let rows = vec![
            ProfileRow {
                role: Role::Both,
                isl: 512.0,
                osl: 128.0,
                rps: 3.1,
                ttft_ms: Some(480.25),
                itl_ms: Some(20.1),
            },
            ProfileRow {
                role: Role::Prefill,
                isl: 8192.0,
                osl: 0.0,
                rps: 0.0123,
                ttft_ms: Some(1e3),
                itl_ms: None,
            },
            ProfileRow {
                role: Role::Decode,
                isl: 4096.0,
                osl: 512.0,
                rps: 1e-7,
                ttft_ms: None,
                itl_ms: Some(1.0 / 3.0),
            },
        ];
        let text = to_toml(&rows, "line one\n\nmodel \"x\" = y\n");
        assert!(text.starts_with("# line one\n#\n# model \"x\" = y\nprofile = [\n"));
        let back: Planner = toml::from_str(&text).unwrap();
        assert_eq!(back.profile, rows);
        let empty: Planner = toml::from_str(&to_toml(&[], "")).unwrap();
        assert!(empty.profile.is_empty());
    }

    /// The benchmark harness may spawn a sweep onto its runtime.
    #[test]
    fn a_sweep_is_send() {
        fn send<T: Send>(_: &T) {}
        let opts = SweepOptions::default();
        let fut = sweep(&opts);
        send(&fut);
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(utc(0), "1970-01-01 00:00");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00");
        assert_eq!(utc(1_709_251_199), "2024-02-29 23:59");
        assert_eq!(utc(1_735_689_600), "2025-01-01 00:00");
    }

    #[test]
    fn options_are_checked_for_the_role() {
        let ok = SweepOptions {
            model: "m".into(),
            ..SweepOptions::default()
        };
        ok.validate().unwrap();
        assert_eq!(ok.points().len(), 6);
        let prefill = SweepOptions {
            role: Role::Prefill,
            itl_ms: None,
            osl: vec![],
            ..ok.clone()
        };
        prefill.validate().unwrap();
        assert_eq!(prefill.points(), [(512, 0), (2048, 0), (8192, 0)]);
        let decode = SweepOptions {
            role: Role::Decode,
            ttft_ms: None,
            ..ok.clone()
        };
        decode.validate().unwrap();
        for bad in [
            SweepOptions {
                itl_ms: None,
                ..ok.clone()
            },
            SweepOptions {
                role: Role::Prefill,
                ttft_ms: Some(f64::NAN),
                ..ok.clone()
            },
            SweepOptions {
                osl: vec![1],
                ..ok.clone()
            },
            SweepOptions {
                isl: vec![],
                ..ok.clone()
            },
            SweepOptions {
                model: " ".into(),
                ..ok.clone()
            },
            SweepOptions {
                max_rps: 0.0,
                ..ok.clone()
            },
        ] {
            assert!(matches!(bad.validate(), Err(ProfileError::Options(_))));
        }
    }
}
