//! One source for every figure the project quotes. The README's headline
//! rows, the report's Summary and architecture.md's per-request cost are
//! blocks between marker comments, rendered from `bench/results/*.json`
//! alone ([`render`]), each figure beside the run it came from: the
//! results' `measured` stamp (date, commit, quick or full, baseline build),
//! which `cargo xtask bench` writes into every results file.
//! `cargo xtask bench` rewrites the blocks after every run, and
//! `cargo xtask bench --report` rewrites them (and the report's sections)
//! from the results without running anything.
//!
//! What the docs check holds the files to ([`check`]):
//!
//! * each block is there, and equal to what the results render: a block
//!   edited by hand, or left behind by new results, fails;
//! * every figure in a block written with a unit ([`UNITS`]: µs, ms, s, %,
//!   ×, req/s, tok/s, MiB, MB, bytes, °C, cores, M for millions) is one the
//!   renderer took from a results file or declared as a target or another
//!   party's published number. The failure names the figure, so a number
//!   typed into a block is found even when the rest of the block is
//!   current, and the renderer itself cannot print a figure no results
//!   file holds.
//!
//! Outside the blocks these files quote no measured figure; they link to
//! the report.

mod render;
#[cfg(test)]
mod tests;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A block's template.
type Renderer = fn(&mut Pen) -> String;

/// The blocks: the file that holds each, its name, and its renderer.
const BLOCKS: [(&str, &str, Renderer); 3] = [
    ("README.md", "headline", render::headline),
    ("bench/report.md", "summary", render::summary),
    ("docs/architecture.md", "cost", render::cost),
];

/// Where the results are, under the repository.
pub const RESULTS_DIR: &str = "bench/results";

/// Units a number is a figure by, longest first so that `ms` is not read
/// as `s`. `M` counts only attached to its number (`1.79M`).
const UNITS: [&str; 14] = [
    "req/s", "tok/s", "bytes", "cores", "MiB", "°C", "µs", "ms", "MB", "s", "%", "×", "M", "KiB",
];

/// Every results file, by name (`overhead` for `overhead.json`).
#[derive(Debug, Default)]
pub struct Results(BTreeMap<String, Value>);

impl Results {
    pub fn load(dir: &Path) -> Result<Results> {
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
            let path = entry?.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            let text = std::fs::read(&path).with_context(|| format!("reading {name}.json"))?;
            let v =
                serde_json::from_slice(&text).with_context(|| format!("parsing {name}.json"))?;
            files.insert(name.to_string(), v);
        }
        Ok(Results(files))
    }

    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name)
    }

    #[cfg(test)]
    pub fn insert(&mut self, name: &str, v: Value) {
        self.0.insert(name.to_string(), v);
    }
}

/// The value at `path` in `v`: keys split at `/`, a number indexes an
/// array, and `field=value` picks the array element whose `field` is
/// `value` (`workloads/name=mooncake/rates/rate_per_s=16`).
pub fn lookup<'v>(v: &'v Value, path: &str) -> Option<&'v Value> {
    path.split('/')
        .try_fold(v, |v, key| match key.split_once('=') {
            Some((field, want)) => v.as_array()?.iter().find(|e| is(&e[field], want)),
            None => match v {
                Value::Array(items) => items.get(key.parse::<usize>().ok()?),
                _ => v.get(key),
            },
        })
}

fn is(v: &Value, want: &str) -> bool {
    match v {
        Value::String(s) => s == want,
        Value::Number(n) => n.as_f64() == want.parse::<f64>().ok(),
        _ => false,
    }
}

/// `x` to `decimals` places, never as `-0`.
pub fn fixed(x: f64, decimals: usize) -> String {
    let s = format!("{x:.decimals$}");
    match s.strip_prefix('-') {
        Some(rest) if rest.chars().all(|c| c == '0' || c == '.') => rest.to_string(),
        _ => s,
    }
}

/// What a renderer writes with: the results, and every figure written so
/// far with where it came from.
pub struct Pen<'r> {
    results: &'r Results,
    /// Each figure as printed, and its source.
    quoted: BTreeMap<String, String>,
    /// What the results lacked.
    missing: Vec<String>,
}

impl<'r> Pen<'r> {
    fn new(results: &'r Results) -> Pen<'r> {
        Pen {
            results,
            quoted: BTreeMap::new(),
            missing: Vec::new(),
        }
    }

    /// The results file `file`, or Null (noted as missing).
    fn file(&mut self, file: &str) -> &'r Value {
        match self.results.get(file) {
            Some(v) => v,
            None => {
                self.missing.push(format!("{file}.json"));
                &Value::Null
            }
        }
    }

