//! `text`: chat and text prompts routed by the text index (precise text)
//! against the routed-prefix index (approximate) and token prompts
//! (precise tokens), on the same requests.
//!
//! The workers tokenize with the model's real tokenizer (the Llama-3-style
//! fixture of `tests/fixtures/chat`), so their KV events carry the ids an
//! engine would; the token-prompt policy sends exactly those ids.
//!
//! * quality: a chat version of the shared-prefix workload and the
//!   Mooncake trace as text, with caches small enough to evict; hit rates
//!   next to the offline reference ([`crate::replay`]);
//! * cost: the filter's whole decision for a 2k-token chat and the same
//!   words as a text completion, text index against routed-prefix index,
//!   in turns beside the baseline build's with `--baseline`
//!   ([`crate::turns`]); Envoy's and the sidecar's memory with the
//!   tokenizer loaded.

use crate::build;
use crate::quality::{WORKERS, dictionary, fleet_config, reset, sims, summarize, words};
use anyhow::{Context, Result};
use bytes::Bytes;
use kvgate_load::workload::{SharedPrefix, mooncake, shared_prefix};
use kvgate_load::{RequestSpec, Target, run_open_loop};
use kvgate_sim::tokenizer::RealText;
use kvgate_stack::{Stack, StackConfig};
use serde_json::{Value, json};
use std::path::PathBuf;

const MODEL: &str = "demo-model";
const POLICIES: [&str; 3] = ["approximate", "precise_text", "precise_token"];

fn fixture(name: &str) -> PathBuf {
    crate::repo().join("tests/fixtures/chat").join(name)
}

fn tokenizer_files() -> (PathBuf, PathBuf) {
    (
        fixture("llama3-style.tokenizer.json"),
        fixture("llama3-style.tokenizer_config.json"),
    )
}

/// One request in the three shapes the policies send.
struct Triple {
    text: RequestSpec,
    tokens: RequestSpec,
    ids: Vec<u32>,
}

fn with_body(spec: &RequestSpec, path: &str, body: Value) -> RequestSpec {
    RequestSpec {
        path: path.into(),
        body: Bytes::from(body.to_string()),
        ..spec.clone()
    }
}

fn prompt_of(spec: &RequestSpec) -> (Vec<u32>, Value) {
    let v: Value = serde_json::from_slice(&spec.body).unwrap_or(Value::Null);
    let p = v["prompt"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_u64().map(|t| t as u32))
        .collect();
    (p, v)
}

/// The shared-prefix workload as chats: the group's prefix is the system
/// prompt, the question the user message.
fn chat_shared_prefix(
    specs: &[RequestSpec],
    prefix_tokens: usize,
    dict: &[String],
    real: &RealText,
) -> Result<Vec<Triple>> {
    specs
        .iter()
        .map(|s| {
            let (p, v) = prompt_of(s);
            let (sys, q) = p.split_at(prefix_tokens.min(p.len()));
            let chat = json!({
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": words(sys, dict)},
                    {"role": "user", "content": words(q, dict)},
                ],
                "max_tokens": v["max_tokens"],
                "stream": true,
                "chat_template_kwargs": {"date_string": "26 Jul 2024"},
            });
            let ids = real.chat(&chat, 0).map_err(anyhow::Error::msg)?;
            let tokens = json!({"model": MODEL, "prompt": ids, "max_tokens": v["max_tokens"], "stream": true});
            Ok(Triple {
                text: with_body(s, "/v1/chat/completions", chat),
                tokens: with_body(s, "/v1/completions", tokens),
                ids,
            })
        })
        .collect()
}

/// The Mooncake trace as text completions: each 512-token hash block
/// becomes the same words wherever it recurs.
fn text_trace(specs: &[RequestSpec], dict: &[String], real: &RealText) -> Result<Vec<Triple>> {
    specs
        .iter()
        .map(|s| {
            let (p, v) = prompt_of(s);
            let text = words(&p, dict);
            let ids = real.prompt(&text).map_err(anyhow::Error::msg)?;
            let max = v["max_tokens"].as_u64().unwrap_or(1).min(32);
            Ok(Triple {
                text: with_body(
                    s,
                    "/v1/completions",
                    json!({"model": MODEL, "prompt": text, "max_tokens": max, "stream": true}),
                ),
                tokens: with_body(
                    s,
                    "/v1/completions",
                    json!({"model": MODEL, "prompt": ids, "max_tokens": max, "stream": true}),
                ),
                ids,
            })
        })
        .collect()
}

