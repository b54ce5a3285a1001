//! Approximate prefix matching, for requests the engines' KV events cannot
//! describe: text prompts (kvgate does not tokenize) and models whose
//! workers publish no events.
//!
//! The prompt text is cut into fixed-size chunks, each keyed by its whole
//! prefix ([`crate::text::prefix_keys`], as the text index keys them),
//! and kvgate *learns* which rank holds which chunks from its own routing
//! decisions: after routing, the filter reports (model, slot,
//! chunk hashes); the sidecar remembers them for a TTL and publishes them as
//! index shards under [`model_key`], which the filter reads exactly like the
//! precise index. This is how SGLang's router and the Gateway API Inference
//! Extension's approximate prefix scorer work.

use crate::wire::{Reader, WireError};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes of prompt text per chunk (about 64 tokens of English).
pub const CHUNK_BYTES: usize = 256;
/// Tokens a chunk stands for, at about four bytes per token: converts
/// chunk overlap into the block units the cost counts in.
pub const CHUNK_TOKENS: u32 = (CHUNK_BYTES / 4) as u32;
/// Shards of every model's approximate index.
pub const SHARDS: u32 = 4096;
/// Chunks a request reports at most: bounds queue and index growth from
/// very long prompts (the leading chunks carry the shared prefix anyway).
pub const MAX_CHUNKS: usize = 256;

/// The index namespace of a model's approximate entries.
pub fn model_key(model: &str) -> String {
    format!("~approx~{model}")
}

/// Seeds the hash that moves token chunks into a cache scope.
const SCOPE_SEED: u64 = 1337 ^ 0xA99A_0C5E_ED00_0001;
/// Keeps token chunks apart from text chunks of the same bytes.
const TOKEN_SEED: u64 = 1337 ^ 0x70CE_0C5E_ED00_0002;

/// Chained hashes of the full `CHUNK_TOKENS`-token chunks of a token
/// prompt, in the same units as text chunks: a token request's routing
/// decision goes into the same index, so requests that follow it before
/// the engine's KV events do still find its prefix.
pub fn token_chunk_hashes(tokens: &[u32]) -> Vec<u64> {
    let n = CHUNK_TOKENS as usize;
    let mut out = Vec::with_capacity((tokens.len() / n).min(MAX_CHUNKS));
    let mut buf = Vec::with_capacity(8 + 4 * n);
    let mut parent = 0u64;
    for chunk in tokens.chunks_exact(n).take(MAX_CHUNKS) {
        buf.clear();
        buf.extend_from_slice(&parent.to_le_bytes());
        // On little-endian targets (all kvgate runs on) the ids already
        // are their little-endian bytes: one copy, not one per token.
        #[cfg(target_endian = "little")]
        buf.extend_from_slice(bytemuck::cast_slice(chunk));
        #[cfg(not(target_endian = "little"))]
        for t in chunk {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        parent = xxh3_64_with_seed(&buf, TOKEN_SEED);
        out.push(parent);
    }
    out
}

/// Moves a token prompt's chunk hashes into the cache scope of its LoRA
/// adapter and `cache_salt` (see [`crate::hash::CacheScope`]): the engine
/// shares no KV blocks across adapters or salts, so a routed prefix must
/// not draw a request of another scope either. The unscoped chunks are
/// unchanged. (Text chunks are prefix keys, scoped where they start.)
pub fn scope_chunks(chunks: &mut [u64], scope: crate::hash::CacheScope<'_>) {
    if scope.lora_name.is_none() && scope.cache_salt.is_none() {
        return;
    }
    // Each part length-prefixed, so ("ab", "c") and ("a", "bc") differ.
    let mut key = Vec::new();
    for part in [scope.lora_name, scope.cache_salt] {
        let b = part.unwrap_or_default().as_bytes();
        key.extend_from_slice(&(b.len() as u64).to_le_bytes());
        key.extend_from_slice(b);
    }
    let seed = xxh3_64_with_seed(&key, SCOPE_SEED);
    for c in chunks {
        *c = xxh3_64_with_seed(&c.to_le_bytes(), seed);
    }
}

/// What a routing decision's chunks were cut from. The sidecar keeps them
/// for different times: a text prefix is all kvgate will ever know of a
/// text prompt, while a token prefix only bridges the moments until the
/// engine's own KV events report the blocks. A text prompt rendered with
/// its model's template ([`crate::text`]) is reported as `Tokens`: its
/// events will be matched too, so it needs only the bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkKind {
    Text = 0,
    Tokens = 1,
}

