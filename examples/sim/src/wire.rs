//! KV events in vLLM's wire format, written byte for byte as the engines'
//! msgspec encoders write them (see docs/kv-events.md).
//!
//! A batch is `[ts: float64, [events...], data_parallel_rank: int]`. Events
//! are either tagged maps (vLLM ≥ 0.26, SGLang ≥ 0.5.23) or positional
//! arrays (vLLM ≤ 0.23). Engine block hashes go out as uint64 (vLLM's
//! default), as signed int64 (SGLang), or as 32-byte binary digests (vLLM's
//! bytes mode).

use crate::cache::{CacheEvent, Scope};
use rmp::encode;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EventShape {
    /// `{"type": "BlockStored", ...}` maps, as vLLM 0.33 publishes.
    Tagged,
    /// `["BlockStored", ...]` arrays, as vLLM up to 0.23 published.
    Positional,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HashMode {
    /// uint64, vLLM's default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).
    U64,
    /// int64 reinterpretation, possibly negative, as SGLang publishes.
    I64,
    /// 32-byte binary digest, vLLM's bytes mode.
    Bytes,
}

/// An event as the publisher sees it (cache events plus a full clear).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimEvent {
    Cache(CacheEvent),
    AllCleared,
}

// Writes into a Vec<u8> cannot fail; rmp's error type exists for fallible
// writers. Ignoring it here keeps the encoder free of unwraps.
fn w<T, E>(r: Result<T, E>) {
    let _ = r;
}

fn write_hash(out: &mut Vec<u8>, h: u64, mode: HashMode) {
    match mode {
        HashMode::U64 => w(encode::write_uint(out, h)),
        HashMode::I64 => w(encode::write_sint(out, h as i64)),
        HashMode::Bytes => {
            // A deterministic 32-byte digest derived from the hash.
            let mut d = [0u8; 32];
            for (i, chunk) in d.chunks_exact_mut(8).enumerate() {
                chunk.copy_from_slice(&(h.rotate_left(i as u32 * 16) ^ i as u64).to_be_bytes());
            }
            w(encode::write_bin(out, &d));
        }
    }
}

fn write_hashes(out: &mut Vec<u8>, hs: &[u64], mode: HashMode) {
    w(encode::write_array_len(out, hs.len() as u32));
    for h in hs {
        write_hash(out, *h, mode);
    }
}

fn write_opt_hash(out: &mut Vec<u8>, h: Option<u64>, mode: HashMode) {
    match h {
        Some(h) => write_hash(out, h, mode),
        None => w(encode::write_nil(out)),
    }
}

fn write_tokens(out: &mut Vec<u8>, t: &[u32]) {
    w(encode::write_array_len(out, t.len() as u32));
    for x in t {
        w(encode::write_uint(out, *x as u64));
    }
}

fn write_opt_str(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(v) => w(encode::write_str(out, v)),
        None => w(encode::write_nil(out)),
    }
}

fn has_extra_keys(scope: &Scope) -> bool {
    scope.lora_name.is_some() || scope.cache_salt.is_some()
}

/// vLLM's `extra_keys`: per block, the typed keys that entered its hash —
/// the adapter on every block, the salt on the chain's first.
fn write_extra_keys(out: &mut Vec<u8>, scope: &Scope, blocks: usize) {
    w(encode::write_array_len(out, blocks as u32));
    for block in 0..blocks {
        let mut keys = Vec::new();
        if let Some(name) = &scope.lora_name {
            keys.push(("lora", "name", name));
        }
        if let Some(salt) = scope.cache_salt.as_ref().filter(|_| block == 0) {
            keys.push(("cache_salt", "salt", salt));
        }
        if keys.is_empty() {
            w(encode::write_nil(out));
            continue;
        }
        w(encode::write_array_len(out, keys.len() as u32));
        for (kind, field, value) in keys {
            w(encode::write_map_len(out, 2));
            w(encode::write_str(out, "type"));
            w(encode::write_str(out, kind));
            w(encode::write_str(out, field));
            w(encode::write_str(out, value));
        }
    }
}

