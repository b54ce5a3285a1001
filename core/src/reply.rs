//! The replies kvgate sends itself, without a worker: status, reason,
//! body and headers, defined once. Each front door (the wasm filter, the
//! ext_proc server) only renders a [`Reply`] into its host's reply.
//!
//! Bodies follow OpenAI's error shape, except the busy 503, which is the
//! exact body Dynamo documents so clients written for Dynamo keep working.

use crate::header;
use crate::plan::Rejection;
use serde_json::json;

/// The busy body, byte for byte.
pub const BUSY_BODY: &str = r#"{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":503}"#;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    /// Goes into `x-kvgate-reason` and names the metric that counts it.
    pub reason: Reason,
    pub body: String,
    pub retry_after_s: Option<u32>,
}

/// Why kvgate answered itself. The discriminants are the reason's code in
/// booking records ([`crate::booking`]): a code is never reused, and a new
/// reason is sent only by filters newer than the sidecars that know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Reason {
    AllWorkersBusy = 0,
    NoWorkers = 1,
    UnknownModel = 2,
    BadRequest = 3,
    BodyTooLarge = 4,
    StaleState = 5,
    /// Every worker busy or at its thermal cap, at least one capped.
    Thermal = 6,
    /// The request could not be booked: the server's fault, not the
    /// client's (the ext_proc server's reservations).
    Internal = 7,
    /// A disaggregated request's prefill leg failed on every worker it was
    /// tried on, and the model is set to fail rather than prefill on the
    /// decode worker.
    PrefillFailed = 8,
    /// No worker is predicted to meet the request's latency targets, and
    /// its class may not be held for one.
    SloUnattainable = 9,
    /// Shed for a request of a class that comes first: a full queue made
    /// room, or the class may not be held.
    PriorityShed = 10,
    /// The model's queue was full of requests that come before it.
    QueueFull = 11,
    /// Held until its deadline, and no worker freed up.
    DeadlinePassed = 12,
}

impl Reason {
    /// In code order, so that `ALL[r.index()] == r`.
    pub const ALL: [Reason; 13] = [
        Reason::AllWorkersBusy,
        Reason::NoWorkers,
        Reason::UnknownModel,
        Reason::BadRequest,
        Reason::BodyTooLarge,
        Reason::StaleState,
        Reason::Thermal,
        Reason::Internal,
        Reason::PrefillFailed,
        Reason::SloUnattainable,
        Reason::PriorityShed,
        Reason::QueueFull,
        Reason::DeadlinePassed,
    ];

    /// The `x-kvgate-reason` value, also the metric's name part.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::AllWorkersBusy => "all_workers_busy",
            Reason::NoWorkers => "no_workers",
            Reason::UnknownModel => "unknown_model",
            Reason::BadRequest => "bad_request",
            Reason::BodyTooLarge => "body_too_large",
            Reason::StaleState => "stale_state",
            Reason::Thermal => "thermal",
            Reason::Internal => "internal",
            Reason::PrefillFailed => "prefill_failed",
            Reason::SloUnattainable => "slo_unattainable",
            Reason::PriorityShed => "priority_shed",
            Reason::QueueFull => "queue_full",
            Reason::DeadlinePassed => "deadline_passed",
        }
    }

    /// The reason named by its `x-kvgate-reason` value.
    pub fn from_name(name: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// The code booking records carry.
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<Reason> {
        Reason::ALL.get(usize::from(code)).copied()
    }

    /// Position in [`Reason::ALL`], for per-reason arrays.
    pub fn index(self) -> usize {
        usize::from(self.code())
    }

    /// Whether the fleet had no room for the request (demand it lost, as
    /// the planner counts it), rather than the request being at fault.
    pub fn is_shed(self) -> bool {
        matches!(
            self,
            Reason::AllWorkersBusy
                | Reason::Thermal
                | Reason::SloUnattainable
                | Reason::PriorityShed
                | Reason::QueueFull
                | Reason::DeadlinePassed
        )
    }
}

fn openai(status: u16, kind: &str, message: &str) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}}).to_string()
}

impl Reply {
    /// The reply to a request the plan refused. `model` is the name the
    /// request used; `default_retry_after_s` is the configured hint, used
    /// when the snapshot has no estimate.
    pub fn rejected(r: Rejection, model: &str, default_retry_after_s: u32) -> Reply {
        let hint = |s: u32| if s == 0 { default_retry_after_s } else { s };
        match r {
            Rejection::UnknownModel => Reply::unknown_model(model),
            Rejection::NoWorkers => Reply::no_workers(model),
            Rejection::AllBusy { retry_after_s } => Reply::busy(hint(retry_after_s)),
            Rejection::Thermal { retry_after_s } => Reply {
                reason: Reason::Thermal,
                ..Reply::busy(hint(retry_after_s))
            },
            Rejection::SloUnattainable { retry_after_s } => {
                Reply::shed(503, Reason::SloUnattainable, hint(retry_after_s))
            }
        }
    }

