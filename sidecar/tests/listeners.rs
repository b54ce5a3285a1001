//! The HTTP listeners under hostile clients, on real loopback sockets:
//! slowloris heads and idle keep-alives are closed, and a connection cap
//! holds while idle sockets pile up, without disturbing a long poll.

use kvgate_sidecar::api;
use kvgate_sidecar::api::listener;
use kvgate_sidecar::config::ListenerLimits;
use kvgate_sidecar::metrics::ListenerSeries;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod support;

/// Serves a sidecar's main API on a loopback port within `limits`.
async fn serve(
    limits: ListenerLimits,
) -> (
    String,
    ListenerSeries,
    std::sync::Arc<kvgate_sidecar::Sidecar>,
) {
    let (_, sc) = support::sidecar(&[]).await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let series = sc.metrics().listener.series("test");
    tokio::spawn(listener::serve(
        l,
        "test",
        api::router(sc.clone()),
        limits,
        series.clone(),
        std::future::pending(),
    ));
    (addr, series, sc)
}

fn limits(header_ms: u64, idle_ms: u64, cap: u32) -> ListenerLimits {
    ListenerLimits {
        header_read_timeout: Duration::from_millis(header_ms),
        idle_timeout: Duration::from_millis(idle_ms),
        max_connections: cap,
    }
}

/// Reads one response head and its `content-length` body; `None` when the
/// connection closes first.
async fn read_response(s: &mut TcpStream) -> Option<(u16, Vec<(String, String)>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some((status, headers))
}

/// Waits for the peer to close `s`: true when it did within `within`.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut chunk = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

async fn get(addr: &str, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    read_response(&mut s).await.map(|(status, _)| status)
}

#[tokio::test]
async fn a_slowloris_head_is_cut_at_the_header_timeout() {
    let (addr, series, _sc) = serve(limits(300, 5_000, 8)).await;
    let s = TcpStream::connect(&addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let head =
        b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-pad: aaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let t = Instant::now();
    let reader = tokio::spawn(async move {
        let mut chunk = [0u8; 256];
        match rd.read(&mut chunk).await {
            Ok(0) | Err(_) => Instant::now(),
            Ok(_) => panic!("the slow head was answered"),
        }
    });
    // One byte every 100 ms: the whole head would take 7 s.
    let mut sent = 0;
    for b in head {
        if reader.is_finished() || wr.write_all(&[*b]).await.is_err() {
            break;
        }
        sent += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let closed = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the slowloris connection was never closed")
        .unwrap();
    assert!(sent < head.len(), "the whole head went through");
    let after = closed - t;
    assert!(
        after >= Duration::from_millis(300) && after < Duration::from_secs(3),
        "closed after {after:?}"
    );
    assert_eq!(series.header_timeouts.get(), 1);
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_the_idle_timeout() {
    let (addr, series, _sc) = serve(limits(5_000, 400, 8)).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(format!("GET /health HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let (status, _) = read_response(&mut s).await.expect("an answer");
    assert_eq!(status, 200);
    let t = Instant::now();
    assert!(
        closed_within(&mut s, Duration::from_secs(3)).await,
        "an idle keep-alive connection stayed open"
    );
    // Closed by the idle timeout, long before the header timeout.
    assert!(
        t.elapsed() >= Duration::from_millis(350),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(series.idle_timeouts.get(), 1);
    assert_eq!(series.header_timeouts.get(), 0);
}

#[tokio::test]
async fn the_cap_holds_under_idle_sockets_and_a_long_poll_goes_on() {
    const CAP: u32 = 8;
    let (addr, series, sc) = serve(limits(1_000, 10_000, CAP)).await;
    // Envoy's poll, held: it is up to date.
    let version = sc.versions().current();
    let epoch = sc.versions().epoch;
    let mut poll = TcpStream::connect(&addr).await.unwrap();
    let t = Instant::now();
    poll.write_all(
        format!(
            "GET /v1/snapshot?after={version}&epoch={epoch}&wait_ms=2000 HTTP/1.1\r\nhost: {addr}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let poll = tokio::spawn(async move { (read_response(&mut poll).await, t.elapsed()) });
    let deadline = Instant::now() + Duration::from_secs(5);
    while series.open.get() < 1 {
        assert!(Instant::now() < deadline, "the poll never connected");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let mut idle = Vec::new();
    for _ in 0..50 {
        idle.push(TcpStream::connect(&addr).await.unwrap());
        assert!(
            series.open.get() <= i64::from(CAP),
            "{} open",
            series.open.get()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while series.refused.get() < 50 - u64::from(CAP - 1) {
        assert!(
            Instant::now() < deadline,
            "refused {} of the idle sockets",
            series.refused.get()
        );
        assert!(series.open.get() <= i64::from(CAP));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(series.open.get() <= i64::from(CAP));

    let (resp, took) = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .expect("the long poll never answered")
        .unwrap();
    let (status, _) = resp.expect("the long poll's connection was closed");
    assert!(
        status == 204 || status == 200,
        "long poll answered {status}"
    );
    if status == 204 {
        assert!(took >= Duration::from_millis(1_900), "held {took:?}");
    }

    // The idle sockets time out their heads; then the listener answers.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if get(&addr, "/health").await == Some(200) {
            break;
        }
        assert!(Instant::now() < deadline, "/health never answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(series.header_timeouts.get() >= u64::from(CAP - 1));
    assert!(series.open.get() <= i64::from(CAP));
    drop(idle);
}
