//! Prefill/decode disaggregation between two sims over loopback: vLLM's
//! NIXL legs by hand (with kvgate's own leg bodies), lease expiry and the
//! load-failure policies, SGLang's bootstrap pairing.

use clap::Parser;
use kvgate_core::disagg::nixl::{answer_params, decode_body, prefill_body};
use kvgate_sim::disagg::frame::Message;
use kvgate_sim::{Args, build, serve};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

async fn start(extra: &[&str]) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut argv = vec![
        "kvgate-sim".to_string(),
        "--listen".into(),
        addr.to_string(),
        "--kv-side-channel-port".into(),
        "0".into(),
        "--bootstrap-port".into(),
        "0".into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let sim = build(&Args::parse_from(argv)).unwrap();
    tokio::spawn(serve(listener, sim));
    addr.to_string()
}

struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(a, _)| a == k)
            .map(|(_, v)| v.as_str())
    }

    /// A stream's `data:` events before `[DONE]`, which must end it.
    fn events(&self) -> Vec<Value> {
        let data: Vec<&str> = self
            .body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{}", self.body);
        data[..data.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }
}

async fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> Answer {
    let addr = addr.to_string();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    )
    .into_bytes();
    for (k, v) in headers {
        req.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    req.extend_from_slice(body);
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(&req).unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
        let mut lines = head.lines();
        let status = lines
            .next()
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Answer {
            status,
            headers,
            body: rest.to_string(),
        }
    })
    .await
    .unwrap()
}

async fn post(addr: &str, path: &str, body: &[u8], headers: &[(&str, &str)]) -> Answer {
    http(addr, "POST", path, body, headers).await
}

async fn disagg(addr: &str) -> Value {
    let a = http(addr, "GET", "/sim/disagg", b"", &[]).await;
    assert_eq!(a.status, 200);
    a.json()
}

