//! Admission on real Envoy (the filter's `"admission"` settings,
//! `docs/admission.md`): a request no worker may take is held inside
//! Envoy and sent the moment one frees up, or answered at its class's
//! deadline; a class without the reserve is shed where critical work
//! still gets in; a client cannot name its own class or skip the queue
//! where the operator forbids it; and a client that hangs up while held
//! leaves nothing behind.
//!
//! One slow worker and `active_decode_requests_threshold` make "full"
//! exact and steady: the worker is full while long requests (hogs) are in
//! flight, for as long as they run, and the control API relaxes the bound
//! live, so a test frees the worker when it chooses rather than when a
//! hog happens to end.

mod common;

use common::*;
use kvgate_stack::{Gateway, Stack, StackConfig, http};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MODEL: &str = "demo-model";

/// The classes of the defaults, with `standard` held for `standard_ms`.
fn classes(standard_ms: u64) -> Value {
    json!([
        {"name": "critical", "priority": 0, "reserve": true, "hold_ms": 10000},
        {"name": "standard", "priority": 1, "hold_ms": standard_ms},
        {"name": "sheddable", "priority": 2, "hold_ms": 0},
    ])
}

/// One worker that decodes in real time (20 ms a token), so a hog of 200
/// tokens stays in flight for about four seconds, with a bound of
/// `bound` requests in flight and the filter's `admission` settings.
fn fleet(admission: Value, bound: u64) -> StackConfig {
    StackConfig {
        workers: 1,
        sim_args: ["--speedup", "1", "--decode-ms-per-token", "20"]
            .map(String::from)
            .to_vec(),
        model_toml: format!("active_decode_requests_threshold = {bound}"),
        plugin: json!({"admission": admission}),
        ..StackConfig::default()
    }
}

/// A completion `body`, sent on a thread of its own: its reply and how
/// long the reply took to arrive whole.
fn send(stack: &Stack, body: Value, headers: &[(&str, &str)]) -> JoinHandle<(Reply, Duration)> {
    send_to(stack.envoy_addr(), body, headers)
}

/// [`send`] through the Envoy listening at `addr` (any gateway's).
fn send_to(addr: String, body: Value, headers: &[(&str, &str)]) -> JoinHandle<(Reply, Duration)> {
    let mut head = String::from("POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\n");
    head.push_str("content-type: application/json\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.to_string();
    head.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let started = Instant::now();
        s.write_all(head.as_bytes()).unwrap();
        // Read up to the reply's length, not to the connection's end:
        // Envoy closes a connection after its own reply only once the
        // client has, or a second later (its delayed close), which would
        // pass for a second of holding.
        let (mut raw, mut buf) = (Vec::new(), [0u8; 4096]);
        loop {
            if let Some(r) = whole(&raw) {
                return (r, started.elapsed());
            }
            let n = s.read(&mut buf).unwrap();
            assert!(
                n > 0,
                "closed before a whole reply: {}",
                String::from_utf8_lossy(&raw)
            );
            raw.extend_from_slice(&buf[..n]);
        }
    })
}

/// The reply in `raw` once all of it (by its content-length) is in.
fn whole(raw: &[u8]) -> Option<Reply> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")?
        .1
        .parse()
        .ok()?;
    let body = raw.get(end + 4..end + 4 + len)?.to_vec();
    Some(Reply {
        status,
        headers,
        body,
    })
}

/// A one-token completion of a prompt unique to `tag`.
fn short(tag: u32) -> Value {
    json!({"model": MODEL, "prompt": unique_prompt(tag, 16), "max_tokens": 1})
}

/// A request that keeps one of the worker's slots for seconds.
fn hog(stack: &Stack, tag: u32, headers: &[(&str, &str)]) -> JoinHandle<(Reply, Duration)> {
    let body = json!({"model": MODEL, "prompt": unique_prompt(tag, 16), "max_tokens": 200});
    send(stack, body, headers)
}

/// Requests in flight on the worker, as the sidecar's state says.
fn in_flight(state: &Value) -> u64 {
    state["models"][0]["workers"][0]["thermal"]["in_flight"]
        .as_u64()
        .unwrap_or(0)
}

