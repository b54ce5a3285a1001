//! Just enough Markdown for the docs check: headings and their GitHub
//! anchors, links, fenced code blocks and inline code, each with its line.
//! Fenced blocks hide their content from everything but command reading,
//! and inline code hides its content from link reading, as a renderer
//! does.

use std::collections::HashMap;

/// Numbered lines: `(line, text)`.
pub type Rows = Vec<(usize, String)>;

/// What the check reads from one Markdown file.
#[derive(Debug, Default)]
pub struct Doc {
    /// The anchors GitHub gives the headings, in order.
    pub anchors: Vec<String>,
    /// Link targets, `(line, target)`.
    pub links: Vec<(usize, String)>,
    /// Fenced code blocks: their language and `(line, text)` rows.
    pub blocks: Vec<(String, Rows)>,
    /// Inline code spans, `(line, text)`, line breaks as spaces.
    pub spans: Vec<(usize, String)>,
}

pub fn parse(text: &str) -> Doc {
    let mut doc = Doc::default();
    let mut slugs = Slugs::default();
    // Text outside fences, fences blanked, so offsets keep their lines.
    let mut prose = String::with_capacity(text.len());
    // An open fence: its marker, language and rows so far.
    let mut fence: Option<(String, String, Rows)> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = line.trim_start();
        let marker: String = trimmed
            .chars()
            .take_while(|c| *c == '`' || *c == '~')
            .collect();
        if let Some((open, _, rows)) = &mut fence {
            let closes = marker.len() >= open.len() && marker.starts_with(&open[..1]);
            if !closes {
                rows.push((n, line.to_string()));
            }
            prose.push('\n');
            if closes && let Some((_, lang, rows)) = fence.take() {
                doc.blocks.push((lang, rows));
            }
            continue;
        }
        if marker.len() >= 3
            && (marker.chars().all(|c| c == '`') || marker.chars().all(|c| c == '~'))
        {
            let lang = trimmed[marker.len()..].trim().to_string();
            fence = Some((marker, lang, Vec::new()));
            prose.push('\n');
            continue;
        }
        let hashes = trimmed.chars().take_while(|c| *c == '#').count();
        if (1..=6).contains(&hashes) && trimmed[hashes..].starts_with(' ') {
            doc.anchors.push(slugs.next(&trimmed[hashes..]));
        }
        prose.push_str(line);
        prose.push('\n');
    }
    let line_of = |at: usize| prose[..at].matches('\n').count() + 1;
    let mut rest = prose.as_str();
    let mut offset = 0;
    while let Some(tick) = rest.find('`') {
        scan_links(&rest[..tick], offset, &line_of, &mut doc.links);
        let run = rest[tick..].chars().take_while(|c| *c == '`').count();
        let body = &rest[tick + run..];
        let close = find_run(body, run);
        let Some(close) = close else {
            // An unclosed run is literal text.
            offset += tick + run;
            rest = &rest[tick + run..];
            continue;
        };
        let span = body[..close]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        doc.spans.push((line_of(offset + tick), span));
        let consumed = tick + run + close + run;
        offset += consumed;
        rest = &rest[consumed..];
    }
    scan_links(rest, offset, &line_of, &mut doc.links);
    doc
}

/// Where a run of exactly `run` backticks starts in `s`.
fn find_run(s: &str, run: usize) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'`' {
            let len = bytes[i..].iter().take_while(|b| **b == b'`').count();
            if len == run {
                return Some(i);
            }
            i += len;
        } else {
            i += 1;
        }
    }
    None
}

/// `[text](target)` and `![alt](target)` links in `s`, which starts at
/// byte `offset` of the prose.
fn scan_links(
    s: &str,
    offset: usize,
    line_of: &dyn Fn(usize) -> usize,
    links: &mut Vec<(usize, String)>,
) {
    let mut from = 0;
    while let Some(at) = s[from..].find("](") {
        let start = from + at + 2;
        let Some(end) = s[start..].find(')') else {
            return;
        };
        let target = s[start..start + end].trim();
        // A title after the target ("...") is not part of it.
        let target = target.split_whitespace().next().unwrap_or("");
        links.push((line_of(offset + start), target.to_string()));
        from = start + end;
    }
}

/// GitHub's heading anchors: the rendered text lowercased, everything but
/// letters, digits, `-`, `_` and spaces dropped, spaces as `-`; a repeated
/// anchor gets `-1`, `-2`, ...
#[derive(Default)]
struct Slugs {
    seen: HashMap<String, usize>,
}

impl Slugs {
    fn next(&mut self, heading: &str) -> String {
        let base = slug(heading);
        let n = self.seen.entry(base.clone()).or_insert(0);
        let anchor = if *n == 0 { base } else { format!("{base}-{n}") };
        *n += 1;
        anchor
    }
}

pub fn slug(heading: &str) -> String {
    rendered(heading.trim())
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// A heading's text as rendered: links by their text, no code or
/// emphasis markers.
fn rendered(heading: &str) -> String {
    let mut out = String::new();
    let mut rest = heading;
    while let Some(at) = rest.find("](") {
        let Some(end) = rest[at..].find(')') else {
            break;
        };
        out.push_str(&rest[..at]);
        rest = &rest[at + end + 1..];
    }
    out.push_str(rest);
    out.chars()
        .filter(|c| !matches!(c, '`' | '*' | '['))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_follow_github() {
        let doc = parse(
            "# kvgate\n## Index recovery from a peer (`GET /dump`, `[indexer] peers`)\n\
             ## Sidecar → Envoy: long-poll updates\n## Sidecar (TOML)\n## Sidecar (TOML)\n\
             ## See [the cost](selection.md) here\n```sh\n# not a heading\n```\n",
        );
        assert_eq!(
            doc.anchors,
            [
                "kvgate",
                "index-recovery-from-a-peer-get-dump-indexer-peers",
                "sidecar--envoy-long-poll-updates",
                "sidecar-toml",
                "sidecar-toml-1",
                "see-the-cost-here",
            ]
        );
    }

    #[test]
    fn code_hides_links_and_keeps_its_lines() {
        let doc = parse(
            "see [a](a.md) and `[b](b.md)`, ``x ` y``\nrun `cargo xtask\nbench --quick`\n\
             ~~~sh\n[c](c.md)\ncargo xtask demo\n~~~\n[d](d.md#x \"title\")\n",
        );
        assert_eq!(
            doc.links,
            [(1, "a.md".to_string()), (8, "d.md#x".to_string())]
        );
        assert_eq!(
            doc.spans,
            [
                (1, "[b](b.md)".to_string()),
                (1, "x ` y".to_string()),
                (2, "cargo xtask bench --quick".to_string()),
            ]
        );
        assert_eq!(
            doc.blocks,
            [(
                "sh".to_string(),
                vec![
                    (5, "[c](c.md)".to_string()),
                    (6, "cargo xtask demo".to_string())
                ]
            )]
        );
    }
}
