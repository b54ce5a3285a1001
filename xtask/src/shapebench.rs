//! Per-request cost by request shape, through the plain route and the
//! filter of one Envoy: a response streamed in 256 chunks against the same
//! response in one piece, and long prompts (32k and 128k tokens, as token
//! ids and as chat text). What it answers: does the filter's cost grow with
//! the chunks of a stream, and what does routing cost per 1k prompt tokens,
//! so how many cores a gateway pod needs for a long-context fleet.

use crate::bench::median;
use crate::build;
use anyhow::Result;
use bytes::Bytes;
use kvgate_load::{RequestSpec, Target, run_closed_loop};
use kvgate_stack::{Stack, StackConfig};
use serde_json::{Value, json};
use std::time::Duration;

/// Tokens in the streamed response: one SSE event each.
const CHUNKS: u64 = 256;

/// The llm-d router's reported cost at about 99 req/s of 100k-token
/// prompts: 35 to 46 cores, about 0.4 core-seconds a request
/// (`peers-2026.md`).
const LLMD_CORE_S_PER_100K_REQUEST: f64 = 0.4;

struct Shape {
    name: &'static str,
    /// Prompt tokens as sent (token ids), or aimed at (chat text, four
    /// bytes a token).
    tokens: u64,
    requests: usize,
    spec: fn(usize, u64) -> RequestSpec,
}

fn spec(path: &str, body: Value, stream: bool, tokens: Option<u64>) -> RequestSpec {
    RequestSpec {
        path: path.into(),
        body: Bytes::from(body.to_string()),
        stream,
        at: Duration::ZERO,
        tag: String::new(),
        prompt_tokens: tokens,
    }
}

fn short_chat(stream: bool) -> RequestSpec {
    spec(
        "/v1/chat/completions",
        json!({"model": "demo-model", "max_tokens": CHUNKS, "stream": stream,
               "messages": [{"role": "user", "content": "Tell me a long story."}]}),
        stream,
        None,
    )
}

/// Distinct token ids per request: no prefix is shared, so each request
/// hashes and looks up its whole prompt, the index's worst case.
fn token_ids(i: usize, n: u64) -> RequestSpec {
    let ids: Vec<u32> = (0..n as u32)
        .map(|t| 1000 + (t.wrapping_mul(7919) ^ i as u32) % 30000)
        .collect();
    spec(
        "/v1/completions",
        json!({"model": "demo-model", "max_tokens": 1, "prompt": ids}),
        false,
        Some(n),
    )
}

/// A system prompt of about `n` tokens (four bytes each), distinct per
/// request from its first word.
fn chat_text(i: usize, n: u64) -> RequestSpec {
    const WORDS: [&str; 8] = [
        "routing ", "prefix ", "cache ", "worker ", "token ", "block ", "engine ", "gateway ",
    ];
    let mut text = format!("Request {i}. ");
    let mut w = i;
    while (text.len() as u64) < n * 4 {
        text.push_str(WORDS[w % WORDS.len()]);
        w = w.wrapping_mul(31).wrapping_add(7);
    }
    spec(
        "/v1/chat/completions",
        json!({"model": "demo-model", "max_tokens": 1, "messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": "Summarise the above."}]}),
        false,
        None,
    )
}

fn shapes(quick: bool) -> Vec<Shape> {
    let q = |full: usize, quick_n: usize| if quick { quick_n } else { full };
    vec![
        Shape {
            name: "one-piece response, 256 tokens",
            tokens: 0,
            requests: q(2000, 600),
            spec: |_, _| short_chat(false),
        },
        Shape {
            name: "streamed response, 256 chunks",
            tokens: 0,
            requests: q(2000, 600),
            spec: |_, _| short_chat(true),
        },
        Shape {
            name: "32k token ids",
            tokens: 32_768,
            requests: q(300, 80),
            spec: token_ids,
        },
        Shape {
            name: "128k token ids",
            tokens: 131_072,
            requests: q(120, 30),
            spec: token_ids,
        },
        Shape {
            name: "32k-token chat text",
            tokens: 32_768,
            requests: q(120, 40),
            spec: chat_text,
        },
        Shape {
            name: "128k-token chat text",
            tokens: 131_072,
            requests: q(40, 16),
            spec: chat_text,
        },
    ]
}

