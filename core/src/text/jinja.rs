//! The chat template as minijinja runs it, set up as `transformers` sets
//! up Jinja2: `trim_blocks` and `lstrip_blocks`, Python's string methods
//! (`pycompat`), a `tojson` that is Python's
//! `json.dumps(ensure_ascii=False)`, and the globals `raise_exception`
//! and `strftime_now`. Both ways of rendering a chat use it: running the
//! template, and assembling a skeleton recorded from it
//! ([`super::skeleton`]).

use crate::wire::WireError;
use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, Value as JinjaValue};
use serde_json::{Map, Value};
use std::borrow::Cow;
use thiserror::Error;

const NAME: &str = "chat";

/// Why a template blob could not be read, compiled or rendered.
#[derive(Debug, Error)]
pub enum TemplateError {
    #[error("prompt template blob {0}")]
    Wire(#[from] WireError),
    #[error("not a prompt template blob (bad magic)")]
    BadMagic,
    #[error("prompt template blob holds invalid UTF-8")]
    Utf8,
    #[error("prompt template blob has {0} bytes after its last field")]
    Trailing(usize),
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// The template as minijinja runs it.
pub(super) struct Compiled {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Whether the template walks a message's content parts itself; if
    /// not, vLLM joins text parts with newlines first.
    content_parts: bool,
}

impl Compiled {
    pub(super) fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Compiled, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(Compiled {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            content_parts: walks_content(source),
        })
    }

    /// `messages` as the template reads them: vLLM joins content parts
    /// with newlines unless the template walks them itself.
    pub(super) fn joined<'a>(&self, messages: &'a Value) -> Cow<'a, Value> {
        let has_parts = || {
            messages
                .as_array()
                .into_iter()
                .flatten()
                .any(|m| m.get("content").is_some_and(Value::is_array))
        };
        if self.content_parts || !has_parts() {
            // A chat of string contents is what the template reads as it
            // is: no copy of its messages.
            Cow::Borrowed(messages)
        } else {
            Cow::Owned(joined_text_parts(messages))
        }
    }

    /// Runs the template over `messages` whose content parts are already
    /// joined where the template wants strings.
    pub(super) fn chat_joined(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: Option<&Map<String, Value>>,
        unix_s: u64,
    ) -> Result<String, TemplateError> {
        let add_generation_prompt = kwargs
            .and_then(|k| k.get("add_generation_prompt"))
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let extra = kwargs.map_or(JinjaValue::UNDEFINED, JinjaValue::from_serialize);
        let ctx = minijinja::context! {
            messages => JinjaValue::from_serialize(messages),
            tools => JinjaValue::from_serialize(tools.unwrap_or(&Value::Null)),
            add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..extra
        };
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        NOW.with(|n| n.set(unix_s));
        tmpl.render(ctx)
            .map_err(|e| TemplateError::Render(e.to_string()))
    }
}

/// Runs `f`, returning with its result every `strftime_now` it called:
/// (format, what it gave).
pub(super) fn recording_clock<T>(f: impl FnOnce() -> T) -> (T, Vec<(String, String)>) {
    CLOCK_READS.with(|r| *r.borrow_mut() = Some(Vec::new()));
    let out = f();
    let reads = CLOCK_READS
        .with(|r| r.borrow_mut().take())
        .unwrap_or_default();
    (out, reads)
}

std::thread_local! {
    /// The render's clock, for `strftime_now`: core reads no clock itself.
    static NOW: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// `strftime_now` calls, while [`recording_clock`] runs.
    static CLOCK_READS: std::cell::RefCell<Option<Vec<(String, String)>>> =
        const { std::cell::RefCell::new(None) };
}

/// Whether a `{% for %}` of the template iterates over message content
/// (vLLM's "openai" content format, which it detects from the template).
fn walks_content(src: &str) -> bool {
    src.split("{%").skip(1).any(|stmt| {
        let stmt = stmt.split("%}").next().unwrap_or_default();
        let s = stmt.trim_start_matches(['-', '+']).trim_start();
        s.starts_with("for ") && s.contains("content")
    })
}

/// vLLM's "string" content format: text parts joined with newlines.
fn joined_text_parts(messages: &Value) -> Value {
    let Some(list) = messages.as_array() else {
        return messages.clone();
    };
    let out = list
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(Value::Array(parts)) = m.get("content") {
                let text: Vec<&str> = parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect();
                let joined = Value::String(text.join("\n"));
                if let Some(obj) = m.as_object_mut() {
                    obj.insert("content".into(), joined);
                }
            }
            m
        })
        .collect();
    Value::Array(out)
}

fn raise_exception(msg: String) -> Result<JinjaValue, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> String {
    let out = strftime(&format, NOW.with(std::cell::Cell::get));
    CLOCK_READS.with(|r| {
        if let Some(reads) = r.borrow_mut().as_mut() {
            reads.push((format, out.clone()));
        }
    });
    out
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=..., sort_keys=...)`,
/// which is what `transformers` registers as `tojson`: its separators
/// (`", "` and `": "`) differ from minijinja's own filter.
fn tojson(value: JinjaValue, kwargs: Kwargs) -> Result<JinjaValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let mut out = String::new();
    py_json(&v, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(JinjaValue::from_safe_string(out))
}

fn py_json(v: &Value, indent: Option<usize>, sort: bool, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    // With an indent Python drops the space after the comma.
    let comma = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, it) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(comma);
                }
                newline(out, depth + 1);
                py_json(it, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(comma);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                py_json(val, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        Value::Array(_) => out.push_str("[]"),
        Value::Object(_) => out.push_str("{}"),
        Value::Number(n) if n.is_f64() => out.push_str(&py_float(n.as_f64().unwrap_or(0.0))),
        other => out.push_str(&other.to_string()),
    }
}

/// Python's `repr` of a float, for the values JSON bodies carry.
fn py_float(f: f64) -> String {
    if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

/// A small `strftime` in UTC: the directives chat templates use.
pub fn strftime(format: &str, unix_s: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (unix_s / 86_400) as i64;
    let secs = unix_s % 86_400;
    let (y, m, d) = civil_from_days(days);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (Hinnant's method).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_in_utc() {
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(
            strftime("%d %b %Y, %A %H:%M:%S %e|%y|%%|%q", 1_721_999_109),
            "26 Jul 2024, Friday 13:05:09 26|24|%|%q"
        );
    }
}
