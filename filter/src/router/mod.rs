//! The router: the HTTP filter on Envoy's worker threads.
//!
//! Per request it reads the 32-byte manifest from shared data, re-decodes the
//! snapshot only when its version changed, and then decides from VM-local
//! memory: route (write the destination and rank headers) or answer locally.
//!
//! A routed request books its load (see `kvgate_core::booking`): prefill
//! tokens until its first response byte, decode blocks until it ends. The
//! booking goes to the sidecar through a shared queue, held back for the
//! flush interval with the VM's other events ([`outbox`]), and, until a
//! snapshot counts it, into this VM's own view (`kvgate_core::plan::local`).
//!
//! The decision itself is `kvgate_core::plan`; this module is the glue:
//! host calls in, headers, replies and bookings out.

mod gates;
pub(crate) mod held;
mod outbox;
mod request;
mod retry;
mod shards;
mod templates;

use crate::config::{Config, ms};
use crate::host::{self, Host};
use crate::manifest::{self, Manifest};
use crate::metrics::RouterMetrics;
use crate::view::View;
use kvgate_core::approx::Routed;
use kvgate_core::booking::{Event, Key, Timing};
use kvgate_core::plan::local::{LocalBookings, Release};
use outbox::Outbox;
use proxy_wasm::types::LogLevel;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Weak;

use request::Flow;
pub(crate) use request::{Request, Usage};

/// State shared by the router root and its requests (one VM, one thread).
pub struct RouterState {
    pub config: Config,
    /// Envoy's vm_id, where the service's queues live.
    vm_id: String,
    /// Routing decisions for the sidecar's routed-prefix index.
    reports: Outbox,
    view: View,
    metrics: RouterMetrics,
    tie_break: u64,
    /// Counts the VM's decisions: one in a few has its phases timed.
    decisions: u64,
    /// Names this VM's bookings; random so that VMs of several Envoys
    /// sharing a sidecar never collide.
    vm_tag: u64,
    next_seq: u64,
    /// Counts SGLang bootstrap rooms; mixed, each count is a room's random
    /// start. Seeded at random, so VMs draw different rooms.
    next_room: u64,
    /// Bookings, their releases and local replies.
    bookings: Outbox,
    local: LocalBookings,
    /// Index shards read since the last update, for the next requests.
    shards: shards::Shards,
    templates: templates::Templates,
    /// Prefill legs whose client left while they ran, and when each
    /// leg's deadline passes (µs): Envoy cancels no callout, and the SDK
    /// drops an answer whose context is gone, so the worker's load is
    /// booked until Envoy must have ended the call.
    orphans: Vec<(Booking, u64)>,
    /// When this VM last told the sidecar it is alive (ms).
    alive_at_ms: u64,
    /// Requests held for a worker ([`held`]).
    held: held::HeldQueue,
    /// Held requests a request that comes first took the place of, to be
    /// answered on the root's next tick.
    displaced: Vec<held::HeldRef>,
    /// Prefill callouts made by requests the root released: their answers
    /// come to the root (token, the request's context, its flow).
    forwarded: Vec<(u32, u32, Weak<RefCell<Flow>>)>,
    /// This VM's slots on decode workers, per model ([`gates`]).
    gated: BTreeMap<String, u32>,
    /// Workers this VM's view counts full since a request found them so,
    /// with the count the view had before (model, worker, in flight).
    full: Vec<(String, u64, u32)>,
    /// Counts what may let a held request go: a new snapshot, a booking
    /// or a slot released here. Held requests are tried again only when
    /// it moved ([`held::on_tick`]).
    changes: u64,
    /// `changes` when held requests were last tried, and when (ms).
    tried_at: u64,
    tried_ms: u64,
}

/// How often a ticking router VM says it is alive: the sidecar ends the
/// bookings of a VM it has not heard from for several of these.
const ALIVE_EVERY_MS: u64 = 1000;

