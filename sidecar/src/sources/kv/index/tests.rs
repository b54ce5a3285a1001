use super::*;
use kvgate_core::hash::{CacheScope, scoped_sequence_hashes};
use kvgate_core::shard::{ShardView, SlotOverlap, overlaps};
use rmpv::Value;

fn v<T: Into<Value>>(x: T) -> Value {
    x.into()
}

pub(super) fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: &str) -> Value {
    Value::Map(vec![
        (v("type"), v("BlockStored")),
        (
            v("block_hashes"),
            Value::Array(hashes.iter().map(|h| v(*h)).collect()),
        ),
        (v("parent_block_hash"), parent.map_or(Value::Nil, v)),
        (
            v("token_ids"),
            Value::Array(tokens.iter().map(|t| v(*t)).collect()),
        ),
        (v("block_size"), v(4)),
        (v("lora_id"), Value::Nil),
        (v("medium"), v(medium)),
        (v("lora_name"), Value::Nil),
    ])
}

pub(super) fn with(mut ev: Value, key: &str, val: Value) -> Value {
    if let Value::Map(m) = &mut ev {
        m.push((v(key), val));
    }
    ev
}

pub(super) fn removed(hashes: &[u64], medium: &str) -> Value {
    Value::Map(vec![
        (v("type"), v("BlockRemoved")),
        (
            v("block_hashes"),
            Value::Array(hashes.iter().map(|h| v(*h)).collect()),
        ),
        (v("medium"), v(medium)),
    ])
}

fn cleared() -> Value {
    Value::Map(vec![(v("type"), v("AllBlocksCleared"))])
}

pub(super) fn apply(idx: &mut Index, slot: u16, events: Vec<Value>) {
    let batch = Value::Array(vec![v(1.0f64), Value::Array(events), v(0)]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).unwrap();
    let mut st = Staged::default();
    st.keep_tokens = idx.has_text();
    st.stage(&buf, idx.block_size(slot)).unwrap();
    idx.apply(slot, &st);
}

/// Overlap of `tokens` per slot, read back through encoded shards the
/// way the filter does.
pub(super) fn overlap_via_shards(idx: &Index, tokens: &[u32], slots: usize) -> Vec<SlotOverlap> {
    scoped_overlap(idx, tokens, slots, CacheScope::default())
}

/// The same for a request naming an adapter or a salt.
fn scoped_overlap(
    idx: &Index,
    tokens: &[u32],
    slots: usize,
    scope: CacheScope<'_>,
) -> Vec<SlotOverlap> {
    let shards: Vec<Vec<u8>> = (0..idx.shard_count())
        .map(|s| idx.encode_shard(s))
        .collect();
    let seq = scoped_sequence_hashes(tokens, 4, scope);
    let mut out = vec![SlotOverlap::default(); slots];
    overlaps(
        seq.len(),
        |i, hs| {
            let s = shard::shard_of(seq[i], shards.len() as u32) as usize;
            hs.extend(ShardView::parse(&shards[s]).unwrap().holders(seq[i]));
        },
        &mut out,
    );
    out
}

pub(super) fn index(slots: u16, max: usize) -> Index {
    let mut idx = Index::new(8, max);
    for s in 0..slots {
        idx.add_slot(s, 4);
    }
    idx
}

#[test]
fn stored_chains_are_found_by_request_hashes() {
    let mut idx = index(2, 1000);
    let toks: Vec<u32> = (1..=12).collect();
    apply(
        &mut idx,
        0,
        vec![
            stored(&[100, 101], None, &toks[..8], "GPU"),
            stored(&[102], Some(101), &toks[8..], "GPU"),
        ],
    );
    apply(&mut idx, 1, vec![stored(&[7], None, &toks[..4], "GPU")]);
    assert_eq!(idx.len(), 3);
    let o = overlap_via_shards(&idx, &toks, 2);
    assert_eq!((o[0].device, o[1].device), (3, 1));
    let mut other = toks.clone();
    other[9] = 999;
    assert_eq!(
        overlap_via_shards(&idx, &other, 2)[0].device,
        2,
        "only the shared blocks match"
    );
}

