//! Latency fits: what a request's time to first token and inter-token
//! latency would be on a worker, from a line the sidecar fits to what the
//! gateways measured there and publishes per worker in the snapshot
//! (minor 10).
//!
//! A fit is only as good as its inputs: the sidecar learns it against load
//! read from its ledger when each request was booked, and a router
//! predicts with the same quantities read from a snapshot's [`RankLoad`].
//! The two `x`s are defined once, here ([`ttft_x_ktok`], [`itl_x_ktok`]),
//! so the learning and the predicting side cannot drift apart.

use crate::state::RankLoad;
#[cfg(feature = "serde")]
use serde::{Deserialize, Serialize};

/// Samples before a fit predicts: fewer is a line through noise. The
/// sidecar's planner trusts its fits at the same count.
pub const MIN_SAMPLES: u32 = 10;
/// A fit whose last sample is older than this predicts nothing: the engine
/// behind it may have changed (a restart, a new version) since it was
/// measured, and a stale line would route as if it had not.
pub const MAX_AGE_S: u32 = 300;
/// Tokens in a unit of `x`: thousands keep both coefficients of a fit of
/// similar size, which keeps its least squares well conditioned.
pub const KTOK: f64 = 1000.0;

/// One latency against one kind of load: `latency_ms = intercept_ms +
/// slope_ms_per_ktok × x`, with `x` in thousands of tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct Fit {
    pub intercept_ms: f32,
    pub slope_ms_per_ktok: f32,
    /// Samples the fit has taken (it forgets old ones gradually, so this
    /// says how much it has seen, not how many it weighs).
    pub samples: u32,
    /// Seconds since its last sample, when the snapshot was built.
    pub age_s: u32,
}

impl Fit {
    /// The latency at `x_ktok`, in ms, never below 0; `None` ("unknown")
    /// while the fit has too few samples, is too old, or is not a number.
    pub fn predict(&self, x_ktok: f64) -> Option<f64> {
        if self.samples < MIN_SAMPLES || self.age_s > MAX_AGE_S || !self.is_finite() {
            return None;
        }
        let y = f64::from(self.intercept_ms) + f64::from(self.slope_ms_per_ktok) * x_ktok;
        y.is_finite().then(|| y.max(0.0))
    }

    /// Both coefficients are numbers.
    pub fn is_finite(&self) -> bool {
        self.intercept_ms.is_finite() && self.slope_ms_per_ktok.is_finite()
    }
}

/// A worker's latency fits: its own once it has [`MIN_SAMPLES`], else its
/// role's, pooled over the model's workers of that role.
///
/// * `ttft`: a whole request's or prefill leg's time to first token (from
///   its dispatch to the engine's first byte, ms) against [`ttft_x_ktok`]:
///   the prompt tokens booked on the rank before it, plus its own uncached
///   prompt tokens, in thousands.
/// * `itl`: a whole request's or decode leg's mean inter-token latency
///   (its time after the first byte over its tokens after the first, ms)
///   against [`itl_x_ktok`]: the KV tokens booked on the rank before it
///   (its decode blocks × the worker's block size), in thousands. Its own
///   are not counted.
///
/// Both loads are what every gateway has booked there (the ledger's, the
/// snapshot's [`RankLoad`]), not the engine's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
pub struct WorkerFits {
    pub ttft: Fit,
    pub itl: Fit,
}

impl WorkerFits {
    /// A request's time to first token on `rank`, were it sent there with
    /// `uncached_tokens` of its prompt to compute.
    pub fn ttft_ms(&self, rank: &RankLoad, uncached_tokens: u64) -> Option<f64> {
        self.ttft
            .predict(ttft_x_ktok(rank.active_prefill_tokens, uncached_tokens))
    }

    /// A request's inter-token latency on `rank`, of a worker whose KV
    /// blocks hold `block_size` tokens.
    pub fn itl_ms(&self, rank: &RankLoad, block_size: u32) -> Option<f64> {
        self.itl
            .predict(itl_x_ktok(rank.active_decode_blocks, block_size))
    }
}

/// The TTFT fit's `x`: `active_prefill_tokens` booked on the rank before
/// the request, plus its `uncached_tokens`, in thousands of tokens.
pub fn ttft_x_ktok(active_prefill_tokens: u64, uncached_tokens: u64) -> f64 {
    active_prefill_tokens.saturating_add(uncached_tokens) as f64 / KTOK
}

/// The ITL fit's `x`: `active_decode_blocks` booked on the rank before the
/// request, times `block_size`, in thousands of tokens.
pub fn itl_x_ktok(active_decode_blocks: u64, block_size: u32) -> f64 {
    active_decode_blocks.saturating_mul(u64::from(block_size)) as f64 / KTOK
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fit(intercept_ms: f32, slope_ms_per_ktok: f32) -> Fit {
        Fit {
            intercept_ms,
            slope_ms_per_ktok,
            samples: MIN_SAMPLES,
            age_s: 0,
        }
    }

    #[test]
    fn predicts_from_the_ranks_load_and_the_requests_own() {
        let f = WorkerFits {
            ttft: fit(40.0, 12.0),
            itl: fit(8.0, 0.5),
        };
        let rank = RankLoad {
            active_prefill_tokens: 1500,
            active_decode_blocks: 250,
            ..Default::default()
        };
        // 1500 booked + 500 of its own = 2 ktok: 40 + 12 × 2.
        assert_eq!(f.ttft_ms(&rank, 500), Some(64.0));
        // 250 blocks × 16 tokens = 4 ktok: 8 + 0.5 × 4.
        assert_eq!(f.itl_ms(&rank, 16), Some(10.0));
        // A line that falls below 0 at this load predicts 0, not less.
        assert_eq!(fit(10.0, -20.0).predict(1.0), Some(0.0));
        assert_eq!(ttft_x_ktok(u64::MAX, 1), u64::MAX as f64 / KTOK);
    }

    #[test]
    fn too_few_samples_too_old_or_not_a_number_is_unknown() {
        let good = fit(40.0, 12.0);
        assert!(good.predict(1.0).is_some());
        let unknown = [
            Fit {
                samples: MIN_SAMPLES - 1,
                ..good
            },
            Fit {
                age_s: MAX_AGE_S + 1,
                ..good
            },
            Fit {
                intercept_ms: f32::NAN,
                ..good
            },
            Fit {
                slope_ms_per_ktok: f32::INFINITY,
                ..good
            },
            Fit::default(),
        ];
        for f in unknown {
            assert_eq!(f.predict(1.0), None, "{f:?}");
        }
        assert_eq!(good.predict(f64::NAN), None);
        assert_eq!(
            Fit {
                age_s: MAX_AGE_S,
                ..good
            }
            .predict(0.0),
            Some(40.0),
            "as old as allowed still predicts"
        );
    }
}
