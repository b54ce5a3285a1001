//! The wire both side channels speak (NIXL-style pulls and SGLang-style
//! bootstrap joins): this simulator's own protocol, not NIXL's or
//! Mooncake's, since only simulators talk to it.
//!
//! A frame is a big-endian `u32` length and that many payload bytes; the
//! payload is a kind byte and the kind's fields. Strings are a `u16` length
//! and UTF-8; lists are a `u32` count and their items. Every length is
//! checked against the bytes actually present before anything is
//! allocated, and a frame's length against [`MAX_FRAME`] before it is read,
//! so a peer can neither crash a sim nor make it allocate more than one
//! capped frame per connection.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest payload either side accepts: 64 Ki blocks of identities.
pub const MAX_FRAME: usize = 1 << 20;
/// The longest string field (engine ids, request ids, reasons).
pub const MAX_STR: usize = 4096;

const PULL: u8 = 1;
const BLOCKS: u8 = 2;
const GONE: u8 = 3;
const REFUSED: u8 = 4;
const JOIN: u8 = 5;

const FULL: u8 = 1;
const PARTIAL: u8 = 0;

/// One KV block as a decode worker needs it to cache what it received:
/// the id the prefill worker gave it, and its engine hash when it is a full
/// block (the prompt's partial tail block has none and is never cached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockIdentity {
    pub id: u32,
    pub hash: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A decode worker asks a prefill engine for a request's blocks.
    Pull {
        engine_id: String,
        request_id: String,
        block_ids: Vec<u32>,
    },
    /// A decode worker joins a bootstrap room (SGLang-style).
    Join { room: u64 },
    /// The blocks asked for, in the order asked.
    Blocks(Vec<BlockIdentity>),
    /// The blocks are no longer held (lease expired, never prefilled).
    Gone(String),
    /// The ask is wrong (another engine, ids not of this request).
    Refused(String),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame of {0} bytes exceeds the cap")]
    TooLong(usize),
    #[error("frame is truncated")]
    Truncated,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("unknown block tag {0}")]
    UnknownTag(u8),
    #[error("string of {0} bytes exceeds the cap")]
    StringTooLong(usize),
    #[error("string is not UTF-8")]
    NotUtf8,
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
    #[error("I/O: {0}")]
    Io(String),
}

impl From<std::io::Error> for FrameError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            FrameError::Truncated
        } else {
            FrameError::Io(e.to_string())
        }
    }
}

/// Reads fields off a payload, never past its end.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.0.len() < n {
            return Err(FrameError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, FrameError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, FrameError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, FrameError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }

    fn string(&mut self) -> Result<String, FrameError> {
        let n = self.u16()? as usize;
        if n > MAX_STR {
            return Err(FrameError::StringTooLong(n));
        }
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| FrameError::NotUtf8)
    }

    /// A list count, refused when its items could not fit in what is left:
    /// the count alone never sizes an allocation.
    fn count(&mut self, min_item: usize) -> Result<usize, FrameError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.0.len() {
            return Err(FrameError::Truncated);
        }
        Ok(n)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Longer strings are cut at a character boundary: the reader caps them.
    let mut end = s.len().min(MAX_STR);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_be_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

impl Message {
    /// The payload (without the length prefix).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Message::Pull {
                engine_id,
                request_id,
                block_ids,
            } => {
                out.push(PULL);
                put_str(&mut out, engine_id);
                put_str(&mut out, request_id);
                out.extend_from_slice(&(block_ids.len() as u32).to_be_bytes());
                for id in block_ids {
                    out.extend_from_slice(&id.to_be_bytes());
                }
            }
            Message::Join { room } => {
                out.push(JOIN);
                out.extend_from_slice(&room.to_be_bytes());
            }
            Message::Blocks(blocks) => {
                out.push(BLOCKS);
                out.extend_from_slice(&(blocks.len() as u32).to_be_bytes());
                for b in blocks {
                    out.extend_from_slice(&b.id.to_be_bytes());
                    match b.hash {
                        Some(h) => {
                            out.push(FULL);
                            out.extend_from_slice(&h.to_be_bytes());
                        }
                        None => out.push(PARTIAL),
                    }
                }
            }
            Message::Gone(reason) => {
                out.push(GONE);
                put_str(&mut out, reason);
            }
            Message::Refused(reason) => {
                out.push(REFUSED);
                put_str(&mut out, reason);
            }
        }
        out
    }

    /// Parses a payload; any malformation is an error, never a panic.
    pub fn decode(payload: &[u8]) -> Result<Message, FrameError> {
        if payload.len() > MAX_FRAME {
            return Err(FrameError::TooLong(payload.len()));
        }
        let mut r = Reader(payload);
        let msg = match r.u8()? {
            PULL => {
                let engine_id = r.string()?;
                let request_id = r.string()?;
                let n = r.count(4)?;
                let block_ids = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
                Message::Pull {
                    engine_id,
                    request_id,
                    block_ids,
                }
            }
            JOIN => Message::Join { room: r.u64()? },
            BLOCKS => {
                let n = r.count(5)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    let id = r.u32()?;
                    let hash = match r.u8()? {
                        FULL => Some(r.u64()?),
                        PARTIAL => None,
                        t => return Err(FrameError::UnknownTag(t)),
                    };
                    blocks.push(BlockIdentity { id, hash });
                }
                Message::Blocks(blocks)
            }
            GONE => Message::Gone(r.string()?),
            REFUSED => Message::Refused(r.string()?),
            k => return Err(FrameError::UnknownKind(k)),
        };
        if !r.0.is_empty() {
            return Err(FrameError::Trailing(r.0.len()));
        }
        Ok(msg)
    }
}

