//! The router: the HTTP filter on Envoy's worker threads.
//!
//! Per request it reads the 32-byte manifest from shared data, re-decodes the
//! snapshot only when its version changed, and then decides from VM-local
//! memory: route (write the destination and rank headers) or answer locally.

use crate::config::{Config, OnStale};
use crate::decide::{Outcome, View, decide};
use crate::host;
use crate::manifest::{self, Manifest};
use crate::metrics::{RouterMetrics, inc, record};
use crate::overlap;
use crate::reply::Reply;
use crate::request::{Endpoint, parse};
use kvgate_core::approx::{self, Routed};
use kvgate_core::select::Policy;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;

/// State shared by the router root and its requests (one VM, one thread).
pub struct RouterState {
    pub config: Config,
    /// Envoy's vm_id, where the routed-decisions queue lives.
    vm_id: String,
    queue: Option<u32>,
    policy: Policy,
    view: View,
    metrics: RouterMetrics,
    tie_break: u64,
}

impl RouterState {
    pub fn new(config: Config, vm_id: String) -> RouterState {
        RouterState {
            config,
            vm_id,
            queue: None,
            policy: Policy::default(),
            view: View::default(),
            metrics: RouterMetrics::define(),
            // Each worker thread's VM starts at a different point, so two
            // VMs' first requests on an idle fleet do not pick the same rank.
            tie_break: host::now_us().wrapping_mul(0x9E37_79B9_7F4A_7C15),
        }
    }
}

/// Hands a routing decision to the snapshot service, which forwards it to
/// the sidecar's approximate index. The queue is resolved on first use: the
/// service registers it when it starts, possibly after this VM.
fn report(queue: &mut Option<u32>, vm_id: &str, metrics: &RouterMetrics, record: &Routed) {
    if queue.is_none() {
        *queue = host::resolve_routed_queue(vm_id);
    }
    let mut bytes = Vec::with_capacity(16 + record.hashes.len() * 8);
    record.encode_into(&mut bytes);
    match queue.map(|q| host::enqueue(q, &bytes)) {
        Some(Ok(())) => {}
        _ => {
            *queue = None;
            inc(metrics.report_errors);
        }
    }
}

pub struct Request {
    state: Rc<RefCell<RouterState>>,
    endpoint: Option<Endpoint>,
    manifest: Manifest,
    replied: bool,
}

impl Request {
    pub fn new(state: Rc<RefCell<RouterState>>) -> Request {
        Request {
            state,
            endpoint: None,
            manifest: Manifest::default(),
            replied: false,
        }
    }

    fn reply(&mut self, r: &Reply) -> Action {
        let st = self.state.borrow();
        st.metrics.rejected(r.reason);
        if let Err(status) = host::send_reply(r) {
            host::log(
                LogLevel::Error,
                &format!("kvgate: local reply failed: {status:?}"),
            );
        }
        self.replied = true;
        Action::Pause
    }

