//! Reading a worker's or peer's HTTP body under a byte cap.

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Body;
use thiserror::Error;

#[derive(Debug, Error)]
pub(crate) enum BodyError {
    #[error("declares {declared} bytes (Content-Length), over the cap of {cap}: refused unread")]
    Declared { declared: u64, cap: usize },
    /// Over the cap as it arrived (no length declared, or a false one),
    /// or the connection failed.
    #[error("{0}")]
    Read(String),
}

/// The whole body, if it fits in `cap` bytes. A declared length over the
/// cap is refused before a byte of the body is read: reading up to the cap
/// first would let a peer that claims a huge body make this side buffer
/// the cap every time. Bodies without a length are cut off at the cap.
pub(crate) async fn read_capped<B>(body: B, cap: usize) -> Result<Bytes, BodyError>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // hyper gives a response body's Content-Length as its size hint.
    let declared = body.size_hint().lower();
    if declared > cap as u64 {
        return Err(BodyError::Declared { declared, cap });
    }
    Limited::new(body, cap)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| BodyError::Read(e.to_string()))
}
