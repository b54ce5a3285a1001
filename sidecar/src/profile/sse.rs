//! The server-sent events an OpenAI-compatible server streams a completion
//! as: `data: {json}` lines, each event ended by a blank line, the stream
//! by `data: [DONE]`.
//!
//! vLLM and SGLang put each event's JSON on one `data:` line, so a line is
//! taken as a whole event; the SSE spec's multi-line `data:` joining is
//! never needed for them. Everything read is bounded: a line longer than
//! [`MAX_LINE`] is an error rather than a buffer that grows with whatever
//! the server sends.

use serde::Deserialize;
use serde::de::IgnoredAny;

/// The longest line kept: a completion chunk is a few hundred bytes, a
/// usage chunk not much more.
pub const MAX_LINE: usize = 256 << 10;

/// Bytes of an error or of a line that is not JSON quoted in a message.
const QUOTE: usize = 200;

/// One event of the stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A completion chunk. `tokens`: it carries output (its `choices` are
    /// not empty; a usage-only chunk has none). `completion_tokens`: the
    /// usage it reports, when it does.
    Chunk {
        tokens: bool,
        completion_tokens: Option<u64>,
    },
    /// `data: [DONE]`.
    Done,
    /// The server reported an error inside the stream (vLLM does so once
    /// the status line has gone out).
    Error(String),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SseError {
    #[error("an event line longer than {MAX_LINE} bytes")]
    LineTooLong,
    #[error("a data line that is not a JSON object: {0}")]
    NotJson(String),
}

/// Splits a byte stream into lines and lines into events, across however
/// the transport cut the bytes.
#[derive(Debug, Default)]
pub struct SseParser {
    /// The line begun in an earlier push and not ended yet.
    partial: Vec<u8>,
}

impl SseParser {
    pub fn new() -> SseParser {
        SseParser::default()
    }

    /// Feeds bytes; appends the events of every line they complete.
    pub fn push(&mut self, mut bytes: &[u8], out: &mut Vec<Event>) -> Result<(), SseError> {
        while let Some(end) = bytes.iter().position(|b| *b == b'\n') {
            if self.partial.len() + end > MAX_LINE {
                return Err(SseError::LineTooLong);
            }
            let event = if self.partial.is_empty() {
                parse_line(&bytes[..end])?
            } else {
                self.partial.extend_from_slice(&bytes[..end]);
                let event = parse_line(&self.partial);
                self.partial.clear();
                event?
            };
            out.extend(event);
            bytes = &bytes[end + 1..];
        }
        if self.partial.len() + bytes.len() > MAX_LINE {
            return Err(SseError::LineTooLong);
        }
        self.partial.extend_from_slice(bytes);
        Ok(())
    }

    /// The stream ended: a last line without its newline still counts.
    pub fn finish(&mut self, out: &mut Vec<Event>) -> Result<(), SseError> {
        let line = std::mem::take(&mut self.partial);
        out.extend(parse_line(&line)?);
        Ok(())
    }
}

#[derive(Deserialize)]
struct RawChunk {
    #[serde(default)]
    choices: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    completion_tokens: Option<u64>,
}

/// One line's event: `None` for what carries none (blank lines, comments,
/// `event:`, `id:` and `retry:` fields).
fn parse_line(line: &[u8]) -> Result<Option<Event>, SseError> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(data) = line.strip_prefix(b"data:") else {
        return Ok(None);
    };
    let data = data.trim_ascii();
    if data.is_empty() {
        return Ok(None);
    }
    if data == b"[DONE]" {
        return Ok(Some(Event::Done));
    }
    let chunk: RawChunk =
        serde_json::from_slice(data).map_err(|_| SseError::NotJson(quote(data)))?;
    if let Some(error) = chunk.error.filter(|e| !e.is_null()) {
        let message = error
            .get("message")
            .and_then(|m| m.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| error.to_string());
        return Ok(Some(Event::Error(quote(message.as_bytes()))));
    }
    Ok(Some(Event::Chunk {
        tokens: chunk.choices.is_some_and(|c| !c.is_empty()),
        completion_tokens: chunk.usage.and_then(|u| u.completion_tokens),
    }))
}

/// The start of `bytes` as text, for a message.
fn quote(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(QUOTE)]);
    if bytes.len() > QUOTE {
        format!("{text}…")
    } else {
        text.into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(parts: &[&[u8]]) -> Result<Vec<Event>, SseError> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for part in parts {
            p.push(part, &mut out)?;
        }
        p.finish(&mut out)?;
        Ok(out)
    }

    const TOKEN: Event = Event::Chunk {
        tokens: true,
        completion_tokens: None,
    };

    #[test]
    fn a_vllm_stream_gives_its_tokens_usage_and_end() {
        let stream = b"data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"the \"}],\"usage\":null}\n\n\
            data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"cache\",\"finish_reason\":\"length\"}]}\n\n\
            data: {\"id\":\"cmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n\
            data: [DONE]\n\n";
        assert_eq!(
            events(&[stream]).unwrap(),
            [
                TOKEN,
                TOKEN,
                Event::Chunk {
                    tokens: false,
                    completion_tokens: Some(2)
                },
                Event::Done
            ]
        );
    }

    #[test]
    fn lines_cut_anywhere_by_the_transport_parse_the_same() {
        let stream: &[u8] = b"data: {\"choices\":[{\"text\":\"a\"}]}\r\n\r\ndata:{\"choices\":[{\"text\":\"b\"}]}\n\ndata: [DONE]\n\n";
        let whole = events(&[stream]).unwrap();
        assert_eq!(whole, [TOKEN, TOKEN, Event::Done]);
        for cut in 0..stream.len() {
            assert_eq!(
                events(&[&stream[..cut], &stream[cut..]]).unwrap(),
                whole,
                "cut at {cut}"
            );
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(events(&bytes).unwrap(), whole);
    }

    #[test]
    fn comments_and_other_fields_carry_no_event() {
        let stream = b": keep-alive\n\nevent: message\nid: 7\nretry: 100\ndata:\n\ndata: [DONE]";
        assert_eq!(events(&[stream]).unwrap(), [Event::Done]);
    }

    #[test]
    fn an_error_in_the_stream_is_reported_with_its_message() {
        let stream = b"data: {\"error\":{\"object\":\"error\",\"message\":\"prompt too long\",\"code\":400}}\n\n";
        assert_eq!(
            events(&[stream]).unwrap(),
            [Event::Error("prompt too long".into())]
        );
        let bare = b"data: {\"error\":\"overloaded\"}\n";
        assert_eq!(
            events(&[bare]).unwrap(),
            [Event::Error("\"overloaded\"".into())]
        );
    }

    #[test]
    fn a_data_line_that_is_not_json_is_an_error() {
        assert!(matches!(
            events(&[b"data: <html>\n"]),
            Err(SseError::NotJson(s)) if s == "<html>"
        ));
    }

    #[test]
    fn a_line_without_end_is_bounded() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        let block = vec![b'x'; 64 << 10];
        let mut result = Ok(());
        for _ in 0..8 {
            result = p.push(&block, &mut out);
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(SseError::LineTooLong));
        assert!(p.partial.len() <= MAX_LINE);
        // One push of a too-long complete line is refused too.
        let mut long = vec![b'x'; MAX_LINE + 1];
        long.push(b'\n');
        assert_eq!(
            SseParser::new().push(&long, &mut out),
            Err(SseError::LineTooLong)
        );
    }
}
