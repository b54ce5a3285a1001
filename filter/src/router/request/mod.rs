//! One request through the router: its routing headers, its decision, and
//! its bookings from the decision to the end of the response.
//!
//! The decision runs in three steps: [`decide::prepare`] (view, settle,
//! template), [`decide::decide`] (gather once, place, and dispatch through
//! `kvgate_core::dispatch`, which owns every rule after placement) and the
//! [`flow`] that applies it (headers, report, bookings, clocks). The
//! request's life is a state machine ([`flow::Stage`]) written against
//! [`Host`](crate::host::Host): [`Request`] is the proxy-wasm context that
//! hands it Envoy's host, and the tests hand it their own.
//!
//! A disaggregated request books both legs, calls its prefill worker from
//! its own context, and on the answer goes on to the decode worker with the
//! prefill's transfer parameters in its body; a failed leg is tried once on
//! the runner-up, then prefilled on the decode worker or answered 503, as
//! the model says. An SGLang request sends both legs at once, one body with
//! its bootstrap room, and drains the prefill's answer ([`legs`]; answers
//! judged in [`prefill`]).

mod decide;
mod flow;
mod legs;
mod prefill;
mod stopwatch;
#[cfg(test)]
mod tests;
mod usage;

use super::RouterState;
use crate::host::Abi;
pub(crate) use flow::{Flow, Retried};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;
pub(crate) use usage::Usage;

/// A request's proxy-wasm context: Envoy's callbacks, handed to its
/// [`Flow`] with Envoy's host. The flow is shared so that the root can
/// reach a request it holds ([`super::held`]); callbacks do not nest, so
/// a borrow that fails is a callback with nothing to do.
pub struct Request {
    flow: Rc<RefCell<Flow>>,
}

impl Request {
    pub fn new(state: Rc<RefCell<RouterState>>, context_id: u32) -> Request {
        Request {
            flow: Flow::shared(state, context_id),
        }
    }
}

impl Context for Request {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Ok(mut f) = self.flow.try_borrow_mut() {
            f.on_callout_answer(&Abi, token_id, body_size);
        }
    }
}

impl Drop for Request {
    /// The backstop: a context Envoy deletes without a log callback still
    /// releases what it booked.
    fn drop(&mut self) {
        if let Ok(mut f) = self.flow.try_borrow_mut() {
            f.end(&Abi);
        }
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        match self.flow.try_borrow_mut() {
            Ok(mut f) => f.on_request_headers(&Abi, end_of_stream),
            // Never undecided to a worker: callbacks do not nest, so this
            // is not expected, and the request waits rather than pass.
            Err(_) => Action::Pause,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.flow.try_borrow_mut() {
            Ok(mut f) => f.on_request_body(&Abi, body_size, end_of_stream),
            // Never undecided to a worker: callbacks do not nest, so this
            // is not expected, and the request waits rather than pass.
            Err(_) => Action::Pause,
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        match self.flow.try_borrow_mut() {
            Ok(mut f) => f.on_request_trailers(&Abi),
            // Never undecided to a worker: callbacks do not nest, so this
            // is not expected, and the request waits rather than pass.
            Err(_) => Action::Pause,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        match self.flow.try_borrow_mut() {
            Ok(mut f) => f.on_response_headers(&Abi),
            Err(_) => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.flow.try_borrow_mut() {
            Ok(mut f) => f.on_response_body(&Abi, body_size, end_of_stream),
            Err(_) => Action::Continue,
        }
    }

    fn on_log(&mut self) {
        if let Ok(mut f) = self.flow.try_borrow_mut() {
            f.on_log(&Abi);
        }
    }
}
