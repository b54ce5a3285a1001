//! Admission settings (`"admission"` in the plugin configuration): the
//! priority classes, the share of the busy thresholds reserved for the
//! classes that may use it, how long and how many requests are held, and
//! the status a shed request is answered with. Absent, the filter sheds
//! as before admission: at once, with a place in the retry queue.

use kvgate_core::admit::{self, fair};
use kvgate_core::state::Slo;
use serde::Deserialize;
use std::collections::BTreeMap;

/// One priority class.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Class {
    pub name: String,
    /// 0 goes first: held requests are released, and a full queue keeps
    /// them, in this order.
    pub priority: u8,
    /// It may use the share of the thresholds reserved for critical work.
    #[serde(default)]
    pub reserve: bool,
    /// How long a request of it may be held for a worker; 0: never held,
    /// shed at once.
    #[serde(default)]
    pub hold_ms: u64,
    /// Its latency targets, in place of the model's (`[models.slo]`).
    #[serde(default)]
    pub ttft_ms: Option<u32>,
    #[serde(default)]
    pub itl_ms: Option<u32>,
}

/// A model's own shed status and queue bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelAdmission {
    pub shed_status: Option<u16>,
    pub max_held: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Admission {
    /// Names the request's class; set in Envoy (from the route, a JWT
    /// claim or the tenant) after removing any client's copy, as for the
    /// tenant header. Absent or unknown: `default_class`.
    pub class_header: String,
    pub default_class: String,
    pub classes: Vec<Class>,
    /// The share of every busy threshold (percent) only classes with
    /// `reserve` may use.
    pub reserve_pct: u32,
    /// Held requests per model in one worker thread (VM); a proxy holds
    /// at most its concurrency times this.
    pub max_held: usize,
    /// Whether a client may ask not to be held (`do_not_queue` in its body
    /// or the do-not-queue header): it is then shed at once.
    pub client_do_not_queue: bool,
    /// Whether a client may name its own class (`kvgate_class` in its
    /// body). Off: the field is stripped and ignored.
    pub client_class: bool,
    /// 503 (the default), 529 or 429.
    pub shed_status: u16,
    pub models: BTreeMap<String, ModelAdmission>,
    /// Passes the class's priority as vLLM's `priority` request field
    /// (for engines run with `--scheduling-policy priority`).
    pub vllm_priority: bool,
    /// How often held requests are looked at (ms).
    pub tick_ms: u64,
    /// Names whose share of a contended model's load a request counts
    /// against: a tenant of a pool shared by several (set in Envoy from
    /// authentication, like the class). Absent on a request: its
    /// `tenant_header` tenant, which scopes workers instead.
    pub account_header: String,
    /// Each tenant's weight in the model's booked load while it is
    /// contended (absent: 1), by the name `account_header` gives.
    pub tenants: BTreeMap<String, f64>,
}

impl Default for Admission {
    fn default() -> Self {
        let class = |name: &str, priority, reserve, hold_ms| Class {
            name: name.into(),
            priority,
            reserve,
            hold_ms,
            ttft_ms: None,
            itl_ms: None,
        };
        Admission {
            class_header: kvgate_core::header::CLASS.into(),
            default_class: "standard".into(),
            classes: vec![
                class("critical", 0, true, 10_000),
                class("standard", 1, false, 5_000),
                class("sheddable", 2, false, 0),
            ],
            reserve_pct: 10,
            max_held: 64,
            client_do_not_queue: true,
            client_class: false,
            shed_status: 503,
            models: BTreeMap::new(),
            vllm_priority: false,
            tick_ms: 10,
            account_header: kvgate_core::header::ACCOUNT.into(),
            tenants: BTreeMap::new(),
        }
    }
}

/// The longest a request may be held: a client waits no longer than
/// this for its first byte to even start.
pub const MAX_HOLD_MS: u64 = 120_000;
/// The statuses a shed may be answered with.
pub const SHED_STATUSES: [u16; 3] = [503, 529, 429];

