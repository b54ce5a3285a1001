//! `cargo xtask bench --only hostile`: the attacks of the third hardening
//! round, each on a fresh sidecar, scaled to about a minute. For each one
//! the sidecar is measured idle, then under the attack, side by side: its
//! peak resident memory (sampled every 100 ms), the latency of `/select`
//! from a client that keeps its connection open, as Envoy and a selection
//! client do, and that of `/health` probes. The attack's own outcome (what was refused, what held) comes
//! from the sidecar's counters.
//!
//! * `replay_flood`: a worker whose replay ROUTER answers every request
//!   with full-size batches repeating their start sequence, while its
//!   publisher skips 1,000 sequence numbers every 2 s;
//! * `slow_dump_readers`: 16 clients read `GET /dump` of the whole index at
//!   64 KiB a second;
//! * `idle_and_slowloris`: 2,000 idle sockets and 200 that send a header
//!   byte every 100 ms, against the selection listener;
//! * `admission_flood`: reservations from a token holder as fast as two
//!   threads can send them, and signed peer admissions over replica sync
//!   at 100,000 a second (the rate that left 3M holders in 30 s; paced,
//!   so that the attacker's own encoding does not take the cores the
//!   sidecar is measured on);
//! * `oversized_sync_frames`: a registered replica-sync peer sending 2 MiB
//!   frames between small ones;
//! * `wrapping_loads`: reservations of 2^63 prefill tokens;
//! * `slow_bodies`: 1,024 connections each posting `/select` with a
//!   declared 2,000,000-byte body at 32 KiB a second, reopened when cut;
//!   the sidecar's memory is read again once they are gone;
//! * `reconnect_flood`: 2,000 silent sockets on each listener (twice its
//!   cap), each reopened as soon as the sidecar closes it;
//! * `spaced_readers`: eight whole-index readers 2 s apart, each reading
//!   at 64 KiB a second: `/dump` with the token and reset frames of
//!   `/v1/snapshot` without it, in turn.
//!
//! And two disaggregated attacks, each on a fleet of two prefill and two
//! decode simulated vLLM workers (NIXL) behind Envoy, the same indexed
//! blocks published for them; besides the sidecar's figures each has its
//! own outcome:
//!
//! * `departed_prefills`: 1,000 clients, in waves every 250 ms spread over
//!   the attack, each posting a 4,000-token completion to Envoy whose
//!   prefill leg takes 1 s on its sim, and hanging up 0.2 s in. Envoy
//!   cancels no callout, so every leg runs on; the filter keeps its
//!   booking until the leg's deadline (`prefill_timeout_ms`, 3 s, from
//!   its dispatch). Outcome: the peak of legs running on the prefill sims
//!   against the peak the sidecar shows booked on their ranks, Envoy's
//!   `kvgate_prefill_orphaned_total`, and what is still booked once the
//!   last deadline has passed;
//! * `stalled_prefills`: prefill sims that answer every leg's headers and
//!   then stall its body (`--prefill-stall-after-headers`), the model with
//!   a 500 ms `prefill_timeout_ms` and `on_prefill_failure = "local"`,
//!   while eight honest clients send 3,000-token completions through
//!   Envoy. Outcome: the share of them answered 200 (before the fix a
//!   router VM that took such an answer panicked, and every later request
//!   on its thread failed), Envoy's `kvgate_prefill_failed_total`, and the
//!   lines of Envoy's log that say a VM panicked.
//!
//! Besides `/select`, `/health` on the main port is called every 100 ms
//! on a fresh connection with a 1 s timeout, as the kubelet probes.
//!
//! `KVGATE_HOSTILE_ONLY=a,b` runs only those attacks; their results then
//! replace theirs in `bench/results/hostile.json`, and the others'
//! published figures are kept (each attack carries its own phases).

use crate::kvfleet::{self, CHAIN_BLOCKS, Publisher, chain_tokens};
use crate::{build, figures, repo};
use anyhow::{Context, Result, bail};
use kvgate_load::summary::percentile;
use kvgate_sidecar::replica::wire::{self, Placed, Stamp, SyncEvent, SyncId};
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const TOKEN: &str = "hostile-bench-token";
const WORKERS: usize = 4;
const MIB: f64 = (1u64 << 20) as f64;
/// Signed peer admissions a second in the admission flood.
const PEER_FLOOD_PER_S: f64 = 100_000.0;

/// How long each phase runs.
struct Phases {
    idle: Duration,
    attack: Duration,
    blocks_per_worker: usize,
}

impl Phases {
    fn of(quick: bool) -> Phases {
        if quick {
            Phases {
                idle: Duration::from_secs(5),
                attack: Duration::from_secs(15),
                blocks_per_worker: 25_000,
            }
        } else {
            Phases {
                idle: Duration::from_secs(10),
                attack: Duration::from_secs(45),
                blocks_per_worker: 100_000,
            }
        }
    }
}

/// One attack: started on a ready stack, stopped by the flag, answering
/// what it did.
type Attack = fn(&Stack, &mut Bench, Arc<AtomicBool>) -> Result<JoinHandle<Result<Value>>>;

/// What every attack can use: the stack's publishers and indexed prompts.
struct Bench {
    /// One per worker, in order, until an attack takes one over.
    publishers: Vec<Publisher>,
    prompts: Vec<Vec<u32>>,
    /// How long the attack is measured for.
    attack: Duration,
}

/// The fleet an attack runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fleet {
    /// Four aggregated instant workers.
    Plain,
    /// Two prefill and two decode workers (NIXL) whose prefill legs take
    /// [`DEPARTED_PREFILL_S`].
    SlowPrefills,
    /// Two prefill workers that stall every leg after its headers, and two
    /// decode workers.
    StalledPrefills,
}

/// Simulated time runs this much faster on the disaggregated fleets' sims
/// (the stack's default).
const PD_SPEEDUP: f64 = 20.0;
/// Clients of `departed_prefills`, in all.
const DEPARTED_CLIENTS: usize = 1000;
/// A wave of them this often.
const DEPARTED_WAVE: Duration = Duration::from_millis(250);
const DEPARTED_PROMPT_TOKENS: usize = 4000;
/// A prefill leg's wall time on its sim.
const DEPARTED_PREFILL_S: f64 = 1.0;
/// A departed client hangs up this long after sending its request.
const DEPARTED_HANG_UP: Duration = Duration::from_millis(200);
const DEPARTED_PREFILL_TIMEOUT_MS: u64 = 3000;
/// How long a departed leg's blocks are held for a decode leg that never
/// comes (wall ms), and the prefill sims' KV blocks per rank: enough that
/// legs never wait for cache room.
const DEPARTED_KV_LEASE_MS: u64 = 2000;
const DEPARTED_GPU_BLOCKS: usize = 100_000;
const STALLED_PREFILL_TIMEOUT_MS: u64 = 500;
/// Honest clients of `stalled_prefills`, each one request at a time.
const HONEST_CLIENTS: usize = 8;
const HONEST_PROMPT_TOKENS: u32 = 3000;
/// At most this many honest requests in all.
const HONEST_MAX_REQUESTS: u64 = 5000;