/// `baseline`: another build of the filter, measured beside this one on a
/// listener of its own (its rows' `baseline` and `baseline_added_cpu_us`).
pub fn run(quick: bool, baseline: Option<&std::path::Path>) -> Result<Value> {
    let reps = if quick { 2 } else { 3 };
    let concurrency = 8;
    eprintln!("xtask: bench request shapes (streams, long prompts; {reps} repetitions)");
    let stack = Stack::start_with(
        build::release_paths()?,
        StackConfig {
            workers: 4,
            sim_args: [
                "--instant",
                "--num-gpu-blocks",
                "65536",
                "--max-num-batched-tokens",
                "1048576",
                "--max-running",
                "64",
            ]
            .map(String::from)
            .to_vec(),
            envoy_concurrency: 2,
            baseline_wasm: baseline.map(std::path::Path::to_path_buf),
            ..StackConfig::default()
        },
    )?;
    stack.wait_routing_ready(Duration::from_secs(30))?;
    let rt = tokio::runtime::Runtime::new()?;
    let mut routes = vec![stack.plain_url(), stack.envoy_url()];
    if baseline.is_some() {
        routes.push(stack.baseline_url());
    }
    let n = routes.len();
    let mut out = Vec::new();
    for shape in shapes(quick) {
        let specs: Vec<RequestSpec> = (0..shape.requests)
            .map(|i| (shape.spec)(i, shape.tokens))
            .collect();
        // Warm both routes (V8 tiers the filter up on its first requests).
        for url in &routes {
            rt.block_on(run_closed_loop(
                &Target::new(url),
                &specs[..specs.len().min(16)],
                concurrency,
            ));
        }
        // Per route: Envoy, its worker threads alone, and the sidecar: CPU
        // µs per request; errors, p50.
        let mut envoy = vec![vec![]; n];
        let mut workers = vec![vec![]; n];
        let mut sidecar = vec![vec![]; n];
        let mut p50 = vec![vec![]; n];
        let mut errors = vec![0usize; n];
        for rep in 0..reps {
            let mut order: Vec<usize> = (0..n).collect();
            if rep % 2 == 1 {
                order.reverse();
            }
            for r in order {
                let [e0, s0, _] = stack.cpu_seconds();
                let [_, w0] = stack.envoy_thread_cpu_seconds();
                let outcomes = rt.block_on(run_closed_loop(
                    &Target::new(&routes[r]),
                    &specs,
                    concurrency,
                ));
                let [e1, s1, _] = stack.cpu_seconds();
                let [_, w1] = stack.envoy_thread_cpu_seconds();
                let n = outcomes.len().max(1) as f64;
                workers[r].push((w1 - w0) * 1e6 / n);
                envoy[r].push((e1 - e0) * 1e6 / n);
                sidecar[r].push((s1 - s0) * 1e6 / n);
                errors[r] += outcomes.iter().filter(|o| o.status != 200).count();
                p50[r].push(median(
                    outcomes.iter().map(|o| o.latency_us as f64).collect(),
                ));
            }
        }
        let route = |r: usize| {
            json!({
                "envoy_cpu_us": median(envoy[r].clone()),
                "envoy_workers_cpu_us": median(workers[r].clone()),
                "sidecar_cpu_us": median(sidecar[r].clone()),
                "p50_us": median(p50[r].clone()),
                "errors": errors[r],
            })
        };
        let (plain, kvgate) = (route(0), route(1));
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        let added = f(&kvgate, "envoy_cpu_us") - f(&plain, "envoy_cpu_us")
            + f(&kvgate, "sidecar_cpu_us")
            - f(&plain, "sidecar_cpu_us");
        let tokens = shape.tokens as f64;
        let mut row = json!({
            "shape": shape.name,
            "requests": shape.requests,
            "prompt_tokens_sent": shape.tokens,
            "plain": plain,
            "kvgate": kvgate,
            "added_cpu_us": added,
            "added_cpu_us_per_1k_tokens": if shape.tokens > 0 { added / (tokens / 1000.0) } else { f64::NAN },
        });
        if n > 2 {
            let old = route(2);
            row["baseline_added_cpu_us"] = json!(
                f(&old, "envoy_cpu_us") - f(&plain, "envoy_cpu_us") + f(&old, "sidecar_cpu_us")
                    - f(&plain, "sidecar_cpu_us")
            );
            row["baseline"] = old;
        }
        out.push(row);
    }
    Ok(json!({
        "runs": reps,
        "concurrency": concurrency,
        "shapes": out,
    }))
}

