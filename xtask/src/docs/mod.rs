//! The docs check, a test that `cargo xtask test` runs: every Markdown
//! file of the project (hidden folders and `target/` aside) is read, and
//!
//! * a relative link must name a file or folder that exists, and its
//!   `#anchor` a heading of the Markdown file it names (GitHub's anchors);
//! * a `cargo xtask ...` command, in a shell code block or inline code,
//!   must parse with xtask's own command line ([`crate::cli::Cli`]), which
//!   reads it without running anything;
//! * a command of one of the project's binaries (`kvgate-sidecar`,
//!   `kvgate-sim`, `kvgate-load`, `kvgate-extproc`) must parse with that
//!   binary's command line: the built binary is run with the command's
//!   arguments and `--help` appended, which clap answers with help only
//!   once every flag and value before it parsed (unknown ones fail first).
//!
//! The same test holds the quoted figures (the README's headline rows,
//! the report's Summary, architecture.md's per-request cost) to
//! `bench/results/*.json`: [`crate::figures::check`] says what it checks;
//! its own tests seed made-up figures.
//!
//! Links to other sites (`http:`, `https:`, `mailto:`) are not checked:
//! the machines the tests run on reach nothing outside.

mod markdown;

use crate::cli::Cli;
use clap::Parser;
use clap::error::ErrorKind;
use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

/// The project's binaries whose commands the docs show.
const BINARIES: [&str; 4] = [
    "kvgate-sidecar",
    "kvgate-sim",
    "kvgate-load",
    "kvgate-extproc",
];

/// Code block languages read as shell commands.
const SHELL: [&str; 5] = ["", "sh", "bash", "shell", "console"];

/// One thing wrong in one file.
#[derive(Debug)]
pub struct Problem {
    pub file: PathBuf,
    pub line: usize,
    pub what: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.what)
    }
}

/// Every problem in the Markdown under `root`; the binaries are looked up
/// in `bin_dir`.
pub fn check(root: &Path, bin_dir: &Path) -> Vec<Problem> {
    let mut problems = Vec::new();
    for file in markdown_files(root) {
        let rel = file.strip_prefix(root).unwrap_or(&file).to_path_buf();
        let Ok(text) = std::fs::read_to_string(&file) else {
            problems.push(Problem {
                file: rel,
                line: 0,
                what: "not readable as UTF-8".into(),
            });
            continue;
        };
        let doc = markdown::parse(&text);
        let mut report = |line: usize, what: String| {
            problems.push(Problem {
                file: rel.clone(),
                line,
                what,
            })
        };
        for (line, target) in &doc.links {
            if let Err(what) = check_link(root, &file, &doc, target) {
                report(*line, what);
            }
        }
        for (line, command) in commands(&doc) {
            if let Err(what) = check_command(bin_dir, &command) {
                report(line, format!("`{}`: {what}", command.join(" ")));
            }
        }
    }
    problems
}

fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" {
                    dirs.push(path);
                }
            } else if name.ends_with(".md") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

fn check_link(root: &Path, file: &Path, doc: &markdown::Doc, target: &str) -> Result<(), String> {
    if target.is_empty()
        || ["http:", "https:", "mailto:"]
            .iter()
            .any(|s| target.starts_with(s))
    {
        return Ok(());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    let dir = file.parent().unwrap_or(root);
    let resolved = if path.is_empty() {
        file.to_path_buf()
    } else {
        normalise(&dir.join(path))
    };
    if !resolved.starts_with(root) {
        return Err(format!("link {target:?} leaves the repository"));
    }
    if !resolved.exists() {
        return Err(format!("link {target:?}: no such file"));
    }
    let Some(anchor) = anchor else {
        return Ok(());
    };
    if resolved.extension().is_none_or(|e| e != "md") {
        return Ok(());
    }
    let anchors = if path.is_empty() {
        doc.anchors.clone()
    } else {
        let text = std::fs::read_to_string(&resolved).unwrap_or_default();
        markdown::parse(&text).anchors
    };
    if anchors.iter().any(|a| a == anchor) {
        Ok(())
    } else {
        Err(format!(
            "link {target:?}: no heading has the anchor #{anchor}"
        ))
    }
}

/// `a/b/../c` as `a/c`, without touching the file system.
fn normalise(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The project's commands the doc shows, as words, with their lines.
fn commands(doc: &markdown::Doc) -> Vec<(usize, Vec<String>)> {
    let mut found = Vec::new();
    for (lang, rows) in &doc.blocks {
        if !SHELL.contains(&lang.as_str()) {
            continue;
        }
        // Lines ending in `\` continue on the next.
        let mut pending: Option<(usize, String)> = None;
        for (n, row) in rows {
            let (line, mut text) = pending.take().unwrap_or((*n, String::new()));
            text.push_str(row.trim_start_matches("$ "));
            match text.strip_suffix('\\') {
                Some(head) => pending = Some((line, format!("{head} "))),
                None => found.extend(project_commands(&text).into_iter().map(|c| (line, c))),
            }
        }
    }
    for (line, span) in &doc.spans {
        let words = words(span);
        if is_project_command(&words) {
            found.push((*line, words));
        }
    }
    found
}

/// The commands of a shell line that are the project's: it is cut at
/// its comment and split at `&&`, `||`, `;` and `|`.
fn project_commands(line: &str) -> Vec<Vec<String>> {
    let mut out = vec![Vec::new()];
    for word in words(line) {
        if word.starts_with('#') {
            break;
        }
        if ["&&", "||", ";", "|"].contains(&word.as_str()) {
            out.push(Vec::new());
        } else if let Some(last) = out.last_mut() {
            last.push(word);
        }
    }
    out.retain(|c| is_project_command(c));
    out
}

fn is_project_command(words: &[String]) -> bool {
    match words {
        [cargo, xtask, ..] if cargo == "cargo" && xtask == "xtask" => true,
        [bin, ..] => BINARIES.contains(&bin.as_str()),
        [] => false,
    }
}

/// Shell words: split at blanks outside quotes, quotes removed; `;`, `|`
/// and `&` runs outside quotes are words of their own.
fn words(s: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    // The word has begun: quotes make a word even when empty.
    let mut started = false;
    let mut in_operator = false;
    for c in s.chars() {
        let operator = quote.is_none() && matches!(c, ';' | '|' | '&');
        if (started || !word.is_empty())
            && (c.is_whitespace() && quote.is_none() || operator != in_operator)
        {
            words.push(std::mem::take(&mut word));
            started = false;
        }
        in_operator = operator;
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                started = true;
            }
            (None, c) if c.is_whitespace() => {}
            (None, c) => word.push(c),
        }
    }
    if started || !word.is_empty() {
        words.push(word);
    }
    words
}

fn check_command(bin_dir: &Path, words: &[String]) -> Result<(), String> {
    if words.first().is_some_and(|w| w == "cargo") {
        let args = std::iter::once("cargo xtask").chain(words[2..].iter().map(String::as_str));
        return match Cli::try_parse_from(args) {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::DisplayHelp
                        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                        | ErrorKind::DisplayVersion
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(first_line(&e.to_string())),
        };
    }
    let bin = bin_dir.join(&words[0]);
    let out = Command::new(&bin)
        .args(&words[1..])
        .arg("--help")
        .output()
        .map_err(|e| {
            format!(
                "could not run {} ({e}); `cargo xtask test` builds it",
                bin.display()
            )
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(first_line(&String::from_utf8_lossy(&out.stderr)))
    }
}

fn first_line(s: &str) -> String {
    s.lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("refused")
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests;
