//! A borrowing MessagePack reader for exactly what KV-event batches contain.
//!
//! Engines publish tens of thousands of blocks per second per worker, and
//! decoding is what bounds ingest (Dynamo's serde-based decoder tops out near
//! 1.2M blocks/s per core). This reader never allocates: strings and binary
//! values are borrowed from the frame, integers are read in place, and
//! unknown values are skipped structurally.

use thiserror::Error;

/// Nesting bound for skipping unknown values; events are 3–4 levels deep,
/// so anything deeper is hostile or corrupt.
const MAX_DEPTH: u32 = 32;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MsgpackError {
    #[error("truncated at byte {0}")]
    Truncated(usize),
    #[error("expected {expected} at byte {offset}, found marker 0x{marker:02x}")]
    Unexpected {
        expected: &'static str,
        marker: u8,
        offset: usize,
    },
    #[error("string at byte {0} is not UTF-8")]
    BadUtf8(usize),
    #[error("nesting deeper than {MAX_DEPTH} at byte {0}")]
    TooDeep(usize),
    #[error("integer at byte {0} does not fit")]
    Overflow(usize),
    /// A count that the rest of the frame cannot hold: callers size buffers
    /// from counts, so one forged header must not become a 32 GiB
    /// allocation.
    #[error("container at byte {offset} claims {count} elements but only {remaining} bytes follow")]
    ImplausibleLength {
        offset: usize,
        count: usize,
        remaining: usize,
    },
}

/// An integer as msgpack carries it: unsigned formats and non-negative
/// fixints are `U`, signed formats with negative values are `I`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    U(u64),
    I(i64),
}

impl Int {
    /// Bit-for-bit as u64, so signed SGLang hashes stay distinct keys.
    pub fn as_u64_bits(self) -> u64 {
        match self {
            Int::U(u) => u,
            Int::I(i) => i as u64,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    #[inline]
    pub fn peek(&self) -> Result<u8, MsgpackError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or(MsgpackError::Truncated(self.pos))
    }

    #[inline]
    fn byte(&mut self) -> Result<u8, MsgpackError> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(MsgpackError::Truncated(self.pos))?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or(MsgpackError::Truncated(self.pos))?;
        self.pos = end;
        Ok(s)
    }

    #[inline]
    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgpackError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn unexpected(&self, expected: &'static str, marker: u8) -> MsgpackError {
        MsgpackError::Unexpected {
            expected,
            marker,
            offset: self.pos.saturating_sub(1),
        }
    }

    /// Consumes a nil if one is next.
    #[inline]
    pub fn nil(&mut self) -> Result<bool, MsgpackError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// Refuses a count of items, each at least `min_bytes` long, that the
    /// rest of the frame cannot hold.
    fn plausible(&self, at: usize, count: usize, min_bytes: usize) -> Result<usize, MsgpackError> {
        let remaining = self.remaining();
        if count.saturating_mul(min_bytes) > remaining {
            return Err(MsgpackError::ImplausibleLength {
                offset: at,
                count,
                remaining,
            });
        }
        Ok(count)
    }

    /// The element count of an array; never more than the bytes left, since
    /// every element takes at least one.
    pub fn array_len(&mut self) -> Result<usize, MsgpackError> {
        let at = self.pos;
        let m = self.byte()?;
        let n = match m {
            0x90..=0x9f => (m & 0x0f) as usize,
            0xdc => u16::from_be_bytes(self.be()?) as usize,
            0xdd => u32::from_be_bytes(self.be()?) as usize,
            _ => return Err(self.unexpected("array", m)),
        };
        self.plausible(at, n, 1)
    }

    /// The entry count of a map; never more than half the bytes left, since
    /// every key and every value takes at least one.
    pub fn map_len(&mut self) -> Result<usize, MsgpackError> {
        let at = self.pos;
        let m = self.byte()?;
        let n = match m {
            0x80..=0x8f => (m & 0x0f) as usize,
            0xde => u16::from_be_bytes(self.be()?) as usize,
            0xdf => u32::from_be_bytes(self.be()?) as usize,
            _ => return Err(self.unexpected("map", m)),
        };
        self.plausible(at, n, 2)
    }

    pub fn is_array(&self) -> Result<bool, MsgpackError> {
        Ok(matches!(self.peek()?, 0x90..=0x9f | 0xdc | 0xdd))
    }

    pub fn is_map(&self) -> Result<bool, MsgpackError> {
        Ok(matches!(self.peek()?, 0x80..=0x8f | 0xde | 0xdf))
    }

    pub fn is_str(&self) -> Result<bool, MsgpackError> {
        Ok(matches!(self.peek()?, 0xa0..=0xbf | 0xd9 | 0xda | 0xdb))
    }

