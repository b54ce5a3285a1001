//! Decision cost of a chat prompt inside the filter: the real `.wasm` in the
//! wasmtime host, 16 workers, 2k-token chats (the Llama-3-style fixture
//! template) whose rendered system prompt one worker holds.
//!
//! Two runs on the same requests: `approximate` (the snapshot names no
//! template: the routed-prefix index, as for a model without prompt files)
//! and `precise_text` (template published, text index filled as the
//! sidecar fills it from KV events). Prints one JSON object; the
//! difference of the medians is what rendering and the text index add.

use kvgate_core::Snapshot;
use kvgate_core::hash::CacheScope;
use kvgate_core::shard::{Holder, TIER_DEVICE, encode, shard_of};
use kvgate_core::text::template::{PromptTemplate, Renderer};
use kvgate_core::text::{self, prefix_keys};
use kvgate_core::update;
use kvgate_tests::fixture_template;
use kvgate_tests::host::{Filter, Shared, Vm};
use kvgate_tests::{bench_snapshot, filter_wasm};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Instant;

const WORKERS: u16 = 16;
const REQUESTS: usize = 2000;

fn template(family: &str) -> PromptTemplate {
    fixture_template(family)
}

const FAMILIES: [&str; 2] = ["llama3-style", "qwen-style"];

/// About 1,900 tokens of system prompt, distinct per worker.
fn system(worker: u16) -> String {
    (0..1500u32)
        .map(|i| {
            let w = (i.wrapping_mul(2_654_435_761) ^ u32::from(worker) << 20) >> 7;
            format!("w{}", w % 5000)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn chat(worker: u16, i: usize) -> Value {
    json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": system(worker)},
            {"role": "user", "content": format!("question {i}: which worker holds this prefix?")},
        ],
        "max_tokens": 1,
        "chat_template_kwargs": {"date_string": "26 Jul 2024"},
    })
}

fn snapshot(template_version: u64) -> Snapshot {
    let mut s = bench_snapshot(WORKERS, 4096);
    s.models[0].prompt_template = template_version;
    s
}

/// The text index as the sidecar publishes it: worker `w` holds every
/// full chunk of its rendered system prompt.
fn text_index(t: &PromptTemplate) -> Vec<(String, u32, Vec<u8>)> {
    let r = Renderer::new(t.clone()).expect("template compiles");
    let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
    for w in 0..WORKERS {
        let c = chat(w, 0);
        let rendered = r
            .chat(
                &c["messages"],
                None,
                c["chat_template_kwargs"].as_object(),
                0,
            )
            .expect("renders");
        let sys_end = rendered.find("question 0").expect("question in the prompt");
        for k in prefix_keys(&rendered[..sys_end], CacheScope::default()) {
            per_shard
                .entry(shard_of(k, text::SHARDS))
                .or_default()
                .push((
                    k,
                    vec![Holder {
                        slot: w,
                        tiers: TIER_DEVICE,
                    }],
                ));
        }
    }
    let ns = text::index_key("m");
    let mut out: Vec<(String, u32, Vec<u8>)> = per_shard
        .into_iter()
        .map(|(s, mut e)| (ns.clone(), s, encode(&mut e)))
        .collect();
    out.push((text::template_key("m"), 0, t.encode()));
    out
}

struct Run {
    times: Vec<f64>,
    holder_chosen: usize,
}

fn run(template: Option<&PromptTemplate>, bodies: &[(u16, String)]) -> Run {
    let filter = Filter::load(&filter_wasm()).expect("filter module");
    let shared = Shared::new();
    let mut svc =
        Vm::start(&filter, &shared, "kvgate", "kvgate_snapshot_service", "").expect("service VM");
    let snap = snapshot(template.map_or(0, PromptTemplate::version))
        .encode()
        .expect("snapshot");
    let shards = template.map(text_index).unwrap_or_default();
    let frame = update::encode(
        1,
        1,
        true,
        Some(&snap),
        shards
            .iter()
            .map(|(ns, s, b)| (ns.as_str(), *s, b.as_slice())),
    );
    let token = svc.pending().pop().expect("poll").token;
    svc.respond(token, 200, &[], &frame)
        .expect("update applied");
    let mut vm = Vm::start(
        &filter,
        &shared,
        "kvgate",
        "kvgate_router",
        r#"{"max_body_bytes": 4194304}"#,
    )
    .expect("router VM");
    let headers = [(":method", "POST"), (":path", "/v1/chat/completions")];
    let mut times = Vec::with_capacity(bodies.len());
    let mut holder_chosen = 0;
    for (w, body) in bodies {
        let t = Instant::now();
        let ex = vm.request(&headers, &[body.as_bytes()]);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        assert!(
            ex.continued,
            "{:?} {:?}\n{}",
            ex.reply,
            ex.trapped,
            vm.logs()
        );
        let want = format!("10.0.0.{}:8000", w + 1);
        let chosen = ex
            .header("x-gateway-destination-endpoint")
            .and_then(|d| d.split(',').next());
        if chosen == Some(want.as_str()) {
            holder_chosen += 1;
        }
    }
    Run {
        times,
        holder_chosen,
    }
}

fn pct(v: &mut [f64], p: usize) -> f64 {
    v.sort_by(f64::total_cmp);
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn main() {
    let bodies: Vec<(u16, String)> = (0..REQUESTS)
        .map(|i| {
            let w = (i % WORKERS as usize) as u16;
            (w, chat(w, i).to_string())
        })
        .collect();
    let mut approx = run(None, &bodies);
    let a50 = pct(&mut approx.times, 50);
    let mut out = json!({
        "name": "text_decision",
        "workers": WORKERS,
        "requests": REQUESTS,
        "body_bytes": bodies[0].1.len(),
        "approximate_us": {"p50": a50, "p99": pct(&mut approx.times, 99)},
        "holder_chosen": {"approximate": approx.holder_chosen},
    });
    for family in FAMILIES {
        let t = template(family);
        let c = chat(0, 0);
        let rendered = Renderer::new(t.clone())
            .expect("template compiles")
            .chat(
                &c["messages"],
                None,
                c["chat_template_kwargs"].as_object(),
                0,
            )
            .expect("renders");
        let mut precise = run(Some(&t), &bodies);
        let p50 = pct(&mut precise.times, 50);
        out[family] = json!({
            "rendered_bytes": rendered.len(),
            "precise_text_us": {"p50": p50, "p99": pct(&mut precise.times, 99)},
            "added_us_p50": p50 - a50,
        });
        out["holder_chosen"][family] = json!(precise.holder_chosen);
    }
    println!("{out}");
}