#[test]
fn removal_and_tiers() {
    let mut idx = index(1, 1000);
    let toks: Vec<u32> = (1..=8).collect();
    apply(
        &mut idx,
        0,
        vec![
            stored(&[1, 2], None, &toks, "GPU"),
            stored(&[1, 2], None, &toks, "CPU"),
        ],
    );
    apply(&mut idx, 0, vec![removed(&[2], "GPU")]);
    let o = overlap_via_shards(&idx, &toks, 1)[0];
    assert_eq!(
        (o.device, o.host),
        (1, 2),
        "block 2 left the GPU but stays on host"
    );
    apply(
        &mut idx,
        0,
        vec![removed(&[1, 2], "CPU"), removed(&[1], "GPU")],
    );
    assert!(idx.is_empty());
    assert_eq!(idx.slot_len(0), 0);
    apply(&mut idx, 0, vec![removed(&[42], "GPU")]);
    assert_eq!(idx.stats.unknown_removals, 1);
}

#[test]
fn cleared_drops_only_that_slot() {
    let mut idx = index(2, 1000);
    let toks: Vec<u32> = (1..=8).collect();
    apply(&mut idx, 0, vec![stored(&[1, 2], None, &toks, "GPU")]);
    apply(&mut idx, 1, vec![stored(&[5, 6], None, &toks, "GPU")]);
    idx.take_dirty();
    apply(&mut idx, 0, vec![cleared()]);
    let o = overlap_via_shards(&idx, &toks, 2);
    assert_eq!((o[0].device, o[1].device), (0, 2));
    assert!(!idx.take_dirty().is_empty(), "clearing marks shards dirty");
}

#[test]
fn orphans_partial_blocks_and_other_groups_are_not_indexed() {
    let mut idx = index(1, 1000);
    apply(
        &mut idx,
        0,
        vec![stored(&[9], Some(12345), &[1, 2, 3, 4], "GPU")],
    );
    assert_eq!(idx.stats.orphan_events, 1);
    // Two hashes but one full block of tokens: one block indexed.
    apply(
        &mut idx,
        0,
        vec![stored(&[1, 2], None, &[1, 2, 3, 4, 5, 6], "GPU")],
    );
    assert_eq!(idx.len(), 1);
    apply(
        &mut idx,
        0,
        vec![
            with(stored(&[3], None, &[9, 9, 9, 9], "GPU"), "group_idx", v(1)),
            with(
                stored(&[4], None, &[8, 8, 8, 8], "GPU"),
                "kv_cache_spec_kind",
                v("sliding_window"),
            ),
            with(
                stored(&[5], None, &[7, 7, 7, 7], "GPU"),
                "locality",
                v("REMOTE"),
            ),
        ],
    );
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.stats.skipped_events, 3);
    apply(&mut idx, 7, vec![stored(&[1], None, &[1, 2, 3, 4], "GPU")]);
    assert_eq!(idx.len(), 1, "events for unknown slots are ignored");
}

#[test]
fn lora_blocks_do_not_match_base_model_requests() {
    let mut idx = index(1, 1000);
    let toks = [1, 2, 3, 4];
    apply(
        &mut idx,
        0,
        vec![with(
            stored(&[1], None, &toks, "GPU"),
            "lora_name",
            v("adapter"),
        )],
    );
    assert_eq!(idx.len(), 1);
    assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 0);
    assert_eq!(scoped_overlap(&idx, &toks, 1, lora("adapter"))[0].device, 1);
    assert_eq!(scoped_overlap(&idx, &toks, 1, lora("other"))[0].device, 0);
}

fn lora(name: &str) -> CacheScope<'_> {
    CacheScope {
        lora_name: Some(name),
        cache_salt: None,
    }
}

