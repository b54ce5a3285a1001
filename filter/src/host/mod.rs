//! Host calls, wrapped so that every failure is a value.
//!
//! Every call but one goes through [`abi`], which never panics: a status
//! the SDK would trap on (Envoy returns some in ordinary operation, e.g.
//! `BadArgument` for the headers of a callout answer that has none) and a
//! value that is not UTF-8 are errors here, and the callers decide what a
//! failure means (usually: log, count, take the safe path). The one call
//! left to the SDK is [`dispatch`]: only the SDK can register a callout
//! with its dispatcher, which routes the answer to the context that made
//! it; it panics only on a status Envoy's `httpCall` never returns.

mod abi;

use crate::reply::Reply;
pub use abi::Fault;
use proxy_wasm::hostcalls;
use proxy_wasm::types::LogLevel;
use std::time::Duration;

pub fn log(level: LogLevel, msg: &str) {
    let _ = abi::log(level as u32, msg);
}

fn now() -> Duration {
    Duration::from_nanos(abi::now_ns().unwrap_or_default())
}

pub fn now_ms() -> u64 {
    now().as_millis() as u64
}

pub fn now_us() -> u64 {
    now().as_micros() as u64
}

pub fn get_shared(key: &str) -> Option<Vec<u8>> {
    abi::get_shared_data(key).ok().and_then(|(v, _)| v)
}

pub fn set_shared(key: &str, value: &[u8]) -> Result<(), Fault> {
    abi::set_shared_data(key, value, 0)
}

/// A shared-data value with its compare-and-swap token.
pub fn get_shared_cas(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    match abi::get_shared_data(key) {
        Ok((value, cas)) => (value, (cas != 0).then_some(cas)),
        Err(_) => (None, None),
    }
}

/// Writes `value` unless the key changed since `cas` was read.
pub fn set_shared_cas(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Fault> {
    abi::set_shared_data(key, value, cas.unwrap_or(0))
}

/// Rewrites a shared-data value that other VMs may be rewriting too:
/// `f` maps the current value to the new one (None: leave it), and the
/// write is retried on a compare-and-swap mismatch, a few times at most.
/// Returns whether a write went through.
pub fn update_shared(key: &str, f: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>) -> bool {
    update(key, false, f)
}

/// [`update_shared`] of a value that must already exist: nothing is
/// written to a missing key. A write to a missing key is not checked by
/// compare-and-swap (Envoy creates it, whatever the token), so two VMs
/// creating one at once would each overwrite the other's; a value whose
/// every write must be checked is created once, by one writer, first.
pub fn update_existing(key: &str, f: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>) -> bool {
    update(key, true, f)
}

fn update(key: &str, existing: bool, mut f: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>) -> bool {
    for _ in 0..4 {
        let (value, cas) = get_shared_cas(key);
        if existing && cas.is_none() {
            return false;
        }
        let Some(new) = f(value.as_deref()) else {
            return false;
        };
        match set_shared_cas(key, &new, cas) {
            Ok(()) => return true,
            Err(Fault::CAS_MISMATCH) => continue,
            Err(_) => return false,
        }
    }
    false
}

/// A header's value; `None` when absent, unreadable (no such map now:
/// a callout answer without headers) or not UTF-8.
fn header(map: u32, name: &str) -> Option<String> {
    abi::get_map_value(map, name)
        .ok()
        .flatten()
        .and_then(|v| String::from_utf8(v).ok())
}

pub fn request_header(name: &str) -> Option<String> {
    header(abi::MAP_REQUEST_HEADERS, name)
}

pub fn set_request_header(name: &str, value: &str) -> Result<(), Fault> {
    abi::set_map_value(abi::MAP_REQUEST_HEADERS, name, value)
}

pub fn response_header(name: &str) -> Option<String> {
    header(abi::MAP_RESPONSE_HEADERS, name)
}

pub fn set_response_header(name: &str, value: &str) -> Result<(), Fault> {
    abi::set_map_value(abi::MAP_RESPONSE_HEADERS, name, value)
}

pub fn remove_request_header(name: &str) -> Result<(), Fault> {
    abi::remove_map_value(abi::MAP_REQUEST_HEADERS, name)
}

pub fn request_body(size: usize) -> Option<Vec<u8>> {
    abi::get_buffer(abi::BUFFER_REQUEST_BODY, 0, size)
        .ok()
        .flatten()
}

/// The response body chunk Envoy has buffered now.
pub fn response_body(size: usize) -> Option<Vec<u8>> {
    abi::get_buffer(abi::BUFFER_RESPONSE_BODY, 0, size)
        .ok()
        .flatten()
}

/// Replaces the whole buffered request body (Envoy drains the buffer and
/// writes `body` when the range starts at 0 and is not empty). The caller
/// sets `content-length` to match.
pub fn set_request_body(body: &[u8]) -> Result<(), Fault> {
    abi::set_buffer(abi::BUFFER_REQUEST_BODY, 0, usize::MAX, body)
}

/// Lets a request paused in a request callback go on to the upstream.
pub fn resume_request() -> Result<(), Fault> {
    abi::continue_request()
}

pub fn plugin_configuration() -> Option<Vec<u8>> {
    abi::get_buffer(abi::BUFFER_PLUGIN_CONFIGURATION, 0, usize::MAX)
        .ok()
        .flatten()
}

pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    abi::get_property(path).ok().flatten()
}

