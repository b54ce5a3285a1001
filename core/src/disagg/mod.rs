//! Disaggregated prefill and decode: a request's prompt is computed on a
//! prefill worker, and its KV blocks move to the decode worker that
//! generates the answer.
//!
//! * [`nixl`]: vLLM's NIXL protocol, the bodies of its two legs: the
//!   prefill leg's rewrite of the client's body, the parameters its answer
//!   carries, and the decode leg's body with them spliced in;
//! * [`sglang`]: SGLang's protocol, the one body both legs get (the
//!   client's with the bootstrap fields) and the bootstrap room;
//! * [`Conditional`]: when the decode worker computes the prompt itself,
//!   with no prefill leg;
//! * [`pull`]: on a model of `both` workers, when the worker holding a
//!   prompt's prefix prefills it and another pulls the KV to decode.

pub mod nixl;
pub mod pull;
pub mod sglang;

use std::borrow::Cow;

/// What a decode body may grow past `max_body_bytes` by: the transfer
/// parameters kvgate splices into the client's body (vLLM's
/// `kv_transfer_params`, SGLang's bootstrap fields). Envoy's buffer
/// limit on the inference listener must be at least `max_body_bytes`
/// plus this: a body set from a callout's callback over that limit makes
/// Envoy answer 413 from inside the callback, which aborts the process.
pub const DECODE_HEADROOM_BYTES: usize = 1 << 20;

/// What the transfer parameters are expected to add to a prompt of
/// `isl_tokens`: a fixed part (engine id, host, port, flags) and a block
/// id per 16 tokens (vLLM's smallest usual block), each up to seven
/// digits and a comma. A decode body that would not fit
/// `max_body_bytes` plus [`DECODE_HEADROOM_BYTES`] by this estimate is
/// not worth a prefill leg: it is computed where it is decoded.
pub fn decode_growth(isl_tokens: u64) -> usize {
    const FIXED: u64 = 1024;
    const PER_BLOCK: u64 = 8;
    let blocks = isl_tokens.div_ceil(16);
    usize::try_from(FIXED.saturating_add(blocks.saturating_mul(PER_BLOCK))).unwrap_or(usize::MAX)
}

/// Fields of a client's body that only kvgate may set on a request of a
/// disaggregated model: each names where KV blocks come from, or (the
/// request id) which transfer a worker matches them to.
const TRANSFER_FIELDS: [&str; 5] = [
    nixl::PARAMS,
    sglang::FIELDS[0],
    sglang::FIELDS[1],
    sglang::FIELDS[2],
    nixl::REQUEST_ID,
];

/// vLLM's extra arguments: it takes `kv_transfer_params` from them when
/// the body has none at the top level.
const XARGS: &str = "vllm_xargs";

/// The body a worker of a disaggregated model gets when it computes the
/// prompt itself (no transfer): the client's own bytes, or, when the
/// client sent transfer fields of its own (`kv_transfer_params`, also
/// inside `vllm_xargs`, `bootstrap_host`, `bootstrap_port`,
/// `bootstrap_room`, `request_id`), the body without them, its other
/// values verbatim.
pub fn whole_body(client: &[u8]) -> Result<Cow<'_, [u8]>, nixl::BodyError> {
    let fields = nixl::Fields::parse(client)?;
    // vLLM reads `vllm_xargs` only as an object; anything else it refuses.
    let xargs = fields
        .get(XARGS)
        .and_then(|v| nixl::Fields::parse(v.get().as_bytes()).ok())
        .filter(|x| x.get(nixl::PARAMS).is_some());
    if xargs.is_none() && !TRANSFER_FIELDS.iter().any(|f| fields.get(f).is_some()) {
        return Ok(Cow::Borrowed(client));
    }
    let mut out = Vec::with_capacity(client.len());
    out.push(b'{');
    for (k, v) in fields
        .0
        .iter()
        .filter(|(k, _)| !TRANSFER_FIELDS.contains(&k.as_ref()))
    {
        if out.len() > 1 {
            out.push(b',');
        }
        nixl::push_key(&mut out, k);
        match (&xargs, k.as_ref()) {
            (Some(x), XARGS) => {
                out.push(b'{');
                let start = out.len();
                for (xk, xv) in x.0.iter().filter(|(xk, _)| xk != nixl::PARAMS) {
                    if out.len() > start {
                        out.push(b',');
                    }
                    nixl::push_key(&mut out, xk);
                    out.extend_from_slice(xv.get().as_bytes());
                }
                out.push(b'}');
            }
            _ => out.extend_from_slice(v.get().as_bytes()),
        }
    }
    out.push(b'}');
    Ok(Cow::Owned(out))
}