/// `with` appends, and a map keeps its first `lora_name`: drops the nil
/// one the base event carries.
fn without_nil_lora(ev: Value) -> Value {
    match ev {
        Value::Map(m) => Value::Map(
            m.into_iter()
                .filter(|(k, val)| !(k.as_str() == Some("lora_name") && val.is_nil()))
                .collect(),
        ),
        other => other,
    }
}

pub(super) fn key(kind: &str, field: &str, value: Value) -> Value {
    Value::Map(vec![(v("type"), v(kind)), (v(field), value)])
}

pub(super) fn extra(blocks: Vec<Option<Vec<Value>>>) -> Value {
    Value::Array(
        blocks
            .into_iter()
            .map(|b| b.map_or(Value::Nil, Value::Array))
            .collect(),
    )
}

#[test]
fn vllm_extra_keys_scope_blocks_by_adapter_and_salt() {
    let mut idx = index(2, 1000);
    let toks: Vec<u32> = (1..=12).collect();
    let adapter = || key("lora", "name", v("sql-lora"));
    let salted = with(
        with(
            stored(&[1, 2, 3], None, &toks, "GPU"),
            "lora_name",
            v("sql-lora"),
        ),
        "extra_keys",
        extra(vec![
            Some(vec![adapter(), key("cache_salt", "salt", v("s1"))]),
            Some(vec![adapter()]),
            Some(vec![adapter()]),
        ]),
    );
    let salted = without_nil_lora(salted);
    apply(&mut idx, 0, vec![salted]);
    // The adapter named only in extra keys, on slot 1, unsalted.
    apply(
        &mut idx,
        1,
        vec![with(
            stored(&[7, 8], None, &toks[..8], "GPU"),
            "extra_keys",
            extra(vec![Some(vec![adapter()]), Some(vec![adapter()])]),
        )],
    );
    let both = CacheScope {
        lora_name: Some("sql-lora"),
        cache_salt: Some("s1"),
    };
    let o = scoped_overlap(&idx, &toks, 2, both);
    assert_eq!((o[0].device, o[1].device), (3, 0));
    let o = scoped_overlap(&idx, &toks, 2, lora("sql-lora"));
    assert_eq!(
        (o[0].device, o[1].device),
        (0, 2),
        "an unsalted request never matches salted blocks"
    );
    let o = overlap_via_shards(&idx, &toks, 2);
    assert_eq!((o[0].device, o[1].device), (0, 0));
    assert!(idx.unmatchable.is_empty());
}

#[test]
fn sglang_salt_scopes_the_whole_chain() {
    let mut idx = index(1, 1000);
    let toks: Vec<u32> = (1..=8).collect();
    let salted = |ev| with(ev, "cache_salt", v("tenant-x"));
    apply(
        &mut idx,
        0,
        vec![
            salted(stored(&[1], None, &toks[..4], "GPU")),
            // SGLang repeats the salt on every page; the chain already
            // carries it, so a child's salt adds nothing.
            salted(stored(&[2], Some(1), &toks[4..], "GPU")),
        ],
    );
    let scope = CacheScope {
        lora_name: None,
        cache_salt: Some("tenant-x"),
    };
    assert_eq!(scoped_overlap(&idx, &toks, 1, scope)[0].device, 2);
    assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 0);
    let other = CacheScope {
        cache_salt: Some("tenant-y"),
        ..scope
    };
    assert_eq!(scoped_overlap(&idx, &toks, 1, other)[0].device, 0);
}