    pub fn busy(retry_after_s: u32) -> Reply {
        Reply {
            status: 503,
            reason: Reason::AllWorkersBusy,
            body: BUSY_BODY.to_string(),
            retry_after_s: Some(retry_after_s),
        }
    }

    pub fn no_workers(model: &str) -> Reply {
        Reply {
            status: 503,
            reason: Reason::NoWorkers,
            body: openai(
                503,
                "service_unavailable",
                &format!("Model '{model}' has no available workers"),
            ),
            retry_after_s: None,
        }
    }

    pub fn unknown_model(model: &str) -> Reply {
        Reply {
            status: 404,
            reason: Reason::UnknownModel,
            body: openai(
                404,
                "not_found_error",
                &format!("The model '{model}' does not exist"),
            ),
            retry_after_s: None,
        }
    }

    pub fn bad_request(message: &str) -> Reply {
        Reply {
            status: 400,
            reason: Reason::BadRequest,
            body: openai(400, "invalid_request_error", message),
            retry_after_s: None,
        }
    }

    pub fn too_large(limit: usize) -> Reply {
        Reply {
            status: 413,
            reason: Reason::BodyTooLarge,
            body: openai(
                413,
                "invalid_request_error",
                &format!("Request body exceeds the {limit}-byte limit"),
            ),
            retry_after_s: None,
        }
    }

    pub fn stale() -> Reply {
        Reply {
            status: 503,
            reason: Reason::StaleState,
            body: openai(
                503,
                "service_unavailable",
                "Routing state is stale; the gateway cannot route safely right now",
            ),
            retry_after_s: Some(1),
        }
    }

    pub fn internal(message: &str) -> Reply {
        Reply {
            status: 500,
            reason: Reason::Internal,
            body: openai(500, "internal_error", message),
            retry_after_s: None,
        }
    }

    /// A disaggregated request whose prefill leg failed, with the model
    /// set to fail (`on_prefill_failure = "fail"`).
    pub fn prefill_failed(cause: &str) -> Reply {
        Reply {
            status: 503,
            reason: Reason::PrefillFailed,
            body: openai(
                503,
                "service_unavailable",
                &format!("The prompt could not be prefilled: {cause}"),
            ),
            retry_after_s: None,
        }
    }

    /// A request shed for want of room, answered with the model's shed
    /// status: 503 (Dynamo's, with its exact busy body for a busy fleet),
    /// 529 (overloaded) or 429 (too many requests), always with a
    /// `Retry-After` and otherwise in OpenAI's error shape.
    pub fn shed(status: u16, reason: Reason, retry_after_s: u32) -> Reply {
        let busy = matches!(reason, Reason::AllWorkersBusy | Reason::Thermal);
        let body = if status == 503 && busy {
            BUSY_BODY.to_string()
        } else {
            let kind = match status {
                429 => "rate_limit_exceeded",
                529 => "overloaded_error",
                _ => "service_unavailable",
            };
            let why = match reason {
                Reason::SloUnattainable => "no worker can meet the request's latency target",
                Reason::PriorityShed => "requests of a higher priority class come first",
                Reason::QueueFull => "the queue of held requests is full",
                Reason::DeadlinePassed => "no worker freed up before the request's deadline",
                _ => "all workers are busy",
            };
            openai(
                status,
                kind,
                &format!("Service temporarily unavailable: {why}, please retry later"),
            )
        };
        Reply {
            status,
            reason,
            body,
            retry_after_s: Some(retry_after_s.max(1)),
        }
    }

    /// This reply, if it sheds a request for want of room, with the
    /// model's shed status instead of 503.
    pub fn with_shed_status(self, status: u16) -> Reply {
        match (self.reason.is_shed(), self.retry_after_s) {
            (true, Some(s)) if status != self.status => Reply::shed(status, self.reason, s),
            _ => self,
        }
    }

