//! Prefix overlap per slot, read from the index shards.
//!
//! The request's token ids are hashed exactly as the sidecar hashes engine
//! events ([`crate::hash`]), per block size in use by the model's workers.
//! Then [`crate::shard::overlaps`] searches the chain, reading a shard only
//! when the search asks for a position in it; a shard read twice in one
//! request is read once.

use super::request::Parsed;
use super::select::Overlap;
use crate::approx::{self, ChunkKind};
use crate::hash::{CacheScope, scoped_sequence_hashes};
use crate::shard::{ShardView, SlotOverlap, overlaps, shard_of};
use crate::state::{ModelState, WorkerState};
use crate::text;
use crate::update::shard_key;
use std::collections::HashMap;

/// Where index shards come from: shared data in the filter, the sidecar's
/// own published shards in its selection API. A shard is named by its
/// shared-data key ([`shard_key`]); `None` is an empty shard. A source
/// that keeps shards across requests hands out shared bytes, not copies.
pub trait ShardSource {
    type Bytes: AsRef<[u8]>;

    fn read(&mut self, key: &str) -> Option<Self::Bytes>;
}

impl<F: FnMut(&str) -> Option<Vec<u8>>> ShardSource for F {
    type Bytes = Vec<u8>;

    fn read(&mut self, key: &str) -> Option<Vec<u8>> {
        self(key)
    }
}

/// What each slot holds of one request: the engines' events and the
/// routed-prefix index (requests placed moments ago).
#[derive(Debug, Clone, Default)]
pub struct Cached {
    precise: Vec<SlotOverlap>,
    routed: Vec<SlotOverlap>,
    source: Precise,
}

/// What the engines' events were matched with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Precise {
    /// Nothing: a text prompt of a model without a template.
    #[default]
    None,
    /// Token ids, in blocks.
    Tokens,
    /// A rendered prompt's prefix keys ([`crate::text`]), in chunks.
    Text,
}

impl Cached {
    /// What the engines' events say `slot` holds, per tier: no routed
    /// prefixes in flight. What an API reports as observed. In blocks for
    /// token prompts, in text chunks for rendered text.
    pub fn reported(&self, slot: u16) -> Overlap {
        of(&self.precise, slot)
    }

    /// The overlap `worker`'s rank in `slot` is charged with, in blocks.
    pub fn of(&self, worker: &WorkerState, slot: u16) -> Overlap {
        let routed = chunks_as_blocks(of(&self.routed, slot), worker.block_size);
        match self.source {
            Precise::Tokens => with_in_flight(of(&self.precise, slot), routed),
            Precise::Text => with_in_flight(
                chunks_as_blocks(of(&self.precise, slot), worker.block_size),
                routed,
            ),
            Precise::None => routed,
        }
    }
}