impl RouterState {
    pub fn new(h: &impl Host, config: Config, vm_id: String) -> RouterState {
        let immediate = config.flush.is_zero();
        RouterState {
            config,
            vm_id,
            reports: Outbox::new(immediate),
            view: View::default(),
            metrics: RouterMetrics::define(h),
            // Each worker thread's VM starts at a different point, so two
            // VMs' first requests on an idle fleet do not pick the same rank.
            tie_break: h.now_us().wrapping_mul(0x9E37_79B9_7F4A_7C15),
            decisions: 0,
            vm_tag: h.random_u64(),
            next_seq: 0,
            next_room: h.random_u64(),
            bookings: Outbox::new(immediate),
            local: LocalBookings::default(),
            shards: shards::Shards::default(),
            templates: templates::Templates::default(),
            orphans: Vec::new(),
            alive_at_ms: 0,
            held: held::HeldQueue::default(),
            displaced: Vec::new(),
            forwarded: Vec::new(),
            gated: BTreeMap::new(),
            full: Vec::new(),
            changes: 0,
            tried_at: 0,
            tried_ms: 0,
        }
    }

    /// Tells the sidecar this VM is alive, once a second at most: on the
    /// root's tick, so a VM that died (a trap kills it and Envoy reloads
    /// a new one under a new tag) goes silent.
    pub fn beat(&mut self, h: &impl Host) {
        let now = h.now_ms();
        if now.saturating_sub(self.alive_at_ms) < ALIVE_EVERY_MS {
            return;
        }
        self.alive_at_ms = now;
        let vm = self.vm_tag;
        self.send(h, &Event::Alive { vm });
        self.refresh_gates(h);
    }

    /// Passes the answer of callout `token` to the request in context
    /// `id` when it comes to the root ([`held::on_callout_answer`]).
    fn forward(&mut self, token: u32, id: u32, flow: Weak<RefCell<Flow>>) {
        self.forwarded.push((token, id, flow));
    }

    /// Keeps a departed client's prefill booking until `until_us`.
    fn orphan(&mut self, h: &impl Host, b: Booking, until_us: u64) {
        h.count(self.metrics.prefill_orphaned);
        self.orphans.push((b, until_us));
    }

    /// Ends the orphaned legs whose deadline has passed: on the root's
    /// tick, and at each request in case the root does not tick. With none
    /// held (the usual case) it reads no clock: it runs on every request.
    pub fn release_orphans(&mut self, h: &impl Host) {
        if self.orphans.is_empty() {
            return;
        }
        let now_us = h.now_us();
        if self.orphans.iter().all(|(_, until)| *until > now_us) {
            return;
        }
        let (due, kept) = std::mem::take(&mut self.orphans)
            .into_iter()
            .partition(|(_, until)| *until <= now_us);
        self.orphans = kept;
        for (b, _) in due {
            self.release(h, b, true, None);
        }
    }

    /// Releases a booking: its prompt at the first byte (`done` false),
    /// all of it when its leg ends (`done`, with the leg's timing when it
    /// completed): exactly once each, however the leg ends.
    fn release(&mut self, h: &impl Host, b: Booking, done: bool, timing: Option<Timing>) {
        self.changes += 1;
        let release = Release {
            seq: b.seq,
            slot: b.slot,
            prefill: if b.first_byte { 0 } else { b.prefill },
            decode: if done { b.decode } else { 0 },
            done,
            // The next booking this VM makes follows the release to the
            // sidecar: a snapshot that counts it counts the release.
            fence: self.next_seq + 1,
        };
        self.local
            .release(self.view.snapshot.as_mut(), release, h.now_ms());
        let key = Key {
            vm: self.vm_tag,
            seq: b.seq,
        };
        let ev = if done {
            Event::Done { key, timing }
        } else {
            Event::FirstByte { key }
        };
        self.send(h, &ev);
    }

    /// Brings the view up to `manifest`'s snapshot, and settles this VM's
    /// own bookings into a new one.
    fn refresh_view(&mut self, h: &impl Host, manifest: &Manifest) {
        let version = manifest.snapshot_version;
        match self.view.refresh(manifest.epoch, version, || {
            h.get_shared(manifest::SNAPSHOT_KEY)
        }) {
            Ok(true) => {
                // A new snapshot counts the workers as they are now.
                self.full.clear();
                self.changes += 1;
                if let Some(snap) = self.view.snapshot.as_mut() {
                    self.local
                        .settle(snap, self.vm_tag, h.now_ms(), ms(self.config.stale_after));
                }
            }
            Ok(false) => {}
            Err(e) => {
                h.count(self.metrics.snapshot_decode_errors);
                h.log(
                    LogLevel::Error,
                    &format!("kvgate: snapshot {version} does not decode: {e}"),
                );
            }
        }
    }

