//! What happens to a request after placement: the one owner of every rule
//! between a [`Plan`] and the bytes a front door sends.
//!
//! ```text
//! plan::Gathered::place ─► Plan ─► dispatch(plan, door, body) ─► Dispatch
//!                                                                 ├─ Whole   (one worker, its booking, the body rule)
//!                                                                 ├─ Split   (two legs, their bookings, the failure policy)
//!                                                                 └─ Refuse  (the reply, no worker)
//! ```
//!
//! Every front door renders a [`Dispatch`] and derives nothing of its
//! own: the filter in Envoy (which makes the prefill callout), the
//! selection API (which names both legs for its client to send) and the
//! ext_proc server (which cannot make a callout, and says so through its
//! [`Door`]). The rules that live here, once:
//!
//! * a disaggregated model's body is always scrubbed of the client's
//!   transfer fields and carries kvgate's request id, split or whole;
//! * an SGLang request goes whole only to a `both` worker, and Envoy's
//!   retry never takes it to another role;
//! * a split whose decode body would pass `max_body_bytes` and its
//!   headroom is not worth a prefill leg;
//! * a door that cannot make the prefill leg treats the split as a leg
//!   that failed, as the model's `on_prefill_failure` says;
//! * a failed leg is tried once on the runner-up while a tenth of the
//!   budget is left, then computed on the decode worker or refused;
//! * a pull (the holder prefills, another `both` worker decodes) never
//!   loses its request: a failed prefill leg is computed on the decode
//!   worker, whatever the model's `on_prefill_failure`.

#[cfg(test)]
mod tests;

use crate::disagg;
use crate::disagg::pull::Placed;
use crate::plan::{LocalReason, Placement, Plan, Prefill, Rejection, Route};
use crate::reply::Reply;
use crate::state::{OnPrefillFailure, Protocol, Role};

/// What a front door can do with a split request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Door {
    /// It sends (or hands its client) a prefill leg before the decode
    /// leg. A door without it serves a split request as a leg that failed.
    pub prefill_leg: bool,
}

impl Door {
    /// The filter: it calls the prefill worker from Envoy.
    pub const CALLOUT: Door = Door { prefill_leg: true };
    /// The selection API: its client sends both legs it names.
    pub const CLIENT_SENDS: Door = Door { prefill_leg: true };
    /// A door that routes one upstream request and makes no callout
    /// (the ext_proc server).
    pub const ONE_UPSTREAM: Door = Door { prefill_leg: false };
}

/// The client's body, where the door has it: a split whose decode body
/// would not fit is decided before any leg is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Body {
    pub len: usize,
    /// The door's `max_body_bytes`.
    pub max: usize,
    /// The prompt's length: the transfer parameters name its blocks.
    pub isl_tokens: u64,
}

/// A request's fate after placement, owned (nothing borrowed from the
/// snapshot): a door may act on it at once or after a callout answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Dispatch {
    Whole(Whole),
    Split(Split),
    Refuse(Refusal),
}

/// A worker's rank, and the load a leg books there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub endpoint: String,
    pub worker_id: u64,
    pub rank: u32,
    pub slot: u16,
    pub role: Role,
    /// The worker has several ranks: the rank header names this one.
    pub names_rank: bool,
    /// The rank's place among the worker's ranks, and their number: an
    /// SGLang worker serves a request on `bootstrap_room % dp_size`.
    pub dp_index: u32,
    pub dp_size: u32,
    /// Its SGLang bootstrap server's port, on the endpoint's host.
    pub bootstrap_port: u16,
    /// What the leg books on the rank until it ends: prompt tokens until
    /// its first byte, decode blocks until its last.
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// Its time to first token there, as the worker's latency fit
    /// predicts it (whole ms); `None` without a usable fit.
    pub ttft_ms: Option<u32>,
}

impl Target {
    pub fn new(p: &Placement<'_>) -> Target {
        let w = p.choice.worker;
        Target {
            endpoint: w.endpoint.clone(),
            worker_id: w.id,
            rank: p.choice.rank.rank,
            slot: p.choice.rank.slot,
            role: w.role,
            names_rank: p.names_rank(),
            dp_index: w
                .ranks
                .iter()
                .position(|r| std::ptr::eq(r, p.choice.rank))
                .and_then(|i| u32::try_from(i).ok())
                .unwrap_or(0),
            dp_size: u32::try_from(w.ranks.len()).unwrap_or(u32::MAX),
            bootstrap_port: w.bootstrap_port(),
            prefill_tokens: p.prefill_tokens,
            decode_blocks: p.decode_blocks,
            ttft_ms: p
                .choice
                .ttft_ms
                .map(|t| t.round().clamp(0.0, f64::from(u32::MAX)) as u32),
        }
    }

    /// The served-by header's value.
    pub fn served_by(&self) -> String {
        format!("worker_id={}; dp_rank={}", self.worker_id, self.rank)
    }
}

