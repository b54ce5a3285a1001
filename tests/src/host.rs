//! A proxy-wasm (ABI 0.2.1) host on wasmtime, purpose-built to run kvgate's
//! real filter module in tests.
//!
//! It emulates what Envoy does for the calls the filter makes: one
//! process-wide shared-data store with CAS, shared by every VM; metrics by
//! name; request headers and bodies with Envoy's buffering; local replies;
//! HTTP callouts the test answers; foreign functions; a clock the test
//! moves. A guest trap (a panic) is reported as a value and marks the VM
//! dead, as Envoy's fail-closed policy would.
//!
//! Each HTTP stream keeps its own headers, body, local reply and resumes,
//! and host calls act on the effective context's stream. Callouts behave
//! as measured on Envoy 1.40 (`docs/envoy-callouts.md`): the answer is
//! delivered to the root context and the SDK hands it to the context that
//! made the call; a stream that ends does not cancel its callout, whose
//! answer still arrives (and finds no context); a resume inside
//! `on_request_headers` or after a local reply, which makes Envoy send the
//! request upstream twice or beside the reply, traps.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use wasmtime::error::Context;
use wasmtime::{
    Caller, Config, Engine, Extern, Instance, Linker, Memory, Module, Store, TypedFunc,
};
use wasmtime::{Result, bail, format_err as anyhow};

// ABI enumerations.
const OK: i32 = 0;
const NOT_FOUND: i32 = 1;
const BAD_ARGUMENT: i32 = 2;
const CAS_MISMATCH: i32 = 8;
const INTERNAL_FAILURE: i32 = 10;
const UNIMPLEMENTED: i32 = 12;
const MAP_REQUEST_HEADERS: i32 = 0;
const MAP_REQUEST_TRAILERS: i32 = 1;
const MAP_CALL_RESPONSE_HEADERS: i32 = 6;
const BUF_REQUEST_BODY: i32 = 0;
const STREAM_REQUEST: i32 = 0;
const BUF_CALL_RESPONSE_BODY: i32 = 4;
const BUF_VM_CONFIGURATION: i32 = 6;
const BUF_PLUGIN_CONFIGURATION: i32 = 7;
pub const ACTION_CONTINUE: i32 = 0;
pub const ACTION_PAUSE: i32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Debug, Clone)]
pub struct Metric {
    pub kind: MetricKind,
    pub value: i64,
    pub samples: Vec<u64>,
}

/// State shared by every VM of one emulated Envoy process.
#[derive(Debug, Default)]
pub struct Shared {
    data: HashMap<String, (Vec<u8>, u32)>,
    cas: u32,
    pub metrics: HashMap<String, Metric>,
    /// Wall clock in nanoseconds, moved by the test.
    pub clock_ns: u64,
    /// `proxy_get_shared_data` calls per key.
    pub reads: HashMap<String, u64>,
    /// `random_get` calls so far, mixed into each draw's seed.
    draws: u64,
    /// Shared queues: id → (vm_id, name, items).
    queues: HashMap<u32, (String, String, std::collections::VecDeque<Vec<u8>>)>,
    /// Armed by [`Shared::before_set`].
    set_hooks: Vec<SetHook>,
}

/// Runs once, inside a VM's `proxy_set_shared_data`: see
/// [`Shared::before_set`].
pub struct SetHook {
    key_prefix: String,
    run: Box<dyn FnOnce() + Send>,
}

impl std::fmt::Debug for SetHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SetHook")
            .field("key_prefix", &self.key_prefix)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub fn new() -> SharedRef {
        Arc::new(Mutex::new(Shared {
            clock_ns: 1_700_000_000_000_000_000,
            ..Default::default()
        }))
    }

    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.data.get(key).map(|(v, _)| v.as_slice())
    }

    pub fn set(&mut self, key: &str, value: &[u8]) {
        self.cas = self.cas.wrapping_add(1).max(1);
        self.data
            .insert(key.to_string(), (value.to_vec(), self.cas));
    }

    pub fn metric(&self, name: &str) -> Option<&Metric> {
        self.metrics.get(name)
    }

    pub fn counter(&self, name: &str) -> i64 {
        self.metrics.get(name).map_or(0, |m| m.value)
    }

    pub fn advance_ms(&mut self, ms: u64) {
        self.clock_ns += ms * 1_000_000;
    }

    pub fn now_ms(&self) -> u64 {
        self.clock_ns / 1_000_000
    }

    /// Runs `f` once, the next time any VM calls `proxy_set_shared_data`
    /// on a key starting with `key_prefix`: after that VM read the value
    /// (its write comes after its read) and before the host checks the
    /// write's compare-and-swap token. So a test interleaves threads the
    /// way Envoy's worker threads may: `f` can run another VM (one of its
    /// own, e.g. behind an `Arc<Mutex<Vm>>`), whose writes land between
    /// this VM's read and its compare-and-swap. The hook is taken out of
    /// the store, and the store's lock released, before `f` runs: `f`'s VM
    /// locks the store in its own host calls, and does not run the hook
    /// again. Hooks armed on the same prefix run one per write, in the
    /// order armed.
    pub fn before_set(&mut self, key_prefix: &str, f: impl FnOnce() + Send + 'static) {
        self.set_hooks.push(SetHook {
            key_prefix: key_prefix.to_string(),
            run: Box::new(f),
        });
    }

    /// Hooks armed and not yet run.
    pub fn armed_hooks(&self) -> usize {
        self.set_hooks.len()
    }

    /// Takes out the first hook armed for a write to `key`.
    fn take_set_hook(&mut self, key: &str) -> Option<SetHook> {
        let i = self
            .set_hooks
            .iter()
            .position(|h| key.starts_with(&h.key_prefix))?;
        Some(self.set_hooks.remove(i))
    }

    /// Items waiting in a queue.
    pub fn queued(&self, vm_id: &str, name: &str) -> usize {
        self.queues
            .values()
            .find(|(v, n, _)| v == vm_id && n == name)
            .map_or(0, |(_, _, q)| q.len())
    }
}

const EMPTY: i32 = 7;
/// The root context's id; streams count up from 2.
const ROOT_CONTEXT: i32 = 1;

pub type SharedRef = Arc<Mutex<Shared>>;

fn lock(s: &SharedRef) -> MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl LocalReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone)]
pub struct Callout {
    pub token: u32,
    /// The context that made it, where its answer goes.
    pub context: i32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u32,
}

