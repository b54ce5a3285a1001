//! The split fleets: one disaggregated model on 16 workers, 8 prefill
//! and 8 decode, once with vLLM's NIXL protocol and once with SGLang's,
//! with the aggregated fleet's token index, text index and template.
//!
//! A split request's decision is more than where it went: the decode
//! destination and rank, the prefill callout's target and rank, and what
//! the decode leg carries from the prefill (NIXL: the answer's transfer
//! parameters, and that the request resumed; SGLang: the bootstrap
//! server). Every callout is answered before the stream ends, so no
//! booking outlives its request and the next request sees the fleet as
//! the previous one did.

use super::{Kind, Side, WORKERS, body_at, frame_of};
use kvgate_core::header::{DESTINATION, RANK, REASON};
use kvgate_core::state::{Disaggregation, OnPrefillFailure, Protocol, Role};
use kvgate_core::text::template::PromptTemplate;
use kvgate_core::{ModelState, RankLoad, Snapshot, WorkerState};
use kvgate_tests::host::{Callout, Cost};
use serde_json::{Value, json};

const MODEL: &str = "pd";
/// Workers below this index prefill; the rest decode.
const PREFILL: u16 = 8;
/// Every worker's data-parallel ranks: both legs name theirs.
const RANKS: u32 = 2;

pub const FLEET: &str =
    "16 workers of 2 ranks, 8 prefill and 8 decode, each holding its prefixes on rank 0";

/// Rank `r` of worker `w`: unique per (worker, rank), as the sidecar
/// assigns slots.
fn slot(w: u16, r: u32) -> u16 {
    w * 4 + r as u16
}

/// Loads that differ from rank to rank, so that no choice is a tie the
/// tie-break settles.
fn worker(w: u16, protocol: Protocol) -> WorkerState {
    let prefill = w < PREFILL;
    let ranks = (0..RANKS)
        .map(|r| {
            let mix = (u64::from(w) * 7 + u64::from(r) * 3) % 8;
            RankLoad {
                rank: r,
                slot: slot(w, r),
                kv_total_blocks: 200_000,
                active_prefill_tokens: if prefill { 256 * mix } else { 0 },
                active_decode_blocks: if prefill { 0 } else { 20 * (mix + 1) },
                ..Default::default()
            }
        })
        .collect();
    WorkerState {
        id: u64::from(w) + 1,
        endpoint: format!("10.0.0.{}:8000", w + 1),
        block_size: 16,
        ranks,
        tenant: "default".into(),
        thermal: Default::default(),
        draining: false,
        role: if prefill { Role::Prefill } else { Role::Decode },
        bootstrap_port: if prefill && protocol == Protocol::Sglang {
            9100 + w
        } else {
            0
        },
        fits: None,
        topology: Default::default(),
    }
}

fn snapshot(protocol: Protocol, t: &PromptTemplate) -> Snapshot {
    Snapshot {
        version: 1,
        built_at_ms: 1,
        models: vec![ModelState {
            name: MODEL.into(),
            shard_count: 4096,
            prompt_template: t.version(),
            workers: (0..WORKERS).map(|w| worker(w, protocol)).collect(),
            disaggregation: Some(Disaggregation {
                protocol,
                on_prefill_failure: OnPrefillFailure::Local,
                ..Disaggregation::default()
            }),
            ..Default::default()
        }],
        applied: Vec::new(),
    }
}

/// The split fleet's first update: its snapshot and every shard.
pub fn frame(protocol: Protocol, blocks_per_worker: usize, t: &PromptTemplate) -> Vec<u8> {
    frame_of(&snapshot(protocol, t), MODEL, blocks_per_worker, t, |w| {
        slot(w, 0)
    })
}

/// What the requests of a split row look like, and who holds their
/// first 2k tokens.
#[derive(Debug, Clone, Copy)]
pub enum Shape {
    TokensOnPrefill,
    /// The decode worker holds the prefix: a short prompt is computed
    /// where it is decoded (NIXL), a long one still goes to a prefill
    /// worker.
    TokensOnDecode,
    ChatOnPrefill,
}