#[test]
fn blocks_with_extra_keys_kvgate_cannot_compute_never_match() {
    let mut idx = index(1, 1000);
    let toks: Vec<u32> = (1..=12).collect();
    let mm = key("mm", "hash", v("img-1"));
    apply(
        &mut idx,
        0,
        vec![
            // Block 0 is text; the image starts in block 1.
            with(
                stored(&[1, 2], None, &toks[..8], "GPU"),
                "extra_keys",
                extra(vec![None, Some(vec![mm])]),
            ),
            stored(&[3], Some(2), &toks[8..], "GPU"),
        ],
    );
    assert_eq!(
        overlap_via_shards(&idx, &toks, 1)[0].device,
        1,
        "only the text block before the image matches"
    );
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.slot_len(0), 3, "the slot still knows all three");
    assert_eq!(idx.unmatchable.get(&(0, Unmatchable::Multimodal)), Some(&1));
    assert_eq!(idx.unmatchable.get(&(0, Unmatchable::Parent)), Some(&1));
    // Removing unmatchable blocks is no unknown removal, and leaves the
    // matchable one alone.
    apply(&mut idx, 0, vec![removed(&[3, 2], "GPU")]);
    assert_eq!((idx.stats.unknown_removals, idx.slot_len(0)), (0, 1));
    assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 1);

    let others = [
        (
            with(stored(&[10], None, &[5, 5, 5, 5], "GPU"), "lora_id", v(3)),
            Unmatchable::LoraIdWithoutName,
        ),
        (
            with(
                stored(&[11], None, &[6, 6, 6, 6], "GPU"),
                "extra_keys",
                extra(vec![Some(vec![v("opaque")])]),
            ),
            Unmatchable::LegacyExtraKeys,
        ),
        (
            with(
                stored(&[12], None, &[7, 7, 7, 7], "GPU"),
                "extra_keys",
                extra(vec![Some(vec![key("prompt_embeds", "hash", v("e"))])]),
            ),
            Unmatchable::PromptEmbeds,
        ),
        (
            with(
                stored(&[13], None, &[8, 8, 8, 8], "GPU"),
                "extra_keys",
                extra(vec![Some(vec![key("novel", "x", v(1))])]),
            ),
            Unmatchable::UnknownExtraKey,
        ),
    ];
    for (ev, why) in others {
        apply(&mut idx, 0, vec![ev]);
        assert_eq!(idx.unmatchable.get(&(0, why)), Some(&1), "{why:?}");
    }
    for t in [5, 6, 7, 8] {
        assert_eq!(overlap_via_shards(&idx, &[t; 4], 1)[0].device, 0);
    }
    assert_eq!(idx.len(), 1);
    // An old vLLM's untyped key that is just the adapter's name is fine.
    apply(
        &mut idx,
        0,
        vec![with(
            with(stored(&[14], None, &[9, 9, 9, 9], "GPU"), "lora_id", v(1)),
            "extra_keys",
            extra(vec![Some(vec![v("a")])]),
        )],
    );
    assert_eq!(idx.len(), 1, "a lora_id without a name stays unmatchable");
    // Clearing the slot drops unmatchable entries too.
    apply(&mut idx, 0, vec![cleared()]);
    assert_eq!((idx.len(), idx.slot_len(0)), (0, 0));
}

#[test]
fn a_flooding_slot_is_bounded() {
    let mut idx = index(1, 10);
    for i in 0..20u32 {
        apply(
            &mut idx,
            0,
            vec![stored(&[i as u64], None, &[i, i, i, i], "GPU")],
        );
    }
    assert!(idx.slot_len(0) <= 10);
    assert_eq!(idx.stats.overflows, 1);
}

#[test]
fn reused_engine_hash_replaces_the_old_block() {
    let mut idx = index(1, 1000);
    apply(&mut idx, 0, vec![stored(&[1], None, &[1, 2, 3, 4], "GPU")]);
    apply(&mut idx, 0, vec![stored(&[1], None, &[5, 6, 7, 8], "GPU")]);
    assert_eq!(idx.len(), 1);
    assert_eq!(overlap_via_shards(&idx, &[1, 2, 3, 4], 1)[0].device, 0);
    assert_eq!(overlap_via_shards(&idx, &[5, 6, 7, 8], 1)[0].device, 1);
}

