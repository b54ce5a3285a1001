//! The Grafana dashboard and the Prometheus alert rules against a real
//! Prometheus (Debian's package, `.tools/prometheus`, installed by `cargo
//! xtask test`) scraping a live stack: Envoy's `/stats/prometheus`, the
//! sidecar's `/metrics` and the workers' own pages, as
//! `deploy/kubernetes/podmonitor.yaml` labels them (jobs kvgate-envoy and
//! kvgate-sidecar, `pod` on both). Every dashboard query and every alert
//! expression must parse and evaluate; each must return at least one series
//! (an alert's with its thresholds turned into `bool` comparisons, so that
//! a healthy stack answers too), except those [`ONLY_AFTER`] names, whose
//! metrics appear only once what they count has happened: those must parse,
//! and every metric name anything references must have series.

mod common;

use common::*;
use kvgate_stack::{Proc, Stack, StackConfig, ThermalStack, http};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Metrics a healthy stack does not have yet, and what creates them.
/// Queries naming them are checked to parse and evaluate only.
const ONLY_AFTER: &[(&str, &str)] = &[
    (
        "kvgate_planner_decisions_total",
        "the planner's first scaling decision",
    ),
    (
        "kvgate_sidecar_thermal_throttle_entries_total",
        "a worker throttling",
    ),
    ("reason=\"thermal\"", "a request shed for heat"),
    (
        "kvgate_sidecar_replica_peer_",
        "replica sync with a peer (the gateways test's stacks)",
    ),
    (
        "kvgate_sidecar_bookings_refused_total",
        "a booking refused before the ledger: past max_prompt_tokens or at a [load.caps] cap (the sidecar's ledger_caps test)",
    ),
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn prometheus_bin() -> PathBuf {
    std::env::var_os("KVGATE_PROMETHEUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".tools/prometheus/usr/bin/prometheus"))
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prometheus {
    addr: String,
    _proc: Proc,
}

impl Prometheus {
    fn start(stack: &Stack) -> Prometheus {
        let bin = prometheus_bin();
        assert!(
            bin.exists(),
            "{} is missing: cargo xtask test unpacks Debian's prometheus package into .tools/",
            bin.display()
        );
        let g = &stack.gateways[0];
        let workers: Vec<String> = stack.workers.iter().map(|w| w.endpoint()).collect();
        let rules = repo().join("deploy/prometheus/kvgate-alerts.yml");
        let config = format!(
            "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\n\
             rule_files: [{rules:?}]\n\
             scrape_configs:\n\
             - job_name: kvgate-envoy\n  metrics_path: /stats/prometheus\n  static_configs: [{{ targets: [{:?}], labels: {{ pod: gateway-0 }} }}]\n\
             - job_name: kvgate-sidecar\n  metrics_path: /metrics\n  static_configs: [{{ targets: [{:?}], labels: {{ pod: gateway-0 }} }}]\n\
             - job_name: vllm\n  metrics_path: /metrics\n  static_configs: [{{ targets: {workers:?} }}]\n",
            g.admin_addr(),
            g.sidecar_addr(),
        );
        let file = stack.run_dir.join("prometheus.yml");
        std::fs::write(&file, config).unwrap();
        let addr = format!("127.0.0.1:{}", kvgate_stack::free_ports(1).unwrap()[0]);
        let args = vec![
            format!("--config.file={}", file.display()),
            format!(
                "--storage.tsdb.path={}",
                stack.run_dir.join("prometheus").display()
            ),
            format!("--web.listen-address={addr}"),
            "--log.level=warn".into(),
        ];
        let proc = Proc::spawn("prometheus", &bin, &args, &stack.run_dir).unwrap();
        http::wait_for_status(&addr, "/-/ready", 200, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("prometheus did not start: {e:#}\n{}", stack.log_tails()));
        Prometheus { addr, _proc: proc }
    }

    /// An instant query: the result, or Prometheus's error.
    fn query(&self, q: &str) -> Result<Vec<Value>, String> {
        let (status, body) = http::get(&self.addr, &format!("/api/v1/query?query={}", encode(q)))
            .map_err(|e| e.to_string())?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        if status != 200 || v["status"] != "success" {
            return Err(format!("{status}: {}", v["error"]));
        }
        match &v["data"]["result"] {
            Value::Array(a) => Ok(a.clone()),
            // Scalars and strings are one value.
            other => Ok(vec![other.clone()]),
        }
    }
}

fn only_after(q: &str) -> Option<&'static str> {
    ONLY_AFTER
        .iter()
        .find(|(m, _)| q.contains(m))
        .map(|(_, why)| *why)
}

/// Grafana's variables as the dashboard uses them.
fn substitute(q: &str) -> String {
    q.replace("$__rate_interval", "15s").replace("$model", ".*")
}

/// The expression with every comparison returning 0 or 1 instead of
/// filtering: what an alert watches, whether it would fire or not.
fn booleanize(q: &str) -> String {
    let b = q.as_bytes();
    let (mut out, mut i, mut depth) = (String::new(), 0, 0i32);
    let mut quote: Option<u8> = None;
    while i < b.len() {
        let c = b[i];
        if let Some(qc) = quote {
            out.push(c as char);
            if c == qc {
                quote = None;
            }
            i += 1;
            continue;
        }
        match c {
            b'"' | b'\'' => quote = Some(c),
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth -= 1,
            _ => {}
        }
        let two = b.get(i..i + 2).unwrap_or_default();
        let op = if depth > 0 {
            0
        } else if matches!(two, b"==" | b"!=" | b">=" | b"<=") {
            2
        } else if matches!(c, b'>' | b'<') {
            1
        } else {
            0
        };
        if op == 0 {
            out.push(c as char);
            i += 1;
            continue;
        }
        out.push_str(std::str::from_utf8(&b[i..i + op]).unwrap());
        i += op;
        if !q[i..].trim_start().starts_with("bool") {
            out.push_str(" bool");
        }
    }
    out
}

/// Metric names a PromQL expression reads (identifiers that are not
/// functions, keywords, label names or grouping labels).
fn metric_names(q: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "inf",
        "nan",
    ];
    let b = q.as_bytes();
    let (mut names, mut i, mut depth) = (BTreeSet::new(), 0, 0i32);
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    while i < b.len() {
        let c = b[i];
        match c {
            b'"' | b'\'' => {
                i += 1;
                while i < b.len() && b[i] != c {
                    i += 1;
                }
                i += 1;
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth -= 1,
            _ => {}
        }
        if depth == 0 && (c.is_ascii_alphabetic() || c == b'_') {
            let start = i;
            while i < b.len() && ident(b[i]) {
                i += 1;
            }
            let word = &q[start..i];
            let next = q[i..].trim_start();
            if matches!(
                word,
                "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
            ) {
                // Its label list is not metric names.
                if let Some(end) = next.strip_prefix('(').and_then(|r| r.find(')')) {
                    i += q[i..].len() - next.len() + end + 2;
                }
                continue;
            }
            if !next.starts_with('(') && !KEYWORDS.contains(&word) {
                names.insert(word.to_string());
            }
            continue;
        }
        i += 1;
    }
    names
}

fn dashboard_queries() -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(repo().join("deploy/grafana/kvgate-dashboard.json")).unwrap();
    let d: Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?").to_string();
            out.push((title, t["expr"].as_str().unwrap().to_string()));
        }
    }
    assert!(out.len() > 30, "only {} dashboard queries", out.len());
    out
}

