//! `GET /v1/state`: the current snapshot as JSON, for people and tests.

use super::Backend;
use super::json_response;
use super::views::StateView;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use std::sync::Arc;

pub(super) async fn state(State(sc): State<Arc<dyn Backend>>) -> Response {
    let mut view = StateView::new(&sc.store().snapshot(), sc.versions().epoch);
    view.unauthorized = sc.metrics().listener.unauthorized_by_path();
    json_response(StatusCode::OK, &view)
}