fn write_event(
    out: &mut Vec<u8>,
    ev: &SimEvent,
    block_size: u32,
    shape: EventShape,
    mode: HashMode,
) {
    match (ev, shape) {
        (
            SimEvent::Cache(CacheEvent::Stored {
                hashes,
                parent,
                tokens,
                scope,
            }),
            EventShape::Tagged,
        ) => {
            let extra = has_extra_keys(scope);
            w(encode::write_map_len(out, 8 + u32::from(extra)));
            w(encode::write_str(out, "type"));
            w(encode::write_str(out, "BlockStored"));
            w(encode::write_str(out, "block_hashes"));
            write_hashes(out, hashes, mode);
            w(encode::write_str(out, "parent_block_hash"));
            write_opt_hash(out, *parent, mode);
            w(encode::write_str(out, "token_ids"));
            write_tokens(out, tokens);
            w(encode::write_str(out, "block_size"));
            w(encode::write_uint(out, block_size as u64));
            w(encode::write_str(out, "lora_id"));
            w(encode::write_nil(out));
            w(encode::write_str(out, "medium"));
            w(encode::write_str(out, "GPU"));
            w(encode::write_str(out, "lora_name"));
            write_opt_str(out, scope.lora_name.as_deref());
            if extra {
                w(encode::write_str(out, "extra_keys"));
                write_extra_keys(out, scope, hashes.len());
            }
        }
        (
            SimEvent::Cache(CacheEvent::Stored {
                hashes,
                parent,
                tokens,
                scope,
            }),
            EventShape::Positional,
        ) => {
            // lora_name has no default, so it is always present; later
            // defaulted fields are trimmed by omit_defaults.
            let extra = has_extra_keys(scope);
            w(encode::write_array_len(out, 8 + u32::from(extra)));
            w(encode::write_str(out, "BlockStored"));
            write_hashes(out, hashes, mode);
            write_opt_hash(out, *parent, mode);
            write_tokens(out, tokens);
            w(encode::write_uint(out, block_size as u64));
            w(encode::write_nil(out));
            w(encode::write_str(out, "GPU"));
            write_opt_str(out, scope.lora_name.as_deref());
            if extra {
                write_extra_keys(out, scope, hashes.len());
            }
        }
        (SimEvent::Cache(CacheEvent::Removed { hashes }), EventShape::Tagged) => {
            w(encode::write_map_len(out, 3));
            w(encode::write_str(out, "type"));
            w(encode::write_str(out, "BlockRemoved"));
            w(encode::write_str(out, "block_hashes"));
            write_hashes(out, hashes, mode);
            w(encode::write_str(out, "medium"));
            w(encode::write_str(out, "GPU"));
        }
        (SimEvent::Cache(CacheEvent::Removed { hashes }), EventShape::Positional) => {
            w(encode::write_array_len(out, 3));
            w(encode::write_str(out, "BlockRemoved"));
            write_hashes(out, hashes, mode);
            w(encode::write_str(out, "GPU"));
        }
        (SimEvent::AllCleared, EventShape::Tagged) => {
            w(encode::write_map_len(out, 1));
            w(encode::write_str(out, "type"));
            w(encode::write_str(out, "AllBlocksCleared"));
        }
        (SimEvent::AllCleared, EventShape::Positional) => {
            w(encode::write_array_len(out, 1));
            w(encode::write_str(out, "AllBlocksCleared"));
        }
    }
}

