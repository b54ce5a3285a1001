//! CI's fuzz pass: for every target, the whole checked-in corpus and then
//! a fixed number of deterministic mutants, with the allocation guard
//! installed. A failure prints the input in hex; add it to the corpus (see
//! `fuzz/README.md`) once the decoder is fixed.
//!
//! Long, coverage-guided runs are `cargo xtask fuzz`; this is the short
//! pass that keeps every decoder honest on stable.

use kvgate_fuzz::guard::{self, GuardAlloc};
use kvgate_fuzz::run::{self, Budget};
use kvgate_fuzz::{CHECKS, TARGETS};
use std::path::Path;

#[global_allocator]
static ALLOC: GuardAlloc = GuardAlloc;

/// Mutants per target, on top of the corpus. The targets run in parallel;
/// on two cores in a debug build the whole file takes about 4 s.
const MUTANTS: u64 = 200_000;

/// Fixed so a failure in CI reproduces locally; each target mixes in its
/// name so they do not share one mutation sequence.
const SEED: u64 = 0x6b76_6761_7465_2d66;

fn run_target(name: &str) {
    assert!(guard::installed(), "the allocation guard is not installed");
    guard::set_abort(false);
    let (name, check) = *CHECKS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no target {name}"));
    let dir = run::corpus_root().join(name);
    let corpus = run::load_corpus(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert!(
        !corpus.is_empty(),
        "{name} has no corpus in {}",
        dir.display()
    );
    // Seeds are valid inputs made by the real encoders: a decoder that
    // rejects one has changed format, and its fuzzing would stop at the
    // first check.
    for (file, bytes) in &corpus {
        let verdict = run::run_one(name, check, bytes);
        match verdict {
            Err(why) => panic!("{name}/{file}: {why}"),
            Ok((false, _)) if file.starts_with("seed-") => {
                panic!("{name}/{file}: the decoder rejects this seed")
            }
            Ok(_) => {}
        }
    }
    let inputs: Vec<Vec<u8>> = corpus.into_iter().map(|(_, b)| b).collect();
    let seed = name
        .bytes()
        .fold(SEED, |s, b| s.rotate_left(5) ^ u64::from(b));
    let stats = run::fuzz(
        name,
        check,
        &inputs,
        seed,
        Budget {
            execs: Some(MUTANTS),
            until: None,
        },
    )
    .unwrap_or_else(|f| panic!("{f}"));
    eprintln!(
        "{name}: {} inputs, {} accepted, largest allocation {} bytes, {:.1} s",
        stats.execs,
        stats.accepted,
        stats.peak,
        stats.elapsed.as_secs_f64()
    );
    assert!(stats.peak <= guard::limit());
}

macro_rules! fuzz_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                run_target(stringify!($name));
            }
        )*

        #[test]
        fn every_target_is_tested_and_has_a_libfuzzer_target() {
            let tested = [$(stringify!($name)),*];
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("libfuzzer");
            let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
            for (name, _) in TARGETS {
                assert!(tested.contains(name), "{name} has no test here");
                let file = root.join("fuzz_targets").join(format!("{name}.rs"));
                let src = std::fs::read_to_string(&file)
                    .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                assert!(src.contains(&format!("kvgate_fuzz::{name}(")), "{}", file.display());
                assert!(
                    manifest.contains(&format!("name = \"{name}\"")),
                    "libfuzzer/Cargo.toml has no [[bin]] {name}"
                );
            }
            assert_eq!(tested.len(), TARGETS.len());
        }
    };
}

fuzz_tests!(
    kv_batch, msgpack, kv_replay, snapshot, update, shard, booking, routed, request, promtext,
    dump, template,
);

#[test]
fn the_guard_flags_an_oversized_allocation() {
    assert!(guard::installed());
    guard::set_abort(false);
    // Lazily committed, so it costs no memory; big enough to flag.
    let over = guard::limit() + 1;
    guard::set_quiet(true);
    guard::begin("self-test", b"");
    let v: Vec<u8> = Vec::with_capacity(over);
    drop(std::hint::black_box(v));
    let w = guard::end();
    guard::set_quiet(false);
    assert_eq!(w.over, over);
    assert!(w.peak >= over);
}
