//! kvgate-fuzz: one fuzz target per decoder of outside input.
//!
//! Every byte string kvgate reads from outside its own process passes
//! through one of these decoders: engines' KV-event batches and replay
//! replies (ZMQ), the snapshot, update frames and index shards (sidecar to
//! Envoy), booking and routing reports (Envoy to sidecar), request bodies
//! (clients), workers' Prometheus pages, and peers' index dumps. None may panic, and none may
//! allocate more than a bound ([`guard::DEFAULT_LIMIT`]) whatever a length
//! field claims.
//!
//! Each target is `pub fn <name>(data: &[u8])`, listed in [`TARGETS`], and
//! shared by three harnesses: the libFuzzer project in `libfuzzer/`
//! (coverage-guided, nightly), the stable runner `src/bin/kvgate-fuzz.rs`
//! (`cargo xtask fuzz --engine builtin`), and `tests/fuzz.rs`, which CI runs
//! over the checked-in `corpus/` plus a bounded number of mutants.
//!
//! Where an encoder exists, a target that decodes successfully re-encodes
//! and decodes again and asserts the two agree: a decoder that accepts
//! bytes its own encoder would never write is how silent corruption
//! starts.
#![deny(clippy::unwrap_used)]

pub mod guard;
pub mod mutate;
pub mod run;

use kvgate_core::approx::{self, Routed};
use kvgate_core::plan::request::{self, Endpoint};
use kvgate_core::shard::{self, Holder, ShardView, SlotOverlap};
use kvgate_core::{Snapshot, booking, update};
use kvgate_sidecar::sources::kv::dump;
use kvgate_sidecar::sources::kv::msgpack::Reader;
use kvgate_sidecar::sources::kv::replay::{self, Reply};
use kvgate_sidecar::sources::kv::stage::{Op, Staged};
use kvgate_sidecar::sources::kv::wire::{self, Event, Scratch};
use kvgate_sidecar::sources::metrics::promtext;

/// A target that also says whether the decoder accepted the input; the
/// stable runner keeps accepted mutants as parents (its only feedback).
pub type Check = fn(&[u8]) -> bool;