/// Encodes one batch.
pub fn encode_batch(
    ts: f64,
    events: &[SimEvent],
    rank: u32,
    block_size: u32,
    shape: EventShape,
    mode: HashMode,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    w(encode::write_array_len(&mut out, 3));
    w(encode::write_f64(&mut out, ts));
    w(encode::write_array_len(&mut out, events.len() as u32));
    for e in events {
        write_event(&mut out, e, block_size, shape, mode);
    }
    w(encode::write_uint(&mut out, rank as u64));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn decode(b: &[u8]) -> Value {
        rmpv::decode::read_value(&mut &b[..]).unwrap()
    }

    fn stored() -> SimEvent {
        SimEvent::Cache(CacheEvent::Stored {
            hashes: vec![u64::MAX - 5, 2],
            parent: None,
            tokens: vec![1, 2, 3, 4, 300, 70000, 7, 8],
            scope: Scope::default(),
        })
    }

    #[test]
    fn adapters_and_salts_are_named_as_vllm_names_them() {
        let scoped = SimEvent::Cache(CacheEvent::Stored {
            hashes: vec![1, 2],
            parent: None,
            tokens: (0..8).collect(),
            scope: Scope {
                lora_name: Some("sql".into()),
                cache_salt: Some("s".into()),
            },
        });
        let key = |kind: &str, field: &str, v: &str| {
            Value::Map(vec![("type".into(), kind.into()), (field.into(), v.into())])
        };
        let lora = key("lora", "name", "sql");
        let want_extra = Value::Array(vec![
            Value::Array(vec![lora.clone(), key("cache_salt", "salt", "s")]),
            Value::Array(vec![lora]),
        ]);
        let b = encode_batch(
            0.0,
            std::slice::from_ref(&scoped),
            0,
            4,
            EventShape::Tagged,
            HashMode::U64,
        );
        let v = decode(&b);
        let ev = &v.as_array().unwrap()[1].as_array().unwrap()[0];
        let field = |k: &str| {
            ev.as_map()
                .unwrap()
                .iter()
                .find(|(key, _)| key.as_str() == Some(k))
                .map(|(_, v)| v.clone())
        };
        assert_eq!(field("lora_name"), Some("sql".into()));
        assert_eq!(field("extra_keys"), Some(want_extra.clone()));
        let b = encode_batch(0.0, &[scoped], 0, 4, EventShape::Positional, HashMode::U64);
        let v = decode(&b);
        let ev = v.as_array().unwrap()[1].as_array().unwrap()[0]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!((ev.len(), &ev[7], &ev[8]), (9, &"sql".into(), &want_extra));
    }

    #[test]
    fn tagged_batch_matches_vllm_0_33() {
        let b = encode_batch(1.5, &[stored()], 1, 4, EventShape::Tagged, HashMode::U64);
        let v = decode(&b);
        let arr = v.as_array().unwrap();
        assert_eq!(arr[0], Value::F64(1.5));
        assert_eq!(arr[2], Value::from(1));
        let ev = arr[1].as_array().unwrap()[0].as_map().unwrap();
        let keys: Vec<&str> = ev.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        assert_eq!(
            keys,
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name"
            ]
        );
        assert_eq!(ev[0].1, Value::from("BlockStored"));
        assert_eq!(
            ev[1].1,
            Value::Array(vec![Value::from(u64::MAX - 5), Value::from(2)])
        );
        assert_eq!(ev[2].1, Value::Nil);
        // msgspec writes floats as float64 (0xcb) and the smallest int forms.
        assert_eq!(b[1], 0xcb);
    }

    #[test]
    fn positional_batch_matches_vllm_0_23() {
        let b = encode_batch(
            2.0,
            &[
                stored(),
                SimEvent::Cache(CacheEvent::Removed { hashes: vec![7] }),
                SimEvent::AllCleared,
            ],
            0,
            4,
            EventShape::Positional,
            HashMode::U64,
        );
        let v = decode(&b);
        let evs = v.as_array().unwrap()[1].as_array().unwrap();
        let s = evs[0].as_array().unwrap();
        assert_eq!(s.len(), 8);
        assert_eq!(s[0], Value::from("BlockStored"));
        assert_eq!(s[4], Value::from(4));
        assert_eq!(s[6], Value::from("GPU"));
        assert_eq!(
            evs[1],
            Value::Array(vec![
                "BlockRemoved".into(),
                Value::Array(vec![7.into()]),
                "GPU".into()
            ])
        );
        assert_eq!(evs[2], Value::Array(vec!["AllBlocksCleared".into()]));
    }

    #[test]
    fn hash_modes() {
        let ev = [SimEvent::Cache(CacheEvent::Removed {
            hashes: vec![u64::MAX],
        })];
        let hash = |mode| {
            let v = decode(&encode_batch(0.0, &ev, 0, 4, EventShape::Tagged, mode));
            v.as_array().unwrap()[1].as_array().unwrap()[0]
                .as_map()
                .unwrap()[1]
                .1
                .as_array()
                .unwrap()[0]
                .clone()
        };
        assert_eq!(hash(HashMode::U64), Value::from(u64::MAX));
        assert_eq!(hash(HashMode::I64), Value::from(-1i64));
        assert!(matches!(hash(HashMode::Bytes), Value::Binary(b) if b.len() == 32));
    }
}
