//! Prefill/decode disaggregation: the sim as one leg of a PD pair.
//!
//! Two protocols, as the engines speak them (see the flags on
//! [`crate::Args`]): vLLM's NixlConnector, where the prefill leg's answer
//! carries `kv_transfer_params` and the decode leg pulls the blocks over a
//! side channel ([`nixl`], [`side_channel`], [`lease`]); and SGLang's
//! bootstrap, where both legs get the same body at once and meet in a
//! bootstrap room ([`bootstrap`]). Both move block identities only and
//! charge the KV transfer as time. A NIXL pull's time is spent on the
//! holder's [`link`], the prefill worker's one `--kv-transfer-gbps` link
//! that concurrent pulls from it share; an SGLang decode leg still charges
//! its transfer alone. [`record`] keeps what the legs saw for tests.

pub mod bootstrap;
pub mod frame;
pub mod lease;
pub mod legs;
pub mod link;
mod listen;
pub mod nixl;
pub mod record;
pub mod side_channel;

use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// vLLM's `kv_role` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum KvRole {
    /// Serves prefill legs (and ordinary requests).
    KvProducer,
    /// Serves decode legs (and ordinary requests).
    KvConsumer,
    /// Serves either leg, as every vLLM worker with NixlConnector does.
    KvBoth,
}

impl KvRole {
    pub fn name(self) -> &'static str {
        match self {
            KvRole::KvProducer => "kv_producer",
            KvRole::KvConsumer => "kv_consumer",
            KvRole::KvBoth => "kv_both",
        }
    }

    fn prefills(self) -> bool {
        self != KvRole::KvConsumer
    }

    fn decodes(self) -> bool {
        self != KvRole::KvProducer
    }
}

/// Which engine's PD protocol a disaggregated sim speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PdProtocol {
    /// vLLM with NixlConnector: `kv_transfer_params`, side channel pulls.
    Nixl,
    /// SGLang: `bootstrap_host`/`bootstrap_port`/`bootstrap_room`.
    Sglang,
}

/// vLLM's `kv_load_failure_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadFailurePolicy {
    /// The request fails.
    Fail,
    /// The decode worker prefills the prompt itself.
    Recompute,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub role: Option<KvRole>,
    pub protocol: PdProtocol,
    /// How long a prefill's blocks are held for a pull (wall time).
    pub lease: Duration,
    /// This worker's link bandwidth when its blocks are pulled, shared by
    /// the pulls in flight.
    pub transfer_gbps: f64,
    pub bytes_per_block: u64,
    /// The time model's: transfers are simulated durations like any other.
    pub speedup: f64,
    pub instant: bool,
    pub publish_received: bool,
    pub failure_policy: LoadFailurePolicy,
    /// SGLang's bootstrap and waiting timeouts (wall time).
    pub bootstrap_timeout: Duration,
    /// The host a prefill answer names for its side channel.
    pub advertise_host: String,
    /// How long a decode leg waits for a side-channel answer. The answer
    /// comes once the bytes are through the holder's link, so this covers
    /// the wait behind other pulls too; the blocks stay held until then,
    /// which bounds that backlog by the holder's cache.
    pub pull_timeout: Duration,
    /// Prefill legs get their headers and then no body, ever.
    pub stall_after_headers: bool,
}

/// What a request asks of this worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    Local,
    NixlPrefill,
    NixlDecode(nixl::RemotePrefill),
    SglangPrefill { room: u64 },
    SglangDecode { room: u64, host: String, port: u16 },
}

impl Leg {
    pub fn name(&self) -> &'static str {
        match self {
            Leg::Local => "local",
            Leg::NixlPrefill | Leg::SglangPrefill { .. } => "prefill",
            Leg::NixlDecode(_) | Leg::SglangDecode { .. } => "decode",
        }
    }
}

