//! Per-request cost by request shape, through the plain route and the
//! filter of one Envoy: a response streamed in 256 chunks against the same
//! response in one piece, and prompts of 1k to 128k tokens as token ids,
//! as text and as chat text (the length curve). What it answers: does the
//! filter's cost grow with the chunks of a stream, what does routing cost
//! per 1k prompt tokens on Envoy's worker threads, and does it stay linear
//! in the prompt, so how many cores a gateway pod needs for a long-context
//! fleet.

use crate::build;
use crate::plot;
use crate::stats::median;
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
pub const LLMD_CORE_S_PER_100K_REQUEST: f64 = 0.4;

/// The length curve's prompt sizes, in tokens.
const LENGTHS: [u64; 5] = [1024, 2048, 8192, 32_768, 131_072];

/// How a prompt of the length curve is sent.
#[derive(Debug, Clone, Copy)]
enum Kind {
    TokenIds,
    Text,
    Chat,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::TokenIds, Kind::Text, Kind::Chat];

    /// The shape's name at `tokens`; the 32k and 128k names are the ones
    /// earlier reports used.
    fn shape_name(self, tokens: u64) -> String {
        let k = tokens / 1024;
        match self {
            Kind::TokenIds => format!("{k}k token ids"),
            Kind::Text => format!("{k}k-token text"),
            Kind::Chat => format!("{k}k-token chat text"),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Kind::TokenIds => "token ids",
            Kind::Text => "text",
            Kind::Chat => "chat",
        }
    }

    fn spec(self) -> fn(usize, u64) -> RequestSpec {
        match self {
            Kind::TokenIds => token_ids,
            Kind::Text => text,
            Kind::Chat => chat_text,
        }
    }

    /// Requests per run at `tokens`: fewer as prompts grow, the simulated
    /// engine's tokenizer being the slow part of the long text rows.
    fn requests(self, tokens: u64, quick: bool) -> usize {
        let full = match (self, tokens / 1024) {
            (Kind::TokenIds, 0..=1) => 1500,
            (Kind::TokenIds, 2) => 1000,
            (Kind::TokenIds, 3..=8) => 500,
            (Kind::TokenIds, 9..=32) => 300,
            (Kind::TokenIds, _) => 120,
            (_, 0..=1) => 1000,
            (_, 2) => 800,
            (_, 3..=8) => 300,
            (_, 9..=32) => 120,
            (_, _) => 40,
        };
        if quick { (full / 4).max(16) } else { full }
    }
}

