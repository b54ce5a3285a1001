//! A router root's part in lease mode ([`crate::lease`]): every tick it
//! renews or contends for the poller lease, and while it holds the lease it
//! runs the snapshot service ([`Service`]) on its own worker thread.

use crate::config::Config;
use crate::host;
use crate::lease::{self, Lease, Step};
use crate::metrics::{inc, lease_takeovers};
use crate::service::Service;
use proxy_wasm::types::LogLevel;

pub struct Standby {
    config: Config,
    lease: Lease,
    /// Present while this root holds the lease.
    service: Option<Box<Service>>,
    /// Failover drills: when this root stops its lease work (only the
    /// first holder since Envoy started does).
    stop_at_ms: Option<u64>,
    /// The drill stopped it.
    halted: bool,
    /// The root ticks at the flush interval too; the lease keeps `tick_ms`.
    next_step_ms: u64,
    takeovers: Option<u32>,
}

impl Standby {
    pub fn new(config: Config) -> Standby {
        Standby {
            lease: Lease {
                me: host::random_u64(),
                term_ms: crate::config::ms(config.lease_term()),
            },
            config,
            service: None,
            stop_at_ms: None,
            halted: false,
            next_step_ms: 0,
            takeovers: lease_takeovers(),
        }
    }

    pub fn on_tick(&mut self) {
        let now = host::now_ms();
        if self.halted || now < self.next_step_ms {
            return;
        }
        self.next_step_ms = now.saturating_add(crate::config::ms(self.config.tick));
        if self.stop_at_ms.is_some_and(|t| now >= t) {
            // As a stuck lease holder: no renewal, no poll, no forwarding.
            // Its requests still hand their events over, for whoever holds
            // the lease next.
            self.halted = true;
            self.service = None;
            host::log(
                LogLevel::Warn,
                "kvgate: lease drill: this root stops its lease work",
            );
            return;
        }
        let (current, cas) = host::get_shared_cas(lease::KEY);
        let first = current.is_none();
        let held = match self.lease.step(current.as_deref(), now) {
            Step::Follow => false,
            Step::Write(r) => match host::set_shared_cas(lease::KEY, &r.encode(), cas) {
                Ok(()) => {
                    // A key written for the first time takes no
                    // compare-and-swap: read it back so that of two roots
                    // creating it at once only the last writer polls.
                    cas.is_some()
                        || host::get_shared(lease::KEY)
                            .and_then(|b| lease::Record::decode(&b))
                            .is_some_and(|r| r.holder == self.lease.me)
                }
                Err(host::Fault::CAS_MISMATCH) => false,
                Err(s) => {
                    host::log(
                        LogLevel::Warn,
                        &format!("kvgate: cannot write the lease: {s:?}"),
                    );
                    false
                }
            },
        };
        match (held, self.service.is_some()) {
            (true, false) => {
                host::log(LogLevel::Info, "kvgate: this root took the poller lease");
                inc(self.takeovers);
                self.service = Some(Box::new(Service::take_over(self.config.clone())));
                self.stop_at_ms = self
                    .config
                    .lease_drill_stop_after_ms
                    .filter(|_| first)
                    .map(|d| now.saturating_add(d));
            }
            (false, true) => {
                host::log(LogLevel::Info, "kvgate: this root lost the poller lease");
                self.service = None;
            }
            _ => {}
        }
        if let Some(s) = self.service.as_mut() {
            s.poll();
            s.send_bookings();
        }
    }

    pub fn on_response(&mut self, token: u32, body_size: usize) {
        if let Some(s) = self.service.as_mut() {
            s.on_response(token, body_size);
        }
    }

    pub fn on_queue_ready(&mut self, queue: u32) {
        if let Some(s) = self.service.as_mut() {
            s.on_queue_ready(queue);
        }
    }
}
