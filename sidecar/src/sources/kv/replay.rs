//! The engines' replay protocol: ask a publisher's ROUTER for buffered
//! batches from a sequence number on.
//!
//! Request: `["", start_seq (8 bytes BE)]` from a DEALER (a REQ socket would
//! only see the first reply). Each reply is one batch, either legacy
//! `["", seq, payload]` or newer vLLM `["", topic, seq, payload]`, and the
//! stream ends with the same shape carrying seq `-1` (eight `0xFF` bytes) and
//! an empty payload. A publisher whose buffer no longer holds `start_seq`
//! silently starts at its oldest batch, so callers compare the first seq
//! they get with the one they asked for.
//!
//! A publisher sends its buffer once, in sequence order, so a reply whose
//! sequence repeats or goes back, or a stream longer than the caller's byte
//! bound, is not one: the replay is refused there rather than read on.

use crate::sources::kv::socket::SocketLimits;
use std::ops::{ControlFlow, Range};
use std::time::{Duration, Instant};
use thiserror::Error;

const END_SEQ: [u8; 8] = [0xFF; 8];

#[derive(Debug, Error)]
pub enum ReplayError {
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("replay from {endpoint} timed out after {batches} batches")]
    Timeout { endpoint: String, batches: usize },
    #[error("malformed replay reply with {frames} frames")]
    Malformed { frames: usize },
    #[error(
        "replay from {endpoint} refused: sequence {seq} after {after}, a replay never repeats or goes back"
    )]
    NotIncreasing {
        endpoint: String,
        seq: u64,
        after: u64,
    },
    #[error(
        "replay from {endpoint} refused: over its bound of {bound} payload bytes after {batches} batches"
    )]
    OverBound {
        endpoint: String,
        bound: u64,
        batches: usize,
    },
}

impl ReplayError {
    /// The publisher's answer broke the replay's bounds, as opposed to
    /// not arriving or not parsing.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            ReplayError::NotIncreasing { .. } | ReplayError::OverBound { .. }
        )
    }
}

/// What a replay returned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplaySummary {
    /// The first batch in the range.
    pub first_seq: Option<u64>,
    /// The last batch received, in the range or below it.
    pub last_seq: Option<u64>,
    /// Batches in the range, each passed to the caller.
    pub batches: usize,
    /// Payload bytes of every batch received.
    pub bytes: u64,
    /// Replies carried a topic frame (vLLM ≥ 0.26 shape).
    pub topic_shape: bool,
}

/// Requests the batches of `range` (`start..u64::MAX`: all from `start`)
/// and calls `on_batch(seq, payload)` for each, in the order the publisher
/// sends them, until the end marker, a batch at or past the range's end
/// (not passed on: the range is covered), or `on_batch` breaks. A batch
/// whose sequence is not above the previous one, or that would take the
/// payload bytes over `max_bytes`, ends the replay with a refusal before
/// `on_batch` sees it.
pub fn replay(
    ctx: &zmq::Context,
    endpoint: &str,
    range: Range<u64>,
    timeout: Duration,
    limits: &SocketLimits,
    max_bytes: u64,
    mut on_batch: impl FnMut(u64, &[u8]) -> ControlFlow<()>,
) -> Result<ReplaySummary, ReplayError> {
    let sock = ctx.socket(zmq::DEALER)?;
    sock.set_linger(0)?;
    // An oversized reply drops the connection; the replay then times out
    // and counts as failed, which costs the slot a resync, not memory.
    limits.apply(&sock)?;
    sock.connect(endpoint)?;
    sock.send_multipart([&b""[..], &range.start.to_be_bytes()[..]], 0)?;
    let deadline = Instant::now() + timeout;
    let mut summary = ReplaySummary::default();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ReplayError::Timeout {
                endpoint: endpoint.to_string(),
                batches: summary.batches,
            });
        }
        sock.set_rcvtimeo(left.as_millis().clamp(1, i32::MAX as u128) as i32)?;
        let frames = match sock.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => return Err(e.into()),
        };
        let (seq, payload) = match parse_reply(&frames)? {
            Reply::End { topic } => {
                summary.topic_shape |= topic;
                return Ok(summary);
            }
            Reply::Batch {
                seq,
                payload,
                topic,
            } => {
                summary.topic_shape |= topic;
                (seq, payload)
            }
        };
        if let Some(after) = summary.last_seq
            && seq <= after
        {
            return Err(ReplayError::NotIncreasing {
                endpoint: endpoint.to_string(),
                seq,
                after,
            });
        }
        // Whatever the publisher sends past the range is not needed; an
        // honest one keeps sending what it published since the request.
        if seq >= range.end {
            return Ok(summary);
        }
        let bytes = summary.bytes.saturating_add(payload.len() as u64);
        if bytes > max_bytes {
            return Err(ReplayError::OverBound {
                endpoint: endpoint.to_string(),
                bound: max_bytes,
                batches: summary.batches,
            });
        }
        summary.last_seq = Some(seq);
        summary.bytes = bytes;
        // Below the range is nothing asked for (an honest publisher sends
        // none); it still counts against the bound.
        if seq < range.start {
            continue;
        }
        summary.first_seq.get_or_insert(seq);
        summary.batches += 1;
        if on_batch(seq, payload).is_break() {
            return Ok(summary);
        }
    }
}

/// One reply of a replay stream, borrowed from its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply<'a> {
    Batch {
        seq: u64,
        payload: &'a [u8],
        /// The reply carried a topic frame (vLLM ≥ 0.26 shape).
        topic: bool,
    },
    End {
        topic: bool,
    },
}

/// Reads one reply's frames as a DEALER receives them. Apart from
/// [`replay`] so what a publisher sends can be fuzzed without sockets.
pub fn parse_reply(frames: &[Vec<u8>]) -> Result<Reply<'_>, ReplayError> {
    let malformed = || ReplayError::Malformed {
        frames: frames.len(),
    };
    // The ROUTER's empty delimiter arrives first on a DEALER.
    let body: &[Vec<u8>] = match frames.split_first() {
        Some((first, rest)) if first.is_empty() => rest,
        _ => frames,
    };
    let (seq, payload, topic) = match body {
        [seq, payload] => (seq, payload, false),
        [_topic, seq, payload] => (seq, payload, true),
        _ => return Err(malformed()),
    };
    let seq = <[u8; 8]>::try_from(seq.as_slice()).map_err(|_| malformed())?;
    if seq == END_SEQ && payload.is_empty() {
        return Ok(Reply::End { topic });
    }
    Ok(Reply::Batch {
        seq: u64::from_be_bytes(seq),
        payload,
        topic,
    })
}