/// Looks `req` up in the index. Token prompts: exact overlap from the
/// engines' events, plus the prefixes of requests routed moments ago whose
/// events have not arrived yet. Text prompts: the routed-prefix index
/// alone. Also returns the chunks to report if the request is routed:
/// none when the events already show a rank holding the whole prompt,
/// since then nothing is in flight to bridge.
pub fn gather(
    model: &ModelState,
    req: &Parsed,
    tenant: &str,
    shards: &mut impl ShardSource,
) -> (Cached, Option<(ChunkKind, Vec<u64>)>) {
    let scope = scope(model, &req.model, req.cache_salt.as_deref());
    let mut read = |k: &str| shards.read(k);
    if let Some(seq) = req.sequence_hashes.as_deref() {
        // The client hashed the prompt: the engines' events are all there
        // is to match, and nothing is reported.
        let precise = slot_count(model)
            .filter(|_| model.shard_count > 0)
            .map(|slots| {
                search(
                    &model.name,
                    model.shard_count,
                    seq,
                    slots,
                    &mut HashMap::new(),
                    &mut read,
                )
            })
            .unwrap_or_default();
        let cached = Cached {
            precise,
            routed: Vec::new(),
            source: Precise::Tokens,
        };
        return (cached, None);
    }
    match (req.tokens.as_deref(), req.text.as_deref()) {
        (Some(tokens), _) => {
            let precise = compute(model, tokens, scope, &mut read).0;
            let mut cached = Cached {
                precise,
                routed: Vec::new(),
                source: Precise::Tokens,
            };
            if holds_whole_prompt(model, tenant, &cached.precise, tokens.len()) {
                return (cached, None);
            }
            let mut chunks = approx::token_chunk_hashes(tokens);
            approx::scope_chunks(&mut chunks, scope);
            cached.routed = approximate(model, &chunks, &mut read);
            (cached, Some((ChunkKind::Tokens, chunks)))
        }
        (None, Some(text)) if req.rendered && model.prompt_template != 0 => {
            // The engine's prompt: its events are matched by prefix key,
            // and routing only bridges until they arrive.
            let keys = text::prefix_keys(text, scope);
            let precise = slot_count(model)
                .map(|slots| {
                    search(
                        &text::index_key(&model.name),
                        text::SHARDS,
                        &keys,
                        slots,
                        &mut HashMap::new(),
                        &mut read,
                    )
                })
                .unwrap_or_default();
            let mut cached = Cached {
                precise,
                routed: Vec::new(),
                source: Precise::Text,
            };
            // When the events show a rank holding all but the last chunk
            // (where a request's own question starts), routing has nothing
            // to bridge: skip the second search and the report.
            if holds_all_but_last(model, tenant, &cached.precise, keys.len()) {
                return (cached, None);
            }
            // A prefix key names its chunk's whole prefix, scope included,
            // as a chained chunk hash does: the keys serve the routed-prefix
            // index too, and the text is hashed once.
            cached.routed = approximate(model, &keys, &mut read);
            (cached, Some((ChunkKind::Tokens, keys)))
        }
        (None, Some(text)) => {
            // The text index's prefix keys, a multiply per eight bytes:
            // chaining each 256-byte chunk through XXH3 instead made the
            // approximate path a chat's slowest in Envoy.
            let chunks = text::prefix_keys(text, scope);
            let cached = Cached {
                routed: approximate(model, &chunks, &mut read),
                ..Cached::default()
            };
            (cached, Some((ChunkKind::Text, chunks)))
        }
        (None, None) => (Cached::default(), None),
    }
}

/// Overlap of every slot of `model` with `tokens` in `scope` (the adapter
/// and salt the request names), in blocks per tier. `read` fetches a
/// shard's bytes by key. Returns the overlap table (indexed by slot) and
/// the number of shards read.
fn compute<B: AsRef<[u8]>>(
    model: &ModelState,
    tokens: &[u32],
    scope: CacheScope<'_>,
    mut read: impl FnMut(&str) -> Option<B>,
) -> (Vec<SlotOverlap>, usize) {
    let Some(slots) = slot_count(model).filter(|_| model.shard_count > 0) else {
        return (Vec::new(), 0);
    };
    let mut table = vec![SlotOverlap::default(); slots];
    let mut shards = HashMap::new();
    let mut block_sizes: Vec<u32> = model.workers.iter().map(|w| w.block_size).collect();
    block_sizes.sort_unstable();
    block_sizes.dedup();
    for bs in block_sizes {
        let seq = scoped_sequence_hashes(tokens, bs as usize, scope);
        let part = search(
            &model.name,
            model.shard_count,
            &seq,
            slots,
            &mut shards,
            &mut read,
        );
        // Slots of workers with another block size read nothing useful
        // from this chain; keep the deepest answer per slot.
        for (t, p) in table.iter_mut().zip(part) {
            if p.device + p.host + p.disk > t.device + t.host + t.disk {
                *t = p;
            }
        }
    }
    let reads = shards.len();
    (table, reads)
}

