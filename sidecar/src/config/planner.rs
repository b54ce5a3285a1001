//! `[models.planner]`: a model's SLA, scaling bounds, predictor and
//! capacity profile. The planner (`crate::planner`) runs on it; the types
//! live here so that configuration names no module later in the flow.

use super::millis;
use kvgate_core::Role;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `[models.planner]`: a model's SLA and scaling bounds.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerConfig {
    /// Time to first token the model should meet, ms.
    pub ttft_ms: f64,
    /// Inter-token latency the model should meet, ms.
    pub itl_ms: f64,
    /// Scale down only when every estimate is under SLA × this.
    #[serde(default = "default_sensitivity")]
    pub sensitivity: f64,
    #[serde(
        rename = "load_interval_ms",
        default = "default_load_interval",
        with = "millis"
    )]
    pub load_interval: Duration,
    #[serde(
        rename = "throughput_interval_ms",
        default = "default_throughput_interval",
        with = "millis"
    )]
    pub throughput_interval: Duration,
    #[serde(default = "default_min")]
    pub min_replicas: u32,
    #[serde(default = "default_max")]
    pub max_replicas: u32,
    #[serde(default)]
    pub predictor: PredictorKind,
    /// The seasonal predictor's period, in throughput intervals.
    #[serde(default = "default_season")]
    pub season_intervals: usize,
    /// Requests per second one replica serves within the SLA at given
    /// ISL/OSL; without it, capacity is learned from the regressions.
    #[serde(default)]
    pub profile: Vec<ProfileRow>,
    /// A decision not reported done within this is given up on.
    #[serde(
        rename = "pending_timeout_ms",
        default = "default_pending_timeout",
        with = "millis"
    )]
    pub pending_timeout: Duration,
    /// How long a new worker takes to become ready, until one has been
    /// seen to.
    #[serde(rename = "startup_ms", default = "default_startup", with = "millis")]
    pub startup: Duration,
    /// Past intervals to warm the predictors with: a CSV of
    /// `requests,isl,osl` per throughput interval (a header line is
    /// skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_trace: Option<std::path::PathBuf>,
    /// `[models.planner.prefill]`: the prefill pool's own bounds and
    /// sensitivity, for a disaggregated model; unset ones are the model's.
    #[serde(default)]
    pub prefill: PoolConfig,
    /// `[models.planner.decode]`: the decode pool's.
    #[serde(default)]
    pub decode: PoolConfig,
    /// A disaggregated model's planner may move a worker from one pool to
    /// the other (`PATCH /workers/{id}` with its new `role`) instead of
    /// starting one and draining another: only for engines that serve
    /// either leg without a restart (vLLM with `kv_both`).
    #[serde(default)]
    pub role_switch: bool,
    /// Watts the model's replicas may draw together, measured; unset: no
    /// budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_budget_w: Option<f64>,
    /// What one replica draws until a reading says (watts, all its GPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_watts: Option<f64>,
}

/// `[planner]`: the fleet's side of planning.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FleetPlanner {
    /// Watts every planned model's replicas may draw together, measured;
    /// each model's own `power_budget_w` applies too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_budget_w: Option<f64>,
}

/// One pool's bounds and sensitivity; unset, the model's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sensitivity: Option<f64>,
}

/// A pool's bounds and sensitivity, resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolBounds {
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub sensitivity: f64,
}

/// At most this many warm-up intervals are read: a month of minutes.
const MAX_TRACE_ROWS: usize = 50_000;

/// Reads a warm-up trace: `requests,isl,osl` per line, numbers not
/// negative; a first line that is not numbers is a header.
pub fn read_trace(text: &str) -> Result<Vec<(f64, f64, f64)>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let nums: Option<Vec<f64>> = fields.iter().map(|f| f.parse::<f64>().ok()).collect();
        match nums {
            Some(v) if v.len() == 3 && v.iter().all(|x| x.is_finite() && *x >= 0.0) => {
                out.push((v[0], v[1], v[2]));
            }
            None if n == 0 => continue,
            _ => {
                return Err(format!(
                    "line {}: expected requests,isl,osl (numbers, not negative), got {line:?}",
                    n + 1
                ));
            }
        }
        if out.len() > MAX_TRACE_ROWS {
            return Err(format!("more than {MAX_TRACE_ROWS} intervals"));
        }
    }
    Ok(out)
}

fn default_sensitivity() -> f64 {
    0.7
}
fn default_load_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_throughput_interval() -> Duration {
    Duration::from_secs(60)
}
fn default_min() -> u32 {
    1
}
fn default_max() -> u32 {
    64
}
fn default_season() -> usize {
    24
}
fn default_pending_timeout() -> Duration {
    Duration::from_secs(30 * 60)
}
fn default_startup() -> Duration {
    Duration::from_secs(60)
}