/// SGLang's default bootstrap port, for a body whose `bootstrap_port` is null.
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// Counters for `/sim/disagg`; monotonic.
#[derive(Debug, Default)]
pub struct Counters {
    pub prefill_legs: AtomicU64,
    pub decode_legs: AtomicU64,
    /// Pulls this (prefill) engine answered with blocks.
    pub pulls_served: AtomicU64,
    /// Pulls this (decode) worker made that brought blocks back.
    pub pulls: AtomicU64,
    pub failed_pulls: AtomicU64,
    pub blocks_pulled: AtomicU64,
    pub recomputes: AtomicU64,
    pub lease_expiries: AtomicU64,
    pub bootstrap_pairs: AtomicU64,
    pub bootstrap_timeouts: AtomicU64,
    /// Requests refused for their PD fields (400).
    pub rejected: AtomicU64,
}

/// A rank's side channel: its port and, until serving starts, its socket.
pub struct SideChannel {
    pub engine_id: String,
    pub port: u16,
    pub leases: Arc<lease::Leases>,
    listener: Mutex<Option<std::net::TcpListener>>,
}

pub struct Disagg {
    pub config: Config,
    pub counters: Arc<Counters>,
    pub record: record::Recorder,
    /// Per rank, when this worker serves NIXL prefill legs.
    pub side_channels: Vec<SideChannel>,
    pub rooms: Arc<bootstrap::Rooms>,
    /// The link pulls from this worker go through, one for all its ranks
    /// as their side channels share the worker's network.
    pub link: Arc<link::Link>,
    pub bootstrap_port: Option<u16>,
    bootstrap_listener: Mutex<Option<std::net::TcpListener>>,
    /// This process's engine id, under which its requests are named too.
    engine_id: String,
    next_request: AtomicU64,
}

