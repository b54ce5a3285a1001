//! The proxy-wasm ABI, called directly.
//!
//! The SDK's `hostcalls` panic on any status they do not expect, and
//! unwrap a header value's UTF-8; Envoy returns such statuses in
//! ordinary operation (a callout answer without headers reads as
//! `BadArgument`), and a panic kills the VM with every request of its
//! thread. Here a status is a number, returned as it came: the enum the
//! SDK matches on cannot even hold every code a host may return.
//!
//! Data the host returns is allocated through the SDK's exported
//! `proxy_on_memory_allocate` (a `Vec<u8>` of exactly that capacity), so
//! it is taken back as one.
#![allow(unsafe_code)]

use std::ptr::{null, null_mut};

/// A host call's status other than `Ok`, as the host returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault(pub u32);

impl Fault {
    pub const CAS_MISMATCH: Fault = Fault(8);
}

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const EMPTY: u32 = 7;

pub const MAP_REQUEST_HEADERS: u32 = 0;
pub const MAP_RESPONSE_HEADERS: u32 = 2;
pub const MAP_CALL_RESPONSE_HEADERS: u32 = 6;

pub const BUFFER_REQUEST_BODY: u32 = 0;
pub const BUFFER_RESPONSE_BODY: u32 = 1;
pub const BUFFER_CALL_RESPONSE_BODY: u32 = 4;
pub const BUFFER_PLUGIN_CONFIGURATION: u32 = 7;

