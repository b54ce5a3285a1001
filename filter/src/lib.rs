//! kvgate-filter: the proxy-wasm module Envoy runs.
//!
//! One module, two roots (see `docs/architecture.md`):
//!
//! * `kvgate_snapshot_service` ([`service`]): a singleton on the main thread
//!   that long-polls the sidecar and writes snapshots and index shards into
//!   shared data;
//! * `kvgate_router` ([`router`]): the HTTP filter on every worker thread
//!   that, per request, routes to a worker or answers locally.
//!
//! Where only HTTP filters can be loaded (Envoy Gateway, Istio),
//! `"poller": "lease"` has one router root at a time play the service's
//! part instead ([`lease`], [`standby`]).
//!
//! The decision itself is `kvgate_core::plan`, shared with the sidecar's
//! selection API. What is left here is host-agnostic and tested natively
//! ([`config`], [`poller`], [`manifest`]) or thin glue over host calls
//! ([`host`], [`router`], [`service`]). The replies it sends itself
//! ([`reply`]) are core's, shared with the ext_proc server.
// Unsafe code only where the ABI is called directly (`host::abi`).
#![deny(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod admission;
mod config;
mod host;
mod lease;
mod manifest;
mod metrics;
mod poller;
mod reply;
mod router;
mod service;
mod standby;
mod view;

use config::{Config, PollerMode};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
use router::{Request, RouterState};
use service::Service;
use standby::Standby;
use std::cell::RefCell;
use std::rc::Rc;

pub const SERVICE_ROOT_ID: &str = "kvgate_snapshot_service";

/// A root is unconfigured until Envoy tells it which role it plays.
enum Root {
    Unconfigured,
    Service(Box<Service>),
    /// A router; in lease mode also a candidate poller.
    Router(Rc<RefCell<RouterState>>, Option<Box<Standby>>),
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        match self {
            Root::Service(s) => s.on_response(token, body_size),
            Root::Router(state, standby) => {
                router::held::on_callout_answer(state, &host::Abi, token, body_size);
                if let Some(standby) = standby {
                    standby.on_response(token, body_size);
                }
            }
            Root::Unconfigured => {}
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = match Config::parse(host::plugin_configuration().as_deref()) {
            Ok(c) => c,
            Err(e) => {
                host::log(LogLevel::Error, &format!("kvgate: {e}"));
                return false;
            }
        };
        let root_id = host::property(&["plugin_root_id"])
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        if root_id == SERVICE_ROOT_ID {
            if let Err(s) = host::set_tick_period(config.tick) {
                host::log(
                    LogLevel::Error,
                    &format!("kvgate: cannot set tick period: {s:?}"),
                );
                return false;
            }
            let mut svc = Service::new(config);
            svc.poll();
            *self = Root::Service(Box::new(svc));
        } else {
            if root_id != "kvgate_router" {
                host::log(
                    LogLevel::Info,
                    &format!(
                        "kvgate: root id {root_id:?} is not {SERVICE_ROOT_ID:?}; acting as the router"
                    ),
                );
            }
            let vm_id = host::property(&["plugin_vm_id"])
                .and_then(|b| String::from_utf8(b).ok())
                .unwrap_or_else(|| "kvgate".into());
            let standby = match config.poller {
                PollerMode::Singleton => None,
                PollerMode::Lease => Some(Box::new(Standby::new(config.clone()))),
            };
            // The root ticks to flush what its requests hold back and, in
            // lease mode, for the lease (which keeps its own pace).
            let tick = match (standby.is_some(), config.flush.is_zero()) {
                (false, true) => None,
                (false, false) => Some(config.flush),
                (true, true) => Some(config.tick),
                (true, false) => Some(config.flush.min(config.tick)),
            };
            // Held requests are looked at on the tick.
            let held_tick = config
                .admission
                .as_ref()
                .map(|a| std::time::Duration::from_millis(a.tick_ms));
            let tick = match (tick, held_tick) {
                (Some(t), Some(a)) => Some(t.min(a)),
                (t, a) => t.or(a),
            };
            if let Some(Err(s)) = tick.map(host::set_tick_period) {
                host::log(
                    LogLevel::Error,
                    &format!("kvgate: cannot set tick period: {s:?}"),
                );
                return false;
            }
            *self = Root::Router(
                Rc::new(RefCell::new(RouterState::new(&host::Abi, config, vm_id))),
                standby,
            );
        }
        true
    }

    fn on_tick(&mut self) {
        match self {
            Root::Service(s) => {
                s.poll();
                s.send_bookings();
            }
            Root::Router(state, standby) => {
                if let Ok(mut st) = state.try_borrow_mut() {
                    let h = &host::Abi;
                    st.release_orphans(h);
                    st.beat(h);
                    st.flush(h);
                    st.look_ahead(h);
                }
                router::held::on_tick(state, &host::Abi);
                if let Some(standby) = standby {
                    standby.on_tick();
                }
            }
            Root::Unconfigured => {}
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        match self {
            Root::Service(s) => s.on_queue_ready(queue_id),
            Root::Router(_, Some(standby)) => standby.on_queue_ready(queue_id),
            _ => {}
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK traps on `None`, so a root that is not a router (never
        // expected to see streams) still hands out a context that does
        // nothing.
        match self {
            Root::Router(state, _) => Some(Box::new(Request::new(state.clone(), context_id))),
            _ => Some(Box::new(PassThrough)),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct PassThrough;
impl Context for PassThrough {}
impl HttpContext for PassThrough {}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::Unconfigured) });
}}
