//! A small deterministic mutation engine for the stable runner and the CI
//! test, where libFuzzer (nightly only) is not available.
//!
//! It has no coverage feedback, so it leans on what breaks length-checked
//! decoders: stacked byte edits, splices between corpus inputs, length
//! fields overwritten with interesting integers in both byte orders, and
//! msgpack container and string markers claiming 2³²−1 entries. The same
//! seed gives the same inputs on every machine, so a CI failure replays.

/// xorshift64*: tiny, fast, and plenty for choosing mutations.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        // splitmix64 once, so that small or similar seeds start far apart
        // and zero (a fixed point of xorshift) cannot happen.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-enough in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }
}

/// Integers that sit on the edges length checks get wrong.
pub const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    16,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_fffe,
    0xffff_ffff,
    0x1_0000_0000,
    0x0400_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX - 1,
    u64::MAX,
];

/// Msgpack markers with hostile lengths, and containers to nest.
pub const MSGPACK: &[&[u8]] = &[
    &[0xdc, 0xff, 0xff],             // array16 of 65535
    &[0xdd, 0xff, 0xff, 0xff, 0xff], // array32 of 2^32-1
    &[0xdd, 0x00, 0x01, 0x00, 0x00], // array32 of 65536
    &[0xde, 0xff, 0xff],             // map16 of 65535
    &[0xdf, 0xff, 0xff, 0xff, 0xff], // map32 of 2^32-1
    &[0xdb, 0xff, 0xff, 0xff, 0xff], // str32
    &[0xc6, 0xff, 0xff, 0xff, 0xff], // bin32
    &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0x9f],
    &[0x8f],
    &[0x91],
    &[0x81],
    &[0x90],
    &[0x80],
    &[0xc0],
    &[0xc1],
    &[0xc3],
    &[0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0], // NaN
    &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
    &[0xce, 0xff, 0xff, 0xff, 0xff],
    &[0xe0],
];

/// Tokens of the formats under test, spliced in whole: random bytes almost
/// never spell a field name, and a decoder's interesting paths sit behind
/// them.
pub const DICTIONARY: &[&[u8]] = &[
    b"\xabBlockStored",
    b"\xacBlockRemoved",
    b"\xb0AllBlocksCleared",
    b"\xa4type",
    b"\xacblock_hashes",
    b"\xa9token_ids",
    b"\xb1parent_block_hash",
    b"\xaablock_size",
    b"\xa6medium",
    b"\xa9lora_name",
    b"\xaacache_salt",
    b"\xa9group_idx",
    b"\xb2kv_cache_spec_kind",
    b"\xa8locality",
    b"\xa6REMOTE",
    b"\xa3CPU",
    b"\xa6events",
    b"\xa2ts",
    b"\xb2data_parallel_rank",
    b"KVGS",
    b"KVGU",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\"",
    b"\\",
    b"\\u0000",
    b"\\ud800",
    b"\"model\":",
    b"\"prompt\":",
    b"\"messages\":",
    b"\"role\":",
    b"\"content\":",
    b"\"text\":",
    b"\"stream\":",
    b"\"max_tokens\":",
    b"\"max_completion_tokens\":",
    b"null",
    b"true",
    b"-1",
    b"1e999",
    b"4294967296",
    b"18446744073709551616",
    b"[[[[[[[[[[[[[[[[",
    b"\n",
    b"# HELP ",
    b"# TYPE ",
    b"{engine=\"",
    b"dp_rank=\"",
    b"\",",
    b"NaN",
    b"+Inf",
    b"-Inf",
    b"vllm:num_requests_running",
    b"vllm:cache_config_info",
    b"num_gpu_blocks=\"",
    b"\xff\xff\xff\xff",
    b"\xc3\xa9",
    b"\xed\xa0\x80",
];

/// Mutates inputs; one per runner thread.
#[derive(Debug, Clone)]
pub struct Mutator {
    rng: Rng,
    /// Mutants are cut to this length.
    pub max_len: usize,
}

impl Mutator {
    pub fn new(seed: u64) -> Self {
        Mutator {
            rng: Rng::new(seed),
            max_len: 4096,
        }
    }

    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Writes a mutant of `input` into `out`, with one to four stacked
    /// mutations; `pool` supplies splice partners (it may be empty).
    pub fn mutate(&mut self, input: &[u8], pool: &[Vec<u8>], out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(input);
        let n = 1 + self.rng.below(4);
        for _ in 0..n {
            self.once(out, pool);
        }
        out.truncate(self.max_len);
    }

    fn pos(&mut self, b: &[u8]) -> usize {
        self.rng.below(b.len() + 1)
    }

