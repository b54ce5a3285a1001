use super::*;
use proptest::prelude::*;

fn block(engine: u64, seq: u64, tiers: u8, unmatchable: bool) -> Block {
    Block {
        engine,
        seq,
        tiers,
        unmatchable,
    }
}

fn group(model: &str, worker_id: u64, dp_rank: u32, blocks: Vec<Block>) -> Group {
    Group {
        model: model.into(),
        worker_id,
        dp_rank,
        block_size: 16,
        blocks,
    }
}

fn sample() -> Dump {
    Dump {
        created_at_ms: 1_700_000_000_123,
        groups: vec![
            group(
                "m",
                2,
                1,
                vec![
                    block(9, 90, TIER_DEVICE, false),
                    block(3, 30, TIER_DEVICE | TIER_HOST, false),
                    block(5, 50, TIER_DEVICE, true),
                    block(1, 10, TIER_DEVICE, false),
                ],
            ),
            group("m", 1, 0, vec![block(u64::MAX, 7, TIER_DISK, false)]),
            group("a-model", 7, 0, vec![block(4, 40, TIER_HOST, true)]),
        ],
    }
}

/// The canonical order: groups by (model, worker, rank), blocks by flags
/// then engine hash.
fn sorted(mut d: Dump) -> Dump {
    d.groups.sort_by(|a, b| a.key().cmp(&b.key()));
    for g in &mut d.groups {
        g.blocks.sort_by_key(|b| (b.flags(), b.engine, b.seq));
    }
    d
}

fn resealed(mut body: Vec<u8>) -> Vec<u8> {
    reseal(&mut body);
    body
}

#[test]
fn a_dump_decodes_to_what_was_encoded_in_canonical_order() {
    let bytes = encode(sample());
    let back = decode(&bytes).unwrap();
    assert_eq!(back, sorted(sample()));
    assert_eq!(back.blocks(), 6);
    assert_eq!(back.groups[0].model, "a-model");
    assert_eq!(
        back.groups[2]
            .blocks
            .iter()
            .map(|b| b.engine)
            .collect::<Vec<_>>(),
        [1, 9, 3, 5],
        "runs by flags, each sorted by engine hash"
    );
    // The same index is the same bytes, whatever order it was read in.
    let mut shuffled = sample();
    shuffled.groups.reverse();
    shuffled.groups[0].blocks.reverse();
    assert_eq!(encode(shuffled), bytes);
    assert_eq!(&bytes[..4], b"KVGD");
}

#[test]
fn a_block_costs_sixteen_bytes() {
    let blocks = |n: u64| Dump {
        created_at_ms: 0,
        groups: vec![group(
            "m",
            1,
            0,
            (0..n)
                .map(|i| block(i, i * 3, TIER_DEVICE, false))
                .collect(),
        )],
    };
    let (small, large) = (encode(blocks(10)).len(), encode(blocks(10_010)).len());
    assert_eq!(large - small, 10_000 * 16);
    assert_eq!(
        small,
        HEADER + CHECKSUM + MIN_GROUP + 1 + RUN_HEADER + 10 * 16
    );
}

#[test]
fn an_empty_dump_round_trips() {
    let bytes = encode(Dump::default());
    assert_eq!(bytes.len(), HEADER + CHECKSUM);
    assert_eq!(decode(&bytes).unwrap(), Dump::default());
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = encode(sample());
    for n in 0..bytes.len() {
        let e = decode(&bytes[..n]).unwrap_err();
        assert!(
            matches!(e, DumpError::Short(_) | DumpError::Checksum),
            "{n} bytes: {e}"
        );
    }
}

#[test]
fn foreign_or_future_dumps_are_refused_by_name() {
    let bytes = encode(sample());
    let mut magic = bytes.clone();
    magic[0] = b'X';
    assert!(matches!(decode(&magic), Err(DumpError::Magic(_))));
    assert!(decode(b"{\"not\": \"a dump at all, but long\"}").is_err());
    let mut v2 = bytes.clone();
    v2[4] = 2;
    assert_eq!(decode(&v2), Err(DumpError::Version(2)));
    let mut flags = bytes.clone();
    flags[6] = 1;
    assert_eq!(decode(&resealed(flags)), Err(DumpError::Flags(1)));
    let mut corrupt = bytes.clone();
    let mid = corrupt.len() / 2;
    corrupt[mid] ^= 0x40;
    assert_eq!(decode(&corrupt), Err(DumpError::Checksum));
}