/// Polls `/sim/disagg` until `pred` holds, for at most ten seconds.
async fn until(addr: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = disagg(addr).await;
        if pred(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: {v:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn last(v: &Value) -> &Value {
    v["recent"].as_array().unwrap().last().unwrap()
}

fn path(chat: bool) -> &'static str {
    if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// The client's body: ten prompt tokens from `from` (two full blocks of
/// four and a partial one) or a short chat.
fn client_body(chat: bool, stream: bool, from: u32) -> String {
    if chat {
        json!({"model": "demo-model", "messages": [{"role": "user", "content": format!("tell me about caches {from}")}],
               "max_tokens": 5, "stream": stream})
    } else {
        json!({"model": "demo-model", "prompt": (from..from + 10).collect::<Vec<u32>>(), "max_tokens": 5, "stream": stream})
    }
    .to_string()
}

/// Runs the prefill leg; returns its `kv_transfer_params` as raw text.
async fn prefill_leg(prefill: &str, client: &str, chat: bool, id: &str) -> String {
    let body = prefill_body(client.as_bytes()).unwrap();
    let a = post(prefill, path(chat), &body, &[("X-Request-Id", id)]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    answer_params(a.body.as_bytes()).unwrap().to_string()
}

fn tokens_of(a: &Answer, chat: bool, stream: bool) -> usize {
    if !stream {
        return a.json()["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    }
    a.events()
        .iter()
        .filter(|e| {
            let c = &e["choices"][0];
            if chat {
                c["delta"]["content"].is_string()
            } else {
                c["text"].is_string()
            }
        })
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn nixl_legs_over_http_for_completions_and_chat_streaming_and_not() {
    let prefill = start(&["--kv-role", "kv_producer", "--instant", "--block-size", "4"]).await;
    let decode = start(&["--kv-role", "kv_consumer", "--instant", "--block-size", "4"]).await;
    let side_port = disagg(&prefill).await["side_channel_ports"][0]
        .as_u64()
        .unwrap();
    let mut pulls = 0;
    for chat in [false, true] {
        for stream in [false, true] {
            let id = format!("req-{chat}-{stream}");
            let client = client_body(chat, stream, 100 * pulls);
            let params = prefill_leg(&prefill, &client, chat, &id).await;
            let p: Value = serde_json::from_str(&params).unwrap();
            assert_eq!(p["do_remote_prefill"], true);
            assert_eq!(p["do_remote_decode"], false);
            assert_eq!(p["remote_request_id"], id.as_str());
            assert_eq!(p["remote_host"], "127.0.0.1");
            assert_eq!(p["remote_port"], side_port);
            assert_eq!(p["tp_size"], 1);
            assert!(p["remote_engine_id"].as_str().unwrap().ends_with("_dp0"));
            let ids = p["remote_block_ids"][0].as_array().unwrap();
            assert!(!ids.is_empty());
            let held = disagg(&prefill).await["counters"]["held_blocks"]
                .as_u64()
                .unwrap();
            assert!(held > 0, "the prefilled blocks are held for the pull");

            let body = decode_body(client.as_bytes(), &params).unwrap();
            let a = post(&decode, path(chat), &body, &[("X-Request-Id", &id)]).await;
            assert_eq!(a.status, 200, "{}", a.body);
            assert_eq!(
                tokens_of(&a, chat, stream),
                5,
                "the client's own max_tokens"
            );
            if stream {
                assert_eq!(a.header("content-type"), Some("text/event-stream"));
            }
            pulls += 1;
            let d = disagg(&decode).await;
            assert_eq!(d["counters"]["pulls"], pulls);
            assert_eq!(d["counters"]["decode_legs"], pulls);
            let rec = last(&d);
            assert_eq!(rec["leg"], "decode");
            assert_eq!(rec["request_id"], id.as_str());
            assert_eq!(rec["kv_transfer_params"], p);
            assert_eq!(rec["endpoint"], if chat { "chat" } else { "completions" });
            // Only the blocks the decode worker lacks are pulled: every
            // one for a new prompt, all but the shared chat-template
            // prefix for the second chat.
            let held: usize = a
                .header("x-kvgate-sim-cached-tokens")
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(rec["pulled_blocks"], ids.len() - held / 4);
            if !chat {
                assert_eq!(held, 0);
            }
            let pd = disagg(&prefill).await;
            assert_eq!(pd["counters"]["held_blocks"], 0, "the pull ends the hold");
            assert_eq!(pd["counters"]["pulls_served"], pulls);
            assert_eq!(last(&pd)["leg"], "prefill");
            assert_eq!(last(&pd)["kv_transfer_params"]["do_remote_decode"], true);
        }
    }
    // The same prompt again: the decode worker holds its two full blocks
    // and pulls only the partial tail.
    let client = client_body(false, false, 0);
    let params = prefill_leg(&prefill, &client, false, "again").await;
    let body = decode_body(client.as_bytes(), &params).unwrap();
    let a = post(&decode, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.header("x-kvgate-sim-cached-tokens"), Some("8"));
    assert_eq!(last(&disagg(&decode).await)["pulled_blocks"], 1);
    // A second pull of the same request finds it gone.
    let a = post(&decode, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 500, "{}", a.body);
    assert_eq!(a.json()["error"]["code"], 500);
}

fn sub(endpoint: &str) -> zmq::Socket {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::SUB).unwrap();
    s.connect(endpoint).unwrap();
    s.set_subscribe(b"").unwrap();
    s.set_rcvtimeo(5000).unwrap();
    s
}

/// The event types and token lists of the next batch.
fn next_events(s: &zmq::Socket) -> Vec<(String, Vec<u64>)> {
    let frames = s.recv_multipart(0).expect("a KV event batch");
    let batch = rmpv::decode::read_value(&mut &frames[2][..]).unwrap();
    batch.as_array().unwrap()[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|ev| {
            let m = ev.as_map().unwrap();
            let get = |k: &str| {
                m.iter()
                    .find(|(a, _)| a.as_str() == Some(k))
                    .map(|(_, v)| v.clone())
            };
            let kind = get("type").unwrap().as_str().unwrap().to_string();
            let tokens = get("token_ids")
                .and_then(|t| t.as_array().cloned())
                .unwrap_or_default()
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect();
            (kind, tokens)
        })
        .collect()
}

/// Subscribes, then waits until a probe request's events arrive, so no
/// later event is lost to the subscription's start.
async fn subscribed(addr: &str, endpoint: &str) -> zmq::Socket {
    let s = sub(endpoint);
    let deadline = Instant::now() + Duration::from_secs(10);
    s.set_rcvtimeo(100).unwrap();
    let mut probe = 1000;
    loop {
        let body =
            json!({"model": "demo-model", "prompt": [probe, probe, probe, probe], "max_tokens": 1})
                .to_string();
        assert_eq!(
            post(addr, "/v1/completions", body.as_bytes(), &[])
                .await
                .status,
            200
        );
        if s.recv_multipart(0).is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "no KV events from {endpoint}");
        probe += 1;
    }
    while s.recv_multipart(zmq::DONTWAIT).is_ok() {}
    s.set_rcvtimeo(5000).unwrap();
    s
}

/// From below the ephemeral range: no client socket takes it before use.
fn free_port() -> u16 {
    kvgate_stack::free_ports(1).unwrap()[0]
}

#[tokio::test(flavor = "multi_thread")]
async fn received_blocks_are_published_unless_asked_not_to() {
    let prefill = start(&["--kv-role", "kv_producer", "--instant", "--block-size", "4"]).await;
    for publish in [true, false] {
        let ev = format!("tcp://127.0.0.1:{}", free_port());
        let mut args = vec![
            "--kv-role",
            "kv_both",
            "--instant",
            "--block-size",
            "4",
            "--kv-events-endpoint",
            &ev,
        ];
        if !publish {
            args.push("--no-publish-received-blocks");
        }
        let decode = start(&args).await;
        let s = subscribed(&decode, &ev).await;
        let client = client_body(false, false, 1);
        let params = prefill_leg(&prefill, &client, false, &format!("pub-{publish}")).await;
        let body = decode_body(client.as_bytes(), &params).unwrap();
        assert_eq!(
            post(&decode, "/v1/completions", &body, &[]).await.status,
            200
        );
        // A local request after it: its events come after any of the
        // decode leg's, so the first batch tells whether there were any.
        let local =
            json!({"model": "demo-model", "prompt": [50, 51, 52, 53], "max_tokens": 1}).to_string();
        assert_eq!(
            post(&decode, "/v1/completions", local.as_bytes(), &[])
                .await
                .status,
            200
        );
        let first = next_events(&s);
        let received = ("BlockStored".to_string(), (1..=8).collect::<Vec<u64>>());
        if publish {
            assert_eq!(first[0], received, "{first:?}");
        } else {
            assert_eq!(
                first[0],
                ("BlockStored".to_string(), vec![50, 51, 52, 53]),
                "{first:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_lease_fails_the_decode_leg_unless_it_recomputes() {
    let prefill = start(&[
        "--kv-role",
        "kv_producer",
        "--instant",
        "--block-size",
        "4",
        "--kv-lease-ms",
        "50",
    ])
    .await;
    let fail = start(&["--kv-role", "kv_consumer", "--instant", "--block-size", "4"]).await;
    let recompute = start(&[
        "--kv-role",
        "kv_consumer",
        "--instant",
        "--block-size",
        "4",
        "--kv-load-failure-policy",
        "recompute",
    ])
    .await;
    let client = client_body(false, false, 1);
    let params = prefill_leg(&prefill, &client, false, "late").await;
    until(&prefill, "the lease expires", |v| {
        v["counters"]["lease_expiries"] == 1 && v["counters"]["held_blocks"] == 0
    })
    .await;
    let body = decode_body(client.as_bytes(), &params).unwrap();
    let a = post(&fail, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 500, "{}", a.body);
    let msg = a.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("no longer holds"), "{msg}");
    let d = disagg(&fail).await;
    assert_eq!(d["counters"]["failed_pulls"], 1);
    assert_eq!(last(&d)["status"], 500);

    let a = post(&recompute, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.json()["usage"]["completion_tokens"], 5);
    let d = disagg(&recompute).await;
    assert_eq!(d["counters"]["recomputes"], 1);
    assert_eq!(last(&d)["recomputed"], true);

    // An unreachable side channel is a load failure too.
    let mut p: Value = serde_json::from_str(&params).unwrap();
    p["remote_port"] = json!(free_port());
    let body = decode_body(client.as_bytes(), &p.to_string()).unwrap();
    let a = post(&fail, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 500, "{}", a.body);
    assert!(a.body.contains("unreachable"), "{}", a.body);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_pulls_share_the_holders_link() {
    // Three blocks a prompt (two full of four tokens and the tail) of
    // 1 MB at 0.024 Gbit/s: one second alone on the holder's link.
    let prefill = start(&[
        "--kv-role",
        "kv_producer",
        "--block-size",
        "4",
        "--prefill-us-per-token",
        "0",
        "--kv-bytes-per-block",
        "1000000",
        "--kv-transfer-gbps",
        "0.024",
    ])
    .await;
    // The decode workers' own bandwidth is not what their pulls wait on.
    let decodes = [
        start(&["--kv-role", "kv_consumer", "--block-size", "4"]).await,
        start(&["--kv-role", "kv_consumer", "--block-size", "4"]).await,
    ];
    let mut bodies = Vec::new();
    for (i, from) in [0u32, 100].into_iter().enumerate() {
        let client = client_body(false, false, from);
        let params = prefill_leg(&prefill, &client, false, &format!("shared-{i}")).await;
        bodies.push(decode_body(client.as_bytes(), &params).unwrap());
    }
    let t0 = Instant::now();
    let legs: Vec<_> = decodes
        .iter()
        .zip(bodies)
        .map(|(addr, body)| {
            let addr = addr.clone();
            tokio::spawn(async move {
                let a = post(&addr, "/v1/completions", &body, &[]).await;
                (a, t0.elapsed())
            })
        })
        .collect();
    // While both pulls are on the link the holder keeps their blocks.
    until(&prefill, "both pulls share the link", |v| {
        v["counters"]["link_max_concurrent"] == 2 && v["counters"]["held_blocks"] == 4
    })
    .await;
    let mut last_done = Duration::ZERO;
    for leg in legs {
        let (a, took) = leg.await.unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
        assert!(
            took >= Duration::from_millis(900),
            "{took:?}: a pull is not free"
        );
        last_done = last_done.max(took);
    }
    // Two seconds of bytes through a one-lane link: the last pull cannot
    // end before both have gone through, however they were interleaved.
    assert!(
        last_done >= Duration::from_millis(1900),
        "{last_done:?}: the pulls did not share the holder's link"
    );
    let pd = disagg(&prefill).await;
    assert_eq!(pd["counters"]["link_bytes"], 6_000_000);
    assert_eq!(pd["counters"]["link_max_concurrent"], 2);
    assert_eq!(
        pd["counters"]["held_blocks"], 0,
        "the hold ends with the pull"
    );
    assert_eq!(pd["counters"]["pulls_served"], 2);
    for d in &decodes {
        let d = disagg(d).await;
        assert_eq!(d["counters"]["pulls"], 1);
        assert_eq!(
            d["counters"]["link_bytes"], 0,
            "a puller's own link is idle"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn legs_a_role_cannot_serve_and_malformed_params_are_400s() {
    let producer = start(&["--kv-role", "kv_producer", "--instant"]).await;
    let consumer = start(&["--kv-role", "kv_consumer", "--instant"]).await;
    let plain = start(&["--instant"]).await;
    let client = client_body(false, false, 1);
    let prefill = prefill_body(client.as_bytes()).unwrap();
    let a = post(&consumer, "/v1/completions", &prefill, &[]).await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body.contains("kv_consumer"), "{}", a.body);
    assert_eq!(last(&disagg(&consumer).await)["leg"], "rejected");

    let params = prefill_leg(&producer, &client, false, "r").await;
    let decode = decode_body(client.as_bytes(), &params).unwrap();
    let a = post(&producer, "/v1/completions", &decode, &[]).await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body.contains("kv_producer"), "{}", a.body);
    assert_eq!(a.json()["error"]["type"], "invalid_request_error");

    // A streaming prefill leg: its params could not come back.
    let mut v: Value = serde_json::from_slice(&prefill).unwrap();
    v["stream"] = json!(true);
    let a = post(&producer, "/v1/completions", v.to_string().as_bytes(), &[]).await;
    assert_eq!(a.status, 400, "{}", a.body);

    // Partial or malformed decode params.
    let mut p: Value = serde_json::from_str(&params).unwrap();
    p.as_object_mut().unwrap().remove("remote_host");
    let body = decode_body(client.as_bytes(), &p.to_string()).unwrap();
    let a = post(&consumer, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body.contains("remote_host"), "{}", a.body);
    let body = decode_body(client.as_bytes(), "[1]").unwrap();
    assert_eq!(
        post(&consumer, "/v1/completions", &body, &[]).await.status,
        400
    );

    // Ordinary requests are served by every role; a sim without one
    // ignores the fields, as vLLM without a connector does.
    assert_eq!(
        post(&consumer, "/v1/completions", client.as_bytes(), &[])
            .await
            .status,
        200
    );
    let a = post(&plain, "/v1/completions", &prefill, &[]).await;
    assert_eq!(a.status, 200);
    assert!(a.json().get("kv_transfer_params").is_none());
    let rec = last(&disagg(&plain).await).clone();
    assert_eq!(rec["leg"], "local");
    assert_eq!(
        rec["kv_transfer_params"]["do_remote_decode"], true,
        "recorded as received"
    );
}

fn sglang_body(port: u64, room: u64, stream: bool) -> String {
    json!({"model": "demo-model", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_tokens": 5, "stream": stream,
           "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room})
    .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn sglang_legs_pair_in_their_bootstrap_room() {
    let args = [
        "--pd-protocol",
        "sglang",
        "--instant",
        "--block-size",
        "4",
        "--dp-size",
        "2",
    ];
    let prefill = start(&[&["--kv-role", "kv_producer"], &args[..]].concat()).await;
    let decode = start(&[&["--kv-role", "kv_consumer"], &args[..]].concat()).await;
    let port = disagg(&prefill).await["bootstrap_port"].as_u64().unwrap();
    assert_ne!(port, 0);
    for (room, stream) in [(7u64, false), (10, true)] {
        let body = sglang_body(port, room, stream);
        // The same body to both at once, as SGLang's router sends it.
        let (p, d) = tokio::join!(
            post(&prefill, "/v1/completions", body.as_bytes(), &[]),
            post(&decode, "/v1/completions", body.as_bytes(), &[]),
        );
        assert_eq!(p.status, 200, "{}", p.body);
        assert_eq!(d.status, 200, "{}", d.body);
        let rank = (room % 2).to_string();
        assert_eq!(
            p.header("x-kvgate-sim-rank"),
            Some(rank.as_str()),
            "room % dp_size"
        );
        assert_eq!(
            d.header("x-kvgate-sim-rank"),
            Some(rank.as_str()),
            "room % dp_size"
        );
        assert_eq!(tokens_of(&d, false, stream), 5);
        let rec = last(&disagg(&decode).await).clone();
        assert_eq!(rec["bootstrap_room"], room);
        assert_eq!(rec["pulled_blocks"], 3, "two full blocks and the partial");
    }
    let pd = disagg(&prefill).await;
    assert_eq!(pd["counters"]["bootstrap_pairs"], 2);
    assert_eq!(pd["open_rooms"], 0);

    // The decode leg first, the prefill a moment later: still a pair.
    let body = sglang_body(port, 11, false);
    let dec = {
        let (decode, body) = (decode.clone(), body.clone());
        tokio::spawn(async move { post(&decode, "/v1/completions", body.as_bytes(), &[]).await })
    };
    until(&prefill, "the decoder joins", |v| v["open_rooms"] == 1).await;
    let p = post(&prefill, "/v1/completions", body.as_bytes(), &[]).await;
    assert_eq!(p.status, 200, "{}", p.body);
    let d = dec.await.unwrap();
    assert_eq!(d.status, 200, "{}", d.body);
}

#[tokio::test(flavor = "multi_thread")]
async fn sglang_legs_without_a_room_or_a_peer_fail() {
    let prefill = start(&[
        "--kv-role",
        "kv_producer",
        "--pd-protocol",
        "sglang",
        "--instant",
        "--bootstrap-timeout-s",
        "0.2",
    ])
    .await;
    let decode = start(&[
        "--kv-role",
        "kv_consumer",
        "--pd-protocol",
        "sglang",
        "--instant",
        "--bootstrap-timeout-s",
        "0.2",
    ])
    .await;
    let port = disagg(&prefill).await["bootstrap_port"].as_u64().unwrap();
    let no_room = json!({"model": "demo-model", "prompt": "hello", "max_tokens": 2,
                         "bootstrap_host": "127.0.0.1", "bootstrap_port": port})
    .to_string();
    for addr in [&prefill, &decode] {
        let a = post(addr, "/v1/completions", no_room.as_bytes(), &[]).await;
        assert_eq!(a.status, 400, "{}", a.body);
        assert!(a.body.contains("bootstrap_room"), "{}", a.body);
    }
    // A prefill whose decode worker never comes, and the reverse.
    let body = sglang_body(port, 99, false);
    let a = post(&prefill, "/v1/completions", body.as_bytes(), &[]).await;
    assert_eq!(a.status, 500, "{}", a.body);
    assert!(a.body.contains("bootstrap timeout"), "{}", a.body);
    let a = post(&decode, "/v1/completions", body.as_bytes(), &[]).await;
    assert_eq!(a.status, 500, "{}", a.body);
    assert!(a.body.contains("timeout"), "{}", a.body);
    let pd = until(&prefill, "rooms are cleaned up", |v| v["open_rooms"] == 0).await;
    assert_eq!(pd["counters"]["bootstrap_timeouts"], 1);
    assert_eq!(disagg(&decode).await["counters"]["failed_pulls"], 1);
}

/// Sends `bytes` to a side channel and reads its answer frame.
async fn raw_exchange(port: u16, bytes: Vec<u8>) -> Message {
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&bytes).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut payload).unwrap();
        Message::decode(&payload).unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_side_channel_peers_are_refused_and_the_channel_keeps_serving() {
    let prefill = start(&["--kv-role", "kv_producer", "--instant", "--block-size", "4"]).await;
    let decode = start(&["--kv-role", "kv_consumer", "--instant", "--block-size", "4"]).await;
    let port = disagg(&prefill).await["side_channel_ports"][0]
        .as_u64()
        .unwrap() as u16;
    // A 4 GiB length prefix: refused before anything is read or allocated.
    let m = raw_exchange(port, vec![0xFF; 4]).await;
    assert!(
        matches!(&m, Message::Refused(why) if why.contains("exceeds the cap")),
        "{m:?}"
    );
    // A pull whose id list claims four billion entries.
    let mut p = vec![1, 0, 1, b'e', 0, 1, b'r', 0xFF, 0xFF, 0xFF, 0xFF];
    p.splice(0..0, (p.len() as u32).to_be_bytes());
    let m = raw_exchange(port, p).await;
    assert!(
        matches!(&m, Message::Refused(why) if why.contains("truncated")),
        "{m:?}"
    );
    // Another engine's name, and a request never prefilled.
    let pull = |engine: &str| {
        let payload = Message::Pull {
            engine_id: engine.into(),
            request_id: "nobody".into(),
            block_ids: vec![1],
        }
        .encode();
        let mut f = (payload.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(&payload);
        f
    };
    assert!(matches!(
        raw_exchange(port, pull("other")).await,
        Message::Refused(_)
    ));
    let engine = disagg(&prefill).await["engine_ids"][0]
        .as_str()
        .unwrap()
        .to_string();
    assert!(matches!(
        raw_exchange(port, pull(&engine)).await,
        Message::Gone(_)
    ));
    // The channel still serves a real pair.
    let client = client_body(false, true, 1);
    let params = prefill_leg(&prefill, &client, false, "after").await;
    let body = decode_body(client.as_bytes(), &params).unwrap();
    let a = post(&decode, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(tokens_of(&a, false, true), 5);
}
