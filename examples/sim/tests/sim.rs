//! The simulator over its real interfaces: HTTP on loopback and ZMQ.

use clap::Parser;
use kvgate_sim::{Args, build, serve};
use kvgate_stack::{free_block, free_ports};
use rmpv::Value;
use std::time::Duration;

async fn start(extra: &[&str]) -> (String, Args) {
    // Bound before the sim is built and held: no gap for another socket.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut argv = vec!["kvgate-sim".to_string(), "--listen".into(), addr.clone()];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = Args::parse_from(argv);
    let sim = build(&args).unwrap();
    tokio::spawn(serve(listener, sim));
    (addr, args)
}

async fn post(
    addr: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<(String, String)>, String) {
    let addr = addr.to_string();
    let (path, body) = (path.to_string(), body.to_string());
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let mut req = format!("POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
        for (k, v) in &headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(&body);
        s.write_all(req.as_bytes()).unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
        let mut lines = head.lines();
        let status: u16 = lines.next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
        let hs = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        (status, hs, rest.to_string())
    })
    .await
    .unwrap()
}

fn header<'a>(hs: &'a [(String, String)], k: &str) -> Option<&'a str> {
    hs.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str())
}

fn sub(endpoint: &str) -> zmq::Socket {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::SUB).unwrap();
    s.connect(endpoint).unwrap();
    s.set_subscribe(b"").unwrap();
    s.set_rcvtimeo(3000).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    s
}