    /// The number at `path` in `file`; NaN (noted as missing) when absent.
    pub fn value(&mut self, file: &str, path: &str) -> f64 {
        let v = self.file(file);
        match lookup(v, path).and_then(Value::as_f64) {
            Some(x) => x,
            None => {
                self.missing.push(format!("{file}.json: {path}"));
                f64::NAN
            }
        }
    }

    /// The value at `path` in `file`, whatever it is; Null when absent.
    pub fn raw(&mut self, file: &str, path: &str) -> &'r Value {
        let v = self.file(file);
        lookup(v, path).unwrap_or(&Value::Null)
    }

    /// `x`, computed from `file` as `how` says, to `decimals` places.
    pub fn put(&mut self, file: &str, how: &str, x: f64, decimals: usize) -> String {
        let text = fixed(x, decimals);
        self.quoted
            .entry(text.clone())
            .or_insert_with(|| format!("{file}.json: {how}"));
        text
    }

    /// The number at `path` in `file`, to `decimals` places.
    pub fn num(&mut self, file: &str, path: &str, decimals: usize) -> String {
        let x = self.value(file, path);
        self.put(file, path, x, decimals)
    }

    /// The fraction at `path` in `file` as a percentage.
    pub fn pct(&mut self, file: &str, path: &str, decimals: usize) -> String {
        let x = self.value(file, path) * 100.0;
        self.put(file, path, x, decimals)
    }

    /// The count at `path` in `file` in millions, `1.79M`.
    pub fn millions(&mut self, file: &str, path: &str, decimals: usize) -> String {
        let x = self.value(file, path) / 1e6;
        format!("{}M", self.put(file, path, x, decimals))
    }

    /// `a / b` (a ratio of two figures of `file`), to `decimals` places.
    pub fn ratio(&mut self, file: &str, a: &str, b: &str, decimals: usize) -> String {
        let x = self.value(file, a) / self.value(file, b);
        self.put(file, &format!("{a} / {b}"), x, decimals)
    }

    /// A figure no run measures: a target, or a number another party
    /// published (`whose` says which).
    pub fn stated(&mut self, text: &str, whose: &str) -> String {
        self.quoted
            .entry(text.to_string())
            .or_insert_with(|| format!("stated: {whose}"));
        text.to_string()
    }

    /// The run `file` came from: its date and commit, and "quick" for a
    /// quick run.
    pub fn run(&mut self, file: &str) -> String {
        let m = &self.file(file)["measured"];
        let (Some(date), Some(commit)) = (m["date"].as_str(), m["commit"].as_str()) else {
            self.missing.push(format!("{file}.json: measured"));
            return "?".into();
        };
        let quick = if m["quick"].as_bool() == Some(true) {
            ", quick"
        } else {
            ""
        };
        format!("{date}, `{commit}`{quick}")
    }

    /// The baseline build `file`'s run measured beside this one.
    pub fn baseline(&mut self, file: &str) -> String {
        match self.file(file)["measured"]["baseline"].as_str() {
            Some(rev) => format!("`{rev}`"),
            None => {
                self.missing.push(format!("{file}.json: measured/baseline"));
                "?".into()
            }
        }
    }
}

/// A rendered block.
pub struct Block {
    /// The file that holds it, from the repository's root.
    pub file: &'static str,
    pub name: &'static str,
    pub text: String,
    /// Each figure in it as printed, and its source: what the docs check
    /// holds the file's block to.
    #[cfg(test)]
    pub quoted: BTreeMap<String, String>,
}

/// Every block, rendered from `results`; an error names what the results
/// lack.
pub fn render(results: &Results) -> Result<Vec<Block>> {
    let mut blocks = Vec::new();
    let mut missing = Vec::new();
    for (file, name, renderer) in BLOCKS {
        let mut pen = Pen::new(results);
        let text = renderer(&mut pen);
        missing.extend(pen.missing.into_iter().map(|m| format!("{name}: {m}")));
        let stray: Vec<String> = figures_in(&text)
            .into_iter()
            .filter(|(_, number, _)| !pen.quoted.contains_key(number))
            .map(|(line, number, unit)| format!("line {line}: {number} {unit}"))
            .collect();
        if !stray.is_empty() {
            bail!(
                "the template of block `figures:{name}` writes figures no results file holds: {}",
                stray.join(", ")
            );
        }
        blocks.push(Block {
            file,
            name,
            text,
            #[cfg(test)]
            quoted: pen.quoted,
        });
    }
    if !missing.is_empty() {
        bail!(
            "the results lack what the figures quote: {}",
            missing.join("; ")
        );
    }
    Ok(blocks)
}

/// The line that opens block `name`; it says how the block is made.
fn opening(name: &str) -> String {
    format!(
        "<!-- figures:{name}: written from bench/results by `cargo xtask bench --report` (templates in xtask/src/figures/render.rs); edit those, not this block -->"
    )
}