impl Callout {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP stream as the filter sees it, kept per stream as Envoy does.
#[derive(Debug, Clone, Default)]
pub struct Stream {
    /// Request headers as the upstream would see them.
    pub headers: Vec<(String, String)>,
    /// The request body Envoy buffered, as the upstream would get it.
    pub body: Vec<u8>,
    pub reply: Option<LocalReply>,
    /// `proxy_continue_stream` calls for the request: the filter resumed a
    /// paused request (after a callout answered).
    pub resumes: u32,
    /// The request callback running now, if any.
    in_headers: bool,
    pub foreign_calls: Vec<String>,
    /// Request trailers, once the client sent them (HTTP/2).
    pub trailers: Vec<(String, String)>,
    /// Header values that are not UTF-8, as a client may send them: a
    /// read of one of these names gets these bytes.
    pub raw_headers: Vec<(String, Vec<u8>)>,
}

impl Stream {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What a VM's guest cost, as the host counts it: the same on any machine
/// under any load, so a change to the filter's hot path can be judged
/// while wall-clock timings are noise.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cost {
    /// Host calls, by import.
    pub calls: BTreeMap<&'static str, u64>,
    /// Bytes the host copied into guest memory, by what they were
    /// (`request_body`, `shared_data`, `header`, ...): Envoy copies each
    /// of them out of its own buffers too.
    pub bytes_out: BTreeMap<&'static str, u64>,
    /// Bytes the guest handed the host, by import.
    pub bytes_in: BTreeMap<&'static str, u64>,
    /// Callbacks into the guest, by export.
    pub callbacks: BTreeMap<&'static str, u64>,
    /// Fuel the guest burnt, by export (a metered [`Filter`] only): about
    /// one unit per wasm instruction, the guest's allocations for what the
    /// host hands it included.
    pub fuel: BTreeMap<&'static str, u64>,
}

impl Cost {
    pub fn total_calls(&self) -> u64 {
        self.calls.values().sum()
    }

    pub fn total_fuel(&self) -> u64 {
        self.fuel.values().sum()
    }

    pub fn total_bytes_out(&self) -> u64 {
        self.bytes_out.values().sum()
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Cost) {
        for (mine, theirs) in [
            (&mut self.calls, &other.calls),
            (&mut self.bytes_out, &other.bytes_out),
            (&mut self.bytes_in, &other.bytes_in),
            (&mut self.callbacks, &other.callbacks),
            (&mut self.fuel, &other.fuel),
        ] {
            for (k, v) in theirs {
                *mine.entry(k).or_default() += v;
            }
        }
    }
}

/// Counts a host call, and names it as the one running, for the bytes it
/// reads from the guest.
fn tally(c: &mut Caller<'_, HostState>, name: &'static str) {
    let st = c.data_mut();
    *st.cost.calls.entry(name).or_default() += 1;
    st.in_call = name;
}

/// The clock the guest reads. With [`HostState::fuel_clock`] on a metered
/// filter, time runs one nanosecond per unit of fuel from the start of the
/// running callback, so the filter's own microsecond histograms record its
/// phases in thousands of fuel units, exactly.
fn clock_ns(c: &Caller<'_, HostState>) -> u64 {
    let now = lock(&c.data().shared).clock_ns;
    let st = c.data();
    match (st.fuel_clock, c.get_fuel()) {
        (true, Ok(left)) => now + st.entry_fuel.saturating_sub(left),
        _ => now,
    }
}

/// Per-VM host state.
pub struct HostState {
    /// What the guest cost since the last [`Vm::take_cost`].
    pub cost: Cost,
    /// The host call running, for [`Cost::bytes_in`].
    in_call: &'static str,
    /// Fuel left when the running callback began.
    entry_fuel: u64,
    /// See [`clock_ns`].
    pub fuel_clock: bool,
    shared: SharedRef,
    vm_id: String,
    root_id: String,
    plugin_config: Vec<u8>,
    /// Open HTTP streams by context id.
    streams: HashMap<i32, Stream>,
    /// The context host calls act on: the one whose callback runs, or the
    /// one `proxy_set_effective_context` named.
    current: i32,
    /// The answer's headers; `None` for an answer without any (a reset,
    /// a timeout), whose header map Envoy reports as `BadArgument`.
    call_headers: Option<Vec<(String, String)>>,
    call_body: Vec<u8>,
    pub callouts: Vec<Callout>,
    next_token: u32,
    pub tick_ms: u32,
    pub logs: Vec<(i32, String)>,
    pub stdout: Vec<u8>,
    metric_names: Vec<String>,
    /// Queues this VM registered (it gets their `on_queue_ready`).
    registered_queues: Vec<u32>,
    /// Clusters that exist; a callout elsewhere gets BadArgument.
    pub clusters: Vec<String>,
    /// Header values that are not UTF-8, for the next stream opened (see
    /// [`Stream::raw_headers`]).
    pub next_raw_headers: Vec<(String, Vec<u8>)>,
    /// Hosts the prefill cluster does not hold: a callout naming one in
    /// `x-kvgate-prefill-host` fails at once with InternalFailure, as
    /// Envoy's override-host balancer with no fallback fails it.
    pub unlisted_hosts: Vec<String>,
}

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub struct Exchange {
    /// Request headers as the upstream would see them.
    pub headers: Vec<(String, String)>,
    /// Whether the request went on to the router (upstream).
    pub continued: bool,
    pub reply: Option<LocalReply>,
    pub foreign_calls: Vec<String>,
    pub trapped: Option<String>,
    /// The request body as the upstream would get it.
    pub body: Vec<u8>,
    /// Times the filter resumed the request.
    pub resumes: u32,
}

impl Exchange {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The worker the filter chose: the first of the destination list.
    pub fn destination(&self) -> Option<&str> {
        self.destinations().into_iter().next()
    }

    /// Where Envoy retries if the chosen worker refuses the connection.
    pub fn retry_destination(&self) -> Option<&str> {
        self.destinations().get(1).copied()
    }

    fn destinations(&self) -> Vec<&str> {
        self.header("x-gateway-destination-endpoint")
            .map(|v| v.split(',').collect())
            .unwrap_or_default()
    }
}

fn memory(caller: &mut Caller<'_, HostState>) -> Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => bail!("guest exports no memory"),
    }
}

fn read(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> Result<Vec<u8>> {
    let m = memory(caller)?;
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    let st = caller.data_mut();
    *st.cost.bytes_in.entry(st.in_call).or_default() += len as u64;
    m.data(&*caller)
        .get(ptr..ptr + len)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| anyhow!("guest pointer out of bounds"))
}