/// Waits until Envoy holds a snapshot with `n` requests in flight on the
/// worker: the next request is decided against a full (or nearly full)
/// worker, not an older, emptier view.
fn wait_in_flight(stack: &Stack, n: u64) {
    wait_published(
        stack,
        &format!("the worker never showed {n} requests in flight"),
        Duration::from_secs(10),
        |s| in_flight(s) >= n,
    );
}

/// Sets the model's bound on requests in flight (`null` lifts it)
/// through Envoy's control listener, and waits until Envoy holds the
/// snapshot that carries it.
fn set_bound(stack: &Stack, bound: Value) {
    set_bound_at(&stack.gateways[0], bound, Duration::from_secs(5));
}

/// One of admission's per-class metrics (`held_total`, `sent_total`...,
/// or `held`, the gauge), as Envoy's admin page names it.
fn admission_stat(stack: &Stack, what: &str, class: &str) -> u64 {
    admission_stat_at(&stack.gateways[0], what, class)
}

/// Waits until an admission metric reads `want`.
fn wait_stat(stack: &Stack, what: &str, class: &str, want: u64) {
    wait_stat_at(&stack.gateways[0], what, class, want);
}

/// Asserts a shed reply: its status, reason, Retry-After, OpenAI's error
/// shape, and that no worker answered it.
fn assert_shed(r: &Reply, status: u16, reason: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.header("x-kvgate-reason"), Some(reason), "{}", r.text());
    let retry = r.header("retry-after").expect("a shed carries retry-after");
    assert!(
        retry.parse::<u32>().is_ok_and(|s| s >= 1),
        "retry-after {retry:?}"
    );
    assert_eq!(r.json()["error"]["code"], status, "{}", r.text());
    assert!(
        r.header("x-kvgate-sim-worker").is_none(),
        "a worker answered the shed"
    );
}

/// The hogs end as they began: served.
fn join_all(hogs: Vec<JoinHandle<(Reply, Duration)>>) {
    for h in hogs {
        let (r, _) = h.join().unwrap();
        assert_eq!(r.status, 200, "a hog failed: {}", r.text());
    }
}

#[test]
fn a_held_request_is_sent_when_the_worker_frees_up() {
    let _g = serial();
    let stack = start(fleet(json!({}), 1));
    let first = hog(&stack, 1, &[]);
    wait_in_flight(&stack, 1);

    // The worker is full: the request waits inside Envoy, not answered.
    let held = send(&stack, short(2), &[]);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!held.is_finished(), "answered at once, not held");
    assert_eq!(admission_stat(&stack, "held_total", "standard"), 1);
    assert_eq!(admission_stat(&stack, "held", "standard"), 1);

    // Lifting the bound frees the worker in the next snapshot: the tick
    // sends the held request on while the hog still runs, so it was the
    // snapshot that released it, not the hog's end.
    set_bound(&stack, Value::Null);
    let (r, took) = held.join().unwrap();
    assert!(!first.is_finished(), "the hog ended first: no proof");
    assert_eq!(served_by(&r), ("1".into(), "0".into()));
    assert!(took >= Duration::from_millis(300), "took {took:?}");
    assert_eq!(admission_stat(&stack, "sent_total", "standard"), 1);
    assert_eq!(admission_stat(&stack, "held", "standard"), 0);
    join_all(vec![first]);
}

#[test]
fn a_held_request_is_answered_with_the_models_status_at_its_deadline() {
    let _g = serial();
    let stack = start(fleet(
        json!({"classes": classes(500), "models": {MODEL: {"shed_status": 429}}}),
        1,
    ));
    let first = hog(&stack, 1, &[]);
    wait_in_flight(&stack, 1);

    let (r, took) = send(&stack, short(2), &[]).join().unwrap();
    assert_shed(&r, 429, "deadline_passed");
    assert_eq!(r.json()["error"]["type"], "rate_limit_exceeded");
    // Held its class's whole hold, and let go soon after: the tick runs
    // every 10 ms.
    assert!(took >= Duration::from_millis(500), "took {took:?}");
    assert!(took < Duration::from_millis(2500), "took {took:?}");
    assert!(!first.is_finished(), "the worker freed up meanwhile");
    assert_eq!(admission_stat(&stack, "expired_total", "standard"), 1);
    assert_eq!(admission_stat(&stack, "held", "standard"), 0);
    assert_eq!(
        stack
            .envoy_stat("kvgate_rejected_deadline_passed_total")
            .unwrap(),
        1
    );
    join_all(vec![first]);
}