#[test]
fn a_malformed_batch_changes_nothing() {
    let idx = index(1, 1000);
    let good = stored(&[1], None, &[1, 2, 3, 4], "GPU");
    let bad = Value::Map(vec![(v("type"), v("BlockStored"))]);
    let batch = Value::Array(vec![v(1.0f64), Value::Array(vec![good, bad]), v(0)]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).unwrap();
    let mut st = Staged::default();
    assert!(st.stage(&buf, 4).is_err());
    assert!(
        idx.is_empty(),
        "nothing applied from a batch that failed to stage"
    );
}

/// A store of `pages` pages of `page` tokens each, as SGLang publishes with
/// a page size other than the worker's block size (4 here).
pub(super) fn stored_pages(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    page: u32,
) -> Value {
    let ev = stored(hashes, parent, tokens, "GPU");
    match ev {
        Value::Map(m) => Value::Map(
            m.into_iter()
                .map(|(k, val)| {
                    if k.as_str() == Some("block_size") {
                        (k, v(page))
                    } else {
                        (k, val)
                    }
                })
                .collect(),
        ),
        other => other,
    }
}

#[test]
fn one_token_pages_are_rechunked_into_the_workers_blocks() {
    let mut idx = index(2, 1000);
    let toks: Vec<u32> = (1..=14).collect();
    // Ten one-token pages, then four more continuing the chain.
    let first: Vec<u64> = (100..110).collect();
    apply(
        &mut idx,
        0,
        vec![stored_pages(&first, None, &toks[..10], 1)],
    );
    assert_eq!(idx.len(), 2, "two whole blocks of 4 in 10 tokens");
    apply(
        &mut idx,
        0,
        vec![stored_pages(
            &[110, 111, 112, 113],
            Some(109),
            &toks[10..],
            1,
        )],
    );
    assert_eq!(idx.len(), 3);
    assert_eq!(overlap_via_shards(&idx, &toks, 2)[0].device, 3);
    assert_eq!(idx.slot_len(0), 14, "an entry per page");
    // The same chain at the worker's own size on slot 1 is the same blocks.
    apply(
        &mut idx,
        1,
        vec![stored(&[7, 8, 9], None, &toks[..12], "GPU")],
    );
    let o = overlap_via_shards(&idx, &toks, 2);
    assert_eq!((o[0].device, o[1].device), (3, 3));
    assert_eq!(idx.len(), 3, "same content, same sequence hashes");

    // Leaf first, as engines evict: the last block goes with the page that
    // completed it (token 12), not before.
    apply(&mut idx, 0, vec![removed(&[113, 112], "GPU")]);
    assert_eq!(overlap_via_shards(&idx, &toks, 2)[0].device, 3);
    apply(&mut idx, 0, vec![removed(&[111], "GPU")]);
    assert_eq!(overlap_via_shards(&idx, &toks, 2)[0].device, 2);
    let rest: Vec<u64> = (100..111).rev().collect();
    apply(&mut idx, 0, vec![removed(&rest, "GPU")]);
    assert_eq!(overlap_via_shards(&idx, &toks, 2)[0].device, 0);
    assert_eq!(idx.slot_len(0), 0);
    assert_eq!(idx.stats.unknown_removals, 0);
}

#[test]
fn pages_larger_than_blocks_complete_several_and_take_other_tiers() {
    let mut idx = index(1, 1000);
    let toks: Vec<u32> = (1..=16).collect();
    apply(&mut idx, 0, vec![stored_pages(&[1, 2], None, &toks, 8)]);
    assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 4);
    let mut cpu = stored_pages(&[1, 2], None, &toks, 8);
    if let Value::Map(m) = &mut cpu {
        for (k, val) in m.iter_mut() {
            if k.as_str() == Some("medium") {
                *val = v("CPU");
            }
        }
    }
    apply(&mut idx, 0, vec![cpu]);
    apply(&mut idx, 0, vec![removed(&[2], "GPU")]);
    let o = overlap_via_shards(&idx, &toks, 1)[0];
    assert_eq!((o.device, o.host), (2, 4), "page 2's blocks stay on host");
    apply(&mut idx, 0, vec![cleared()]);
    assert!(idx.is_empty());
    assert_eq!(idx.slot_len(0), 0);
}