    /// Decodes a new snapshot on the root's tick, between requests, so
    /// that the next request usually finds its view current: under load
    /// the sidecar republishes as loads move, and reading and decoding
    /// new snapshots cost 2k-token decisions 1 to 3 µs each on average
    /// (docs/text-routing.md). Costs a manifest read a tick.
    pub fn look_ahead(&mut self, h: &impl Host) {
        let Some(m) = Manifest::read(h) else {
            return;
        };
        if m.is_fresh(h.now_ms(), ms(self.config.stale_after)) {
            self.refresh_view(h, &m);
        }
    }

    /// Books a routed request's load on `slot`, under its tenant: to the
    /// sidecar, and into this VM's view until a snapshot counts it.
    fn book(
        &mut self,
        h: &impl Host,
        model: &str,
        tenant: &str,
        slot: u16,
        prefill: u64,
        decode: u64,
    ) -> Booking {
        self.next_seq += 1;
        let seq = self.next_seq;
        self.send(
            h,
            &Event::Book {
                key: Key {
                    vm: self.vm_tag,
                    seq,
                },
                model: model.to_string(),
                slot,
                prefill_tokens: u32::try_from(prefill).unwrap_or(u32::MAX),
                decode_blocks: u32::try_from(decode).unwrap_or(u32::MAX),
                tenant: tenant.to_string(),
            },
        );
        if let Some(snap) = self.view.snapshot.as_mut() {
            self.local
                .book(snap, seq, slot, prefill, decode, h.now_ms());
        }
        Booking {
            seq,
            slot,
            prefill,
            decode,
            first_byte: false,
        }
    }

    /// Sends a booking event to the snapshot service. A failure costs
    /// accuracy only: the sidecar expires what it never hears the end of.
    fn send(&mut self, h: &impl Host, ev: &Event) {
        let vm_id = &self.vm_id;
        let sent = self.bookings.push(
            |b| ev.encode_into(b),
            |q, bytes| enqueue_on(h, vm_id, host::BOOKINGS_QUEUE, q, bytes),
        );
        if !sent {
            h.count(self.metrics.booking_errors);
        }
    }

    /// Hands a routing decision to the snapshot service, which forwards it
    /// to the sidecar's routed-prefix index.
    fn report(&mut self, h: &impl Host, record: &Routed) {
        let vm_id = &self.vm_id;
        let sent = self.reports.push(
            |b| record.encode_into(b),
            |q, bytes| enqueue_on(h, vm_id, host::ROUTED_QUEUE, q, bytes),
        );
        if !sent {
            h.count(self.metrics.report_errors);
        }
    }

    /// Hands everything held back to the snapshot service: every flush
    /// interval, on the router root's tick.
    pub fn flush(&mut self, h: &impl Host) {
        let vm_id = &self.vm_id;
        if !self
            .bookings
            .flush(|q, bytes| enqueue_on(h, vm_id, host::BOOKINGS_QUEUE, q, bytes))
        {
            h.count(self.metrics.booking_errors);
        }
        if !self
            .reports
            .flush(|q, bytes| enqueue_on(h, vm_id, host::ROUTED_QUEUE, q, bytes))
        {
            h.count(self.metrics.report_errors);
        }
    }
}

/// Enqueues `bytes` on the service's `name` queue, resolving it first when
/// unknown, and forgetting it on failure so that the next send resolves it
/// again (the service may have restarted and registered it anew).
fn enqueue_on(
    h: &impl Host,
    vm_id: &str,
    name: &str,
    queue: &mut Option<u32>,
    bytes: &[u8],
) -> bool {
    if queue.is_none() {
        *queue = h.resolve_queue(vm_id, name);
    }
    match queue.map(|q| h.enqueue(q, bytes)) {
        Some(Ok(())) => true,
        _ => {
            *queue = None;
            false
        }
    }
}

/// A routed request's booking, until it is released.
#[derive(Debug, Clone, Copy)]
struct Booking {
    seq: u64,
    slot: u16,
    prefill: u64,
    decode: u64,
    first_byte: bool,
}
