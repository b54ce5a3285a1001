//! Admission: what happens to a request no worker may take now. Rather
//! than shed it at once, a front door may hold it, in a [`queue`] ordered
//! by class and deadline, until a worker frees up or its deadline passes.
//! A class that may not use the share of the busy thresholds reserved for
//! critical work is placed against narrower thresholds
//! ([`thresholds_scale`]). A decode worker's bound on requests in flight
//! is checked again as a request is sent, against the [`ledger`] every
//! worker thread of one proxy shares, so that two threads never send into
//! the same last slot.
//!
//! Pure logic and formats only: the filter holds the requests and makes
//! the host calls.

pub mod body;
pub mod fair;
pub mod ledger;
pub mod queue;

/// The busy thresholds a request is placed against, as a multiple of the
/// model's (`plan::Ask::thresholds_scale`): a class without the reserve
/// stops `reserve` (a fraction) short of them; a retry holding its
/// ticket (`retry_headroom`, a fraction) goes that much over what its
/// class may use. `None`: the published busy flags as they are.
pub fn thresholds_scale(
    reserve: f64,
    may_use_reserve: bool,
    retry_headroom: Option<f64>,
) -> Option<f64> {
    // NaN and nothing reserved read as no reserve.
    let class = if may_use_reserve || reserve.is_nan() || reserve <= 0.0 {
        1.0
    } else {
        (1.0 - reserve).clamp(0.0, 1.0)
    };
    let retry = retry_headroom.map_or(1.0, |h| 1.0 + h.max(0.0));
    let scale = class * retry;
    (scale != 1.0 && scale.is_finite()).then_some(scale)
}

/// The share of the busy thresholds reserved for critical work where no
/// setting says otherwise (the filter's `admission.reserve_pct`, the
/// selection API's).
pub const DEFAULT_RESERVE: f64 = 0.10;

/// Whether a request with Dynamo's scheduler fields belongs to the class
/// that may use the reserve: `strict_priority` tier 0 (Dynamo's first
/// tier) or any `priority_jump` ahead. A later tier, or neither field, is
/// the default class, which may not.
pub fn dynamo_reserve(strict_priority: Option<i64>, priority_jump: Option<f64>) -> bool {
    strict_priority == Some(0) || priority_jump.is_some_and(|j| j > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_narrows_only_classes_without_it() {
        assert_eq!(thresholds_scale(0.1, true, None), None);
        assert_eq!(thresholds_scale(0.0, false, None), None);
        assert_eq!(thresholds_scale(0.1, false, None), Some(0.9));
        assert_eq!(thresholds_scale(0.2, false, Some(0.5)), Some(0.8 * 1.5));
        assert_eq!(thresholds_scale(0.2, true, Some(0.5)), Some(1.5));
        assert_eq!(thresholds_scale(f64::NAN, false, None), None);
    }

    #[test]
    fn dynamos_first_tier_and_a_jump_ahead_are_critical() {
        assert!(dynamo_reserve(Some(0), None));
        assert!(dynamo_reserve(None, Some(2.5)));
        assert!(!dynamo_reserve(Some(1), None));
        assert!(!dynamo_reserve(None, Some(0.0)));
        assert!(!dynamo_reserve(None, Some(f64::NAN)));
        assert!(!dynamo_reserve(None, None));
    }
}