pub fn run(quick: bool) -> Result<Value> {
    let phases = Phases::of(quick);
    let attacks: [(&str, Attack, Fleet); 11] = [
        ("replay_flood", replay_flood, Fleet::Plain),
        ("slow_dump_readers", slow_dump_readers, Fleet::Plain),
        ("idle_and_slowloris", idle_and_slowloris, Fleet::Plain),
        ("admission_flood", admission_flood, Fleet::Plain),
        ("oversized_sync_frames", oversized_sync_frames, Fleet::Plain),
        ("wrapping_loads", wrapping_loads, Fleet::Plain),
        ("slow_bodies", slow_bodies, Fleet::Plain),
        ("reconnect_flood", reconnect_flood, Fleet::Plain),
        ("spaced_readers", spaced_readers, Fleet::Plain),
        ("departed_prefills", departed_prefills, Fleet::SlowPrefills),
        ("stalled_prefills", stalled_prefills, Fleet::StalledPrefills),
    ];
    // KVGATE_HOSTILE_ONLY=a,b runs only those attacks, to try one.
    let only = std::env::var("KVGATE_HOSTILE_ONLY").ok();
    let chosen = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|n| n.trim() == name))
    };
    let mut results = Vec::new();
    for (name, attack, fleet) in attacks.into_iter().filter(|(n, _, _)| chosen(n)) {
        eprintln!("xtask: bench hostile: {name}");
        let mut v = one(name, attack, fleet, &phases).with_context(|| format!("attack {name}"))?;
        // Each attack carries its phases: a subset run's results sit
        // beside figures of another run.
        v["quick"] = json!(quick);
        v["idle_s"] = json!(phases.idle.as_secs());
        v["attack_s"] = json!(phases.attack.as_secs());
        v["indexed_blocks"] = json!(phases.blocks_per_worker * WORKERS);
        v["measured"] = figures::stamp(quick, None);
        eprintln!("{v}");
        results.push(v);
    }
    let this = json!({
        "name": "hostile",
        "quick": quick,
        "idle_s": phases.idle.as_secs(),
        "attack_s": phases.attack.as_secs(),
        "indexed_blocks": phases.blocks_per_worker * WORKERS,
        "attacks": results,
    });
    if only.is_none() {
        return Ok(this);
    }
    // A subset: the other attacks' published figures stay.
    let order: Vec<&str> = attacks.iter().map(|(n, _, _)| *n).collect();
    let published = std::fs::read(repo().join("bench/results/hostile.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .filter(|v| v["attacks"].is_array());
    Ok(match published {
        Some(old) => merge(old, this, &order),
        None => this,
    })
}

/// `new`'s attacks in place of `old`'s of the same name, the others kept
/// (each given `old`'s phases where it has none of its own), in the order
/// of `order`; the top-level phases stay `old`'s.
fn merge(mut old: Value, new: Value, order: &[&str]) -> Value {
    let phase_keys = ["quick", "idle_s", "attack_s", "indexed_blocks", "measured"];
    let mut attacks: Vec<Value> = old["attacks"].as_array().cloned().unwrap_or_default();
    for a in &mut attacks {
        for k in phase_keys {
            if a.get(k).is_none() {
                a[k] = old[k].clone();
            }
        }
    }
    for a in new["attacks"].as_array().into_iter().flatten() {
        match attacks.iter_mut().find(|o| o["attack"] == a["attack"]) {
            Some(o) => *o = a.clone(),
            None => attacks.push(a.clone()),
        }
    }
    let rank = |a: &Value| {
        a["attack"]
            .as_str()
            .and_then(|n| order.iter().position(|o| *o == n))
            .unwrap_or(order.len())
    };
    attacks.sort_by_key(rank);
    old["attacks"] = Value::Array(attacks);
    old
}

/// The stack an attack runs on: every fleet indexes the same blocks and
/// serves the selection API as the plain one does.
fn stack_config(name: &str, fleet: Fleet) -> StackConfig {
    let plain = StackConfig {
        kv_external_replay: name == "replay_flood",
        replica_sync: true,
        control_token: Some(TOKEN.to_string()),
        ..kvfleet::config(WORKERS)
    };
    let strings = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let consumer = strings(&["--kv-role", "kv_consumer", "--kv-side-channel-port", "0"]);
    let mut producer = strings(&["--kv-role", "kv_producer", "--kv-side-channel-port", "0"]);
    let timeout_ms = match fleet {
        Fleet::Plain => return plain,
        Fleet::SlowPrefills => {
            // A leg of DEPARTED_PROMPT_TOKENS takes DEPARTED_PREFILL_S of
            // wall time at the sims' speedup.
            let us_per_token =
                DEPARTED_PREFILL_S * 1e6 * PD_SPEEDUP / DEPARTED_PROMPT_TOKENS as f64;
            producer.extend([
                "--prefill-us-per-token".into(),
                format!("{us_per_token}"),
                "--kv-lease-ms".into(),
                DEPARTED_KV_LEASE_MS.to_string(),
                "--num-gpu-blocks".into(),
                DEPARTED_GPU_BLOCKS.to_string(),
                // Every leg runs at once: none waits for a batch slot.
                "--max-running".into(),
                "1024".into(),
            ]);
            DEPARTED_PREFILL_TIMEOUT_MS
        }
        Fleet::StalledPrefills => {
            producer.push("--prefill-stall-after-headers".into());
            STALLED_PREFILL_TIMEOUT_MS
        }
    };
    StackConfig {
        sim_args: strings(&[
            "--default-max-tokens",
            "1",
            "--speedup",
            &PD_SPEEDUP.to_string(),
        ]),
        roles: strings(&["prefill", "prefill", "decode", "decode"]),
        worker_sim_args: vec![producer.clone(), producer, consumer.clone(), consumer],
        model_toml: format!(
            "[models.disaggregation]\nprotocol = \"vllm-nixl\"\non_prefill_failure = \"local\"\nprefill_timeout_ms = {timeout_ms}\n"
        ),
        ..plain
    }
}

fn one(name: &str, attack: Attack, fleet: Fleet, phases: &Phases) -> Result<Value> {
    let stack = Stack::start_with(build::release_paths()?, stack_config(name, fleet))?;
    // Honest, empty replay buffers for every worker but the first, whose
    // ROUTER the attack binds.
    let routers = Arc::new(AtomicBool::new(false));
    let replay_ports: Vec<u16> = stack.workers.iter().filter_map(|w| w.replay_port).collect();
    let honest = match replay_ports.split_first() {
        Some((_, rest)) => Some(honest_replay(rest, routers.clone())?),
        None => None,
    };
    let mut bench = fill(&stack, phases.blocks_per_worker)?;
    bench.attack = phases.attack;

    let cpu0 = stack.cpu_seconds();
    let idle = measure(&stack, &bench, phases.idle)?;
    let cpu1 = stack.cpu_seconds();
    let stop = Arc::new(AtomicBool::new(false));
    let handle = attack(&stack, &mut bench, stop.clone())?;
    let under = measure(&stack, &bench, phases.attack)?;
    let cpu2 = stack.cpu_seconds();
    // CPU seconds a second of each part of the stack, idle and attacked:
    // on a small machine they share the cores the sidecar is measured on.
    let cores = |a: [f64; 3], b: [f64; 3], d: Duration| {
        let per_s = |i: usize| (b[i] - a[i]) / d.as_secs_f64().max(1e-9);
        json!({"envoy": per_s(0), "sidecar": per_s(1), "workers": per_s(2)})
    };
    let cpu = json!({
        "idle": cores(cpu0, cpu1, phases.idle),
        "under_attack": cores(cpu1, cpu2, phases.attack),
    });
    stop.store(true, Ordering::Relaxed);
    let outcome = handle
        .join()
        .map_err(|_| anyhow::anyhow!("attack thread panicked"))??;
    routers.store(true, Ordering::Relaxed);
    if let Some(h) = honest {
        let _ = h.join();
    }
    let counters = counters(&stack)?;
    bench.publishers.clear();
    Ok(json!({
        "attack": name,
        "idle": idle,
        "under_attack": under,
        "rss_ratio": ratio(&under["rss_peak_mib"], &idle["rss_peak_mib"]),
        "select_p99_ratio": ratio(&under["select_p99_us"], &idle["select_p99_us"]),
        "health_p99_ratio": ratio(&under["health_p99_us"], &idle["health_p99_us"]),
        "outcome": outcome,
        "counters": counters,
        "cpu_cores": cpu,
    }))
}

fn ratio(a: &Value, b: &Value) -> Value {
    match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => json!(a / b),
        _ => Value::Null,
    }
}

