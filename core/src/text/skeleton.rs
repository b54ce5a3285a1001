//! Rendering a chat without running its template on every request.
//!
//! Interpreting a chat template costs microseconds per request however
//! short the chat (macros, namespaces, loops), several times that in
//! Envoy's V8, and it is most of what precise text routing adds to a
//! decision. Yet for the chats clients send, plain `{role, content}`
//! messages, the output is fixed text around the contents, and it
//! changes only with the conversation's shape: its roles, the template's
//! arguments, the date. A [`Skeletons`] cache renders each shape once with
//! sentinel contents, records the output as literal text and content
//! slots, and assembles later chats of that shape by substitution.
//!
//! Substitution is only right where the template treats a content as an
//! opaque string, so a skeleton is used only when all of this holds:
//! * the shape rendered twice, with sentinels of other lengths and bytes
//!   (a quote, a backslash, a newline), gives the same skeleton: a template
//!   that escapes, slices, changes the case of or drops a content, or that
//!   branches on such bytes, fails this and its shape is always rendered;
//! * the request's contents are not empty and have no whitespace at either
//!   end (what `trim` and `strip` would change);
//! * no content equals a string the template compares with `==`, or holds
//!   one the template looks for in a string (`"</think>" in content`,
//!   `.split(...)`, `.startswith(...)`: [`Guards`]);
//! * every `strftime_now` the shape called formats the same now.
//!
//! Anything else is rendered by the template, so the cache changes
//! nothing but the cost: tests check both paths against `transformers`.

use super::jinja::{self, Compiled, TemplateError};
use serde_json::{Map, Value};
use std::collections::HashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Shapes kept per model: a conversation's shape is its role sequence, so
/// long multi-turn traffic makes many; past this the cache starts over.
const MAX_SHAPES: usize = 512;

/// Brackets a sentinel: private-use code points no template emits.
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Content(usize),
}

#[derive(Debug, Clone)]
struct Skeleton {
    parts: Vec<Part>,
    literal_bytes: usize,
    /// `strftime_now` calls while rendering: (format, what it gave).
    clock: Vec<(String, String)>,
    /// The last second [`Skeleton::current`] found it current: chats come
    /// many a second, and formatting a date is not free in Envoy's VM.
    current_at: Option<u64>,
}

impl Skeleton {
    /// Every `strftime_now` it recorded formats `unix_s` the same.
    fn current(&mut self, unix_s: u64) -> bool {
        if self.clock.is_empty() || self.current_at == Some(unix_s) {
            return true;
        }
        let current = self
            .clock
            .iter()
            .all(|(f, out)| jinja::strftime(f, unix_s) == *out);
        if current {
            self.current_at = Some(unix_s);
        }
        current
    }
}

/// The strings a template tests contents against, read from its source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Guards {
    /// Compared whole (`x == "text"`).
    equal: Vec<String>,
    /// Looked for inside a string (`"</think>" in x`, `x.split("</think>")`).
    inside: Vec<String>,
}

/// String methods and filters whose literal arguments inspect a string.
const INSPECTING: [&str; 17] = [
    "split",
    "rsplit",
    "startswith",
    "endswith",
    "replace",
    "find",
    "rfind",
    "index",
    "rindex",
    "count",
    "partition",
    "rpartition",
    "removeprefix",
    "removesuffix",
    "strip",
    "lstrip",
    "rstrip",
];

impl Guards {
    /// Reads the string literals of `source`'s tags and expressions that
    /// are compared with `==`/`!=`, tested with `in`, or passed to a string
    /// method or filter that inspects its subject. Whitespace-only
    /// literals are left out: the edge-whitespace rule covers `strip`'s,
    /// and a sentinel's newline makes a branch on `"\n" in x` fail the
    /// skeleton's check.
    pub fn of(source: &str) -> Guards {
        let mut g = Guards::default();
        for code in code_regions(source) {
            let toks = tokens(code);
            for (i, t) in toks.iter().enumerate() {
                let Tok::Str(s) = t else { continue };
                if s.trim().is_empty() {
                    continue;
                }
                let prev = i.checked_sub(1).map(|j| &toks[j]);
                let next = toks.get(i + 1);
                let compared = matches!(prev, Some(Tok::Op(o)) if o == "==" || o == "!=")
                    || matches!(next, Some(Tok::Op(o)) if o == "==" || o == "!=");
                let tested_in = matches!(next, Some(Tok::Word(w)) if w == "in" || w == "not");
                let argument = call_of(&toks, i).is_some_and(|m| INSPECTING.contains(&m));
                if tested_in || argument {
                    g.inside.push(s.clone());
                } else if compared {
                    g.equal.push(s.clone());
                }
            }
        }
        for v in [&mut g.equal, &mut g.inside] {
            v.sort();
            v.dedup();
        }
        g
    }