/// Answers the client with a worker's answer, as it came.
pub fn send_response(status: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<(), Fault> {
    abi::send_local_response(u32::from(status), headers, body)
}

/// Makes Envoy match the route again after routing headers changed.
pub fn clear_route_cache() -> Result<(), Fault> {
    abi::call_foreign_function("clear_route_cache", &[]).map(|_| ())
}

/// Calls `cluster` from the current context: the answer goes to that
/// context's `on_http_call_response` (the root's, or a request's, which
/// stays paused until it resumes).
pub fn dispatch(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<u32, Fault> {
    hostcalls::dispatch_http_call(cluster, headers, body, vec![], timeout)
        .map_err(|s| Fault(s as u32))
}

/// Gets `path`; `authorization` is a whole header value.
pub fn dispatch_get(
    cluster: &str,
    authority: &str,
    path: &str,
    authorization: Option<&str>,
    timeout: Duration,
) -> Result<u32, Fault> {
    let headers = call_headers("GET", authority, path, authorization, None);
    dispatch(cluster, headers, None, timeout)
}

/// Posts `body`; `authorization` is a whole header value.
pub fn dispatch_post(
    cluster: &str,
    authority: &str,
    path: &str,
    authorization: Option<&str>,
    body: &[u8],
    timeout: Duration,
) -> Result<u32, Fault> {
    let content_type = Some("application/octet-stream");
    let headers = call_headers("POST", authority, path, authorization, content_type);
    dispatch(cluster, headers, Some(body), timeout)
}

/// A callout's headers: the pseudo-headers first, as HTTP/2 requires.
fn call_headers<'a>(
    method: &'a str,
    authority: &'a str,
    path: &'a str,
    authorization: Option<&'a str>,
    content_type: Option<&'a str>,
) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        (":method", method),
        (":path", path),
        (":authority", authority),
    ];
    if let Some(t) = content_type {
        headers.push(("content-type", t));
    }
    if let Some(a) = authorization {
        headers.push(("authorization", a));
    }
    headers
}

/// The queue routing decisions travel through, from router VMs to the
/// snapshot service.
pub const ROUTED_QUEUE: &str = "kvgate.routed";
/// The queue load bookings (and local replies) travel through.
pub const BOOKINGS_QUEUE: &str = "kvgate.bookings";

pub fn register_queue(name: &str) -> Result<u32, Fault> {
    abi::register_shared_queue(name)
}

pub fn resolve_queue(vm_id: &str, name: &str) -> Option<u32> {
    abi::resolve_shared_queue(vm_id, name).ok()
}