/// Publishes `blocks_per_worker` blocks on each worker and waits until the
/// index holds them.
fn fill(stack: &Stack, blocks_per_worker: usize) -> Result<Bench> {
    let mut publishers = kvfleet::publishers(stack)?;
    let chains = blocks_per_worker / CHAIN_BLOCKS;
    kvfleet::fill(stack, &mut publishers, chains)?;
    let prompts = (0..64)
        .map(|i| chain_tokens(i % WORKERS, (i * 37) % chains.max(1)))
        .collect();
    Ok(Bench {
        publishers,
        prompts,
        attack: Duration::ZERO,
    })
}

/// `/select` over one kept-alive connection for `how_long`, and the
/// sidecar's resident memory every 100 ms meanwhile.
fn measure(stack: &Stack, bench: &Bench, how_long: Duration) -> Result<Value> {
    let addr = stack.gateways[0].selection_addr();
    let bodies: Vec<String> = bench
        .prompts
        .iter()
        .map(|p| json!({"model_name": "demo-model", "token_ids": p}).to_string())
        .collect();
    let done = Arc::new(AtomicBool::new(false));
    let pid = stack.gateways[0]
        .sidecar_pid()
        .context("the sidecar is not running")?;
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak = 0u64;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(kvgate_stack::process_rss(pid).unwrap_or(0));
                std::thread::sleep(Duration::from_millis(100));
            }
            peak
        })
    };
    let prober = {
        let (done, addr) = (done.clone(), stack.sidecar_addr());
        std::thread::spawn(move || {
            let (mut lat, mut failed) = (Vec::new(), 0u64);
            while !done.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                match probe(&addr, "/health") {
                    Some(200) => lat.push(t0.elapsed().as_micros() as u64),
                    _ => failed += 1,
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            (lat, failed)
        })
    };
    let mut conn = KeepAlive::connect(&addr)?;
    let mut lat = Vec::new();
    let (mut failed, mut reconnects) = (0u64, 0u64);
    let t = Instant::now();
    let mut i = 0;
    while t.elapsed() < how_long {
        let t0 = Instant::now();
        match conn.post("/select", bodies[i % bodies.len()].as_bytes()) {
            Ok(200) => lat.push(t0.elapsed().as_micros() as u64),
            Ok(_) => failed += 1,
            Err(_) => {
                failed += 1;
                reconnects += 1;
                std::thread::sleep(Duration::from_millis(50));
                if let Ok(c) = KeepAlive::connect(&addr) {
                    conn = c;
                }
            }
        }
        i += 1;
        // About 200 selections a second: a client, not a load test.
        std::thread::sleep(Duration::from_millis(5));
    }
    done.store(true, Ordering::Relaxed);
    let peak = sampler
        .join()
        .map_err(|_| anyhow::anyhow!("sampler panicked"))?;
    let (mut health, health_failed) = prober
        .join()
        .map_err(|_| anyhow::anyhow!("prober panicked"))?;
    health.sort_unstable();
    lat.sort_unstable();
    Ok(json!({
        "rss_peak_mib": peak as f64 / MIB,
        "health_calls": health.len(),
        "health_failed": health_failed,
        "health_p99_us": percentile(&health, 99.0),
        "select_calls": lat.len(),
        "select_failed": failed,
        "select_reconnects": reconnects,
        "select_p50_us": percentile(&lat, 50.0),
        "select_p99_us": percentile(&lat, 99.0),
    }))
}

/// A GET on a fresh connection within a second, as the kubelet probes;
/// the status, `None` when refused, closed or late.
fn probe(addr: &str, path: &str) -> Option<u16> {
    let sa = addr.parse().ok()?;
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    read_response(&mut s).ok()
}

/// A client connection that stays open between requests.
struct KeepAlive {
    s: TcpStream,
    addr: String,
    /// Sends the control token with every request.
    authorized: bool,
}

impl KeepAlive {
    fn connect(addr: &str) -> Result<KeepAlive> {
        let s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.set_nodelay(true)?;
        Ok(KeepAlive {
            s,
            addr: addr.to_string(),
            authorized: false,
        })
    }

    /// A connection of a token holder.
    fn authorized(addr: &str) -> Result<KeepAlive> {
        Ok(KeepAlive {
            authorized: true,
            ..KeepAlive::connect(addr)?
        })
    }

    /// Sends one POST and reads its answer whole; the status.
    fn post(&mut self, path: &str, body: &[u8]) -> Result<u16> {
        let auth = if self.authorized {
            format!("authorization: Bearer {TOKEN}\r\n")
        } else {
            String::new()
        };
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        self.s.write_all(head.as_bytes())?;
        self.s.write_all(body)?;
        read_response(&mut self.s)
    }
}

/// The status a response's bytes start with (`HTTP/1.1 503 ...`).
fn status_of(response: &[u8]) -> Option<u16> {
    String::from_utf8_lossy(response)
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Reads one response with a content length; the status.
fn read_response(s: &mut TcpStream) -> Result<u16> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            bail!("connection closed");
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if buf.len() > 64 << 10 {
            bail!("response head over 64 KiB");
        }
    };
    let status = status_of(&buf[..head_end]).context("no status")?;
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no content-length")?;
    let mut have = buf.len() - head_end;
    while have < len {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            bail!("connection closed mid-body");
        }
        have += n;
    }
    Ok(status)
}

/// The sidecar's counters that say what each attack met, summed over
/// their labels.
fn counters(stack: &Stack) -> Result<Value> {
    let (status, body) = http::get(&stack.sidecar_addr(), "/metrics")?;
    if status != 200 {
        bail!("/metrics answered {status}");
    }
    let text = String::from_utf8_lossy(&body);
    let sum = |name: &str| sample_sum(&text, name, &[]);
    let names = [
        "kvgate_sidecar_kv_replays_refused_total",
        "kvgate_sidecar_kv_resyncs_total",
        "kvgate_sidecar_connections_refused_total",
        "kvgate_sidecar_connections_timed_out_total",
        "kvgate_sidecar_connections_open",
        "kvgate_sidecar_bookings_refused_total",
        "kvgate_sidecar_bookings_active",
        "kvgate_sidecar_replica_sync_refused_messages_total",
        "kvgate_sidecar_replica_peer_reconnects_total",
        "kvgate_sidecar_full_reads_refused_total",
        "kvgate_sidecar_full_read_copies_total",
        "kvgate_sidecar_replica_peer_refused_admissions_total",
        "kvgate_sidecar_unauthorized_total",
        "kvgate_sidecar_connections_evicted_total",
        "kvgate_sidecar_requests_refused_total",
        "kvgate_sidecar_request_body_bytes",
        "kvgate_sidecar_full_read_copies_alive",
    ];
    Ok(names
        .iter()
        .map(|n| (n.to_string(), json!(sum(n))))
        .collect())
}

// ---- the attacks ----

/// The first worker's publisher skips 1,000 sequence numbers every 2 s;
/// its replay ROUTER answers each request with batches as large as a
/// message may be, every one carrying the start sequence again, until the
/// replay timeout would end it.
fn replay_flood(
    stack: &Stack,
    bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let port = stack.workers[0]
        .replay_port
        .context("the stack has no replay endpoints")?;
    // The first worker's publisher now speaks for the attacker.
    let mut publisher = bench.publishers.remove(0);
    Ok(std::thread::spawn(move || {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER)?;
        router.set_linger(0)?;
        router.set_rcvtimeo(20)?;
        router.bind(&format!("tcp://127.0.0.1:{port}"))?;
        let payload = vec![0xA5u8; 4 << 20];
        let (mut requests, mut sent_bytes) = (0u64, 0u64);
        let mut next_gap = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            if Instant::now() >= next_gap {
                publisher.skip(1_000);
                publisher.chains(&[chain_tokens(0, 1_000_000 + requests as usize)])?;
                next_gap = Instant::now() + Duration::from_secs(2);
            }
            let Ok(req) = router.recv_multipart(0) else {
                continue;
            };
            let [id, _, start] = req.as_slice() else {
                continue;
            };
            requests += 1;
            let seq = start.clone();
            // 64 batches of 4 MiB (256 MiB) per request, all one sequence.
            for _ in 0..64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if router
                    .send_multipart([&id[..], b"", b"kv", &seq, &payload], 0)
                    .is_err()
                {
                    break;
                }
                sent_bytes += payload.len() as u64;
            }
            let _ = router.send_multipart([&id[..], b"", b"kv", &[0xFF; 8], b""], 0);
        }
        Ok(json!({"replay_requests": requests, "replay_bytes_sent_mib": sent_bytes as f64 / MIB}))
    }))
}