    /// The reply's headers, in the order they are sent.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![
            (header::CONTENT_TYPE, "application/json".to_string()),
            (header::REASON, self.reason.as_str().to_string()),
        ];
        if let Some(s) = self.retry_after_s {
            h.push((header::RETRY_AFTER, s.to_string()));
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_body_is_dynamos_exact_json() {
        let v: serde_json::Value = serde_json::from_str(BUSY_BODY).unwrap();
        assert_eq!(
            v["message"],
            "Service temporarily unavailable: All workers are busy, please retry later"
        );
        assert_eq!(v["type"], "service_unavailable");
        assert_eq!(v["code"], 503);
        assert_eq!(Reply::busy(3).retry_after_s, Some(3));
    }

    #[test]
    fn rejections_map_to_their_replies() {
        let busy = |hint| {
            Reply::rejected(
                Rejection::AllBusy {
                    retry_after_s: hint,
                },
                "m",
                2,
            )
        };
        assert_eq!(
            busy(0).retry_after_s,
            Some(2),
            "no estimate: the configured hint"
        );
        assert_eq!(
            busy(7).retry_after_s,
            Some(7),
            "the sidecar's estimate wins"
        );
        assert_eq!(
            (busy(7).status, busy(7).reason, busy(7).body),
            (503, Reason::AllWorkersBusy, BUSY_BODY.to_string())
        );
        let r = Reply::rejected(Rejection::UnknownModel, "x", 2);
        assert_eq!((r.status, r.reason), (404, Reason::UnknownModel));
        let r = Reply::rejected(Rejection::NoWorkers, "x", 2);
        assert_eq!((r.status, r.reason), (503, Reason::NoWorkers));
        let hot = |hint| {
            Reply::rejected(
                Rejection::Thermal {
                    retry_after_s: hint,
                },
                "m",
                2,
            )
        };
        assert_eq!(
            (hot(9).status, hot(9).reason, hot(9).retry_after_s),
            (503, Reason::Thermal, Some(9))
        );
        assert_eq!(hot(9).body, BUSY_BODY, "Dynamo's body, whatever the cause");
        assert_eq!(hot(0).retry_after_s, Some(2));
    }

    #[test]
    fn openai_shapes_escape_names() {
        let r = Reply::unknown_model("we\"ird");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"]["message"], "The model 'we\"ird' does not exist");
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
        for (r, status, kind) in [
            (Reply::bad_request("no"), 400, "invalid_request_error"),
            (Reply::too_large(10), 413, "invalid_request_error"),
            (Reply::stale(), 503, "service_unavailable"),
            (Reply::internal("no"), 500, "internal_error"),
            (Reply::prefill_failed("no"), 503, "service_unavailable"),
        ] {
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(
                (r.status, v["error"]["code"].as_u64()),
                (status, Some(u64::from(status)))
            );
            assert_eq!(v["error"]["type"], kind);
        }
    }

    #[test]
    fn a_shed_answers_with_the_models_status_and_always_a_retry_hint() {
        assert_eq!(Reply::shed(503, Reason::AllWorkersBusy, 2), Reply::busy(2));
        for status in [429, 529, 503] {
            for reason in [
                Reason::SloUnattainable,
                Reason::PriorityShed,
                Reason::QueueFull,
                Reason::DeadlinePassed,
            ] {
                let r = Reply::shed(status, reason, 0);
                assert!(reason.is_shed());
                assert_eq!((r.status, r.retry_after_s), (status, Some(1)));
                let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
                assert_eq!(v["error"]["code"], u64::from(status));
                assert!(
                    r.headers()
                        .contains(&("x-kvgate-reason", reason.as_str().to_string()))
                );
            }
        }
        let r = Reply::busy(3).with_shed_status(429);
        assert_eq!(
            (r.status, r.reason, r.retry_after_s),
            (429, Reason::AllWorkersBusy, Some(3))
        );
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&r.body).unwrap()["error"]["type"],
            "rate_limit_exceeded"
        );
        assert_eq!(
            Reply::stale().with_shed_status(429).status,
            503,
            "not a shed"
        );
    }

    #[test]
    fn headers_carry_the_reason_and_any_retry_hint() {
        assert_eq!(
            Reply::busy(4).headers(),
            vec![
                ("content-type", "application/json".to_string()),
                ("x-kvgate-reason", "all_workers_busy".to_string()),
                ("retry-after", "4".to_string()),
            ]
        );
        let h = Reply::bad_request("x").headers();
        assert_eq!(h.len(), 2);
        assert_eq!(h[1], ("x-kvgate-reason", "bad_request".to_string()));
    }

    #[test]
    fn reasons_have_one_name_and_one_code_each() {
        for (i, r) in Reason::ALL.into_iter().enumerate() {
            assert_eq!(r.index(), i);
            assert_eq!(Reason::from_code(r.code()), Some(r));
            assert_eq!(Reason::from_name(r.as_str()), Some(r));
        }
        let names: std::collections::HashSet<&str> =
            Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
        assert_eq!(Reason::from_code(Reason::ALL.len() as u8), None);
        assert_eq!(Reason::from_code(u8::MAX), None);
        assert_eq!(Reason::from_name("busy"), None);
        assert_eq!(Reason::from_name(""), None);
    }
}
