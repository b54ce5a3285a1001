//! What the filter reports: routing decisions and load bookings.

use super::error;
use super::handles::Reports;
use crate::metrics::LedgerMetrics;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Routing decisions from the filter, for the approximate index.
pub(super) async fn routed(State(reports): State<Arc<dyn Reports>>, body: Bytes) -> Response {
    match kvgate_core::approx::Routed::decode_all(&body) {
        Ok(records) => {
            reports.learn(&records);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, e),
    }
}

/// Booking events from the filter. A batch that does not decode is refused
/// whole (400): its records cannot be delimited past the bad one.
pub(super) async fn bookings(
    State(reports): State<Arc<dyn Reports>>,
    State(metrics): State<Arc<LedgerMetrics>>,
    body: Bytes,
) -> Response {
    match kvgate_core::booking::decode_batch(&body) {
        Ok(events) => {
            metrics.booking_batches.with_label_values(&["ok"]).inc();
            reports.book(events);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => {
            metrics
                .booking_batches
                .with_label_values(&["malformed"])
                .inc();
            tracing::warn!(error = %e, "malformed booking batch");
            error(StatusCode::BAD_REQUEST, e)
        }
    }
}