fn bind(host: std::net::IpAddr, port: u16, what: &str) -> anyhow::Result<std::net::TcpListener> {
    use anyhow::Context;
    let l = std::net::TcpListener::bind((host, port))
        .with_context(|| format!("binding the {what} on {host}:{port}"))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

impl Disagg {
    /// Binds the listeners the role needs (none without a role), so their
    /// ports are known before serving starts.
    pub fn build(
        config: Config,
        ranks: &[Arc<crate::engine::Rank>],
        bind_host: std::net::IpAddr,
        engine_id: &str,
        side_channel_port: u16,
        bootstrap_port: u16,
    ) -> anyhow::Result<Disagg> {
        let counters = Arc::new(Counters::default());
        let prefills = config.role.is_some_and(KvRole::prefills);
        if config.protocol == PdProtocol::Sglang && config.role == Some(KvRole::KvBoth) {
            anyhow::bail!(
                "--pd-protocol sglang needs --kv-role kv_producer or kv_consumer: \
                 both legs get the same body, so a worker must know which it is"
            );
        }
        let mut side_channels = Vec::new();
        if prefills && config.protocol == PdProtocol::Nixl {
            for rank in ranks {
                let port = if side_channel_port == 0 {
                    0
                } else {
                    side_channel_port
                        .checked_add(rank.index as u16)
                        .ok_or_else(|| anyhow::anyhow!("side channel port out of range"))?
                };
                let l = bind(bind_host, port, "KV side channel")?;
                side_channels.push(SideChannel {
                    engine_id: format!("{engine_id}_dp{}", rank.index),
                    port: l.local_addr()?.port(),
                    leases: Arc::new(lease::Leases::new(rank.clone(), counters.clone())),
                    listener: Mutex::new(Some(l)),
                });
            }
        }
        let (bootstrap_port, bootstrap_listener) =
            if prefills && config.protocol == PdProtocol::Sglang {
                let l = bind(bind_host, bootstrap_port, "bootstrap server")?;
                (Some(l.local_addr()?.port()), Some(l))
            } else {
                (None, None)
            };
        let link = Arc::new(link::Link::new(
            config.transfer_gbps,
            config.speedup,
            config.instant,
        ));
        Ok(Disagg {
            config,
            counters,
            record: record::Recorder::default(),
            side_channels,
            rooms: Arc::default(),
            link,
            bootstrap_port,
            bootstrap_listener: Mutex::new(bootstrap_listener),
            engine_id: engine_id.to_string(),
            next_request: AtomicU64::new(0),
        })
    }

    /// Starts the listeners' tasks; they end with the runtime.
    pub fn start(&self) -> anyhow::Result<()> {
        for sc in &self.side_channels {
            let taken = sc.listener.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(l) = taken {
                let l = tokio::net::TcpListener::from_std(l)?;
                tokio::spawn(side_channel::serve(
                    l,
                    sc.engine_id.clone(),
                    sc.leases.clone(),
                    self.counters.clone(),
                    self.link.clone(),
                    self.config.bytes_per_block,
                ));
            }
        }
        let taken = self
            .bootstrap_listener
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(l) = taken {
            let l = tokio::net::TcpListener::from_std(l)?;
            tokio::spawn(bootstrap::serve(
                l,
                self.rooms.clone(),
                self.config.bootstrap_timeout,
                self.counters.clone(),
            ));
        }
        Ok(())
    }

    /// Which leg `body` asks for, refusing what the role cannot serve.
    /// Without a role the PD fields are ignored, as an engine without a
    /// KV connector ignores them.
    pub fn leg(&self, body: &Value) -> Result<Leg, String> {
        let Some(role) = self.config.role else {
            return Ok(Leg::Local);
        };
        let leg = match self.config.protocol {
            PdProtocol::Nixl => match nixl::classify(&body["kv_transfer_params"])? {
                nixl::NixlLeg::Local => Leg::Local,
                nixl::NixlLeg::Prefill => Leg::NixlPrefill,
                nixl::NixlLeg::Decode(r) => Leg::NixlDecode(r),
            },
            PdProtocol::Sglang => sglang_leg(role, body)?,
        };
        match &leg {
            Leg::NixlPrefill | Leg::SglangPrefill { .. } if !role.prefills() => Err(format!(
                "this worker's kv_role is {}: it cannot serve a prefill leg (do_remote_decode)",
                role.name()
            )),
            Leg::NixlDecode(_) | Leg::SglangDecode { .. } if !role.decodes() => Err(format!(
                "this worker's kv_role is {}: it cannot serve a decode leg (do_remote_prefill)",
                role.name()
            )),
            _ => Ok(leg),
        }
    }

    /// The KV transfer time of `blocks` blocks over an idle link, divided
    /// like every simulated duration: what an SGLang decode leg waits,
    /// since nothing is shared on that path.
    pub fn transfer_time(&self, blocks: usize) -> Duration {
        let gbps = self.config.transfer_gbps;
        if self.config.instant || blocks == 0 || gbps.is_nan() || gbps <= 0.0 {
            return Duration::ZERO;
        }
        let bits = blocks as f64 * self.config.bytes_per_block as f64 * 8.0;
        Duration::try_from_secs_f64(bits / (gbps * 1e9) / self.config.speedup.max(1e-9))
            .unwrap_or(Duration::MAX)
    }

    /// An id for a request that came without `X-Request-Id`, unique to
    /// this process.
    pub fn new_request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("{}-req-{n}", self.engine_id)
    }

    pub fn held_blocks(&self) -> usize {
        self.side_channels
            .iter()
            .map(|s| s.leases.held_blocks())
            .sum()
    }
}

