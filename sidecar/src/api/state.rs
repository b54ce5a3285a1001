//! `GET /v1/state`: the current snapshot as JSON, for people and tests.

use super::json_response;
use super::views::StateView;
use crate::metrics::ListenerMetrics;
use crate::publish::{SnapshotStore, Versions};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use std::sync::Arc;

pub(super) async fn state(
    State(store): State<Arc<SnapshotStore>>,
    State(versions): State<Arc<Versions>>,
    State(listener): State<Arc<ListenerMetrics>>,
) -> Response {
    let mut view = StateView::new(&store.snapshot(), versions.epoch);
    view.unauthorized = listener.unauthorized_by_path();
    json_response(StatusCode::OK, &view)
}