fn alert_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join("deploy/prometheus/kvgate-alerts.yml")).unwrap();
    let v: Value = serde_norway::from_str(&text).unwrap();
    let mut out = Vec::new();
    for g in v["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            out.push((
                r["alert"].as_str().unwrap().to_string(),
                r["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

#[test]
fn booleanize_turns_thresholds_into_bool_comparisons() {
    assert_eq!(
        booleanize("max by (pod) (x{a!=\"b\"}) > 5"),
        "max by (pod) (x{a!=\"b\"}) > bool 5"
    );
    assert_eq!(
        booleanize("a == 0 and on (w) b >= bool 1"),
        "a == bool 0 and on (w) b >= bool 1"
    );
    assert_eq!(
        metric_names("sum by (model) (rate(kvgate_x_total{reason=\"y\"}[5m])) / sum(up)"),
        BTreeSet::from(["kvgate_x_total".to_string(), "up".to_string()])
    );
    assert_eq!(
        metric_names(
            "histogram_quantile(0.5, sum by (le) (rate(vllm:a_bucket[1m]))) * on (pod) group_left (model) b"
        ),
        BTreeSet::from(["vllm:a_bucket".to_string(), "b".to_string()])
    );
}

#[test]
fn dashboard_and_alerts_query_a_live_stack() {
    let _serial = serial();
    // Everything the dashboard shows configured: KV events, the text index
    // (the model's tokenizer files), thermal readings and the planner.
    let chat_files = repo().join("tests/fixtures/chat");
    let stack = start(
        StackConfig {
            workers: 3,
            kv_events: true,
            model_toml: "[models.planner]\nttft_ms = 500\nitl_ms = 40\nload_interval_ms = 500\nthroughput_interval_ms = 2000\n".into(),
            thermal: Some(ThermalStack {
                gpus: 2,
                batch_control: false,
                toml: "interval_ms = 200\n".into(),
            }),
            ..StackConfig::default()
        }
        .with_prompt_files(
            &chat_files.join("llama3-style.tokenizer.json"),
            &chat_files.join("llama3-style.tokenizer_config.json"),
            true,
        ),
    );
    let prom = Prometheus::start(&stack);
    // Traffic of every kind the dashboard shows: routed chats and
    // completions, and local replies (unknown model, malformed body).
    for i in 0..30 {
        let r = chat(
            &stack,
            "demo-model",
            &format!("question {i} about caching"),
            8,
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = chat(&stack, "no-such-model", "hello", 8);
    assert_eq!(r.status, 404);
    let r = post(&stack, "/v1/completions", b"{not json", &[]);
    assert_eq!(r.status, 400);

    // Until every target is scraped and the counters have a few samples
    // after the traffic.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let up = prom.query("sum(up)").unwrap_or_default();
        let routed = prom
            .query("count_over_time(kvgate_sidecar_routed_total[1m])")
            .unwrap_or_default();
        let planned = prom
            .query("kvgate_planner_desired_replicas")
            .unwrap_or_default();
        let n = |v: &[Value]| {
            v.first()
                .and_then(|s| s["value"][1].as_str())
                .and_then(|s| s.parse::<f64>().ok())
        };
        if n(&up) == Some(5.0) && n(&routed).is_some_and(|c| c >= 5.0) && !planned.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus never had the stack's series: up {up:?}, routed {routed:?}, planner {planned:?}\n{}",
            stack.log_tails()
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    let mut failures = Vec::new();
    let mut names = BTreeSet::new();
    let mut check = |what: String, q: String, nonempty: String| {
        names.extend(metric_names(&q));
        match prom.query(&q) {
            Err(e) => failures.push(format!("{what}: {q}\n  does not evaluate: {e}")),
            Ok(_) if only_after(&q).is_some() => {
                let has = prom.query(&nonempty).is_ok_and(|r| !r.is_empty());
                eprintln!(
                    "{what}: parse-only ({}); has series now: {has}",
                    only_after(&q).unwrap_or("")
                );
            }
            Ok(_) => match prom.query(&nonempty) {
                Ok(r) if !r.is_empty() => {}
                Ok(_) => failures.push(format!("{what}: {nonempty}\n  returns no series")),
                Err(e) => failures.push(format!("{what}: {nonempty}\n  does not evaluate: {e}")),
            },
        }
    };
    for (panel, q) in dashboard_queries() {
        let q = substitute(&q);
        check(format!("dashboard panel {panel:?}"), q.clone(), q);
    }
    for (alert, q) in alert_exprs() {
        let b = booleanize(&q);
        check(format!("alert {alert}"), q, b);
    }
    // Names in parse-only queries must be real too: each has series, or is
    // one of those that appear only after their event.
    for name in &names {
        if only_after(name).is_some() {
            continue;
        }
        match prom.query(&format!("count({{__name__={name:?}}})")) {
            Ok(r) if !r.is_empty() => {}
            other => failures.push(format!("metric {name} has no series: {other:?}")),
        }
    }
    // Prometheus evaluated every rule without an error.
    let (_, body) = http::get(&prom.addr, "/api/v1/rules").unwrap();
    let rules: Value = serde_json::from_slice(&body).unwrap();
    for g in rules["data"]["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            if r["health"] != "ok" {
                failures.push(format!(
                    "rule {} health {}: {}",
                    r["name"], r["health"], r["lastError"]
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
