//! The HTTP listeners under hostile clients, on real loopback sockets:
//! slowloris heads and idle keep-alives are closed, a connection cap
//! holds while idle sockets pile up, without disturbing a long poll, and
//! probes and token holders are answered while a flood fills it; slow
//! request bodies are held within a byte budget and cut at a deadline;
//! spaced whole-index readers share a bounded number of copies.

use kvgate_sidecar::api;
use kvgate_sidecar::api::listener;
use kvgate_sidecar::config::ListenerLimits;
use kvgate_sidecar::metrics::ListenerSeries;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
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
    let (addr, series) = serve_on(l, api::router(sc.clone()), &sc, limits, None);
    (addr, series, sc)
}

/// Serves `app` of `sc` on `l` within `limits`, with `token` as the
/// control token the listener knows.
fn serve_on(
    l: tokio::net::TcpListener,
    app: axum::Router,
    sc: &kvgate_sidecar::Sidecar,
    limits: ListenerLimits,
    token: Option<&str>,
) -> (String, ListenerSeries) {
    let addr = l.local_addr().unwrap().to_string();
    let series = sc.metrics().listener.series("test");
    tokio::spawn(listener::serve(
        l,
        "test",
        app,
        limits,
        token.map(str::to_string),
        series.clone(),
        std::future::pending(),
    ));
    (addr, series)
}

fn limits(header_ms: u64, idle_ms: u64, cap: u32) -> ListenerLimits {
    ListenerLimits {
        header_read_timeout: Duration::from_millis(header_ms),
        idle_timeout: Duration::from_millis(idle_ms),
        max_connections: cap,
        reserved_connections: 0,
        body_budget_bytes: 64 << 20,
        body_timeout: Duration::from_secs(10),
    }
}

