//! `GET/POST /busy_threshold`: shedding thresholds, in Dynamo's shapes.

use super::handles::Catalog;
use super::views::{ModelThresholds, ThresholdsList};
use super::{error, fleet_error, json_response};
use crate::fleet::Fleet;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use kvgate_core::ThresholdsPatch;
use parking_lot::Mutex;
use serde_json::Value;
use std::sync::Arc;

pub(super) async fn get_thresholds(State(fleet): State<Arc<Mutex<Fleet>>>) -> Response {
    let f = fleet.lock();
    let thresholds = f
        .models()
        .iter()
        .map(|(name, m)| ModelThresholds::new(name, &m.thresholds))
        .collect();
    json_response(StatusCode::OK, &ThresholdsList { thresholds })
}

/// `{"model": .., <threshold>: ..}`: only `model` reads that model's
/// thresholds; the rest is a [`ThresholdsPatch`]: each threshold given is
/// set, others are kept; `null` unsets one (that condition stops shedding).
pub(super) async fn post_thresholds(
    State(fleet): State<Arc<Mutex<Fleet>>>,
    State(catalog): State<Arc<dyn Catalog>>,
    body: Bytes,
) -> Response {
    let mut body = match serde_json::from_slice(&body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return error(StatusCode::BAD_REQUEST, "the body must be a JSON object"),
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
    };
    let Some(Value::String(model)) = body.remove("model") else {
        return error(StatusCode::BAD_REQUEST, "\"model\" (a string) is required");
    };
    let current = match fleet.lock().model(&model) {
        Some(m) => m.thresholds,
        None => {
            return error(
                StatusCode::NOT_FOUND,
                format!("model {model:?} is not served here"),
            );
        }
    };
    let patch: ThresholdsPatch = match serde_json::from_value(Value::Object(body)) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid thresholds: {e}")),
    };
    let t = current.patched(&patch);
    if t != current
        && let Err(e) = catalog.set_thresholds(&model, t)
    {
        return fleet_error(e);
    }
    json_response(StatusCode::OK, &ModelThresholds::new(&model, &t))
}
