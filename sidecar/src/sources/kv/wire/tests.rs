use super::*;

macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/kv_events/",
            $name,
            ".msgpack"
        ))
    };
}

/// An owned copy of an event, for assertions.
#[derive(Debug, Clone, PartialEq)]
enum Owned {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u32,
        medium: Medium,
        lora: Option<String>,
        salt: Option<String>,
        indexable: bool,
    },
    Removed(Vec<u64>, Medium),
    Cleared,
    Unknown(String),
}

fn decode(payload: &[u8]) -> Result<(BatchMeta, Vec<Owned>), WireError> {
    let mut out = Vec::new();
    let meta = decode_batch(payload, &mut Scratch::default(), |e| {
        out.push(match e {
            Event::Stored(s) => Owned::Stored {
                hashes: s.hashes.to_vec(),
                parent: s.parent,
                tokens: s.tokens.to_vec(),
                block_size: s.block_size,
                medium: s.medium,
                lora: s.lora_name.map(str::to_owned),
                salt: s.cache_salt.map(str::to_owned),
                indexable: s.indexable(),
            },
            Event::Removed { hashes, medium, .. } => Owned::Removed(hashes.to_vec(), medium),
            Event::Cleared => Owned::Cleared,
            Event::Unknown { tag } => Owned::Unknown(tag.to_owned()),
        })
    })?;
    Ok((meta, out))
}

const BIG: u64 = 18446744073709551000;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32, medium: Medium) -> Owned {
    Owned::Stored {
        hashes: hashes.to_vec(),
        parent,
        tokens: tokens.to_vec(),
        block_size: bs,
        medium,
        lora: None,
        salt: None,
        indexable: true,
    }
}