impl Admission {
    /// Checks and normalises; the message names what is wrong.
    pub fn validate(&mut self) -> Result<(), String> {
        for (name, h) in [
            ("class_header", &mut self.class_header),
            ("account_header", &mut self.account_header),
        ] {
            *h = h.to_ascii_lowercase();
            if h.is_empty() || h.starts_with(':') || !h.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "admission.{name} {h:?} is not a usable header name"
                ));
            }
        }
        if self.classes.is_empty() {
            return Err("admission.classes must name at least one class".into());
        }
        for (i, c) in self.classes.iter().enumerate() {
            if c.name.is_empty() || self.classes[..i].iter().any(|o| o.name == c.name) {
                return Err(format!(
                    "admission class {:?} is empty or named twice",
                    c.name
                ));
            }
            if c.hold_ms > MAX_HOLD_MS {
                return Err(format!(
                    "admission class {:?}: hold_ms must be at most {MAX_HOLD_MS}",
                    c.name
                ));
            }
        }
        if self.class(&self.default_class).is_none() {
            return Err(format!(
                "admission.default_class {:?} is not one of the classes",
                self.default_class
            ));
        }
        if self.reserve_pct >= 100 {
            return Err("admission.reserve_pct must be under 100".into());
        }
        let statuses = std::iter::once(self.shed_status)
            .chain(self.models.values().filter_map(|m| m.shed_status));
        for s in statuses {
            if !SHED_STATUSES.contains(&s) {
                return Err(format!(
                    "admission shed_status {s} is not one of 503, 529, 429"
                ));
            }
        }
        if self.tick_ms == 0 || self.tick_ms > 1000 {
            return Err("admission.tick_ms must be within 1..=1000".into());
        }
        if let Some((t, w)) = self
            .tenants
            .iter()
            .find(|(_, w)| !(w.is_finite() && **w > 0.0))
        {
            return Err(format!(
                "admission tenant {t:?}: weight {w} must be above 0"
            ));
        }
        Ok(())
    }

    /// The class named `name`, by its index.
    pub fn class(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c.name == name)
    }

    /// The class of a request: the one its header names, else the
    /// default (validated to exist).
    pub fn class_of(&self, name: Option<&str>) -> usize {
        name.and_then(|n| self.class(n))
            .or_else(|| self.class(&self.default_class))
            .unwrap_or(0)
    }

    pub fn shed_status(&self, model: &str) -> u16 {
        self.models
            .get(model)
            .and_then(|m| m.shed_status)
            .unwrap_or(self.shed_status)
    }

    pub fn max_held(&self, model: &str) -> usize {
        self.models
            .get(model)
            .and_then(|m| m.max_held)
            .unwrap_or(self.max_held)
    }

    /// `tenant`'s weight.
    pub fn weight(&self, tenant: &str) -> f64 {
        self.tenants.get(tenant).copied().unwrap_or(1.0)
    }

    /// Whether `tenant` holds more than its weight's part of what every
    /// gateway has booked on `model`, among the tenants with load there
    /// and those `waiting` for it (`kvgate_core::admit::fair`).
    pub fn over_share<'a>(
        &self,
        model: &kvgate_core::ModelState,
        tenant: &str,
        waiting: impl IntoIterator<Item = &'a str>,
    ) -> bool {
        let loads: Vec<fair::Booked<'_>> = model
            .tenants
            .iter()
            .map(|t| fair::Booked {
                tenant: &t.tenant,
                prefill_tokens: t.prefill_tokens,
                decode_blocks: t.decode_blocks,
            })
            .collect();
        fair::over_share(&loads, tenant, waiting, |t| self.weight(t))
    }

    /// The latency targets of a request of `class` on `model`: the class's
    /// where it sets them, else the model's (a target of 0 is none).
    pub fn slo(&self, class: usize, model: Slo) -> Option<Slo> {
        let c = self.classes.get(class);
        let slo = Slo {
            ttft_ms: c.and_then(|c| c.ttft_ms).unwrap_or(model.ttft_ms),
            itl_ms: c.and_then(|c| c.itl_ms).unwrap_or(model.itl_ms),
        };
        (slo != Slo::default()).then_some(slo)
    }

    /// The share of every threshold outside the reserve.
    pub fn unreserved(&self) -> f64 {
        1.0 - f64::from(self.reserve_pct) / 100.0
    }

    /// The thresholds a request of class `class` is placed against, with
    /// a retry's headroom when it holds its ticket.
    pub fn thresholds_scale(&self, class: usize, retry_headroom: Option<f64>) -> Option<f64> {
        let reserve = self.classes.get(class).is_some_and(|c| c.reserve);
        admit::thresholds_scale(f64::from(self.reserve_pct) / 100.0, reserve, retry_headroom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Admission, String> {
        let mut a: Admission = serde_json::from_str(json).map_err(|e| e.to_string())?;
        a.validate()?;
        Ok(a)
    }

    #[test]
    fn defaults_have_three_classes_and_a_reserve_for_critical() {
        let a = parse("{}").unwrap();
        assert_eq!(a.class_of(None), 1);
        assert_eq!(a.class_of(Some("critical")), 0);
        assert_eq!(a.class_of(Some("nonsense")), 1, "unknown: the default");
        assert_eq!(a.thresholds_scale(0, None), None, "critical may use it all");
        assert_eq!(a.thresholds_scale(1, None), Some(0.9));
        assert_eq!(a.thresholds_scale(0, Some(0.5)), Some(1.5));
        assert_eq!(a.shed_status("m"), 503);
        let a = parse(r#"{"shed_status":429,"models":{"m":{"shed_status":529,"max_held":2}}}"#)
            .unwrap();
        assert_eq!((a.shed_status("m"), a.shed_status("n")), (529, 429));
        assert_eq!((a.max_held("m"), a.max_held("n")), (2, 64));
    }

    #[test]
    fn a_class_slo_replaces_the_models_target_by_target() {
        let a = parse(
            r#"{"classes":[{"name":"fast","priority":0,"ttft_ms":200},{"name":"any","priority":1}],"default_class":"any"}"#,
        )
        .unwrap();
        let model = Slo {
            ttft_ms: 1000,
            itl_ms: 50,
        };
        assert_eq!(
            a.slo(0, model),
            Some(Slo {
                ttft_ms: 200,
                itl_ms: 50
            })
        );
        assert_eq!(a.slo(1, model), Some(model));
        assert_eq!(a.slo(1, Slo::default()), None, "no targets: cost alone");
    }

    #[test]
    fn mistakes_are_refused() {
        for bad in [
            r#"{"shed_status":500}"#,
            r#"{"models":{"m":{"shed_status":200}}}"#,
            r#"{"classes":[]}"#,
            r#"{"classes":[{"name":"a","priority":0},{"name":"a","priority":1}],"default_class":"a"}"#,
            r#"{"default_class":"gold"}"#,
            r#"{"reserve_pct":100}"#,
            r#"{"class_header":"x class"}"#,
            r#"{"tick_ms":0}"#,
            r#"{"tenants":{"a":0}}"#,
            r#"{"classes":[{"name":"a","priority":0,"hold_ms":999999}],"default_class":"a"}"#,
            r#"{"bogus":1}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