/// Overlap of every slot of `model` with a text prompt's chunks, from the
/// approximate index learned from routing decisions.
fn approximate<B: AsRef<[u8]>>(
    model: &ModelState,
    chunks: &[u64],
    mut read: impl FnMut(&str) -> Option<B>,
) -> Vec<SlotOverlap> {
    let Some(slots) = slot_count(model) else {
        return Vec::new();
    };
    let key = approx::model_key(&model.name);
    search(
        &key,
        approx::SHARDS,
        chunks,
        slots,
        &mut HashMap::new(),
        &mut read,
    )
}

/// The cache scope of a request whose `model` field (`requested`)
/// resolved to `model`: it names an adapter when it is not the model
/// itself, and the salt is the body's `cache_salt`.
fn scope<'a>(
    model: &ModelState,
    requested: &'a str,
    cache_salt: Option<&'a str>,
) -> CacheScope<'a> {
    CacheScope {
        lora_name: (model.name != requested).then_some(requested),
        cache_salt,
    }
}

fn slot_count(model: &ModelState) -> Option<usize> {
    model
        .workers
        .iter()
        .flat_map(|w| w.ranks.iter().map(|r| r.slot as usize + 1))
        .max()
}

/// Searches one chain of hashes through a namespace's shards, reading each
/// shard from shared data at most once per request.
fn search<B: AsRef<[u8]>>(
    namespace: &str,
    shard_count: u32,
    seq: &[u64],
    slots: usize,
    shards: &mut HashMap<u32, Option<B>>,
    read: &mut impl FnMut(&str) -> Option<B>,
) -> Vec<SlotOverlap> {
    let mut out = vec![SlotOverlap::default(); slots];
    overlaps(
        seq.len(),
        |i, holders| {
            let h = seq[i];
            let shard = shard_of(h, shard_count);
            let bytes = shards
                .entry(shard)
                .or_insert_with(|| read(&shard_key(namespace, shard)));
            if let Some(view) = bytes
                .as_ref()
                .and_then(|b| ShardView::parse(b.as_ref()).ok())
            {
                holders.extend(view.holders(h));
            }
        },
        &mut out,
    );
    out
}

/// An approximate overlap in chunks, converted to blocks of `block_size`.
fn chunks_as_blocks(o: Overlap, block_size: u32) -> Overlap {
    let per = approx::CHUNK_TOKENS / block_size.max(1);
    Overlap {
        device: o.device.saturating_mul(per),
        host: o.host.saturating_mul(per),
        disk: o.disk.saturating_mul(per),
    }
}

/// Events say what a rank holds; routing decisions say what it is about to
/// hold. A prefix known only from routing is credited like one in host
/// memory (`host_weight`): probably there by the time the request runs,
/// but not surely, so a rank whose events confirm the same prefix wins.
fn with_in_flight(precise: Overlap, routed: Overlap) -> Overlap {
    let host = precise.host.max(routed.device);
    Overlap {
        device: precise.device,
        host,
        disk: precise.disk.max(host),
    }
}

/// Whether some rank of `tenant` holds every full block of a
/// `tokens`-long prompt on its device, per the events.
fn holds_whole_prompt(
    model: &ModelState,
    tenant: &str,
    precise: &[SlotOverlap],
    tokens: usize,
) -> bool {
    model
        .workers
        .iter()
        .filter(|w| w.tenant == tenant)
        .any(|w| {
            let full = tokens / w.block_size.max(1) as usize;
            full > 0
                && w.ranks
                    .iter()
                    .any(|r| of(precise, r.slot).device as usize >= full)
        })
}

/// Whether some rank of `tenant` holds, on its device, every one of a
/// rendered prompt's `keys` chunks but the last.
fn holds_all_but_last(
    model: &ModelState,
    tenant: &str,
    precise: &[SlotOverlap],
    keys: usize,
) -> bool {
    keys >= 2
        && model
            .workers
            .iter()
            .filter(|w| w.tenant == tenant)
            .flat_map(|w| &w.ranks)
            .any(|r| of(precise, r.slot).device as usize + 1 >= keys)
}

