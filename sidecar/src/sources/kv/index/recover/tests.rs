use super::*;
use crate::sources::kv::dump::{self, Dump, Group};
use crate::sources::kv::index::tests::{
    apply, extra, index, key, overlap_via_shards, removed, stored, stored_pages, with,
};
use kvgate_core::shard::{TIER_DEVICE, TIER_HOST};

/// Slot `s` is worker `s`'s rank 0 in these tests.
fn dump_of(idx: &Index, slots: u16) -> Vec<u8> {
    dump::encode(Dump {
        created_at_ms: 1,
        groups: (0..slots)
            .map(|s| Group {
                model: "m".into(),
                worker_id: u64::from(s),
                dp_rank: 0,
                block_size: idx.block_size(s),
                blocks: idx.blocks(s),
            })
            .collect(),
    })
}

fn replayed(bytes: &[u8], slots: u16) -> Index {
    let mut idx = index(slots, 1000);
    for g in dump::decode(bytes).unwrap().groups {
        let r = idx.restore(g.worker_id as u16, &g.blocks).unwrap();
        assert_eq!(
            (r.known, r.over_bound),
            (0, 0),
            "an empty slot takes every block"
        );
    }
    idx
}

fn assert_same(a: &Index, b: &Index, slots: u16) {
    assert_eq!(holders(a), holders(b), "the shards' holders");
    for s in 0..a.shard_count() {
        assert_eq!(
            a.encode_shard(s),
            b.encode_shard(s),
            "shard {s} as published"
        );
    }
    for s in 0..slots {
        assert_eq!(a.slot_len(s), b.slot_len(s), "slot {s}'s table");
        let mut x = a.blocks(s);
        let mut y = b.blocks(s);
        x.sort_by_key(|b| b.engine);
        y.sort_by_key(|b| b.engine);
        assert_eq!(x, y, "slot {s}'s blocks");
    }
}

/// Slot 0: a chain of three on the GPU, its first two also on host.
/// Slot 1: text, then a block with an image and its child (unmatchable).
/// Slot 2: the first block of slot 0's chain, under its own engine hash.
fn live(toks: &[u32]) -> Index {
    let mut idx = index(3, 1000);
    apply(
        &mut idx,
        0,
        vec![
            stored(&[100, 101], None, &toks[..8], "GPU"),
            stored(&[102], Some(101), &toks[8..12], "GPU"),
            stored(&[100, 101], None, &toks[..8], "CPU"),
        ],
    );
    apply(
        &mut idx,
        1,
        vec![
            with(
                stored(&[1, 2], None, &toks[..8], "GPU"),
                "extra_keys",
                extra(vec![None, Some(vec![key("mm", "hash", "img".into())])]),
            ),
            stored(&[3], Some(2), &toks[8..12], "GPU"),
        ],
    );
    apply(&mut idx, 2, vec![stored(&[7], None, &toks[..4], "GPU")]);
    idx
}

