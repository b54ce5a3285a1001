//! The control token that guards every route changing state.

use super::error;
use crate::config::Config;
use crate::metrics::ListenerMetrics;
use axum::extract::{MatchedPath, State};
use axum::http::StatusCode;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use std::sync::Arc;

/// Refuses requests without the configured bearer token; checked before
/// the body is read.
pub(super) async fn require_token(
    State(config): State<Arc<Config>>,
    State(metrics): State<Arc<ListenerMetrics>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if config.control.token.is_none() || holds_token(&config, req.headers()) {
        return next.run(req).await;
    }
    // By the route, not the URI: a reservation's id must not make a
    // series. A filter without the token shows here, not in Envoy's log.
    let path = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("-", |p| p.as_str());
    metrics.unauthorized.with_label_values(&[path]).inc();
    let mut r = error(
        StatusCode::UNAUTHORIZED,
        "this endpoint requires Authorization: Bearer <the sidecar's control token>",
    );
    r.headers_mut()
        .insert("www-authenticate", HeaderValue::from_static("Bearer"));
    r
}

/// Whether the request carries the configured control token; false when
/// none is configured.
pub(super) fn holds_token(config: &Config, headers: &HeaderMap) -> bool {
    config
        .control
        .token
        .as_deref()
        .is_some_and(|token| bears(token, headers))
}

/// Whether the request carries `token` as its bearer token.
pub(super) fn bears(token: &str, headers: &HeaderMap) -> bool {
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    constant_time_eq(given.as_bytes(), token.as_bytes())
}

/// Compares without an early exit, so timing does not reveal how much of a
/// guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}