struct Shape {
    name: String,
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

/// [`token_ids`] laid out as Python's `json.dumps` writes them (", " and
/// ": "), as `requests` and `aiohttp` send them.
fn token_ids_spaced(i: usize, n: u64) -> RequestSpec {
    let mut r = token_ids(i, n);
    // No string of the body holds a comma or a colon.
    let spaced = String::from_utf8_lossy(&r.body)
        .replace(',', ", ")
        .replace(':', ": ");
    r.body = Bytes::from(spaced);
    r
}

/// About `n` tokens of words (four bytes a token), distinct per request
/// from its first word.
fn words(i: usize, n: u64) -> String {
    const WORDS: [&str; 8] = [
        "routing ", "prefix ", "cache ", "worker ", "token ", "block ", "engine ", "gateway ",
    ];
    let mut text = format!("Request {i}. ");
    let mut w = i;
    while (text.len() as u64) < n * 4 {
        text.push_str(WORDS[w % WORDS.len()]);
        w = w.wrapping_mul(31).wrapping_add(7);
    }
    text
}

/// A completion whose prompt is `n` Chinese characters (about a token
/// each), escaped as Python's `json.dumps` writes anything past ASCII
/// (`\u4f60`).
fn chinese_text_escaped(i: usize, n: u64) -> RequestSpec {
    let prompt: String = (0..n as usize)
        .map(|k| format!("\\u{:04x}", 0x4e00 + (k * 7919 + i * 31) % 20_000))
        .collect();
    let mut r = text(i, n);
    r.body = Bytes::from(format!(
        r#"{{"model": "demo-model", "max_tokens": 1, "prompt": "{prompt}"}}"#
    ));
    r
}

/// A completion whose prompt is about `n` tokens of text.
fn text(i: usize, n: u64) -> RequestSpec {
    spec(
        "/v1/completions",
        json!({"model": "demo-model", "max_tokens": 1, "prompt": words(i, n)}),
        false,
        None,
    )
}

/// A chat whose system prompt is about `n` tokens.
fn chat_text(i: usize, n: u64) -> RequestSpec {
    let text = words(i, n);
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
    let mut shapes = vec![
        Shape {
            name: "one-piece response, 256 tokens".into(),
            tokens: 0,
            requests: q(2000, 600),
            spec: |_, _| short_chat(false),
        },
        Shape {
            name: "streamed response, 256 chunks".into(),
            tokens: 0,
            requests: q(2000, 600),
            spec: |_, _| short_chat(true),
        },
    ];
    shapes.push(Shape {
        name: "2k token ids, spaced (Python's json.dumps)".into(),
        tokens: 2048,
        requests: Kind::TokenIds.requests(2048, quick),
        spec: token_ids_spaced,
    });
    shapes.push(Shape {
        name: "2k-token Chinese text, escaped (Python's json.dumps)".into(),
        tokens: 2048,
        requests: Kind::Text.requests(2048, quick),
        spec: chinese_text_escaped,
    });
    for kind in Kind::ALL {
        for tokens in LENGTHS {
            shapes.push(Shape {
                name: kind.shape_name(tokens),
                tokens,
                requests: kind.requests(tokens, quick),
                spec: kind.spec(),
            });
        }
    }
    shapes
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
    let stream_line = match streaming(v) {
        Some((streamed, one_piece)) => format!(
            "Streaming: on Envoy's worker threads, where the filter's callbacks run, it adds {streamed:.0} µs to a response \
             streamed in 256 chunks and {one_piece:.0} µs to the same response in one piece, {:+.2} µs a chunk (it releases the \
             prefill at the first chunk and returns at once on the others). The rest of a stream's added CPU is the main \
             thread's and the sidecar's work for bookings and snapshots, which runs per interval, not per request, and \
             weighs more per request at the streams' lower request rate.\n\n",
            (streamed - one_piece) / (CHUNKS - 1) as f64,
        ),
        None => String::new(),
    };
    let cores: String = LONG_PROMPTS
        .iter()
        .filter_map(|name| Some(long_prompt_line(name, &long_prompt(v, name)?)))
        .collect();
    let curve = length_curve(shapes);
    format!(
        "\n### By request shape: streamed responses and long prompts\n\n\
Same Envoy (2 worker threads), plain route against the filter, alternating, closed loop ×{}, medians of {} runs; \
instant simulated workers that hand each token of a stream over as its own write (an SSE event). \
CPU per request includes each process's background (polls, ticks, scrapes, the sidecar indexing the workers' KV events), \
which weighs most on the slow rows (the simulated engine tokenizes long chats); \
added CPU is Envoy's plus the sidecar's, kvgate's route minus the plain one, over the same requests, which takes most of the background off; token prompts are distinct per request \
(no shared prefix: the whole prompt is hashed and looked up). Chat prompts are sized at four bytes a token, kvgate's own estimate.\n\n\
| request | prompt tokens | Envoy CPU µs, plain / kvgate | of it on Envoy's worker threads | sidecar CPU µs, plain / kvgate | added CPU per request | per 1k prompt tokens |\n\
| --- | --- | --- | --- | --- | --- | --- |\n{rows}\n{stream_line}{cores}{curve}",
        f(v, &["concurrency"]),
        f(v, &["runs"]),
    )
}

/// The rows whose routing cost is put in cores for 100k-token prompts.
pub const LONG_PROMPTS: [&str; 2] = ["128k token ids", "128k-token chat text"];

/// Worker-thread CPU µs the filter adds to a response streamed in
/// [`CHUNKS`] chunks, and to the same response in one piece.
pub fn streaming(v: &Value) -> Option<(f64, f64)> {
    let find = |name: &str| shape(v, name);
    Some((
        on_workers(find("streamed response, 256 chunks")?, "kvgate")?,
        on_workers(find("one-piece response, 256 tokens")?, "kvgate")?,
    ))
}

fn shape<'v>(v: &'v Value, name: &str) -> Option<&'v Value> {
    v["shapes"].as_array()?.iter().find(|s| s["shape"] == name)
}