impl Shape {
    pub const ALL: [Shape; 3] = [
        Shape::TokensOnPrefill,
        Shape::TokensOnDecode,
        Shape::ChatOnPrefill,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Shape::TokensOnPrefill => "token ids, prefix on a prefill worker",
            Shape::TokensOnDecode => "token ids, prefix on a decode worker",
            Shape::ChatOnPrefill => "chat, precise, prefix on a prefill worker",
        }
    }

    /// Request `i` of `n` prompt tokens.
    pub fn body(self, n: usize, i: usize) -> (&'static str, String) {
        let kind = match self {
            Shape::ChatOnPrefill => Kind::Chat,
            _ => Kind::Tokens,
        };
        let nth = (i % usize::from(PREFILL)) as u16;
        let holder = match self {
            Shape::TokensOnDecode => PREFILL + nth,
            _ => nth,
        };
        body_at(kind, n, i, holder, MODEL)
    }
}

/// Sends one request of the split model, answers its prefill callout and
/// ends its stream; returns its decision, what the whole exchange cost
/// (the answer's callback included) and its phase samples.
pub fn request(
    side: &mut Side,
    protocol: Protocol,
    path: &str,
    body: &str,
    i: usize,
    n: usize,
) -> (Value, Cost, Value) {
    let headers = [(":method", "POST"), (":path", path), (":authority", "gw")];
    let vm = &mut side.router;
    let (ex, ctx) = vm.open(&headers, &[body.as_bytes()]);
    assert!(ex.trapped.is_none(), "{:?}\n{}", ex.trapped, vm.logs());
    let calls = callouts(&vm.pending(), ctx);
    assert!(calls.len() <= 1, "one prefill leg at a time: {calls:?}");
    let call = calls.first();
    let mut d = json!({
        "paused": !ex.continued && ex.reply.is_none(),
        "prefill": call.and_then(|c| c.header(":authority")),
        "prefill_rank": call.and_then(|c| c.header(RANK)),
    });
    if let Some(c) = call {
        let answer = match protocol {
            Protocol::VllmNixl => nixl_answer(c, i, n),
            Protocol::Sglang => sglang_answer(i),
        };
        vm.respond(
            c.token,
            200,
            &[("content-type", "application/json")],
            &answer,
        )
        .expect("the prefill answer is taken");
    }
    let s = vm.stream(ctx).expect("the stream is open").clone();
    d["reply"] = json!(s.reply.as_ref().map(|r| format!(
        "{} {}",
        r.status,
        r.header(REASON).unwrap_or_default()
    )));
    d["destination"] = json!(s.header(DESTINATION));
    d["rank"] = json!(s.header(RANK));
    // A second try would mean the answer was not taken as a success.
    d["callouts_left"] = json!(callouts(&vm.pending(), ctx).len());
    let sent: Value = serde_json::from_slice(&s.body).unwrap_or(Value::Null);
    match protocol {
        Protocol::VllmNixl => {
            d["resumes"] = json!(s.resumes);
            d["kv_transfer_params"] = json!(sent.get("kv_transfer_params"));
        }
        // The room is drawn at random: only where it leads is a decision.
        Protocol::Sglang => {
            d["bootstrap"] = json!([sent.get("bootstrap_host"), sent.get("bootstrap_port")]);
        }
    }
    vm.finish(ctx);
    assert!(vm.trapped.is_none(), "{:?}\n{}", vm.trapped, vm.logs());
    let cost = vm.take_cost();
    (d, cost, side.phases())
}

fn callouts(pending: &[Callout], ctx: i32) -> Vec<Callout> {
    pending
        .iter()
        .filter(|c| c.context == ctx)
        .cloned()
        .collect()
}

/// A prefill answer as vLLM's NixlConnector gives it: the prompt's
/// blocks (a 16-token block each) on the worker that computed them.
fn nixl_answer(call: &Callout, i: usize, n: usize) -> Vec<u8> {
    let host = call
        .header(":authority")
        .and_then(|a| a.split(':').next())
        .unwrap_or_default();
    let blocks: Vec<usize> = (0..n.div_ceil(16)).map(|b| i * 10_000 + b).collect();
    json!({
        "id": format!("cmpl-{i}"),
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "x", "logprobs": null, "finish_reason": "length"}],
        "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
        "kv_transfer_params": {
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": blocks,
            "remote_engine_id": format!("engine-{host}"),
            "remote_host": host,
            "remote_port": 5600,
            "tp_size": 1,
        },
    })
    .to_string()
    .into_bytes()
}

/// An SGLang prefill worker's answer: the filter only drains it.
fn sglang_answer(i: usize) -> Vec<u8> {
    json!({
        "id": format!("cmpl-{i}"),
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
    })
    .to_string()
    .into_bytes()
}