#[test]
fn the_reserve_sheds_sheddable_work_where_critical_work_gets_in() {
    let _g = serial();
    // The stack's Envoy strips `x-kvgate-class` and sets it only from a
    // JWT claim this stack cannot sign, so the operator's class here comes
    // from a header of its own.
    let stack = start(fleet(
        json!({"class_header": "x-test-class", "shed_status": 429}),
        10,
    ));
    // Nine of ten: over the 90 % a class without the reserve may use,
    // under the whole bound critical work may.
    let critical = [("x-test-class", "critical")];
    let hogs: Vec<_> = (0..9).map(|i| hog(&stack, i, &critical)).collect();
    wait_in_flight(&stack, 9);

    let (r, took) = send(&stack, short(100), &[("x-test-class", "sheddable")])
        .join()
        .unwrap();
    assert_shed(&r, 429, "priority_shed");
    assert!(
        took < Duration::from_millis(300),
        "not shed at once: {took:?}"
    );

    // A standard request would be held at this load; asked not to be, it
    // is shed at once.
    let (r, took) = send(&stack, short(101), &[("x-kvgate-do-not-queue", "1")])
        .join()
        .unwrap();
    assert_shed(&r, 429, "all_workers_busy");
    assert!(
        took < Duration::from_millis(300),
        "not shed at once: {took:?}"
    );
    assert_eq!(admission_stat(&stack, "do_not_queue_total", "standard"), 1);

    // The tenth slot is critical work's: routed at once, never held.
    let (r, took) = send(&stack, short(102), &critical).join().unwrap();
    assert_eq!(served_by(&r).0, "1");
    assert!(took < Duration::from_millis(1000), "took {took:?}");
    assert_eq!(admission_stat(&stack, "held_total", "critical"), 0);
    assert!(
        hogs.iter().all(|h| !h.is_finished()),
        "a hog ended: the load changed under the test"
    );
    join_all(hogs);
    // Counted by class as well as by reason.
    assert_eq!(
        stack
            .envoy_stat("kvgate_rejected_priority_shed_total")
            .unwrap(),
        1
    );
    assert_eq!(admission_stat(&stack, "shed_total", "sheddable"), 1);
}

#[test]
fn a_client_cannot_name_its_class_or_skip_the_queue_where_forbidden() {
    let _g = serial();
    let stack = start(fleet(
        json!({"client_class": false, "client_do_not_queue": false}),
        1,
    ));
    let first = hog(&stack, 1, &[]);
    wait_in_flight(&stack, 1);

    // Everything a client could try: the body's fields, the do-not-queue
    // header, and the class header itself (which Envoy strips).
    let mut body = short(2);
    body["kvgate_class"] = json!("critical");
    body["do_not_queue"] = json!(true);
    let held = send(
        &stack,
        body,
        &[
            ("x-kvgate-do-not-queue", "1"),
            ("x-kvgate-class", "critical"),
        ],
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !held.is_finished(),
        "shed at once: the client skipped the queue"
    );
    assert_eq!(admission_stat(&stack, "held_total", "standard"), 1);
    assert_eq!(admission_stat(&stack, "held_total", "critical"), 0);
    assert_eq!(admission_stat(&stack, "do_not_queue_total", "standard"), 0);

    set_bound(&stack, Value::Null);
    let (r, _) = held.join().unwrap();
    assert_eq!(served_by(&r).0, "1");
    join_all(vec![first]);
    // The worker saw neither field: they are stripped, allowed or not.
    let seen = recent(&stack, 0);
    assert_eq!(seen.len(), 2, "{seen:?}");
    for record in &seen {
        let keys = record["body_keys"].as_array().unwrap();
        assert!(
            !keys.contains(&json!("kvgate_class")) && !keys.contains(&json!("do_not_queue")),
            "the worker saw admission's fields: {record}"
        );
    }
}