/// The report's subsection, under the overhead section.
pub fn report(v: &Value) -> String {
    let Some(shapes) = v["shapes"].as_array() else {
        return String::new();
    };
    let f = |v: &Value, path: &[&str]| {
        path.iter()
            .fold(v, |v, k| &v[*k])
            .as_f64()
            .unwrap_or(f64::NAN)
    };
    let mut rows = String::new();
    for s in shapes {
        let per_1k = f(s, &["added_cpu_us_per_1k_tokens"]);
        rows.push_str(&format!(
            "| {} | {} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} µs{} | {} |\n",
            s["shape"].as_str().unwrap_or("?"),
            match f(s, &["prompt_tokens_sent"]) {
                t if t > 0.0 => format!("{}k", t / 1024.0),
                _ => "—".into(),
            },
            f(s, &["plain", "envoy_cpu_us"]),
            f(s, &["kvgate", "envoy_cpu_us"]),
            f(s, &["plain", "envoy_workers_cpu_us"]),
            f(s, &["kvgate", "envoy_workers_cpu_us"]),
            f(s, &["plain", "sidecar_cpu_us"]),
            f(s, &["kvgate", "sidecar_cpu_us"]),
            f(s, &["added_cpu_us"]),
            match s["baseline_added_cpu_us"].as_f64() {
                Some(b) => format!(" (baseline build: {b:.0} µs)"),
                None => String::new(),
            },
            if per_1k.is_nan() {
                "—".into()
            } else {
                format!("{per_1k:.1} µs")
            },
        ));
    }
    let find = |name: &str| shapes.iter().find(|s| s["shape"] == name);
    let stream_line = match (
        find("one-piece response, 256 tokens"),
        find("streamed response, 256 chunks"),
    ) {
        (Some(a), Some(b)) => {
            let on_workers = |s: &Value| {
                f(s, &["kvgate", "envoy_workers_cpu_us"]) - f(s, &["plain", "envoy_workers_cpu_us"])
            };
            format!(
                "Streaming: on Envoy's worker threads, where the filter's callbacks run, it adds {:.0} µs to a response \
                 streamed in 256 chunks and {:.0} µs to the same response in one piece, {:+.2} µs a chunk (it releases the \
                 prefill at the first chunk and returns at once on the others). The rest of a stream's added CPU is the main \
                 thread's and the sidecar's work for bookings and snapshots, which runs per interval, not per request, and \
                 weighs more per request at the streams' lower request rate.\n\n",
                on_workers(b),
                on_workers(a),
                (on_workers(b) - on_workers(a)) / (CHUNKS - 1) as f64,
            )
        }
        _ => String::new(),
    };
    // Cores for 100 req/s of 100k-token prompts, from the 128k rows.
    let mut cores = String::new();
    for name in ["128k token ids", "128k-token chat text"] {
        let Some(s) = find(name) else { continue };
        let per_1k = f(s, &["added_cpu_us_per_1k_tokens"]);
        let tokens = f(s, &["prompt_tokens_sent"]);
        let gateway_per_1k = (f(s, &["kvgate", "envoy_cpu_us"])
            + f(s, &["kvgate", "sidecar_cpu_us"]))
            / (tokens / 1000.0);
        let added_100k_s = per_1k * 100.0 / 1e6;
        cores.push_str(&format!(
            "* {name}: routing adds {:.2} ms of CPU per 100k-token request, {:.2} cores at 100 req/s \
             ({:.0}× less than llm-d's reported 0.4 core-seconds a request); the whole gateway pod \
             (Envoy proxying the body too, and the sidecar) needs {:.2} cores.\n",
            added_100k_s * 1e3,
            added_100k_s * 100.0,
            LLMD_CORE_S_PER_100K_REQUEST / added_100k_s,
            gateway_per_1k * 100.0 * 100.0 / 1e6,
        ));
    }
    format!(
        "\n### By request shape: streamed responses and long prompts\n\n\
Same Envoy (2 worker threads), plain route against the filter, alternating, closed loop ×{}, medians of {} runs; \
instant simulated workers that hand each token of a stream over as its own write (an SSE event). \
CPU per request includes each process's background (polls, ticks, scrapes, the sidecar indexing the workers' KV events), \
which weighs most on the slow rows (the simulated engine tokenizes long chats); \
added CPU is Envoy's plus the sidecar's, kvgate's route minus the plain one, over the same requests, which takes most of the background off; token prompts are distinct per request \
(no shared prefix: the whole prompt is hashed and looked up). Chat prompts are sized at four bytes a token, kvgate's own estimate.\n\n\
| request | prompt tokens | Envoy CPU µs, plain / kvgate | of it on Envoy's worker threads | sidecar CPU µs, plain / kvgate | added CPU per request | per 1k prompt tokens |\n\
| --- | --- | --- | --- | --- | --- | --- |\n{rows}\n{stream_line}{cores}",
        f(v, &["concurrency"]),
        f(v, &["runs"]),
    )
}
