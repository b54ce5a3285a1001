//! What the server answers Envoy: header mutations for a routed request,
//! and the local replies the filter sends itself (`kvgate_core::reply`),
//! rendered as ext_proc immediate responses.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, TrailersResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use kvgate_core::reply::Reply;

/// A local reply as an immediate response: its status, headers and body,
/// with the reason in Envoy's response details.
pub fn immediate(r: &Reply) -> ProcessingResponse {
    let headers = r.headers().iter().map(|(k, v)| set(k, v)).collect();
    respond(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(r.status),
        }),
        headers: Some(HeaderMutation {
            set_headers: headers,
            remove_headers: Vec::new(),
        }),
        body: r.body.clone().into_bytes(),
        details: format!("kvgate_{}", r.reason.as_str()),
        grpc_status: None,
    }))
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

/// Request body: go on with `body` in place of the client's, and these
/// headers changed. In BUFFERED mode Envoy leaves `content-length` to the
/// processor when it replaces a body, so `mutation` must set it.
pub fn request_body_replaced(mutation: HeaderMutation, body: Vec<u8>) -> ProcessingResponse {
    respond(Response::RequestBody(BodyResponse {
        response: Some(CommonResponse {
            header_mutation: Some(mutation),
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::Body(body)),
            }),
            ..CommonResponse::default()
        }),
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
    use kvgate_core::plan::Rejection;

    #[test]
    fn a_replaced_body_goes_with_its_headers() {
        let mutation = HeaderMutation {
            set_headers: vec![set("content-length", "2")],
            remove_headers: Vec::new(),
        };
        let Some(Response::RequestBody(b)) =
            request_body_replaced(mutation.clone(), b"{}".to_vec()).response
        else {
            panic!("not a request-body response");
        };
        let c = b.response.expect("a common response");
        assert_eq!(c.header_mutation, Some(mutation));
        assert_eq!(
            c.body_mutation.and_then(|m| m.mutation),
            Some(Mutation::Body(b"{}".to_vec()))
        );
        // CONTINUE (0): the rest of the exchange goes on as for any body.
        assert_eq!(c.status, 0);
    }

    /// The immediate response carries the core reply unchanged.
    #[test]
    fn replies_are_rendered_faithfully() {
        for r in [
            Reply::rejected(Rejection::AllBusy { retry_after_s: 0 }, "m", 2),
            Reply::bad_request("request body is not valid JSON"),
            Reply::internal("no booking"),
        ] {
            let Some(Response::ImmediateResponse(i)) = immediate(&r).response else {
                panic!("not an immediate response");
            };
            assert_eq!(i.status.map(|s| s.code), Some(i32::from(r.status)));
            assert_eq!(i.body, r.body.as_bytes());
            assert_eq!(i.details, format!("kvgate_{}", r.reason.as_str()));
            let headers: Vec<(String, String)> = i
                .headers
                .unwrap_or_default()
                .set_headers
                .into_iter()
                .filter_map(|h| h.header)
                .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                .collect();
            let want: Vec<(String, String)> = r
                .headers()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            assert_eq!(headers, want);
        }
    }
}