    /// Whether the template would treat `content` as it treats a sentinel.
    fn admit(&self, content: &str) -> bool {
        !content.is_empty()
            && !content.starts_with(is_py_space)
            && !content.ends_with(is_py_space)
            && !self.equal.iter().any(|e| e == content)
            && !self.inside.iter().any(|s| content.contains(s.as_str()))
    }
}

/// Python's `str.isspace`, which `strip` and Jinja's `trim` use.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The method or filter whose arguments hold token `i` (through tuples
/// and lists), if any; `None` inside a plain function's arguments.
fn call_of(toks: &[Tok], i: usize) -> Option<&str> {
    let mut depth = 0i32;
    for j in (0..i).rev() {
        match &toks[j] {
            Tok::Op(o) if o == ")" || o == "]" => depth += 1,
            Tok::Op(o) if (o == "(" || o == "[") && depth > 0 => depth -= 1,
            Tok::Op(o) if o == "(" => {
                let Some(Tok::Word(name)) = j.checked_sub(1).map(|k| &toks[k]) else {
                    continue; // a tuple or grouping: look further out
                };
                // `.name(` or `| name(`: a method or filter of a value.
                let of_value = matches!(j.checked_sub(2).map(|k| &toks[k]),
                    Some(Tok::Op(dot)) if dot == "." || dot == "|");
                return of_value.then_some(name.as_str());
            }
            _ => {}
        }
    }
    None
}

/// The insides of `{{ }}` and `{% %}`; comments and text left out.
fn code_regions(src: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(at) = rest.find('{') {
        let after = &rest[at + 1..];
        let close = match after.as_bytes().first() {
            Some(b'{') => "}}",
            Some(b'%') => "%}",
            Some(b'#') => {
                rest = after.find("#}").map_or("", |e| &after[e + 2..]);
                continue;
            }
            _ => {
                rest = after;
                continue;
            }
        };
        let body = &after[1..];
        let end = code_end(body, close).unwrap_or(body.len());
        out.push(&body[..end]);
        rest = body.get(end + close.len()..).unwrap_or("");
    }
    out
}

/// Where `close` ends a tag, skipping string literals that contain it.
fn code_end(body: &str, close: &str) -> Option<usize> {
    let b = body.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            q @ (b'"' | b'\'') => i = skip_string(b, i, q),
            _ if body[i..].starts_with(close) => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// The index after the string literal opening at `i`.
fn skip_string(b: &[u8], mut i: usize, quote: u8) -> usize {
    i += 1;
    while i < b.len() && b[i] != quote {
        i += if b[i] == b'\\' { 2 } else { 1 };
    }
    i + 1
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Str(String),
    Word(String),
    Op(String),
}

fn tokens(code: &str) -> Vec<Tok> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() || c == b'-' && (i == 0 || i + 1 == b.len()) {
            i += 1;
        } else if c == b'"' || c == b'\'' {
            let end = skip_string(b, i, c).min(b.len());
            let raw = code.get(i + 1..end.saturating_sub(1)).unwrap_or_default();
            out.push(Tok::Str(unescape(raw)));
            i = end;
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Word(code[start..i].to_string()));
        } else {
            let two = code.get(i..i + 2).filter(|t| matches!(*t, "==" | "!="));
            let op = two.unwrap_or_else(|| code.get(i..i + 1).unwrap_or_default());
            out.push(Tok::Op(op.to_string()));
            i += op.len().max(1);
        }
    }
    out
}

/// Jinja's escapes in a string literal, as far as guards need them.
fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut it = raw.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some(other) => out.push(other),
            None => {}
        }
    }
    out
}

/// A model's skeletons, one per conversation shape seen.
#[derive(Debug, Default)]
pub struct Skeletons {
    guards: Guards,
    /// `None`: that shape fails the check and is always rendered.
    by_shape: HashMap<u64, Option<Skeleton>>,
    built: u64,
    used: u64,
}

