//! A model's vocabulary, for one direction only: token id → bytes.
//!
//! The text index needs the exact bytes an engine's cached tokens stand
//! for. For a byte-level BPE (GPT-2's scheme, used by Llama 3, Qwen 2 and
//! 3, DeepSeek V3, gpt-oss and every tiktoken vocabulary) that is each
//! token's bytes in order, with nothing to normalise: decoding the tokens
//! of a prompt gives the prompt back. Vocabularies that do not decode
//! exactly (SentencePiece's `▁` and byte fallback) are refused, and their
//! models keep the routed-prefix index.

use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum VocabError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a tokenizer file: {why}")]
    Format { path: String, why: String },
    #[error(
        "{path} is not a byte-level BPE ({why}): its tokens do not decode to the exact \
         prompt, so text prompts keep the routed-prefix index"
    )]
    NotByteLevel { path: String, why: String },
}

/// Token id → bytes, in one buffer.
#[derive(Debug, Default)]
pub struct Vocab {
    bytes: Vec<u8>,
    /// `ends[id]` is where token `id`'s bytes end; an id never defined has
    /// an empty range and is `None` in [`Vocab::token`].
    ends: Vec<u32>,
    defined: Vec<bool>,
}

/// A file's bytes, bounded: real tokenizer files are a few MB, the
/// largest (250k-token vocabularies) about 30 MB.
const MAX_FILE_BYTES: u64 = 128 << 20;

pub(crate) fn read_bounded(path: &Path) -> Result<Vec<u8>, VocabError> {
    use std::io::Read;
    let err = |source| VocabError::Read {
        path: path.display().to_string(),
        source,
    };
    let f = std::fs::File::open(path).map_err(err)?;
    let mut out = Vec::new();
    f.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(err)?;
    if out.len() as u64 > MAX_FILE_BYTES {
        return Err(VocabError::Format {
            path: path.display().to_string(),
            why: format!("larger than {MAX_FILE_BYTES} bytes"),
        });
    }
    Ok(out)
}

impl Vocab {
    /// Loads a HuggingFace `tokenizer.json`, or a tiktoken file (`*.tiktoken`,
    /// base64 token and rank per line) with its special tokens given apart.
    pub fn load(path: &Path, specials: &[(u32, String)]) -> Result<Vocab, VocabError> {
        let bytes = read_bounded(path)?;
        let name = path.display().to_string();
        if path.extension().is_some_and(|e| e == "tiktoken") {
            Vocab::from_tiktoken(&name, &bytes, specials)
        } else {
            Vocab::from_tokenizer_json(&name, &bytes)
        }
    }

