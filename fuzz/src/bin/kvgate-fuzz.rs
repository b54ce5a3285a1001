//! The stable fuzz runner: the built-in mutator over each target for a
//! time budget, with the allocation guard installed. What
//! `cargo xtask fuzz --engine builtin` runs (in release), and the fallback
//! where no nightly toolchain is around for libFuzzer.
//!
//! ```text
//! kvgate-fuzz [--seconds N] [--execs N] [--target NAME]... [--seed S]
//!             [--corpus DIR] [--crashes DIR]
//! ```
//!
//! Prints one line per target; on a failure writes the input to
//! `<crashes>/<target>/crash-<hash>` and exits with status 1.

use kvgate_fuzz::guard::{self, GuardAlloc};
use kvgate_fuzz::run::{self, Budget};
use kvgate_fuzz::{CHECKS, Check};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[global_allocator]
static ALLOC: GuardAlloc = GuardAlloc;

struct Args {
    seconds: Option<f64>,
    execs: Option<u64>,
    targets: Vec<String>,
    seed: u64,
    corpus: PathBuf,
    crashes: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        seconds: None,
        execs: None,
        targets: Vec::new(),
        seed: 1,
        corpus: run::corpus_root(),
        crashes: PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/fuzz/builtin/crashes"
        )),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--seconds" => a.seconds = Some(value()?.parse().map_err(|e| format!("{e}"))?),
            "--execs" => a.execs = Some(value()?.parse().map_err(|e| format!("{e}"))?),
            "--target" => a.targets.push(value()?),
            "--seed" => a.seed = value()?.parse().map_err(|e| format!("{e}"))?,
            "--corpus" => a.corpus = value()?.into(),
            "--crashes" => a.crashes = value()?.into(),
            "-h" | "--help" => {
                return Err(
                    "usage: kvgate-fuzz [--seconds N] [--execs N] [--target NAME]... \
                     [--seed S] [--corpus DIR] [--crashes DIR]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    if a.seconds.is_none() && a.execs.is_none() {
        a.seconds = Some(60.0);
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if !guard::installed() {
        eprintln!("kvgate-fuzz: the allocation guard is not installed");
        return ExitCode::FAILURE;
    }
    // Flag, don't abort, so the runner can name and save the input; an
    // allocation the system refuses still aborts, after the guard has
    // printed the input.
    guard::set_abort(false);
    let chosen: Vec<(&'static str, Check)> = if args.targets.is_empty() {
        CHECKS.to_vec()
    } else {
        let mut v = Vec::new();
        for t in &args.targets {
            match CHECKS.iter().find(|(n, _)| n == t) {
                Some(c) => v.push(*c),
                None => {
                    let names: Vec<&str> = CHECKS.iter().map(|(n, _)| *n).collect();
                    eprintln!("no target {t:?}; targets: {}", names.join(", "));
                    return ExitCode::from(2);
                }
            }
        }
        v
    };
    println!(
        "{:<10} {:>12} {:>11} {:>9} {:>12} {:>7}  result",
        "target", "runs", "execs/s", "accepted", "peak alloc", "wall s"
    );
    let mut failed = false;
    for (name, check) in chosen {
        let corpus = match run::load_corpus(&args.corpus.join(name)) {
            Ok(c) => c.into_iter().map(|(_, b)| b).collect::<Vec<_>>(),
            Err(e) => {
                eprintln!("{name}: corpus: {e}");
                return ExitCode::FAILURE;
            }
        };
        let budget = Budget {
            execs: args.execs,
            until: args
                .seconds
                .map(|s| Instant::now() + Duration::from_secs_f64(s)),
        };
        match run::fuzz(name, check, &corpus, args.seed, budget) {
            Ok(s) => println!(
                "{name:<10} {:>12} {:>11.0} {:>8.1}% {:>12} {:>7.1}  ok",
                s.execs,
                s.execs_per_s(),
                100.0 * s.accepted as f64 / s.execs.max(1) as f64,
                s.peak,
                s.elapsed.as_secs_f64()
            ),
            Err(f) => {
                failed = true;
                let dir = args.crashes.join(name);
                let path = dir.join(run::crash_name(&f.input));
                let saved = std::fs::create_dir_all(&dir)
                    .and_then(|()| std::fs::write(&path, &f.input))
                    .map(|()| path.display().to_string())
                    .unwrap_or_else(|e| format!("(not saved: {e})"));
                println!("{name:<10} FAILED: {} -> {saved}", f.why);
                eprintln!("{f}");
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