#[test]
fn vllm_positional_era() {
    let (meta, ev) = decode(fixture!("vllm_v023_positional")).unwrap();
    assert_eq!(
        meta,
        BatchMeta {
            ts: 1700000000.5,
            dp_rank: Some(0),
            events: 5
        }
    );
    assert_eq!(
        ev[0],
        stored(
            &[BIG, 2],
            None,
            &[1, 2, 3, 4, 5, 6, 7, 8],
            4,
            Medium::Device
        )
    );
    match &ev[1] {
        Owned::Stored {
            parent,
            medium,
            lora,
            indexable,
            ..
        } => {
            assert_eq!(
                (*parent, *medium, lora.as_deref(), *indexable),
                (Some(2), Medium::Host, Some("adapter-a"), true)
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ev[2], Owned::Removed(vec![BIG], Medium::Device));
    assert!(
        matches!(
            ev[3],
            Owned::Stored {
                indexable: false,
                ..
            }
        ),
        "group 1 is not indexed"
    );
    assert_eq!(ev[4], Owned::Cleared);
}

#[test]
fn vllm_two_element_batch_has_no_rank() {
    let (meta, ev) = decode(fixture!("vllm_v023_two_element_batch")).unwrap();
    assert_eq!(meta.dp_rank, None);
    assert_eq!(ev, vec![Owned::Removed(vec![7], Medium::Device)]);
}

#[test]
fn vllm_tagged_maps_ignore_unknown_fields() {
    let (meta, ev) = decode(fixture!("vllm_v033_tagged")).unwrap();
    assert_eq!((meta.dp_rank, meta.events), (Some(1), 5));
    let first: Vec<u32> = (300..316).collect();
    assert_eq!(ev[0], stored(&[BIG], None, &first, 16, Medium::Device));
    let second: Vec<u32> = (316..332).collect();
    assert_eq!(ev[1], stored(&[5], Some(BIG), &second, 16, Medium::Disk));
    assert!(
        matches!(
            ev[2],
            Owned::Stored {
                indexable: false,
                ..
            }
        ),
        "sliding window is not indexed"
    );
    assert_eq!(ev[3], Owned::Removed(vec![5], Medium::Disk));
    assert_eq!(ev[4], Owned::Cleared);
}

#[test]
fn byte_hashes_become_stable_keys() {
    let (_, ev) = decode(fixture!("vllm_bytes_hashes")).unwrap();
    let (a, b) = (bytes_hash(&[1; 32]), bytes_hash(&[2; 32]));
    assert_ne!(a, b);
    assert_eq!(
        ev[0],
        stored(&[a, b], None, &[1, 2, 3, 4, 5, 6, 7, 8], 4, Medium::Device)
    );
    assert_eq!(ev[1], Owned::Removed(vec![b], Medium::Device));
}

#[test]
fn sglang_positional_with_salt_and_negative_hashes() {
    let (meta, ev) = decode(fixture!("sglang_positional")).unwrap();
    assert_eq!(meta.dp_rank, None);
    assert_eq!(
        ev[0],
        stored(
            &[-5i64 as u64, 2],
            None,
            &[1, 2, 3, 4, 5, 6, 7, 8],
            4,
            Medium::Device
        )
    );
    match &ev[1] {
        Owned::Stored {
            parent,
            medium,
            lora,
            salt,
            ..
        } => {
            assert_eq!(*parent, Some(-5i64 as u64));
            assert_eq!(*medium, Medium::Host);
            assert_eq!(
                lora.as_deref(),
                None,
                "the salt map must not be read as lora_name"
            );
            assert_eq!(salt.as_deref(), Some("tenant-x"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ev[2], Owned::Removed(vec![-5i64 as u64], Medium::Disk));
}

#[test]
fn sglang_tagged() {
    let (_, ev) = decode(fixture!("sglang_0523_tagged")).unwrap();
    assert_eq!(
        ev[0],
        stored(
            &[BIG, 2],
            None,
            &[1, 2, 3, 4, 5, 6, 7, 8],
            4,
            Medium::Device
        )
    );
    match &ev[1] {
        Owned::Stored {
            lora, salt, medium, ..
        } => {
            assert_eq!(
                (lora.as_deref(), salt.as_deref(), *medium),
                (Some("lora-b"), Some("salt"), Medium::Host)
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ev[2], Owned::Removed(vec![8], Medium::Device));
}

/// Decodes one event given as an rmpv value, returning what staging
/// needs to scope it.
fn scope_of(event: rmpv::Value) -> (Option<String>, Option<String>, Option<(usize, Unmatchable)>) {
    let batch = rmpv::Value::Array(vec![1.0f64.into(), rmpv::Value::Array(vec![event])]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).unwrap();
    let mut out = None;
    decode_batch(&buf, &mut Scratch::default(), |e| {
        if let Event::Stored(s) = e {
            out = Some((
                s.lora_name.map(str::to_owned),
                s.cache_salt.map(str::to_owned),
                s.unmatchable_from,
            ));
        }
    })
    .unwrap();
    out.unwrap()
}

#[test]
fn extra_keys_scope_or_exclude_blocks() {
    use rmpv::Value as V;
    let typed = |kind: &str, field: &str, val: V| {
        V::Map(vec![("type".into(), kind.into()), (field.into(), val)])
    };
    // Positional vLLM: lora_id 5, lora_name "a", untyped extra keys:
    // the adapter's own name is fine, anything else is not.
    let positional = V::Array(vec![
        "BlockStored".into(),
        V::Array(vec![1.into(), 2.into()]),
        V::Nil,
        V::Array((0..8).map(V::from).collect()),
        4.into(),
        5.into(),
        "GPU".into(),
        "a".into(),
        V::Array(vec![
            V::Array(vec!["a".into()]),
            V::Array(vec!["img".into()]),
        ]),
    ]);
    assert_eq!(
        scope_of(positional),
        (
            Some("a".into()),
            None,
            Some((1, Unmatchable::LegacyExtraKeys))
        )
    );
    // Tagged vLLM: the adapter named only in extra keys, a salt on the
    // first block, an image from the second.
    let tagged = V::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), V::Array(vec![1.into(), 2.into()])),
        ("parent_block_hash".into(), V::Nil),
        ("token_ids".into(), V::Array((0..8).map(V::from).collect())),
        ("block_size".into(), 4.into()),
        ("lora_id".into(), 5.into()),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), V::Nil),
        (
            "extra_keys".into(),
            V::Array(vec![
                V::Array(vec![
                    typed("lora", "name", "b".into()),
                    typed("cache_salt", "salt", "s".into()),
                ]),
                V::Array(vec![typed("mm", "hash", "h".into())]),
            ]),
        ),
    ]);
    assert_eq!(
        scope_of(tagged),
        (
            Some("b".into()),
            Some("s".into()),
            Some((1, Unmatchable::Multimodal))
        )
    );
}

#[test]
fn map_form_batch() {
    let (meta, ev) = decode(fixture!("vllm_map_batch")).unwrap();
    assert_eq!((meta.ts, meta.dp_rank, meta.events), (2.0, Some(3), 1));
    assert_eq!(ev.len(), 1);
}

#[test]
fn unknown_tags_are_reported_and_skipped() {
    let (_, ev) = decode(fixture!("vllm_unknown_tag")).unwrap();
    assert_eq!(
        ev,
        vec![
            Owned::Unknown("BlockPromoted".into()),
            Owned::Removed(vec![9], Medium::Device)
        ]
    );
}

#[test]
fn malformed_batches_are_errors_with_the_event_index() {
    assert_eq!(decode(&[0xc0]).unwrap_err(), WireError::BatchShape);
    assert_eq!(
        decode(&[0x94, 0, 0x90, 0, 0]).unwrap_err(),
        WireError::BatchLen(4)
    );
    // [1.0, [["BlockStored"]]]: no hashes or tokens.
    let bad = [
        0x92, 0x01, 0x91, 0x91, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e',
        b'd',
    ];
    assert!(matches!(
        decode(&bad),
        Err(WireError::Event { index: 0, .. })
    ));
    // {"events": [], "events": []}: one list per batch.
    let mut twice = vec![0x82];
    for _ in 0..2 {
        twice.push(0xa6);
        twice.extend_from_slice(b"events");
        twice.push(0x90);
    }
    assert!(matches!(decode(&twice), Err(WireError::Event { .. })));
    // Every truncation of a real batch is an error, never a panic.
    let full = fixture!("vllm_v033_tagged");
    for cut in 0..full.len() {
        assert!(decode(&full[..cut]).is_err(), "cut at {cut} decoded");
    }
}

/// `[ts, [{"type": "BlockStored", <field>: <array32 header>}]]`: 47
/// bytes whose one array claims 2^32-1 elements and holds none.
fn hostile_batch(field: &str) -> Vec<u8> {
    let mut b = vec![0x92, 0xcb];
    b.extend_from_slice(&1.5f64.to_be_bytes());
    b.extend_from_slice(&[0x91, 0x82, 0xa4]);
    b.extend_from_slice(b"type");
    b.push(0xab);
    b.extend_from_slice(b"BlockStored");
    b.push(0xa0 | field.len() as u8);
    b.extend_from_slice(field.as_bytes());
    b.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    b
}

fn implausible(e: &WireError) -> bool {
    match e {
        WireError::Event { why, .. } => why.contains("claims 4294967295"),
        WireError::Msgpack(MsgpackError::ImplausibleLength { count, .. }) => {
            *count == u32::MAX as usize
        }
        _ => false,
    }
}

#[test]
fn a_count_beyond_the_frame_is_refused_before_allocating() {
    // Reserving what these claim is 32 GiB (hashes) and 16 GiB (tokens):
    // enough to abort the process.
    for field in ["block_hashes", "token_ids"] {
        let b = hostile_batch(field);
        assert_eq!(b.len(), if field == "token_ids" { 44 } else { 47 });
        let e = decode(&b).unwrap_err();
        assert!(implausible(&e), "{field}: {e}");
    }
    // The same in the positional shape.
    let mut b = vec![0x92, 0x01, 0x91, 0x92, 0xab];
    b.extend_from_slice(b"BlockStored");
    b.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    let e = decode(&b).unwrap_err();
    assert!(implausible(&e), "{e}");
    // A batch map claiming 2^32-1 entries.
    let e = decode(&[0xdf, 0xff, 0xff, 0xff, 0xff, 0xa2, b't', b's', 0x01]).unwrap_err();
    assert!(implausible(&e), "{e}");
    // A scratch reused after the hostile batch still decodes real ones.
    let mut scratch = Scratch::default();
    assert!(decode_batch(&hostile_batch("block_hashes"), &mut scratch, |_| {}).is_err());
    let mut n = 0;
    decode_batch(fixture!("vllm_v033_tagged"), &mut scratch, |_| n += 1).unwrap();
    assert_eq!(n, 5);
}

proptest::proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn corrupted_fixtures_never_panic(at in 0usize..711, val in proptest::prelude::any::<u8>()) {
        let mut b = fixture!("vllm_v033_tagged").to_vec();
        let i = at % b.len();
        b[i] = val;
        let _ = decode(&b);
    }
}