/// What the cache did for one render, for counters and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Assembled from a skeleton.
    Skeleton,
    /// The template ran: a new shape, or a chat the skeleton cannot take.
    Template,
}

impl Skeletons {
    pub fn new(template_source: &str) -> Skeletons {
        Skeletons {
            guards: Guards::of(template_source),
            ..Default::default()
        }
    }

    /// Skeletons built and chats assembled from one, so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.built, self.used)
    }

    /// Renders a chat as running the template does, from a skeleton where
    /// the chat allows.
    pub(super) fn chat(
        &mut self,
        c: &Compiled,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: Option<&Map<String, Value>>,
        unix_s: u64,
    ) -> Result<(String, Path), TemplateError> {
        let messages = &*c.joined(messages);
        let assembled = match self.plain(messages, tools) {
            Some(contents) => self
                .skeleton(c, messages, kwargs, unix_s)
                .map(|s| assemble(s, &contents)),
            None => None,
        };
        if let Some(text) = assembled {
            self.used += 1;
            return Ok((text, Path::Skeleton));
        }
        Ok((
            c.chat_joined(messages, tools, kwargs, unix_s)?,
            Path::Template,
        ))
    }

    /// A chat of plain (role, content) turns assembled from its shape's
    /// skeleton, when one is built and reads the clock as it would now:
    /// what [`Skeletons::chat`] gives a chat of such messages. `None`:
    /// that needs the messages' tree.
    pub(super) fn assemble_turns(
        &mut self,
        turns: &[(&str, &str)],
        tools: Option<&Value>,
        kwargs: Option<&Map<String, Value>>,
        unix_s: u64,
    ) -> Option<String> {
        if tools.is_some_and(|t| !t.is_null()) || !turns.iter().all(|(_, c)| self.guards.admit(c)) {
            return None;
        }
        let key = shape_key(turns.iter().map(|(role, _)| *role), kwargs);
        let s = self.by_shape.get_mut(&key)?.as_mut()?;
        if !s.current(unix_s) {
            return None;
        }
        let contents: Vec<&str> = turns.iter().map(|(_, c)| *c).collect();
        let text = assemble(s, &contents);
        self.used += 1;
        Some(text)
    }

    /// The skeleton of the chat's shape, built if it is new or read the
    /// clock differently now; `None` if the shape fails the check.
    fn skeleton(
        &mut self,
        c: &Compiled,
        messages: &Value,
        kwargs: Option<&Map<String, Value>>,
        unix_s: u64,
    ) -> Option<&Skeleton> {
        let roles = messages
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| m.get("role").and_then(Value::as_str).unwrap_or_default());
        let key = shape_key(roles, kwargs);
        let stale = match self.by_shape.get_mut(&key) {
            None => true,
            Some(None) => return None,
            Some(Some(s)) => !s.current(unix_s),
        };
        if stale {
            if self.by_shape.len() >= MAX_SHAPES {
                self.by_shape.clear();
            }
            self.built += 1;
            self.by_shape
                .insert(key, build(c, messages, kwargs, unix_s));
        }
        self.by_shape.get(&key)?.as_ref()
    }

    /// The contents of a chat of plain `{role, content}` messages that the
    /// guards admit; `None` if the template must run.
    fn plain<'a>(&self, messages: &'a Value, tools: Option<&Value>) -> Option<Vec<&'a str>> {
        if tools.is_some_and(|t| !t.is_null()) {
            return None;
        }
        messages
            .as_array()?
            .iter()
            .map(|m| {
                let m = m.as_object()?;
                if m.len() != 2 || !m.get("role")?.is_string() {
                    return None;
                }
                let content = m.get("content")?.as_str()?;
                self.guards.admit(content).then_some(content)
            })
            .collect()
    }
}

/// Roles in order and the template's arguments: what a skeleton depends on.
fn shape_key<'a>(roles: impl Iterator<Item = &'a str>, kwargs: Option<&Map<String, Value>>) -> u64 {
    // Each role hashed on the hash before it: XXH3 takes each one's
    // length in, so the roles cannot run into each other, and one-shot
    // hashes of a few bytes are a fraction of a streaming hasher's code.
    let mut h = roles.fold(SHAPE_SEED, |h, role| xxh3_64_with_seed(role.as_bytes(), h));
    h = xxh3_64_with_seed(&[0xff], h);
    if let Some(k) = kwargs {
        h = xxh3_64_with_seed(serde_json::to_string(k).unwrap_or_default().as_bytes(), h);
    }
    h
}