/// The overlap of one slot, in the selector's terms.
fn of(table: &[SlotOverlap], slot: u16) -> Overlap {
    table
        .get(slot as usize)
        .map_or(Overlap::default(), |o| Overlap {
            device: o.device,
            host: o.host,
            disk: o.disk,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{XXH3_SEED, block_hashes, sequence_hashes};
    use crate::shard::{Holder, TIER_DEVICE, encode};
    use crate::state::RankLoad;

    fn model(shards: u32) -> ModelState {
        ModelState {
            name: "m".into(),
            shard_count: shards,
            workers: (0..3u16)
                .map(|s| WorkerState {
                    id: s as u64,
                    endpoint: String::new(),
                    block_size: 4,
                    ranks: vec![RankLoad {
                        slot: s,
                        ..Default::default()
                    }],
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    /// The text index's shards with `slot` holding the first `held` keys.
    fn text_store(keys: &[u64], slot: u16, held: usize) -> HashMap<String, Vec<u8>> {
        let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
        for k in &keys[..held] {
            per_shard
                .entry(shard_of(*k, text::SHARDS))
                .or_default()
                .push((
                    *k,
                    vec![Holder {
                        slot,
                        tiers: TIER_DEVICE,
                    }],
                ));
        }
        per_shard
            .into_iter()
            .map(|(s, mut e)| (shard_key(&text::index_key("m"), s), encode(&mut e)))
            .collect()
    }

    #[test]
    fn rendered_text_is_matched_against_the_text_index() {
        let mut m = model(8);
        m.prompt_template = 7;
        let text = "system prompt words ".repeat(80); // 1600 bytes: 6 keys
        let keys = text::prefix_keys(&text, CacheScope::default());
        assert_eq!(keys.len(), 6);
        let req = |rendered| Parsed {
            model: "m".into(),
            tokens: None,
            text: Some(text.clone()),
            rendered,
            chat: None,
            sequence_hashes: None,
            isl_tokens: 400,
            stream: false,
            max_tokens: None,
            cache_salt: None,
        };
        // Slot 2 holds four of six chunks: 16 blocks of 4 tokens each.
        let store = text_store(&keys, 2, 4);
        let mut read = |k: &str| store.get(k).cloned();
        let (cached, report) = gather(&m, &req(true), &m.workers[0].tenant, &mut read);
        assert_eq!(cached.reported(2).device, 4, "in chunks");
        assert_eq!(cached.of(&m.workers[2], 2).device, 4 * 16);
        assert_eq!(cached.of(&m.workers[1], 1).device, 0);
        let (kind, chunks) = report.unwrap();
        assert_eq!(
            (kind, chunks.len()),
            (ChunkKind::Tokens, 6),
            "bridged until events"
        );
        assert_eq!(
            chunks, keys,
            "the routed bridge is keyed by the prefix keys"
        );
        // Not rendered (the VM has no template yet): approximate only.
        let (cached, report) = gather(&m, &req(false), &m.workers[0].tenant, &mut read);
        assert_eq!(cached.of(&m.workers[2], 2).device, 0);
        assert_eq!(report.unwrap().0, ChunkKind::Text);
        // All but the last chunk held: nothing to bridge, nothing reported.
        let store = text_store(&keys, 2, 5);
        let mut read = |k: &str| store.get(k).cloned();
        let (cached, report) = gather(&m, &req(true), &m.workers[0].tenant, &mut read);
        assert_eq!(cached.reported(2).device, 5);
        assert!(report.is_none());
    }

    #[test]
    fn overlap_from_shards() {
        let m = model(8);
        let tokens: Vec<u32> = (0..40).collect();
        let seq = sequence_hashes(&block_hashes(&tokens, 4, XXH3_SEED));
        // Slot 1 holds 6 blocks, slot 2 holds 2.
        let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
        for (i, h) in seq.iter().enumerate() {
            let mut holders = Vec::new();
            if i < 6 {
                holders.push(Holder {
                    slot: 1,
                    tiers: TIER_DEVICE,
                });
            }
            if i < 2 {
                holders.push(Holder {
                    slot: 2,
                    tiers: TIER_DEVICE,
                });
            }
            if !holders.is_empty() {
                per_shard
                    .entry(shard_of(*h, 8))
                    .or_default()
                    .push((*h, holders));
            }
        }
        let store: HashMap<String, Vec<u8>> = per_shard
            .into_iter()
            .map(|(s, mut e)| (shard_key("m", s), encode(&mut e)))
            .collect();
        let (table, reads) = compute(&m, &tokens, CacheScope::default(), |k| {
            store.get(k).cloned()
        });
        assert_eq!(
            (table[0].device, table[1].device, table[2].device),
            (0, 6, 2)
        );
        assert!(reads <= 8);
        assert_eq!(of(&table, 1).device, 6);
        assert_eq!(of(&table, 99), Overlap::default());
    }

    #[test]
    fn adapter_and_salt_requests_read_their_own_chains() {
        let mut m = model(8);
        m.lora_adapters = vec!["sql-lora".into()];
        let tokens: Vec<u32> = (0..16).collect();
        let lora = scope(&m, "sql-lora", None);
        assert_eq!(lora.lora_name, Some("sql-lora"));
        assert_eq!(scope(&m, "m", None).lora_name, None);
        // Slot 1 holds the prompt under the adapter and salt "s".
        let held = CacheScope {
            cache_salt: Some("s"),
            ..lora
        };
        let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
        for h in scoped_sequence_hashes(&tokens, 4, held) {
            per_shard.entry(shard_of(h, 8)).or_default().push((
                h,
                vec![Holder {
                    slot: 1,
                    tiers: TIER_DEVICE,
                }],
            ));
        }
        let store: HashMap<String, Vec<u8>> = per_shard
            .into_iter()
            .map(|(s, mut e)| (shard_key("m", s), encode(&mut e)))
            .collect();
        let device = |sc| compute(&m, &tokens, sc, |k| store.get(k).cloned()).0[1].device;
        assert_eq!(device(held), 4);
        assert_eq!(device(lora), 0, "unsalted never matches salted blocks");
        assert_eq!(device(scope(&m, "m", Some("s"))), 0, "base model");
    }

    #[test]
    fn routed_only_prefixes_count_as_host_tier() {
        let resident = Overlap {
            device: 4,
            host: 6,
            disk: 6,
        };
        let routed = Overlap {
            device: 8,
            ..Overlap::default()
        };
        assert_eq!(
            with_in_flight(resident, routed),
            Overlap {
                device: 4,
                host: 8,
                disk: 8
            }
        );
        assert_eq!(
            with_in_flight(resident, Overlap::default()),
            resident,
            "nothing routed changes nothing"
        );
    }

    #[test]
    fn whole_prompt_holders_are_recognised() {
        let mut m = model(8);
        let table = |dev: u32| {
            vec![
                SlotOverlap::default(),
                SlotOverlap {
                    device: dev,
                    host: dev,
                    disk: dev,
                },
            ]
        };
        // 10 tokens in blocks of 4: two full blocks.
        assert!(holds_whole_prompt(&m, "", &table(2), 10));
        assert!(!holds_whole_prompt(&m, "", &table(1), 10));
        assert!(
            !holds_whole_prompt(&m, "", &table(0), 3),
            "no full block at all"
        );
        m.workers[1].tenant = "other".into();
        assert!(
            !holds_whole_prompt(&m, "", &table(2), 10),
            "another tenant's holder does not count"
        );
    }

    #[test]
    fn no_index_no_reads() {
        let (t, reads) = compute(
            &model(0),
            &[1, 2, 3, 4],
            CacheScope::default(),
            |_| -> Option<Vec<u8>> { panic!("no shard should be read") },
        );
        assert!(t.is_empty());
        assert_eq!(reads, 0);
    }
}