#[test]
fn rechunked_chains_keep_their_salt_and_adapter() {
    let mut idx = index(1, 1000);
    let toks: Vec<u32> = (1..=8).collect();
    let hashes: Vec<u64> = (1..=8).collect();
    let ev = with(
        with(stored_pages(&hashes, None, &toks, 1), "cache_salt", v("t1")),
        "lora_name",
        v("sql"),
    );
    let ev = without_nil_lora(ev);
    apply(&mut idx, 0, vec![ev]);
    let scope = |salt| CacheScope {
        lora_name: Some("sql"),
        cache_salt: salt,
    };
    assert_eq!(
        scoped_overlap(&idx, &toks, 1, scope(Some("t1")))[0].device,
        2
    );
    assert_eq!(scoped_overlap(&idx, &toks, 1, scope(None))[0].device, 0);
    assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 0);
}

#[test]
fn rechunked_orphans_and_reused_page_hashes() {
    let mut idx = index(1, 1000);
    apply(&mut idx, 0, vec![stored_pages(&[5], Some(999), &[1], 1)]);
    assert_eq!(idx.stats.orphan_events, 1);
    let toks: Vec<u32> = (1..=4).collect();
    apply(
        &mut idx,
        0,
        vec![stored_pages(&[1, 2, 3, 4], None, &toks, 1)],
    );
    assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 1);
    // The engine restarted and reused page 4's hash for other content.
    apply(&mut idx, 0, vec![stored_pages(&[4], Some(3), &[42], 1)]);
    assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 0);
    let other = [1, 2, 3, 42];
    assert_eq!(overlap_via_shards(&idx, &other, 1)[0].device, 1);
}

mod text {
    use super::*;
    use crate::prompt::Vocab;
    use kvgate_core::text::{CHUNK_BYTES, SHARDS, prefix_keys};

    /// Token `b` is byte `b`: a text's tokens are its bytes.
    fn bytes_vocab() -> Arc<Vocab> {
        let lines: String = (0..=255u8)
            .map(|b| format!("{} {b}\n", b64(&[b])))
            .collect();
        Arc::new(Vocab::from_tiktoken("bytes", lines.as_bytes(), &[]).unwrap())
    }

    fn b64(b: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let x = b[0] as usize;
        format!("{}{}==", A[x >> 2] as char, A[(x & 3) << 4] as char)
    }

    fn prompt(n: usize) -> String {
        (0..n).map(|i| char::from(b'a' + (i % 23) as u8)).collect()
    }

    /// Chunks of `text` each slot holds, read through encoded text shards.
    fn text_overlap(idx: &Index, text: &str, scope: CacheScope<'_>, slots: usize) -> Vec<u32> {
        let keys = prefix_keys(text, scope);
        let mut out = vec![SlotOverlap::default(); slots];
        overlaps(
            keys.len(),
            |i, hs| {
                let b = idx.encode_text_shard(shard::shard_of(keys[i], SHARDS));
                if let Ok(view) = ShardView::parse(&b) {
                    hs.extend(view.holders(keys[i]));
                }
            },
            &mut out,
        );
        out.iter().map(|o| o.device).collect()
    }

    /// Stores `text` as a chain of 4-token blocks, engine hashes from `h0`.
    fn store_text(idx: &mut Index, slot: u16, text: &str, h0: u64, medium: &str) -> Vec<u64> {
        let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
        let hashes: Vec<u64> = (0..tokens.len() as u64 / 4).map(|i| h0 + i).collect();
        // Two events, so the second resumes from its parent's cursor.
        let half = hashes.len() / 2;
        apply(
            idx,
            slot,
            vec![
                stored(&hashes[..half], None, &tokens[..half * 4], medium),
                stored(
                    &hashes[half..],
                    Some(hashes[half - 1]),
                    &tokens[half * 4..hashes.len() * 4],
                    medium,
                ),
            ],
        );
        hashes
    }