/// KV blocks a worker needs so that no request is refused as too long:
/// its longest prompt and `output_tokens`, in 16-token blocks, rounded up
/// to a multiple of 1024 and at least 4096.
fn fitting_blocks(requests: &[Triple], output_tokens: usize) -> u32 {
    let longest = requests.iter().map(|t| t.ids.len()).max().unwrap_or(0);
    let need = (longest + output_tokens).div_ceil(16);
    need.div_ceil(1024).max(4) as u32 * 1024
}

struct Workload {
    name: &'static str,
    describe: String,
    kv_blocks: u32,
    prefill_us_per_token: u32,
    rate: f64,
    time_scale: f64,
    requests: Vec<Triple>,
}

fn workloads(quick: bool) -> Result<Vec<Workload>> {
    let dict = dictionary()?;
    let (tok, cfg) = tokenizer_files();
    let real = RealText::load(&tok, Some(&cfg), None)?;
    let (groups, per_group, rate) = if quick {
        (24, 12, 30.0)
    } else {
        (48, 16, 40.0)
    };
    let prefix_tokens = 1536;
    let specs = shared_prefix(
        MODEL,
        SharedPrefix {
            groups,
            per_group,
            prefix_tokens,
            question_tokens: 96,
            output_tokens: 16,
            rate,
        },
        42,
    );
    let chat = Workload {
        name: "chat_shared_prefix",
        describe: format!(
            "{groups} groups × {per_group} chats: a {prefix_tokens}-word system prompt shared by the group, a 96-word question, Llama-3-style template, 16 output tokens, Poisson arrivals"
        ),
        // A group's prompt is about 105 blocks (a token a word): eight
        // workers hold about three groups each, so the quick run's 24
        // groups fit and the full run's 48 are twice what the fleet holds.
        kv_blocks: 320,
        prefill_us_per_token: 50,
        rate,
        time_scale: 1.0,
        requests: chat_shared_prefix(&specs, prefix_tokens, &dict, &real)?,
    };
    let mut out = vec![chat];
    let path = std::env::var_os("KVGATE_MOONCAKE_TRACE")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::repo().join("../shared/data/mooncake/conversation_trace.jsonl"));
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let n = if quick { 300 } else { 600 };
            let trace = mooncake(&text, MODEL, n, 512).map_err(anyhow::Error::msg)?;
            let requests = text_trace(&trace, &dict, &real)?;
            let span = trace.last().map_or(1.0, |s| s.at.as_secs_f64()).max(1.0);
            let rate = 8.0;
            out.push(Workload {
                name: "mooncake_text",
                describe: format!(
                    "first {n} requests of the Mooncake conversation trace as text completions (a word per trace token, each 512-token hash block the same words wherever it recurs), outputs capped at 32 tokens"
                ),
                // Room for the longest prompt (a token a word, so the
                // trace's longest need some 8k blocks) and little more:
                // the fleet holds a fraction of the trace's prompts, and
                // returning conversations find theirs evicted unless
                // routing keeps them together.
                kv_blocks: fitting_blocks(&requests, 32),
                prefill_us_per_token: 25,
                rate,
                time_scale: (trace.len() as f64 / span) / rate,
                requests,
            });
        }
        Err(_) => eprintln!(
            "xtask: bench text: no Mooncake trace at {} (set KVGATE_MOONCAKE_TRACE); chat workload only",
            path.display()
        ),
    }
    Ok(out)
}

/// Eight workers with the real tokenizer; the sidecar has the model's
/// prompt files only when `text_index`.
fn fleet(w: &Workload, text_index: bool) -> Result<Stack> {
    let (tok, cfg) = tokenizer_files();
    Stack::start_with(
        build::release_paths()?,
        fleet_config(w.kv_blocks, w.prefill_us_per_token).with_prompt_files(&tok, &cfg, text_index),
    )
}

