//! The selection for a front door that routes requests itself rather than
//! answering with a placement: the ext_proc server (`examples/extproc`),
//! the architecture peers use (an endpoint picker beside the proxy,
//! consulted over a gRPC stream per request).
//!
//! It is `/select_and_reserve` on an OpenAI body: the published snapshot
//! with each rank's load from the ledger at call time, this sidecar's
//! index shards, `kvgate_core::plan`, and the reservation booked in the
//! same ledger as Envoy's bookings. Using the HTTP handler's path, not a
//! copy of it, keeps a comparison with the filter about the architecture
//! alone: the same decision over the same state.
//!
//! What follows the placement is `kvgate_core::dispatch`'s, for a door
//! that sends one upstream request and makes no callout
//! ([`Door::ONE_UPSTREAM`]): a split request is served as a prefill leg
//! that failed, so the model's `on_prefill_failure` decides: `local`
//! sends it whole to the decode worker, which books the prompt it then
//! computes; `fail` (and SGLang's decode worker, which cannot compute a
//! prompt) refuses it. A disaggregated model's body goes scrubbed of the
//! client's transfer fields, under an `x-request-id` of kvgate's.
//!
//! [`place`] and [`select_in`] are this door's and `/select`'s decisions
//! over a model the caller holds, booking nothing: for a test that gives
//! the filter the same snapshot.

use super::{TIE_BREAK, new_reservation_id, place_in, rank_id};
use crate::api::Selection;
use crate::api::ledger_view::{fresh_model, within_bound};
use crate::fleet::RankId;
use crate::sources::bookings::Load;
use kvgate_core::ModelState;
use kvgate_core::approx;
use kvgate_core::disagg::whole_body;
use kvgate_core::dispatch::{Dispatch, Door, Refusal, WholeBody, dispatch};
use kvgate_core::plan::request::Parsed;
use kvgate_core::plan::{Ask, Plan, Rejection, ShardSource};
use kvgate_core::reply::Reply;
use std::borrow::Cow;
use std::sync::atomic::Ordering;
use thiserror::Error;

pub use super::{Refused, select_in};

/// Where a routed request goes, and the reservation that books it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// Free it with [`free`] when the request ends, however it ends.
    /// Empty from [`place`], which books nothing.
    pub reservation_id: String,
    /// The override-host list, as the filter writes it: the chosen worker,
    /// then the runner-up a refused connection is retried on.
    pub destination: String,
    /// The data-parallel rank to name to the worker; `None` when it has one
    /// rank (the rank header is then removed, as the filter does).
    pub rank: Option<u32>,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// The body to send instead of the client's: a disaggregated model's,
    /// without the client's transfer fields. `None`: the client's bytes.
    pub body: Option<Vec<u8>>,
    /// kvgate's `x-request-id` for the worker, in place of the client's:
    /// set on every request of a disaggregated model, as the filter does,
    /// so that no client names the transfer its blocks are matched to.
    pub request_id: Option<String>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RouteError {
    /// The plan refuses the request: the caller answers it without a worker.
    #[error("refused: {0:?}")]
    Refused(Rejection),
    /// The model's settings cannot serve it at this door (a split request
    /// whose model says `fail`, or SGLang's): the reply to send.
    #[error("unservable: {}", .0.reason.as_str())]
    Unservable(Reply),
    /// The ledger refused the reservation (an id already live).
    #[error("{0}")]
    Ledger(String),
}

/// A request placed and dispatched, not yet booked.
#[derive(Debug, Clone, PartialEq)]
pub struct Placed {
    /// Where it goes; its `reservation_id` is empty.
    pub routed: Routed,
    /// The rank it books, and the load: the decode worker's, with the
    /// prompt it computes.
    pub rank: RankId,
    pub load: Load,
    /// The prefix record for the routed-prefix index.
    pub report: Option<approx::Routed>,
}