fn read_str(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> Result<String> {
    Ok(String::from_utf8_lossy(&read(caller, ptr, len)?).into_owned())
}

fn write(caller: &mut Caller<'_, HostState>, ptr: i32, bytes: &[u8]) -> Result<()> {
    let m = memory(caller)?;
    m.write(&mut *caller, ptr as u32 as usize, bytes)?;
    Ok(())
}

fn write_u32(caller: &mut Caller<'_, HostState>, ptr: i32, v: u32) -> Result<()> {
    write(caller, ptr, &v.to_le_bytes())
}

/// Copies `bytes` into guest memory allocated by the guest itself, and
/// writes its address and length to the two out-pointers.
fn give(
    caller: &mut Caller<'_, HostState>,
    what: &'static str,
    bytes: &[u8],
    ptr_out: i32,
    len_out: i32,
) -> Result<()> {
    let alloc = match caller.get_export("proxy_on_memory_allocate") {
        Some(Extern::Func(f)) => f.typed::<i32, i32>(&*caller)?,
        _ => bail!("guest exports no proxy_on_memory_allocate"),
    };
    *caller.data_mut().cost.bytes_out.entry(what).or_default() += bytes.len() as u64;
    let addr = alloc.call(&mut *caller, bytes.len().max(1) as i32)?;
    write(caller, addr, bytes)?;
    write_u32(caller, ptr_out, addr as u32)?;
    write_u32(caller, len_out, bytes.len() as u32)
}

/// Proxy-wasm header-map serialisation.
pub fn serialize_map(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

fn deserialize_map(b: &[u8]) -> Vec<(String, String)> {
    let word = |i: usize| {
        b.get(i..i + 4)
            .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize)
    };
    let n = word(0);
    let mut sizes = Vec::with_capacity(n);
    for i in 0..n {
        sizes.push((word(4 + i * 8), word(8 + i * 8)));
    }
    let mut pos = 4 + n * 8;
    let mut out = Vec::with_capacity(n);
    for (kl, vl) in sizes {
        let k = b
            .get(pos..pos + kl)
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .unwrap_or_default();
        pos += kl + 1;
        let v = b
            .get(pos..pos + vl)
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .unwrap_or_default();
        pos += vl + 1;
        out.push((k, v));
    }
    out
}

impl HostState {
    /// The effective context's stream; none for the root context.
    fn stream_mut(&mut self) -> Option<&mut Stream> {
        self.streams.get_mut(&self.current)
    }
}

fn map_mut(st: &mut HostState, map: i32) -> Option<&mut Vec<(String, String)>> {
    match map {
        MAP_REQUEST_HEADERS => st.stream_mut().map(|s| &mut s.headers),
        MAP_REQUEST_TRAILERS => st.stream_mut().map(|s| &mut s.trailers),
        MAP_CALL_RESPONSE_HEADERS => st.call_headers.as_mut(),
        _ => None,
    }
}

/// Writes `data` into `buf` as Envoy's wasm buffer `copyFrom` does: a
/// range from 0 drains its `len` bytes and prepends `data` (so `len` of
/// the whole buffer replaces it), a range from the end appends, and
/// anything else is refused.
fn copy_from(buf: &mut Vec<u8>, start: usize, len: usize, data: &[u8]) -> i32 {
    if start == 0 {
        buf.drain(..len.min(buf.len()));
        buf.splice(0..0, data.iter().copied());
        OK
    } else if start >= buf.len() {
        buf.extend_from_slice(data);
        OK
    } else {
        BAD_ARGUMENT
    }
}

/// A compiled filter module, ready to start VMs from.
pub struct Filter {
    engine: Engine,
    module: Module,
    metered: bool,
}

impl Filter {
    pub fn load(path: &Path) -> Result<Filter> {
        Filter::compile(path, false)
    }

    /// Loads the module so that its VMs count the fuel each callback burns
    /// ([`Cost::fuel`]). Metered code runs slower: for counting, not for
    /// wall-clock timings.
    pub fn load_metered(path: &Path) -> Result<Filter> {
        Filter::compile(path, true)
    }

    fn compile(path: &Path, metered: bool) -> Result<Filter> {
        let mut config = Config::new();
        config.consume_fuel(metered);
        let engine = Engine::new(&config)?;
        let module = Module::from_file(&engine, path)
            .with_context(|| format!("loading {}", path.display()))?;
        Ok(Filter {
            engine,
            module,
            metered,
        })
    }

    /// Names of imports this host does not implement (they would trap).
    pub fn unimplemented_imports(&self) -> Vec<String> {
        self.module
            .imports()
            .filter(|i| !IMPLEMENTED.contains(&i.name()))
            .map(|i| format!("{}.{}", i.module(), i.name()))
            .collect()
    }
}

const IMPLEMENTED: &[&str] = &[
    "proxy_log",
    "proxy_get_log_level",
    "proxy_get_current_time_nanoseconds",
    "proxy_set_tick_period_milliseconds",
    "proxy_get_buffer_bytes",
    "proxy_set_buffer_bytes",
    "proxy_get_header_map_value",
    "proxy_replace_header_map_value",
    "proxy_add_header_map_value",
    "proxy_remove_header_map_value",
    "proxy_get_header_map_pairs",
    "proxy_set_header_map_pairs",
    "proxy_get_property",
    "proxy_set_property",
    "proxy_get_shared_data",
    "proxy_set_shared_data",
    "proxy_register_shared_queue",
    "proxy_resolve_shared_queue",
    "proxy_enqueue_shared_queue",
    "proxy_dequeue_shared_queue",
    "proxy_send_local_response",
    "proxy_http_call",
    "proxy_call_foreign_function",
    "proxy_define_metric",
    "proxy_increment_metric",
    "proxy_record_metric",
    "proxy_get_metric",
    "proxy_set_effective_context",
    "proxy_continue_stream",
    "proxy_close_stream",
    "proxy_get_status",
    "proxy_done",
    "proxy_grpc_call",
    "proxy_grpc_stream",
    "proxy_grpc_send",
    "proxy_grpc_cancel",
    "proxy_grpc_close",
    "environ_get",
    "environ_sizes_get",
    "fd_write",
    "proc_exit",
    "random_get",
    "clock_time_get",
];

fn link(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut c: Caller<'_, HostState>, level: i32, p: i32, l: i32| -> Result<i32> {
            tally(&mut c, "proxy_log");
            let msg = read_str(&mut c, p, l)?;
            c.data_mut().logs.push((level, msg));
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_log_level",
        |mut c: Caller<'_, HostState>, out: i32| -> Result<i32> {
            tally(&mut c, "proxy_get_log_level");
            write_u32(&mut c, out, 2)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut c: Caller<'_, HostState>, out: i32| -> Result<i32> {
            tally(&mut c, "proxy_get_current_time_nanoseconds");
            let now = clock_ns(&c);
            write(&mut c, out, &now.to_le_bytes())?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: Caller<'_, HostState>, ms: i32| -> i32 {
            tally(&mut c, "proxy_set_tick_period_milliseconds");
            c.data_mut().tick_ms = ms as u32;
            OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, HostState>,
         kind: i32,
         start: i32,
         max: i32,
         po: i32,
         lo: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_get_buffer_bytes");
            let st = c.data_mut();
            let (what, buf) = match kind {
                BUF_REQUEST_BODY => match st.stream_mut() {
                    Some(s) => ("request_body", s.body.clone()),
                    None => return Ok(NOT_FOUND),
                },
                BUF_CALL_RESPONSE_BODY => ("call_response_body", st.call_body.clone()),
                BUF_PLUGIN_CONFIGURATION => ("plugin_configuration", st.plugin_config.clone()),
                BUF_VM_CONFIGURATION => ("vm_configuration", Vec::new()),
                _ => return Ok(NOT_FOUND),
            };
            let start = (start as u32 as usize).min(buf.len());
            let end = start.saturating_add(max as u32 as usize).min(buf.len());
            if buf.is_empty() {
                return Ok(NOT_FOUND);
            }
            give(&mut c, what, &buf[start..end], po, lo)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |mut c: Caller<'_, HostState>,
         kind: i32,
         start: i32,
         len: i32,
         dp: i32,
         dl: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_set_buffer_bytes");
            let data = read(&mut c, dp, dl)?;
            if kind != BUF_REQUEST_BODY {
                return Ok(BAD_ARGUMENT);
            }
            let Some(stream) = c.data_mut().stream_mut() else {
                return Ok(NOT_FOUND);
            };
            Ok(copy_from(
                &mut stream.body,
                start as u32 as usize,
                len as u32 as usize,
                &data,
            ))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: Caller<'_, HostState>,
         map: i32,
         kp: i32,
         kl: i32,
         po: i32,
         lo: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_get_header_map_value");
            let key = read_str(&mut c, kp, kl)?;
            let raw = match (map, c.data_mut().stream_mut()) {
                (MAP_REQUEST_HEADERS, Some(s)) => s
                    .raw_headers
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, v)| v.clone()),
                _ => None,
            };
            if let Some(raw) = raw {
                give(&mut c, "header", &raw, po, lo)?;
                return Ok(OK);
            }
            let v = match map_mut(c.data_mut(), map) {
                Some(m) => m.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone()),
                None => return Ok(BAD_ARGUMENT),
            };
            match v {
                Some(v) => {
                    give(&mut c, "header", v.as_bytes(), po, lo)?;
                    Ok(OK)
                }
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    for (name, replace) in [
        ("proxy_replace_header_map_value", true),
        ("proxy_add_header_map_value", false),
    ] {
        linker.func_wrap(
            "env",
            name,
            move |mut c: Caller<'_, HostState>,
                  map: i32,
                  kp: i32,
                  kl: i32,
                  vp: i32,
                  vl: i32|
                  -> Result<i32> {
                tally(&mut c, name);
                let (k, v) = (read_str(&mut c, kp, kl)?, read_str(&mut c, vp, vl)?);
                let Some(m) = map_mut(c.data_mut(), map) else {
                    return Ok(BAD_ARGUMENT);
                };
                if replace {
                    m.retain(|(mk, _)| *mk != k);
                }
                m.push((k, v));
                Ok(OK)
            },
        )?;
    }
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, HostState>, map: i32, kp: i32, kl: i32| -> Result<i32> {
            tally(&mut c, "proxy_remove_header_map_value");
            let k = read_str(&mut c, kp, kl)?;
            match map_mut(c.data_mut(), map) {
                Some(m) => {
                    m.retain(|(mk, _)| *mk != k);
                    Ok(OK)
                }
                None => Ok(BAD_ARGUMENT),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, HostState>, map: i32, po: i32, lo: i32| -> Result<i32> {
            tally(&mut c, "proxy_get_header_map_pairs");
            let pairs = match map_mut(c.data_mut(), map) {
                Some(m) => m.clone(),
                None => return Ok(BAD_ARGUMENT),
            };
            give(&mut c, "header_pairs", &serialize_map(&pairs), po, lo)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut c: Caller<'_, HostState>, map: i32, p: i32, l: i32| -> Result<i32> {
            tally(&mut c, "proxy_set_header_map_pairs");
            let pairs = deserialize_map(&read(&mut c, p, l)?);
            match map_mut(c.data_mut(), map) {
                Some(m) => {
                    *m = pairs;
                    Ok(OK)
                }
                None => Ok(BAD_ARGUMENT),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: Caller<'_, HostState>, pp: i32, pl: i32, po: i32, lo: i32| -> Result<i32> {
            tally(&mut c, "proxy_get_property");
            let path = read_str(&mut c, pp, pl)?;
            let v = match path.trim_end_matches('\0') {
                "plugin_root_id" => c.data().root_id.clone(),
                "plugin_vm_id" => c.data().vm_id.clone(),
                "plugin_name" => c.data().root_id.clone(),
                _ => return Ok(NOT_FOUND),
            };
            give(&mut c, "property", v.as_bytes(), po, lo)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: Caller<'_, HostState>, _: i32, _: i32, _: i32, _: i32| -> i32 {
            tally(&mut c, "proxy_set_property");
            OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: Caller<'_, HostState>,
         kp: i32,
         kl: i32,
         po: i32,
         lo: i32,
         cas_out: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_get_shared_data");
            let key = read_str(&mut c, kp, kl)?;
            let found = {
                let mut s = lock(&c.data().shared);
                *s.reads.entry(key.clone()).or_default() += 1;
                s.data.get(&key).cloned()
            };
            match found {
                Some((v, cas)) => {
                    give(&mut c, "shared_data", &v, po, lo)?;
                    write_u32(&mut c, cas_out, cas)?;
                    Ok(OK)
                }
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: Caller<'_, HostState>,
         kp: i32,
         kl: i32,
         vp: i32,
         vl: i32,
         cas: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_set_shared_data");
            let (key, value) = (read_str(&mut c, kp, kl)?, read(&mut c, vp, vl)?);
            // Out of the store and with its lock released: the hook's VM
            // takes the lock in its own calls (`Shared::before_set`).
            let hook = lock(&c.data().shared).take_set_hook(&key);
            if let Some(h) = hook {
                (h.run)();
            }
            let mut s = lock(&c.data().shared);
            if cas != 0 && s.data.get(&key).map(|(_, c)| *c) != Some(cas as u32) {
                return Ok(CAS_MISMATCH);
            }
            s.set(&key, &value);
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_register_shared_queue",
        |mut c: Caller<'_, HostState>, np: i32, nl: i32, id_out: i32| -> Result<i32> {
            tally(&mut c, "proxy_register_shared_queue");
            let name = read_str(&mut c, np, nl)?;
            let vm_id = c.data().vm_id.clone();
            let id = {
                let mut s = lock(&c.data().shared);
                let existing = s
                    .queues
                    .iter()
                    .find(|(_, (v, n, _))| *v == vm_id && *n == name)
                    .map(|(id, _)| *id);
                existing.unwrap_or_else(|| {
                    let id = s.queues.len() as u32 + 1;
                    s.queues.insert(id, (vm_id, name, Default::default()));
                    id
                })
            };
            // The last registrant receives on_queue_ready, as in Envoy.
            c.data_mut().registered_queues.push(id);
            write_u32(&mut c, id_out, id)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_resolve_shared_queue",
        |mut c: Caller<'_, HostState>,
         vp: i32,
         vl: i32,
         np: i32,
         nl: i32,
         id_out: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_resolve_shared_queue");
            let (vm_id, name) = (read_str(&mut c, vp, vl)?, read_str(&mut c, np, nl)?);
            let found = lock(&c.data().shared)
                .queues
                .iter()
                .find(|(_, (v, n, _))| *v == vm_id && *n == name)
                .map(|(id, _)| *id);
            match found {
                Some(id) => {
                    write_u32(&mut c, id_out, id)?;
                    Ok(OK)
                }
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_enqueue_shared_queue",
        |mut c: Caller<'_, HostState>, id: i32, dp: i32, dl: i32| -> Result<i32> {
            tally(&mut c, "proxy_enqueue_shared_queue");
            let data = read(&mut c, dp, dl)?;
            let mut s = lock(&c.data().shared);
            match s.queues.get_mut(&(id as u32)) {
                Some((_, _, q)) => {
                    q.push_back(data);
                    Ok(OK)
                }
                None => Ok(NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_dequeue_shared_queue",
        |mut c: Caller<'_, HostState>, id: i32, po: i32, lo: i32| -> Result<i32> {
            tally(&mut c, "proxy_dequeue_shared_queue");
            let item = {
                let mut s = lock(&c.data().shared);
                match s.queues.get_mut(&(id as u32)) {
                    Some((_, _, q)) => q.pop_front(),
                    None => return Ok(NOT_FOUND),
                }
            };
            match item {
                Some(data) => {
                    give(&mut c, "queue", &data, po, lo)?;
                    Ok(OK)
                }
                None => Ok(EMPTY),
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: Caller<'_, HostState>,
         status: i32,
         _dp: i32,
         _dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         _grpc: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_send_local_response");
            let body = read(&mut c, bp, bl)?;
            let headers = deserialize_map(&read(&mut c, hp, hl)?);
            let Some(stream) = c.data_mut().stream_mut() else {
                return Ok(NOT_FOUND);
            };
            stream.reply = Some(LocalReply {
                status: status as u32,
                headers,
                body,
            });
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Caller<'_, HostState>,
         up: i32,
         ul: i32,
         hp: i32,
         hl: i32,
         bp: i32,
         bl: i32,
         _tp: i32,
         _tl: i32,
         timeout: i32,
         token_out: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_http_call");
            let cluster = read_str(&mut c, up, ul)?;
            let headers = deserialize_map(&read(&mut c, hp, hl)?);
            let body = if bl > 0 {
                read(&mut c, bp, bl)?
            } else {
                Vec::new()
            };
            if !c.data().clusters.contains(&cluster) {
                return Ok(BAD_ARGUMENT);
            }
            let unlisted = headers
                .iter()
                .any(|(k, v)| k == "x-kvgate-prefill-host" && c.data().unlisted_hosts.contains(v));
            if unlisted {
                return Ok(INTERNAL_FAILURE);
            }
            let required = [":method", ":path", ":authority"];
            if !required.iter().all(|r| headers.iter().any(|(k, _)| k == r)) {
                return Ok(BAD_ARGUMENT);
            }
            let st = c.data_mut();
            st.next_token += 1;
            let token = st.next_token;
            st.callouts.push(Callout {
                token,
                context: st.current,
                cluster,
                headers,
                body,
                timeout_ms: timeout as u32,
            });
            write_u32(&mut c, token_out, token)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_call_foreign_function",
        |mut c: Caller<'_, HostState>,
         np: i32,
         nl: i32,
         _ap: i32,
         _al: i32,
         _ro: i32,
         _rl: i32|
         -> Result<i32> {
            tally(&mut c, "proxy_call_foreign_function");
            let name = read_str(&mut c, np, nl)?;
            let known = name == "clear_route_cache";
            if let Some(stream) = c.data_mut().stream_mut() {
                stream.foreign_calls.push(name);
            }
            Ok(if known { OK } else { NOT_FOUND })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: Caller<'_, HostState>, kind: i32, np: i32, nl: i32, id_out: i32| -> Result<i32> {
            tally(&mut c, "proxy_define_metric");
            let name = read_str(&mut c, np, nl)?;
            let kind = match kind {
                0 => MetricKind::Counter,
                1 => MetricKind::Gauge,
                2 => MetricKind::Histogram,
                _ => return Ok(BAD_ARGUMENT),
            };
            lock(&c.data().shared)
                .metrics
                .entry(name.clone())
                .or_insert(Metric {
                    kind,
                    value: 0,
                    samples: Vec::new(),
                });
            let st = c.data_mut();
            st.metric_names.push(name);
            let id = st.metric_names.len() as u32 - 1;
            write_u32(&mut c, id_out, id)?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |mut c: Caller<'_, HostState>, id: i32, offset: i64| -> i32 {
            tally(&mut c, "proxy_increment_metric");
            let Some(name) = c.data().metric_names.get(id as usize).cloned() else {
                return NOT_FOUND;
            };
            let mut s = lock(&c.data().shared);
            let Some(m) = s.metrics.get_mut(&name) else {
                return NOT_FOUND;
            };
            match m.kind {
                MetricKind::Counter if offset <= 0 => BAD_ARGUMENT,
                MetricKind::Histogram => BAD_ARGUMENT,
                _ => {
                    m.value += offset;
                    OK
                }
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_record_metric",
        |mut c: Caller<'_, HostState>, id: i32, value: i64| -> i32 {
            tally(&mut c, "proxy_record_metric");
            let Some(name) = c.data().metric_names.get(id as usize).cloned() else {
                return NOT_FOUND;
            };
            let mut s = lock(&c.data().shared);
            let Some(m) = s.metrics.get_mut(&name) else {
                return NOT_FOUND;
            };
            match m.kind {
                MetricKind::Histogram => m.samples.push(value as u64),
                _ => m.value = value,
            }
            OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_metric",
        |mut c: Caller<'_, HostState>, id: i32, out: i32| -> Result<i32> {
            tally(&mut c, "proxy_get_metric");
            let Some(name) = c.data().metric_names.get(id as usize).cloned() else {
                return Ok(NOT_FOUND);
            };
            let v = lock(&c.data().shared)
                .metrics
                .get(&name)
                .map_or(0, |m| m.value);
            write(&mut c, out, &(v as u64).to_le_bytes())?;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_effective_context",
        |mut c: Caller<'_, HostState>, ctx: i32| -> i32 {
            tally(&mut c, "proxy_set_effective_context");
            let st = c.data_mut();
            if ctx != ROOT_CONTEXT && !st.streams.contains_key(&ctx) {
                return BAD_ARGUMENT;
            }
            st.current = ctx;
            OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_continue_stream",
        |mut c: Caller<'_, HostState>, kind: i32| -> Result<i32> {
            tally(&mut c, "proxy_continue_stream");
            if kind != STREAM_REQUEST {
                return Ok(BAD_ARGUMENT);
            }
            let Some(s) = c.data_mut().stream_mut() else {
                return Ok(NOT_FOUND);
            };
            if s.in_headers {
                bail!("resumed inside on_request_headers: Envoy sends the request upstream twice");
            }
            if s.reply.is_some() {
                bail!("resumed after a local reply: Envoy sends the request upstream as well");
            }
            s.resumes += 1;
            Ok(OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_close_stream",
        |mut c: Caller<'_, HostState>, _: i32| -> i32 {
            tally(&mut c, "proxy_close_stream");
            OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_status",
        |mut c: Caller<'_, HostState>, _: i32, _: i32, _: i32| -> i32 {
            tally(&mut c, "proxy_get_status");
            UNIMPLEMENTED
        },
    )?;
    linker.func_wrap("env", "proxy_done", |mut c: Caller<'_, HostState>| -> i32 {
        tally(&mut c, "proxy_done");
        OK
    })?;
    // gRPC is not used by the filter; answer "unimplemented" rather than trap.
    linker.func_wrap(
        "env",
        "proxy_grpc_call",
        |mut c: Caller<'_, HostState>,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> i32 {
            tally(&mut c, "proxy_grpc_call");
            UNIMPLEMENTED
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_stream",
        |mut c: Caller<'_, HostState>,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> i32 {
            tally(&mut c, "proxy_grpc_stream");
            UNIMPLEMENTED
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_send",
        |mut c: Caller<'_, HostState>, _: i32, _: i32, _: i32, _: i32| -> i32 {
            tally(&mut c, "proxy_grpc_send");
            UNIMPLEMENTED
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_cancel",
        |mut c: Caller<'_, HostState>, _: i32| -> i32 {
            tally(&mut c, "proxy_grpc_cancel");
            UNIMPLEMENTED
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_close",
        |mut c: Caller<'_, HostState>, _: i32| -> i32 {
            tally(&mut c, "proxy_grpc_close");
            UNIMPLEMENTED
        },
    )?;

    // WASI preview1, the four calls a wasm32-wasip1 Rust module makes.
    let w = "wasi_snapshot_preview1";
    linker.func_wrap(
        w,
        "environ_sizes_get",
        |mut c: Caller<'_, HostState>, count: i32, size: i32| -> Result<i32> {
            tally(&mut c, "environ_sizes_get");
            write_u32(&mut c, count, 0)?;
            write_u32(&mut c, size, 0)?;
            Ok(0)
        },
    )?;
    linker.func_wrap(
        w,
        "environ_get",
        |mut c: Caller<'_, HostState>, _: i32, _: i32| -> i32 {
            tally(&mut c, "environ_get");
            0
        },
    )?;
    linker.func_wrap(
        w,
        "fd_write",
        |mut c: Caller<'_, HostState>, _fd: i32, iovs: i32, n: i32, written: i32| -> Result<i32> {
            tally(&mut c, "fd_write");
            let mut total = 0u32;
            for i in 0..n {
                let iov = read(&mut c, iovs + i * 8, 8)?;
                let (p, l) = (
                    u32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]),
                    u32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]),
                );
                let bytes = read(&mut c, p as i32, l as i32)?;
                c.data_mut().stdout.extend_from_slice(&bytes);
                total += l;
            }
            write_u32(&mut c, written, total)?;
            Ok(0)
        },
    )?;
    // Envoy serves randomness and clocks through WASI too (std's HashMap
    // seeds itself from random_get).
    linker.func_wrap(
        w,
        "random_get",
        |mut c: Caller<'_, HostState>, buf: i32, len: i32| -> Result<i32> {
            tally(&mut c, "random_get");
            // Each draw its own seed: VMs started at the same clock (an
            // Envoy's worker threads) must not draw the same numbers, or
            // their tags and bookings' keys would collide.
            let mut x = {
                let mut s = lock(&c.data().shared);
                s.draws += 1;
                (s.clock_ns ^ s.draws.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1
            };
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            write(&mut c, buf, &bytes)?;
            Ok(0)
        },
    )?;
    linker.func_wrap(
        w,
        "clock_time_get",
        |mut c: Caller<'_, HostState>, _id: i32, _precision: i64, out: i32| -> Result<i32> {
            tally(&mut c, "clock_time_get");
            let now = clock_ns(&c);
            write(&mut c, out, &now.to_le_bytes())?;
            Ok(0)
        },
    )?;
    linker.func_wrap(
        w,
        "proc_exit",
        |mut c: Caller<'_, HostState>, code: i32| -> Result<()> {
            tally(&mut c, "proc_exit");
            bail!("guest called proc_exit({code})")
        },
    )?;
    Ok(())
}

