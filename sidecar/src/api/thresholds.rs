//! `GET/POST /busy_threshold`: shedding thresholds, in Dynamo's shapes.

use super::Backend;
use super::views::{ModelThresholds, ThresholdsList};
use super::{error, fleet_error, json_response};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::Value;
use std::sync::Arc;

pub(super) async fn get_thresholds(State(sc): State<Arc<dyn Backend>>) -> Response {
    let f = sc.fleet();
    let thresholds = f
        .models
        .iter()
        .map(|(name, m)| ModelThresholds::new(name, &m.thresholds))
        .collect();
    json_response(StatusCode::OK, &ThresholdsList { thresholds })
}

/// `{"model": .., <threshold>: ..}`: only `model` reads that model's
/// thresholds; each threshold given is set, others are kept; `null` unsets
/// one (that condition stops shedding).
pub(super) async fn post_thresholds(State(sc): State<Arc<dyn Backend>>, body: Bytes) -> Response {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return error(StatusCode::BAD_REQUEST, "the body must be a JSON object"),
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
    };
    let Some(model) = body.get("model").and_then(Value::as_str) else {
        return error(StatusCode::BAD_REQUEST, "\"model\" (a string) is required");
    };
    let current = match sc.fleet().models.get(model) {
        Some(m) => m.thresholds,
        None => {
            return error(
                StatusCode::NOT_FOUND,
                format!("model {model:?} is not served here"),
            );
        }
    };
    let mut t = current;
    for (k, v) in body.as_object().into_iter().flatten() {
        let bad = |what: &str| error(StatusCode::BAD_REQUEST, format!("{k}: {what}, got {v}"));
        match k.as_str() {
            "model" => {}
            "active_decode_blocks_threshold" => match v {
                Value::Null => t.active_decode_blocks = None,
                _ => match v.as_f64() {
                    Some(x) => t.active_decode_blocks = Some(x),
                    None => return bad("expected a number within [0, 1]"),
                },
            },
            "active_prefill_tokens_threshold" => match v {
                Value::Null => t.active_prefill_tokens = None,
                _ => match v.as_u64() {
                    Some(x) => t.active_prefill_tokens = Some(x),
                    None => return bad("expected a non-negative integer"),
                },
            },
            "active_prefill_tokens_threshold_frac" => match v {
                Value::Null => t.active_prefill_tokens_frac = None,
                _ => match v.as_f64() {
                    Some(x) => t.active_prefill_tokens_frac = Some(x),
                    None => return bad("expected a number above 0"),
                },
            },
            _ => return error(StatusCode::BAD_REQUEST, format!("unknown field {k:?}")),
        }
    }
    if t != current
        && let Err(e) = sc.set_thresholds(model, t)
    {
        return fleet_error(e);
    }
    json_response(StatusCode::OK, &ModelThresholds::new(model, &t))
}