/// What a worker's body is made of when it takes the request whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WholeBody {
    /// The client's bytes: a model with no disaggregation settings.
    Verbatim,
    /// A disaggregated model's: the client's transfer fields dropped
    /// ([`disagg::whole_body`]) and the request id kvgate's, whether the
    /// request is split or not, so that no client names where blocks
    /// come from.
    Scrubbed,
}

/// Why a disaggregated model's request is served whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WholeWhy {
    /// The plan chose no prefill leg ([`LocalReason`]).
    Local(LocalReason),
    /// No worker of one of the roles is up: the model is not split now.
    NotSplit,
    /// The decode body would not fit `max_body_bytes` and its headroom.
    NoRoom,
    /// The door makes no prefill leg.
    NoLegAtDoor,
}

impl WholeWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            WholeWhy::Local(r) => r.as_str(),
            WholeWhy::NotSplit => "not_split",
            WholeWhy::NoRoom => "no_room",
            WholeWhy::NoLegAtDoor => "no_leg_at_door",
        }
    }
}

/// The request goes to one worker, which computes its prompt and answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Whole {
    /// The model the fleet knows it by: bookings go under it.
    pub model: String,
    /// Where it goes, and what it books there.
    pub target: Target,
    /// Where Envoy retries when `target` refuses the connection; it takes
    /// the same headers and the same body.
    pub fallback: Option<Target>,
    pub body: WholeBody,
    /// On a disaggregated model, why it is not split.
    pub why: Option<WholeWhy>,
    /// On a model that pulls, whether it is on the holder or recomputes.
    pub pull: Option<Placed>,
}

impl Whole {
    /// The override-host list Envoy's balancer walks: the target, then
    /// the fallback a refused connection is retried on.
    pub fn destination(&self) -> String {
        match &self.fallback {
            Some(f) => format!("{},{}", self.target.endpoint, f.endpoint),
            None => self.target.endpoint.clone(),
        }
    }
}

/// A disaggregated request: the prompt on one worker, the answer on
/// another.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    pub model: String,
    /// How the legs are sent: vLLM's NIXL (prefill first, its transfer
    /// parameters in the decode body) or SGLang (both at once, one body
    /// with a bootstrap room).
    pub protocol: Protocol,
    /// The client's request; books its decode blocks, no prompt.
    pub decode: Target,
    /// Where Envoy retries the decode leg.
    pub decode_fallback: Option<Target>,
    /// The prefill leg; books the prompt it computes, no decode blocks.
    pub prefill: Target,
    /// Where a failed prefill leg is tried once more.
    pub runner_up: Option<Target>,
    /// The prompt tokens the decode worker computes when no leg succeeds
    /// and the model says to compute it there.
    pub local_prefill_tokens: u64,
    pub on_failure: OnPrefillFailure,
    /// One budget for every try of the prefill leg.
    pub timeout_ms: u64,
    /// A pull: the prefill leg is on the holder of the prompt's prefix,
    /// and the decode worker pulls every block it lacks.
    pub pull: Option<Placed>,
}

/// A second try of a prefill leg needs at least this share (one in ten)
/// of the leg's budget left: a try that spent almost all of it is not
/// retried for the last milliseconds.
const MIN_RETRY_SHARE: u64 = 10;

/// What follows a failed prefill try.
#[derive(Debug, Clone, PartialEq)]
pub enum AfterFailure {
    /// Try the leg on this worker, within what is left of the budget.
    Retry(Target),
    /// Send the client's body to the decode worker, scrubbed, booking
    /// this many more prompt tokens there.
    Local { prefill_tokens: u64 },
    /// Answer the client.
    Refuse,
}

impl Split {
    /// What to do after a failed try: the runner-up once, if `retried`
    /// is false and at least a tenth of the budget is left (`left_us`);
    /// then as the model says. Takes the runner-up out of the split.
    pub fn after_failure(&mut self, retried: bool, left_us: u64) -> AfterFailure {
        let worth_a_try = left_us >= self.timeout_ms.saturating_mul(1000) / MIN_RETRY_SHARE;
        if !retried
            && worth_a_try
            && let Some(next) = self.runner_up.take()
        {
            return AfterFailure::Retry(next);
        }
        self.give_up()
    }

    /// No prefill leg will be: as the model says.
    pub fn give_up(&self) -> AfterFailure {
        match self.on_failure {
            OnPrefillFailure::Local => AfterFailure::Local {
                prefill_tokens: self.local_prefill_tokens,
            },
            OnPrefillFailure::Fail => AfterFailure::Refuse,
        }
    }

    /// An SGLang callout Envoy refused at once (the worker left its
    /// catalog): both legs are still unsent, so the runner-up takes the
    /// leg; with none, the request is refused.
    pub fn next_sglang_prefill(&mut self) -> Option<Target> {
        self.runner_up.take()
    }
}