fn quality(w: &Workload, rt: &tokio::runtime::Runtime) -> Result<Value> {
    let ids: Vec<Vec<u32>> = w.requests.iter().map(|t| t.ids.clone()).collect();
    let reference = crate::replay::replay(&ids, WORKERS, w.kv_blocks as usize, 16);
    let mut policies = serde_json::Map::new();
    for (text_index, names) in [(false, &POLICIES[..1]), (true, &POLICIES[1..])] {
        let stack = fleet(w, text_index)?;
        for policy in names {
            eprintln!(
                "xtask: bench text: {} at {} req/s, {policy} ({} requests)",
                w.name,
                w.rate,
                w.requests.len()
            );
            reset(&stack)?;
            let specs: Vec<RequestSpec> = w
                .requests
                .iter()
                .map(|t| {
                    if *policy == "precise_token" {
                        t.tokens.clone()
                    } else {
                        t.text.clone()
                    }
                })
                .collect();
            let before = sims(&stack);
            let outcomes = rt.block_on(run_open_loop(
                &Target::new(stack.envoy_url()),
                &specs,
                w.time_scale,
            ));
            let after = sims(&stack);
            let mut v = summarize(&outcomes, &before, &after, WORKERS);
            v["of_reference"] =
                json!(v["hit_rate"].as_f64().unwrap_or(0.0) / reference.reference.max(1e-9));
            policies.insert((*policy).into(), v);
        }
    }
    Ok(json!({
        "name": w.name,
        "describe": w.describe,
        "kv_blocks_per_worker": w.kv_blocks,
        "rate_per_s": w.rate,
        "reference_hit_rate": reference.reference,
        "reference_floor_blocks": reference.floor.0,
        "reference_floor_fraction": (reference.floor.1 != usize::MAX).then_some(reference.floor.1),
        "ideal_hit_rate": reference.ideal,
        "policies": policies,
    }))
}

/// The whole decision for a 2k-token chat and the same words as a text
/// completion, and memory, with and without the text index: the same
/// requests on two otherwise equal stacks, each request kind in turns
/// against the baseline build when there is one ([`crate::turns`]).
fn cost(
    quick: bool,
    baseline: Option<&std::path::Path>,
    rt: &tokio::runtime::Runtime,
) -> Result<Value> {
    let dict = dictionary()?;
    let (n, reps) = crate::turns::size(quick);
    let (tok, cfg) = tokenizer_files();
    let real = RealText::load(&tok, Some(&cfg), None)?;
    let system: Vec<u32> = (0..1950u32)
        .map(|i| i.wrapping_mul(2_654_435_761) >> 7)
        .collect();
    let system = words(&system, &dict);
    let chat = |i: usize| {
        json!({
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question {i}: which worker holds this prefix?")},
            ],
            "max_tokens": 1,
        })
    };
    let text = |i: usize| {
        json!({
            "model": MODEL,
            "prompt": format!("{system} question {i}: which worker holds this prefix?"),
            "max_tokens": 1,
        })
    };
    let kinds = [
        (
            "chat",
            crate::turns::paced("/v1/chat/completions", (0..n).map(chat)),
        ),
        (
            "text",
            crate::turns::paced("/v1/completions", (0..n).map(text)),
        ),
    ];
    let prompt_tokens = real.chat(&chat(0), 0).map_err(anyhow::Error::msg)?.len();
    let mut out = serde_json::Map::new();
    for (name, text_index) in [("approximate", false), ("precise_text", true)] {
        eprintln!(
            "xtask: bench text: decision cost, {name} ({reps} turns of {n} requests, chat and text, {prompt_tokens} tokens)"
        );
        let stack = Stack::start_with(
            build::release_paths()?,
            StackConfig {
                workers: 4,
                kv_events: true,
                sim_args: vec!["--instant".into()],
                envoy_concurrency: 2,
                plugin: json!({"max_body_bytes": 4 << 20}),
                baseline_wasm: baseline.map(std::path::Path::to_path_buf),
                ..StackConfig::default()
            }
            .with_prompt_files(&tok, &cfg, text_index),
        )?;
        let listeners = crate::turns::listeners(&stack, baseline.is_some());
        // The workers tokenize each prompt once (2k tokens: milliseconds
        // of CPU on the cores Envoy runs on), then answer from their memo:
        // the turns send the same prompts again.
        stack.deprioritize_workers()?;
        let mut policy = serde_json::Map::new();
        for (kind, specs) in &kinds {
            policy.insert(
                (*kind).into(),
                crate::turns::decision(&stack, rt, &listeners, specs, reps)?,
            );
        }
        policy.insert(
            "rendered".into(),
            json!(
                stack
                    .envoy_stat("kvgate_prompts_rendered_total")
                    .unwrap_or(0)
            ),
        );
        policy.insert(
            "envoy_rss_mb".into(),
            json!(stack.envoy_rss().map(|b| b as f64 / 1048576.0)),
        );
        policy.insert(
            "sidecar_rss_mb".into(),
            json!(stack.sidecar_rss().map(|b| b as f64 / 1048576.0)),
        );
        out.insert(name.into(), Value::Object(policy));
    }
    Ok(json!({"prompt_tokens": prompt_tokens, "requests_per_turn": n, "policies": out}))
}