/// One VM: an instance of the module with its root context.
pub struct Vm {
    store: Store<HostState>,
    instance: Instance,
    root: i32,
    next_ctx: i32,
    pub configured: bool,
    pub trapped: Option<String>,
}

impl Vm {
    /// Instantiates and configures a VM, as Envoy does when it loads a
    /// plugin: `_initialize`, root context, `on_vm_start`, `on_configure`.
    pub fn start(
        filter: &Filter,
        shared: &SharedRef,
        vm_id: &str,
        root_id: &str,
        config: &str,
    ) -> Result<Vm> {
        let mut linker = Linker::new(&filter.engine);
        link(&mut linker)?;
        linker.define_unknown_imports_as_traps(&filter.module)?;
        let state = HostState {
            cost: Cost::default(),
            in_call: "",
            entry_fuel: 0,
            fuel_clock: false,
            shared: shared.clone(),
            vm_id: vm_id.into(),
            root_id: root_id.into(),
            plugin_config: config.as_bytes().to_vec(),
            streams: HashMap::new(),
            current: ROOT_CONTEXT,
            call_headers: None,
            call_body: Vec::new(),
            callouts: Vec::new(),
            next_token: 0,
            tick_ms: 0,
            logs: Vec::new(),
            stdout: Vec::new(),
            metric_names: Vec::new(),
            registered_queues: Vec::new(),
            clusters: vec!["kvgate_sidecar".into(), "kvgate_prefill".into()],
            unlisted_hosts: Vec::new(),
            next_raw_headers: Vec::new(),
        };
        let mut store = Store::new(&filter.engine, state);
        if filter.metered {
            store.set_fuel(1 << 62)?;
        }
        let instance = linker.instantiate(&mut store, &filter.module)?;
        let mut vm = Vm {
            store,
            instance,
            root: ROOT_CONTEXT,
            next_ctx: 2,
            configured: false,
            trapped: None,
        };
        vm.call::<(), ()>("_initialize", ())?;
        vm.call::<(i32, i32), ()>("proxy_on_context_create", (ROOT_CONTEXT, 0))?;
        vm.call::<(i32, i32), i32>("proxy_on_vm_start", (ROOT_CONTEXT, 0))?;
        let len = config.len() as i32;
        vm.configured = vm.call::<(i32, i32), i32>("proxy_on_configure", (ROOT_CONTEXT, len))? != 0;
        Ok(vm)
    }