    pub fn from_tokenizer_json(path: &str, bytes: &[u8]) -> Result<Vocab, VocabError> {
        let format = |why: String| VocabError::Format {
            path: path.into(),
            why,
        };
        let not_byte_level = |why: String| VocabError::NotByteLevel {
            path: path.into(),
            why,
        };
        let v: Value = serde_json::from_slice(bytes).map_err(|e| format(e.to_string()))?;
        let model = v.get("model").ok_or_else(|| format("no 'model'".into()))?;
        match model.get("type").and_then(Value::as_str) {
            Some("BPE") => {}
            other => return Err(not_byte_level(format!("model type {other:?}"))),
        }
        if !is_byte_level(v.get("decoder")) {
            return Err(not_byte_level(format!(
                "decoder {}",
                v.get("decoder").map_or("none".into(), |d| d
                    .get("type")
                    .map_or("?".into(), Value::to_string))
            )));
        }
        let inverse = byte_decoder();
        let mut tokens: Vec<(u32, Vec<u8>)> = Vec::new();
        let vocab = model
            .get("vocab")
            .and_then(Value::as_object)
            .ok_or_else(|| format("no 'model.vocab' map".into()))?;
        for (piece, id) in vocab {
            let id = id
                .as_u64()
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| format(format!("token {piece:?} has no valid id")))?;
            let b: Option<Vec<u8>> = piece.chars().map(|c| inverse.get(&c).copied()).collect();
            let b = b.ok_or_else(|| {
                not_byte_level(format!("token {piece:?} is not in the byte alphabet"))
            })?;
            tokens.push((id, b));
        }
        // Added tokens decode to their content as written.
        for t in v
            .get("added_tokens")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let (Some(id), Some(content)) = (
                t.get("id").and_then(Value::as_u64),
                t.get("content").and_then(Value::as_str),
            ) && let Ok(id) = u32::try_from(id)
            {
                tokens.push((id, content.as_bytes().to_vec()));
            }
        }
        Vocab::build(path, tokens)
    }

    pub fn from_tiktoken(
        path: &str,
        bytes: &[u8],
        specials: &[(u32, String)],
    ) -> Result<Vocab, VocabError> {
        let format = |why: String| VocabError::Format {
            path: path.into(),
            why,
        };
        let text = std::str::from_utf8(bytes).map_err(|_| format("not UTF-8".into()))?;
        let mut tokens = Vec::new();
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(b64), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(format(format!("line {} is not 'token rank'", n + 1)));
            };
            let b =
                base64_decode(b64).ok_or_else(|| format(format!("line {}: bad base64", n + 1)))?;
            let id: u32 = rank
                .parse()
                .map_err(|_| format(format!("line {}: bad rank", n + 1)))?;
            tokens.push((id, b));
        }
        tokens.extend(specials.iter().map(|(id, s)| (*id, s.as_bytes().to_vec())));
        Vocab::build(path, tokens)
    }

    fn build(path: &str, mut tokens: Vec<(u32, Vec<u8>)>) -> Result<Vocab, VocabError> {
        tokens.sort_by_key(|(id, _)| *id);
        let Some(max) = tokens.last().map(|(id, _)| *id as usize) else {
            return Err(VocabError::Format {
                path: path.into(),
                why: "no tokens".into(),
            });
        };
        if max > 4 << 20 {
            return Err(VocabError::Format {
                path: path.into(),
                why: format!("token id {max} is implausibly large"),
            });
        }
        let mut v = Vocab {
            bytes: Vec::new(),
            ends: Vec::with_capacity(max + 1),
            defined: vec![false; max + 1],
        };
        let mut next = tokens.into_iter().peekable();
        for id in 0..=max {
            // A later entry for the same id (an added token) wins.
            let mut piece = None;
            while let Some((i, _)) = next.peek() {
                if *i as usize != id {
                    break;
                }
                piece = next.next().map(|(_, b)| b);
            }
            if let Some(b) = piece {
                v.bytes.extend_from_slice(&b);
                v.defined[id] = true;
            }
            v.ends.push(v.bytes.len() as u32);
        }
        Ok(v)
    }

    /// The bytes of token `id`; `None` for an id the vocabulary lacks.
    pub fn token(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        if !*self.defined.get(i)? {
            return None;
        }
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        Some(&self.bytes[start..self.ends[i] as usize])
    }

    /// Appends the bytes of `ids` to `out`; false (and `out` partly
    /// filled) at the first id the vocabulary lacks.
    pub fn decode_into(&self, ids: &[u32], out: &mut Vec<u8>) -> bool {
        for &id in ids {
            match self.token(id) {
                Some(b) => out.extend_from_slice(b),
                None => return false,
            }
        }
        true
    }

    /// Ids the vocabulary defines (ids may leave gaps).
    pub fn defined_tokens(&self) -> usize {
        self.defined.iter().filter(|d| **d).count()
    }

    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity() + 4 * self.ends.capacity() + self.defined.capacity()
    }
}

