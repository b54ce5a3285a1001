//! The two workers of a pull, found among a model's ranks: the holder of
//! the longest cached prefix that may take a prefill leg, and the decode
//! worker that prices cheapest with the transfer from it
//! ([`crate::disagg::pull`] prices them).

use super::select::{Choice, Leg, Overlap, RequestShape, Term, busy_for};
use super::{Ask, Gathered};
use crate::busy::rank_busy;
use crate::disagg::pull::{Distance, Prompt, Pull, Quote, Side};
use crate::fit::KTOK;
use crate::state::{ModelState, Policy, RankLoad, Role, WorkerState};

/// The best pull for a request, and the longest prefix any rank holds.
#[derive(Debug, Clone, Copy)]
pub(super) struct Found<'a> {
    /// The pull and its two ranks, where one is quoted at all.
    pub best: Option<Quoted<'a>>,
    /// The most blocks of the prompt any of the tenant's ranks holds on
    /// its device, loaded or not: what a whole placement elsewhere
    /// computes again.
    pub longest: u32,
}

/// A quoted pull.
#[derive(Debug, Clone, Copy)]
pub(super) struct Quoted<'a> {
    pub holder: Choice<'a>,
    pub decoder: Choice<'a>,
    pub quote: Quote,
}

/// One rank as both sides of the comparison see it.
#[derive(Clone, Copy)]
struct Rank<'a> {
    worker: &'a WorkerState,
    rank: &'a RankLoad,
    overlap: Overlap,
    side: Side,
}

/// Looks for the cheapest pull of a request of `shape` among `model`'s
/// `both` ranks of `tenant`. Candidates are judged as selection judges
/// them (draining, capped and busy ranks are left out), except that the
/// holder takes only a prefill leg: its decode load is no reason to
/// refuse it, since the answer's blocks leave with the transfer, but
/// requests waiting in its engine's queue are.
pub(super) fn find<'a>(
    g: &Gathered<'a>,
    pull: &Pull,
    tenant: &str,
    shape: &RequestShape,
    ask: &Ask,
    terms: &[&dyn Term],
) -> Found<'a> {
    let model = g.model;
    let policy = &model.policy;
    let scale = ask.thresholds_scale.unwrap_or(1.0);
    let request_bound = model.thresholds.scaled(scale).active_decode_requests;
    let mut longest = 0u32;
    let mut holders: Vec<Rank<'a>> = Vec::new();
    let mut decoders: Vec<Rank<'a>> = Vec::new();
    for worker in model
        .workers
        .iter()
        .filter(|w| w.tenant == tenant && w.role == Role::Both)
    {
        let at_cap = worker.thermal.at_cap();
        let full = request_bound.is_some_and(|b| u64::from(worker.thermal.in_flight) >= b);
        let heat = 1.0 + policy.thermal_weight * worker.thermal.heat.clamp(0.0, 1.0);
        for rank in &worker.ranks {
            let overlap = g.cached.of(worker, rank.slot);
            longest = longest.max(overlap.device);
            if worker.draining || at_cap {
                continue;
            }
            let extra: f64 = terms.iter().map(|t| t.cost(worker, rank)).sum();
            let r = Rank {
                worker,
                rank,
                overlap,
                side: sides(policy, shape, worker, rank, overlap, extra, heat),
            };
            // A holder whose engine has requests waiting for a batch slot
            // would queue the prefill leg behind them: the pull inherits
            // the very queue it was to avoid.
            if overlap.device >= pull.min_blocks.max(1)
                && rank.waiting == 0
                && !prefill_busy(model, rank, scale)
            {
                holders.push(r);
            }
            if !full && !busy_for(model, worker, rank, ask.thresholds_scale, false) {
                decoders.push(r);
            }
        }
    }
    let mut best: Option<Quoted<'a>> = None;
    for h in &holders {
        let bs = h.worker.block_size.max(1);
        let prompt = Prompt {
            blocks: shape.isl_tokens.div_ceil(u64::from(bs)),
            block_size: bs,
            prefill_load_scale: policy.prefill_load_scale,
        };
        let rate = tokens_per_s(h.worker, pull);
        for d in decoders
            .iter()
            .filter(|d| !std::ptr::eq(d.worker, h.worker) && d.worker.block_size.max(1) == bs)
        {
            let distance = Distance::between(&h.worker.topology, &d.worker.topology);
            let Some(quote) = pull.quote(prompt, &h.side, &d.side, distance, rate) else {
                continue;
            };
            if best.is_some_and(|b| b.quote.cost <= quote.cost) {
                continue;
            }
            best = Some(Quoted {
                holder: choice(h),
                decoder: choice(d),
                quote,
            });
        }
    }
    // The pull's first token comes after the holder's prefill and the
    // transfer: predicted where the holder's fit can say.
    if let Some(b) = &mut best {
        let bs = u64::from(b.holder.worker.block_size.max(1));
        let uncached = shape
            .isl_tokens
            .saturating_sub(u64::from(b.holder.overlap.device).saturating_mul(bs));
        b.decoder.ttft_ms = b
            .holder
            .worker
            .fits
            .as_ref()
            .and_then(|f| f.ttft_ms(b.holder.rank, uncached))
            .map(|t| t + b.quote.transfer_ms);
    }
    Found { best, longest }
}

/// A rank's two sides of the logit, with its extra terms charged to the
/// prefill side (they weigh a worker, not a leg).
fn sides(
    policy: &Policy,
    shape: &RequestShape,
    worker: &WorkerState,
    rank: &RankLoad,
    overlap: Overlap,
    extra: f64,
    heat: f64,
) -> Side {
    let whole = RequestShape {
        leg: Leg::Whole,
        ..*shape
    };
    Side {
        cached_blocks: overlap.device,
        prefill: policy.prefill_cost(&whole, worker.block_size, rank, overlap) + extra,
        decode: policy.decode_cost(&whole, worker.block_size, rank, overlap),
        heat,
    }
}

fn choice<'a>(r: &Rank<'a>) -> Choice<'a> {
    Choice {
        worker: r.worker,
        rank: r.rank,
        logit: r.side.whole(),
        overlap: r.overlap,
        ttft_ms: None,
    }
}

/// Whether a rank is busy for a prefill leg: its prompt thresholds only,
/// at the request's scale. Its decode blocks and requests stay as they
/// are, since the prompt's blocks leave with the transfer.
fn prefill_busy(model: &ModelState, rank: &RankLoad, scale: f64) -> bool {
    let th = Role::Prefill
        .judged_by(model.thresholds, true)
        .scaled(scale);
    let th = crate::state::Thresholds {
        active_decode_requests: None,
        ..th
    };
    rank_busy(rank, &th, &mut false).is_some()
}

/// The holder's prefill speed: its TTFT fit's slope where usable (ms per
/// thousand tokens of queue and prompt), else the model's setting.
fn tokens_per_s(worker: &WorkerState, pull: &Pull) -> f64 {
    worker
        .fits
        .as_ref()
        .and_then(|f| {
            let slope = f.ttft.predict(1.0)? - f.ttft.predict(0.0)?;
            (slope > 0.0).then(|| KTOK * 1e3 / slope)
        })
        .unwrap_or(pull.prefill_tokens_per_s)
}