/// Reads one frame. `Ok(None)` is a clean end of stream between frames.
pub async fn read<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Message>, FrameError> {
    let mut len = [0u8; 4];
    // A peer that closes before a new frame has simply finished.
    match r.read(&mut len[..1]).await? {
        0 => return Ok(None),
        _ => r.read_exact(&mut len[1..]).await?,
    };
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLong(n));
    }
    let mut payload = vec![0u8; n];
    r.read_exact(&mut payload).await?;
    Message::decode(&payload).map(Some)
}

pub async fn write<W: AsyncWrite + Unpin>(w: &mut W, msg: &Message) -> Result<(), FrameError> {
    let payload = msg.encode();
    if payload.len() > MAX_FRAME {
        return Err(FrameError::TooLong(payload.len()));
    }
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    w.write_all(&out).await?;
    w.flush().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        let all = [
            Message::Pull {
                engine_id: "sim-1_dp0".into(),
                request_id: "req-é".into(),
                block_ids: vec![0, 7, u32::MAX],
            },
            Message::Join { room: u64::MAX - 3 },
            Message::Blocks(vec![
                BlockIdentity {
                    id: 1,
                    hash: Some(0xDEAD_BEEF_0000_0001),
                },
                BlockIdentity { id: 2, hash: None },
            ]),
            Message::Blocks(vec![]),
            Message::Gone("lease expired".into()),
            Message::Refused("wrong engine".into()),
        ];
        for m in all {
            assert_eq!(Message::decode(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn hostile_payloads_are_errors_not_panics_or_huge_allocations() {
        // A list that claims four billion ids in a handful of bytes.
        let mut p = vec![PULL, 0, 1, b'e', 0, 1, b'r'];
        p.extend_from_slice(&u32::MAX.to_be_bytes());
        p.extend_from_slice(&[0, 0, 0, 1]);
        assert_eq!(Message::decode(&p), Err(FrameError::Truncated));
        // A block list that claims more than it carries.
        let mut b = vec![BLOCKS];
        b.extend_from_slice(&1_000_000u32.to_be_bytes());
        assert_eq!(Message::decode(&b), Err(FrameError::Truncated));
        // A string longer than the cap, and one longer than the payload.
        let mut s = vec![GONE];
        s.extend_from_slice(&u16::MAX.to_be_bytes());
        assert_eq!(
            Message::decode(&s),
            Err(FrameError::StringTooLong(u16::MAX as usize))
        );
        assert_eq!(
            Message::decode(&[GONE, 0, 9, b'x']),
            Err(FrameError::Truncated)
        );
        assert_eq!(
            Message::decode(&[GONE, 0, 1, 0xFF]),
            Err(FrameError::NotUtf8)
        );
        assert_eq!(Message::decode(&[]), Err(FrameError::Truncated));
        assert_eq!(Message::decode(&[99]), Err(FrameError::UnknownKind(99)));
        assert_eq!(
            Message::decode(&[BLOCKS, 0, 0, 0, 1, 0, 0, 0, 1, 7, 0, 0]),
            Err(FrameError::UnknownTag(7))
        );
        assert_eq!(
            Message::decode(&[GONE, 0, 0, 1]),
            Err(FrameError::Trailing(1))
        );
        // Every prefix of a valid frame is an error, none panics.
        let good = Message::Pull {
            engine_id: "e".into(),
            request_id: "r".into(),
            block_ids: vec![1, 2, 3],
        }
        .encode();
        for cut in 0..good.len() {
            assert!(Message::decode(&good[..cut]).is_err(), "prefix of {cut}");
        }
    }

    #[tokio::test]
    async fn a_huge_length_prefix_is_refused_before_reading() {
        let mut hostile: &[u8] = &[0xFF, 0xFF, 0xFF, 0xFF, 1, 2, 3];
        assert_eq!(
            read(&mut hostile).await,
            Err(FrameError::TooLong(u32::MAX as usize))
        );
        let mut short: &[u8] = &[0, 0, 0, 10, GONE];
        assert_eq!(read(&mut short).await, Err(FrameError::Truncated));
        let mut empty: &[u8] = &[];
        assert_eq!(read(&mut empty).await, Ok(None));
        let mut buf = Vec::new();
        write(&mut buf, &Message::Join { room: 42 }).await.unwrap();
        assert_eq!(
            read(&mut buf.as_slice()).await,
            Ok(Some(Message::Join { room: 42 }))
        );
    }
}
