//! Disconnections of a SUB socket, from libzmq's socket monitor.

use std::sync::atomic::{AtomicU64, Ordering};

/// Tells monitor endpoints apart: a restarted subscriber's slot may
/// overlap with its predecessor still shutting down.
static MONITORS: AtomicU64 = AtomicU64::new(0);

/// The SUB socket's disconnections, as libzmq's socket monitor reports
/// them. libzmq drops the connection of a peer that sends an oversized
/// frame without telling the socket's user; this is how the subscriber
/// learns of it, to count it and to connect again.
pub(super) struct Monitor {
    pair: zmq::Socket,
}

impl Monitor {
    pub(super) fn attach(
        ctx: &zmq::Context,
        sock: &zmq::Socket,
        slot: u16,
    ) -> Result<Monitor, zmq::Error> {
        let endpoint = format!(
            "inproc://kvgate-kv-monitor-{slot}-{}",
            MONITORS.fetch_add(1, Ordering::Relaxed)
        );
        sock.monitor(&endpoint, zmq::SocketEvent::DISCONNECTED as i32)?;
        let pair = ctx.socket(zmq::PAIR)?;
        pair.set_linger(0)?;
        pair.connect(&endpoint)?;
        Ok(Monitor { pair })
    }

    /// Disconnections reported since the last call; never blocks.
    pub(super) fn disconnects(&self) -> u64 {
        let mut n = 0;
        // Each event is two frames: six bytes (the event number as a
        // native-endian u16, then a u32 value), and the peer's endpoint.
        while let Ok(frames) = self.pair.recv_multipart(zmq::DONTWAIT) {
            let event = frames
                .first()
                .and_then(|f| f.get(..2))
                .map(|b| u16::from_ne_bytes([b[0], b[1]]));
            if event == Some(zmq::SocketEvent::DISCONNECTED.to_raw()) {
                n += 1;
            }
        }
        n
    }
}
