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
//!   with no prefill leg.

pub mod nixl;
pub mod sglang;

use std::borrow::Cow;

/// Fields of a client's body that only kvgate may set on a request of a
/// disaggregated model: each names where KV blocks come from.
const TRANSFER_FIELDS: [&str; 4] = [
    nixl::PARAMS,
    sglang::FIELDS[0],
    sglang::FIELDS[1],
    sglang::FIELDS[2],
];

/// The body a worker of a disaggregated model gets when it computes the
/// prompt itself (no transfer): the client's own bytes, or, when the
/// client sent transfer fields of its own (`kv_transfer_params`,
/// `bootstrap_host`, `bootstrap_port`, `bootstrap_room`), the body
/// without them, its other values verbatim.
pub fn whole_body(client: &[u8]) -> Result<Cow<'_, [u8]>, nixl::BodyError> {
    let fields = nixl::Fields::parse(client)?;
    if !TRANSFER_FIELDS.iter().any(|f| fields.get(f).is_some()) {
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
        out.extend_from_slice(v.get().as_bytes());
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