const SHAPE_SEED: u64 = 0x5348_4150_455f_4b45;

fn with_contents(messages: &Value, sentinel: impl Fn(usize) -> String) -> Value {
    let list = messages.as_array().cloned().unwrap_or_default();
    Value::Array(
        list.into_iter()
            .enumerate()
            .map(|(i, mut m)| {
                if let Some(o) = m.as_object_mut() {
                    o.insert("content".into(), Value::String(sentinel(i)));
                }
                m
            })
            .collect(),
    )
}

fn short(i: usize) -> String {
    format!("{OPEN}{i}{CLOSE}")
}

fn long(i: usize) -> String {
    format!("{OPEN}\"\\\n{i}:kvgate sentinel{CLOSE}")
}

fn build(
    c: &Compiled,
    messages: &Value,
    kwargs: Option<&Map<String, Value>>,
    unix_s: u64,
) -> Option<Skeleton> {
    let n = messages.as_array().map_or(0, Vec::len);
    let (a, clock) = jinja::recording_clock(|| {
        c.chat_joined(&with_contents(messages, short), None, kwargs, unix_s)
    });
    let b = c
        .chat_joined(&with_contents(messages, long), None, kwargs, unix_s)
        .ok()?;
    let parts = parse(&a.ok()?, n)?;
    let literal_bytes = parts
        .iter()
        .map(|p| match p {
            Part::Text(t) => t.len(),
            Part::Content(_) => 0,
        })
        .sum();
    let s = Skeleton {
        parts,
        literal_bytes,
        clock,
        current_at: None,
    };
    let longs: Vec<String> = (0..n).map(long).collect();
    let filled = assemble(&s, &longs.iter().map(String::as_str).collect::<Vec<_>>());
    (filled == b).then_some(s)
}

/// Splits a sentinel render into text and content slots; `None` if a
/// sentinel is malformed or names no message.
fn parse(rendered: &str, n: usize) -> Option<Vec<Part>> {
    let mut parts = Vec::new();
    let mut rest = rendered;
    while let Some(at) = rest.find(OPEN) {
        if at > 0 {
            parts.push(Part::Text(rest[..at].to_string()));
        }
        let after = &rest[at + OPEN.len_utf8()..];
        let end = after.find(CLOSE)?;
        let i: usize = after[..end].parse().ok()?;
        if i >= n {
            return None;
        }
        parts.push(Part::Content(i));
        rest = &after[end + CLOSE.len_utf8()..];
    }
    if rest.contains(CLOSE) {
        return None;
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_string()));
    }
    Some(parts)
}