/// Honest replay buffers holding nothing: the end marker at once.
fn honest_replay(ports: &[u16], stop: Arc<AtomicBool>) -> Result<JoinHandle<()>> {
    let ctx = zmq::Context::new();
    let mut routers = Vec::new();
    for p in ports {
        let r = ctx.socket(zmq::ROUTER)?;
        r.set_linger(0)?;
        r.bind(&format!("tcp://127.0.0.1:{p}"))?;
        routers.push(r);
    }
    Ok(std::thread::spawn(move || {
        let _ctx = ctx;
        while !stop.load(Ordering::Relaxed) {
            let mut items: Vec<zmq::PollItem> = routers
                .iter()
                .map(|r| r.as_poll_item(zmq::POLLIN))
                .collect();
            if zmq::poll(&mut items, 50).unwrap_or(0) == 0 {
                continue;
            }
            for r in &routers {
                while let Ok(req) = r.recv_multipart(zmq::DONTWAIT) {
                    if let Some(id) = req.first() {
                        let _ = r.send_multipart([&id[..], b"", b"kv", &[0xFF; 8], b""], 0);
                    }
                }
            }
        }
    }))
}

/// Sixteen clients each read the whole dump at 64 KiB a second, all at
/// once, reconnecting when one is done or refused.
fn slow_dump_readers(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let addr = stack.sidecar_addr();
    Ok(std::thread::spawn(move || {
        let statuses = Arc::new(Counts::default());
        let readers: Vec<_> = (0..16)
            .map(|_| {
                let (addr, stop, statuses) = (addr.clone(), stop.clone(), statuses.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let status = slow_get(&addr, "/dump", true, &stop).unwrap_or(0);
                        statuses.count(status);
                        if status != 200 {
                            std::thread::sleep(Duration::from_millis(500));
                        }
                    }
                })
            })
            .collect();
        for r in readers {
            let _ = r.join();
        }
        Ok(json!({"readers": 16, "answers": statuses.view()}))
    }))
}

/// Answers by status (0: no answer), shared between attack threads.
#[derive(Default)]
struct Counts(Mutex<BTreeMap<u16, u64>>);

impl Counts {
    fn count(&self, status: u16) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(status).or_default() += 1;
    }
    fn view(&self) -> Value {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(s, n)| (s.to_string(), json!(n)))
            .collect()
    }
}

/// A GET whose answer is read at 64 KiB a second, with the control token
/// when `authorized`; its status.
fn slow_get(addr: &str, path: &str, authorized: bool, stop: &AtomicBool) -> Result<u16> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let auth = if authorized {
        format!("authorization: Bearer {TOKEN}\r\n")
    } else {
        String::new()
    };
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )?;
    let mut chunk = vec![0u8; 8 << 10];
    let mut head = Vec::new();
    let mut status = 0;
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 || stop.load(Ordering::Relaxed) {
            return Ok(status);
        }
        if status == 0 {
            head.extend_from_slice(&chunk[..n]);
            if let Some(line) = head
                .split(|b| *b == b'\n')
                .next()
                .filter(|_| head.len() > 12)
            {
                status = status_of(line).unwrap_or(0);
            }
        }
        // 8 KiB every 125 ms.
        std::thread::sleep(Duration::from_millis(125));
    }
}

/// 2,000 sockets that never send, and 200 that send their head a byte
/// every 100 ms, all on the selection listener; each reopened when closed.
fn idle_and_slowloris(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let addr = stack.gateways[0].selection_addr();
    Ok(std::thread::spawn(move || {
        let (opened, closed) = hold_all(&[(addr.clone(), 2_000, false), (addr, 200, true)], &stop);
        Ok(json!({
            "idle_sockets": 2_000,
            "slowloris_sockets": 200,
            "connections_opened": opened,
            "connections_closed_by_the_sidecar": closed,
        }))
    }))
}

/// Holds each `(address, sockets, slowloris)` group open with ten threads
/// (a tenth of its sockets each) until `stop`; answers the connections
/// opened, and those the sidecar closed.
fn hold_all(groups: &[(String, usize, bool)], stop: &Arc<AtomicBool>) -> (u64, u64) {
    let opened = Arc::new(AtomicU64::new(0));
    let closed = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for (addr, sockets, slowloris) in groups {
        for _ in 0..10 {
            let (addr, stop, opened, closed) =
                (addr.clone(), stop.clone(), opened.clone(), closed.clone());
            let (n, slowloris) = (sockets / 10, *slowloris);
            threads.push(std::thread::spawn(move || {
                hold(&addr, n, slowloris, &stop, &opened, &closed)
            }));
        }
    }
    for t in threads {
        let _ = t.join();
    }
    (
        opened.load(Ordering::Relaxed),
        closed.load(Ordering::Relaxed),
    )
}

fn hold(
    addr: &str,
    n: usize,
    slowloris: bool,
    stop: &AtomicBool,
    opened: &AtomicU64,
    closed: &AtomicU64,
) {
    let head = format!("POST /select HTTP/1.1\r\nHost: {addr}\r\ncontent-length: 2\r\n");
    let mut socks: Vec<(TcpStream, usize)> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        while socks.len() < n && !stop.load(Ordering::Relaxed) {
            let Ok(s) = TcpStream::connect(addr) else {
                std::thread::sleep(Duration::from_millis(100));
                break;
            };
            let _ = s.set_nonblocking(true);
            opened.fetch_add(1, Ordering::Relaxed);
            socks.push((s, 0));
        }
        socks.retain_mut(|(s, at)| {
            let mut b = [0u8; 512];
            let gone = matches!(s.read(&mut b), Ok(0));
            let gone = gone
                || (slowloris
                    && *at < head.len()
                    && s.write(&head.as_bytes()[*at..*at + 1]).is_err());
            if slowloris {
                *at = (*at + 1).min(head.len() - 1);
            }
            if gone {
                closed.fetch_add(1, Ordering::Relaxed);
            }
            !gone
        });
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Two threads of reservations from a token holder, never freed, and a
/// peer's signed admissions over replica sync, as fast as they go.
fn admission_flood(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let addr = stack.gateways[0].selection_addr();
    let sidecar = stack.sidecar_addr();
    let statuses = Arc::new(Counts::default());
    let api: Vec<_> = (0..2)
        .map(|t| {
            let (addr, stop, statuses) = (addr.clone(), stop.clone(), statuses.clone());
            std::thread::spawn(move || {
                reserve_until(&addr, &stop, &statuses, |i| {
                    json!({
                        "reservation_id": format!("flood-{t}-{i}"),
                        "model_name": "demo-model",
                        "worker_id": 1 + i % WORKERS as u64,
                        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                    })
                    .to_string()
                })
            })
        })
        .collect();
    let peer = {
        let stop = stop.clone();
        std::thread::spawn(move || -> Result<u64> {
            let ctx = zmq::Context::new();
            let publisher = ctx.socket(zmq::PUB)?;
            publisher.set_linger(0)?;
            publisher.set_sndhwm(100_000)?;
            register_peer(&sidecar, &publisher)?;
            std::thread::sleep(Duration::from_millis(500));
            let mut sent = 0u64;
            let origin = 0xBAD_u64;
            // Each message numbered anew: fresh admissions, not replays.
            let mut seq = 0u64;
            let started = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let due = started + Duration::from_secs_f64(sent as f64 / PEER_FLOOD_PER_S);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let events: Vec<SyncEvent> = (0..wire::MAX_EVENTS as u64)
                    .map(|k| {
                        SyncEvent::Admit(
                            SyncId::Reservation(format!("peer-flood-{}", sent + k).into()),
                            Placed {
                                model: "demo-model".into(),
                                tenant: "default".into(),
                                request_tenant: "default".into(),
                                block_size: 16,
                                worker_id: 1 + k % WORKERS as u64,
                                dp_rank: 0,
                                prefill_tokens: 8,
                                decode_blocks: 1,
                            },
                        )
                    })
                    .collect();
                for run in wire::split(&events, 1 << 20, true) {
                    seq += 1;
                    publisher.send(wire::encode(&Stamp::now(origin, seq), run, Some(TOKEN)), 0)?;
                }
                sent += events.len() as u64;
            }
            Ok(sent)
        })
    };
    let statuses2 = statuses.clone();
    Ok(std::thread::spawn(move || {
        for t in api {
            t.join()
                .map_err(|_| anyhow::anyhow!("flood thread panicked"))??;
        }
        let peer_sent = peer
            .join()
            .map_err(|_| anyhow::anyhow!("peer thread panicked"))??;
        Ok(json!({"api_answers": statuses2.view(), "peer_admissions_sent": peer_sent}))
    }))
}

