//! A tiny blocking HTTP/1.1 client for control-plane calls (health, stats,
//! state). Request traffic goes through `kvgate-load`, not this.

use anyhow::{Context, Result, bail};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Status, lower-cased header pairs, and body of a response.
pub type Response = (u16, Vec<(String, String)>, Vec<u8>);

/// `GET path` on `addr`, returning status and body.
pub fn get(addr: &str, path: &str) -> Result<(u16, Vec<u8>)> {
    request(addr, "GET", path, &[], None)
}

/// `POST path` with a JSON body.
pub fn post_json(addr: &str, path: &str, body: &[u8]) -> Result<Response> {
    request_full(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        Some(body),
    )
}

/// A request with optional JSON body and extra headers.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Result<(u16, Vec<u8>)> {
    let (status, _, body) = request_full(addr, method, path, headers, body)?;
    Ok((status, body))
}

/// Like [`request`], also returning the response headers (names lower-cased).
pub fn request_full(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Result<Response> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    req.push_str("\r\n");
    // One write: a filter that answers at the headers (a 503 for stale
    // state) lets Envoy close the connection, and a body written after
    // that draws a reset that can discard the answer before it is read.
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body.unwrap_or_default());
    s.write_all(&bytes)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Result<Response> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("response has no header terminator")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let body = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok((status, headers, body))
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("bad chunk header")?;
        let size_str = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("bad chunk size {size_str:?}"))?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// Polls `GET path` until it answers `status` or `timeout` passes.
pub fn wait_for_status(addr: &str, path: &str, status: u16, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        match get(addr, path) {
            Ok((s, _)) if s == status => return Ok(()),
            Ok((s, body)) => last = format!("status {s}: {}", String::from_utf8_lossy(&body)),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("{addr}{path} did not answer {status} within {timeout:?} (last: {last})")
}