/// What routing a long prompt costs, scaled from its row to 100k tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LongPrompt {
    /// CPU ms routing adds to a request (Envoy and the sidecar, kvgate's
    /// route minus the plain one); below zero when the plain route took
    /// more.
    pub added_ms: f64,
    /// The whole gateway pod's cores for 100 such requests a second.
    pub pod_cores: f64,
}

impl LongPrompt {
    /// Cores the added CPU takes at 100 requests a second.
    pub fn added_cores(&self) -> f64 {
        self.added_ms / 10.0
    }

    /// How many times less than the llm-d router's reported cost.
    pub fn times_less_than_llmd(&self) -> f64 {
        LLMD_CORE_S_PER_100K_REQUEST / (self.added_ms / 1e3)
    }
}

pub fn long_prompt(v: &Value, name: &str) -> Option<LongPrompt> {
    let s = shape(v, name)?;
    let per_1k = s["added_cpu_us_per_1k_tokens"].as_f64()?;
    let tokens = s["prompt_tokens_sent"].as_f64()?;
    let pod_per_1k = (s["kvgate"]["envoy_cpu_us"].as_f64()?
        + s["kvgate"]["sidecar_cpu_us"].as_f64()?)
        / (tokens / 1000.0);
    Some(LongPrompt {
        added_ms: per_1k * 100.0 / 1e3,
        pod_cores: pod_per_1k * 100.0 * 100.0 / 1e6,
    })
}

/// A long prompt's routing cost in words. Added CPU is kvgate's route
/// minus the plain one, and on the text rows the background (the sidecar
/// indexing, the simulated engine tokenizing) can outweigh it: a negative
/// difference says the cost is below the run's noise, not that routing
/// saves CPU, so it is not put as a ratio to anyone's cost.
pub fn long_prompt_line(name: &str, c: &LongPrompt) -> String {
    let pod = format!(
        "the whole gateway pod (Envoy proxying the body too, and the sidecar) needs {:.2} cores",
        c.pod_cores
    );
    if c.added_ms > 0.0 {
        format!(
            "* {name}: routing adds {:.2} ms of CPU per 100k-token request, {:.2} cores at 100 req/s \
             ({:.0}× less than llm-d's reported {LLMD_CORE_S_PER_100K_REQUEST} core-seconds a request); {pod}.\n",
            c.added_ms,
            c.added_cores(),
            c.times_less_than_llmd(),
        )
    } else {
        format!(
            "* {name}: the kvgate route took {:.2} ms less CPU per 100k-token request than the plain one, \
             so what routing adds is below this run's noise (each process's background weighs most on these rows); {pod}.\n",
            -c.added_ms,
        )
    }
}

/// A line fitted through the length curve: (µs per 1k tokens, µs a
/// request).
pub type Line = (f64, f64);

/// The length curve's lines per kind: its label, the line through this
/// build's points, and the baseline build's.
pub fn lines(v: &Value) -> Vec<(&'static str, Option<Line>, Option<Line>)> {
    let Some(shapes) = v["shapes"].as_array() else {
        return Vec::new();
    };
    Kind::ALL
        .iter()
        .map(|&k| {
            (
                k.label(),
                fit(&curve(shapes, k, "kvgate")),
                fit(&curve(shapes, k, "baseline")),
            )
        })
        .collect()
}