fn assemble(s: &Skeleton, contents: &[&str]) -> String {
    let cap = s.literal_bytes
        + s.parts
            .iter()
            .map(|p| match p {
                Part::Content(i) => contents.get(*i).map_or(0, |c| c.len()),
                Part::Text(_) => 0,
            })
            .sum::<usize>();
    let mut out = String::with_capacity(cap);
    for p in &s.parts {
        match p {
            Part::Text(t) => out.push_str(t),
            Part::Content(i) => out.push_str(contents.get(*i).copied().unwrap_or_default()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::template::Renderer;
    use crate::text::template::tests::renderer;
    use serde_json::json;

    /// Renders twice through the cache and once by the template; returns
    /// the text and the second render's path.
    fn both(r: &mut Renderer, msgs: &Value) -> (String, Path) {
        let want = r.chat(msgs, None, None, 1_721_999_109).unwrap();
        let (first, _) = r.chat_cached(msgs, None, None, 1_721_999_109).unwrap();
        let (second, path) = r.chat_cached(msgs, None, None, 1_721_999_109).unwrap();
        assert_eq!(first, want);
        assert_eq!(second, want);
        (want, path)
    }

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn a_shape_is_rendered_once_then_assembled() {
        let mut r = renderer(CHATML);
        let a =
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]);
        let (text, path) = both(&mut r, &a);
        assert_eq!(
            text,
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(path, Path::Skeleton);
        // Same roles, other contents: no new skeleton.
        let b = json!([{"role": "system", "content": "x"}, {"role": "user", "content": "{{ not jinja }}"}]);
        assert_eq!(both(&mut r, &b).1, Path::Skeleton);
        assert_eq!(r.skeleton_counts(), (1, 4));
        // Another role sequence is another shape.
        let c = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(both(&mut r, &c).1, Path::Skeleton);
        assert_eq!(r.skeleton_counts().0, 2);
    }

    #[test]
    fn contents_a_template_treats_differently_are_rendered() {
        let src = "{% for m in messages %}{% if '</think>' in m.content %}{{ m.content.split('</think>')[-1] | trim }}{% else %}{{ m.content | trim }}{% endif %}|{% endfor %}";
        let mut r = renderer(src);
        for content in ["a</think>b", "  padded ", "\nx", "", "plain"] {
            let msgs = json!([{"role": "assistant", "content": content}]);
            let (_, path) = both(&mut r, &msgs);
            let want = if content == "plain" {
                Path::Skeleton
            } else {
                Path::Template
            };
            assert_eq!(path, want, "{content:?}");
        }
        // Compared whole with a literal.
        let mut r = renderer(
            "{% for m in messages %}{% if m.content == 'ping' %}pong{% else %}{{ m.content }}{% endif %}{% endfor %}",
        );
        assert_eq!(
            both(&mut r, &json!([{"role": "user", "content": "ping"}])).1,
            Path::Template
        );
        assert_eq!(
            both(&mut r, &json!([{"role": "user", "content": "pin"}])).1,
            Path::Skeleton
        );
    }

    #[test]
    fn templates_that_change_contents_are_never_assembled() {
        for src in [
            "{% for m in messages %}{{ m.content | upper }}{% endfor %}",
            "{% for m in messages %}{{ m.content[:3] }}{% endfor %}",
            "{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
            "{% for m in messages %}{% if m.content | length > 12 %}long{% endif %}{{ m.content }}{% endfor %}",
            "{% for m in messages %}{% if '\\n' in m.content %}multi{% endif %}{{ m.content }}{% endfor %}",
        ] {
            let mut r = renderer(src);
            for content in ["short", "a longer content\nwith a newline"] {
                let msgs = json!([{"role": "user", "content": content}]);
                assert_eq!(both(&mut r, &msgs).1, Path::Template, "{src}");
            }
        }
    }

    #[test]
    fn tools_and_other_message_fields_run_the_template() {
        let mut r = renderer(CHATML);
        let named = json!([{"role": "user", "content": "hi", "name": "bob"}]);
        assert_eq!(both(&mut r, &named).1, Path::Template);
        let tools = json!([{"type": "function"}]);
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let want = r.chat(&msgs, Some(&tools), None, 0).unwrap();
        let (got, path) = r.chat_cached(&msgs, Some(&tools), None, 0).unwrap();
        assert_eq!((got, path), (want, Path::Template));
    }

    #[test]
    fn a_new_day_rebuilds_a_skeleton_that_read_the_clock() {
        let mut r = renderer(
            "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m.content }}{% endfor %}",
        );
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let day = 86_400;
        let (a, _) = r.chat_cached(&msgs, None, None, 10 * day).unwrap();
        let (b, path) = r.chat_cached(&msgs, None, None, 10 * day + 5).unwrap();
        assert_eq!((a.as_str(), path), ("11 Jan 1970hi", Path::Skeleton));
        assert_eq!(b, a);
        let (c, _) = r.chat_cached(&msgs, None, None, 11 * day).unwrap();
        assert_eq!(c, "12 Jan 1970hi");
        assert_eq!(r.skeleton_counts().0, 2);
    }

    #[test]
    fn guards_come_from_tests_comparisons_and_inspecting_calls() {
        let g = Guards::of(
            "{#- 'comment' == x -#}{%- if '</think>' in m.content and m.role == \"user\" %}{{ m.content.split('<sep>')[0] | replace('a', 'b') }}{% endif %}\
             {{- raise_exception('not a guard') }}{{ '<|im_start|>' + m.role }}{{ x.lstrip('\\n') }}{{ y.startswith(('<t>', '<u>')) }}",
        );
        assert_eq!(g.equal, vec!["user".to_string()]);
        assert_eq!(
            g.inside,
            ["</think>", "<sep>", "<t>", "<u>", "a", "b"]
                .map(String::from)
                .to_vec()
        );
    }
}
