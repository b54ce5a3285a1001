//! What the engine says it reused: `usage.prompt_tokens_details
//! .cached_tokens` in a completion's answer, set beside the cached prompt
//! tokens the index predicted for the worker it went to. A non-streamed
//! answer always carries usage (where the engine reports the details:
//! vLLM with `--enable-prompt-tokens-details`); a stream only when its
//! client asked (`stream_options.include_usage`). The filter does not ask
//! on the client's behalf: it would change what the client receives.

/// A sampled request's cached prompt tokens: predicted, and as reported.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Usage {
    pub predicted: u64,
    pub isl_tokens: u64,
    pub reported: Option<u64>,
}

const KEY: &[u8] = b"\"cached_tokens\":";

/// The last `"cached_tokens": N` in a chunk of the answer; `None` when it
/// names none (or a non-number).
pub(super) fn cached_tokens(chunk: &[u8]) -> Option<u64> {
    let at = chunk.windows(KEY.len()).rposition(|w| w == KEY)? + KEY.len();
    let rest = &chunk[at..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits = rest[start..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    std::str::from_utf8(&rest[start..start + digits])
        .ok()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_count_in_a_chunk_is_read() {
        let whole =
            br#"{"usage":{"prompt_tokens":640,"prompt_tokens_details":{"cached_tokens": 512}}}"#;
        assert_eq!(cached_tokens(whole), Some(512));
        let stream = b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":96}}}\n\ndata: [DONE]\n\n";
        assert_eq!(cached_tokens(stream), Some(96));
        assert_eq!(cached_tokens(b"{\"cached_tokens\":null}"), None);
        assert_eq!(cached_tokens(b"{\"cached_tokens\":"), None);
        assert_eq!(cached_tokens(b"no usage here"), None);
        assert_eq!(
            cached_tokens(b"{\"cached_tokens\":99999999999999999999999}"),
            None,
            "past u64: not a count"
        );
    }
}
