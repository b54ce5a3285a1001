//! Replies the filter sends itself, without contacting a worker.
//!
//! Bodies follow OpenAI's error shape, except the busy 503, which is the
//! exact body Dynamo documents so clients written for Dynamo keep working.

use kvgate_core::Rejection;
use serde_json::json;

/// The busy body, byte for byte.
pub const BUSY_BODY: &str = r#"{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":503}"#;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u32,
    /// Goes into `x-kvgate-reason` and names the metric that counts it.
    pub reason: Reason,
    pub body: String,
    pub retry_after_s: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    AllWorkersBusy,
    NoWorkers,
    UnknownModel,
    BadRequest,
    BodyTooLarge,
    StaleState,
    /// Every worker busy or at its thermal cap, at least one capped.
    Thermal,
}

impl Reason {
    pub const ALL: [Reason; 7] = [
        Reason::AllWorkersBusy,
        Reason::NoWorkers,
        Reason::UnknownModel,
        Reason::BadRequest,
        Reason::BodyTooLarge,
        Reason::StaleState,
        Reason::Thermal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::AllWorkersBusy => "all_workers_busy",
            Reason::NoWorkers => "no_workers",
            Reason::UnknownModel => "unknown_model",
            Reason::BadRequest => "bad_request",
            Reason::BodyTooLarge => "body_too_large",
            Reason::StaleState => "stale_state",
            Reason::Thermal => "thermal",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

fn openai(status: u32, kind: &str, message: &str) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}}).to_string()
}

impl Reply {
    /// The reply to a request the plan refused. `model` is the name the
    /// request used; `default_retry_after_s` is the configured hint, used
    /// when the snapshot has no estimate.
    pub fn rejected(r: Rejection, model: &str, default_retry_after_s: u32) -> Reply {
        match r {
            Rejection::UnknownModel => Reply::unknown_model(model),
            Rejection::NoWorkers => Reply::no_workers(model),
            Rejection::AllBusy { retry_after_s: 0 } => Reply::busy(default_retry_after_s),
            Rejection::AllBusy { retry_after_s } => Reply::busy(retry_after_s),
            Rejection::Thermal { retry_after_s } => Reply {
                reason: Reason::Thermal,
                ..Reply::busy(match retry_after_s {
                    0 => default_retry_after_s,
                    s => s,
                })
            },
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_body_is_exact_json() {
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
        assert_eq!(busy(7).body, BUSY_BODY);
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
        assert_eq!(Reply::too_large(10).status, 413);
        let names: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), 7);
        assert!(Reason::ALL.iter().enumerate().all(|(i, r)| r.index() == i));
    }
}