    fn index() -> Index {
        let mut idx = Index::new(64, 1 << 20);
        idx.add_slot(0, 4);
        idx.add_slot(1, 4);
        idx.set_vocab(bytes_vocab());
        idx
    }

    #[test]
    fn engine_text_is_matched_by_prefix_key_and_follows_evictions() {
        let mut idx = index();
        let text = prompt(3 * CHUNK_BYTES + 40);
        let none = CacheScope::default();
        assert_eq!(text_overlap(&idx, &text, none, 2), vec![0, 0]);
        let hashes = store_text(&mut idx, 1, &text, 1000, "GPU");
        assert_eq!(text_overlap(&idx, &text, none, 2), vec![0, 3]);
        assert!(
            !idx.take_text_updates().is_empty(),
            "changed shards are published"
        );
        // A longer request with the same prefix matches the same three.
        let longer = format!("{text}{}", prompt(1000));
        assert_eq!(text_overlap(&idx, &longer, none, 2), vec![0, 3]);
        // Evicting the leaf blocks from byte 512 on leaves two chunks.
        let first_gone = 2 * CHUNK_BYTES / 4;
        apply(&mut idx, 1, vec![removed(&hashes[first_gone..], "GPU")]);
        assert_eq!(text_overlap(&idx, &text, none, 2), vec![0, 2]);
        // The same text on another rank, offloaded to CPU, counts too.
        store_text(&mut idx, 0, &text, 5000, "CPU");
        let keys = prefix_keys(&text, none);
        let b = idx.encode_text_shard(shard::shard_of(keys[2], SHARDS));
        let holders: Vec<Holder> = ShardView::parse(&b).unwrap().holders(keys[2]).collect();
        assert_eq!(
            holders,
            vec![Holder {
                slot: 0,
                tiers: TIER_HOST
            }]
        );
        apply(&mut idx, 1, vec![cleared()]);
        assert_eq!(text_overlap(&idx, &text, none, 2), vec![0, 0]);
        idx.remove_slot(0);
        assert_eq!(idx.text_stats().unwrap().0, 0, "nothing left keyed");
    }

    #[test]
    fn salted_chains_match_only_their_salt_and_orphans_are_skipped() {
        let mut idx = index();
        let text = prompt(2 * CHUNK_BYTES);
        let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
        let hashes: Vec<u64> = (0..tokens.len() as u64 / 4).collect();
        let ev = with(
            stored(&hashes, None, &tokens, "GPU"),
            "cache_salt",
            v("tenant-a"),
        );
        apply(&mut idx, 0, vec![ev]);
        let salted = CacheScope {
            lora_name: None,
            cache_salt: Some("tenant-a"),
        };
        let shards: std::collections::HashMap<u32, Vec<u8>> =
            idx.take_text_updates().into_iter().collect();
        let holds = |scope| {
            prefix_keys(&text, scope).iter().all(|k| {
                shards
                    .get(&shard::shard_of(*k, SHARDS))
                    .and_then(|b| ShardView::parse(b).ok())
                    .is_some_and(|v| v.holders(*k).next().is_some())
            })
        };
        assert!(holds(salted));
        assert!(!holds(CacheScope::default()));
        // A child whose parent this sidecar never saw gets no keys.
        apply(
            &mut idx,
            1,
            vec![stored(&[77], Some(76), &[1, 2, 3, 4], "GPU")],
        );
        assert_eq!(idx.text_stats().unwrap().1.orphans, 1);
    }

    #[test]
    fn ids_outside_the_vocabulary_stop_the_chain() {
        let mut idx = index();
        apply(
            &mut idx,
            0,
            vec![stored(
                &[1, 2],
                None,
                &[97, 98, 99, 100, 999, 1, 2, 3],
                "GPU",
            )],
        );
        let (_, stats) = idx.text_stats().unwrap();
        assert_eq!(stats.undecodable, 1);
    }
}
