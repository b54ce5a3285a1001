//! Busy rules: when a data-parallel rank, and so a worker, stops taking work.
//!
//! These follow Dynamo's request-rejection semantics. A rank is busy when its
//! decode blocks fill the KV cache past a fraction, or when its queued
//! prefill tokens exceed an absolute or a batch-relative bound. The decode
//! condition latches: it sets above the threshold and clears only when usage
//! is back under it, so a rank at the edge does not flap between admitting
//! and shedding on every snapshot. A worker is busy only when *all* its ranks
//! are.

use crate::state::{RankLoad, Thresholds};

/// How far under the decode threshold both usage signals must fall before a
/// latched rank takes work again. Engines report KV usage in coarse steps;
/// without a margin a rank hovering at the line would alternate every scrape.
pub const DECODE_CLEAR_MARGIN: f64 = 0.02;

/// Why a rank is busy; the first condition that holds wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusyReason {
    DecodeBlocks,
    PrefillTokens,
    PrefillTokensFrac,
}

impl BusyReason {
    pub fn as_str(self) -> &'static str {
        match self {
            BusyReason::DecodeBlocks => "decode_blocks",
            BusyReason::PrefillTokens => "prefill_tokens",
            BusyReason::PrefillTokensFrac => "prefill_tokens_frac",
        }
    }
}

/// Evaluates one rank. `decode_latched` is the rank's latch from the last
/// evaluation; it is updated in place.
pub fn rank_busy(
    load: &RankLoad,
    th: &Thresholds,
    decode_latched: &mut bool,
) -> Option<BusyReason> {
    if let Some(limit) = th.active_decode_blocks {
        if load.kv_total_blocks > 0 {
            let total = load.kv_total_blocks as f64;
            let used = load.kv_used_blocks as f64 / total;
            let decode = load.active_decode_blocks as f64 / total;
            let clear_below = limit - DECODE_CLEAR_MARGIN;
            if used > limit || decode > limit {
                *decode_latched = true;
            } else if used <= clear_below && decode <= clear_below {
                *decode_latched = false;
            }
        }
    } else {
        *decode_latched = false;
    }
    if *decode_latched {
        return Some(BusyReason::DecodeBlocks);
    }
    if let Some(limit) = th.active_prefill_tokens
        && load.active_prefill_tokens > limit
    {
        return Some(BusyReason::PrefillTokens);
    }
    if let Some(frac) = th.active_prefill_tokens_frac
        && load.max_num_batched_tokens > 0
        && load.active_prefill_tokens as f64 > frac * load.max_num_batched_tokens as f64
    {
        return Some(BusyReason::PrefillTokensFrac);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(used: u64, decode: u64, prefill: u64) -> RankLoad {
        RankLoad {
            kv_used_blocks: used,
            active_decode_blocks: decode,
            kv_total_blocks: 100,
            active_prefill_tokens: prefill,
            max_num_batched_tokens: 1000,
            ..Default::default()
        }
    }

    #[test]
    fn no_thresholds_never_busy() {
        let mut latch = false;
        assert_eq!(
            rank_busy(&load(100, 100, 1 << 40), &Thresholds::default(), &mut latch),
            None
        );
        assert!(!Thresholds::default().is_enabled());
    }

    #[test]
    fn decode_latches_until_back_under() {
        let th = Thresholds {
            active_decode_blocks: Some(0.8),
            ..Default::default()
        };
        let mut latch = false;
        assert_eq!(
            rank_busy(&load(81, 10, 0), &th, &mut latch),
            Some(BusyReason::DecodeBlocks)
        );
        assert!(latch);
        // Still over on the decode side alone: stays busy.
        assert_eq!(
            rank_busy(&load(10, 85, 0), &th, &mut latch),
            Some(BusyReason::DecodeBlocks)
        );
        // Back at the line but inside the margin: still latched.
        assert_eq!(
            rank_busy(&load(80, 80, 0), &th, &mut latch),
            Some(BusyReason::DecodeBlocks)
        );
        assert_eq!(rank_busy(&load(78, 78, 0), &th, &mut latch), None);
        assert!(!latch);
    }

    #[test]
    fn prefill_absolute_and_fraction() {
        let th = Thresholds {
            active_prefill_tokens: Some(5000),
            active_prefill_tokens_frac: Some(2.0),
            ..Default::default()
        };
        let mut latch = false;
        assert_eq!(rank_busy(&load(0, 0, 1999), &th, &mut latch), None);
        assert_eq!(
            rank_busy(&load(0, 0, 2001), &th, &mut latch),
            Some(BusyReason::PrefillTokensFrac)
        );
        assert_eq!(
            rank_busy(&load(0, 0, 5001), &th, &mut latch),
            Some(BusyReason::PrefillTokens)
        );
    }

    #[test]
    fn unknown_kv_capacity_does_not_trip_decode() {
        let th = Thresholds {
            active_decode_blocks: Some(0.5),
            ..Default::default()
        };
        let mut latch = false;
        let mut l = load(90, 90, 0);
        l.kv_total_blocks = 0;
        assert_eq!(rank_busy(&l, &th, &mut latch), None);
    }
}
