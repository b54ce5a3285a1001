//! The view of the fleet that selections and reservations read, and the
//! ids reservations take.
//!
//! A selection must see the load booked a moment ago, or a burst of
//! `/select_and_reserve` calls would all land on the rank that looked
//! idlest in the last published snapshot. So a selection reads the
//! snapshot (workers, thresholds, engine metrics) with each rank's booked
//! load taken from the ledger at that instant, as the filter adds its own
//! bookings to its copy of the snapshot.

use super::{Selection, error};
use crate::sources::bookings::{Bookings, Full, LedgerError};
use axum::http::StatusCode;
use axum::response::Response;
use kvgate_core::busy::rank_busy;
use kvgate_core::{ModelState, Snapshot};

/// Refuses a request naming more tokens than one booking of its model may
/// hold (`max_prompt_tokens`): the prompt's `isl_tokens` and its
/// `expected_output_tokens`, from which every booked field follows. The
/// refusal is counted. Call it without the ledger held: it reads the
/// fleet, which is locked before the ledger elsewhere.
pub(crate) fn within_bound(
    sc: &Selection,
    snap: &Snapshot,
    model: &str,
    isl_tokens: Option<u64>,
    expected_output_tokens: Option<u64>,
) -> Result<(), String> {
    // An adapter's requests are booked as its base model's.
    let name = snap.model(model).map_or(model, |m| m.name.as_str());
    let max = sc.fleet.lock().booking_bound(name).prefill_tokens;
    let over = match (isl_tokens, expected_output_tokens) {
        (Some(n), _) if n > max => Some(("isl_tokens", n)),
        (_, Some(n)) if n > max => Some(("expected_output_tokens", n)),
        _ => None,
    };
    let Some((field, n)) = over else {
        return Ok(());
    };
    sc.metrics.refused("api", "out_of_bound", 1);
    Err(format!(
        "{field} {n} is more than model {model:?}'s max_prompt_tokens {max}"
    ))
}

/// The answer to a reservation call the ledger refused.
pub(crate) fn ledger_refusal(e: LedgerError) -> Response {
    let status = match &e {
        LedgerError::Duplicate(_) => StatusCode::CONFLICT,
        LedgerError::Unknown(_) => StatusCode::NOT_FOUND,
        // The API's own reservations fill its share: its clients must free
        // some (or let them expire) before booking more.
        LedgerError::Full(Full::Origin(_)) => StatusCode::TOO_MANY_REQUESTS,
        // The ledger as a whole is full: not this client's doing.
        LedgerError::Full(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(status, e)
}

/// A reservation's id: non-empty, printable and short, since it is echoed
/// in answers and logs and sent to peers.
pub(crate) fn valid_reservation_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 256 || !id.chars().all(|c| c.is_ascii_graphic()) {
        return Err(format!(
            "reservation_id {:?} must be 1 to 256 printable ASCII characters",
            truncate(id)
        ));
    }
    Ok(())
}

fn truncate(s: &str) -> &str {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `model` of `snap` with each rank's booked load as the ledger has it now,
/// and its busy flag checked again against that load. The published flag
/// stands in for the decode latch: a rank that was busy stays so until its
/// load is under the threshold's lower mark.
pub(crate) fn fresh_model(snap: &Snapshot, name: &str, ledger: &Bookings) -> Option<ModelState> {
    snap.model(name).map(|m| fresh(m, ledger))
}

/// [`fresh_model`] for a model already found.
pub(crate) fn fresh(model: &ModelState, ledger: &Bookings) -> ModelState {
    let mut m = model.clone();
    let split = m.disaggregated();
    let thresholds = m.thresholds;
    for w in &mut m.workers {
        let th = w.role.judged_by(thresholds, split);
        for r in &mut w.ranks {
            let booked = ledger.slot(r.slot);
            r.active_prefill_tokens = booked.prefill_tokens;
            r.active_decode_blocks = booked.decode_blocks;
            let mut latched = r.busy;
            r.busy = rank_busy(r, &th, &mut latched).is_some();
        }
    }
    m
}
