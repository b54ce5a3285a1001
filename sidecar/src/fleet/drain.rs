//! Drain time: when a busy rank is expected to take work again, which is
//! what a shed request's `Retry-After` says.

use crate::sources::bookings::SlotLoad;
use kvgate_core::busy::DECODE_CLEAR_MARGIN;
use kvgate_core::{RankLoad, Thresholds};

/// Seconds until a busy rank is expected under all its thresholds again, at
/// the rate its bookings have been draining; `None` when nothing drained
/// lately (the caller falls back to the configured default).
pub(super) fn drain_time(load: &RankLoad, th: &Thresholds, booked: &SlotLoad) -> Option<f64> {
    let mut worst: f64 = 0.0;
    if let Some(limit) = th.active_decode_blocks
        && load.kv_total_blocks > 0
    {
        let clear_at = (limit - DECODE_CLEAR_MARGIN).max(0.0) * load.kv_total_blocks as f64;
        let booked_used = load.active_decode_blocks as f64;
        let engine_used = load.kv_used_blocks as f64;
        let used = booked_used.max(engine_used);
        if used > clear_at {
            // The rate of whichever count keeps the rank busy. The engine's
            // usage (which holds shared prefixes and other gateways' work)
            // falls as its running requests finish, each freeing its share;
            // dividing it by the drain of this gateway's bookings alone made
            // the estimate jump to its cap.
            let rate = if engine_used > booked_used {
                booked.completions_per_s * engine_used / f64::from(load.running.max(1))
            } else {
                booked.decode_drain_per_s
            };
            if rate <= 0.0 {
                return None;
            }
            worst = worst.max((used - clear_at) / rate);
        }
    }
    let mut prefill_limit: Option<f64> = th.active_prefill_tokens.map(|t| t as f64);
    if let Some(frac) = th.active_prefill_tokens_frac
        && load.max_num_batched_tokens > 0
    {
        let f = frac * load.max_num_batched_tokens as f64;
        prefill_limit = Some(prefill_limit.map_or(f, |p| p.min(f)));
    }
    if let Some(limit) = prefill_limit
        && load.active_prefill_tokens as f64 > limit
    {
        if booked.prefill_drain_per_s <= 0.0 {
            return None;
        }
        worst = worst.max((load.active_prefill_tokens as f64 - limit) / booked.prefill_drain_per_s);
    }
    Some(worst)
}