/// Places `req` (from the request's `tenant`, its body `body`) and books
/// it. The prefix record a text prompt leaves goes to the routed-prefix
/// index, as the filter's routing reports do.
pub fn route_and_reserve(
    sc: &Selection,
    req: &Parsed,
    tenant: &str,
    body: &[u8],
) -> Result<Routed, RouteError> {
    let snap = sc.store.snapshot();
    // The door's body limit keeps prompts far shorter; refused as the
    // ledger would refuse it, should that limit ever be raised.
    within_bound(sc, &snap, &req.model, Some(req.isl_tokens), None).map_err(RouteError::Ledger)?;
    let tie = TIE_BREAK.fetch_add(1, Ordering::Relaxed);
    let log = &sc.shards;
    // Held from the view to the booking: concurrent streams must not both
    // see the same idle rank.
    let mut ledger = sc.ledger.lock();
    let model = fresh_model(&snap, &req.model, &ledger)
        .ok_or(RouteError::Refused(Rejection::UnknownModel))?;
    let placed = place(&model, req, tenant, body, tie, &mut |k: &str| log.read(k))?;
    let id = new_reservation_id();
    sc.reservations
        .reserve(&mut ledger, &id, &placed.rank, tenant, placed.load)
        .map_err(|e| RouteError::Ledger(e.to_string()))?;
    drop(ledger);
    if let Some(record) = &placed.report {
        sc.reports.learn(std::slice::from_ref(record));
    }
    Ok(Routed {
        reservation_id: id,
        ..placed.routed
    })
}

/// [`route_and_reserve`]'s decision over `model` as it stands (its ranks'
/// load already the ledger's), booking nothing: for a caller that holds
/// a snapshot of its own (the conformance test, which gives the filter
/// the same one).
pub fn place(
    model: &ModelState,
    req: &Parsed,
    tenant: &str,
    body: &[u8],
    tie_break: u64,
    shards: &mut impl ShardSource,
) -> Result<Placed, RouteError> {
    // This door sends one upstream request: it makes no pull.
    let ask = Ask {
        tie_break,
        one_upstream: true,
        ..Ask::default()
    };
    let (plan, _) = place_in(model, req, tenant, &ask, shards, true);
    let route = match &plan {
        Plan::Route(r) => r,
        Plan::Reject(r) => return Err(RouteError::Refused(*r)),
    };
    // This door has no `max_body_bytes` of its own (Envoy's buffer limit
    // bounds the body), and makes no prefill leg for a limit to matter.
    let whole = match dispatch(&plan, Door::ONE_UPSTREAM, None) {
        Dispatch::Whole(w) => w,
        Dispatch::Refuse(Refusal::Plan(r)) => return Err(RouteError::Refused(r)),
        Dispatch::Refuse(Refusal::Unservable(reply)) => {
            return Err(RouteError::Unservable(reply));
        }
        // Not for a door without a prefill leg; were it, the leg failed.
        Dispatch::Split(_) => {
            return Err(RouteError::Unservable(Reply::prefill_failed(
                "this front door makes no prefill leg",
            )));
        }
    };
    let destination = whole.destination();
    let t = &whole.target;
    let (body, request_id) = match whole.body {
        WholeBody::Verbatim => (None, None),
        WholeBody::Scrubbed => {
            let body = match whole_body(body) {
                Ok(Cow::Owned(b)) => Some(b),
                Ok(Cow::Borrowed(_)) => None,
                // Not an object: the worker refuses it as the client's
                // error, as it would from the filter.
                Err(_) => None,
            };
            // Random, in the filter's format (`kvgate-` and 32 hex
            // digits), as a reservation id is.
            (body, Some(new_reservation_id()))
        }
    };
    Ok(Placed {
        routed: Routed {
            reservation_id: String::new(),
            destination,
            rank: t.names_rank.then_some(t.rank),
            worker_id: t.worker_id,
            dp_rank: t.rank,
            body,
            request_id,
        },
        // The target is `route.first`, the decode worker.
        rank: rank_id(model, &route.first),
        load: Load::from(t),
        // The plan is spent: its report moves on with the request.
        report: match plan {
            Plan::Route(r) => r.report,
            Plan::Reject(_) => None,
        },
    })
}

/// The worker answered: the reservation's prefill tokens leave its rank.
pub fn prefill_complete(sc: &Selection, reservation_id: &str) -> Result<(), RouteError> {
    sc.reservations
        .prefill_complete(reservation_id)
        .map_err(|e| RouteError::Ledger(e.to_string()))
}

/// The request ended: its reservation leaves the ledger.
pub fn free(sc: &Selection, reservation_id: &str) -> Result<(), RouteError> {
    sc.reservations
        .free(reservation_id)
        .map_err(|e| RouteError::Ledger(e.to_string()))
}

/// What this sidecar publishes under `key` (an index shard, a model's
/// prompt template blob): what the filter reads from Envoy's shared data,
/// for a front door that renders prompts as the filter does.
pub fn published(sc: &Selection, key: &str) -> Option<Vec<u8>> {
    sc.shards.read(key)
}
