//! The stack as shipped, attacked and broken on purpose, on real Envoy:
//! client headers that try to steer routing, forged tenants, unauthenticated
//! bookings, and workers that refuse connections or die mid-stream.

mod common;

use common::*;
use kvgate_core::booking::{Event, Key};
use kvgate_stack::{Stack, StackConfig, http};
use serde_json::json;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A listener that only counts who connects: any connection is a request
/// that Envoy sent where a client told it to.
struct Canary {
    addr: String,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Canary {
    fn start() -> Canary {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, s) = (accepted.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok(_) => {
                        a.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Canary {
            addr,
            accepted,
            stop,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

const METHODS: [&str; 7] = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"];
const PATHS: [&str; 4] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/anything?x=1",
];
/// Headers a client might hope Envoy picks its upstream from.
const STEERING: [&str; 2] = [
    "x-gateway-destination-endpoint",
    "x-envoy-original-dst-host",
];

fn chat_body() -> Vec<u8> {
    json!({
        "model": "demo-model",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
    })
    .to_string()
    .into_bytes()
}

fn chat_with(stack: &Stack, headers: &[(&str, &str)]) -> Reply {
    post(stack, "/v1/chat/completions", &chat_body(), headers)
}

#[test]
fn no_client_header_makes_envoy_connect_outside_the_catalog() {
    let _g = serial();
    let stack = start(StackConfig::default());
    let canary = Canary::start();
    let body = chat_body();
    let admin = stack.admin_addr();
    for target in [canary.addr.as_str(), admin.as_str()] {
        for method in METHODS {
            for path in PATHS {
                for header in STEERING {
                    // Several addresses, as the routed cluster's balancer
                    // reads a list.
                    let value = format!("{target},{target}");
                    // A worker may answer a method it does not serve before
                    // reading the body, and the connection then resets
                    // under the client: no answer is fine, a wrong one not.
                    let Ok((status, _, reply)) = http::request_full(
                        &stack.envoy_addr(),
                        method,
                        path,
                        &[(header, &value), ("content-type", "application/json")],
                        Some(&body),
                    ) else {
                        continue;
                    };
                    let reply = String::from_utf8_lossy(&reply);
                    assert!(
                        !reply.contains("admin"),
                        "{method} {path} with {header}: {target} reached Envoy's admin ({status}): {reply}"
                    );
                }
            }
        }
    }
    // HTTP/2 (cleartext, prior knowledge), where headers arrive as HPACK.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use http_body_util::{BodyExt, Full};
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .http2_only(true)
                .build_http::<Full<bytes::Bytes>>();
        for method in METHODS {
            for path in PATHS {
                let req = hyper::Request::builder()
                    .method(method)
                    .uri(format!("{}{path}", stack.envoy_url()))
                    .header(STEERING[0], canary.addr.as_str())
                    .header("content-type", "application/json")
                    .body(Full::new(bytes::Bytes::from(body.clone())))
                    .unwrap();
                let resp = client.request(req).await.unwrap();
                assert_eq!(resp.version(), hyper::Version::HTTP_2);
                resp.into_body().collect().await.unwrap();
            }
        }
    });
    assert_eq!(
        canary.accepted(),
        0,
        "Envoy connected where a client's header told it to"
    );
    // The filter's own choice still routes: a real worker answers.
    let r = chat_with(&stack, &[(STEERING[0], &canary.addr)]);
    served_by(&r);
    assert_eq!(canary.accepted(), 0);
}

#[test]
fn the_tenant_comes_from_authentication_never_from_the_client() {
    let _g = serial();
    let stack = start(StackConfig {
        workers: 3,
        tenants: vec!["premium".into()],
        ..StackConfig::default()
    });
    // Worker 1 serves only `premium`; 2 and 3 the default tenant.
    for _ in 0..12 {
        let r = chat_with(&stack, &[("x-kvgate-tenant", "premium")]);
        assert_ne!(
            served_by(&r).0,
            "1",
            "a client's own tenant header reached the premium worker"
        );
    }
    // A token signed with another key is no proof either.
    let forged = format!("Bearer {}", forged_token());
    for _ in 0..6 {
        let r = chat_with(&stack, &[("authorization", &forged)]);
        assert_ne!(served_by(&r).0, "1", "a forged token made the tenant");
    }
    // What an identity provider vouches for does.
    let token = format!("Bearer {}", stack.tenant_token("premium"));
    for _ in 0..4 {
        let r = chat_with(&stack, &[("authorization", &token)]);
        assert_eq!(served_by(&r).0, "1");
    }
}

/// An HS256 token for `premium` under a key Envoy does not know.
fn forged_token() -> String {
    // Header and claims as the stack's own, signature over garbage.
    let real = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCIsImtpZCI6Imt2Z2F0ZS1sb2NhbCJ9";
    let claims = "eyJ0ZW5hbnQiOiJwcmVtaXVtIn0";
    format!("{real}.{claims}.c2lnbmVkIHdpdGggc29tZSBvdGhlciBrZXkgZW50aXJlbHk")
}

#[test]
fn bookings_and_reports_need_the_control_token() {
    let _g = serial();
    let stack = start(StackConfig {
        workers: 2,
        control_token: Some("t0ken-for-tests".into()),
        ..StackConfig::default()
    });
    // A hostile booking: enough decode load to make every rank busy for
    // the whole booking TTL.
    let mut bookings = Vec::new();
    for slot in 0..2u16 {
        Event::Book {
            key: Key {
                vm: 7,
                seq: u64::from(slot),
            },
            model: "demo-model".into(),
            slot,
            prefill_tokens: u32::MAX,
            decode_blocks: u32::MAX,
            tenant: "default".into(),
        }
        .encode_into(&mut bookings);
    }
    for (path, auth) in [
        ("/v1/bookings", None),
        ("/v1/bookings", Some("Bearer wrong")),
        ("/v1/routed", None),
    ] {
        let mut headers = vec![("content-type", "application/octet-stream")];
        if let Some(a) = auth {
            headers.push(("authorization", a));
        }
        let (status, _, _) = http::request_full(
            &stack.sidecar_addr(),
            "POST",
            path,
            &headers,
            Some(&bookings),
        )
        .unwrap();
        assert_eq!(status, 401, "{path} without the token");
    }
    // Nothing was booked: requests are routed, not shed.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(bookings_active(&stack), 0.0);
    for _ in 0..4 {
        served_by(&chat_with(&stack, &[]));
    }
    // The filter's own bookings carry the token and are accepted.
    wait_bookings_drained(&stack);
    assert!(stack.envoy_stat("kvgate_booking_batches_total").unwrap() >= 1);
    assert_eq!(
        stack
            .envoy_stat("kvgate_booking_batch_errors_total")
            .unwrap(),
        0,
        "the sidecar refused the filter's bookings"
    );
}

#[test]
fn a_refused_connection_is_retried_once_on_the_next_best_worker() {
    let _g = serial();
    let mut stack = start(StackConfig {
        workers: 2,
        // The sidecar keeps the dead worker in the catalog, as it does
        // until its metrics have been silent for this long.
        down_after_ms: 60_000,
        ..StackConfig::default()
    });
    stack.kill_worker(0);
    for i in 0..20 {
        let r = chat_with(&stack, &[]);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(served_by(&r).0, "2");
        // The gateway names who served it, retry or not.
        assert_eq!(
            r.header("x-kvgate-served-by"),
            Some("worker_id=2; dp_rank=0")
        );
    }
    assert!(
        stack
            .envoy_stat("kvgate_retried_on_fallback_total")
            .unwrap()
            >= 1,
        "no request chose the dead worker first"
    );
    assert_eq!(
        stack
            .envoy_stat("kvgate_upstream_unavailable_total")
            .unwrap(),
        0
    );
    // Bookings followed the retry to the worker that served it.
    wait_bookings_drained(&stack);
}

#[test]
fn no_reachable_worker_is_an_openai_error_not_envoys_text() {
    let _g = serial();
    let mut stack = start(StackConfig {
        workers: 1,
        down_after_ms: 60_000,
        ..StackConfig::default()
    });
    stack.kill_worker(0);
    let r = chat_with(&stack, &[]);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some("upstream_unavailable"));
    assert!(
        r.header("content-type")
            .unwrap_or_default()
            .starts_with("application/json")
    );
    let v = r.json();
    assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
    assert_eq!(v["error"]["code"], 503, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("worker"));
    wait_stat(&stack, "kvgate_upstream_unavailable_total", 1);
    wait_bookings_drained(&stack);
}

#[test]
fn a_worker_dying_mid_stream_is_counted_and_releases_its_booking() {
    let _g = serial();
    let mut stack = start(StackConfig {
        workers: 1,
        down_after_ms: 60_000,
        // About 20 ms a token: a 400-token answer streams for seconds.
        sim_args: vec![
            "--speedup".into(),
            "1".into(),
            "--decode-ms-per-token".into(),
            "20".into(),
        ],
        ..StackConfig::default()
    });
    let body = json!({
        "model": "demo-model",
        "messages": [{"role": "user", "content": "a long story"}],
        "stream": true,
        "max_tokens": 400,
    })
    .to_string();
    let mut s = TcpStream::connect(stack.envoy_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended before its first event");
        got.extend_from_slice(&buf[..n]);
    }
    stack.kill_worker(0);
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got);
    assert!(!text.contains("[DONE]"), "the stream was not cut: {text}");
    assert!(
        !text.ends_with("0\r\n\r\n"),
        "a cut stream must not look complete to the client"
    );
    wait_stat(&stack, "kvgate_streams_cut_total", 1);
    wait_bookings_drained(&stack);
}

fn wait_stat(stack: &Stack, name: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = stack.envoy_stat(name).unwrap_or(0);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} is {got}, expected {want}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