    fn once(&mut self, b: &mut Vec<u8>, pool: &[Vec<u8>]) {
        let r = &mut self.rng;
        match r.below(13) {
            0 if !b.is_empty() => {
                let i = r.below(b.len());
                b[i] ^= 1 << r.below(8);
            }
            1 if !b.is_empty() => {
                let i = r.below(b.len());
                b[i] = r.byte();
            }
            2 if !b.is_empty() => {
                let i = r.below(b.len());
                let d = 1 + r.below(16) as u8;
                b[i] = if r.one_in(2) {
                    b[i].wrapping_add(d)
                } else {
                    b[i].wrapping_sub(d)
                };
            }
            3 => {
                let at = self.pos(b);
                let n = 1 + self.rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| self.rng.byte()).collect();
                b.splice(at..at, bytes);
            }
            4 if !b.is_empty() => {
                let at = r.below(b.len());
                let n = (1 + r.below(16)).min(b.len() - at);
                b.drain(at..at + n);
            }
            5 if !b.is_empty() => {
                // Copy a range elsewhere: repeats records and list items.
                let from = r.below(b.len());
                let n = (1 + r.below(32)).min(b.len() - from);
                let chunk = b[from..from + n].to_vec();
                let at = self.pos(b);
                b.splice(at..at, chunk);
            }
            6 => self.interesting(b),
            7 => {
                let m = MSGPACK[self.rng.below(MSGPACK.len())];
                self.put(b, m);
            }
            8 if !pool.is_empty() => {
                // Splice: our head, another input's tail.
                let other = &pool[self.rng.below(pool.len())];
                let cut = self.pos(b);
                let from = self.rng.below(other.len() + 1);
                b.truncate(cut);
                b.extend_from_slice(&other[from..]);
            }
            9 if !pool.is_empty() => {
                let other = &pool[self.rng.below(pool.len())];
                if !other.is_empty() {
                    let from = self.rng.below(other.len());
                    let n = (1 + self.rng.below(64)).min(other.len() - from);
                    let at = self.pos(b);
                    b.splice(at..at, other[from..from + n].iter().copied());
                }
            }
            10 => {
                let t = DICTIONARY[self.rng.below(DICTIONARY.len())];
                self.put(b, t);
            }
            11 if !b.is_empty() => {
                let at = r.below(b.len());
                b.truncate(at);
            }
            _ => {
                let i = self.pos(b);
                b.insert(i, self.rng.byte());
            }
        }
    }

    /// Inserts or overwrites (even odds) `bytes` at a random position.
    fn put(&mut self, b: &mut Vec<u8>, bytes: &[u8]) {
        let at = self.pos(b);
        if self.rng.one_in(2) {
            b.splice(at..at, bytes.iter().copied());
        } else {
            let end = (at + bytes.len()).min(b.len());
            b.splice(at..end, bytes.iter().copied());
        }
    }

    /// An interesting integer of 1, 2, 4 or 8 bytes, either byte order,
    /// over the bytes at a random position: most length fields in these
    /// formats are little-endian, msgpack's are big-endian.
    fn interesting(&mut self, b: &mut Vec<u8>) {
        let v = INTERESTING[self.rng.below(INTERESTING.len())];
        let width = 1 << self.rng.below(4);
        let le = v.to_le_bytes();
        let mut bytes = [0u8; 8];
        bytes[..width].copy_from_slice(&le[..width]);
        if self.rng.one_in(2) {
            bytes[..width].reverse();
        }
        let at = self.rng.below(b.len().saturating_sub(width) + 1);
        let end = (at + width).min(b.len());
        b.splice(at..end, bytes[..width].iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_bounded() {
        let seeds = vec![b"hello world".to_vec(), vec![0x92, 0x01, 0x90]];
        let run = |seed| {
            let mut m = Mutator::new(seed);
            m.max_len = 64;
            let mut out = Vec::new();
            let mut all = Vec::new();
            for i in 0..2000 {
                m.mutate(&seeds[i % 2], &seeds, &mut out);
                assert!(out.len() <= 64);
                all.push(out.clone());
            }
            all
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn reaches_hostile_lengths() {
        let mut m = Mutator::new(1);
        let mut out = Vec::new();
        let mut seen = false;
        for _ in 0..20_000 {
            m.mutate(&[0x92, 0x01, 0x91, 0x90], &[], &mut out);
            seen |= out.windows(5).any(|w| w == [0xdd, 0xff, 0xff, 0xff, 0xff]);
        }
        assert!(seen, "array32 with 2^32-1 entries never produced");
    }
}
