//! `/workers`: the catalog, read and changed.

use super::handles::Catalog;
use super::views::{WorkerList, WorkerView};
use super::{error, fleet_error, json_response};
use crate::config::WorkerSpec;
use crate::fleet::{Fleet, FleetError};
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

/// `GET /workers?model_name=&tenant_id=`: both optional, as Dynamo's.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Scope {
    model_name: Option<String>,
    tenant_id: Option<String>,
}

pub(super) async fn list_workers(
    State(fleet): State<Arc<Mutex<Fleet>>>,
    Query(scope): Query<Scope>,
) -> Response {
    let f = fleet.lock();
    let workers = f
        .workers()
        .values()
        .filter(|w| {
            scope
                .model_name
                .as_ref()
                .is_none_or(|m| *m == w.spec().model_name)
        })
        .filter(|w| {
            scope
                .tenant_id
                .as_ref()
                .is_none_or(|t| *t == w.spec().tenant_id)
        })
        .map(WorkerView::from)
        .collect();
    json_response(StatusCode::OK, &WorkerList { workers })
}

pub(super) async fn get_worker(
    State(fleet): State<Arc<Mutex<Fleet>>>,
    Path(id): Path<u64>,
) -> Response {
    match fleet.lock().worker(id) {
        Some(w) => json_response(StatusCode::OK, &WorkerView::from(w)),
        None => fleet_error(FleetError::UnknownWorker(id)),
    }
}

pub(super) async fn add_worker(State(catalog): State<Arc<dyn Catalog>>, body: Bytes) -> Response {
    let spec: WorkerSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid worker: {e}")),
    };
    match catalog.add_worker(spec) {
        Ok(w) => json_response(StatusCode::CREATED, &WorkerView::from(&w)),
        Err(e) => fleet_error(e),
    }
}

pub(super) async fn patch_worker(
    State(catalog): State<Arc<dyn Catalog>>,
    Path(id): Path<u64>,
    body: Bytes,
) -> Response {
    let patch: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
    };
    match catalog.patch_worker(id, &patch) {
        Ok(w) => json_response(StatusCode::OK, &WorkerView::from(&w)),
        Err(e) => fleet_error(e),
    }
}

pub(super) async fn delete_worker(
    State(catalog): State<Arc<dyn Catalog>>,
    Path(id): Path<u64>,
) -> Response {
    match catalog.remove_worker(id) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => fleet_error(e),
    }
}
