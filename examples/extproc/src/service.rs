//! The ext_proc service: one gRPC stream per HTTP request, answered
//! message by message.
//!
//! Processing mode (set in Envoy's filter configuration, see
//! `tests/stack/src/envoy.rs`): request headers SEND, request body
//! BUFFERED, response headers SEND, response body NONE, trailers SKIP.
//! The decision needs the whole body (model, prompt), so the body comes
//! buffered in one message, as the filter reads it whole; the response
//! headers are the first byte (prefill done, as the filter releases its
//! prefill booking there); nothing else is needed, so nothing else
//! crosses the stream. The reservation is freed when Envoy closes the
//! stream, which it does when the HTTP request ends, however it ends.
//!
//! What follows the placement is `kvgate_core::dispatch`'s, as in the
//! filter, for a door that makes no callout: a disaggregated model's body
//! is replaced by the client's without its transfer fields (with its
//! `content-length`) and `x-request-id` by kvgate's; a request the model
//! would split goes whole to the decode worker or is refused 503
//! `prefill_failed`, as its `on_prefill_failure` (and SGLang) says
//! (`kvgate_sidecar::api::route`).
//!
//! Where it differs from the filter: no prefill leg, as above; a request
//! Envoy retries on the runner-up (the first worker refused the
//! connection) keeps its reservation on the first, where the filter moves
//! its booking; and a shed request gets the busy 503 without the filter's
//! place in the retry queue (`retry_headroom_pct`).

use crate::reply;
use crate::templates::{Rendered, Templates};
use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use futures::Stream;
use kvgate_core::DEFAULT_TENANT;
use kvgate_core::header;
use kvgate_core::plan::request::{Endpoint, parse};
use kvgate_core::reply::Reply;
use kvgate_sidecar::Sidecar;
use kvgate_sidecar::api::route::{self, RouteError};
use std::pin::Pin;
use std::sync::Arc;
use tonic::{Status, Streaming};

/// Header names, as the filter's configuration has them.
#[derive(Debug, Clone)]
pub struct Names {
    pub destination: String,
    pub rank: String,
    pub tenant: String,
    /// Empty: not sent.
    pub served_by: String,
    /// `Retry-After` when the snapshot has no estimate.
    pub retry_after_s: u32,
}

impl Default for Names {
    fn default() -> Names {
        Names {
            destination: header::DESTINATION.into(),
            rank: header::RANK.into(),
            tenant: header::TENANT.into(),
            served_by: header::SERVED_BY.into(),
            retry_after_s: 1,
        }
    }
}

/// What every stream shares.
pub struct Shared {
    pub sidecar: Arc<Sidecar>,
    pub names: Names,
    pub templates: Templates,
}

pub struct Processor {
    shared: Arc<Shared>,
}

