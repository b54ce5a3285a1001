//! Tenant fairness while a model is contended: each tenant's dominant
//! share of the load every gateway has booked on the model (the larger of
//! its share of the prompt tokens and of the decode blocks: whichever of
//! the two it crowds others out of), divided by its weight. A tenant with
//! the lowest goes first among held requests of one class, and a full
//! queue makes room by shedding the highest's. Uncontended, nothing is
//! held and anyone may use everything.

/// One tenant's booked load on a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Booked<'a> {
    pub tenant: &'a str,
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
}

/// A tenant's dominant share of `loads` over its `weight` (a weight of 0
/// or less, or not a number, reads as 1). 0 for a tenant with nothing
/// booked, or a model with nothing booked.
pub fn weighted_share(loads: &[Booked<'_>], tenant: &str, weight: f64) -> f64 {
    let (mut prefill, mut decode) = (0u64, 0u64);
    for l in loads {
        prefill = prefill.saturating_add(l.prefill_tokens);
        decode = decode.saturating_add(l.decode_blocks);
    }
    let Some(own) = loads.iter().find(|l| l.tenant == tenant) else {
        return 0.0;
    };
    let share = |part: u64, all: u64| {
        if all == 0 {
            0.0
        } else {
            part as f64 / all as f64
        }
    };
    let dominant = share(own.prefill_tokens, prefill).max(share(own.decode_blocks, decode));
    let weight = if weight > 0.0 && weight.is_finite() {
        weight
    } else {
        1.0
    };
    dominant / weight
}

/// Whether `tenant` holds more than its weight's part of the booked
/// load: its dominant share over the share its weight gives it among the
/// tenants that contend for the model: those with load, those `waiting`
/// (with requests held), and itself. `weight_of` names each tenant's
/// weight.
pub fn over_share<'a>(
    loads: &[Booked<'_>],
    tenant: &str,
    waiting: impl IntoIterator<Item = &'a str>,
    weight_of: impl Fn(&str) -> f64,
) -> bool {
    let w = |t: &str| {
        let w = weight_of(t);
        if w > 0.0 && w.is_finite() { w } else { 1.0 }
    };
    let mut contenders: Vec<&str> = loads
        .iter()
        .filter(|l| l.prefill_tokens > 0 || l.decode_blocks > 0)
        .map(|l| l.tenant)
        .collect();
    for t in waiting {
        if !contenders.contains(&t) {
            contenders.push(t);
        }
    }
    if !contenders.contains(&tenant) {
        contenders.push(tenant);
    }
    let total: f64 = contenders.iter().map(|t| w(t)).sum();
    if total <= 0.0 {
        return false;
    }
    let fair = w(tenant) / total;
    weighted_share(loads, tenant, 1.0) > fair + 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(tenant: &str, prefill_tokens: u64, decode_blocks: u64) -> Booked<'_> {
        Booked {
            tenant,
            prefill_tokens,
            decode_blocks,
        }
    }

    #[test]
    fn the_dominant_share_counts_whichever_load_a_tenant_crowds_most() {
        let loads = [b("a", 3000, 10), b("b", 1000, 90)];
        assert_eq!(weighted_share(&loads, "a", 1.0), 0.75);
        assert_eq!(weighted_share(&loads, "b", 1.0), 0.9);
        assert_eq!(weighted_share(&loads, "b", 3.0), 0.3);
        assert_eq!(weighted_share(&loads, "c", 1.0), 0.0);
        assert_eq!(
            weighted_share(&loads, "a", f64::NAN),
            0.75,
            "a bad weight reads as 1"
        );
        assert_eq!(weighted_share(&[b("a", 0, 0)], "a", 1.0), 0.0);
    }

    #[test]
    fn a_tenant_over_its_weights_part_is_over_its_share() {
        let equal = |_: &str| 1.0;
        let none: [&str; 0] = [];
        let loads = [b("heavy", 8000, 80), b("light", 2000, 20)];
        assert!(over_share(&loads, "heavy", none, equal));
        assert!(!over_share(&loads, "light", none, equal));
        // Weighted 4 to 1, 80 % is heavy's part.
        let weights = |t: &str| if t == "heavy" { 4.0 } else { 1.0 };
        assert!(!over_share(&loads, "heavy", none, weights));
        // A newcomer with nothing booked is under; its weight counts.
        assert!(!over_share(&loads, "new", none, equal));
        let alone = [b("solo", 100, 1)];
        assert!(
            !over_share(&alone, "solo", none, equal),
            "alone, everything is its part"
        );
        // ... until another waits for the model with nothing booked yet.
        assert!(over_share(&alone, "solo", ["waiter"], equal));
        assert!(!over_share(&alone, "waiter", ["solo", "waiter"], equal));
        assert!(!over_share(&[], "x", none, equal));
    }
}