macro_rules! targets {
    ($($(#[$doc:meta])* $name:ident => $check:ident,)*) => {
        $(
            $(#[$doc])*
            pub fn $name(data: &[u8]) {
                $check(data);
            }
        )*

        /// Every target by name, as libFuzzer and the corpus folders name it.
        pub const TARGETS: &[(&str, fn(&[u8]))] = &[$((stringify!($name), $name as fn(&[u8])),)*];

        /// The same targets, returning whether the input was accepted.
        pub const CHECKS: &[(&str, Check)] = &[$((stringify!($name), $check as Check),)*];
    };
}

targets! {
    /// A vLLM/SGLang KV-event batch (`sidecar/src/kv/wire.rs`): tagged-map
    /// and positional events, decoded by the visitor and then staged with
    /// block hashing, as the subscriber does with every live message.
    kv_batch => check_kv_batch,
    /// The borrowing msgpack reader itself (`sidecar/src/kv/msgpack.rs`):
    /// structural skipping and every typed read, over arbitrary values.
    msgpack => check_msgpack,
    /// A replay reply (`sidecar/src/kv/replay.rs`): the frames a publisher's
    /// ROUTER sends, then the batch they carry. Input: frames, each a length
    /// byte and that many bytes (0xff: the rest of the input).
    kv_replay => check_kv_replay,
    /// The load snapshot (`core/src/snapshot.rs`), with a round trip.
    snapshot => check_snapshot,
    /// The long-poll update frame (`core/src/update.rs`), with a round trip,
    /// and the snapshot and shards inside it decoded as the filter does.
    update => check_update,
    /// An index shard (`core/src/shard.rs`): framing, validation, lookups,
    /// the overlap search, and a byte-exact round trip of valid shards.
    shard => check_shard,
    /// A `POST /v1/bookings` body (`core/src/booking.rs`), byte-exact round trip.
    booking => check_booking,
    /// A `POST /v1/routed` body (`core/src/approx.rs`), byte-exact round trip.
    routed => check_routed,
    /// A client's request body (`filter/src/request.rs`) for both
    /// `/v1/completions` and `/v1/chat/completions`, and the chunk hashing
    /// the filter does with the prompt.
    request => check_request,
    /// A worker's Prometheus page (`sidecar/src/promtext.rs`) and the load
    /// signals extracted from it.
    promtext => check_promtext,
    /// A peer's `GET /dump` (`sidecar/src/sources/kv/dump.rs`), as sent and
    /// resealed (so mutants get past the checksum), with a round trip.
    dump => check_dump,
    /// A prompt template blob (`core/src/text/template.rs`) as the
    /// snapshot service validates it, round trip, and compiled as a router
    /// VM compiles it.
    template => check_template,
}

/// Looks a target up by name.
pub fn check(name: &str) -> Option<Check> {
    CHECKS.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
}

fn check_kv_batch(data: &[u8]) -> bool {
    let mut scratch = Scratch::default();
    let mut visited = 0usize;
    let decoded = wire::decode_batch(data, &mut scratch, |e| {
        visited += 1;
        match e {
            Event::Stored(s) => {
                let _ = s.indexable();
            }
            Event::Removed { .. } | Event::Cleared | Event::Unknown { .. } => {}
        }
    });
    let mut staged = Staged::default();
    let staged_ok = staged.stage(data, 16);
    // Staging is decoding plus hashing: it must agree with the visitor on
    // every input, and leave consistent ranges behind.
    assert_eq!(
        decoded.is_ok(),
        staged_ok.is_ok(),
        "stage and decode disagree"
    );
    let Ok(meta) = decoded else {
        return false;
    };
    // Not equal: a map batch may repeat its "events" key, and every list is
    // visited while the count is the last list's.
    assert!(meta.events <= visited, "fewer visits than events");
    assert_eq!(staged.ops.len(), visited);
    for op in &staged.ops {
        match op {
            Op::Stored { engine, local, .. } => {
                assert_eq!(engine.len(), local.len());
                assert!(engine.end <= staged.engine.len() && local.end <= staged.local.len());
            }
            Op::Pages {
                engine,
                tokens,
                page_size,
                salt,
                ..
            } => {
                assert_eq!(tokens.len(), engine.len() * *page_size as usize);
                assert!(engine.end <= staged.engine.len() && tokens.end <= staged.tokens.len());
                assert!(salt.as_ref().is_none_or(|r| r.end <= staged.text.len()));
            }
            Op::Removed { engine, .. } => assert!(engine.end <= staged.engine.len()),
            Op::Cleared | Op::Skipped | Op::Unknown => {}
        }
    }
    true
}

fn check_msgpack(data: &[u8]) -> bool {
    // Structural walk: every value skipped, position strictly advancing.
    let mut r = Reader::new(data);
    let mut whole = true;
    for _ in 0..64 {
        if r.is_empty() {
            break;
        }
        let before = r.pos();
        if r.skip().is_err() {
            whole = false;
            break;
        }
        assert!(r.pos() > before && r.pos() <= data.len());
    }
    // Typed walk: read each value as what its marker says it is, so the
    // typed readers see every marker too (containers are entered, not
    // skipped).
    let mut r = Reader::new(data);
    for _ in 0..256 {
        let Ok(m) = r.peek() else { break };
        let ok = match m {
            0x90..=0x9f | 0xdc | 0xdd => r.array_len().is_ok(),
            0x80..=0x8f | 0xde | 0xdf => r.map_len().is_ok(),
            0xa0..=0xbf | 0xd9..=0xdb => r.str().is_ok(),
            0xc4..=0xc6 => r.bin().is_ok(),
            0xca | 0xcb => r.f64().is_ok(),
            0xc0 => r.nil().is_ok(),
            0xcc | 0xcd => r.u32().is_ok(),
            _ => r.int().is_ok(),
        };
        assert!(r.pos() <= data.len());
        if !ok {
            break;
        }
    }
    whole
}

/// Splits fuzz input into frames: a length byte and that many bytes each,
/// 0xff meaning the rest of the input (where a payload goes).
pub fn split_frames(mut data: &[u8]) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    while let Some((&len, rest)) = data.split_first() {
        if frames.len() == 6 {
            break;
        }
        let n = if len == 0xff {
            rest.len()
        } else {
            (len as usize).min(rest.len())
        };
        frames.push(rest[..n].to_vec());
        data = &rest[n..];
    }
    frames
}

/// The inverse of [`split_frames`], for writing seeds.
pub fn join_frames(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        if i + 1 == frames.len() || f.len() >= 0xff {
            out.push(0xff);
        } else {
            out.push(f.len() as u8);
        }
        out.extend_from_slice(f);
    }
    out
}

fn check_kv_replay(data: &[u8]) -> bool {
    let frames = split_frames(data);
    match replay::parse_reply(&frames) {
        Ok(Reply::Batch { payload, .. }) => {
            check_kv_batch(payload);
            true
        }
        Ok(Reply::End { .. }) => true,
        Err(_) => false,
    }
}

fn check_snapshot(data: &[u8]) -> bool {
    let header = kvgate_core::snapshot::Header::parse(data);
    let Ok(snap) = Snapshot::decode(data) else {
        return false;
    };
    assert!(header.is_ok(), "decoded a snapshot whose header fails");
    // Compared as bytes, not structs: NaN thresholds are legal and never
    // equal themselves.
    let once = snap.encode().expect("a decoded snapshot must encode");
    let again = Snapshot::decode(&once).expect("an encoded snapshot must decode");
    let twice = again.encode().expect("a decoded snapshot must encode");
    assert_eq!(once, twice, "snapshot round trip changed the bytes");
    true
}

fn check_update(data: &[u8]) -> bool {
    let Ok(u) = update::decode(data) else {
        return false;
    };
    let frame = update::encode(
        u.version,
        u.epoch,
        u.reset,
        u.snapshot,
        u.shards.iter().map(|s| (s.model, s.shard, s.bytes)),
    );
    let back = update::decode(&frame).expect("an encoded update must decode");
    assert_eq!(u, back, "update round trip changed the frame");
    if let Some(snap) = u.snapshot {
        check_snapshot(snap);
    }
    for s in &u.shards {
        check_shard(s.bytes);
    }
    true
}

fn check_shard(data: &[u8]) -> bool {
    let Ok(view) = ShardView::parse(data) else {
        return false;
    };
    let n = view.len();
    // The hashes as the layout places them, read independently of the view.
    let hash_at = |i: usize| {
        let at = 5 + i * 8;
        let mut b = [0u8; 8];
        b.copy_from_slice(&data[at..at + 8]);
        u64::from_le_bytes(b)
    };
    // Lookups and the overlap search must hold up even on a shard that
    // fails validation: a reader may look before it validates.
    let probes = n.min(32);
    for i in 0..probes {
        let _ = view.holders(hash_at(i)).count();
    }
    let _ = view.holders(0).count();
    let _ = view.holders(u64::MAX).count();
    let mut out = [SlotOverlap::default(); 8];
    shard::overlaps(probes, |i, v| v.extend(view.holders(hash_at(i))), &mut out);
    if view.validate().is_err() || data.is_empty() {
        return !data.is_empty();
    }
    // A valid shard is exactly what the encoder writes for its entries.
    let mut entries: Vec<(u64, Vec<Holder>)> = (0..n)
        .map(|i| {
            let h = hash_at(i);
            (h, view.holders(h).collect())
        })
        .collect();
    assert_eq!(shard::encode(&mut entries), data, "shard round trip");
    true
}

fn check_template(data: &[u8]) -> bool {
    use kvgate_core::text::template::{PromptTemplate, Renderer};
    let Ok(t) = PromptTemplate::decode(data) else {
        return false;
    };
    assert_eq!(t.encode(), data, "template round trip");
    if let Ok(mut r) = Renderer::new(t) {
        // Whatever the template, assembling from a skeleton gives what the
        // template renders, for the shape that built it and the next chat.
        for content in ["hi", "there </think> now", "second"] {
            let messages = serde_json::json!([
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": content},
            ]);
            let full = r.chat(&messages, None, None, 0);
            let cached = r.chat_cached(&messages, None, None, 0);
            match (full, cached) {
                (Ok(a), Ok((b, _))) => assert_eq!(a, b, "skeleton differs from the template"),
                (Err(_), Err(_)) => {}
                (a, b) => panic!("template {a:?} but skeleton {b:?}"),
            }
        }
    }
    true
}

fn check_booking(data: &[u8]) -> bool {
    let Ok(events) = booking::decode_batch(data) else {
        return false;
    };
    let mut out = Vec::with_capacity(data.len());
    for e in &events {
        e.encode_into(&mut out);
    }
    // Equal events, not equal bytes: a rejection the previous release
    // wrote with its reason's name is written back with the code.
    assert_eq!(
        booking::decode_batch(&out).as_ref(),
        Ok(&events),
        "booking round trip"
    );
    true
}

fn check_routed(data: &[u8]) -> bool {
    let Ok(records) = Routed::decode_all(data) else {
        return false;
    };
    let mut out = Vec::with_capacity(data.len());
    for r in &records {
        r.encode_into(&mut out);
    }
    assert_eq!(out, data, "routed round trip");
    true
}

fn check_request(data: &[u8]) -> bool {
    let mut accepted = false;
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        let Ok(p) = request::parse(endpoint, data) else {
            continue;
        };
        accepted = true;
        assert!(!p.model.is_empty());
        assert!(p.isl_tokens >= 1, "a prompt counts at least one token");
        if let Some(text) = &p.text {
            let keys = kvgate_core::text::prefix_keys(text, Default::default());
            assert!(keys.len() <= approx::MAX_CHUNKS);
        }
        if let Some(tokens) = &p.tokens {
            let _ = approx::token_chunk_hashes(tokens);
        }
    }
    accepted
}