#[test]
fn a_replayed_dump_is_the_same_index_and_later_events_resolve_against_it() {
    let toks: Vec<u32> = (1..=20).collect();
    let mut orig = live(&toks);
    let mut back = replayed(&dump_of(&orig, 3), 3);
    assert_same(&orig, &back, 3);
    let o = overlap_via_shards(&back, &toks, 3);
    assert_eq!([o[0].device, o[1].device, o[2].device], [3, 1, 1]);

    // What the engines send next, to both: a removal by engine hash of a
    // recovered block, children of recovered parents (one of them
    // unmatchable), and a removal of an unmatchable block.
    let later = |idx: &mut Index| {
        apply(idx, 0, vec![removed(&[101], "CPU")]);
        apply(
            idx,
            0,
            vec![stored(&[103], Some(102), &toks[12..16], "GPU")],
        );
        apply(idx, 1, vec![stored(&[4], Some(3), &toks[12..16], "GPU")]);
        apply(idx, 1, vec![removed(&[2], "GPU")]);
        apply(idx, 2, vec![stored(&[8], Some(7), &toks[4..8], "CPU")]);
    };
    later(&mut orig);
    later(&mut back);
    assert_same(&orig, &back, 3);
    assert_eq!(
        (back.stats.orphan_events, back.stats.unknown_removals),
        (0, 0),
        "every parent and every removed block was found"
    );
    let o = overlap_via_shards(&back, &toks, 3);
    assert_eq!(o[0].device, 4, "103 chains onto the recovered 102");
    let tiers_of = |engine| {
        back.blocks(0)
            .iter()
            .find(|b| b.engine == engine)
            .map(|b| b.tiers)
    };
    assert_eq!(tiers_of(101), Some(TIER_DEVICE), "101 left host");
    assert_eq!(tiers_of(100), Some(TIER_DEVICE | TIER_HOST));
    assert_eq!(
        o[1].device, 1,
        "a child of an unmatchable block stays unmatchable"
    );
    assert_eq!(
        (o[2].device, o[2].host),
        (1, 2),
        "8 on host chains onto the recovered 7"
    );
    assert_eq!(back.slot_len(1), 3);

    // Removing the recovered chain empties slot 0 as it would have live.
    apply(
        &mut back,
        0,
        vec![
            removed(&[103, 102, 101, 100], "GPU"),
            removed(&[100], "CPU"),
        ],
    );
    assert_eq!(back.slot_len(0), 0);
    assert_eq!(overlap_via_shards(&back, &toks, 3)[0].device, 0);
    assert_eq!(back.stats.unknown_removals, 0);
}

#[test]
fn a_slot_keeps_what_it_already_held_and_its_bound() {
    let toks: Vec<u32> = (1..=8).collect();
    let mut idx = index(2, 3);
    apply(&mut idx, 0, vec![stored(&[100], None, &toks[..4], "GPU")]);
    let seq = idx.blocks(0)[0].seq;
    let peer = |engine, seq| Block {
        engine,
        seq,
        tiers: TIER_HOST,
        unmatchable: false,
    };
    // The live entry for 100 wins over the peer's.
    let r = idx.restore(0, &[peer(100, 77), peer(101, 78)]).unwrap();
    assert_eq!(
        r,
        Restored {
            blocks: 1,
            known: 1,
            over_bound: 0
        }
    );
    let mut held = idx.blocks(0);
    held.sort_by_key(|b| b.engine);
    assert_eq!((held[0].seq, held[0].tiers), (seq, TIER_DEVICE));
    // Two held, bound 3: two more would pass it, so neither goes in.
    let r = idx.restore(0, &[peer(1, 1), peer(2, 2)]).unwrap();
    assert_eq!(r.over_bound, 2);
    assert_eq!(idx.slot_len(0), 2);
    assert_eq!(idx.restore(5, &[peer(1, 1)]), None, "no such slot");
    idx.remove_slot(1);
    assert_eq!(idx.restore(1, &[peer(1, 1)]), None, "a removed slot");
}

#[test]
fn rechunked_pages_are_left_out_of_a_dump() {
    let toks: Vec<u32> = (1..=12).collect();
    let mut idx = index(1, 1000);
    apply(&mut idx, 0, vec![stored(&[7], None, &toks[..4], "GPU")]);
    apply(
        &mut idx,
        0,
        vec![stored_pages(
            &(200..208).collect::<Vec<_>>(),
            Some(7),
            &toks[4..],
            1,
        )],
    );
    assert_eq!(overlap_via_shards(&idx, &toks, 1)[0].device, 3);
    assert_eq!(idx.pages_len(0), 8);
    let blocks = idx.blocks(0);
    assert_eq!(blocks.len(), 1);
    let back = replayed(&dump_of(&idx, 1), 1);
    assert_eq!(
        overlap_via_shards(&back, &toks, 1)[0].device,
        1,
        "only the block stored at the worker's size"
    );
}