impl PlannerConfig {
    /// The bounds of the pool of `role`: the model's, or a disaggregated
    /// pool's own where set.
    pub fn bounds(&self, role: Role) -> PoolBounds {
        let own = match role {
            Role::Both => PoolConfig::default(),
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
        };
        PoolBounds {
            min_replicas: own.min_replicas.unwrap_or(self.min_replicas),
            max_replicas: own.max_replicas.unwrap_or(self.max_replicas),
            sensitivity: own.sensitivity.unwrap_or(self.sensitivity),
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if !pos(self.ttft_ms) || !pos(self.itl_ms) {
            return Err("ttft_ms and itl_ms must be above 0".into());
        }
        for role in Role::ALL {
            let b = self.bounds(role);
            let name = match role {
                Role::Both => String::new(),
                r => format!("{}: ", r.as_str()),
            };
            if !(b.sensitivity.is_finite() && b.sensitivity > 0.0 && b.sensitivity < 1.0) {
                return Err(format!(
                    "{name}sensitivity must be within (0, 1), got {}",
                    b.sensitivity
                ));
            }
            if b.min_replicas > b.max_replicas || b.max_replicas == 0 {
                return Err(format!(
                    "{name}min_replicas {} must be at most max_replicas {} (above 0)",
                    b.min_replicas, b.max_replicas
                ));
            }
        }
        for (k, v) in [
            ("power_budget_w", self.power_budget_w),
            ("replica_watts", self.replica_watts),
        ] {
            if v.is_some_and(|w| !pos(w)) {
                return Err(format!("{k} must be above 0"));
            }
        }
        if self.load_interval.is_zero() || self.throughput_interval.is_zero() {
            return Err("load_interval_ms and throughput_interval_ms must be above 0".into());
        }
        if self.season_intervals < 2 {
            return Err("season_intervals must be at least 2".into());
        }
        if let Some(p) = &self.warmup_trace {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("warmup_trace {}: {e}", p.display()))?;
            read_trace(&text).map_err(|e| format!("warmup_trace {}: {e}", p.display()))?;
        }
        validate_profile(&self.profile)
    }
}

/// Which predictor a model's throughput loop uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PredictorKind {
    Constant,
    Kalman,
    Seasonal,
    /// The default: the lowest mean one-step MAPE of requests, ISL and
    /// OSL per minute on the Mooncake conversation trace (`xtask bench`'s
    /// `trace_mape`), if only just ahead of `kalman`.
    #[default]
    Arima,
}

impl PredictorKind {
    pub const ALL: [PredictorKind; 4] = [
        PredictorKind::Constant,
        PredictorKind::Kalman,
        PredictorKind::Seasonal,
        PredictorKind::Arima,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PredictorKind::Constant => "constant",
            PredictorKind::Kalman => "kalman",
            PredictorKind::Seasonal => "seasonal",
            PredictorKind::Arima => "arima",
        }
    }
}

/// One profiled point: at this ISL and OSL one worker of `role` served
/// `rps` within the SLA (`kvgate-sidecar profile` measures them). A
/// `both` row (the default) is a worker serving whole requests; a
/// `prefill` row one computing prompts only (its `osl` is 0), judged by
/// TTFT; a `decode` row one decoding only, judged by ITL.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileRow {
    #[serde(default)]
    pub role: Role,
    pub isl: f64,
    pub osl: f64,
    pub rps: f64,
    /// What the sweep measured at `rps` (p90), for the record: the
    /// planner reads only `rps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<f64>,
}

fn validate_profile(rows: &[ProfileRow]) -> Result<(), String> {
    for r in rows {
        if !(r.isl.is_finite() && r.osl.is_finite() && r.rps.is_finite())
            || r.isl < 0.0
            || r.osl < 0.0
            || r.rps <= 0.0
        {
            return Err(format!(
                "profile row {{isl: {}, osl: {}, rps: {}}}: lengths must be at least 0 and rps above 0",
                r.isl, r.osl, r.rps
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_row_needs_a_positive_rate() {
        assert!(
            validate_profile(&[ProfileRow {
                role: Role::Both,
                isl: 1.0,
                osl: 1.0,
                rps: 0.0,
                ttft_ms: None,
                itl_ms: None,
            }])
            .is_err()
        );
    }

    #[test]
    fn durations_are_read_and_shown_in_milliseconds_under_their_ms_keys() {
        let c: PlannerConfig = toml::from_str(
            "ttft_ms = 200\nitl_ms = 20\nload_interval_ms = 1500\nstartup_ms = 7000",
        )
        .unwrap();
        assert_eq!(
            (c.load_interval, c.startup),
            (Duration::from_millis(1500), Duration::from_secs(7))
        );
        assert_eq!(
            (c.throughput_interval, c.pending_timeout),
            (Duration::from_secs(60), Duration::from_secs(1800)),
            "the defaults"
        );
        let shown = serde_json::to_value(&c).unwrap();
        assert_eq!(shown["load_interval_ms"], 1500);
        assert_eq!(shown["pending_timeout_ms"], 1_800_000);
        assert!(shown.get("load_interval").is_none(), "{shown}");
        for bad in [
            "startup_ms = -1",
            "startup_ms = \"1m\"",
            "load_interval_ms = 0",
        ] {
            let parsed =
                toml::from_str::<PlannerConfig>(&format!("ttft_ms = 1\nitl_ms = 1\n{bad}"));
            assert!(
                !parsed.is_ok_and(|c| c.validate().is_ok()),
                "{bad} was taken"
            );
        }
    }
}