const STREAM_HTTP_REQUEST: u32 = 0;

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    fn proxy_log(level: u32, data: *const u8, size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(out: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        kind: u32,
        start: usize,
        max: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        kind: u32,
        start: usize,
        size: usize,
        data: *const u8,
        data_size: usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map: u32, key: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path: *const u8,
        path_size: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_size: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
        cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_register_shared_queue(name: *const u8, name_size: usize, id: *mut u32) -> u32;
    fn proxy_resolve_shared_queue(
        vm_id: *const u8,
        vm_id_size: usize,
        name: *const u8,
        name_size: usize,
        id: *mut u32,
    ) -> u32;
    fn proxy_dequeue_shared_queue(queue: u32, out: *mut *mut u8, out_size: *mut usize) -> u32;
    fn proxy_enqueue_shared_queue(queue: u32, data: *const u8, size: usize) -> u32;
    fn proxy_continue_stream(stream: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_send_local_response(
        status: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_call_foreign_function(
        name: *const u8,
        name_size: usize,
        args: *const u8,
        args_size: usize,
        out: *mut *mut u8,
        out_size: *mut usize,
    ) -> u32;
    fn proxy_define_metric(kind: u32, name: *const u8, name_size: usize, id: *mut u32) -> u32;
    fn proxy_increment_metric(id: u32, offset: i64) -> u32;
    fn proxy_record_metric(id: u32, value: u64) -> u32;
}

fn status(code: u32) -> Result<(), Fault> {
    if code == OK { Ok(()) } else { Err(Fault(code)) }
}

/// Takes back bytes the host wrote through `proxy_on_memory_allocate`.
fn owned(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        return Vec::new();
    }
    // SAFETY: the host allocated `size` bytes at `data` through the SDK's
    // `proxy_on_memory_allocate` (`Vec::<u8>::with_capacity(size)`, then
    // forgotten) and filled them; ownership passes to us here, once.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// A call that writes bytes back: `Ok(None)` when the host found nothing.
fn read_back(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Option<Vec<u8>>, Fault> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    match call(&mut data, &mut size) {
        OK => Ok(Some(owned(data, size))),
        NOT_FOUND => Ok(None),
        code => Err(Fault(code)),
    }
}

pub fn log(level: u32, msg: &str) -> Result<(), Fault> {
    // SAFETY: the pointer and length describe `msg`, alive for the call.
    status(unsafe { proxy_log(level, msg.as_ptr(), msg.len()) })
}

pub fn now_ns() -> Result<u64, Fault> {
    let mut t = 0u64;
    // SAFETY: `t` outlives the call.
    status(unsafe { proxy_get_current_time_nanoseconds(&mut t) }).map(|()| t)
}

pub fn set_tick_period_ms(ms: u32) -> Result<(), Fault> {
    // SAFETY: no pointers.
    status(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

pub fn get_buffer(kind: u32, start: usize, max: usize) -> Result<Option<Vec<u8>>, Fault> {
    // SAFETY: the out-pointers are `read_back`'s locals.
    read_back(|d, s| unsafe { proxy_get_buffer_bytes(kind, start, max, d, s) })
}

pub fn set_buffer(kind: u32, start: usize, size: usize, data: &[u8]) -> Result<(), Fault> {
    // SAFETY: the pointer and length describe `data`, alive for the call.
    status(unsafe { proxy_set_buffer_bytes(kind, start, size, data.as_ptr(), data.len()) })
}

pub fn get_map_value(map: u32, key: &str) -> Result<Option<Vec<u8>>, Fault> {
    // SAFETY: `key` is alive for the call; the out-pointers are locals.
    read_back(|d, s| unsafe { proxy_get_header_map_value(map, key.as_ptr(), key.len(), d, s) })
}

pub fn set_map_value(map: u32, key: &str, value: &str) -> Result<(), Fault> {
    // SAFETY: `key` and `value` are alive for the call.
    status(unsafe {
        proxy_replace_header_map_value(map, key.as_ptr(), key.len(), value.as_ptr(), value.len())
    })
}

pub fn remove_map_value(map: u32, key: &str) -> Result<(), Fault> {
    // SAFETY: `key` is alive for the call.
    status(unsafe { proxy_remove_header_map_value(map, key.as_ptr(), key.len()) })
}

/// `path`'s segments joined by NUL bytes, as the ABI takes a property.
pub fn get_property(path: &[&str]) -> Result<Option<Vec<u8>>, Fault> {
    let joined = path.join("\0");
    // SAFETY: `joined` is alive for the call; the out-pointers are locals.
    read_back(|d, s| unsafe { proxy_get_property(joined.as_ptr(), joined.len(), d, s) })
}

/// A shared-data value and its compare-and-swap token (0: none).
pub fn get_shared_data(key: &str) -> Result<(Option<Vec<u8>>, u32), Fault> {
    let mut cas = 0u32;
    // SAFETY: `key` and `cas` outlive the call; the out-pointers are locals.
    let value = read_back(|d, s| unsafe {
        proxy_get_shared_data(key.as_ptr(), key.len(), d, s, &mut cas)
    })?;
    Ok((value, cas))
}

pub fn set_shared_data(key: &str, value: &[u8], cas: u32) -> Result<(), Fault> {
    // SAFETY: `key` and `value` are alive for the call.
    status(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
    })
}

pub fn register_shared_queue(name: &str) -> Result<u32, Fault> {
    let mut id = 0u32;
    // SAFETY: `name` and `id` outlive the call.
    status(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) }).map(|()| id)
}

pub fn resolve_shared_queue(vm_id: &str, name: &str) -> Result<u32, Fault> {
    let mut id = 0u32;
    // SAFETY: `vm_id`, `name` and `id` outlive the call.
    status(unsafe {
        proxy_resolve_shared_queue(
            vm_id.as_ptr(),
            vm_id.len(),
            name.as_ptr(),
            name.len(),
            &mut id,
        )
    })
    .map(|()| id)
}

/// The queue's next item; `Ok(None)` when it is empty.
pub fn dequeue_shared_queue(queue: u32) -> Result<Option<Vec<u8>>, Fault> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the out-pointers are locals.
    match unsafe { proxy_dequeue_shared_queue(queue, &mut data, &mut size) } {
        OK => Ok(Some(owned(data, size))),
        EMPTY => Ok(None),
        code => Err(Fault(code)),
    }
}

pub fn enqueue_shared_queue(queue: u32, data: &[u8]) -> Result<(), Fault> {
    // SAFETY: `data` is alive for the call.
    status(unsafe { proxy_enqueue_shared_queue(queue, data.as_ptr(), data.len()) })
}

/// Makes `context_id` the context later host calls act on, until the
/// current callback returns.
pub fn set_effective_context(context_id: u32) -> Result<(), Fault> {
    // SAFETY: no pointers.
    status(unsafe { proxy_set_effective_context(context_id) })
}

pub fn continue_request() -> Result<(), Fault> {
    // SAFETY: no pointers.
    status(unsafe { proxy_continue_stream(STREAM_HTTP_REQUEST) })
}

pub fn send_local_response(
    status_code: u32,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), Fault> {
    let headers = serialize_map(headers);
    // SAFETY: `headers` and `body` are alive for the call; no details.
    status(unsafe {
        proxy_send_local_response(
            status_code,
            null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    })
}

pub fn call_foreign_function(name: &str, args: &[u8]) -> Result<Option<Vec<u8>>, Fault> {
    // SAFETY: `name` and `args` are alive for the call; the out-pointers
    // are locals.
    read_back(|d, s| unsafe {
        proxy_call_foreign_function(name.as_ptr(), name.len(), args.as_ptr(), args.len(), d, s)
    })
}

pub fn define_metric(kind: u32, name: &str) -> Result<u32, Fault> {
    let mut id = 0u32;
    // SAFETY: `name` and `id` outlive the call.
    status(unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) }).map(|()| id)
}

pub fn increment_metric(id: u32, offset: i64) -> Result<(), Fault> {
    // SAFETY: no pointers.
    status(unsafe { proxy_increment_metric(id, offset) })
}

pub fn record_metric(id: u32, value: u64) -> Result<(), Fault> {
    // SAFETY: no pointers.
    status(unsafe { proxy_record_metric(id, value) })
}

/// The ABI's header map: a count, each pair's two lengths, then each
/// name and value NUL-terminated (little-endian u32s).
pub fn serialize_map(pairs: &[(&str, &str)]) -> Vec<u8> {
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    let size = 4 + pairs
        .iter()
        .map(|(k, v)| 10 + k.len() + v.len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&len(pairs.len()));
    for (k, v) in pairs {
        out.extend_from_slice(&len(k.len()));
        out.extend_from_slice(&len(v.len()));
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_map_is_serialized_as_the_abi_reads_it() {
        let m = serialize_map(&[("a", "bc"), ("", "")]);
        let mut want = vec![2, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        want.extend_from_slice(b"a\0bc\0\0\0");
        assert_eq!(m, want);
    }
}