/// A number no one outside the VM can predict: std's `RandomState` keys
/// SipHash from WASI `random_get` once per thread and steps one key per
/// call, so each call is a keyed hash under a secret key; distinct
/// calls give unrelated numbers.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_us());
    h.finish()
}

pub fn enqueue(queue: u32, data: &[u8]) -> Result<(), Fault> {
    abi::enqueue_shared_queue(queue, data)
}

pub fn dequeue(queue: u32) -> Option<Vec<u8>> {
    abi::dequeue_shared_queue(queue).ok().flatten()
}

/// A callout answer's header; `None` also for an answer without headers
/// (a reset, a timeout, an answer past Envoy's buffer), which callers
/// take as a reset.
pub fn call_response_header(name: &str) -> Option<String> {
    header(abi::MAP_CALL_RESPONSE_HEADERS, name)
}

pub fn call_response_body(size: usize) -> Option<Vec<u8>> {
    abi::get_buffer(abi::BUFFER_CALL_RESPONSE_BODY, 0, size)
        .ok()
        .flatten()
}

pub fn set_tick_period(period: Duration) -> Result<(), Fault> {
    abi::set_tick_period_ms(u32::try_from(period.as_millis()).unwrap_or(u32::MAX))
}

pub fn define_metric(kind: u32, name: &str) -> Option<u32> {
    abi::define_metric(kind, name).ok()
}

pub fn increment_metric(id: u32, offset: i64) {
    let _ = abi::increment_metric(id, offset);
}

pub fn record_metric(id: u32, value: u64) {
    let _ = abi::record_metric(id, value);
}

/// Maps a shared-data value to its new value (`None`: leave it).
pub type Rewrite<'a> = dyn FnMut(Option<&[u8]>) -> Option<Vec<u8>> + 'a;

/// What a request's logic asks of its host: the clock and randomness,
/// shared data and the VMs' queues, the request's headers and body, a
/// callout and its answer, resuming a paused request, a local reply, and
/// metrics. The router's request path and the state it shares are
/// written against this trait: [`Abi`] is the one implementation that
/// calls proxy-wasm, and tests drive the same logic natively with one
/// of their own.
pub trait Host {
    fn log(&self, level: LogLevel, msg: &str);
    /// Envoy's clock, in µs.
    fn now_us(&self) -> u64;
    fn now_ms(&self) -> u64 {
        self.now_us() / 1000
    }
    /// A number no one outside the VM can predict.
    fn random_u64(&self) -> u64;

