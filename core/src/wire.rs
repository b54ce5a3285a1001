//! The one reader behind every binary format kvgate decodes (snapshots,
//! update frames, booking events, routing reports, index shards, and the
//! sidecar's index dumps).
//!
//! Input comes from another process, often across a trust boundary, so
//! every read is checked against the bytes present, every count against
//! what the remaining bytes could hold before anything is allocated, and no
//! read panics. Each format wraps [`WireError`] in its own error, which adds
//! what only that format can get wrong (magic, version, tags).

use thiserror::Error;

/// A read past the input, a string that is not UTF-8, or a count that the
/// input cannot hold. Offsets are from the start of the reader's window.
#[derive(Debug, Clone, Copy, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("truncated: needed {needed} bytes at offset {offset}, {available} available")]
    Truncated {
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error("string at offset {offset} is not UTF-8")]
    BadUtf8 { offset: usize },
    #[error("{count} {what}, more than the bytes present can hold")]
    ImplausibleCount { what: &'static str, count: u32 },
}

/// A bounds-checked little-endian cursor over a byte window.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// A reader of `buf` that starts at `pos`.
    pub fn at(buf: &'a [u8], pos: usize) -> Self {
        Reader { buf, pos }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let available = self.remaining();
        if n > available {
            return Err(WireError::Truncated {
                offset: self.pos,
                needed: n,
                available,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }

    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub fn f32(&mut self) -> Result<f32, WireError> {
        Ok(f32::from_le_bytes(self.array()?))
    }

    pub fn f64(&mut self) -> Result<f64, WireError> {
        Ok(f64::from_le_bytes(self.array()?))
    }

    /// A string with a u16 length prefix, borrowed from the input.
    pub fn str16(&mut self) -> Result<&'a str, WireError> {
        let len = self.u16()? as usize;
        let offset = self.pos;
        std::str::from_utf8(self.take(len)?).map_err(|_| WireError::BadUtf8 { offset })
    }

    /// [`Reader::str16`], owned.
    pub fn string16(&mut self) -> Result<String, WireError> {
        self.str16().map(str::to_owned)
    }

    /// Refuses a count whose items, at `min_each` bytes apiece, could not
    /// fit in what remains: a corrupted count must not make a reader
    /// allocate gigabytes.
    pub fn plausible(
        &self,
        count: u32,
        min_each: usize,
        what: &'static str,
    ) -> Result<(), WireError> {
        if (count as usize).saturating_mul(min_each) > self.remaining() {
            return Err(WireError::ImplausibleCount { what, count });
        }
        Ok(())
    }

    /// A reader of the next `len` bytes, which this one skips.
    pub fn window(&mut self, len: usize) -> Result<Reader<'a>, WireError> {
        Ok(Reader::new(self.take(len)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_little_endian_and_names_the_failing_offset() {
        let bytes = [1, 0, 2, 0, 0, 0, 3, b'a', b'b', b'c'];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.u16(), Ok(1));
        assert_eq!(r.u32(), Ok(2));
        assert_eq!(r.remaining(), 4);
        let mut s = Reader::at(&bytes, 6);
        assert_eq!(
            s.str16(),
            Err(WireError::Truncated {
                offset: 8,
                needed: 0x6103,
                available: 2
            })
        );
        let mut w = Reader::new(&[2, 0, 0xff, 0xfe]);
        assert_eq!(w.str16(), Err(WireError::BadUtf8 { offset: 2 }));
        let mut ok = Reader::new(&[2, 0, b'h', b'i', 9]);
        assert_eq!(ok.string16().as_deref(), Ok("hi"));
        assert_eq!(
            ok.window(2).map(|w| w.remaining()),
            Err(WireError::Truncated {
                offset: 4,
                needed: 2,
                available: 1
            })
        );
    }

    #[test]
    fn counts_are_checked_against_the_bytes_present() {
        let r = Reader::new(&[0; 16]);
        assert!(r.plausible(4, 4, "items").is_ok());
        assert_eq!(
            r.plausible(5, 4, "items"),
            Err(WireError::ImplausibleCount {
                what: "items",
                count: 5
            })
        );
        assert!(r.plausible(u32::MAX, usize::MAX, "items").is_err());
    }

    proptest! {
        #[test]
        fn no_read_panics(bytes in prop::collection::vec(any::<u8>(), 0..64), ops in prop::collection::vec(0u8..7, 0..32)) {
            let mut r = Reader::new(&bytes);
            for op in ops {
                let _ = match op {
                    0 => r.u8().map(drop),
                    1 => r.u16().map(drop),
                    2 => r.u32().map(drop),
                    3 => r.u64().map(drop),
                    4 => r.f64().map(drop),
                    5 => r.str16().map(drop),
                    _ => r.window(3).map(drop),
                };
                prop_assert!(r.pos() <= bytes.len());
            }
        }
    }
}