fn closing(name: &str) -> String {
    format!("<!-- /figures:{name} -->")
}

/// Where block `name`'s content lies in `text` (from after its opening
/// line to its closing line), and the line its content starts on.
fn locate(text: &str, name: &str) -> Option<(usize, usize, usize)> {
    let open = format!("<!-- figures:{name}:");
    let start = text
        .match_indices(&open)
        .map(|(at, _)| at)
        .find(|&at| at == 0 || text.as_bytes()[at - 1] == b'\n')?;
    let content = start + text[start..].find('\n')? + 1;
    let close = closing(name);
    let end = content
        + text[content..]
            .match_indices(&close)
            .map(|(at, _)| at)
            .find(|&at| at == 0 || text.as_bytes()[content + at - 1] == b'\n')?;
    let line = text[..content].matches('\n').count() + 1;
    Some((content, end, line))
}

/// The whole block `name` with `content`, markers included.
pub fn block(name: &str, content: &str) -> String {
    format!("{}\n{content}{}\n", opening(name), closing(name))
}

/// `text` with block `name`'s content, and its opening line, replaced;
/// `None` when `text` has no such block.
fn splice(text: &str, name: &str, content: &str) -> Option<String> {
    let (from, to, _) = locate(text, name)?;
    let open_at = text[..from - 1].rfind('\n').map_or(0, |n| n + 1);
    Some(format!(
        "{}{}\n{content}{}",
        &text[..open_at],
        opening(name),
        &text[to..]
    ))
}

/// Rewrites every block under `root` from its results; the files it
/// changed.
pub fn rewrite(root: &Path) -> Result<Vec<PathBuf>> {
    let results = Results::load(&root.join(RESULTS_DIR))?;
    let mut changed = Vec::new();
    for b in render(&results)? {
        let path = root.join(b.file);
        let old = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let Some(new) = splice(&old, b.name, &b.text) else {
            bail!(
                "{} has no block `figures:{}`: put {:?} and {:?} on lines of their own where it goes",
                b.file,
                b.name,
                opening(b.name),
                closing(b.name)
            );
        };
        if new != old {
            std::fs::write(&path, new)?;
            changed.push(path);
        }
    }
    Ok(changed)
}

/// What the check found wrong in one file.
#[cfg(test)]
#[derive(Debug)]
pub struct Finding {
    pub file: String,
    pub line: usize,
    pub what: String,
}

/// Every block under `root` against what its results render.
#[cfg(test)]
pub fn check(root: &Path) -> Vec<Finding> {
    let problem = |file: &str, what: String| Finding {
        file: file.to_string(),
        line: 0,
        what,
    };
    let results = match Results::load(&root.join(RESULTS_DIR)) {
        Ok(r) => r,
        Err(e) => return vec![problem(RESULTS_DIR, format!("{e:#}"))],
    };
    let blocks = match render(&results) {
        Ok(b) => b,
        Err(e) => return vec![problem(RESULTS_DIR, format!("{e:#}"))],
    };
    let mut found = Vec::new();
    for b in &blocks {
        match std::fs::read_to_string(root.join(b.file)) {
            Ok(text) => found.extend(check_text(b, &text)),
            Err(e) => found.push(problem(b.file, format!("not readable: {e}"))),
        }
    }
    found
}

/// One file's text against its block.
#[cfg(test)]
pub fn check_text(b: &Block, text: &str) -> Vec<Finding> {
    let at = |line: usize, what: String| Finding {
        file: b.file.to_string(),
        line,
        what,
    };
    let Some((from, to, first)) = locate(text, b.name) else {
        return vec![at(
            0,
            format!(
                "no block `figures:{}`; `cargo xtask bench --report` fills one between {:?} and {:?}",
                b.name,
                opening(b.name),
                closing(b.name)
            ),
        )];
    };
    let content = &text[from..to];
    let mut found: Vec<Finding> = figures_in(content)
        .into_iter()
        .filter(|(_, number, _)| !b.quoted.contains_key(number))
        .map(|(line, number, unit)| {
            at(
                first + line - 1,
                format!(
                    "`{number} {unit}` is in no results file (block `figures:{}` quotes only what bench/results hold)",
                    b.name
                ),
            )
        })
        .collect();
    if content != b.text {
        let differs = content
            .lines()
            .zip(b.text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| content.lines().count().min(b.text.lines().count()));
        found.push(at(
            first + differs,
            format!(
                "block `figures:{}` is not what bench/results render; `cargo xtask bench --report` writes it",
                b.name
            ),
        ));
    }
    found
}