fn recv_batch(s: &zmq::Socket) -> (u64, Value) {
    let frames = s.recv_multipart(0).expect("a KV event batch");
    assert_eq!(frames.len(), 3, "topic, seq, payload");
    let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
    (seq, rmpv::decode::read_value(&mut &frames[2][..]).unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn completions_cache_prefixes_and_publish_events() {
    // ZMQ ports from below the ephemeral range: no client socket of a
    // parallel test takes one before the sim binds it.
    let [ev, rp] = free_ports(2).unwrap()[..] else {
        unreachable!()
    };
    let (addr, _) = start(&[
        "--instant",
        "--block-size",
        "4",
        "--kv-events-endpoint",
        &format!("tcp://127.0.0.1:{ev}"),
        "--kv-replay-endpoint",
        &format!("tcp://127.0.0.1:{rp}"),
    ])
    .await;
    let s = sub(&format!("tcp://127.0.0.1:{ev}"));
    let body = r#"{"model":"demo-model","prompt":[1,2,3,4,5,6,7,8,9],"max_tokens":3}"#;
    let (status, hs, text) = post(&addr, "/v1/completions", body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(header(&hs, "x-kvgate-sim-cached-tokens"), Some("0"));
    let (seq, batch) = recv_batch(&s);
    assert_eq!(seq, 0);
    let ev = &batch.as_array().unwrap()[1].as_array().unwrap()[0];
    let m: Vec<(String, Value)> = ev
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().to_string(), v.clone()))
        .collect();
    assert_eq!(m[0].1, Value::from("BlockStored"));
    let tokens = &m.iter().find(|(k, _)| k == "token_ids").unwrap().1;
    assert_eq!(
        tokens,
        &Value::Array((1..=8).map(Value::from).collect()),
        "only full blocks are stored"
    );

    let (_, hs, text) = post(&addr, "/v1/completions", body, &[]).await;
    assert_eq!(header(&hs, "x-kvgate-sim-cached-tokens"), Some("8"));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 8);

    // reset_prefix_cache publishes AllBlocksCleared.
    let (status, _, _) = post(&addr, "/reset_prefix_cache", "", &[]).await;
    assert_eq!(status, 200);
    let (seq, batch) = recv_batch(&s);
    assert_eq!(seq, 1);
    assert_eq!(
        batch.as_array().unwrap()[1].as_array().unwrap()[0]
            .as_map()
            .unwrap()[0]
            .1,
        Value::from("AllBlocksCleared")
    );

    // Replay over a DEALER: both batches, then the end marker.
    let ctx = zmq::Context::new();
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.connect(&format!("tcp://127.0.0.1:{rp}")).unwrap();
    d.set_rcvtimeo(3000).unwrap();
    d.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
        .unwrap();
    let mut seqs = Vec::new();
    loop {
        let f = d.recv_multipart(0).unwrap();
        assert_eq!(f.len(), 4, "delimiter, topic, seq, payload");
        if f[2] == [0xFF; 8] {
            assert!(f[3].is_empty());
            break;
        }
        seqs.push(u64::from_be_bytes(f[2].as_slice().try_into().unwrap()));
    }
    assert_eq!(seqs, [0, 1]);

    // A restart starts the sequence over without AllBlocksCleared.
    post(&addr, "/sim/restart", "", &[]).await;
    post(&addr, "/v1/completions", body, &[]).await;
    let (seq, batch) = recv_batch(&s);
    assert_eq!(seq, 0);
    assert_eq!(
        batch.as_array().unwrap()[1].as_array().unwrap()[0]
            .as_map()
            .unwrap()[0]
            .1,
        Value::from("BlockStored")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn streamed_usage_comes_last_and_only_when_asked() {
    let (addr, _) = start(&["--instant"]).await;
    let body = r#"{"model":"demo-model","prompt":"a b c d","stream":true,"max_tokens":3,"stream_options":{"include_usage":true}}"#;
    let (status, _, text) = post(&addr, "/v1/completions", body, &[]).await;
    assert_eq!(status, 200);
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 4, "three tokens, then usage: {text}");
    assert!(chunks[..3].iter().all(|c| c.get("usage").is_none()));
    let last = &chunks[3];
    assert_eq!(last["choices"], serde_json::json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_and_dp_ranks_and_metrics() {
    // Rank r publishes on ev + r.
    let ev = free_block(2).unwrap();
    let (addr, _) = start(&[
        "--instant",
        "--dp-size",
        "2",
        "--kv-events-endpoint",
        &format!("tcp://127.0.0.1:{ev}"),
    ])
    .await;
    let rank1 = sub(&format!("tcp://127.0.0.1:{}", ev + 1));
    let body = r#"{"model":"demo-model","messages":[{"role":"user","content":"a fairly long question about caches and more words here"}],"stream":true,"max_tokens":4}"#;
    let (status, hs, text) = post(
        &addr,
        "/v1/chat/completions",
        body,
        &[("X-Data-Parallel-Rank", "1")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(header(&hs, "x-kvgate-sim-rank"), Some("1"));
    assert!(text.contains("data: [DONE]"), "{text}");
    assert_eq!(text.matches("chat.completion.chunk").count(), 4);
    assert!(!text.contains("usage"), "usage only when asked: {text}");
    let (_, batch) = recv_batch(&rank1);
    assert_eq!(
        batch.as_array().unwrap()[2],
        Value::from(1),
        "the batch names its DP rank"
    );

    let (status, _, _) = post(
        &addr,
        "/v1/chat/completions",
        body,
        &[("X-Data-Parallel-Rank", "2")],
    )
    .await;
    assert_eq!(status, 400);
    let (status, _, text) = post(
        &addr,
        "/v1/completions",
        r#"{"model":"other","prompt":"x"}"#,
        &[],
    )
    .await;
    assert_eq!(status, 404, "{text}");
    let (status, _, _) = post(&addr, "/v1/completions", "{", &[]).await;
    assert_eq!(status, 400);

    let metrics = scrape(addr).await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
    ] {
        assert!(metrics.contains(&format!("{name}{{")), "missing {name}");
    }
    assert!(
        metrics.contains(r#"vllm:prefix_cache_queries_total{engine="1",model_name="demo-model"}"#)
    );
    assert!(metrics.contains(r#"num_gpu_blocks="4096""#));
}

/// The worker's `/metrics` page, raw response included.
async fn scrape(addr: String) -> String {
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        raw
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_speak_sglang_when_asked() {
    let (addr, _) = start(&[
        "--instant",
        "--dp-size",
        "2",
        "--num-gpu-blocks",
        "100",
        "--metrics-flavor",
        "sglang",
    ])
    .await;
    let metrics = scrape(addr).await;
    assert!(!metrics.contains("vllm:"), "{metrics}");
    for name in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_used_tokens",
        "sglang:page_size",
        "sglang:num_pages",
    ] {
        assert!(
            metrics.contains(&format!("# TYPE {name} gauge")),
            "missing {name}"
        );
    }
    // 100 pages of 16 tokens, per scheduler, ranked by `dp_rank`.
    assert!(
        metrics.contains(r#"sglang:max_total_num_tokens{dp_rank="1",engine_type="unified",model_name="demo-model",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1600.0"#),
        "{metrics}"
    );
}

/// Streamed chunks on a kept-alive connection leave at once: with Nagle's
/// algorithm each response's first chunk waited for the client's delayed
/// ACK of the headers, about 40 ms on Linux, for every request.
#[tokio::test(flavor = "multi_thread")]
async fn kept_alive_streams_are_not_held_by_nagle() {
    let (addr, _) = start(&["--speedup", "20"]).await;
    let mut ttft_ms = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let body = r#"{"model":"demo-model","prompt":"hello there, hello again","max_tokens":4,"stream":true}"#;
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut out = Vec::new();
        for _ in 0..15 {
            let t0 = std::time::Instant::now();
            s.write_all(req.as_bytes()).unwrap();
            let (mut raw, mut first) = (Vec::new(), None);
            let mut buf = [0u8; 65536];
            while !(raw.ends_with(b"0\r\n\r\n") && raw.windows(6).any(|w| w == b"[DONE]")) {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "connection closed");
                raw.extend_from_slice(&buf[..n]);
                if first.is_none() && raw.windows(5).any(|w| w == b"data:") {
                    first = Some(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            out.push(first.unwrap());
        }
        out
    })
    .await
    .unwrap();
    ttft_ms.sort_by(f64::total_cmp);
    let median = ttft_ms[ttft_ms.len() / 2];
    assert!(median < 20.0, "median TTFT {median:.1} ms: {ttft_ms:?}");
}

async fn get(addr: &str, path: &str) -> (u16, String) {
    let addr = addr.to_string();
    let path = path.to_string();
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
        let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, rest.to_string())
    })
    .await
    .unwrap()
}

async fn thermal(addr: &str) -> serde_json::Value {
    let (status, body) = get(addr, "/sim/thermal").await;
    assert_eq!(status, 200);
    serde_json::from_str(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn batch_control_caps_admissions_and_evicts_without_losing_work() {
    let (addr, _) = start(&["--decode-ms-per-token", "20", "--max-running", "8"]).await;
    // Six long requests run at once.
    let long: Vec<_> = (0..6)
        .map(|i| {
            let addr = addr.clone();
            tokio::spawn(async move {
                post(
                    &addr,
                    "/v1/completions",
                    &format!(r#"{{"model":"demo-model","prompt":"long {i}","max_tokens":60}}"#),
                    &[],
                )
                .await
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while thermal(&addr).await["running"] != 6 {
        assert!(std::time::Instant::now() < deadline, "never ran six");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A dry run answers and changes nothing.
    let (status, _, body) = post(
        &addr,
        "/v1/admin/batch",
        r#"{"max_num_seqs": 2, "force_evict": 4, "dry_run": true}"#,
        &[],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["previous_running"].as_u64(), v["new_running"].as_u64()),
        (Some(6), Some(2))
    );
    assert_eq!(v["new_max_num_seqs"], 2);
    let t = thermal(&addr).await;
    assert_eq!(
        (t["running"].as_u64(), t["max_num_seqs"].as_u64()),
        (Some(6), Some(8))
    );
    // The cut: both at once, as the seed insists.
    let (status, _, body) = post(
        &addr,
        "/v1/admin/batch",
        r#"{"max_num_seqs": 2, "force_evict": 4, "policy": "largest_kv"}"#,
        &[],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["evicted_request_ids"].as_array().unwrap().len(), 4);
    assert_eq!(
        (v["new_running"].as_u64(), v["new_max_num_seqs"].as_u64()),
        (Some(2), Some(2))
    );
    assert!(v["estimated_watts_saved"].as_f64().unwrap() > 0.0);
    // Evicted work does not come straight back, and a new request waits too.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = thermal(&addr).await;
    assert_eq!(
        (t["running"].as_u64(), t["waiting"].as_u64()),
        (Some(2), Some(4))
    );
    // Given its batch back, everything completes.
    let (status, _, _) = post(&addr, "/v1/admin/batch", r#"{"max_num_seqs": 8}"#, &[]).await;
    assert_eq!(status, 200);
    for h in long {
        let (status, _, body) = h.await.unwrap();
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 60);
    }
    let t = thermal(&addr).await;
    assert_eq!(
        (t["running"].as_u64(), t["waiting"].as_u64()),
        (Some(0), Some(0))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn batch_control_refuses_bad_input_and_wants_its_token() {
    let dir = std::env::temp_dir().join(format!("kvgate-sim-token-{}", std::process::id()));
    std::fs::write(&dir, "s3cret\n").unwrap();
    let (addr, _) = start(&["--admin-token-file", dir.to_str().unwrap()]).await;
    let auth = [("Authorization", "Bearer s3cret")];
    let (status, _, _) = post(&addr, "/v1/admin/batch", r#"{"max_num_seqs": 4}"#, &[]).await;
    assert_eq!(status, 401);
    let (status, _, _) = post(
        &addr,
        "/v1/admin/batch",
        r#"{"max_num_seqs": 4}"#,
        &[("Authorization", "Bearer nope")],
    )
    .await;
    assert_eq!(status, 401);
    for bad in [
        r#"{"max_num_seqs": 0}"#,
        r#"{"target_temp_c": 120}"#,
        r#"{"policy": "random"}"#,
        r#"{"force_evict": -1}"#,
        r#"{"evict_everything": true}"#,
        "not json",
    ] {
        let (status, _, body) = post(&addr, "/v1/admin/batch", bad, &auth).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, _, body) = post(&addr, "/v1/admin/batch", r#"{"target_temp_c": 60}"#, &auth).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    // (60 − 25) / 0.1 − 100 W = 250 W: 17 sequences of 14 W.
    assert_eq!(v["new_max_num_seqs"], 17);
    let _ = std::fs::remove_file(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_plant_heats_with_work_and_serves_dcgm_exporters_page() {
    let (addr, args) = start(&["--gpus", "2", "--thermal-tau-s", "0.2", "--ambient-c", "60"]).await;
    let (status, page) = get(&addr, "/dcgm/metrics").await;
    assert_eq!(status, 200);
    let uuid = format!("GPU-sim-{}-1", args.listen.port());
    assert!(page.contains(&format!("UUID=\"{uuid}\"")), "{page}");
    // Idle at ambient 60: 70 °C. Twenty running: 60 + 0.1 × 380 = 98,
    // past the slowdown, where clocks and power halve.
    let long: Vec<_> = (0..20)
        .map(|i| {
            let addr = addr.clone();
            tokio::spawn(async move {
                post(
                    &addr,
                    "/v1/completions",
                    &format!(r#"{{"model":"demo-model","prompt":"hot {i}","max_tokens":200}}"#),
                    &[],
                )
                .await
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let t = thermal(&addr).await;
        if t["gpus"][0]["slowing"] == true {
            assert_eq!(t["clock_factor"], 0.5);
            assert_eq!(t["gpus"][0]["clock_reasons"].as_u64().unwrap() & 0x48, 0x48);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never slowed: {t}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, page) = get(&addr, "/dcgm/metrics").await;
    assert!(
        page.lines()
            .any(|l| l.starts_with("DCGM_FI_DEV_CLOCKS_EVENT_REASONS{") && l.ends_with(" 72")),
        "{page}"
    );
    // The exporter can go away, for staleness tests.
    let (status, _, _) = post(
        &addr,
        "/sim/thermal",
        r#"{"dcgm": "down", "ambient_c": 20}"#,
        &[],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(get(&addr, "/dcgm/metrics").await.0, 503);
    let (status, _, _) = post(&addr, "/sim/thermal", r#"{"ambient": 20}"#, &[]).await;
    assert_eq!(status, 400);
    for h in long {
        assert_eq!(h.await.unwrap().0, 200);
    }
}
