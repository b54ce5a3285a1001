//! vLLM's NIXL protocol, as its reference proxy speaks it: the prefill leg
//! gets the client's body asking for one token and for the KV blocks to
//! be kept for a remote decode; its answer carries `kv_transfer_params`,
//! which the decode leg gets inside the client's own body.
//!
//! Both rewrites keep every value of the client's body byte for byte: the
//! top-level fields are read as raw JSON, never parsed into numbers that a
//! re-serialisation would rewrite. A client's own `kv_transfer_params` is
//! never passed on: it names the host a decode worker pulls blocks from.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// The field that carries the transfer in both legs.
pub const PARAMS: &str = "kv_transfer_params";

/// vLLM's body field for its request id. The `x-request-id` header that
/// kvgate sets takes precedence in vLLM; the client's field is dropped
/// from every leg all the same, so that no engine keys a transfer by an
/// id a client chose.
pub const REQUEST_ID: &str = "request_id";

/// What the prefill leg asks for: keep the blocks for a remote decode.
const PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// Fields the prefill leg drops: it generates one token and streams
/// nothing.
const PREFILL_DROPS: [&str; 3] = ["stream_options", "min_tokens", "min_completion_tokens"];

/// Why a body cannot be rewritten.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the body is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the body is not a JSON object")]
    NotAnObject,
}

/// Why a prefill answer gives no transfer to hand on.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AnswerError {
    #[error("the prefill answer is not a JSON object")]
    NotAnObject,
    /// Absent, null or empty: vLLM's sign that the prefill was aborted or
    /// failed.
    #[error("the prefill answer carries no kv_transfer_params")]
    Absent,
    #[error("the prefill answer's kv_transfer_params is not an object")]
    NotAnObjectParams,
}