fn check_promtext(data: &[u8]) -> bool {
    // The scraper refuses pages that are not UTF-8 before parsing.
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let parsed = promtext::parse(text);
    assert!(parsed.samples.len() + parsed.malformed_lines <= text.lines().count());
    let dp = 1 + u32::from(data.first().copied().unwrap_or(0) % 8);
    let start = u32::from(data.last().copied().unwrap_or(0));
    for (dp, start) in [(4, 0), (dp, start)] {
        let ranks = promtext::extract(&parsed, dp, start, 16);
        assert_eq!(ranks.len(), dp as usize);
        for r in &ranks {
            let _ = r.kv_used_blocks();
        }
    }
    !parsed.samples.is_empty()
}

fn check_dump(data: &[u8]) -> bool {
    // As sent: a mutant almost always fails its checksum.
    let _ = dump::decode(data);
    let mut sealed = data.to_vec();
    dump::reseal(&mut sealed);
    let Ok(d) = dump::decode(&sealed) else {
        return false;
    };
    // Re-encoded, the same ranks and blocks come back, in canonical order.
    let again = dump::decode(&dump::encode(d.clone())).expect("an encoded dump decodes");
    assert_eq!(again.groups.len(), d.groups.len());
    let key = |b: &dump::Block| (b.engine, b.seq, b.tiers, b.unmatchable);
    for (a, b) in again.groups.iter().zip(&d.groups) {
        assert_eq!(
            (&a.model, a.worker_id, a.dp_rank, a.block_size),
            (&b.model, b.worker_id, b.dp_rank, b.block_size)
        );
        let (mut x, mut y) = (a.blocks.clone(), b.blocks.clone());
        x.sort_by_key(key);
        y.sort_by_key(key);
        assert_eq!(x, y, "blocks changed in a round trip");
    }
    true
}