    fn get_shared(&self, key: &str) -> Option<Vec<u8>>;
    /// Rewrites a shared-data value other VMs may be rewriting too (see
    /// [`update_shared`]); whether a write went through.
    fn update_shared(&self, key: &str, f: &mut Rewrite<'_>) -> bool;
    /// The same, of a value that must already exist (see
    /// [`update_existing`]).
    fn update_existing(&self, key: &str, f: &mut Rewrite<'_>) -> bool;
    fn resolve_queue(&self, vm_id: &str, name: &str) -> Option<u32>;
    fn enqueue(&self, queue: u32, data: &[u8]) -> Result<(), Fault>;

    fn request_header(&self, name: &str) -> Option<String>;
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), Fault>;
    fn remove_request_header(&self, name: &str) -> Result<(), Fault>;
    fn response_header(&self, name: &str) -> Option<String>;
    fn set_response_header(&self, name: &str, value: &str) -> Result<(), Fault>;
    fn request_body(&self, size: usize) -> Option<Vec<u8>>;
    /// The response body chunk of the current callback.
    fn response_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Replaces the buffered body; the caller sets `content-length`.
    fn set_request_body(&self, body: &[u8]) -> Result<(), Fault>;
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    fn clear_route_cache(&self) -> Result<(), Fault>;

    /// Calls `cluster` from the current request's context; the answer
    /// comes to that context, under the returned token.
    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Fault>;
    fn call_response_header(&self, name: &str) -> Option<String>;
    fn call_response_body(&self, size: usize) -> Option<Vec<u8>>;

    /// Lets the current request, paused in a request callback, go on.
    fn resume_request(&self) -> Result<(), Fault>;
    /// Makes another request's context the one later calls act on (its
    /// headers, body, reply), until the current callback returns: how a
    /// root's tick, or another request, reaches a held request.
    fn set_effective_context(&self, context_id: u32) -> Result<(), Fault>;
    fn send_response(
        &self,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Fault>;
    fn send_reply(&self, r: &Reply) -> Result<(), Fault> {
        let headers = r.headers();
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        self.send_response(r.status, &headers, r.body.as_bytes())
    }

    fn define_metric(&self, kind: u32, name: &str) -> Option<u32>;
    fn increment_metric(&self, id: u32, offset: i64);
    fn record_metric(&self, id: u32, value: u64);
    /// Counts one on a metric that may not be defined.
    fn count(&self, id: Option<u32>) {
        if let Some(id) = id {
            self.increment_metric(id, 1);
        }
    }
    /// Moves a gauge that may not be defined.
    fn add(&self, id: Option<u32>, by: i64) {
        if let Some(id) = id {
            self.increment_metric(id, by);
        }
    }
    /// Samples a histogram that may not be defined.
    fn sample(&self, id: Option<u32>, value: u64) {
        if let Some(id) = id {
            self.record_metric(id, value);
        }
    }
}

/// The proxy-wasm host: Envoy's.
#[derive(Debug, Clone, Copy, Default)]
pub struct Abi;

impl Host for Abi {
    fn log(&self, level: LogLevel, msg: &str) {
        log(level, msg);
    }
    fn now_us(&self) -> u64 {
        now_us()
    }
    fn now_ms(&self) -> u64 {
        now_ms()
    }
    fn random_u64(&self) -> u64 {
        random_u64()
    }
    fn get_shared(&self, key: &str) -> Option<Vec<u8>> {
        get_shared(key)
    }
    fn update_shared(&self, key: &str, f: &mut Rewrite<'_>) -> bool {
        update_shared(key, f)
    }
    fn update_existing(&self, key: &str, f: &mut Rewrite<'_>) -> bool {
        update_existing(key, f)
    }
    fn resolve_queue(&self, vm_id: &str, name: &str) -> Option<u32> {
        resolve_queue(vm_id, name)
    }
    fn enqueue(&self, queue: u32, data: &[u8]) -> Result<(), Fault> {
        enqueue(queue, data)
    }
    fn request_header(&self, name: &str) -> Option<String> {
        request_header(name)
    }
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), Fault> {
        set_request_header(name, value)
    }
    fn remove_request_header(&self, name: &str) -> Result<(), Fault> {
        remove_request_header(name)
    }
    fn response_header(&self, name: &str) -> Option<String> {
        response_header(name)
    }
    fn set_response_header(&self, name: &str, value: &str) -> Result<(), Fault> {
        set_response_header(name, value)
    }
    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        request_body(size)
    }
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        response_body(size)
    }
    fn set_request_body(&self, body: &[u8]) -> Result<(), Fault> {
        set_request_body(body)
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        property(path)
    }
    fn clear_route_cache(&self) -> Result<(), Fault> {
        clear_route_cache()
    }
    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<u32, Fault> {
        dispatch(cluster, headers, body, timeout)
    }
    fn call_response_header(&self, name: &str) -> Option<String> {
        call_response_header(name)
    }
    fn call_response_body(&self, size: usize) -> Option<Vec<u8>> {
        call_response_body(size)
    }
    fn resume_request(&self) -> Result<(), Fault> {
        resume_request()
    }
    fn set_effective_context(&self, context_id: u32) -> Result<(), Fault> {
        abi::set_effective_context(context_id)
    }
    fn send_response(
        &self,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), Fault> {
        send_response(status, headers, body)
    }
    fn define_metric(&self, kind: u32, name: &str) -> Option<u32> {
        define_metric(kind, name)
    }
    fn increment_metric(&self, id: u32, offset: i64) {
        increment_metric(id, offset);
    }
    fn record_metric(&self, id: u32, value: u64) {
        record_metric(id, value);
    }
}