/// A producer that seals whatever it writes: every count is still bounded
/// by the bytes present.
#[test]
fn huge_counts_with_a_valid_checksum_allocate_nothing() {
    let mut d = encode(Dump {
        created_at_ms: 0,
        groups: vec![group("m", 1, 0, vec![block(1, 1, TIER_DEVICE, false)])],
    });
    let groups_at = HEADER - 4;
    let mut g = d.clone();
    g[groups_at..groups_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode(&resealed(g)),
        Err(DumpError::Wire(WireError::ImplausibleCount {
            what: "groups",
            ..
        }))
    ));
    // model "m" (3), worker, rank, block size: then runs, then the run.
    let runs_at = HEADER + 3 + 8 + 4 + 4;
    let mut r = d.clone();
    r[runs_at..runs_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode(&resealed(r)),
        Err(DumpError::Wire(WireError::ImplausibleCount {
            what: "runs",
            ..
        }))
    ));
    let count_at = runs_at + 4 + 1;
    d[count_at..count_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode(&resealed(d)),
        Err(DumpError::Wire(WireError::ImplausibleCount {
            what: "blocks",
            ..
        }))
    ));
}

#[test]
fn bad_flags_repeated_groups_and_trailing_bytes_are_refused() {
    let one = || group("m", 1, 0, vec![block(1, 1, TIER_DEVICE, false)]);
    let bytes = encode(Dump {
        created_at_ms: 0,
        groups: vec![one()],
    });
    let flags_at = HEADER + 3 + 8 + 4 + 4 + 4;
    for bad in [0u8, 0x80, 0x08, 0x41] {
        let mut b = bytes.clone();
        b[flags_at] = bad;
        assert_eq!(
            decode(&resealed(b)),
            Err(DumpError::BlockFlags(bad)),
            "{bad:#x}"
        );
    }
    // Two groups for one rank: the encoder never writes it.
    let mut twice = bytes[..bytes.len() - CHECKSUM].to_vec();
    twice[HEADER - 4..HEADER].copy_from_slice(&2u32.to_le_bytes());
    twice.extend_from_slice(&bytes[HEADER..bytes.len() - CHECKSUM]);
    twice.extend_from_slice(&[0; CHECKSUM]);
    assert!(matches!(
        decode(&resealed(twice)),
        Err(DumpError::Order {
            index: 1,
            worker_id: 1,
            ..
        })
    ));
    let mut trailing = bytes[..bytes.len() - CHECKSUM].to_vec();
    trailing.extend_from_slice(&[0; 3 + CHECKSUM]);
    assert_eq!(decode(&resealed(trailing)), Err(DumpError::Trailing(3)));
}

proptest! {
    #[test]
    fn no_input_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(&bytes);
        // The same bytes behind a valid header and sealed: the parser
        // proper sees them.
        let mut sealed = MAGIC.to_vec();
        sealed.extend_from_slice(&VERSION.to_le_bytes());
        sealed.extend_from_slice(&bytes);
        sealed.extend_from_slice(&[0; CHECKSUM]);
        let _ = decode(&resealed(sealed));
    }

    #[test]
    fn mutated_dumps_never_panic(at in 0usize..1000, byte in any::<u8>()) {
        let mut b = encode(sample());
        let i = at % (b.len() - CHECKSUM);
        b[i] = byte;
        let _ = decode(&resealed(b));
    }

    #[test]
    fn any_dump_round_trips(groups in prop::collection::vec(
        (0u64..4, 0u32..3, prop::collection::vec((any::<u64>(), any::<u64>(), 1u8..8, any::<bool>()), 0..20)),
        0..6,
    )) {
        let mut seen = std::collections::HashSet::new();
        let d = Dump {
            created_at_ms: 5,
            groups: groups
                .into_iter()
                .filter(|(w, r, _)| seen.insert((*w, *r)))
                .map(|(w, r, blocks)| group(
                    "m",
                    w,
                    r,
                    blocks.into_iter().map(|(e, s, t, u)| block(e, s, t, u)).collect(),
                ))
                .collect(),
        };
        prop_assert_eq!(decode(&encode(d.clone())).unwrap(), sorted(d));
    }
}
