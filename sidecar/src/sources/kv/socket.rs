//! What a rank's ZMQ sockets may hold, for the subscriber's SUB socket
//! and the replay DEALER alike.

/// What one rank's sockets may hold: at most `queue_messages` messages of
/// frames no larger than `max_message_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketLimits {
    /// A peer sending a larger frame is disconnected by libzmq, never
    /// buffered (the subscriber then connects again).
    pub max_message_bytes: u64,
    /// The receive high-water mark: messages past it are dropped.
    pub queue_messages: u32,
}

impl Default for SocketLimits {
    fn default() -> Self {
        SocketLimits {
            max_message_bytes: 8 << 20,
            queue_messages: 1000,
        }
    }
}

impl SocketLimits {
    /// Sets both on a socket; must come before it connects.
    pub fn apply(&self, sock: &zmq::Socket) -> Result<(), zmq::Error> {
        sock.set_maxmsgsize(i64::try_from(self.max_message_bytes).unwrap_or(i64::MAX))?;
        sock.set_rcvhwm(i32::try_from(self.queue_messages).unwrap_or(i32::MAX))
    }
}
