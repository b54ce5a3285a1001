//! Block and sequence hashing, compatible with NVIDIA Dynamo's KV router.
//!
//! A prompt's token ids are cut into full blocks of the worker's block size
//! (a trailing partial block is never hashed, because engines only cache full
//! blocks). Each block is XXH3-64 with seed 1337 over its tokens written as
//! little-endian `u32`; the sequence hash of block `i` chains the sequence
//! hash of block `i - 1` with the block's own hash, so equal sequence hashes
//! mean equal prefixes. Matching Dynamo bit for bit lets block and sequence
//! hashes flow between kvgate's selection API and Dynamo-speaking clients.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The seed Dynamo uses for every kv-router hash.
pub const XXH3_SEED: u64 = 1337;

/// Seed for a LoRA adapter's blocks: the base seed shifted by the adapter
/// name's hash, so identical tokens under different adapters never collide.
pub fn lora_seed(lora_name: Option<&str>) -> u64 {
    match lora_name {
        Some(name) if !name.is_empty() => XXH3_SEED.wrapping_add(xxh3_64(name.as_bytes())),
        _ => XXH3_SEED,
    }
}

/// Hash of one block's tokens with the given seed.
pub fn block_hash_with_seed(tokens: &[u32], seed: u64) -> u64 {
    // On little-endian targets (x86_64, aarch64, wasm32) a token slice already
    // is its little-endian byte string: hash it in place. This is the hottest
    // line of event ingest and of per-request hashing.
    #[cfg(target_endian = "little")]
    {
        xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let mut bytes = Vec::with_capacity(tokens.len() * 4);
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&bytes, seed)
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
            xxh3_64_with_seed(&buf, XXH3_SEED)
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

    const VEC_1234: u64 = 14643705804678351452;
    const VEC_EMPTY: u64 = 15128690059815094969;
    const VEC_16: u64 = 2926740542014778476;
    const VEC_SEQ2: u64 = 4945711292740353085;
}