fn is_byte_level(decoder: Option<&Value>) -> bool {
    match decoder.and_then(|d| d.get("type")).and_then(Value::as_str) {
        Some("ByteLevel") => true,
        Some("Sequence") => decoder
            .and_then(|d| d.get("decoders"))
            .and_then(Value::as_array)
            .is_some_and(|ds| ds.len() == 1 && is_byte_level(ds.first())),
        _ => false,
    }
}

/// GPT-2's map from the printable characters a byte-level vocabulary is
/// written in back to bytes: printable Latin-1 bytes stand for
/// themselves, the other 68 are shifted to U+0100 onwards in byte order.
fn byte_decoder() -> HashMap<char, u8> {
    let mut m = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or('\0')
        };
        m.insert(c, b);
    }
    m
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let s = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    for chunk in s.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c)? << (18 - 6 * i);
        }
        let n = match chunk.len() {
            4 => 3,
            3 => 2,
            2 => 1,
            _ => return None,
        };
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + n]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let m = byte_decoder();
        assert_eq!(m.len(), 256);
        assert_eq!(m[&'Ġ'], b' ', "U+0120 is the space");
        assert_eq!(m[&'Ċ'], b'\n');
        assert_eq!(m[&'a'], b'a');
    }

    #[test]
    fn tokenizer_json_decodes_bytes_and_added_tokens() {
        let j = r#"{"model":{"type":"BPE","vocab":{"a":0,"Ġb":1,"Ã©":2}},
            "added_tokens":[{"id":3,"content":"<|eot|>","special":true}],
            "decoder":{"type":"ByteLevel"}}"#;
        let v = Vocab::from_tokenizer_json("t", j.as_bytes()).unwrap();
        let mut out = Vec::new();
        assert!(v.decode_into(&[0, 1, 2, 3], &mut out));
        assert_eq!(String::from_utf8(out).unwrap(), "a bé<|eot|>");
        assert_eq!(v.defined_tokens(), 4);
        assert!(!v.decode_into(&[9], &mut Vec::new()));
    }

    #[test]
    fn sentencepiece_and_garbage_are_refused() {
        let sp = r#"{"model":{"type":"BPE","vocab":{"▁a":0}},
            "decoder":{"type":"Sequence","decoders":[{"type":"Replace"},{"type":"ByteFallback"}]}}"#;
        assert!(matches!(
            Vocab::from_tokenizer_json("t", sp.as_bytes()),
            Err(VocabError::NotByteLevel { .. })
        ));
        let uni = r#"{"model":{"type":"Unigram","vocab":[]},"decoder":null}"#;
        assert!(matches!(
            Vocab::from_tokenizer_json("t", uni.as_bytes()),
            Err(VocabError::NotByteLevel { .. })
        ));
        for bad in [
            "",
            "[]",
            "{}",
            r#"{"model":{"type":"BPE"},"decoder":{"type":"ByteLevel"}}"#,
        ] {
            assert!(matches!(
                Vocab::from_tokenizer_json("t", bad.as_bytes()),
                Err(VocabError::Format { .. })
            ));
        }
        let huge =
            r#"{"model":{"type":"BPE","vocab":{"a":4294967295}},"decoder":{"type":"ByteLevel"}}"#;
        assert!(Vocab::from_tokenizer_json("t", huge.as_bytes()).is_err());
    }

    #[test]
    fn tiktoken_files() {
        // "hello" = aGVsbG8=, " world" = IHdvcmxk
        let f = "aGVsbG8= 0\nIHdvcmxk 1\n";
        let v = Vocab::from_tiktoken("t", f.as_bytes(), &[(5, "<|end|>".into())]).unwrap();
        let mut out = Vec::new();
        assert!(v.decode_into(&[0, 1, 5], &mut out));
        assert_eq!(out, b"hello world<|end|>");
        assert!(v.token(3).is_none());
        assert!(Vocab::from_tiktoken("t", b"!!! 0", &[]).is_err());
        assert!(Vocab::from_tiktoken("t", b"aGVsbG8= x", &[]).is_err());
    }
}