/// The filter's own work on a shape: CPU µs a request on Envoy's worker
/// threads, `route` ("kvgate" or "baseline") minus the plain route.
fn on_workers(s: &Value, route: &str) -> Option<f64> {
    let cpu = |r: &str| s[r]["envoy_workers_cpu_us"].as_f64();
    Some(cpu(route)? - cpu("plain")?)
}

/// A kind's length curve on `route`: (prompt tokens in thousands, added
/// worker-thread µs a request), in length order.
fn curve(shapes: &[Value], kind: Kind, route: &str) -> Vec<(f64, f64)> {
    LENGTHS
        .iter()
        .filter_map(|&t| {
            let name = kind.shape_name(t);
            let s = shapes.iter().find(|s| s["shape"] == name.as_str())?;
            Some((t as f64 / 1000.0, on_workers(s, route)?))
        })
        .collect()
}

/// Least squares: the slope (µs per 1k tokens) and the intercept (µs a
/// request whatever its length).
fn fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let slope = sxy / sxx;
    Some((slope, my - slope * mx))
}

/// The length curve's table: per kind and length, the worker threads'
/// added µs a request and per 1k tokens, and the line fitted through them.
fn length_curve(shapes: &[Value]) -> String {
    let baseline = shapes.iter().any(|s| s.get("baseline").is_some());
    let mut rows = String::new();
    for kind in Kind::ALL {
        let points = curve(shapes, kind, "kvgate");
        if points.is_empty() {
            continue;
        }
        let cells: Vec<String> = points
            .iter()
            .map(|(k, us)| format!("{us:.0} ({:.1})", us / k))
            .collect();
        let line = |p: &[(f64, f64)]| match fit(p) {
            Some((slope, fixed)) => format!(
                "{slope:.1} µs per 1k {} {:.0} µs",
                if fixed < -0.5 { "−" } else { "+" },
                fixed.abs()
            ),
            None => "—".into(),
        };
        let old = if baseline {
            format!(" | {}", line(&curve(shapes, kind, "baseline")))
        } else {
            String::new()
        };
        rows.push_str(&format!(
            "| {} | {} | {}{old} |\n",
            kind.label(),
            cells.join(" | "),
            line(&points)
        ));
    }
    let sizes: Vec<String> = LENGTHS.iter().map(|t| format!("{}k", t / 1024)).collect();
    let (old_head, old_rule) = if baseline {
        (" | baseline build's line", " --- |")
    } else {
        ("", "")
    };
    format!(
        "\n**Length curve.** The filter's own work grows with the prompt: CPU µs a request on Envoy's worker threads, \
kvgate's route minus the plain one (in brackets, per 1k prompt tokens), and the line fitted through the five lengths \
(least squares: its slope is the cost per 1k tokens, its intercept the cost of any request). \
Token ids are 4–5 digits, as a real vocabulary's; text is four bytes a token.\n\n\
| prompt | {} | line{old_head} |\n| --- |{} --- |{old_rule}\n{rows}\n\
![length curve](plots/overhead_length_curve.svg)\n",
        sizes.join(" | "),
        " --- |".repeat(sizes.len()),
    )
}