/// Reads one response head and its `content-length` body; `None` when the
/// connection closes first.
async fn read_response(s: &mut (impl AsyncRead + Unpin)) -> Option<(u16, Vec<(String, String)>)> {
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
    // Each idle socket past the cap takes the slot of the one that has
    // waited longest; the poll, in flight, keeps its own.
    let deadline = Instant::now() + Duration::from_secs(5);
    while series.refused.get() + series.evicted.get() < 50 - u64::from(CAP - 1) {
        assert!(
            Instant::now() < deadline,
            "refused {} and evicted {} of the idle sockets",
            series.refused.get(),
            series.evicted.get()
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

/// A GET carrying `token` as its bearer token; the status.
async fn get_with(addr: &str, path: &str, token: &str) -> Option<u16> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    let req =
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {token}\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    read_response(&mut s).await.map(|(status, _)| status)
}

/// A POST of `body`; the status.
async fn post(addr: &str, path: &str, body: &str) -> Option<u16> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.ok()?;
    read_response(&mut s).await.map(|(status, _)| status)
}

/// A POST declaring `declared` body bytes and sending `chunk` of them
/// every `every`; the status of the answer, `None` if the connection
/// closed without one.
async fn slow_post(
    addr: String,
    path: &'static str,
    declared: usize,
    chunk: usize,
    every: Duration,
) -> Option<u16> {
    let s = TcpStream::connect(&addr).await.ok()?;
    let (mut rd, mut wr) = s.into_split();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    );
    wr.write_all(head.as_bytes()).await.ok()?;
    let writer = tokio::spawn(async move {
        let mut sent = 0;
        while sent < declared {
            let n = chunk.min(declared - sent);
            if wr.write_all(&vec![b' '; n]).await.is_err() {
                return;
            }
            sent += n;
            tokio::time::sleep(every).await;
        }
        // Keep the write half open: closing it would end the request.
        std::future::pending::<()>().await;
    });
    let status = read_response(&mut rd).await.map(|(status, _)| status);
    writer.abort();
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_are_held_within_the_budget_then_cut_and_their_bytes_given_back() {
    const BUDGET: u64 = 256 << 10;
    const SLOW: usize = 12;
    let (_, sc) = support::sidecar(&[]).await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let limits = ListenerLimits {
        body_budget_bytes: BUDGET,
        body_timeout: Duration::from_millis(1500),
        ..limits(5_000, 60_000, 64)
    };
    let (addr, series) = serve_on(l, api::selection_router(sc.clone()), &sc, limits, None);
    let select = r#"{"model_name":"m","token_ids":[1,2,3,4]}"#;
    let idle = post(&addr, "/select", select).await.expect("an answer");

    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (done, held) = (done.clone(), series.body_bytes.clone());
        tokio::spawn(async move {
            let mut peak = 0;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(held.get());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            peak
        })
    };
    // Each declares 200 kB and sends 4 KiB every 50 ms: too slow to end
    // within the body timeout, and together far over the budget.
    let slow: Vec<_> = (0..SLOW)
        .map(|_| {
            tokio::spawn(slow_post(
                addr.clone(),
                "/select",
                200_000,
                4096,
                Duration::from_millis(50),
            ))
        })
        .collect();
    // Once the slow bodies have used up the budget, a small body is still
    // read and answered: its first bytes are not paid from the budget.
    let full = tokio::time::timeout(Duration::from_secs(10), async {
        while series.refused_body_budget.get() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(full.is_ok(), "the slow bodies never filled the budget");
    assert_eq!(post(&addr, "/select", select).await, Some(idle));
    let mut statuses = Vec::new();
    for t in slow {
        statuses.push(
            tokio::time::timeout(Duration::from_secs(20), t)
                .await
                .expect("a slow body was never answered")
                .unwrap(),
        );
    }
    done.store(true, Ordering::Relaxed);
    let peak = sampler.await.unwrap();
    assert!(
        statuses.iter().all(|s| matches!(s, Some(503 | 408))),
        "slow bodies answered {statuses:?}"
    );
    assert!(statuses.contains(&Some(503)), "{statuses:?}");
    assert!(peak > 0 && peak <= BUDGET as i64, "held {peak} bytes");
    assert_eq!(
        series.refused_body_budget.get() + series.refused_body_timeout.get(),
        SLOW as u64
    );
    assert_eq!(series.body_bytes.get(), 0, "every buffer is given back");

    // A body that stops moving is cut at the body timeout, not the idle
    // timeout (60 s), and its bytes given back.
    let stalled = slow_post(addr.clone(), "/select", 1000, 100, Duration::from_secs(60));
    let stalled = tokio::time::timeout(Duration::from_secs(20), stalled)
        .await
        .expect("the stalled body was never answered");
    assert_eq!(stalled, Some(408));
    assert_eq!(series.body_bytes.get(), 0);
    // A body longer than the budget can ever hold is refused unread.
    let huge = slow_post(
        addr.clone(),
        "/select",
        BUDGET as usize + 1,
        1,
        Duration::from_secs(60),
    );
    assert_eq!(huge.await, Some(413));
    // And selections answer as before.
    assert_eq!(post(&addr, "/select", select).await, Some(idle));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_at_the_cap_leaves_probes_and_token_holders_answered() {
    const TOKEN: &str = "flood-test-token";
    const CAP: u32 = 10;
    let (_, sc) = support::sidecar_with(&[], Some(TOKEN)).await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let limits = ListenerLimits {
        reserved_connections: 4,
        ..limits(5_000, 60_000, CAP)
    };
    let (addr, series) = serve_on(l, api::router(sc.clone()), &sc, limits, Some(TOKEN));
    let version = sc.versions().current();
    let epoch = sc.versions().epoch;
    // Long polls, held 10 s, fill the share any request may use; a request
    // in flight is never closed to make room.
    let mut polls = Vec::new();
    for _ in 0..CAP - 4 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(
            format!(
                "GET /v1/snapshot?after={version}&epoch={epoch}&wait_ms=10000 HTTP/1.1\r\nhost: {addr}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        polls.push(s);
    }
    support::wait_until("the polls to connect", async || {
        series.open.get() == i64::from(CAP - 4)
    })
    .await;
    // Silent sockets, one every 5 ms, for as long as the test runs.
    let flood = {
        let addr = addr.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            for _ in 0..400 {
                if let Ok(s) = TcpStream::connect(&addr).await {
                    held.push(s);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            std::future::pending::<()>().await;
        })
    };
    support::wait_until("the flood to fill the cap", async || {
        series.evicted.get() >= 10
    })
    .await;

    assert_eq!(
        get(&addr, "/health").await,
        Some(200),
        "the kubelet's probe"
    );
    assert_eq!(get(&addr, "/metrics").await, Some(200));
    let poll = format!("/v1/snapshot?after={version}&epoch={epoch}&wait_ms=0");
    assert!(
        matches!(get_with(&addr, &poll, TOKEN).await, Some(200 | 204)),
        "Envoy's poll, with the token"
    );
    // Anyone else waits for the flood to end.
    assert_eq!(get(&addr, "/v1/state").await, Some(503));
    assert!(series.refused_reserved.get() >= 1);
    assert!(series.open.get() <= i64::from(CAP));
    assert_eq!(
        series.refused.get(),
        0,
        "no new connection was shut out: one waiting made room"
    );
    flood.abort();
    drop(polls);
}

/// vLLM's BlockStored for `hashes`, 16 tokens a block.
fn stored(hashes: &[u64], tokens: &[u32]) -> rmpv::Value {
    use rmpv::Value;
    Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        ("parent_block_hash".into(), Value::Nil),
        (
            "token_ids".into(),
            Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
        ),
        ("block_size".into(), 16.into()),
        ("medium".into(), "GPU".into()),
    ])
}

/// Sends `GET /dump` on a socket with a small receive buffer and reads
/// its head; the stream, the dump's length and the body bytes read.
async fn start_dump(addr: &str) -> (TcpStream, usize, usize) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock.connect(addr.parse().unwrap()).await.unwrap();
    s.write_all(format!("GET /dump HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
            assert!(head.starts_with("http/1.1 200"), "{head}");
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("a content-length");
            return (s, len, buf.len() - i - 4);
        }
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before the head");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spaced_whole_index_readers_hold_one_copy_between_them() {
    const BLOCKS: u64 = 20_000;
    const READERS: usize = 4;
    let ctx = zmq::Context::new();
    let (engine, _page) = support::fake_worker().await;
    let mut publisher = support::Publisher::bind(&ctx);
    let toml = format!(
        "[server]\npublish_interval_ms = 10\nmax_full_reads = 8\nfull_read_reuse_ms = 100\n\
         [scrape]\ninterval_ms = 50\n[[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"{engine}\"\nblock_size = 16\n\
         kv_events_endpoints = {{ \"0\" = \"{}\" }}\n",
        publisher.endpoint
    );
    let (_, sc) = support::sidecar_from(&toml, None).await;
    let hashes: Vec<u64> = (1..=BLOCKS).collect();
    let tokens: Vec<u32> = (0..BLOCKS as u32 * 16).map(|t| t % 100).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while support::metric(&sc, "kvgate_sidecar_kv_indexed_blocks{model=\"m\"}") < BLOCKS as f64 {
        assert!(Instant::now() < deadline, "the index never took the blocks");
        publisher.publish_events(vec![stored(&hashes, &tokens)]);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A small send buffer, so that a reader that stops reading keeps its
    // answer, and the copy it is sent, in the sidecar.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_send_buffer_size(4096).unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(64).unwrap();
    let (addr, _series) = serve_on(
        l,
        api::router(sc.clone()),
        &sc,
        limits(5_000, 60_000, 64),
        None,
    );
    let m = &sc.metrics().listener;
    let alive = || m.full_read_copies_alive.with_label_values(&["dump"]).get();
    let mut readers = Vec::new();
    for _ in 0..READERS {
        readers.push(start_dump(&addr).await);
        assert_eq!(alive(), 1, "copies alive");
        // Spaced wider than full_read_reuse_ms: age alone shares nothing.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Each reader's answer, unread, holds the copy (hyper's buffers hold
    // slices of it), and the later readers were sent it too.
    assert_eq!(m.full_read_copies.with_label_values(&["dump"]).get(), 1);
    assert_eq!(alive(), 1);
    // Each reader gets the whole dump, then the copy is gone.
    let mut chunk = vec![0u8; 64 << 10];
    for (mut s, len, mut got) in readers {
        assert!(
            len > 200_000,
            "a dump of {len} bytes fits in socket buffers"
        );
        while got < len {
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the dump ended at {got} of {len} bytes");
            got += n;
        }
    }
    support::wait_until("the copy to be dropped", async || alive() == 0).await;
}
