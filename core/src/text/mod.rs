//! Precise routing for text and chat prompts, without a tokenizer on the
//! request path (decision record: `docs/text-routing.md`).
//!
//! The filter renders the model's chat template ([`template`]) and keys the
//! rendered text at every [`CHUNK_BYTES`] boundary by a hash of the whole
//! prefix up to it. The sidecar, which holds the model's vocabulary,
//! decodes the token ids of every block the engines report stored back to
//! bytes, resumes the hash from the parent block's [`Cursor`], and publishes
//! which ranks hold which prefix keys under [`index_key`]. A byte-level BPE
//! decodes to exactly the text it encoded, so the two sides meet: a
//! request's key `k` is held by the ranks that hold the block in which the
//! engine's cached prefix passed byte `256·(k+1)`. Removals, clears and
//! restarts reach these keys as they reach the token index.
//!
//! Keys are prefix hashes rather than chained chunk hashes because the
//! sidecar sees text in blocks that end anywhere: resuming a word-at-a-time
//! hash needs only the parent's state, unfinished word and offset (24 bytes
//! per block), where a chunk hash would need every block to keep its
//! unfinished chunk. The hash is a cache hint, not a security boundary: a
//! crafted prompt that collides with another's prefix only steers its own
//! request towards a worker that then computes its own, exact, hashes.

mod jinja;
pub mod skeleton;
pub mod template;

use crate::hash::CacheScope;
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use crate::approx::{CHUNK_BYTES, MAX_CHUNKS};
/// A small UTC `strftime` (the directives chat templates use), also what
/// the sidecar stamps its own output with.
pub use jinja::strftime;

/// Shards of every model's text index.
pub const SHARDS: u32 = 4096;
/// Keeps prefix keys apart from block and chunk hashes.
const SEED: u64 = 1337 ^ 0x7E47_0C5E_ED00_0003;
/// Prompt bytes keyed at most: the leading chunks carry the shared prefix,
/// and it bounds the request's work and the index's growth.
pub const MAX_BYTES: u64 = (CHUNK_BYTES * MAX_CHUNKS) as u64;

/// The index namespace of a model's text prefix keys.
pub fn index_key(model: &str) -> String {
    format!("~text~{model}")
}

const TEMPLATE_NAMESPACE: &str = "~template~";

/// The namespace whose shard 0 holds a model's [`template::PromptTemplate`].
pub fn template_key(model: &str) -> String {
    format!("{TEMPLATE_NAMESPACE}{model}")
}

/// Whether an update's namespace carries a template blob rather than an
/// index shard (readers validate each by its own format).
pub fn is_template_namespace(namespace: &str) -> bool {
    namespace.starts_with(TEMPLATE_NAMESPACE)
}

/// Where hashing stands after a prefix: all the sidecar keeps per block.
///
/// The hash takes the text eight bytes at a time, aligned to the prompt's
/// start; `tail` holds the bytes of an unfinished word, so a block may end
/// anywhere. Chunk boundaries fall on word boundaries (256 is a multiple of
/// 8), where the tail is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    state: u64,
    tail: u64,
    offset: u64,
}