/// Posts the reservations `body(i)` gives, i = 0, 1, ..., as a token
/// holder on one kept-alive connection until `stop`, counting the answers.
fn reserve_until(
    addr: &str,
    stop: &AtomicBool,
    statuses: &Counts,
    body: impl Fn(u64) -> String,
) -> Result<()> {
    let mut conn = KeepAlive::authorized(addr)?;
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        match conn.post("/reservations", body(i).as_bytes()) {
            Ok(s) => statuses.count(s),
            Err(_) => {
                statuses.count(0);
                conn = KeepAlive::authorized(addr)?;
            }
        }
        i += 1;
    }
    Ok(())
}

/// Binds `publisher` on a free loopback port and registers it with the
/// sidecar as a replica-sync peer.
fn register_peer(sidecar: &str, publisher: &zmq::Socket) -> Result<()> {
    publisher.bind("tcp://127.0.0.1:*")?;
    let endpoint = publisher
        .get_last_endpoint()?
        .map_err(|_| anyhow::anyhow!("endpoint not UTF-8"))?;
    let body = json!({ "endpoint": endpoint }).to_string();
    let (status, _) = http::request(
        sidecar,
        "POST",
        "/replica_sync/register_peer",
        &[
            ("content-type", "application/json"),
            ("authorization", &format!("Bearer {TOKEN}")),
        ],
        Some(body.as_bytes()),
    )?;
    if status != 200 {
        bail!("register_peer answered {status}");
    }
    Ok(())
}

/// A registered peer that sends a 2 MiB frame, then ten small signed ones,
/// over and over.
fn oversized_sync_frames(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let sidecar = stack.sidecar_addr();
    Ok(std::thread::spawn(move || {
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB)?;
        publisher.set_linger(0)?;
        register_peer(&sidecar, &publisher)?;
        let big = vec![0x5Au8; 2 << 20];
        let (mut big_sent, mut small_sent) = (0u64, 0u64);
        while !stop.load(Ordering::Relaxed) {
            publisher.send(&big[..], 0)?;
            big_sent += 1;
            for k in 0..10u64 {
                let id = SyncId::Reservation(format!("sync-{big_sent}-{k}").into());
                let seq = big_sent * 10 + k + 1;
                let msg = wire::encode(&Stamp::now(7, seq), &[SyncEvent::Free(id)], Some(TOKEN));
                publisher.send(msg, 0)?;
                small_sent += 1;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(json!({"oversized_frames_sent": big_sent, "small_frames_sent": small_sent}))
    }))
}

/// Reservations claiming 2^63 prefill tokens, as fast as one thread sends.
fn wrapping_loads(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let addr = stack.gateways[0].selection_addr();
    Ok(std::thread::spawn(move || {
        let statuses = Counts::default();
        reserve_until(&addr, &stop, &statuses, |i| {
            json!({
                "reservation_id": format!("wrap-{i}"),
                "model_name": "demo-model",
                "worker_id": 1,
                "isl_tokens": 1u64 << 63,
                "effective_prefill_tokens": 1u64 << 63,
            })
            .to_string()
        })?;
        Ok(json!({"answers": statuses.view()}))
    }))
}

/// 1,024 connections on the selection listener, each posting `/select`
/// with a declared 2,000,000-byte body sent at 32 KiB a second, reopened
/// when the sidecar answers or closes; then, once they are gone, what the
/// sidecar still holds.
fn slow_bodies(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    const THREADS: usize = 16;
    const CONNECTIONS: usize = 1024;
    let addr = stack.gateways[0].selection_addr();
    let pid = stack.gateways[0]
        .sidecar_pid()
        .context("the sidecar is not running")?;
    Ok(std::thread::spawn(move || {
        let statuses = Arc::new(Counts::default());
        let opened = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                let (addr, stop, statuses, opened) =
                    (addr.clone(), stop.clone(), statuses.clone(), opened.clone());
                std::thread::spawn(move || {
                    post_slowly(&addr, CONNECTIONS / THREADS, &stop, &statuses, &opened)
                })
            })
            .collect();
        for t in threads {
            let _ = t.join();
        }
        // The clients are gone: what stays is what the sidecar kept, read
        // at once and past the allocator's 10 s decay, when freed pages
        // have gone back to the system.
        std::thread::sleep(Duration::from_secs(1));
        let at_once = kvgate_stack::process_rss(pid).unwrap_or(0);
        std::thread::sleep(Duration::from_secs(14));
        let after = kvgate_stack::process_rss(pid).unwrap_or(0);
        Ok(json!({
            "connections": CONNECTIONS,
            "declared_bytes": SLOW_BODY_BYTES,
            "bytes_per_s": 32 << 10,
            "connections_opened": opened.load(Ordering::Relaxed),
            "answers": statuses.view(),
            "rss_1s_after_clients_left_mib": at_once as f64 / MIB,
            "rss_after_clients_left_mib": after as f64 / MIB,
        }))
    }))
}

const SLOW_BODY_BYTES: usize = 2_000_000;