#[test]
fn a_client_that_hangs_up_while_held_leaves_nothing_behind() {
    let _g = serial();
    let stack = start(fleet(json!({}), 1));
    let first = hog(&stack, 1, &[]);
    wait_in_flight(&stack, 1);

    // Held, then gone: the connection closes with the request paused.
    let body = short(2).to_string();
    let mut client = TcpStream::connect(stack.envoy_addr()).unwrap();
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\ncontent-type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_stat(&stack, "held", "standard", 1);
    drop(client);
    // Its place goes with it, before any worker frees up.
    wait_stat(&stack, "held", "standard", 0);

    // A worker frees up: nothing is left to send.
    set_bound(&stack, Value::Null);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(admission_stat(&stack, "sent_total", "standard"), 0);
    join_all(vec![first]);
    wait_bookings_drained(&stack);
    assert_eq!(
        served_total(&stack),
        1,
        "the worker served more than the hog"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight(&stack.sidecar_state().unwrap()) > 0 {
        assert!(
            Instant::now() < deadline,
            "requests still counted in flight"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // No slot of the bound is left taken either: at a bound of one, the
    // next request is routed at once.
    set_bound(&stack, json!(1));
    let (r, took) = send(&stack, short(3), &[]).join().unwrap();
    assert_eq!(served_by(&r).0, "1");
    assert!(took < Duration::from_millis(1000), "took {took:?}");
    assert_eq!(admission_stat(&stack, "held_total", "standard"), 1);
}

/// [`set_bound`] through gateway `g`'s control listener, which reaches
/// `g`'s own sidecar: only `g`'s Envoy decides by it.
fn set_bound_at(g: &Gateway, bound: Value, within: Duration) {
    g.set_thresholds(&json!({"model": MODEL, "active_decode_requests_threshold": bound}))
        .unwrap();
    wait_published_at(g, "Envoy never took the new bound", within, |s| {
        s["models"][0]["thresholds"]["active_decode_requests_threshold"] == bound
    });
}

/// [`wait_published_at`] within ten seconds: what the two-gateway test
/// waits for crosses replica sync.
fn published_10s(g: &Gateway, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    wait_published_at(g, what, Duration::from_secs(10), ready)
}

/// [`admission_stat`] at gateway `g`: Envoy's admin page names the
/// metric with its model and class.
fn admission_stat_at(g: &Gateway, what: &str, class: &str) -> u64 {
    g.envoy_stat(&format!(
        "kvgate_admission_{what}.model.{MODEL}.class.{class}"
    ))
    .unwrap()
}

/// [`wait_stat`] at gateway `g`: polled for five seconds at most.
fn wait_stat_at(g: &Gateway, what: &str, class: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = admission_stat_at(g, what, class);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "kvgate_admission_{what} of {class} stayed {got}, not {want}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What a state's first model lists as `tenant`'s booked load:
/// (prefill tokens, decode blocks), if it lists the tenant.
fn tenant_load(state: &Value, tenant: &str) -> Option<(u64, u64)> {
    state["models"][0]["tenants"]
        .as_array()?
        .iter()
        .find(|t| t["tenant"] == tenant)
        .map(|t| {
            (
                t["prefill_tokens"].as_u64().unwrap_or(0),
                t["decode_blocks"].as_u64().unwrap_or(0),
            )
        })
}

/// A completion of `max_tokens` through the Envoy at `addr`, counted
/// against `account`.
fn as_account(
    addr: String,
    account: &'static str,
    tag: u32,
    max_tokens: u32,
) -> JoinHandle<(Reply, Duration)> {
    let body = json!({"model": MODEL, "prompt": unique_prompt(tag, 16), "max_tokens": max_tokens});
    send_to(addr, body, &[("x-test-account", account)])
}

#[test]
fn two_gateways_enforce_one_tenant_budget() {
    let _g = serial();
    // Two gateway pods in front of one worker, their sidecars joined by
    // replica sync. Each Envoy runs one worker thread, so the held
    // requests at B share one VM's queue, which is what fairness orders
    // (the queue is per VM). No reserve: the bound of 4 is every class's,
    // so relaxing it to 5 frees exactly one slot for a standard request.
    // The stack's Envoy strips `x-kvgate-account` from clients, so the
    // account comes from a header of the test's own.
    let stack = start(StackConfig {
        gateways: 2,
        replica_sync: true,
        envoy_concurrency: 1,
        ..fleet(
            json!({
                "account_header": "x-test-account",
                "reserve_pct": 0,
                "classes": classes(20000),
            }),
            4,
        )
    });
    let (a, b) = (&stack.gateways[0], &stack.gateways[1]);

    // `heavy` books three long requests at A (500 tokens: ten seconds,
    // far longer than the test needs the worker full). `light` books one
    // at B: fairness weighs shares among accounts with load, and an
    // account alone holds all of it, its fair part, so `light` needs a
    // little load for `heavy`'s three quarters to count as over its half.
    let mut hogs: Vec<_> = (0..3)
        .map(|i| as_account(a.envoy_addr(), "heavy", i, 500))
        .collect();
    published_10s(b, "B never saw heavy's bookings at A", |s| {
        in_flight(s) >= 3 && tenant_load(s, "heavy").is_some_and(|(_, d)| d > 0)
    });
    hogs.push(as_account(b.envoy_addr(), "light", 10, 500));
    published_10s(b, "the worker never filled up", |s| {
        in_flight(s) >= 4 && tenant_load(s, "light").is_some_and(|(_, d)| d > 0)
    });

    // The worker is full: at B, `heavy` is held first, then `light`
    // behind it. Each, once sent, keeps the one freed slot for about a
    // second (50 tokens), so the other cannot follow until it ends.
    let heavy = as_account(b.envoy_addr(), "heavy", 20, 50);
    wait_stat_at(b, "held", "standard", 1);
    let light = as_account(b.envoy_addr(), "light", 21, 50);
    wait_stat_at(b, "held", "standard", 2);
    assert_eq!(admission_stat_at(b, "sent_total", "standard"), 0);

    // B's Envoy has sent no `heavy` request (its one is held), so the
    // `heavy` load in B's snapshot is A's bookings, carried by replica
    // sync, and the same as A's own count. By decode blocks `heavy` holds
    // three quarters of the booked load, over its half.
    let seen_at_a = published_10s(a, "A never counted both accounts", |s| {
        tenant_load(s, "heavy").is_some() && tenant_load(s, "light").is_some()
    });
    let seen_at_b = published_10s(b, "B never counted both accounts", |s| {
        tenant_load(s, "heavy").is_some() && tenant_load(s, "light").is_some()
    });
    let (heavy_at_b, light_at_b) = (
        tenant_load(&seen_at_b, "heavy").unwrap(),
        tenant_load(&seen_at_b, "light").unwrap(),
    );
    assert_eq!(
        Some(heavy_at_b),
        tenant_load(&seen_at_a, "heavy"),
        "B counts heavy's load otherwise than A, where it is booked"
    );
    assert!(
        heavy_at_b.1 >= 3 * light_at_b.1 && light_at_b.1 > 0,
        "heavy {heavy_at_b:?}, light {light_at_b:?}"
    );
    assert!(
        hogs.iter().all(|h| !h.is_finished()),
        "a hog ended: the load changed under the test"
    );

    // One slot frees up at B. `heavy` came first, but is over its share:
    // `light` gets the slot.
    set_bound_at(b, json!(5), Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(5);
    while admission_stat_at(b, "sent_total", "standard") == 0 {
        assert!(Instant::now() < deadline, "nothing was sent at B");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Exactly one went: the other still waits for the slot.
    assert_eq!(admission_stat_at(b, "held", "standard"), 1);
    let (r, _) = light.join().unwrap();
    assert_eq!(served_by(&r).0, "1");
    // `light` was served whole while `heavy` still waited: had `heavy`
    // gone first, its second of decoding would have ended before
    // `light`'s began.
    assert!(
        !heavy.is_finished(),
        "heavy was answered before light: the account over its share went first"
    );
    assert!(
        hogs.iter().all(|h| !h.is_finished()),
        "a hog ended: its slot, not the relaxed bound, let a request in"
    );
    // Then `heavy` gets the slot `light` left, within its hold.
    let (r, _) = heavy.join().unwrap();
    assert_eq!(served_by(&r).0, "1");
    assert_eq!(admission_stat_at(b, "sent_total", "standard"), 2);
    assert_eq!(admission_stat_at(b, "expired_total", "standard"), 0);
    join_all(hogs);
}

#[test]
fn admission_metrics_carry_model_and_class_labels() {
    let _g = serial();
    let stack = start(fleet(json!({}), 1));
    let first = hog(&stack, 1, &[]);
    wait_in_flight(&stack, 1);
    let held = send(&stack, short(2), &[]);
    wait_stat(&stack, "held", "standard", 1);

    // The filter names the metric `kvgate_admission_held_total.model.<m>
    // .class.<c>` (proxy-wasm metrics have no labels); the template's
    // stats_tags turn both parts into labels on Prometheus's page, where
    // a dashboard sums or filters by them.
    let (status, body) = http::get(&stack.admin_addr(), "/stats/prometheus").unwrap();
    assert_eq!(status, 200);
    let page = String::from_utf8_lossy(&body);
    let labelled = |name: &str| -> Vec<String> {
        page.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .map(String::from)
            .collect()
    };
    let lines = labelled("kvgate_admission_held_total");
    let line = lines
        .iter()
        .find(|l| l.contains(&format!("model=\"{MODEL}\"")) && l.contains("class=\"standard\""))
        .unwrap_or_else(|| {
            panic!(
                "no kvgate_admission_held_total with model and class labels in:\n{}",
                page.lines()
                    .filter(|l| l.contains("kvgate_admission"))
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        });
    // It counts the one request held, and no name kept the suffix.
    assert!(line.ends_with(" 1"), "{line}");
    let kept: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("kvgate_admission_"))
        .map(|l| l.split(['{', ' ']).next().unwrap_or(l))
        .filter(|name| name.contains("model") || name.contains("class"))
        .collect();
    assert!(kept.is_empty(), "names that kept their suffix: {kept:?}");
    // The gauge is labelled the same way, and reads the one held.
    let gauge = labelled("kvgate_admission_held");
    assert!(
        gauge
            .iter()
            .any(|l| l.contains("class=\"standard\"") && l.ends_with(" 1")),
        "{gauge:?}"
    );

    set_bound(&stack, Value::Null);
    let (r, _) = held.join().unwrap();
    assert_eq!(served_by(&r).0, "1");
    join_all(vec![first]);
}

#[test]
fn a_full_queue_sheds_its_last_for_a_request_that_comes_first() {
    let _g = serial();
    // One Envoy thread: the queue is a thread's.
    let stack = start(StackConfig {
        envoy_concurrency: 1,
        ..fleet(json!({"class_header": "x-test-class", "max_held": 1}), 1)
    });
    let first = hog(&stack, 1, &[]);
    wait_in_flight(&stack, 1);
    let standard = send(&stack, short(2), &[]);
    wait_stat(&stack, "held", "standard", 1);
    // Another of its class finds the queue full of one that came first.
    let (r, _) = send(&stack, short(3), &[]).join().unwrap();
    assert_shed(&r, 503, "queue_full");
    // A critical one takes the last one's place; that one is answered.
    let critical = send(&stack, short(4), &[("x-test-class", "critical")]);
    let (r, _) = standard.join().unwrap();
    assert_shed(&r, 503, "priority_shed");
    wait_stat(&stack, "held", "critical", 1);
    assert_eq!(admission_stat(&stack, "held", "standard"), 0);
    set_bound(&stack, Value::Null);
    let (r, _) = critical.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // Envoy is still there to serve the next one.
    let (r, _) = send(&stack, short(5), &[]).join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    join_all(vec![first]);
}