impl Processor {
    pub fn new(shared: Shared) -> Processor {
        Processor {
            shared: Arc::new(shared),
        }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let inbound = request.into_inner();
        let exchange = Exchange::new(self.shared.clone());
        // No task or channel per stream: the answers are produced as the
        // response stream is polled, and the exchange (with its
        // reservation) is dropped when either side ends the stream.
        let answers = futures::stream::unfold(Some((inbound, exchange)), |state| async move {
            let (mut inbound, mut ex) = state?;
            match inbound.message().await {
                Ok(Some(m)) => match ex.answer(m) {
                    Ok(r) => Some((Ok(r), Some((inbound, ex)))),
                    // The stream ends with the error after it.
                    Err(s) => Some((Err(s), None)),
                },
                Ok(None) => None,
                Err(s) => {
                    tracing::debug!(status = %s, "ext_proc stream ended by Envoy");
                    None
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}

/// One HTTP request's conversation.
struct Exchange {
    shared: Arc<Shared>,
    /// Set when the request is one kvgate routes.
    endpoint: Option<Endpoint>,
    tenant: String,
    decided: bool,
    reservation: Option<Reservation>,
}

/// A booked request; freed on drop, so that every way a stream ends
/// frees it.
struct Reservation {
    sidecar: Arc<Sidecar>,
    id: String,
    prefilled: bool,
    served_by: String,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Err(e) = route::free(self.sidecar.selection(), &self.id) {
            tracing::warn!(reservation = self.id, error = %e, "freeing a reservation");
        }
    }
}

impl Exchange {
    fn new(shared: Arc<Shared>) -> Exchange {
        Exchange {
            shared,
            endpoint: None,
            tenant: String::new(),
            decided: false,
            reservation: None,
        }
    }

    /// The answer to one message. A message Envoy would not send in this
    /// processing mode still gets the answer its kind expects, so that a
    /// differently configured filter degrades to pass-through.
    fn answer(&mut self, m: ProcessingRequest) -> Result<ProcessingResponse, Status> {
        match m.request {
            Some(Request::RequestHeaders(h)) => Ok(self.request_headers(&h)),
            Some(Request::RequestBody(b)) => Ok(self.request_body(&b)),
            Some(Request::ResponseHeaders(_)) => Ok(self.response_headers()),
            Some(Request::ResponseBody(_)) => Ok(reply::response_body()),
            Some(Request::RequestTrailers(_)) => Ok(reply::request_trailers()),
            Some(Request::ResponseTrailers(_)) => Ok(reply::response_trailers()),
            None => Err(Status::invalid_argument(
                "a processing request names no phase",
            )),
        }
    }

    fn request_headers(&mut self, h: &HttpHeaders) -> ProcessingResponse {
        let headers = h.headers.as_ref();
        let method = header(headers, ":method");
        let path = header(headers, ":path").unwrap_or_default();
        self.endpoint = match method.as_deref() {
            Some("POST") => Endpoint::from_path(&path),
            _ => None,
        };
        if self.endpoint.is_none() {
            return reply::request_headers();
        }
        self.tenant = header(headers, &self.shared.names.tenant)
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| DEFAULT_TENANT.to_string());
        if h.end_of_stream {
            return reply::immediate(&Reply::bad_request("a request body is required"));
        }
        reply::request_headers()
    }

    fn request_body(&mut self, b: &HttpBody) -> ProcessingResponse {
        let Some(endpoint) = self.endpoint else {
            return reply::request_body(None);
        };
        // Buffered mode sends the body whole, once; anything after the
        // decision passes.
        if self.decided {
            return reply::request_body(None);
        }
        self.decided = true;
        let mut req = match parse(endpoint, &b.body) {
            Ok(r) => r,
            Err(e) => return reply::immediate(&Reply::bad_request(&e.0)),
        };
        let sc = &self.shared.sidecar;
        if req.tokens.is_none() {
            let version = sc
                .store()
                .snapshot()
                .model(&req.model)
                .map_or(0, |m| m.prompt_template);
            if version != 0 {
                let unix_s = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                let r = self
                    .shared
                    .templates
                    .render(sc, version, &mut req, &b.body, unix_s);
                if r != Rendered::Yes {
                    tracing::debug!(model = req.model, outcome = ?r, "prompt not rendered");
                }
            }
        }
        let names = &self.shared.names;
        match route::route_and_reserve(sc.selection(), &req, &self.tenant, &b.body) {
            Ok(routed) => {
                let mut set = vec![reply::set(&names.destination, &routed.destination)];
                let mut remove = Vec::new();
                match routed.rank {
                    Some(r) => set.push(reply::set(&names.rank, &r.to_string())),
                    None => remove.push(names.rank.clone()),
                }
                if let Some(id) = &routed.request_id {
                    set.push(reply::set(header::REQUEST_ID, id));
                }
                if let Some(body) = &routed.body {
                    set.push(reply::set("content-length", &body.len().to_string()));
                }
                self.reservation = Some(Reservation {
                    sidecar: sc.clone(),
                    id: routed.reservation_id,
                    prefilled: false,
                    served_by: format!(
                        "worker_id={}; dp_rank={}",
                        routed.worker_id, routed.dp_rank
                    ),
                });
                let mutation = HeaderMutation {
                    set_headers: set,
                    remove_headers: remove,
                };
                match routed.body {
                    Some(body) => reply::request_body_replaced(mutation, body),
                    None => reply::request_body(Some(mutation)),
                }
            }
            Err(RouteError::Refused(r)) => {
                reply::immediate(&Reply::rejected(r, &req.model, names.retry_after_s))
            }
            Err(RouteError::Unservable(r)) => reply::immediate(&r),
            Err(RouteError::Ledger(e)) => {
                tracing::error!(error = %e, "the ledger refused a reservation");
                reply::immediate(&Reply::internal("the gateway could not book the request"))
            }
        }
    }

    fn response_headers(&mut self) -> ProcessingResponse {
        let Some(r) = self.reservation.as_mut() else {
            return reply::response_headers(None);
        };
        if !r.prefilled {
            r.prefilled = true;
            if let Err(e) = route::prefill_complete(r.sidecar.selection(), &r.id) {
                tracing::warn!(reservation = r.id, error = %e, "prefill completion");
            }
        }
        let served_by = &self.shared.names.served_by;
        if served_by.is_empty() {
            return reply::response_headers(None);
        }
        reply::response_headers(Some(HeaderMutation {
            set_headers: vec![reply::set(served_by, &r.served_by)],
            remove_headers: Vec::new(),
        }))
    }
}

/// A header's value; Envoy sends values as bytes in `raw_value` (older
/// versions in `value`).
fn header(map: Option<&HeaderMap>, name: &str) -> Option<String> {
    let h = map?.headers.iter().find(|h| h.key == name)?;
    if h.raw_value.is_empty() {
        Some(h.value.clone())
    } else {
        String::from_utf8(h.raw_value.clone()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderValue;

    #[test]
    fn headers_are_read_from_raw_value_or_value() {
        let map = HeaderMap {
            headers: vec![
                HeaderValue {
                    key: ":path".into(),
                    raw_value: b"/v1/completions".to_vec(),
                    ..HeaderValue::default()
                },
                HeaderValue {
                    key: ":method".into(),
                    value: "POST".into(),
                    ..HeaderValue::default()
                },
            ],
        };
        assert_eq!(
            header(Some(&map), ":path").as_deref(),
            Some("/v1/completions")
        );
        assert_eq!(header(Some(&map), ":method").as_deref(), Some("POST"));
        assert_eq!(header(Some(&map), "x-none"), None);
        assert_eq!(header(None, ":path"), None);
    }
}