/// `baseline`: another build of the filter, whose decision cost is
/// measured beside this one's.
pub fn run(quick: bool, baseline: Option<&std::path::Path>) -> Result<Value> {
    let rt = tokio::runtime::Runtime::new()?;
    let cost = cost(quick, baseline, &rt).context("decision cost")?;
    let mut out = Vec::new();
    for w in workloads(quick)? {
        out.push(quality(&w, &rt).with_context(|| w.name)?);
    }
    Ok(json!({"name": "text", "workers": WORKERS, "cost": cost, "workloads": out}))
}

pub fn report(v: &Value) -> String {
    let c = &v["cost"];
    let m = |policy: &str, k: &str| c["policies"][policy][k].as_f64().unwrap_or(f64::NAN);
    let rows: Vec<(String, &Value)> = [
        ("chat", "approximate"),
        ("chat", "precise_text"),
        ("text", "approximate"),
        ("text", "precise_text"),
    ]
    .into_iter()
    .map(|(kind, policy)| {
        let index = if policy == "approximate" {
            "approximate index"
        } else {
            "precise text index"
        };
        (format!("{kind}, {index}"), &c["policies"][policy][kind])
    })
    .collect();
    let mut md = format!(
        "\n## Text and chat prompts\n\nChat and text prompts matched against the engines' KV events through the text index (`precise_text`; `docs/text-routing.md`), against the routed-prefix index (`approximate`, what models without prompt files get) and against token prompts of the same requests (`precise_token`). The workers tokenize with the Llama-3-style fixture tokenizer, so their events carry the ids a vLLM would.\n\n\
Decision cost: a chat of {} tokens (a system prompt and a question) and the same words as a text completion, in turns of {} requests, paced at {} a second (the VM idle between requests) and back to back on one connection (the VM warm) (Envoy histogram `kvgate_decision_us`, 2 Envoy workers, V8 tiered up by a warm-up turn; the simulated workers, on the same two cores at nice 19, tokenize each prompt once and then answer from a memo), {} turns of each per listener, medians with their spread:\n\n{}\n\
Memory after the run: Envoy {:.0} MB with the text index, {:.0} MB without; sidecar {:.0} MB with the tokenizer's vocabulary, {:.0} MB without.\n",
        c["prompt_tokens"],
        c["requests_per_turn"],
        crate::turns::RATE,
        c["policies"]["approximate"]["chat"]["kvgate"]["paced"]["turns"],
        crate::turns::table(&rows),
        m("precise_text", "envoy_rss_mb"),
        m("approximate", "envoy_rss_mb"),
        m("precise_text", "sidecar_rss_mb"),
        m("approximate", "sidecar_rss_mb"),
    );
    for w in v["workloads"].as_array().into_iter().flatten() {
        md.push_str(&format!(
            "\n### {}: {} ({} KV blocks per worker, {} req/s)\n\nReference (perfect knowledge, offline replay through the same caches, best cold floor {} blocks{}): {:.1} % hit rate; unbounded cache: {:.1} %.\n\n| policy | hit rate | of reference | TTFT p50 / p90 / p99 (ms) | load max / min |\n| --- | --- | --- | --- | --- |\n",
            w["name"].as_str().unwrap_or("?"),
            w["describe"].as_str().unwrap_or(""),
            w["kv_blocks_per_worker"],
            w["rate_per_s"],
            w["reference_floor_blocks"],
            w["reference_floor_fraction"]
                .as_u64()
                .map_or(String::new(), |f| format!(" or 1/{f} of the prompt")),
            100.0 * w["reference_hit_rate"].as_f64().unwrap_or(f64::NAN),
            100.0 * w["ideal_hit_rate"].as_f64().unwrap_or(f64::NAN),
        ));
        for policy in POLICIES {
            let p = &w["policies"][policy];
            let f = |a: &str, b: &str| p[a][b].as_f64().unwrap_or(f64::NAN);
            md.push_str(&format!(
                "| {policy} | {:.1} % | {:.0} % | {:.0} / {:.0} / {:.0} | {} / {} |\n",
                100.0 * p["hit_rate"].as_f64().unwrap_or(f64::NAN),
                100.0 * p["of_reference"].as_f64().unwrap_or(f64::NAN),
                f("ttft_ms", "p50"),
                f("ttft_ms", "p90"),
                f("ttft_ms", "p99"),
                p["max_min_load"]["max"],
                p["max_min_load"]["min"],
            ));
        }
    }
    md
}