fn sglang_leg(role: KvRole, body: &Value) -> Result<Leg, String> {
    let room = match &body["bootstrap_room"] {
        Value::Null => {
            return Err(
                "bootstrap_room is required: this worker serves SGLang disaggregated legs".into(),
            );
        }
        v => v
            .as_u64()
            .ok_or("bootstrap_room must be a non-negative integer")?,
    };
    if role.prefills() {
        return Ok(Leg::SglangPrefill { room });
    }
    let host = body["bootstrap_host"]
        .as_str()
        .filter(|h| !h.is_empty())
        .ok_or("bootstrap_host is required for a decode leg")?
        .to_string();
    let port = match &body["bootstrap_port"] {
        Value::Null => SGLANG_BOOTSTRAP_PORT,
        v => v
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
            .ok_or("bootstrap_port must be a TCP port or null")?,
    };
    Ok(Leg::SglangDecode { room, host, port })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn disagg(role: Option<KvRole>, protocol: PdProtocol) -> Disagg {
        Disagg {
            config: Config {
                role,
                protocol,
                lease: Duration::from_secs(30),
                transfer_gbps: 100.0,
                bytes_per_block: 1 << 21,
                speedup: 1.0,
                instant: false,
                publish_received: true,
                failure_policy: LoadFailurePolicy::Fail,
                bootstrap_timeout: Duration::from_secs(300),
                advertise_host: "127.0.0.1".into(),
                pull_timeout: Duration::from_secs(5),
                stall_after_headers: false,
            },
            counters: Arc::default(),
            record: record::Recorder::default(),
            side_channels: Vec::new(),
            rooms: Arc::default(),
            link: Arc::new(link::Link::new(100.0, 1.0, false)),
            bootstrap_port: None,
            bootstrap_listener: Mutex::new(None),
            engine_id: "e".into(),
            next_request: AtomicU64::new(0),
        }
    }

    #[test]
    fn roles_refuse_the_legs_they_cannot_serve() {
        let prefill = json!({"kv_transfer_params": {"do_remote_decode": true}});
        let decode = json!({"kv_transfer_params": nixl::answer("e", "r", &[1], "h", 9)});
        let producer = disagg(Some(KvRole::KvProducer), PdProtocol::Nixl);
        let consumer = disagg(Some(KvRole::KvConsumer), PdProtocol::Nixl);
        let both = disagg(Some(KvRole::KvBoth), PdProtocol::Nixl);
        assert_eq!(producer.leg(&prefill), Ok(Leg::NixlPrefill));
        assert!(producer.leg(&decode).unwrap_err().contains("kv_producer"));
        assert!(consumer.leg(&prefill).unwrap_err().contains("kv_consumer"));
        assert!(matches!(consumer.leg(&decode), Ok(Leg::NixlDecode(_))));
        assert_eq!(both.leg(&prefill), Ok(Leg::NixlPrefill));
        assert!(matches!(both.leg(&decode), Ok(Leg::NixlDecode(_))));
        assert_eq!(both.leg(&json!({})), Ok(Leg::Local));
        let none = disagg(None, PdProtocol::Nixl);
        assert_eq!(none.leg(&decode), Ok(Leg::Local), "no connector: ignored");
    }

    #[test]
    fn sglang_legs_need_a_room() {
        let p = disagg(Some(KvRole::KvProducer), PdProtocol::Sglang);
        let d = disagg(Some(KvRole::KvConsumer), PdProtocol::Sglang);
        let body =
            json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": null, "bootstrap_room": 77});
        assert_eq!(p.leg(&body), Ok(Leg::SglangPrefill { room: 77 }));
        assert_eq!(
            d.leg(&body),
            Ok(Leg::SglangDecode {
                room: 77,
                host: "10.0.0.1".into(),
                port: SGLANG_BOOTSTRAP_PORT
            })
        );
        assert!(p.leg(&json!({})).unwrap_err().contains("bootstrap_room"));
        assert!(d.leg(&json!({"bootstrap_room": -1})).is_err());
        assert!(d.leg(&json!({"bootstrap_room": 1})).is_err(), "no host");
    }

    #[test]
    fn transfer_time_follows_bandwidth() {
        let mut d = disagg(None, PdProtocol::Nixl);
        // 100 blocks of 2 MiB at 100 Gbit/s.
        let t = d.transfer_time(100);
        assert!((t.as_secs_f64() - 100.0 * 2097152.0 * 8.0 / 100e9).abs() < 1e-9);
        d.config.speedup = 2.0;
        assert_eq!(d.transfer_time(100), t / 2);
        d.config.instant = true;
        assert_eq!(d.transfer_time(100), Duration::ZERO);
    }
}