/// A JSON object's top-level fields in their order, each value as its raw
/// text. A repeated key keeps its first place and its last value, as
/// Python's `json` (vLLM's reference proxy) reads it.
pub(super) struct Fields<'a>(pub(super) Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Fields<'a> {
    pub(super) fn parse(body: &'a [u8]) -> Result<Fields<'a>, BodyError> {
        let text = std::str::from_utf8(body).map_err(|_| BodyError::NotAnObject)?;
        if !text.trim_start().starts_with('{') {
            return Err(BodyError::NotAnObject);
        }
        let mut de = serde_json::Deserializer::from_str(text);
        let fields = de.deserialize_map(FieldsVisitor)?;
        de.end()?;
        Ok(fields)
    }

    pub(super) fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// Writes the object: each field through `edit` (`None` drops it),
    /// then the `added` fields.
    fn write(
        &self,
        mut edit: impl FnMut(&str, &'a str) -> Option<&'a str>,
        added: &[(&str, &'a str)],
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            self.0
                .iter()
                .map(|(k, v)| k.len() + v.get().len() + 4)
                .sum::<usize>()
                + 64,
        );
        out.push(b'{');
        let mut first = true;
        let kept = self
            .0
            .iter()
            .filter_map(|(k, v)| edit(k, v.get()).map(|v| (k.as_ref(), v)));
        for (k, v) in kept.chain(added.iter().copied()) {
            if !first {
                out.push(b',');
            }
            first = false;
            push_key(&mut out, k);
            out.extend_from_slice(v.as_bytes());
        }
        out.push(b'}');
        out
    }
}

pub(super) fn push_key(out: &mut Vec<u8>, key: &str) {
    // A string always serialises; the fallback is never taken.
    let quoted = serde_json::to_string(key).unwrap_or_else(|_| String::from("\"\""));
    out.extend_from_slice(quoted.as_bytes());
    out.push(b':');
}

struct FieldsVisitor;

impl<'de> Visitor<'de> for FieldsVisitor {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields<'de>, A::Error> {
        let mut fields: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::new();
        while let Some((k, v)) = map.next_entry::<Cow<'de, str>, &'de RawValue>()? {
            match fields.iter_mut().find(|(have, _)| *have == k) {
                Some(slot) => slot.1 = v,
                None => fields.push((k, v)),
            }
        }
        Ok(Fields(fields))
    }
}

/// The prefill leg's body, as vLLM's reference proxy makes it: the
/// client's body with `kv_transfer_params` asking for a remote decode,
/// `stream` false, `max_tokens` 1 (and `max_completion_tokens` 1 if the
/// client sent it), and no `stream_options`, `min_tokens` or
/// `min_completion_tokens`. Fields keep their places; new ones follow.
pub fn prefill_body(client: &[u8]) -> Result<Vec<u8>, BodyError> {
    let fields = Fields::parse(client)?;
    let mut added = Vec::with_capacity(3);
    for (key, value) in [
        (PARAMS, PREFILL_PARAMS),
        ("stream", "false"),
        ("max_tokens", "1"),
    ] {
        if fields.get(key).is_none() {
            added.push((key, value));
        }
    }
    Ok(fields.write(
        |k, v| match k {
            PARAMS => Some(PREFILL_PARAMS),
            "stream" => Some("false"),
            "max_tokens" | "max_completion_tokens" => Some("1"),
            k if PREFILL_DROPS.contains(&k) || k == REQUEST_ID => None,
            _ => Some(v),
        },
        &added,
    ))
}

/// The `kv_transfer_params` of a prefill answer, as its raw text: the
/// object is handed on verbatim, whatever fields this vLLM version puts
/// in it.
pub fn answer_params(answer: &[u8]) -> Result<&str, AnswerError> {
    let fields = Fields::parse(answer).map_err(|_| AnswerError::NotAnObject)?;
    let params = fields.get(PARAMS).ok_or(AnswerError::Absent)?.get();
    match params.as_bytes().first() {
        // An empty object hands nothing over, as vLLM's proxy reads it.
        Some(b'{') if is_empty_object(params) => Err(AnswerError::Absent),
        Some(b'{') => Ok(params),
        _ if params == "null" => Err(AnswerError::Absent),
        _ => Err(AnswerError::NotAnObjectParams),
    }
}

fn is_empty_object(raw: &str) -> bool {
    raw.strip_prefix('{')
        .and_then(|r| r.strip_suffix('}'))
        .is_some_and(|inner| inner.trim().is_empty())
}

/// The decode leg's body: the client's own bytes with the prefill's
/// `kv_transfer_params` (an object's raw text, from [`answer_params`])
/// added before the closing brace. A client that sent its own
/// `kv_transfer_params` has it replaced, and a `request_id` dropped, its
/// other values kept verbatim.
pub fn decode_body(client: &[u8], params: &str) -> Result<Vec<u8>, BodyError> {
    let fields = Fields::parse(client)?;
    let has_params = fields.get(PARAMS).is_some();
    if has_params || fields.get(REQUEST_ID).is_some() {
        let added = [(PARAMS, params)];
        let added: &[(&str, &str)] = if has_params { &[] } else { &added };
        return Ok(fields.write(
            |k, v| match k {
                PARAMS => Some(params),
                REQUEST_ID => None,
                _ => Some(v),
            },
            added,
        ));
    }
    // The object ends with its closing brace (trailing white space aside):
    // the parse above saw all of it.
    let end = client
        .iter()
        .rposition(|b| *b == b'}')
        .ok_or(BodyError::NotAnObject)?;
    let mut out = Vec::with_capacity(client.len() + PARAMS.len() + params.len() + 4);
    out.extend_from_slice(&client[..end]);
    if !fields.0.is_empty() {
        out.push(b',');
    }
    push_key(&mut out, PARAMS);
    out.extend_from_slice(params.as_bytes());
    out.extend_from_slice(&client[end..]);
    Ok(out)
}

/// The body a decode worker gets when it computes the prompt itself (no
/// transfer to hand on): the client's own bytes, or, when the client sent
/// `kv_transfer_params` of its own, the body without them.
pub fn local_body(client: &[u8]) -> Result<Cow<'_, [u8]>, BodyError> {
    let fields = Fields::parse(client)?;
    if fields.get(PARAMS).is_none() {
        return Ok(Cow::Borrowed(client));
    }
    Ok(Cow::Owned(
        fields.write(|k, v| (k != PARAMS).then_some(v), &[]),
    ))
}

#[cfg(test)]
mod tests;
