//! The simulator over its real interfaces: HTTP on loopback and ZMQ.

use clap::Parser;
use kvgate_sim::{Args, build, serve};
use rmpv::Value;
use std::time::Duration;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn start(extra: &[&str]) -> (String, Args) {
    let port = free_port();
    let mut argv = vec![
        "kvgate-sim".to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = Args::parse_from(argv);
    let sim = build(&args).unwrap();
    let listener = tokio::net::TcpListener::bind(args.listen).await.unwrap();
    tokio::spawn(serve(listener, sim));
    (format!("127.0.0.1:{port}"), args)
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
    let (ev, rp) = (free_port(), free_port());
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
async fn streaming_and_dp_ranks_and_metrics() {
    let ev = free_port();
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

    let metrics = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        raw
    })
    .await
    .unwrap();
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