/// Holds `n` slow `/select` posts open, each sending 3,277 bytes every
/// 100 ms, and counts the answers (0: closed without one).
fn post_slowly(addr: &str, n: usize, stop: &AtomicBool, statuses: &Counts, opened: &AtomicU64) {
    struct Post {
        s: TcpStream,
        sent: usize,
        answer: Vec<u8>,
    }
    let head = format!(
        "POST /select HTTP/1.1\r\nHost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {SLOW_BODY_BYTES}\r\n\r\n"
    );
    let piece = vec![b' '; 3277];
    let mut posts: Vec<Post> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        while posts.len() < n && !stop.load(Ordering::Relaxed) {
            let Ok(mut s) = TcpStream::connect(addr) else {
                break;
            };
            if s.write_all(head.as_bytes()).is_err() || s.set_nonblocking(true).is_err() {
                continue;
            }
            opened.fetch_add(1, Ordering::Relaxed);
            posts.push(Post {
                s,
                sent: 0,
                answer: Vec::new(),
            });
        }
        posts.retain_mut(|p| {
            let mut b = [0u8; 1024];
            match p.s.read(&mut b) {
                Ok(0) => {
                    statuses.count(status_of(&p.answer).unwrap_or(0));
                    return false;
                }
                Ok(k) => {
                    p.answer.extend_from_slice(&b[..k]);
                    if p.answer.len() >= 12 {
                        statuses.count(status_of(&p.answer).unwrap_or(0));
                        return false;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => {
                    statuses.count(status_of(&p.answer).unwrap_or(0));
                    return false;
                }
            }
            let k = piece.len().min(SLOW_BODY_BYTES - p.sent);
            match p.s.write(&piece[..k]) {
                Ok(w) => p.sent += w,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => {
                    statuses.count(status_of(&p.answer).unwrap_or(0));
                    return false;
                }
            }
            true
        });
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// 2,000 silent sockets on each listener, twice its cap, each reopened as
/// soon as the sidecar closes it.
fn reconnect_flood(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let groups = [
        (stack.sidecar_addr(), 2_000, false),
        (stack.gateways[0].selection_addr(), 2_000, false),
    ];
    Ok(std::thread::spawn(move || {
        let (opened, closed) = hold_all(&groups, &stop);
        Ok(json!({
            "sockets_per_listener": 2_000,
            "connections_opened": opened,
            "connections_closed_by_the_sidecar": closed,
        }))
    }))
}

/// Eight whole-index readers started 2 s apart, each reading at 64 KiB a
/// second: `/dump` with the token and a reset frame of `/v1/snapshot`
/// without it, in turn. The peak of copies alive, from `/metrics` every
/// 500 ms.
fn spaced_readers(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let addr = stack.sidecar_addr();
    Ok(std::thread::spawn(move || {
        let statuses = Arc::new(Counts::default());
        let sampler = {
            let (addr, stop) = (addr.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut peak = 0.0f64;
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((200, body)) = http::get(&addr, "/metrics") {
                        let alive = sample_sum(
                            &String::from_utf8_lossy(&body),
                            "kvgate_sidecar_full_read_copies_alive",
                            &[],
                        );
                        peak = peak.max(alive);
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
                peak
            })
        };
        let mut readers = Vec::new();
        for i in 0..8 {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let (addr, stop, statuses) = (addr.clone(), stop.clone(), statuses.clone());
            readers.push(std::thread::spawn(move || {
                let status = if i % 2 == 0 {
                    slow_get(&addr, "/dump", true, &stop)
                } else {
                    slow_get(&addr, "/v1/snapshot?after=0&epoch=0", false, &stop)
                };
                statuses.count(status.unwrap_or(0));
            }));
            std::thread::sleep(Duration::from_secs(2));
        }
        for r in readers {
            let _ = r.join();
        }
        let peak = sampler
            .join()
            .map_err(|_| anyhow::anyhow!("sampler panicked"))?;
        Ok(json!({"readers": 8, "answers": statuses.view(), "copies_alive_peak": peak}))
    }))
}

/// A prompt no worker holds: `n` tokens from `tag`'s own range.
fn fresh_prompt(tag: u64, n: usize) -> Vec<u32> {
    let base = 60_000_000u32.wrapping_add((tag as u32).wrapping_mul(10_007));
    (0..n as u32).map(|k| base.wrapping_add(k)).collect()
}

fn completion_request(addr: &str, prompt: &[u32], max_tokens: u32) -> Vec<u8> {
    let body =
        json!({"model": "demo-model", "prompt": prompt, "max_tokens": max_tokens}).to_string();
    let mut req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body.as_bytes());
    req
}

/// The prefill workers of a disaggregated fleet (catalog role `prefill`).
fn prefill_workers(stack: &Stack) -> Vec<(u64, String)> {
    stack
        .workers
        .iter()
        .enumerate()
        .filter(|(i, _)| stack.config.roles.get(*i).map(String::as_str) == Some("prefill"))
        .map(|(_, w)| (w.id, w.endpoint()))
        .collect()
}

/// The sum of a Prometheus page's samples of `name` whose labels contain
/// one of `labels` (all of them when `labels` is empty).
fn sample_sum(text: &str, name: &str, labels: &[String]) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .filter(|l| labels.is_empty() || labels.iter().any(|m| l.contains(m.as_str())))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        // An empty f64 sum is -0.0.
        .fold(0.0, |a, b| a + b)
}

/// Prefill legs on the prefill sims now, running or queued (their
/// `vllm:num_requests_running` and `_waiting`: a prefill worker serves
/// nothing else).
fn legs_in_flight(sims: &[(u64, String)]) -> Option<f64> {
    let mut n = 0.0;
    for (_, addr) in sims {
        let (200, body) = http::get(addr, "/metrics").ok()? else {
            return None;
        };
        let text = String::from_utf8_lossy(&body);
        n += sample_sum(&text, "vllm:num_requests_running", &[]);
        n += sample_sum(&text, "vllm:num_requests_waiting", &[]);
    }
    Some(n)
}

/// Prompt tokens the sidecar shows booked on the prefill workers' ranks.
fn prefill_booked(sidecar: &str, sims: &[(u64, String)]) -> Option<f64> {
    let (200, body) = http::get(sidecar, "/metrics").ok()? else {
        return None;
    };
    let labels: Vec<String> = sims
        .iter()
        .map(|(id, _)| format!("worker_id=\"{id}\""))
        .collect();
    Some(sample_sum(
        &String::from_utf8_lossy(&body),
        "kvgate_sidecar_rank_active_prefill_tokens",
        &labels,
    ))
}

/// Prefill legs the sims have served (their `/sim/disagg` counter).
fn prefill_legs_served(sims: &[(u64, String)]) -> u64 {
    sims.iter()
        .filter_map(|(_, addr)| {
            let (200, body) = http::get(addr, "/sim/disagg").ok()? else {
                return None;
            };
            let v: Value = serde_json::from_slice(&body).ok()?;
            v["counters"]["prefill_legs"].as_u64()
        })
        .sum()
}

/// 1,000 clients in waves every 250 ms spread over the attack, each
/// posting a long completion to Envoy and hanging up 0.2 s in, during its
/// 1 s prefill leg. Meanwhile, every 100 ms, the legs in flight on the
/// prefill sims and the prompt tokens the sidecar shows booked on them;
/// after the attack, what is still booked once the last leg's deadline
/// has passed.
fn departed_prefills(
    stack: &Stack,
    bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let envoy = stack.envoy_addr();
    let sidecar = stack.sidecar_addr();
    let admin = stack.admin_addr();
    let sims = prefill_workers(stack);
    anyhow::ensure!(!sims.is_empty(), "the fleet has no prefill worker");
    let stat = {
        let admin = admin.clone();
        move |name: &str| envoy_stat(&admin, name)
    };
    let before_orphaned = stat("kvgate_prefill_orphaned_total");
    let before_remote = stat("kvgate_prefill_remote_total");
    let before_legs = prefill_legs_served(&sims);
    let per_wave = DEPARTED_CLIENTS
        .div_ceil((bench.attack.as_millis() / DEPARTED_WAVE.as_millis()).max(1) as usize);
    Ok(std::thread::spawn(move || {
        let sampling = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (sims, sidecar, done) = (sims.clone(), sidecar.clone(), sampling.clone());
            std::thread::spawn(move || {
                let (mut legs_peak, mut booked_peak) = (0.0f64, 0.0f64);
                let mut tick = 0u64;
                while !done.load(Ordering::Relaxed) {
                    if let Some(n) = legs_in_flight(&sims) {
                        legs_peak = legs_peak.max(n);
                    }
                    // The sidecar is what is measured: its page is read
                    // less often (a booking lasts 3 s, a leg 1 s).
                    if tick.is_multiple_of(3)
                        && let Some(t) = prefill_booked(&sidecar, &sims)
                    {
                        booked_peak = booked_peak.max(t);
                    }
                    tick += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                (legs_peak, booked_peak)
            })
        };
        let statuses = Counts::default();
        let mut open: std::collections::VecDeque<(TcpStream, Instant)> = Default::default();
        let (mut sent, mut send_failed) = (0usize, 0u64);
        let mut next_wave = Instant::now();
        let mut last_sent = Instant::now();
        while !(stop.load(Ordering::Relaxed) || (sent >= DEPARTED_CLIENTS && open.is_empty())) {
            if Instant::now() >= next_wave && sent < DEPARTED_CLIENTS {
                for _ in 0..per_wave.min(DEPARTED_CLIENTS - sent) {
                    let req = completion_request(
                        &envoy,
                        &fresh_prompt(sent as u64, DEPARTED_PROMPT_TOKENS),
                        16,
                    );
                    sent += 1;
                    let s = TcpStream::connect(&envoy).and_then(|mut s| {
                        s.set_nodelay(true)?;
                        s.write_all(&req)?;
                        s.set_nonblocking(true)?;
                        Ok(s)
                    });
                    match s {
                        Ok(s) => open.push_back((s, Instant::now() + DEPARTED_HANG_UP)),
                        Err(_) => send_failed += 1,
                    }
                }
                last_sent = Instant::now();
                next_wave += DEPARTED_WAVE;
            }
            while open.front().is_some_and(|(_, at)| *at <= Instant::now()) {
                let Some((mut s, _)) = open.pop_front() else {
                    break;
                };
                // An answer before the hang-up is counted by its status;
                // 0: none came, the client left with its leg running.
                let mut head = [0u8; 64];
                let status = match s.read(&mut head) {
                    Ok(n) if n >= 12 => status_of(&head[..n]).unwrap_or(1),
                    _ => 0,
                };
                statuses.count(status);
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for (s, _) in open.drain(..) {
            statuses.count(0);
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // The last legs' deadlines, then what the sidecar still holds.
        let deadline = last_sent + Duration::from_millis(DEPARTED_PREFILL_TIMEOUT_MS + 2000);
        let mut booked_after = prefill_booked(&sidecar, &sims);
        while Instant::now() < deadline && booked_after != Some(0.0) {
            std::thread::sleep(Duration::from_millis(200));
            booked_after = prefill_booked(&sidecar, &sims);
        }
        let drained_after_ms = last_sent.elapsed().as_millis() as u64;
        sampling.store(true, Ordering::Relaxed);
        let (legs_peak, booked_peak) = sampler
            .join()
            .map_err(|_| anyhow::anyhow!("sampler panicked"))?;
        Ok(json!({
            "clients": sent,
            "clients_not_sent": send_failed,
            "prompt_tokens": DEPARTED_PROMPT_TOKENS,
            "prefill_leg_s": DEPARTED_PREFILL_S,
            "hang_up_ms": DEPARTED_HANG_UP.as_millis() as u64,
            "prefill_timeout_ms": DEPARTED_PREFILL_TIMEOUT_MS,
            "answers_before_hang_up": statuses.view(),
            "prefill_legs_served": prefill_legs_served(&sims).saturating_sub(before_legs),
            "prefill_remote": stat("kvgate_prefill_remote_total").saturating_sub(before_remote),
            "prefill_orphaned": stat("kvgate_prefill_orphaned_total").saturating_sub(before_orphaned),
            "legs_in_flight_peak": legs_peak,
            "booked_prefill_tokens_peak": booked_peak,
            "booked_legs_peak": booked_peak / DEPARTED_PROMPT_TOKENS as f64,
            "booked_prefill_tokens_after_deadline": booked_after,
            "drained_after_last_wave_ms": drained_after_ms,
        }))
    }))
}

/// One of the filter's counters from Envoy's admin `/stats`; 0 when it
/// cannot be read.
fn envoy_stat(admin: &str, name: &str) -> u64 {
    let full = format!("wasmcustom.{name}");
    let path = format!("/stats?filter=^{}$", full.replace('.', "\\."));
    let Ok((200, body)) = http::get(admin, &path) else {
        return 0;
    };
    String::from_utf8_lossy(&body)
        .lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(k, _)| k.trim() == full)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Prefill sims that stall every leg after its headers; eight honest
/// clients each send 3,000-token completions through Envoy, one at a
/// time, until the attack ends. Each leg times out after 500 ms and the
/// decode worker prefills the prompt itself.
fn stalled_prefills(
    stack: &Stack,
    _bench: &mut Bench,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<Result<Value>>> {
    let envoy = stack.envoy_addr();
    let admin = stack.admin_addr();
    let log = stack.run_dir.join("envoy.log");
    let before_failed = envoy_stat(&admin, "kvgate_prefill_failed_total");
    let before_remote = envoy_stat(&admin, "kvgate_prefill_remote_total");
    Ok(std::thread::spawn(move || {
        let statuses = Arc::new(Counts::default());
        let sent = Arc::new(AtomicU64::new(0));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let clients: Vec<_> = (0..HONEST_CLIENTS)
            .map(|_| {
                let (envoy, stop, statuses, sent, latencies) = (
                    envoy.clone(),
                    stop.clone(),
                    statuses.clone(),
                    sent.clone(),
                    latencies.clone(),
                );
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let i = sent.fetch_add(1, Ordering::Relaxed);
                        if i >= HONEST_MAX_REQUESTS {
                            break;
                        }
                        let body = json!({"model": "demo-model", "max_tokens": 4,
                            "prompt": fresh_prompt(i, HONEST_PROMPT_TOKENS as usize)})
                        .to_string();
                        let t0 = Instant::now();
                        let status = http::request(
                            &envoy,
                            "POST",
                            "/v1/completions",
                            &[("content-type", "application/json")],
                            Some(body.as_bytes()),
                        )
                        .map_or(0, |(s, _)| s);
                        statuses.count(status);
                        if status == 200 {
                            let us = t0.elapsed().as_micros() as u64;
                            latencies.lock().unwrap_or_else(|e| e.into_inner()).push(us);
                        }
                    }
                })
            })
            .collect();
        for c in clients {
            let _ = c.join();
        }
        let answers = statuses.view();
        let total: u64 = answers
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(_, n)| n.as_u64())
            .sum();
        let ok = answers["200"].as_u64().unwrap_or(0);
        let mut lat = std::mem::take(&mut *latencies.lock().unwrap_or_else(|e| e.into_inner()));
        lat.sort_unstable();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let panics = text
            .lines()
            .filter(|l| l.contains("panicked") || l.contains("wasm trap"))
            .count();
        Ok(json!({
            "honest_clients": HONEST_CLIENTS,
            "prompt_tokens": HONEST_PROMPT_TOKENS,
            "prefill_timeout_ms": STALLED_PREFILL_TIMEOUT_MS,
            "honest_requests": total,
            "honest_answers": answers,
            "honest_ok_share": if total > 0 { json!(ok as f64 / total as f64) } else { Value::Null },
            "honest_ok_p50_us": percentile(&lat, 50.0),
            "honest_ok_p99_us": percentile(&lat, 99.0),
            "prefill_remote": envoy_stat(&admin, "kvgate_prefill_remote_total").saturating_sub(before_remote),
            "prefill_failed": envoy_stat(&admin, "kvgate_prefill_failed_total").saturating_sub(before_failed),
            "envoy_log_panics": panics,
        }))
    }))
}

/// The section of `bench/report.md`.
pub fn report(v: &Value) -> String {
    let mut s = String::from("\n## Hostile inputs\n\n");
    s.push_str(&format!(
        "`cargo xtask bench --only hostile`{}: each attack on a fresh sidecar \
         holding a {}-block index, measured idle for {} s and then under the \
         attack for {} s. `/select` is called about 200 times a second on one \
         kept-alive connection (as Envoy and selection clients hold theirs); \
         resident memory is sampled every 100 ms, and `/health` probed on a \
         fresh connection every 100 ms (1 s timeout). Targets: peak RSS within \
         2× idle plus the configured bounds, `/select` p99 within 5× idle. \
         The disaggregated attacks run on two prefill and two decode \
         simulated vLLM workers (NIXL) behind Envoy.\n\n",
        if v["quick"].as_bool() == Some(true) {
            " (quick)"
        } else {
            ""
        },
        v["indexed_blocks"],
        v["idle_s"],
        v["attack_s"],
    ));
    s.push_str(
        "| attack | RSS idle → peak (MiB) | ratio | `/select` p99 idle → attack (µs) | ratio | calls failed | `/health` p99 idle → attack (µs), failed | what the sidecar did |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let f = |x: &Value| x.as_f64().map_or("–".to_string(), |x| format!("{x:.0}"));
    let r = |x: &Value| x.as_f64().map_or("–".to_string(), |x| format!("{x:.2}×"));
    let mut other_phases = false;
    for a in v["attacks"].as_array().into_iter().flatten() {
        let c = &a["counters"];
        let nonzero: Vec<String> = c
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, n)| {
                n.as_f64().is_some_and(|n| n > 0.0)
                    && !k.ends_with("_open")
                    && !k.ends_with("bookings_active")
            })
            .map(|(k, n)| {
                format!(
                    "{} {}",
                    k.trim_start_matches("kvgate_sidecar_"),
                    n.as_f64().unwrap_or(0.0)
                )
            })
            .collect();
        // An attack measured in another run than the section's phases say.
        let own = |k: &str| a.get(k).is_some_and(|x| *x != v[k]);
        let marked = own("quick") || own("idle_s") || own("attack_s") || own("indexed_blocks");
        other_phases |= marked;
        s.push_str(&format!(
            "| {}{} | {} → {} | {} | {} → {} | {} | {} | {} → {}, {} | {} |\n",
            a["attack"].as_str().unwrap_or("?"),
            if marked { " ¹" } else { "" },
            f(&a["idle"]["rss_peak_mib"]),
            f(&a["under_attack"]["rss_peak_mib"]),
            r(&a["rss_ratio"]),
            f(&a["idle"]["select_p99_us"]),
            f(&a["under_attack"]["select_p99_us"]),
            r(&a["select_p99_ratio"]),
            a["under_attack"]["select_failed"],
            f(&a["idle"]["health_p99_us"]),
            f(&a["under_attack"]["health_p99_us"]),
            f(&a["under_attack"]["health_failed"]),
            if nonzero.is_empty() {
                "–".to_string()
            } else {
                nonzero.join(", ")
            },
        ));
    }
    if other_phases {
        // The attacks of each other set of phases, in order.
        let mut runs: Vec<(String, Vec<&str>)> = Vec::new();
        for a in v["attacks"].as_array().into_iter().flatten() {
            let phases = ["quick", "idle_s", "attack_s", "indexed_blocks"];
            if phases.iter().all(|k| a.get(*k).is_none_or(|x| *x == v[*k])) {
                continue;
            }
            let run = format!(
                "{}{} s idle, {} s attack, a {}-block index",
                if a["quick"].as_bool() == Some(true) {
                    "quick: "
                } else {
                    ""
                },
                a["idle_s"],
                a["attack_s"],
                a["indexed_blocks"],
            );
            let name = a["attack"].as_str().unwrap_or("?");
            match runs.iter_mut().find(|(r, _)| *r == run) {
                Some((_, names)) => names.push(name),
                None => runs.push((run, vec![name])),
            }
        }
        let runs: Vec<String> = runs
            .into_iter()
            .map(|(run, names)| format!("{} ({run})", names.join(", ")))
            .collect();
        s.push_str(&format!(
            "\n¹ Measured later, in a run of these attacks alone with other phases: {}.\n",
            runs.join("; ")
        ));
    }
    let unprobed = v["attacks"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|a| a["under_attack"].get("health_p99_us").is_none());
    if unprobed {
        s.push_str("\nA `/health` figure of – is from a run before the probe was measured.\n");
    }
    s.push_str(&disagg_outcomes(v));
    s.push_str("\nEach attack's own tally is in `bench/results/hostile.json`.\n");
    s
}

