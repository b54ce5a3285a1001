//! The KV-event publisher of one DP rank: a ZMQ PUB socket sending batches
//! and a ROUTER socket answering replay requests, as vLLM's
//! `ZmqEventPublisher` does.
//!
//! ZMQ sockets are not thread-safe, so each rank's sockets live on one OS
//! thread that the HTTP side feeds through a channel. Events are batched:
//! a batch goes out when 64 events are pending or 2 ms after the first.

use crate::wire::{EventShape, HashMode, SimEvent, encode_batch};
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const END_SEQ: [u8; 8] = [0xFF; 8];
const MAX_PENDING: usize = 64;
const FLUSH_AFTER: Duration = Duration::from_millis(2);

#[derive(Debug, Clone)]
pub struct PublisherConfig {
    pub rank: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub block_size: u32,
    pub shape: EventShape,
    pub hash_mode: HashMode,
    /// Replies carry the topic frame (vLLM ≥ 0.26) or not (legacy).
    pub replay_topic_frame: bool,
    pub buffer_steps: usize,
}

#[derive(Debug)]
pub enum Command {
    Event(SimEvent),
    /// A process restart: sequence back to 0, replay buffer emptied.
    Restart,
}

/// Feeds a rank's publisher thread.
#[derive(Debug, Clone)]
pub struct Publisher {
    tx: Sender<Command>,
}

impl Publisher {
    /// Binds the sockets and starts the thread.
    pub fn start(ctx: &zmq::Context, cfg: PublisherConfig) -> anyhow::Result<Publisher> {
        let pub_sock = ctx.socket(zmq::PUB)?;
        pub_sock.set_sndhwm(100_000)?;
        pub_sock.set_linger(0)?;
        pub_sock.bind(&cfg.endpoint)?;
        let router = match &cfg.replay_endpoint {
            Some(ep) => {
                let r = ctx.socket(zmq::ROUTER)?;
                r.set_linger(0)?;
                r.bind(ep)?;
                Some(r)
            }
            None => None,
        };
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name(format!("kv-pub-{}", cfg.rank))
            .spawn(move || run(cfg, pub_sock, router, rx))?;
        Ok(Publisher { tx })
    }

    pub fn send(&self, ev: SimEvent) {
        let _ = self.tx.send(Command::Event(ev));
    }

    pub fn restart(&self) {
        let _ = self.tx.send(Command::Restart);
    }
}

fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

struct State {
    cfg: PublisherConfig,
    seq: u64,
    pending: Vec<SimEvent>,
    first_pending: Option<Instant>,
    buffer: VecDeque<(u64, Vec<u8>)>,
}

impl State {
    fn flush(&mut self, sock: &zmq::Socket) {
        if self.pending.is_empty() {
            return;
        }
        let c = &self.cfg;
        let payload = encode_batch(
            now_ts(),
            &self.pending,
            c.rank,
            c.block_size,
            c.shape,
            c.hash_mode,
        );
        self.pending.clear();
        self.first_pending = None;
        let seq = self.seq.to_be_bytes();
        if let Err(e) = sock.send_multipart([c.topic.as_bytes(), &seq[..], &payload[..]], 0) {
            tracing::warn!(error = %e, "publishing KV events failed");
        }
        self.buffer.push_back((self.seq, payload));
        while self.buffer.len() > c.buffer_steps {
            self.buffer.pop_front();
        }
        self.seq += 1;
    }

    fn answer_replay(&self, router: &zmq::Socket) {
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            let [id, empty, start] = frames.as_slice() else {
                tracing::warn!(frames = frames.len(), "ignoring malformed replay request");
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
                tracing::warn!("ignoring replay request with a bad sequence frame");
                continue;
            };
            if !empty.is_empty() {
                continue;
            }
            let start = u64::from_be_bytes(start);
            let topic = self.cfg.topic.as_bytes();
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let seq = seq.to_be_bytes();
                let r = if self.cfg.replay_topic_frame {
                    router.send_multipart([&id[..], b"", topic, &seq[..], &payload[..]], 0)
                } else {
                    router.send_multipart([&id[..], b"", &seq[..], &payload[..]], 0)
                };
                if r.is_err() {
                    return;
                }
            }
            let _ = if self.cfg.replay_topic_frame {
                router.send_multipart([&id[..], b"", b"", &END_SEQ[..], b""], 0)
            } else {
                router.send_multipart([&id[..], b"", &END_SEQ[..], b""], 0)
            };
        }
    }
}

fn run(
    cfg: PublisherConfig,
    sock: zmq::Socket,
    router: Option<zmq::Socket>,
    rx: Receiver<Command>,
) {
    let mut st = State {
        cfg,
        seq: 0,
        pending: Vec::new(),
        first_pending: None,
        buffer: VecDeque::new(),
    };
    loop {
        // Wake often enough to serve replays and to flush on time.
        match rx.recv_timeout(Duration::from_millis(1)) {
            Ok(Command::Event(ev)) => {
                st.pending.push(ev);
                st.first_pending.get_or_insert_with(Instant::now);
                if st.pending.len() >= MAX_PENDING {
                    st.flush(&sock);
                }
            }
            Ok(Command::Restart) => {
                st.pending.clear();
                st.first_pending = None;
                st.buffer.clear();
                st.seq = 0;
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                st.flush(&sock);
                return;
            }
        }
        if st.first_pending.is_some_and(|t| t.elapsed() >= FLUSH_AFTER) {
            st.flush(&sock);
        }
        if let Some(r) = &router {
            st.answer_replay(r);
        }
    }
}