    pub fn str(&mut self) -> Result<&'a str, MsgpackError> {
        let m = self.byte()?;
        let len = match m {
            0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 => self.byte()? as usize,
            0xda => u16::from_be_bytes(self.be()?) as usize,
            0xdb => u32::from_be_bytes(self.be()?) as usize,
            _ => return Err(self.unexpected("string", m)),
        };
        let at = self.pos;
        std::str::from_utf8(self.take(len)?).map_err(|_| MsgpackError::BadUtf8(at))
    }

    pub fn bin(&mut self) -> Result<&'a [u8], MsgpackError> {
        let m = self.byte()?;
        let len = match m {
            0xc4 => self.byte()? as usize,
            0xc5 => u16::from_be_bytes(self.be()?) as usize,
            0xc6 => u32::from_be_bytes(self.be()?) as usize,
            _ => return Err(self.unexpected("binary", m)),
        };
        self.take(len)
    }

    #[inline]
    pub fn int(&mut self) -> Result<Int, MsgpackError> {
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => Int::U(m as u64),
            0xe0..=0xff => Int::I(m as i8 as i64),
            0xcc => Int::U(self.byte()? as u64),
            0xcd => Int::U(u16::from_be_bytes(self.be()?) as u64),
            0xce => Int::U(u32::from_be_bytes(self.be()?) as u64),
            0xcf => Int::U(u64::from_be_bytes(self.be()?)),
            0xd0 => signed(i8::from_be_bytes(self.be()?) as i64),
            0xd1 => signed(i16::from_be_bytes(self.be()?) as i64),
            0xd2 => signed(i32::from_be_bytes(self.be()?) as i64),
            0xd3 => signed(i64::from_be_bytes(self.be()?)),
            _ => return Err(self.unexpected("integer", m)),
        })
    }

    /// An integer that must fit a u32 (token ids, block sizes).
    #[inline]
    pub fn u32(&mut self) -> Result<u32, MsgpackError> {
        // Token ids dominate the payload; the fixint and uint16 cases cover
        // nearly all of them, so they come first.
        let at = self.pos;
        match self.peek()? {
            m @ 0x00..=0x7f => {
                self.pos += 1;
                Ok(m as u32)
            }
            0xcd => {
                self.pos += 1;
                Ok(u16::from_be_bytes(self.be()?) as u32)
            }
            _ => match self.int()? {
                Int::U(u) => u32::try_from(u).map_err(|_| MsgpackError::Overflow(at)),
                Int::I(i) => u32::try_from(i).map_err(|_| MsgpackError::Overflow(at)),
            },
        }
    }

    pub fn f64(&mut self) -> Result<f64, MsgpackError> {
        match self.peek()? {
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            0xca => {
                self.pos += 1;
                Ok(f32::from_be_bytes(self.be()?) as f64)
            }
            _ => Ok(match self.int()? {
                Int::U(u) => u as f64,
                Int::I(i) => i as f64,
            }),
        }
    }

    /// Skips one value of any type.
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: u32) -> Result<(), MsgpackError> {
        if depth > MAX_DEPTH {
            return Err(MsgpackError::TooDeep(self.pos));
        }
        let at = self.pos;
        let m = self.byte()?;
        let (skip_bytes, items) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * (m & 0x0f) as usize),
            0x90..=0x9f => (0, (m & 0x0f) as usize),
            0xa0..=0xbf => ((m & 0x1f) as usize, 0),
            0xc4 | 0xd9 => (self.byte()? as usize, 0),
            0xc5 | 0xda => (u16::from_be_bytes(self.be()?) as usize, 0),
            0xc6 | 0xdb => (u32::from_be_bytes(self.be()?) as usize, 0),
            0xc7 => (self.byte()? as usize + 1, 0),
            0xc8 => (u16::from_be_bytes(self.be()?) as usize + 1, 0),
            0xc9 => (u32::from_be_bytes(self.be()?) as usize + 1, 0),
            0xca => (4, 0),
            0xcb => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 => (4, 0),
            0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, u16::from_be_bytes(self.be()?) as usize),
            0xdd => (0, u32::from_be_bytes(self.be()?) as usize),
            0xde => (0, 2 * u16::from_be_bytes(self.be()?) as usize),
            0xdf => (0, 2 * u32::from_be_bytes(self.be()?) as usize),
            // 0xc1 is "never used" in the spec.
            _ => return Err(self.unexpected("any value", m)),
        };
        self.take(skip_bytes)?;
        // Fails a forged count at once rather than after billions of
        // truncated reads.
        self.plausible(at, items, 1)?;
        for _ in 0..items {
            self.skip_depth(depth + 1)?;
        }
        Ok(())
    }
}

fn signed(i: i64) -> Int {
    if i >= 0 { Int::U(i as u64) } else { Int::I(i) }
}

#[cfg(test)]
mod tests;
