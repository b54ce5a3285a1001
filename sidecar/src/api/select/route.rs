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

use super::{TIE_BREAK, new_reservation_id, place_in, rank_id};
use crate::api::Backend;
use crate::api::ledger_view::{fresh_model, within_bound};
use crate::sources::bookings::Load;
use kvgate_core::plan::request::Parsed;
use kvgate_core::plan::{Prefill, Rejection};
use std::sync::atomic::Ordering;
use thiserror::Error;

/// Where a routed request goes, and the reservation that books it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// Free it with [`free`] when the request ends, however it ends.
    pub reservation_id: String,
    /// The override-host list, as the filter writes it: the chosen worker,
    /// then the runner-up a refused connection is retried on.
    pub destination: String,
    /// The data-parallel rank to name to the worker; `None` when it has one
    /// rank (the rank header is then removed, as the filter does).
    pub rank: Option<u32>,
    pub worker_id: u64,
    pub dp_rank: u32,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RouteError {
    /// The plan refuses the request: the caller answers it without a worker.
    #[error("refused: {0:?}")]
    Refused(Rejection),
    /// The ledger refused the reservation (an id already live).
    #[error("{0}")]
    Ledger(String),
}

/// Places `req` (from the request's `tenant`) and books it. The prefix
/// record a text prompt leaves goes to the routed-prefix index, as the
/// filter's routing reports do.
pub fn route_and_reserve(
    sc: &dyn Backend,
    req: &Parsed,
    tenant: &str,
) -> Result<Routed, RouteError> {
    let snap = sc.store().snapshot();
    // The door's body limit keeps prompts far shorter; refused as the
    // ledger would refuse it, should that limit ever be raised.
    within_bound(sc, &snap, &req.model, Some(req.isl_tokens), None).map_err(RouteError::Ledger)?;
    let tie = TIE_BREAK.fetch_add(1, Ordering::Relaxed);
    let log = sc.shards();
    // Held from the view to the booking: concurrent streams must not both
    // see the same idle rank.
    let mut ledger = sc.bookings();
    let model = fresh_model(&snap, &req.model, &ledger)
        .ok_or(RouteError::Refused(Rejection::UnknownModel))?;
    let (route, _) = place_in(&model, req, tenant, tie, &mut |k: &str| log.read(k), true)
        .map_err(RouteError::Refused)?;
    let first = &route.first;
    let id = new_reservation_id();
    // This door sends no prefill leg: on a disaggregated model the decode
    // worker gets the request whole and computes the prompt itself.
    let prefill_tokens = match &route.prefill {
        Some(Prefill::Remote(leg)) => leg.local_prefill_tokens,
        _ => first.prefill_tokens,
    };
    let load = Load {
        slot: first.choice.rank.slot,
        prefill_tokens,
        decode_blocks: first.decode_blocks,
    };
    sc.reserve(&mut ledger, &id, &rank_id(&model, first), load)
        .map_err(|e| RouteError::Ledger(e.to_string()))?;
    drop(ledger);
    if let Some(record) = &route.report {
        sc.learn(std::slice::from_ref(record));
    }
    let worker = first.choice.worker;
    let destination = match &route.fallback {
        Some(f) => format!("{},{}", worker.endpoint, f.choice.worker.endpoint),
        None => worker.endpoint.clone(),
    };
    Ok(Routed {
        reservation_id: id,
        destination,
        rank: route.set_rank.then_some(first.choice.rank.rank),
        worker_id: worker.id,
        dp_rank: first.choice.rank.rank,
    })
}

/// The worker answered: the reservation's prefill tokens leave its rank.
pub fn prefill_complete(sc: &dyn Backend, reservation_id: &str) -> Result<(), RouteError> {
    sc.reservation_prefill_complete(reservation_id)
        .map_err(|e| RouteError::Ledger(e.to_string()))
}

/// The request ended: its reservation leaves the ledger.
pub fn free(sc: &dyn Backend, reservation_id: &str) -> Result<(), RouteError> {
    sc.free_reservation(reservation_id)
        .map_err(|e| RouteError::Ledger(e.to_string()))
}

/// What this sidecar publishes under `key` (an index shard, a model's
/// prompt template blob): what the filter reads from Envoy's shared data,
/// for a front door that renders prompts as the filter does.
pub fn published(sc: &dyn Backend, key: &str) -> Option<Vec<u8>> {
    sc.shards().read(key)
}