/// A request answered without a worker.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The plan found no worker ([`Rejection`]); the door answers as it
    /// answers a shed (the filter with a place in its retry queue).
    Plan(Rejection),
    /// The request cannot be served as the model's settings stand: the
    /// answer, as every door sends it.
    Unservable(Reply),
}

/// What the transfer fields add to an SGLang body at most: the three
/// bootstrap fields, an address and two numbers.
const SGLANG_GROWTH: usize = 256;

/// Decides what a door does with `plan`: the legs and their bookings,
/// the body rules and the failure policy, or the refusal.
pub fn dispatch(plan: &Plan<'_>, door: Door, body: Option<Body>) -> Dispatch {
    match plan {
        Plan::Reject(r) => Dispatch::Refuse(Refusal::Plan(*r)),
        Plan::Route(route) => dispatch_route(route, door, body),
    }
}

fn dispatch_route(route: &Route<'_>, door: Door, body: Option<Body>) -> Dispatch {
    let model = route.model.name.clone();
    let decode = Target::new(&route.first);
    let fallback = route.fallback.as_ref().map(Target::new);
    let Some(settings) = route.model.disaggregation else {
        return Dispatch::Whole(Whole {
            model,
            target: decode,
            fallback,
            body: WholeBody::Verbatim,
            why: None,
            pull: None,
        });
    };
    let why = match route.prefill {
        Some(Prefill::Remote(leg)) => Ok(leg),
        Some(Prefill::Local(why)) => Err(WholeWhy::Local(why)),
        None => Err(WholeWhy::NotSplit),
    };
    let leg = match why {
        Ok(leg) => leg,
        Err(why) => {
            let mut d = whole(model, decode, fallback, settings.protocol, why);
            if let Dispatch::Whole(w) = &mut d {
                w.pull = route.pull;
            }
            return d;
        }
    };
    let pull = route.pull.filter(|p| p.kind == disagg::pull::Kind::Pull);
    let split = Split {
        model,
        protocol: settings.protocol,
        decode,
        decode_fallback: fallback,
        prefill: Target::new(&leg.first),
        runner_up: leg.runner_up.as_ref().map(Target::new),
        local_prefill_tokens: leg.local_prefill_tokens,
        on_failure: if pull.is_some() {
            OnPrefillFailure::Local
        } else {
            settings.on_prefill_failure
        },
        timeout_ms: settings.prefill_timeout_ms,
        pull,
    };
    if !door.prefill_leg {
        return fail_before_leg(
            split,
            WholeWhy::NoLegAtDoor,
            Reply::prefill_failed("this front door makes no prefill leg"),
        );
    }
    if let Some(b) = body {
        let grows = match settings.protocol {
            Protocol::VllmNixl => disagg::decode_growth(b.isl_tokens),
            Protocol::Sglang => SGLANG_GROWTH,
        };
        if b.len.saturating_add(grows) > b.max.saturating_add(disagg::DECODE_HEADROOM_BYTES) {
            return fail_before_leg(split, WholeWhy::NoRoom, Reply::too_large(b.max));
        }
    }
    Dispatch::Split(split)
}

/// A disaggregated model's request served whole by `target`: an SGLang
/// one only by a `both` worker (a decode worker's engine asserts without
/// a bootstrap room, a prefill worker has no decode side), and never
/// retried on another role.
fn whole(
    model: String,
    target: Target,
    mut fallback: Option<Target>,
    protocol: Protocol,
    why: WholeWhy,
) -> Dispatch {
    if protocol == Protocol::Sglang {
        if target.role != Role::Both {
            return Dispatch::Refuse(Refusal::Unservable(Reply::prefill_failed(&format!(
                "no prefill worker is free for an SGLang {} worker ({})",
                target.role.as_str(),
                match why {
                    WholeWhy::NotSplit => "no worker of the other role is up",
                    w => w.as_str(),
                }
            ))));
        }
        fallback = fallback.filter(|f| f.role == Role::Both);
    }
    Dispatch::Whole(Whole {
        model,
        target,
        fallback,
        body: WholeBody::Scrubbed,
        why: Some(why),
        pull: None,
    })
}

/// A split that no leg will serve (`why`): the decode worker computes
/// the prompt where the model allows it, else the client gets `refusal`.
fn fail_before_leg(split: Split, why: WholeWhy, refusal: Reply) -> Dispatch {
    match split.give_up() {
        AfterFailure::Local { prefill_tokens } => {
            let mut target = split.decode;
            target.prefill_tokens = target.prefill_tokens.saturating_add(prefill_tokens);
            let mut d = whole(
                split.model,
                target,
                split.decode_fallback,
                split.protocol,
                why,
            );
            // A pull the door cannot make: its decode worker recomputes.
            if let Dispatch::Whole(w) = &mut d {
                w.pull = split.pull.map(Placed::recomputed);
            }
            d
        }
        _ => Dispatch::Refuse(Refusal::Unservable(refusal)),
    }
}
