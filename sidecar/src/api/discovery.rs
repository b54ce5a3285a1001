//! `POST /v3/discovery:endpoints`: the catalog as Envoy's routed cluster.

use super::{error, json_response};
use crate::fleet::Fleet;
use crate::publish::eds;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use parking_lot::Mutex;
use std::sync::Arc;

/// Envoy's REST EDS poll for the routed cluster (see [`crate::publish::eds`]).
pub(super) async fn endpoints(State(fleet): State<Arc<Mutex<Fleet>>>, body: Bytes) -> Response {
    let req: eds::DiscoveryRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid DiscoveryRequest: {e}"),
            );
        }
    };
    match eds::discovery_response(&fleet.lock(), &req) {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => error(StatusCode::BAD_REQUEST, e),
    }
}
