//! What the server answers Envoy: header mutations for a routed request,
//! and the local replies the filter sends itself (same statuses, bodies
//! and `x-kvgate-reason`), as ext_proc immediate responses.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, TrailersResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use kvgate_core::plan::Rejection;
use serde_json::json;

/// Dynamo's busy body, byte for byte, as the filter sends it.
pub const BUSY_BODY: &str = r#"{"message":"Service temporarily unavailable: All workers are busy, please retry later","type":"service_unavailable","code":503}"#;

/// A reply without a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Local {
    pub status: u16,
    /// `x-kvgate-reason`, as the filter names it.
    pub reason: &'static str,
    pub body: String,
    pub retry_after_s: Option<u32>,
}

fn openai(status: u16, kind: &str, message: &str) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}}).to_string()
}

impl Local {
    pub fn bad_request(message: &str) -> Local {
        Local {
            status: 400,
            reason: "bad_request",
            body: openai(400, "invalid_request_error", message),
            retry_after_s: None,
        }
    }

    /// The plan's refusal; `model` as the request named it, and
    /// `default_retry_after_s` where the snapshot has no estimate.
    pub fn rejected(r: Rejection, model: &str, default_retry_after_s: u32) -> Local {
        let hint = |s: u32| if s == 0 { default_retry_after_s } else { s };
        match r {
            Rejection::UnknownModel => Local {
                status: 404,
                reason: "unknown_model",
                body: openai(
                    404,
                    "not_found_error",
                    &format!("The model '{model}' does not exist"),
                ),
                retry_after_s: None,
            },
            Rejection::NoWorkers => Local {
                status: 503,
                reason: "no_workers",
                body: openai(
                    503,
                    "service_unavailable",
                    &format!("Model '{model}' has no available workers"),
                ),
                retry_after_s: None,
            },
            Rejection::AllBusy { retry_after_s } => Local {
                status: 503,
                reason: "all_workers_busy",
                body: BUSY_BODY.to_string(),
                retry_after_s: Some(hint(retry_after_s)),
            },
            Rejection::Thermal { retry_after_s } => Local {
                status: 503,
                reason: "thermal",
                body: BUSY_BODY.to_string(),
                retry_after_s: Some(hint(retry_after_s)),
            },
        }
    }

    /// The reservation could not be booked: the server's fault, not the
    /// client's.
    pub fn internal(message: &str) -> Local {
        Local {
            status: 500,
            reason: "internal",
            body: openai(500, "internal_error", message),
            retry_after_s: None,
        }
    }

    pub fn into_response(self) -> ProcessingResponse {
        let mut headers = vec![
            set("content-type", "application/json"),
            set("x-kvgate-reason", self.reason),
        ];
        if let Some(s) = self.retry_after_s {
            headers.push(set("retry-after", &s.to_string()));
        }
        respond(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(self.status),
            }),
            headers: Some(HeaderMutation {
                set_headers: headers,
                remove_headers: Vec::new(),
            }),
            body: self.body.into_bytes(),
            details: format!("kvgate_{}", self.reason),
            grpc_status: None,
        }))
    }
}

/// Overwrites header `key` with `value`.
pub fn set(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            // Header values are bytes: Envoy takes them from `raw_value`
            // (tests/tests/extproc.rs checks it end to end).
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

fn respond(r: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..ProcessingResponse::default()
    }
}

fn common(mutation: Option<HeaderMutation>) -> Option<CommonResponse> {
    Some(CommonResponse {
        header_mutation: mutation,
        ..CommonResponse::default()
    })
}

/// Request headers: go on (Envoy sends the body next, as the processing
/// mode says).
pub fn request_headers() -> ProcessingResponse {
    respond(Response::RequestHeaders(HeadersResponse { response: None }))
}

/// Request body: go on, with these headers changed. The route cache is
/// kept: the route matches on the path, and the override-host balancer
/// reads the destination header after this filter, at host selection.
pub fn request_body(mutation: Option<HeaderMutation>) -> ProcessingResponse {
    respond(Response::RequestBody(BodyResponse {
        response: common(mutation),
    }))
}

pub fn response_headers(mutation: Option<HeaderMutation>) -> ProcessingResponse {
    respond(Response::ResponseHeaders(HeadersResponse {
        response: common(mutation),
    }))
}

pub fn response_body() -> ProcessingResponse {
    respond(Response::ResponseBody(BodyResponse { response: None }))
}

pub fn request_trailers() -> ProcessingResponse {
    respond(Response::RequestTrailers(TrailersResponse::default()))
}

pub fn response_trailers() -> ProcessingResponse {
    respond(Response::ResponseTrailers(TrailersResponse::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_reply_is_the_filters() {
        let r = Local::rejected(Rejection::AllBusy { retry_after_s: 0 }, "m", 2);
        assert_eq!(r.status, 503);
        assert_eq!(r.reason, "all_workers_busy");
        assert_eq!(r.retry_after_s, Some(2));
        let Some(Response::ImmediateResponse(i)) = r.into_response().response else {
            panic!("not an immediate response");
        };
        assert_eq!(i.body, BUSY_BODY.as_bytes());
        let headers = i.headers.unwrap_or_default().set_headers;
        let named = |k: &str| {
            headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .find(|h| h.key == k)
                .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
        };
        assert_eq!(
            named("x-kvgate-reason").as_deref(),
            Some("all_workers_busy")
        );
        assert_eq!(named("retry-after").as_deref(), Some("2"));
    }

    #[test]
    fn bad_request_is_openai_shaped() {
        let r = Local::bad_request("request body is not valid JSON");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
}