/// The figures in `text` written with a unit: (line from 1, the number as
/// written without its sign, the unit). Numbers joined by ` / ` or `–`
/// share the unit after the last (`10 / 118 µs`, `90–97 %`), and a spread
/// in brackets after a number is a figure of its group (`43 [4] / 98 µs`).
/// A number inside a word or a version (`p50`, `2P+2D`, `6f733e4`,
/// `1,000`) is none.
pub fn figures_in(text: &str) -> Vec<(usize, String, &'static str)> {
    let c: Vec<char> = text.chars().collect();
    let mut found = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < c.len() {
        if c[i] == '\n' {
            line += 1;
        }
        if !starts_number(&c, i) {
            i += 1;
            continue;
        }
        let times_before = i > 0 && c[i - 1] == '×';
        let mut group = Vec::new();
        let mut j = i;
        loop {
            let end = number_end(&c, j);
            group.push(c[j..end].iter().collect::<String>());
            j = end;
            if let Some((from, to)) = spread(&c, j) {
                group.push(c[from..to].iter().collect());
                j = to + 1;
            }
            match joined(&c, j) {
                Some(next) if starts_number(&c, next) => j = next,
                _ => break,
            }
        }
        let unit = unit_at(&c, j).or(times_before.then_some("×"));
        if let Some(unit) = unit {
            found.extend(group.into_iter().map(|n| (line, n, unit)));
        }
        i = j;
    }
    found
}

fn starts_number(c: &[char], i: usize) -> bool {
    c.get(i).is_some_and(char::is_ascii_digit)
        && (i == 0 || !(c[i - 1].is_alphanumeric() || matches!(c[i - 1], '_' | '.' | ',')))
}

/// Where the number starting at `i` ends: digits, and a fraction.
fn number_end(c: &[char], i: usize) -> usize {
    let mut j = i;
    while c.get(j).is_some_and(char::is_ascii_digit) {
        j += 1;
    }
    if c.get(j) == Some(&'.') && c.get(j + 1).is_some_and(char::is_ascii_digit) {
        j += 1;
        while c.get(j).is_some_and(char::is_ascii_digit) {
            j += 1;
        }
    }
    j
}

/// A spread ` [n]` at `i`: where its number starts and ends.
fn spread(c: &[char], i: usize) -> Option<(usize, usize)> {
    if c.get(i) != Some(&' ') || c.get(i + 1) != Some(&'[') || !starts_number(c, i + 2) {
        return None;
    }
    let end = number_end(c, i + 2);
    (c.get(end) == Some(&']')).then_some((i + 2, end))
}

/// Where the next number of a group starts, after ` / ` or `–` at `i`.
fn joined(c: &[char], i: usize) -> Option<usize> {
    let at = |k: usize, s: &str| {
        s.chars()
            .enumerate()
            .all(|(n, ch)| c.get(k + n) == Some(&ch))
    };
    if at(i, " / ") {
        Some(i + 3)
    } else if at(i, "–") {
        Some(i + 1)
    } else {
        None
    }
}

/// The unit at `i`, after at most one space; none inside a longer word.
fn unit_at(c: &[char], i: usize) -> Option<&'static str> {
    let attached = UNITS.iter().find(|u| unit_here(c, i, u));
    if attached.is_some() {
        return attached.copied();
    }
    if c.get(i) != Some(&' ') {
        return None;
    }
    UNITS
        .iter()
        .filter(|u| **u != "M")
        .find(|u| unit_here(c, i + 1, u))
        .copied()
}

fn unit_here(c: &[char], i: usize, unit: &str) -> bool {
    let n = unit.chars().count();
    unit.chars()
        .enumerate()
        .all(|(k, ch)| c.get(i + k) == Some(&ch))
        && !c.get(i + n).is_some_and(|ch| ch.is_alphanumeric())
}

/// The `measured` stamp a results file carries: the date, the commit
/// measured (with `+` when the tree had uncommitted changes outside
/// `bench/`), quick or full, and the baseline build's revision.
pub fn stamp(quick: bool, baseline: Option<&str>) -> Value {
    let git = |args: &[&str]| crate::output("git", args).map(|s| s.trim().to_string());
    let commit = git(&["rev-parse", "--short=7", "HEAD"]).unwrap_or_else(|_| "unknown".into());
    let dirty = git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":(exclude)bench",
    ])
    .is_ok_and(|s| !s.is_empty());
    let date = crate::output("date", &["-u", "+%Y-%m-%d"])
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let mut m = json!({
        "date": date,
        "commit": if dirty { format!("{commit}+") } else { commit },
        "quick": quick,
    });
    if let Some(rev) = baseline {
        m["baseline"] =
            json!(git(&["rev-parse", "--short=7", rev]).unwrap_or_else(|_| rev.to_string()));
    }
    m
}
