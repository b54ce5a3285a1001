//! The prefill leg of a disaggregated request (vLLM's NIXL protocol): the
//! callout that computes the prompt on the prefill worker, and what its
//! answer makes of the client's request.
//!
//! The leg is judged by what comes back, never by a timer of the filter's
//! own: Envoy answers a callout that timed out, was refused or reset with
//! a made-up answer (`docs/envoy-callouts.md`), so every outcome arrives in
//! `on_http_call_response`.

use kvgate_core::disagg::nixl;

/// What a prefill answer means for the request.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The blocks are ready: the decode leg's body, the client's bytes
    /// with the answer's `kv_transfer_params` spliced in.
    Transfer(Vec<u8>),
    /// The worker refused the request as malformed (a 4xx that is not
    /// overload): the client's error, answered to the client as it is.
    ClientError(u16),
    /// The leg failed; the cause, for logs and the 503's message.
    Failed(&'static str),
}

/// Judges a prefill answer: `status` is absent when Envoy reports a reset
/// after the worker's headers (no headers at all), `answer` its body.
pub(super) fn judge(status: Option<u16>, answer: &[u8], client: &[u8]) -> Verdict {
    let Some(status) = status else {
        return Verdict::Failed("the prefill worker reset the stream");
    };
    match status {
        200 => {}
        // Overload and timeouts are the fleet's, not the request's.
        408 | 429 => return Verdict::Failed("the prefill worker is overloaded"),
        400..=499 => return Verdict::ClientError(status),
        503 | 504 => return Verdict::Failed("the prefill worker did not answer"),
        _ => return Verdict::Failed("the prefill worker failed"),
    }
    let params = match nixl::answer_params(answer) {
        Ok(p) => p,
        Err(nixl::AnswerError::Absent) => {
            return Verdict::Failed("the prefill answer carries no kv_transfer_params");
        }
        Err(_) => return Verdict::Failed("the prefill answer is malformed"),
    };
    match nixl::decode_body(client, params) {
        Ok(body) => Verdict::Transfer(body),
        // The client's body parsed before the leg was sent.
        Err(_) => Verdict::Failed("the decode body could not be made"),
    }
}

/// The id both legs carry: vLLM keys the KV handoff by it, so kvgate
/// chooses it, never a client. The engine echoes it in its answer, so it
/// must not let anyone predict the next: it is 128 random bits (two
/// draws of `random`), nothing of the VM or of a counter.
pub(super) fn request_id(mut random: impl FnMut() -> u64) -> String {
    format!("kvgate-{:016x}{:016x}", random(), random())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLIENT: &[u8] = br#"{"model":"m","prompt":"hi","max_tokens":7,"temperature":0.10}"#;
    const ANSWER: &[u8] = br#"{"id":"x","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1,2]],"remote_host":"10.0.0.1","remote_port":5600}}"#;

    #[test]
    fn a_complete_answer_hands_its_params_to_the_clients_own_bytes() {
        let Verdict::Transfer(body) = judge(Some(200), ANSWER, CLIENT) else {
            panic!("no transfer");
        };
        let text = std::str::from_utf8(&body).unwrap();
        assert!(
            text.starts_with(r#"{"model":"m","prompt":"hi","max_tokens":7,"temperature":0.10,"#),
            "the client's bytes verbatim: {text}"
        );
        assert!(text.ends_with(
            r#""kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1,2]],"remote_host":"10.0.0.1","remote_port":5600}}"#
        ));
    }

    #[test]
    fn failures_and_client_errors_are_told_apart() {
        assert_eq!(
            judge(None, b"", CLIENT),
            Verdict::Failed("the prefill worker reset the stream")
        );
        for status in [408, 429] {
            assert!(matches!(
                judge(Some(status), b"{}", CLIENT),
                Verdict::Failed(_)
            ));
        }
        for status in [400, 404, 413, 422] {
            assert_eq!(
                judge(Some(status), b"{}", CLIENT),
                Verdict::ClientError(status)
            );
        }
        for status in [500, 502, 503, 504, 302, 204] {
            assert!(
                matches!(judge(Some(status), ANSWER, CLIENT), Verdict::Failed(_)),
                "{status}"
            );
        }
    }

    #[test]
    fn an_answer_without_a_transfer_is_a_failure() {
        for answer in [
            &br#"{"choices":[]}"#[..],
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":{}}"#,
            br#"{"kv_transfer_params":[1]}"#,
            br#"{"kv_transfer_params":"#,
            b"not json",
            b"",
            br#"[{"kv_transfer_params":{"a":1}}]"#,
        ] {
            assert!(
                matches!(judge(Some(200), answer, CLIENT), Verdict::Failed(_)),
                "{}",
                String::from_utf8_lossy(answer)
            );
        }
    }

    #[test]
    fn a_request_id_is_its_random_draws_and_nothing_else() {
        let mut draws = [0xab_u64, 0x10].into_iter();
        let id = request_id(|| draws.next().unwrap_or_default());
        assert_eq!(id, "kvgate-00000000000000ab0000000000000010");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever a prefill worker answers, the judge never panics,
            /// and a transfer always keeps the client's bytes as its head.
            #[test]
            fn any_answer_is_judged(status in proptest::option::of(100u16..600), answer in proptest::collection::vec(any::<u8>(), 0..256)) {
                if let Verdict::Transfer(body) = judge(status, &answer, CLIENT) {
                    prop_assert!(body.starts_with(&CLIENT[..CLIENT.len() - 1]));
                }
            }

            /// Answers shaped like vLLM's, with any parameters object.
            #[test]
            fn any_params_object_is_spliced_verbatim(keys in proptest::collection::vec("[a-z_]{1,12}", 1..6), n in any::<i64>()) {
                let inner: Vec<String> = keys.iter().map(|k| format!("\"{k}\":{n}")).collect();
                let params = format!("{{{}}}", inner.join(","));
                let answer = format!(r#"{{"id":"x","kv_transfer_params":{params}}}"#);
                let Verdict::Transfer(body) = judge(Some(200), answer.as_bytes(), CLIENT) else {
                    return Err(TestCaseError::fail("no transfer"));
                };
                let text = String::from_utf8(body).unwrap();
                let expected = format!("\"kv_transfer_params\":{params}}}");
                prop_assert!(text.ends_with(&expected), "{}", text);
            }
        }
    }
}
