//! A deterministic stand-in tokenizer.
//!
//! Text is split into runs of letters/digits, cut into pieces of at most
//! four characters, and single other non-space characters; each piece
//! becomes `1000 + xxh3(piece) mod 100000`. It is not a real BPE, but it has
//! the two properties prefix caching depends on (the same text always gives
//! the same tokens, and a shared text prefix gives a shared token prefix up
//! to the piece that differs), and it counts about as many tokens as a real
//! BPE vocabulary does for English (about four characters a token), so
//! prefill times and cache figures for text prompts are of the right size.
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
            word(&text[s..i], &mut out);
        }
        if !c.is_whitespace() {
            out.push(piece(&text[i..i + c.len_utf8()]));
        }
    }
    if let Some(s) = start {
        word(&text[s..], &mut out);
    }
    out
}

/// Longest piece of a word, in characters; real vocabularies split long
/// and rare words into several tokens.
const PIECE_CHARS: usize = 4;

fn word(w: &str, out: &mut Vec<u32>) {
    let mut start = 0;
    for (n, (i, _)) in w.char_indices().enumerate() {
        if n > 0 && n % PIECE_CHARS == 0 {
            out.push(piece(&w[start..i]));
            start = i;
        }
    }
    out.push(piece(&w[start..]));
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
    fn about_four_characters_a_token_like_a_real_bpe() {
        let text = "The quick brown fox jumps over the lazy dog, while \
            transformer inference servers cache attention keys and values \
            for every prompt prefix they have already computed.";
        let n = tokenize(text).len();
        let per_token = text.len() as f64 / n as f64;
        assert!(
            (3.0..5.0).contains(&per_token),
            "{per_token} chars a token ({n})"
        );
        assert_eq!(tokenize("inference").len(), 3, "infe|renc|e");
        assert_eq!(tokenize("héllo").len(), 2, "cut on characters, not bytes");
    }

    #[test]
    fn deterministic_and_prefix_preserving() {
        let a = tokenize("You are a helpful assistant. Question: why?");
        assert_eq!(a, tokenize("You are a helpful assistant. Question: why?"));
        let b = tokenize("You are a helpful assistant. Question: how?");
        assert_eq!(a[..6], b[..6]);
        assert_ne!(a, b);
        assert_eq!(tokenize("hello, world").len(), 5, "hell|o , worl|d");
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