/// Skips the prefill leg when the decode worker would compute little of
/// the prompt itself: its uncached part is short in tokens and as a share
/// of the prompt (Dynamo's conditional disaggregation: under 2048 tokens
/// and under 70 %). A remote prefill costs a second hop and a transfer;
/// for a short or mostly cached prompt that is more than computing it.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Conditional {
    /// Fewer uncached tokens than this can be computed locally.
    pub max_uncached_tokens: u64,
    /// And only if they are less than this share of the prompt.
    pub max_uncached_ratio: f64,
}

impl Default for Conditional {
    fn default() -> Conditional {
        Conditional {
            max_uncached_tokens: 2048,
            max_uncached_ratio: 0.7,
        }
    }
}

impl Conditional {
    /// Whether a prompt of `isl_tokens`, of which the decode worker holds
    /// `cached_tokens`, is computed on the decode worker.
    pub fn local(&self, isl_tokens: u64, cached_tokens: u64) -> bool {
        let uncached = isl_tokens.saturating_sub(cached_tokens);
        uncached < self.max_uncached_tokens
            && (uncached as f64) < self.max_uncached_ratio * isl_tokens as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_body_carries_no_transfer_field_of_the_clients() {
        let plain = br#"{"model":"m","temperature":0.10}"#;
        assert!(matches!(whole_body(plain).unwrap(), Cow::Borrowed(_)));
        let out = whole_body(
            br#"{"bootstrap_room":1,"model":"m","kv_transfer_params":{},"bootstrap_host":"h","temperature":0.10,"bootstrap_port":2}"#,
        )
        .unwrap();
        assert_eq!(&*out, br#"{"model":"m","temperature":0.10}"#);
        assert!(whole_body(b"[1]").is_err());
    }

    #[test]
    fn a_whole_body_drops_transfer_params_inside_vllm_xargs_and_the_clients_request_id() {
        let out = whole_body(
            br#"{"model":"m","vllm_xargs":{"a":1,"kv_transfer_params":{"remote_host":"evil"},"b":"x"},"request_id":"victim"}"#,
        )
        .unwrap();
        assert_eq!(&*out, br#"{"model":"m","vllm_xargs":{"a":1,"b":"x"}}"#);
        // Extra arguments without transfer parameters stay as they came.
        let plain = br#"{"model":"m","vllm_xargs":{"a": 1}}"#;
        assert!(matches!(whole_body(plain).unwrap(), Cow::Borrowed(_)));
        // Not an object: vLLM refuses it; kvgate passes it on untouched.
        let odd = br#"{"model":"m","vllm_xargs":[1]}"#;
        assert!(matches!(whole_body(odd).unwrap(), Cow::Borrowed(_)));
    }

    #[test]
    fn the_decode_growth_estimate_covers_a_million_token_prompt_within_the_headroom() {
        assert_eq!(decode_growth(0), 1024);
        assert_eq!(decode_growth(16), 1032);
        assert_eq!(decode_growth(17), 1040);
        assert!(decode_growth(1 << 20) < DECODE_HEADROOM_BYTES);
        assert!(decode_growth(1 << 22) > DECODE_HEADROOM_BYTES);
        assert!(decode_growth(u64::MAX) > DECODE_HEADROOM_BYTES);
    }

    #[test]
    fn short_or_mostly_cached_prompts_stay_local() {
        let c = Conditional::default();
        // Short but nothing cached: 100 % uncached is over the 70 %.
        assert!(!c.local(1000, 0));
        // Short and mostly cached.
        assert!(c.local(1000, 400));
        assert!(!c.local(1000, 300), "exactly 70 % uncached is not under it");
        // Mostly cached but long: 3000 uncached tokens.
        assert!(!c.local(10_000, 7000));
        assert!(c.local(10_000, 8000));
        assert!(!c.local(10_000, 7952), "2048 uncached is not under 2048");
        // Fully cached, and an empty prompt with nothing to compute.
        assert!(c.local(4096, 4096));
        assert!(!c.local(0, 0), "0 is not under 70 % of 0");
        // Turned off by a zero bound.
        let never = Conditional {
            max_uncached_tokens: 0,
            ..c
        };
        assert!(!never.local(4096, 4096));
    }
}
