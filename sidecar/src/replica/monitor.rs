//! A peer's SUB socket as libzmq's socket monitor sees it.
//!
//! libzmq drops the connection of a peer that sends a frame over
//! `ZMQ_MAXMSGSIZE` as a protocol error, and after a protocol error it
//! never connects again, nor tells the socket's user: without the monitor
//! one oversized message silenced the peer for good.

use std::sync::atomic::{AtomicU64, Ordering};

/// Tells monitor endpoints apart: a peer removed and added again gets a
/// new socket while the old one may still be closing.
static MONITORS: AtomicU64 = AtomicU64::new(0);

/// What the monitor reported since it was last read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
    /// The last change of state, if any: true for a handshake done.
    pub connected: Option<bool>,
    /// The connection was lost or refused in a way libzmq may not retry.
    pub lost: bool,
}

pub(super) struct Monitor {
    pair: zmq::Socket,
}

const WATCHED: [zmq::SocketEvent; 5] = [
    zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
    zmq::SocketEvent::DISCONNECTED,
    zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL,
    zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL,
    zmq::SocketEvent::HANDSHAKE_FAILED_AUTH,
];

impl Monitor {
    /// Attach before connecting, so that no event goes unseen.
    pub(super) fn attach(ctx: &zmq::Context, sock: &zmq::Socket) -> Result<Monitor, zmq::Error> {
        let endpoint = format!(
            "inproc://kvgate-replica-monitor-{}",
            MONITORS.fetch_add(1, Ordering::Relaxed)
        );
        let mask = WATCHED.iter().fold(0, |m, e| m | i32::from(e.to_raw()));
        sock.monitor(&endpoint, mask)?;
        let pair = ctx.socket(zmq::PAIR)?;
        pair.set_linger(0)?;
        pair.connect(&endpoint)?;
        Ok(Monitor { pair })
    }

    /// Reads every event waiting; never blocks.
    pub(super) fn read(&self) -> Seen {
        let mut seen = Seen::default();
        // Each event is two frames: six bytes (the event number as a
        // native-endian u16, then a u32 value), and the peer's endpoint.
        while let Ok(frames) = self.pair.recv_multipart(zmq::DONTWAIT) {
            let Some(event) = frames
                .first()
                .and_then(|f| f.get(..2))
                .map(|b| u16::from_ne_bytes([b[0], b[1]]))
            else {
                continue;
            };
            if event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
                seen.connected = Some(true);
            } else if WATCHED.iter().any(|e| e.to_raw() == event) {
                seen.connected = Some(false);
                seen.lost = true;
            }
        }
        seen
    }
}