/// One routing decision, as reported to the sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    pub model: String,
    pub slot: u16,
    pub kind: ChunkKind,
    pub hashes: Vec<u64>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RoutedError {
    #[error("routed record {0}")]
    Wire(#[from] WireError),
    #[error("routed record has unknown chunk kind {0}")]
    UnknownKind(u8),
}

impl Routed {
    /// `u16 model_len, model, u16 slot, u8 kind, u32 n, n × u64`,
    /// little-endian.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let name = &self.model.as_bytes()[..self.model.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(&(self.hashes.len() as u32).to_le_bytes());
        for h in &self.hashes {
            out.extend_from_slice(&h.to_le_bytes());
        }
    }

    /// Decodes a concatenation of records.
    pub fn decode_all(b: &[u8]) -> Result<Vec<Routed>, RoutedError> {
        let mut r = Reader::new(b);
        let mut out = Vec::new();
        while !r.is_empty() {
            let model = r.string16()?;
            let slot = r.u16()?;
            let kind = match r.u8()? {
                0 => ChunkKind::Text,
                1 => ChunkKind::Tokens,
                k => return Err(RoutedError::UnknownKind(k)),
            };
            let n = r.u32()?;
            r.plausible(n, 8, "chunk hashes")?;
            let hashes = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
            out.push(Routed {
                model,
                slot,
                kind,
                hashes,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_keep_routed_prefixes_apart() {
        use crate::hash::CacheScope;
        let tokens: Vec<u32> = (0..CHUNK_TOKENS * 3).collect();
        let base = token_chunk_hashes(&tokens);
        let scoped = |lora, salt| {
            let mut c = token_chunk_hashes(&tokens);
            scope_chunks(
                &mut c,
                CacheScope {
                    lora_name: lora,
                    cache_salt: salt,
                },
            );
            c
        };
        assert_eq!(scoped(None, None), base);
        let lora = scoped(Some("sql-lora"), None);
        let salt = scoped(None, Some("sql-lora"));
        for i in 0..base.len() {
            assert_ne!(lora[i], base[i]);
            assert_ne!(salt[i], base[i]);
            assert_ne!(lora[i], salt[i], "an adapter and an equal salt differ");
        }
        assert_eq!(lora, scoped(Some("sql-lora"), None));
    }

    #[test]
    fn token_chunks_chain_share_prefixes_and_differ_from_text() {
        let a: Vec<u32> = (0..200).collect();
        let mut b = a.clone();
        b[150] = 9;
        let (ha, hb) = (token_chunk_hashes(&a), token_chunk_hashes(&b));
        assert_eq!(ha.len(), 3, "only full 64-token chunks");
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        let bytes: String = a
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .map(char::from)
            .collect();
        let text = crate::text::prefix_keys(&bytes, crate::hash::CacheScope::default());
        assert!(text.iter().all(|h| !ha.contains(h)));
    }

    // The sidecar keeps these hashes across versions (dumps, peers): the
    // chain is the parent's and the ids' little-endian bytes, restated
    // here rather than through the function.
    #[test]
    fn a_token_chunk_hashes_its_parent_and_its_ids_little_endian() {
        let ids: Vec<u32> = (0..2 * CHUNK_TOKENS).map(|i| i * 65_537 + 3).collect();
        let mut parent = 0u64;
        for (chunk, got) in ids
            .chunks(CHUNK_TOKENS as usize)
            .zip(token_chunk_hashes(&ids))
        {
            let mut bytes = parent.to_le_bytes().to_vec();
            bytes.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
            parent = xxh3_64_with_seed(&bytes, TOKEN_SEED);
            assert_eq!(got, parent);
        }
    }

    #[test]
    fn routed_records_round_trip_and_reject_truncation() {
        let rs = vec![
            Routed {
                model: "m".into(),
                slot: 3,
                kind: ChunkKind::Tokens,
                hashes: vec![1, u64::MAX],
            },
            Routed {
                model: "other".into(),
                slot: 0,
                kind: ChunkKind::Text,
                hashes: vec![],
            },
        ];
        let mut b = Vec::new();
        for r in &rs {
            r.encode_into(&mut b);
        }
        assert_eq!(Routed::decode_all(&b).unwrap(), rs);
        for cut in 1..b.len() {
            let _ = Routed::decode_all(&b[..cut]);
        }
        assert!(matches!(
            Routed::decode_all(&b[..b.len() - 1]),
            Err(RoutedError::Wire(WireError::Truncated { .. }))
        ));
        let mut huge = b.clone();
        huge[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Routed::decode_all(&huge),
            Err(RoutedError::Wire(WireError::ImplausibleCount { .. }))
        ));
        let mut odd = b.clone();
        odd[5] = 7;
        assert_eq!(Routed::decode_all(&odd), Err(RoutedError::UnknownKind(7)));
    }
}