    fn func<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &mut self,
        name: &str,
    ) -> Result<TypedFunc<P, R>> {
        self.instance
            .get_typed_func::<P, R>(&mut self.store, name)
            .with_context(|| format!("export {name}"))
    }

    /// Calls an export; a trap is recorded and returned as an error.
    fn call<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &mut self,
        name: &'static str,
        params: P,
    ) -> Result<R> {
        if let Some(t) = &self.trapped {
            bail!("VM is dead after a trap: {t}");
        }
        let f = self.func::<P, R>(name)?;
        let before = self.store.get_fuel().ok();
        if let Some(f) = before {
            self.store.data_mut().entry_fuel = f;
        }
        let result = f.call(&mut self.store, params);
        let after = self.store.get_fuel().ok();
        let cost = &mut self.store.data_mut().cost;
        *cost.callbacks.entry(name).or_default() += 1;
        if let (Some(b), Some(a)) = (before, after) {
            *cost.fuel.entry(name).or_default() += b.saturating_sub(a);
        }
        result.map_err(|e| {
            let msg = format!("{name}: {e:?}");
            self.trapped = Some(msg.clone());
            anyhow!(msg)
        })
    }

    /// What the guest cost since the VM started or the last call of this,
    /// and starts counting afresh.
    pub fn take_cost(&mut self) -> Cost {
        std::mem::take(&mut self.state_mut().cost)
    }

    pub fn state(&self) -> &HostState {
        self.store.data()
    }

    pub fn state_mut(&mut self) -> &mut HostState {
        self.store.data_mut()
    }

    pub fn logs(&self) -> String {
        self.state()
            .logs
            .iter()
            .map(|(l, m)| format!("[{l}] {m}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Calls a context's callback with that context effective, as Envoy
    /// does.
    fn call_on<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &mut self,
        ctx: i32,
        name: &'static str,
        params: P,
    ) -> Result<R> {
        self.state_mut().current = ctx;
        self.call(name, params)
    }

    pub fn tick(&mut self) -> Result<()> {
        let root = self.root;
        self.call_on::<i32, ()>(root, "proxy_on_tick", root)
    }

    /// Delivers `on_queue_ready` for every queue this VM registered that
    /// has items, as Envoy posts it to the registering thread.
    pub fn deliver_queues(&mut self) -> Result<()> {
        let ids = self.state().registered_queues.clone();
        for id in ids {
            let pending = lock(&self.state().shared)
                .queues
                .get(&id)
                .is_some_and(|(_, _, q)| !q.is_empty());
            if pending {
                let root = self.root;
                self.call_on::<(i32, i32), ()>(root, "proxy_on_queue_ready", (root, id as i32))?;
            }
        }
        Ok(())
    }

    /// Callouts not yet answered.
    pub fn pending(&self) -> Vec<Callout> {
        self.state().callouts.clone()
    }

    /// Answers a callout as the upstream would. Envoy delivers every
    /// answer to the root context, and the SDK finds the context that made
    /// the call, which may have ended meanwhile. A callout that is not
    /// pending (never made, or answered) is an error.
    pub fn respond(
        &mut self,
        token: u32,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<()> {
        let headers = std::iter::once((":status".to_string(), status.to_string()))
            .chain(headers.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .collect();
        self.answer(token, Some(headers), body.to_vec())
    }

    /// Fails a callout the way Envoy reports a reset, a timeout or an
    /// answer past its buffer: no headers (the header map cannot be read:
    /// `BadArgument`), no body.
    pub fn fail(&mut self, token: u32) -> Result<()> {
        self.answer(token, None, Vec::new())
    }

    /// Answers a callout with the worker's headers, as given (`:status`
    /// included or not), and its body.
    pub fn respond_raw(&mut self, token: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<()> {
        let headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.answer(token, Some(headers), body.to_vec())
    }

    fn answer(
        &mut self,
        token: u32,
        headers: Option<Vec<(String, String)>>,
        body: Vec<u8>,
    ) -> Result<()> {
        let st = self.state_mut();
        let Some(i) = st.callouts.iter().position(|c| c.token == token) else {
            bail!("callout {token} is not pending");
        };
        st.callouts.remove(i);
        let (n, size) = (
            headers.as_ref().map_or(0, Vec::len) as i32,
            body.len() as i32,
        );
        st.call_headers = headers;
        st.call_body = body;
        let root = self.root;
        self.call_on::<(i32, i32, i32, i32, i32), ()>(
            root,
            "proxy_on_http_call_response",
            (root, token as i32, n, size, 0),
        )
    }

    /// Runs one request through the filter's request path, delivering the
    /// body in `chunks` (cumulative sizes, as Envoy reports them), and ends
    /// its stream.
    pub fn request(&mut self, headers: &[(&str, &str)], chunks: &[&[u8]]) -> Exchange {
        let (ex, ctx) = self.open(headers, chunks);
        self.finish(ctx);
        let mut ex = ex;
        if ex.trapped.is_none() {
            ex.trapped = self.trapped.clone();
        }
        ex
    }

    /// Like [`Vm::request`], but leaves the stream open: the upstream has
    /// not answered yet. End it with [`Vm::finish`].
    pub fn open(&mut self, headers: &[(&str, &str)], chunks: &[&[u8]]) -> (Exchange, i32) {
        let (mut ex, ctx) = self.begin(headers, chunks.is_empty());
        for (i, chunk) in chunks.iter().enumerate() {
            if ex.reply.is_some() || ex.trapped.is_some() {
                break;
            }
            ex = self.body(ctx, chunk, i + 1 == chunks.len());
        }
        (ex, ctx)
    }

    /// Opens a stream with its request headers (`end_of_stream` when the
    /// request has no body); returns what the filter did and the stream's
    /// context.
    pub fn begin(&mut self, headers: &[(&str, &str)], end_of_stream: bool) -> (Exchange, i32) {
        let ctx = self.next_ctx;
        self.next_ctx += 1;
        let stream = Stream {
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            raw_headers: std::mem::take(&mut self.state_mut().next_raw_headers),
            ..Stream::default()
        };
        self.state_mut().streams.insert(ctx, stream);
        let root = self.root;
        let n = headers.len() as i32;
        let created = self.call_on::<(i32, i32), ()>(ctx, "proxy_on_context_create", (ctx, root));
        let result = created.and_then(|()| {
            self.set_in_headers(ctx, true);
            let r = self.call_on::<(i32, i32, i32), i32>(
                ctx,
                "proxy_on_request_headers",
                (ctx, n, i32::from(end_of_stream)),
            );
            self.set_in_headers(ctx, false);
            r
        });
        (self.exchange(ctx, result), ctx)
    }

    fn set_in_headers(&mut self, ctx: i32, on: bool) {
        if let Some(s) = self.state_mut().streams.get_mut(&ctx) {
            s.in_headers = on;
        }
    }

    /// Delivers the next body chunk of stream `ctx` (`last` ends the
    /// request), as Envoy reports it: the size of all the body so far.
    pub fn body(&mut self, ctx: i32, chunk: &[u8], last: bool) -> Exchange {
        let total = match self.state_mut().streams.get_mut(&ctx) {
            Some(s) => {
                s.body.extend_from_slice(chunk);
                s.body.len() as i32
            }
            None => {
                return Exchange {
                    trapped: Some(format!("stream {ctx} is not open")),
                    ..Exchange::default()
                };
            }
        };
        let result = self.call_on::<(i32, i32, i32), i32>(
            ctx,
            "proxy_on_request_body",
            (ctx, total, i32::from(last)),
        );
        self.exchange(ctx, result)
    }

    /// Ends stream `ctx`'s request with trailers after its body, as an
    /// HTTP/2 client may: the last body callback did not end the stream,
    /// this one does.
    pub fn trailers(&mut self, ctx: i32, trailers: &[(&str, &str)]) -> Exchange {
        let n = match self.state_mut().streams.get_mut(&ctx) {
            Some(s) => {
                s.trailers = trailers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                s.trailers.len() as i32
            }
            None => {
                return Exchange {
                    trapped: Some(format!("stream {ctx} is not open")),
                    ..Exchange::default()
                };
            }
        };
        let result = self.call_on::<(i32, i32), i32>(ctx, "proxy_on_request_trailers", (ctx, n));
        self.exchange(ctx, result)
    }

    /// What stream `ctx` looks like now, after a callback that returned
    /// `action`.
    pub fn exchange(&self, ctx: i32, action: Result<i32>) -> Exchange {
        let mut ex = Exchange::default();
        if let Some(s) = self.stream(ctx) {
            ex.headers = s.headers.clone();
            ex.reply = s.reply.clone();
            ex.foreign_calls = s.foreign_calls.clone();
            ex.body = s.body.clone();
            ex.resumes = s.resumes;
        }
        match action {
            Ok(a) => ex.continued = ex.reply.is_none() && a == ACTION_CONTINUE,
            Err(e) => ex.trapped = Some(e.to_string()),
        }
        if ex.trapped.is_none() {
            ex.trapped = self.trapped.clone();
        }
        ex
    }

    /// An open stream's state.
    pub fn stream(&self, ctx: i32) -> Option<&Stream> {
        self.state().streams.get(&ctx)
    }

    /// The upstream's first `size` response body bytes reach the filter.
    pub fn response_body(&mut self, ctx: i32, size: usize) -> Result<()> {
        self.call_on::<(i32, i32, i32), i32>(ctx, "proxy_on_response_body", (ctx, size as i32, 0))?;
        Ok(())
    }

    /// Ends a stream as Envoy does, whether it completed or the client
    /// reset it: log, done, delete. Its pending callouts stay pending:
    /// Envoy does not cancel them, and their answers arrive later.
    pub fn finish(&mut self, ctx: i32) {
        if self.trapped.is_none() {
            let _ = self.call_on::<i32, ()>(ctx, "proxy_on_log", ctx);
            let _ = self.call_on::<i32, i32>(ctx, "proxy_on_done", ctx);
            let _ = self.call_on::<i32, ()>(ctx, "proxy_on_delete", ctx);
        }
        let st = self.state_mut();
        st.streams.remove(&ctx);
        st.current = ROOT_CONTEXT;
    }

    /// Takes every item waiting in a queue (as the consumer would).
    pub fn drain_queue(&mut self, vm_id: &str, name: &str) -> Vec<Vec<u8>> {
        let mut shared = lock(&self.state().shared);
        shared
            .queues
            .values_mut()
            .find(|(v, n, _)| v == vm_id && n == name)
            .map(|(_, _, q)| q.drain(..).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_writes_follow_envoys_copy_from() {
        let mut b = b"hello".to_vec();
        assert_eq!(copy_from(&mut b, 0, 5, b"bye"), OK, "the whole range");
        assert_eq!(b, b"bye");
        assert_eq!(copy_from(&mut b, 0, 0, b">"), OK, "an empty range prepends");
        assert_eq!(b, b">bye");
        assert_eq!(copy_from(&mut b, 4, 0, b"!"), OK, "from the end appends");
        assert_eq!(b, b">bye!");
        assert_eq!(copy_from(&mut b, 2, 1, b"x"), BAD_ARGUMENT, "the middle");
        assert_eq!(b, b">bye!");
        assert_eq!(copy_from(&mut b, 0, usize::MAX, b"all"), OK);
        assert_eq!(b, b"all", "a range past the end drains what there is");
    }
}