/// The disaggregated attacks' own figures, when the results hold them.
fn disagg_outcomes(v: &Value) -> String {
    let find = |name: &str| {
        v["attacks"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["attack"] == name)
            .map(|a| &a["outcome"])
    };
    let f = |x: &Value| x.as_f64().map_or("–".to_string(), |x| format!("{x:.0}"));
    let mut s = String::new();
    if let Some(o) = find("departed_prefills") {
        s.push_str(&format!(
            "\n`departed_prefills`: {} clients, each a {}-token prompt whose \
             prefill leg takes {} s, hanging up {} ms in; `prefill_timeout_ms` \
             {}.\n\n\
             | prefill legs served | Envoy's `kvgate_prefill_orphaned_total` | legs in flight on the prefill sims, peak | booked on their ranks, peak (prompt tokens ≈ legs) | still booked after the last deadline (tokens) |\n\
             | --- | --- | --- | --- | --- |\n\
             | {} | {} | {} | {} ≈ {} | {} |\n",
            o["clients"],
            o["prompt_tokens"],
            o["prefill_leg_s"],
            o["hang_up_ms"],
            o["prefill_timeout_ms"],
            o["prefill_legs_served"],
            o["prefill_orphaned"],
            f(&o["legs_in_flight_peak"]),
            f(&o["booked_prefill_tokens_peak"]),
            f(&o["booked_legs_peak"]),
            f(&o["booked_prefill_tokens_after_deadline"]),
        ));
    }
    if let Some(o) = find("stalled_prefills") {
        let share = o["honest_ok_share"]
            .as_f64()
            .map_or("–".to_string(), |x| format!("{:.1} %", x * 100.0));
        s.push_str(&format!(
            "\n`stalled_prefills`: every prefill leg stalls after its headers; \
             `prefill_timeout_ms` {}, `on_prefill_failure = \"local\"`; {} honest \
             clients send {}-token completions through Envoy.\n\n\
             | honest requests | answered 200 | their p50 / p99 (ms) | Envoy's `kvgate_prefill_failed_total` | lines of Envoy's log with `panicked` or `wasm trap` |\n\
             | --- | --- | --- | --- | --- |\n\
             | {} | {} | {} / {} | {} | {} |\n",
            o["prefill_timeout_ms"],
            o["honest_clients"],
            o["prompt_tokens"],
            o["honest_requests"],
            share,
            o["honest_ok_p50_us"]
                .as_f64()
                .map_or("–".to_string(), |x| format!("{:.0}", x / 1000.0)),
            o["honest_ok_p99_us"]
                .as_f64()
                .map_or("–".to_string(), |x| format!("{:.0}", x / 1000.0)),
            o["prefill_failed"],
            o["envoy_log_panics"],
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attack(name: &str, rss: f64) -> Value {
        json!({"attack": name, "idle": {"rss_peak_mib": rss}, "under_attack": {}, "outcome": {}})
    }

    #[test]
    fn a_subset_run_keeps_the_other_attacks_figures() {
        let old = json!({"quick": false, "idle_s": 10, "attack_s": 45, "indexed_blocks": 4,
            "attacks": [attack("a", 1.0), attack("c", 3.0)]});
        let mut b = attack("b", 2.0);
        let mut c = attack("c", 30.0);
        for x in [&mut b, &mut c] {
            x["quick"] = json!(true);
            x["attack_s"] = json!(15);
        }
        let new = json!({"quick": true, "idle_s": 5, "attack_s": 15, "indexed_blocks": 1,
            "attacks": [c, b]});
        let merged = merge(old, new, &["a", "b", "c"]);
        assert_eq!(merged["attack_s"], 45, "the published phases stay");
        let names: Vec<&str> = merged["attacks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["attack"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(
            merged["attacks"][0]["attack_s"], 45,
            "given its run's phases"
        );
        assert_eq!(merged["attacks"][2]["idle"]["rss_peak_mib"], 30.0);
        let r = report(&merged);
        assert!(
            r.contains("| b ¹ |") && r.contains("| c ¹ |") && r.contains("| a |"),
            "{r}"
        );
        assert!(r.contains("b, c (quick: "), "{r}");
    }

    #[test]
    fn the_report_shows_the_disaggregated_outcomes() {
        let mut d = attack("departed_prefills", 1.0);
        d["outcome"] = json!({"clients": 1000, "prefill_orphaned": 998,
            "legs_in_flight_peak": 70.0, "booked_legs_peak": 200.0});
        let mut s = attack("stalled_prefills", 1.0);
        s["outcome"] = json!({"honest_requests": 240, "honest_ok_share": 1.0,
            "prefill_failed": 240, "envoy_log_panics": 0});
        let r = report(&json!({"attacks": [d, s]}));
        assert!(r.contains("| 998 | 70 |"), "{r}");
        assert!(r.contains("| 240 | 100.0 % |"), "{r}");
    }
}
