//! Replica-sync peers, changed without a restart (Dynamo's routes):
//! `POST /replica_sync/register_peer`, `POST /replica_sync/deregister_peer`
//! with `{"endpoint": "tcp://host:port"}`, and `GET /replica_sync/peers`
//! (each peer's connection, last message age, refusals and reconnects).
//! Changes live in memory; after a restart only the configured peers
//! return.

use super::views::{PeerRequest, PeersView};
use super::{error, json_response};
use crate::config::validate_peer;
use crate::replica::ReplicaSync;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use std::sync::Arc;

pub(super) async fn peers(State(replica): State<Option<Arc<ReplicaSync>>>) -> Response {
    match replica.as_deref() {
        Some(r) => json_response(StatusCode::OK, &PeersView::of(r)),
        None => off(),
    }
}

pub(super) async fn register(
    State(replica): State<Option<Arc<ReplicaSync>>>,
    body: Bytes,
) -> Response {
    change(replica.as_deref(), &body, true)
}

pub(super) async fn deregister(
    State(replica): State<Option<Arc<ReplicaSync>>>,
    body: Bytes,
) -> Response {
    change(replica.as_deref(), &body, false)
}

fn change(replica: Option<&ReplicaSync>, body: &[u8], add: bool) -> Response {
    let Some(r) = replica else {
        return off();
    };
    let req: PeerRequest = match serde_json::from_slice(body) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid peer: {e}")),
    };
    if let Err(m) = validate_peer(&req.endpoint) {
        return error(StatusCode::BAD_REQUEST, m);
    }
    let changed = if add {
        r.add_peer(&req.endpoint)
    } else {
        r.remove_peer(&req.endpoint)
    };
    if changed {
        tracing::info!(peer = %req.endpoint, registered = add, "replica-sync peer changed");
    } else if !add {
        return error(
            StatusCode::NOT_FOUND,
            format!("{:?} is not a replica-sync peer", req.endpoint),
        );
    }
    json_response(StatusCode::OK, &PeersView::of(r))
}

fn off() -> Response {
    error(
        StatusCode::CONFLICT,
        "replica sync is off: start the sidecar with [replica_sync] listen (--replica-sync-port)",
    )
}