/// The length curve's plot, µs per 1k prompt tokens against the prompt's
/// length: flat is linear.
pub fn plot(v: &Value, dir: &std::path::Path) -> Result<()> {
    let Some(shapes) = v["shapes"].as_array() else {
        return Ok(());
    };
    let mut series = Vec::new();
    for kind in Kind::ALL {
        for (route, suffix) in [("kvgate", ""), ("baseline", ", baseline build")] {
            let points: Vec<(f64, f64)> = curve(shapes, kind, route)
                .into_iter()
                .map(|(k, us)| (k, us / k))
                .collect();
            if !points.is_empty() {
                series.push((format!("{}{suffix}", kind.label()), points));
            }
        }
    }
    let refs: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("overhead_length_curve.svg"),
        plot::lines(
            "Routing on Envoy's worker threads, per 1k prompt tokens",
            "prompt, thousands of tokens",
            "µs per 1k tokens",
            &refs,
            &[("target", 10.0)],
        ),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_prompts_cost_reads_as_what_it_adds_or_as_below_the_noise() {
        let adds = long_prompt_line(
            "128k token ids",
            &LongPrompt {
                added_ms: 1.59,
                pod_cores: 0.43,
            },
        );
        assert!(adds.contains("routing adds 1.59 ms"), "{adds}");
        assert!(adds.contains("0.16 cores at 100 req/s"), "{adds}");
        assert!(adds.contains("(252× less than llm-d's"), "{adds}");

        // The plain route took more: no negative cost, and no ratio to
        // anyone's.
        let below = long_prompt_line(
            "128k-token chat text",
            &LongPrompt {
                added_ms: -3.05,
                pod_cores: 0.36,
            },
        );
        assert!(below.contains("3.05 ms less CPU"), "{below}");
        assert!(below.contains("below this run's noise"), "{below}");
        assert!(!below.contains("-3") && !below.contains('−'), "{below}");
        assert!(!below.contains('×'), "{below}");
        assert!(below.contains("needs 0.36 cores"), "{below}");
    }

    #[test]
    fn the_line_through_a_line_is_itself() {
        let (slope, fixed) = fit(&[(1.0, 12.0), (2.0, 14.0), (128.0, 266.0)]).unwrap();
        assert!((slope - 2.0).abs() < 1e-9 && (fixed - 10.0).abs() < 1e-9);
        assert_eq!(fit(&[(1.0, 1.0)]), None);
    }

    #[test]
    fn the_length_curve_has_a_row_per_kind_with_its_line() {
        let shape = |kind: Kind, t: u64, kvgate: f64| {
            json!({
                "shape": kind.shape_name(t),
                "plain": {"envoy_workers_cpu_us": 100.0},
                "kvgate": {"envoy_workers_cpu_us": 100.0 + kvgate},
            })
        };
        let shapes: Vec<Value> = LENGTHS
            .iter()
            .flat_map(|&t| {
                let k = t as f64 / 1000.0;
                [
                    shape(Kind::TokenIds, t, 20.0 + 8.0 * k),
                    shape(Kind::Chat, t, 30.0 + 4.0 * k),
                ]
            })
            .collect();
        let table = length_curve(&shapes);
        assert!(table.contains("| token ids |"), "{table}");
        assert!(table.contains("8.0 µs per 1k + 20 µs"), "{table}");
        assert!(table.contains("4.0 µs per 1k + 30 µs"), "{table}");
        assert!(
            !table.contains("| text |"),
            "no text rows were measured: {table}"
        );
        assert!(!table.contains("baseline"), "{table}");
        let rules = table.lines().find(|l| l.starts_with("| --- |")).unwrap();
        let header = table.lines().find(|l| l.starts_with("| prompt |")).unwrap();
        assert_eq!(
            rules.matches('|').count(),
            header.matches('|').count(),
            "{table}"
        );

        // Beside a baseline build, its line gets a column of its own.
        let with_old: Vec<Value> = shapes
            .into_iter()
            .map(|mut s| {
                s["baseline"] = json!({"envoy_workers_cpu_us": 150.0});
                s
            })
            .collect();
        let table = length_curve(&with_old);
        let rules = table.lines().find(|l| l.starts_with("| --- |")).unwrap();
        let header = table.lines().find(|l| l.starts_with("| prompt |")).unwrap();
        assert!(header.contains("baseline build's line"), "{table}");
        assert_eq!(
            rules.matches('|').count(),
            header.matches('|').count(),
            "{table}"
        );
        assert!(table.contains("0.0 µs per 1k + 50 µs"), "{table}");

        // A line below zero at no length reads with its minus sign, not
        // as `+ -20`.
        let falling: Vec<Value> = LENGTHS
            .iter()
            .map(|&t| shape(Kind::Text, t, -20.0 + 2.0 * t as f64 / 1000.0))
            .collect();
        let table = length_curve(&falling);
        assert!(table.contains("2.0 µs per 1k − 20 µs"), "{table}");
    }
}