    fn route(&mut self, body_size: usize) -> Action {
        let started = host::now_us();
        let Some(endpoint) = self.endpoint else {
            return Action::Continue;
        };
        let body = host::request_body(body_size).unwrap_or_default();
        let req = match parse(endpoint, &body) {
            Ok(r) => r,
            Err(e) => return self.reply(&Reply::bad_request(&e.0)),
        };
        let mut guard = self.state.borrow_mut();
        let st = &mut *guard;
        let version = self.manifest.snapshot_version;
        if let Err(e) = st
            .view
            .refresh(version, || host::get_shared(manifest::SNAPSHOT_KEY))
        {
            inc(st.metrics.snapshot_decode_errors);
            host::log(
                LogLevel::Error,
                &format!("kvgate: snapshot {version} does not decode: {e}"),
            );
        }
        let Some(snap) = st.view.snapshot.as_ref() else {
            drop(guard);
            return self.reply(&Reply::stale());
        };
        st.tie_break = st.tie_break.wrapping_add(1);
        let selecting = host::now_us();
        // Token prompts: exact overlap from the engines' events. Text
        // prompts: the approximate index learned from earlier decisions.
        let mut chunks = Vec::new();
        let table = match (
            req.tokens.as_deref(),
            req.text.as_deref(),
            snap.model(&req.model),
        ) {
            (Some(tokens), _, Some(model)) => overlap::compute(model, tokens, host::get_shared).0,
            (None, Some(text), Some(model)) => {
                chunks = approx::chunk_hashes(text);
                overlap::approximate(model, &chunks, host::get_shared)
            }
            _ => Vec::new(),
        };
        let approximate = !chunks.is_empty();
        let outcome = decide(&st.config, &st.policy, snap, &req, st.tie_break, |w, r| {
            let o = overlap::of(&table, r.slot);
            if approximate {
                overlap::chunks_as_blocks(o, w.block_size)
            } else {
                o
            }
        });
        record(
            st.metrics.selection_us,
            host::now_us().saturating_sub(selecting),
        );
        let action = match outcome {
            Outcome::Route {
                worker,
                rank,
                set_rank,
            } => {
                let c = &st.config;
                let mut ok =
                    host::set_request_header(&c.destination_header, &worker.endpoint).is_ok();
                ok &= if set_rank {
                    host::set_request_header(&c.rank_header, &rank.rank.to_string()).is_ok()
                } else {
                    host::remove_request_header(&c.rank_header).is_ok()
                };
                if !ok {
                    host::log(LogLevel::Error, "kvgate: could not set routing headers");
                }
                inc(st.metrics.routed);
                if !chunks.is_empty() {
                    let record = Routed {
                        model: req.model.clone(),
                        slot: rank.slot,
                        hashes: std::mem::take(&mut chunks),
                    };
                    report(&mut st.queue, &st.vm_id, &st.metrics, &record);
                }
                None
            }
            Outcome::Reply(r) => Some(r),
        };
        record(
            st.metrics.decision_us,
            host::now_us().saturating_sub(started),
        );
        drop(guard);
        match action {
            None => Action::Continue,
            Some(r) => self.reply(&r),
        }
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let method = host::request_header(":method");
        let path = host::request_header(":path").unwrap_or_default();
        let endpoint = match method.as_deref() {
            Some("POST") => Endpoint::from_path(&path),
            _ => None,
        };
        let Some(endpoint) = endpoint else {
            return Action::Continue;
        };
        self.endpoint = Some(endpoint);
        let (cfg_dest, cfg_fallback, stale_after, on_stale) = {
            let st = self.state.borrow();
            inc(st.metrics.requests);
            let c = &st.config;
            (
                c.destination_header.clone(),
                c.fallback_header.clone(),
                c.stale_after_ms,
                c.on_stale,
            )
        };
        // Routing headers are ours alone: a client's copy never steers.
        let _ = host::remove_request_header(&cfg_dest);
        if host::request_header(&cfg_fallback).is_some() {
            let _ = host::remove_request_header(&cfg_fallback);
            // The route was matched on the client's header; match again.
            let _ = host::clear_route_cache();
        }
        self.manifest = host::get_shared(manifest::KEY)
            .and_then(|b| Manifest::decode(&b))
            .unwrap_or_default();
        if !self.manifest.is_fresh(host::now_ms(), stale_after) {
            return match on_stale {
                OnStale::FailClosed => self.reply(&Reply::stale()),
                OnStale::FailOpen => {
                    inc(self.state.borrow().metrics.failed_open);
                    self.endpoint = None;
                    let _ = host::set_request_header(&cfg_fallback, "stale");
                    if let Err(s) = host::clear_route_cache() {
                        host::log(
                            LogLevel::Warn,
                            &format!("kvgate: clear_route_cache failed: {s:?}"),
                        );
                    }
                    Action::Continue
                }
            };
        }
        if end_of_stream {
            return self.reply(&Reply::bad_request("a request body is required"));
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.endpoint.is_none() || self.replied {
            return Action::Continue;
        }
        let limit = self.state.borrow().config.max_body_bytes;
        if body_size > limit {
            return self.reply(&Reply::too_large(limit));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.route(body_size)
    }
}
