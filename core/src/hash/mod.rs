//! Block and sequence hashing, compatible with NVIDIA Dynamo's KV router.
//!
//! A prompt's token ids are cut into full blocks of the worker's block size
//! (a trailing partial block is never hashed, because engines only cache full
//! blocks). Each block is XXH3-64 with seed 1337 over its tokens written as
//! little-endian `u32`; the sequence hash of block `i` chains the sequence
//! hash of block `i - 1` with the block's own hash, so equal sequence hashes
//! mean equal prefixes. Matching Dynamo bit for bit lets block and sequence
//! hashes flow between kvgate's selection API and Dynamo-speaking clients.

#[cfg(any(test, target_arch = "wasm32"))]
mod narrow;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The seed Dynamo uses for every kv-router hash.
pub const XXH3_SEED: u64 = 1337;

/// XXH3-64 of `bytes` with `seed`. In the filter a block or a chain link
/// is hashed without 128-bit multiplies, which WebAssembly lacks.
pub(crate) fn xxh3(bytes: &[u8], seed: u64) -> u64 {
    #[cfg(target_arch = "wasm32")]
    match bytes.len() {
        16 => return narrow::sixteen(bytes, seed),
        17..=128 => return narrow::upto128(bytes, seed),
        _ => {}
    }
    xxh3_64_with_seed(bytes, seed)
}

/// Seed for a LoRA adapter's blocks: the base seed shifted by the adapter
/// name's hash, so identical tokens under different adapters never collide.
pub fn lora_seed(lora_name: Option<&str>) -> u64 {
    match lora_name {
        Some(name) if !name.is_empty() => XXH3_SEED.wrapping_add(xxh3_64(name.as_bytes())),
        _ => XXH3_SEED,
    }
}

/// Seed of the hash that mixes a `cache_salt` into a chain's first block;
/// distinct from [`XXH3_SEED`] so a salted root can never equal an unsalted
/// block hash by construction of the input alone.
const SALT_SEED: u64 = XXH3_SEED ^ 0x6b76_6761_7465_5f73;

/// The first block's local hash under a `cache_salt`.
///
/// vLLM folds the salt into the first block's hash only, and every later
/// block inherits it through the chain; kvgate does the same on its own
/// hashes, so a salted prompt shares nothing with the same tokens unsalted
/// (or salted differently), while chains without a salt keep Dynamo's
/// values bit for bit. An empty salt is no salt (vLLM refuses one).
pub fn salted_root(local: u64, salt: &str) -> u64 {
    if salt.is_empty() {
        return local;
    }
    let mut buf = Vec::with_capacity(8 + salt.len());
    buf.extend_from_slice(&local.to_le_bytes());
    buf.extend_from_slice(salt.as_bytes());
    xxh3_64_with_seed(&buf, SALT_SEED)
}

/// What, besides its tokens, decides which cached blocks a prompt may
/// reuse: the LoRA adapter (the hash seed, Dynamo's rule) and the
/// `cache_salt` (mixed into the first block). The sidecar keys engine
/// events and the filter keys requests with these same rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheScope<'a> {
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
}

/// Sequence hashes of every full block of a prompt in `scope`.
pub fn scoped_sequence_hashes(
    tokens: &[u32],
    block_size: usize,
    scope: CacheScope<'_>,
) -> Vec<u64> {
    let mut local = block_hashes(tokens, block_size, lora_seed(scope.lora_name));
    if let (Some(first), Some(salt)) = (local.first_mut(), scope.cache_salt) {
        *first = salted_root(*first, salt);
    }
    sequence_hashes(&local)
}

/// Hash of one block's tokens with the given seed.
pub fn block_hash_with_seed(tokens: &[u32], seed: u64) -> u64 {
    // On little-endian targets (x86_64, aarch64, wasm32) a token slice already
    // is its little-endian byte string: hash it in place. This is the hottest
    // line of event ingest and of per-request hashing.
    #[cfg(target_endian = "little")]
    {
        xxh3(bytemuck::cast_slice(tokens), seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let mut bytes = Vec::with_capacity(tokens.len() * 4);
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        xxh3(&bytes, seed)
    }
}

/// Hash of one block's tokens with Dynamo's default seed.
pub fn block_hash(tokens: &[u32]) -> u64 {
    block_hash_with_seed(tokens, XXH3_SEED)
}

/// Local block hashes of every full block of `tokens`.
///
/// A `block_size` of zero yields no blocks rather than dividing by zero.
pub fn block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    tokens
        .chunks_exact(block_size)
        .map(|block| block_hash_with_seed(block, seed))
        .collect()
}

/// Chains one more block onto a sequence: `parent` is the sequence hash of
/// the previous block, or `None` for the first block.
pub fn chain(parent: Option<u64>, local: u64) -> u64 {
    match parent {
        None => local,
        Some(parent) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&parent.to_le_bytes());
            buf[8..].copy_from_slice(&local.to_le_bytes());
            xxh3(&buf, XXH3_SEED)
        }
    }
}

