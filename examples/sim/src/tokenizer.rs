//! A deterministic stand-in tokenizer.
//!
//! Text is split into runs of letters/digits and single other non-space
//! characters; each piece becomes `1000 + xxh3(piece) mod 100000`. It is not
//! a real BPE, but it has the two properties prefix caching depends on: the
//! same text always gives the same tokens, and a shared text prefix gives a
//! shared token prefix (up to the piece that differs).
//!
//! Chat messages are rendered before tokenizing with a fixed template:
//! `<|{role}|>\n{content}\n` per message, then `<|assistant|>\n`.

use xxhash_rust::xxh3::xxh3_64;

pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    let mut start: Option<usize> = None;
    for (i, c) in text.char_indices() {
        if c.is_alphanumeric() {
            start.get_or_insert(i);
            continue;
        }
        if let Some(s) = start.take() {
            out.push(piece(&text[s..i]));
        }
        if !c.is_whitespace() {
            out.push(piece(&text[i..i + c.len_utf8()]));
        }
    }
    if let Some(s) = start {
        out.push(piece(&text[s..]));
    }
    out
}

fn piece(p: &str) -> u32 {
    1000 + (xxh3_64(p.as_bytes()) % 100_000) as u32
}

/// Renders OpenAI chat messages with the simulator's template.
pub fn render_chat(messages: &[(String, String)]) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str("<|");
        s.push_str(role);
        s.push_str("|>\n");
        s.push_str(content);
        s.push('\n');
    }
    s.push_str("<|assistant|>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_prefix_preserving() {
        let a = tokenize("You are a helpful assistant. Question: why?");
        assert_eq!(a, tokenize("You are a helpful assistant. Question: why?"));
        let b = tokenize("You are a helpful assistant. Question: how?");
        assert_eq!(a[..6], b[..6]);
        assert_ne!(a, b);
        assert_eq!(tokenize("hello, world").len(), 3);
        assert!(tokenize("   ").is_empty());
        assert!(a.iter().all(|&t| (1000..101_000).contains(&t)));
    }

    #[test]
    fn chat_template_is_fixed() {
        let r = render_chat(&[
            ("system".into(), "be brief".into()),
            ("user".into(), "hi".into()),
        ]);
        assert_eq!(r, "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
    }
}