/// Mixes one little-endian word into the state: a multiply spreads low
/// bits up, the shift brings high bits down, so every input bit reaches
/// the whole state within two words.
#[inline(always)]
fn mix(state: u64, word: u64) -> u64 {
    let x = (state ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

impl Cursor {
    /// The start of a prompt in `scope`: an adapter or a salt starts the
    /// register elsewhere, so their keys never meet another scope's.
    pub fn root(scope: CacheScope<'_>) -> Cursor {
        let state = if scope.lora_name.is_none() && scope.cache_salt.is_none() {
            SEED
        } else {
            // Each part length-prefixed, so ("ab", "c") and ("a", "bc") differ.
            let mut key = Vec::new();
            for part in [scope.lora_name, scope.cache_salt] {
                let b = part.unwrap_or_default().as_bytes();
                key.extend_from_slice(&(b.len() as u64).to_le_bytes());
                key.extend_from_slice(b);
            }
            xxh3_64_with_seed(&key, SEED) | 1
        };
        Cursor {
            state,
            tail: 0,
            offset: 0,
        }
    }

    /// Bytes fed so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Whether feeding more can still produce keys.
    pub fn open(&self) -> bool {
        self.offset < MAX_BYTES
    }

    /// Feeds `bytes`, pushing the key of every chunk boundary they reach.
    pub fn feed(&mut self, mut bytes: &[u8], keys: &mut Vec<u64>) {
        while !bytes.is_empty() && self.open() {
            let to_boundary = CHUNK_BYTES - (self.offset % CHUNK_BYTES as u64) as usize;
            let n = to_boundary.min(bytes.len());
            self.absorb(&bytes[..n]);
            bytes = &bytes[n..];
            if n == to_boundary {
                keys.push(self.key());
            }
        }
        self.offset += bytes.len() as u64;
    }

    fn absorb(&mut self, mut bytes: &[u8]) {
        // Finish the word a previous block left unfinished.
        let mut used = (self.offset % 8) as usize;
        while used != 0 && !bytes.is_empty() {
            self.tail |= u64::from(bytes[0]) << (8 * used);
            bytes = &bytes[1..];
            self.offset += 1;
            used = (used + 1) % 8;
            if used == 0 {
                self.state = mix(self.state, self.tail);
                self.tail = 0;
            }
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            self.state = mix(self.state, u64::from_le_bytes(b));
        }
        self.offset += (bytes.len() - words.remainder().len()) as u64;
        for (i, &b) in words.remainder().iter().enumerate() {
            self.tail |= u64::from(b) << (8 * i);
        }
        self.offset += words.remainder().len() as u64;
    }

    fn key(&self) -> u64 {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.state.to_le_bytes());
        b[8..].copy_from_slice(&self.offset.to_le_bytes());
        crate::hash::xxh3(&b, SEED)
    }
}

/// The prefix keys of a rendered prompt in `scope`, one per full chunk.
pub fn prefix_keys(text: &str, scope: CacheScope<'_>) -> Vec<u64> {
    let mut keys = Vec::with_capacity((text.len() / CHUNK_BYTES).min(MAX_CHUNKS));
    Cursor::root(scope).feed(text.as_bytes(), &mut keys);
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(n: usize) -> String {
        (0..n)
            .map(|i| char::from(b'a' + (i * 7 % 26) as u8))
            .collect()
    }

    #[test]
    fn one_key_per_full_chunk_and_prefixes_share_keys() {
        let t = text(1000);
        let k = prefix_keys(&t, CacheScope::default());
        assert_eq!(k.len(), 1000 / CHUNK_BYTES);
        let longer = format!("{t}and more text after it, of any length");
        assert_eq!(prefix_keys(&longer, CacheScope::default())[..k.len()], k);
        let mut other = t.clone().into_bytes();
        other[300] ^= 1;
        let o = prefix_keys(std::str::from_utf8(&other).unwrap(), CacheScope::default());
        assert_eq!(o[0], k[0], "the first chunk is unchanged");
        assert_ne!(o[1..], k[1..], "every key after a change differs");
    }

    #[test]
    fn blocks_ending_anywhere_give_the_prompts_keys() {
        let t = text(3000);
        let whole = prefix_keys(&t, CacheScope::default());
        for step in [1, 5, 64, 100, 255, 256, 257, 1024] {
            let mut c = Cursor::root(CacheScope::default());
            let mut keys = Vec::new();
            for block in t.as_bytes().chunks(step) {
                c.feed(block, &mut keys);
            }
            assert_eq!(keys, whole, "blocks of {step} bytes");
            assert_eq!(c.offset(), 3000);
        }
    }

    #[test]
    fn scopes_never_share_keys() {
        let t = text(600);
        let plain = prefix_keys(&t, CacheScope::default());
        let lora = CacheScope {
            lora_name: Some("a"),
            cache_salt: None,
        };
        let salt = CacheScope {
            lora_name: None,
            cache_salt: Some("a"),
        };
        let (l, s) = (prefix_keys(&t, lora), prefix_keys(&t, salt));
        assert!(plain.iter().all(|k| !l.contains(k) && !s.contains(k)));
        assert!(l.iter().all(|k| !s.contains(k)));
    }

    #[test]
    fn keys_stop_at_the_bound() {
        let t = text(MAX_BYTES as usize + 5000);
        assert_eq!(prefix_keys(&t, CacheScope::default()).len(), MAX_CHUNKS);
        let mut c = Cursor::root(CacheScope::default());
        let mut keys = Vec::new();
        c.feed(t.as_bytes(), &mut keys);
        assert!(!c.open());
        assert_eq!(c.offset(), t.len() as u64);
    }
}