/// Sequence hashes for a run of local block hashes starting at the root.
pub fn sequence_hashes(local: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(local.len());
    let mut parent = None;
    for &h in local {
        let s = chain(parent, h);
        out.push(s);
        parent = Some(s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors computed independently with the Python `xxhash` package
    // (xxh3_64_intdigest over the little-endian token bytes, seed 1337), so a
    // change in byte order, seed or chaining shows up here.
    #[test]
    fn block_hash_matches_independent_vectors() {
        assert_eq!(block_hash(&[1, 2, 3, 4]), VEC_1234);
        assert_eq!(block_hash(&[]), VEC_EMPTY);
        let big: Vec<u32> = (0..16).map(|i| i * 1000 + 7).collect();
        assert_eq!(block_hash(&big), VEC_16);
    }

    #[test]
    fn sequence_hash_chains_little_endian_pairs() {
        let local = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, XXH3_SEED);
        assert_eq!(local.len(), 2, "the trailing partial block is not hashed");
        let seq = sequence_hashes(&local);
        assert_eq!(seq[0], local[0]);
        assert_eq!(seq[1], VEC_SEQ2);
    }

    #[test]
    fn lora_changes_the_seed() {
        assert_eq!(lora_seed(None), XXH3_SEED);
        assert_eq!(lora_seed(Some("")), XXH3_SEED);
        let s = lora_seed(Some("adapter-a"));
        assert_ne!(s, XXH3_SEED);
        assert_ne!(
            block_hash_with_seed(&[1, 2, 3, 4], s),
            block_hash(&[1, 2, 3, 4])
        );
    }

    #[test]
    fn hashing_in_place_equals_hashing_le_bytes() {
        let tokens: Vec<u32> = (0..1024).collect();
        let mut bytes = Vec::new();
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(block_hash(&tokens), xxh3_64_with_seed(&bytes, XXH3_SEED));
    }

    #[test]
    fn zero_block_size_yields_nothing() {
        assert!(block_hashes(&[1, 2, 3], 0, XXH3_SEED).is_empty());
    }

    // Dynamo's LoRA seed, restated from its definition rather than through
    // `lora_seed`, so a change of formula fails here.
    #[test]
    fn adapter_seed_is_dynamos() {
        let name = "sql-lora";
        let dynamo = 1337u64.wrapping_add(xxhash_rust::xxh3::xxh3_64(name.as_bytes()));
        assert_eq!(lora_seed(Some(name)), dynamo);
        let tokens: Vec<u32> = (0..8).collect();
        let scope = CacheScope {
            lora_name: Some(name),
            cache_salt: None,
        };
        let mut bytes = Vec::new();
        for t in &tokens[..4] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let seq = scoped_sequence_hashes(&tokens, 4, scope);
        assert_eq!(seq[0], xxh3_64_with_seed(&bytes, dynamo));
        assert_ne!(
            seq,
            scoped_sequence_hashes(&tokens, 4, CacheScope::default()),
            "an adapter's blocks never equal the base model's"
        );
    }

    #[test]
    fn salt_changes_only_the_chains_that_carry_it() {
        let tokens: Vec<u32> = (0..12).collect();
        let base = sequence_hashes(&block_hashes(&tokens, 4, XXH3_SEED));
        assert_eq!(
            scoped_sequence_hashes(&tokens, 4, CacheScope::default()),
            base,
            "no salt, no adapter: Dynamo's hashes unchanged"
        );
        let salt = |s| CacheScope {
            lora_name: None,
            cache_salt: Some(s),
        };
        let a = scoped_sequence_hashes(&tokens, 4, salt("tenant-a"));
        let b = scoped_sequence_hashes(&tokens, 4, salt("tenant-b"));
        for i in 0..3 {
            assert_ne!(a[i], base[i], "block {i} salted equals unsalted");
            assert_ne!(a[i], b[i], "block {i} equal under two salts");
        }
        assert_eq!(a, scoped_sequence_hashes(&tokens, 4, salt("tenant-a")));
        assert_eq!(scoped_sequence_hashes(&tokens, 4, salt("")), base);
        // The salt enters once, at the root: a later block's local hash is
        // unsalted, and the chain alone carries the salt onward.
        let local = block_hashes(&tokens, 4, XXH3_SEED);
        assert_eq!(a[0], salted_root(local[0], "tenant-a"));
        assert_eq!(a[1], chain(Some(a[0]), local[1]));
    }

    const VEC_1234: u64 = 14643705804678351452;
    const VEC_EMPTY: u64 = 15128690059815094969;
    const VEC_16: u64 = 2926740542014778476;
    const VEC_SEQ2: u64 = 4945711292740353085;
}
