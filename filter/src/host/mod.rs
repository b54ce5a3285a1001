//! Host calls, wrapped so that every failure is a value.
//!
//! The SDK's trait methods unwrap host-call results and would trap the VM
//! on an unexpected status; these wrappers call `proxy_wasm::hostcalls`
//! directly and hand back `Option`/`Result`, and the callers decide what a
//! failure means (usually: log, count, take the safe path).

use crate::reply::Reply;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, Status};
use std::time::{Duration, UNIX_EPOCH};

pub fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

fn now() -> Duration {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default()
}

pub fn now_ms() -> u64 {
    now().as_millis() as u64
}

pub fn now_us() -> u64 {
    now().as_micros() as u64
}

pub fn get_shared(key: &str) -> Option<Vec<u8>> {
    hostcalls::get_shared_data(key).ok().and_then(|(v, _)| v)
}

pub fn set_shared(key: &str, value: &[u8]) -> Result<(), Status> {
    hostcalls::set_shared_data(key, Some(value), None)
}

/// A shared-data value with its compare-and-swap token.
pub fn get_shared_cas(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    hostcalls::get_shared_data(key).unwrap_or((None, None))
}

/// Writes `value` unless the key changed since `cas` was read.
pub fn set_shared_cas(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
    hostcalls::set_shared_data(key, Some(value), cas)
}

/// Rewrites a shared-data value that other VMs may be rewriting too:
/// `f` maps the current value to the new one (None: leave it), and the
/// write is retried on a compare-and-swap mismatch, a few times at most.
/// Returns whether a write went through.
pub fn update_shared(key: &str, mut f: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>) -> bool {
    for _ in 0..4 {
        let (value, cas) = hostcalls::get_shared_data(key).unwrap_or((None, None));
        let Some(new) = f(value.as_deref()) else {
            return false;
        };
        match hostcalls::set_shared_data(key, Some(&new), cas) {
            Ok(()) => return true,
            Err(Status::CasMismatch) => continue,
            Err(_) => return false,
        }
    }
    false
}

pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

pub fn set_request_header(name: &str, value: &str) -> Result<(), Status> {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value))
}

pub fn response_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpResponseHeaders, name)
        .ok()
        .flatten()
}

pub fn set_response_header(name: &str, value: &str) -> Result<(), Status> {
    hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value))
}

pub fn remove_request_header(name: &str) -> Result<(), Status> {
    hostcalls::remove_map_value(MapType::HttpRequestHeaders, name)
}

pub fn request_body(size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
        .ok()
        .flatten()
}

/// Replaces the whole buffered request body (Envoy drains the buffer and
/// writes `body` when the range starts at 0 and is not empty). The caller
/// sets `content-length` to match. The SDK traps on any status but `Ok`;
/// a range from 0 of a buffered body is always `Ok`.
pub fn set_request_body(body: &[u8]) -> Result<(), Status> {
    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, usize::MAX, body)
}

/// Lets a request paused in a request callback go on to the upstream.
pub fn resume_request() -> Result<(), Status> {
    hostcalls::resume_http_request()
}

pub fn plugin_configuration() -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
}

pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    hostcalls::get_property(path.to_vec()).ok().flatten()
}

/// Answers the client with a worker's answer, as it came.
pub fn send_response(status: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<(), Status> {
    hostcalls::send_http_response(u32::from(status), headers.to_vec(), Some(body))
}

pub fn send_reply(r: &Reply) -> Result<(), Status> {
    let headers = r.headers();
    hostcalls::send_http_response(
        u32::from(r.status),
        headers.iter().map(|(k, v)| (*k, v.as_str())).collect(),
        Some(r.body.as_bytes()),
    )
}

/// Makes Envoy match the route again after routing headers changed.
pub fn clear_route_cache() -> Result<(), Status> {
    hostcalls::call_foreign_function("clear_route_cache", None).map(|_| ())
}

/// Calls `cluster` from the current context: the answer goes to that
/// context's `on_http_call_response` (the root's, or a request's, which
/// stays paused until it resumes).
pub fn dispatch(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<u32, Status> {
    hostcalls::dispatch_http_call(cluster, headers, body, vec![], timeout)
}

/// Gets `path`; `authorization` is a whole header value.
pub fn dispatch_get(
    cluster: &str,
    authority: &str,
    path: &str,
    authorization: Option<&str>,
    timeout: Duration,
) -> Result<u32, Status> {
    let mut headers = vec![
        (":method", "GET"),
        (":path", path),
        (":authority", authority),
    ];
    if let Some(a) = authorization {
        headers.push(("authorization", a));
    }
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
) -> Result<u32, Status> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/octet-stream"),
    ];
    if let Some(a) = authorization {
        headers.push(("authorization", a));
    }
    dispatch(cluster, headers, Some(body), timeout)
}

/// The queue routing decisions travel through, from router VMs to the
/// snapshot service.
pub const ROUTED_QUEUE: &str = "kvgate.routed";
/// The queue load bookings (and local replies) travel through.
pub const BOOKINGS_QUEUE: &str = "kvgate.bookings";

pub fn register_queue(name: &str) -> Result<u32, Status> {
    hostcalls::register_shared_queue(name)
}

pub fn resolve_queue(vm_id: &str, name: &str) -> Option<u32> {
    hostcalls::resolve_shared_queue(vm_id, name).ok().flatten()
}

/// A random number, drawn once per VM (WASI `random_get` seeds std's hasher).
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_us());
    h.finish()
}

pub fn enqueue(queue: u32, data: &[u8]) -> Result<(), Status> {
    hostcalls::enqueue_shared_queue(queue, Some(data))
}

pub fn dequeue(queue: u32) -> Option<Vec<u8>> {
    hostcalls::dequeue_shared_queue(queue).ok().flatten()
}

pub fn call_response_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpCallResponseHeaders, name)
        .ok()
        .flatten()
}

pub fn call_response_body(size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size)
        .ok()
        .flatten()
}

pub fn set_tick_period(period: Duration) -> Result<(), Status> {
    hostcalls::set_tick_period(period)
}
