//! The loop the stable harnesses share (the CI test and the runner binary):
//! replay a corpus, then feed mutants, each input watched for panics and
//! for allocations over the bound.
//!
//! Allocation checks only mean something in a process that installed
//! [`GuardAlloc`](crate::guard::GuardAlloc); both harnesses assert
//! [`guard::installed`] first.

use crate::Check;
use crate::guard::{self, Watch};
use crate::mutate::Mutator;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The checked-in corpus: one folder per target.
pub fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

/// The files of one corpus folder, sorted by name so runs are
/// reproducible. A missing folder is an empty corpus.
pub fn load_corpus(dir: &Path) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !entry.file_type()?.is_file() {
            continue;
        }
        out.push((name, std::fs::read(entry.path())?));
    }
    out.sort();
    Ok(out)
}

/// An input that broke a target.
#[derive(Debug, Clone)]
pub struct Failure {
    pub target: &'static str,
    pub input: Vec<u8>,
    pub why: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "target {}: {} on an input of {} bytes: {}",
            self.target,
            self.why,
            self.input.len(),
            hex(&self.input)
        )
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs one input: whether the decoder accepted it and what it allocated,
/// or why it failed (a panic, or an allocation over the bound).
pub fn run_one(target: &'static str, check: Check, data: &[u8]) -> Result<(bool, Watch), String> {
    guard::begin(target, data);
    let result = panic::catch_unwind(AssertUnwindSafe(|| check(data)));
    let watch = guard::end();
    match result {
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".into());
            Err(format!("panicked: {msg}"))
        }
        Ok(_) if watch.over > 0 => Err(format!(
            "allocated {} bytes at once, over the {}-byte bound",
            watch.over,
            guard::limit()
        )),
        Ok(accepted) => Ok((accepted, watch)),
    }
}

/// When to stop mutating: after `execs` inputs, or at `until`, whichever
/// is set and comes first.
#[derive(Debug, Clone, Copy, Default)]
pub struct Budget {
    pub execs: Option<u64>,
    pub until: Option<Instant>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    /// Inputs run, corpus included.
    pub execs: u64,
    /// Inputs the decoder accepted.
    pub accepted: u64,
    /// Largest single allocation any input caused.
    pub peak: usize,
    /// Parents in the pool at the end.
    pub pool: usize,
    pub elapsed: Duration,
}

impl Stats {
    pub fn execs_per_s(&self) -> f64 {
        self.execs as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Mutants kept as parents beyond the corpus.
const POOL_EXTRA: usize = 512;

/// Runs every corpus input, then mutants until the budget is spent.
///
/// Without coverage, the only feedback is acceptance: a mutant the decoder
/// accepted is sometimes kept as a parent, so mutations accumulate in
/// inputs that still reach deep into the format instead of all dying at
/// the first length check.
pub fn fuzz(
    target: &'static str,
    check: Check,
    corpus: &[Vec<u8>],
    seed: u64,
    budget: Budget,
) -> Result<Stats, Failure> {
    let started = Instant::now();
    let mut stats = Stats::default();
    let fail = |input: &[u8], why: String| Failure {
        target,
        input: input.to_vec(),
        why,
    };
    for input in corpus {
        let (accepted, w) = run_one(target, check, input).map_err(|why| fail(input, why))?;
        stats.execs += 1;
        stats.accepted += u64::from(accepted);
        stats.peak = stats.peak.max(w.peak);
    }
    let mut pool: Vec<Vec<u8>> = if corpus.is_empty() {
        vec![Vec::new()]
    } else {
        corpus.to_vec()
    };
    let fixed = pool.len();
    let mut m = Mutator::new(seed);
    let mut buf = Vec::new();
    let mut n = 0u64;
    loop {
        if budget.execs.is_some_and(|e| n >= e) {
            break;
        }
        // Reading the clock costs more than some targets; look now and then.
        if n.is_multiple_of(256) && budget.until.is_some_and(|t| Instant::now() >= t) {
            break;
        }
        if budget.execs.is_none() && budget.until.is_none() {
            break;
        }
        let parent = m.rng().below(pool.len());
        m.mutate(&pool[parent], &pool, &mut buf);
        let (accepted, w) = run_one(target, check, &buf).map_err(|why| fail(&buf, why))?;
        n += 1;
        stats.execs += 1;
        stats.peak = stats.peak.max(w.peak);
        if accepted {
            stats.accepted += 1;
            if pool.len() < fixed + POOL_EXTRA {
                if m.rng().one_in(4) {
                    pool.push(buf.clone());
                }
            } else if m.rng().one_in(16) {
                let i = fixed + m.rng().below(POOL_EXTRA);
                pool[i].clone_from(&buf);
            }
        }
    }
    stats.pool = pool.len();
    stats.elapsed = started.elapsed();
    Ok(stats)
}

/// A file name for a failing input, stable for the same bytes.
pub fn crash_name(input: &[u8]) -> String {
    // FNV-1a: enough to tell crashes apart, no dependency.
    let h = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    });
    format!("crash-{h:016x}")
}
