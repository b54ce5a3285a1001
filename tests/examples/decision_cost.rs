//! The decision's cost in counts, not time: the real `.wasm` in the
//! wasmtime host, metered, over 16 workers with a token index (100k blocks
//! a worker), a text index and the Llama-3-style fixture template, for
//! prompts of 1k to 128k tokens sent as token ids, as text, and as chats
//! matched precisely (text index) or approximately (a model without a
//! template). Each prompt's first 2k tokens are one worker's cached prefix;
//! the rest is its own.
//!
//! Per request: fuel (about one unit per wasm instruction) over all its
//! callbacks, the filter's own phase histograms in thousands of fuel units
//! (the host's clock runs on fuel, see `HostState::fuel_clock`), host calls
//! by kind, and bytes copied into the VM by kind. These do not move with
//! the machine's load, so two builds compare exactly.
//!
//! Every measured request follows an update of the index, so it reads its
//! shards; a VM keeps a shard read twice until the next update, and what
//! a request saves when earlier ones of the same update read its shards
//! is measured on its own (`shards_held_2k`).
//!
//! The same is measured on split fleets (`split`): a disaggregated model
//! with vLLM's NIXL protocol and one with SGLang's, each request's
//! prefill callout answered, its cost counted with the request's.
//!
//! `--baseline PATH` runs another build of the filter on the same requests
//! beside it and checks every request was decided alike: the same workers,
//! and on a split fleet the same legs, ranks and transfer; a difference
//! is printed and the run exits non-zero. `--quick` builds a smaller
//! index and measures fewer requests. Prints one JSON object on stdout
//! and a table on stderr.

use kvgate_core::hash::{CacheScope, XXH3_SEED, block_hashes, sequence_hashes};
use kvgate_core::header::DESTINATION;
use kvgate_core::shard::{Holder, TIER_DEVICE, encode, shard_of};
use kvgate_core::state::Protocol;
use kvgate_core::text::template::{PromptTemplate, Renderer};
use kvgate_core::text::{self, prefix_keys};
use kvgate_core::{Snapshot, update};
use kvgate_tests::bench_snapshot;
use kvgate_tests::fixture_template;
use kvgate_tests::host::{Cost, Filter, Shared, Vm};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::PathBuf;

// Beside the example, not among `examples/*.rs`, which Cargo would take
// for an example of its own.
#[path = "decision_cost/split.rs"]
mod split;

const WORKERS: u16 = 16;
/// Tokens of each worker's cached prefix chains.
const CHAIN_TOKENS: usize = 2048;
const SIZES: [usize; 5] = [1024, 2048, 8192, 32_768, 131_072];

#[derive(Debug, Clone, Copy)]
enum Kind {
    Tokens,
    /// As Python's `json.dumps` writes them, a space after each comma: what
    /// `requests` and `aiohttp` send.
    TokensSpaced,
    Text,
    /// Chinese text, each character escaped as Python's `json.dumps`
    /// writes it (`\u4f60`): no worker holds it.
    TextEscaped,
    Chat,
    /// The same chat, each content a list of one text part, as agent
    /// frameworks send it.
    ChatParts,
    ChatApproximate,
}

impl Kind {
    const ALL: [Kind; 7] = [
        Kind::Tokens,
        Kind::TokensSpaced,
        Kind::Text,
        Kind::TextEscaped,
        Kind::Chat,
        Kind::ChatParts,
        Kind::ChatApproximate,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Tokens => "token ids",
            Kind::TokensSpaced => "token ids, spaced",
            Kind::Text => "text",
            Kind::TextEscaped => "Chinese text, escaped",
            Kind::Chat => "chat, precise",
            Kind::ChatParts => "chat of text parts, precise",
            Kind::ChatApproximate => "chat, approximate",
        }
    }
}

fn template() -> PromptTemplate {
    fixture_template("llama3-style")
}

/// Worker `w`'s cached chain `c` of token ids.
fn chain(w: u16, c: usize) -> Vec<u32> {
    let base = u32::from(w) << 24 | (c as u32) << 8;
    (0..CHAIN_TOKENS as u32)
        .map(|i| base.wrapping_add(i * 7919) % 150_000 + u32::from(w) * 150_000)
        .collect()
}

/// About 2k tokens (four bytes each) of worker `w`'s system prompt.
fn system(w: u16) -> String {
    let mut s = String::new();
    let mut i = 0u32;
    while s.len() < CHAIN_TOKENS * 4 {
        let x = (i.wrapping_mul(2_654_435_761) ^ u32::from(w) << 20) >> 7;
        s.push_str(&format!("w{} ", x % 5000));
        i += 1;
    }
    s.truncate(CHAIN_TOKENS * 4);
    s
}

/// Words of request `i`'s own, up to `bytes`.
fn filler(i: usize, bytes: usize) -> String {
    const WORDS: [&str; 8] = [
        "routing ", "prefix ", "cache ", "worker ", "token ", "block ", "engine ", "gateway ",
    ];
    let mut s = format!("Request {i}. ");
    let mut x = i;
    while s.len() < bytes {
        s.push_str(WORDS[x % WORDS.len()]);
        x = x.wrapping_mul(31).wrapping_add(7);
    }
    s.truncate(bytes);
    s
}

const KWARGS: &str = "26 Jul 2024";

/// Request `i` of `kind` with `n` prompt tokens; worker `i % WORKERS` holds
/// its first 2k tokens.
fn body(kind: Kind, n: usize, i: usize) -> (&'static str, String) {
    let model = if matches!(kind, Kind::ChatApproximate) {
        "a"
    } else {
        "m"
    };
    body_at(kind, n, i, (i % WORKERS as usize) as u16, model)
}

/// Request `i` of `kind` for `model` with `n` prompt tokens, whose first
/// 2k tokens worker `w` holds.
fn body_at(kind: Kind, n: usize, i: usize, w: u16, model: &str) -> (&'static str, String) {
    match kind {
        Kind::Tokens | Kind::TokensSpaced => {
            let mut t = chain(w, i % 50);
            t.truncate(n);
            t.extend((t.len()..n).map(|k| (3_000_000 + (k as u32).wrapping_mul(7919)) ^ i as u32));
            let b = json!({"model": model, "prompt": t, "max_tokens": 1}).to_string();
            if matches!(kind, Kind::TokensSpaced) {
                ("/v1/completions", b.replace(',', ", ").replace(':', ": "))
            } else {
                ("/v1/completions", b)
            }
        }
        Kind::Text => {
            let mut p = system(w);
            p.truncate(n * 4);
            let rest = n * 4 - p.len();
            p.push_str(&filler(i, rest));
            let b = json!({"model": model, "prompt": p, "max_tokens": 1});
            ("/v1/completions", b.to_string())
        }
        Kind::TextEscaped => {
            // About a token a character; the body writes six bytes each.
            let p: String = (0..n)
                .map(|k| format!("\\u{:04x}", 0x4e00 + (k * 7919 + i * 31) % 20_000))
                .collect();
            let b = format!(r#"{{"model":"{model}","prompt":"{p}","max_tokens":1}}"#);
            ("/v1/completions", b)
        }
        Kind::Chat | Kind::ChatParts | Kind::ChatApproximate => {
            let mut sys = system(w);
            sys.truncate(n * 4);
            let user = filler(i, (n * 4 - sys.len()).max(32));
            let content = |t: &str| match kind {
                Kind::ChatParts => json!([{"type": "text", "text": t}]),
                _ => json!(t),
            };
            let b = json!({
                "model": model,
                "messages": [
                    {"role": "system", "content": content(sys.trim_end())},
                    {"role": "user", "content": content(user.trim_end())},
                ],
                "max_tokens": 1,
                "chat_template_kwargs": {"date_string": KWARGS},
            });
            ("/v1/chat/completions", b.to_string())
        }
    }
}

/// Shards of one namespace from (hash, holder slot) pairs.
fn shards(entries: impl IntoIterator<Item = (u64, u16)>, count: u32) -> HashMap<u32, Vec<u8>> {
    let mut per: HashMap<u32, HashMap<u64, Vec<Holder>>> = HashMap::new();
    for (h, slot) in entries {
        per.entry(shard_of(h, count))
            .or_default()
            .entry(h)
            .or_default()
            .push(Holder {
                slot,
                tiers: TIER_DEVICE,
            });
    }
    per.into_iter()
        .map(|(s, m)| (s, encode(&mut m.into_iter().collect::<Vec<_>>())))
        .collect()
}

/// The update frame: the snapshot (model `m` with its template and
/// indexes, model `a` with neither), and every shard.
fn frame(blocks_per_worker: usize, t: &PromptTemplate) -> Vec<u8> {
    frame_of(&snapshot(t, 1), "m", blocks_per_worker, t, |w| w)
}

/// A frame holding `snap` and `model`'s indexes and template: worker `w`'s
/// cached chains and system prompt are held by slot `slot(w)`.
fn frame_of(
    snap: &Snapshot,
    model: &str,
    blocks_per_worker: usize,
    t: &PromptTemplate,
    slot: impl Fn(u16) -> u16 + Copy,
) -> Vec<u8> {
    let chains = blocks_per_worker / (CHAIN_TOKENS / 16);
    let tokens = (0..WORKERS).flat_map(|w| {
        (0..chains).flat_map(move |c| {
            sequence_hashes(&block_hashes(&chain(w, c), 16, XXH3_SEED))
                .into_iter()
                .map(move |h| (h, slot(w)))
        })
    });
    let token_shards = shards(tokens, 4096);
    // The text index: each worker holds its system prompt, as a chat's
    // first message and as a completion's prompt.
    let r = Renderer::new(t.clone()).expect("template compiles");
    let mut keys = Vec::new();
    for w in 0..WORKERS {
        let sys = system(w);
        let messages = json!([{"role": "system", "content": sys.trim_end()}]);
        let kwargs = json!({"date_string": KWARGS});
        let rendered = r
            .chat(&messages, None, kwargs.as_object(), 0)
            .expect("renders");
        let end = rendered.find(sys.trim_end()).expect("content") + sys.trim_end().len();
        for k in prefix_keys(&rendered[..end], CacheScope::default()) {
            keys.push((k, slot(w)));
        }
        for k in prefix_keys(&r.completion(&sys), CacheScope::default()) {
            keys.push((k, slot(w)));
        }
    }
    let text_shards = shards(keys, text::SHARDS);
    let text_ns = text::index_key(model);
    let template_ns = text::template_key(model);
    let blob = t.encode();
    let encoded = snap.encode().expect("snapshot");
    let all = token_shards
        .iter()
        .map(|(s, b)| (model, *s, b.as_slice()))
        .chain(
            text_shards
                .iter()
                .map(|(s, b)| (text_ns.as_str(), *s, b.as_slice())),
        )
        .chain(std::iter::once((template_ns.as_str(), 0, blob.as_slice())));
    update::encode(snap.version, 1, true, Some(&encoded), all)
}

/// The snapshot at `version`: model `m` with its template and indexes,
/// model `a` with neither.
fn snapshot(t: &PromptTemplate, version: u64) -> Snapshot {
    let mut snap: Snapshot = bench_snapshot(WORKERS, 4096);
    snap.version = version;
    snap.models[0].prompt_template = t.version();
    let mut approx = snap.models[0].clone();
    approx.name = "a".into();
    approx.prompt_template = 0;
    approx.shard_count = 0;
    snap.models.push(approx);
    snap
}

/// One Envoy's worth of VMs on one build of the filter.
struct Side {
    shared: kvgate_tests::host::SharedRef,
    service: Vm,
    router: Vm,
    version: u64,
}

impl Side {
    fn start(filter: &Filter, frame: &[u8]) -> Side {
        let shared = Shared::new();
        let mut svc = Vm::start(filter, &shared, "kvgate", "kvgate_snapshot_service", "")
            .expect("service VM");
        let token = svc.pending().pop().expect("poll").token;
        svc.respond(token, 200, &[], frame).expect("update applied");
        // Every request's phases are timed; a build from before the key
        // refuses it, and timed every request's.
        let router = |config: &str| Vm::start(filter, &shared, "kvgate", "kvgate_router", config);
        let mut router = router(r#"{"max_body_bytes": 4194304, "phase_timing_every": 1}"#)
            .ok()
            .filter(|vm| vm.configured)
            .map_or_else(|| router(r#"{"max_body_bytes": 4194304}"#), Ok)
            .expect("router VM");
        assert!(router.configured, "router VM refused its configuration");
        router.state_mut().fuel_clock = true;
        router.take_cost();
        Side {
            shared,
            service: svc,
            router,
            version: 1,
        }
    }

    /// A new snapshot version, as the sidecar publishes whenever a
    /// worker's load moves: under load, most requests find one, and the
    /// router decodes it before deciding.
    fn republish(&mut self, t: &PromptTemplate) {
        let snap = snapshot(t, self.version + 1).encode().expect("snapshot");
        self.update(Some(&snap));
    }

    /// A new update that changes nothing, as the sidecar sends when only
    /// shards of other prompts changed: a VM keeps the shards it read
    /// twice only while the update version stands still.
    fn touch(&mut self) {
        self.update(None);
    }

    /// The service's next poll answered with an update of the next
    /// version, carrying `snap` and no shards.
    fn update(&mut self, snap: Option<&[u8]>) {
        self.version += 1;
        let update = update::encode(self.version, 1, false, snap, []);
        let token = self.service.pending().pop().expect("poll").token;
        self.service
            .respond(token, 200, &[], &update)
            .expect("update applied");
        self.router.take_cost();
    }

    /// Sends one request; returns where it went, what it cost and the
    /// filter's phase histograms' samples (thousands of fuel units).
    fn request(&mut self, path: &str, body: &str) -> (String, Cost, Value) {
        let headers = [(":method", "POST"), (":path", path)];
        let ex = self.router.request(&headers, &[body.as_bytes()]);
        assert!(
            ex.continued,
            "{:?} {:?}\n{}",
            ex.reply,
            ex.trapped,
            self.router.logs()
        );
        let cost = self.router.take_cost();
        let dest = ex.header(DESTINATION).unwrap_or_default().to_string();
        (dest, cost, self.phases())
    }

    /// The last request's phase samples (thousands of fuel units); the
    /// histograms are emptied for the next.
    fn phases(&self) -> Value {
        let mut phases = serde_json::Map::new();
        let mut shared = self.shared.lock().expect("shared");
        for name in ["parse", "gather", "selection", "decision"] {
            let key = format!("kvgate_{name}_us");
            if let Some(m) = shared.metrics.get_mut(&key) {
                if let Some(v) = m.samples.pop() {
                    phases.insert(name.into(), json!(v));
                }
                m.samples.clear();
            }
        }
        Value::Object(phases)
    }
}

/// The requests whose decisions both builds made, and the first that
/// differed.
#[derive(Default)]
struct Verdict {
    aggregated: usize,
    split: usize,
    differing: usize,
    first: Option<Value>,
}

impl Verdict {
    /// Compares the candidate's decisions on one row's requests with the
    /// baseline's, when there is one; the first difference is printed at
    /// once, so a run that goes on to its end still names it first.
    fn compare(&mut self, split: bool, row: &str, decisions: &[Vec<String>]) {
        let [now, before] = decisions else {
            return;
        };
        for (i, (a, b)) in now.iter().zip(before).enumerate() {
            if split {
                self.split += 1;
            } else {
                self.aggregated += 1;
            }
            if a == b {
                continue;
            }
            self.differing += 1;
            if self.first.is_none() {
                eprintln!(
                    "decision_cost: the builds decide differently: {row}, request {i}\n  candidate: {a}\n  baseline:  {b}"
                );
                self.first = Some(json!({
                    "row": row,
                    "request": i,
                    "candidate": a,
                    "baseline": b,
                }));
            }
        }
    }

    fn report(&self) -> Value {
        json!({
            "aggregated_compared": self.aggregated,
            "split_compared": self.split,
            "differing": self.differing,
            "first_difference": self.first,
        })
    }
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// A side's figures for one prompt shape: medians over the measured
/// requests (they differ only in their own words).
fn summary(costs: &[Cost], phases: &[Value]) -> Value {
    let by = |f: &dyn Fn(&Cost) -> u64| median(costs.iter().map(f).collect());
    let last = &costs[costs.len() - 1];
    let mut ph = serde_json::Map::new();
    for name in ["parse", "gather", "selection", "decision"] {
        let v: Vec<u64> = phases.iter().filter_map(|p| p[name].as_u64()).collect();
        if !v.is_empty() {
            ph.insert(name.into(), json!(median(v)));
        }
    }
    let mut s = json!({
        "fuel": by(&Cost::total_fuel),
        "fuel_request_body": by(&|c: &Cost| c.fuel.get("proxy_on_request_body").copied().unwrap_or(0)),
        "phases_kfuel": ph,
        "host_calls": by(&Cost::total_calls),
        "bytes_out": by(&Cost::total_bytes_out),
        "host_calls_by_kind": last.calls,
        "bytes_out_by_kind": last.bytes_out,
    });
    // A split request's prefill answer runs in a callback of its own.
    let answer = |c: &Cost| c.fuel.get("proxy_on_http_call_response").copied();
    if costs.iter().any(|c| answer(c).is_some()) {
        s["fuel_prefill_answer"] = json!(by(&|c: &Cost| answer(c).unwrap_or(0)));
    }
    s
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut baseline = None;
    let mut quick = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--baseline" => baseline = args.next().map(PathBuf::from),
            "--quick" => quick = true,
            other => panic!("unknown argument {other}: [--baseline PATH] [--quick]"),
        }
    }
    let (blocks, warm, measured) = if quick {
        (10_000, 1, 2)
    } else {
        (100_000, 2, 5)
    };
    let t = template();
    let load = |wasm: &std::path::Path| Filter::load_metered(wasm).expect("filter module");
    let mut filters = vec![("candidate", load(&kvgate_tests::filter_wasm()))];
    if let Some(b) = &baseline {
        filters.push(("baseline", load(b)));
    }
    let frame = frame(blocks, &t);
    let mut sides: Vec<(&str, Side)> = filters
        .iter()
        .map(|(name, f)| (*name, Side::start(f, &frame)))
        .collect();
    let mut verdict = Verdict::default();
    let mut ratios = Vec::new();
    let mut rows = Vec::new();
    let mut table = String::from(TABLE_HEAD);
    for kind in Kind::ALL {
        for n in SIZES {
            let reqs: Vec<(&str, String)> =
                (0..warm + measured).map(|i| body(kind, n, i)).collect();
            let mut row = json!({
                "kind": kind.name(),
                "tokens": n,
                "body_bytes": reqs[0].1.len(),
            });
            let mut dests: Vec<Vec<String>> = Vec::new();
            for (name, side) in &mut sides {
                let mut costs = Vec::new();
                let mut phases = Vec::new();
                let mut went = Vec::new();
                for (i, (path, b)) in reqs.iter().enumerate() {
                    // Each request reads its shards, as the first after an
                    // update does; held shards are measured below.
                    side.touch();
                    let (dest, cost, ph) = side.request(path, b);
                    went.push(dest);
                    if i >= warm {
                        costs.push(cost);
                        phases.push(ph);
                    }
                }
                let s = summary(&costs, &phases);
                table_row(&mut table, kind.name(), n, reqs[0].1.len(), name, &s);
                row[*name] = s;
                dests.push(went);
            }
            verdict.compare(false, &format!("{} at {n} tokens", kind.name()), &dests);
            ratios.push(ratio(kind.name(), n, &row));
            row["routed_to_holder"] = json!(
                dests[0]
                    .iter()
                    .enumerate()
                    .filter(|(i, d)| d
                        .split(',')
                        .next()
                        .is_some_and(|d| d == format!("10.0.0.{}:8000", i % WORKERS as usize + 1)))
                    .count()
            );
            rows.push(row);
        }
    }
    // The split fleets, each in an Envoy of its own: the aggregated rows
    // keep the snapshot they were always measured on.
    let mut split_rows = Vec::new();
    table.push_str(&format!(
        "\nSplit fleets ({}):\n\n{TABLE_HEAD}",
        split::FLEET
    ));
    for protocol in Protocol::ALL {
        let frame = split::frame(protocol, blocks, &t);
        let mut sides: Vec<(&str, Side)> = filters
            .iter()
            .map(|(name, f)| (*name, Side::start(f, &frame)))
            .collect();
        for shape in split::Shape::ALL {
            for n in SIZES {
                let reqs: Vec<(&str, String)> =
                    (0..warm + measured).map(|i| shape.body(n, i)).collect();
                let label = format!("{}: {}", protocol.as_str(), shape.name());
                let mut row = json!({
                    "protocol": protocol.as_str(),
                    "kind": shape.name(),
                    "tokens": n,
                    "body_bytes": reqs[0].1.len(),
                });
                let mut decisions: Vec<Vec<String>> = Vec::new();
                for (name, side) in &mut sides {
                    let mut costs = Vec::new();
                    let mut phases = Vec::new();
                    let mut decided = Vec::new();
                    for (i, (path, b)) in reqs.iter().enumerate() {
                        side.touch();
                        let (d, cost, ph) = split::request(side, protocol, path, b, i, n);
                        decided.push(d);
                        if i >= warm {
                            costs.push(cost);
                            phases.push(ph);
                        }
                    }
                    let s = summary(&costs, &phases);
                    table_row(&mut table, &label, n, reqs[0].1.len(), name, &s);
                    row[*name] = s;
                    decisions.push(decided.iter().map(Value::to_string).collect());
                    if row.get("decisions").is_none() {
                        row["decisions"] = json!(decided);
                    }
                }
                verdict.compare(true, &format!("{label} at {n} tokens"), &decisions);
                ratios.push(ratio(&label, n, &row));
                split_rows.push(row);
            }
        }
    }
    if baseline.is_some() {
        table.push_str(
            "\nFuel per request, candidate / baseline:\n\n| prompt | tokens | candidate | baseline | ratio |\n| --- | --- | --- | --- | --- |\n",
        );
        for r in &ratios {
            if let Some(b) = r.baseline {
                table.push_str(&format!(
                    "| {} | {}k | {} | {b} | {:.3} |\n",
                    r.kind,
                    r.tokens / 1024,
                    r.candidate,
                    r.candidate as f64 / b as f64,
                ));
            }
        }
    }
    // What a new snapshot adds to a request that finds one.
    let (path, b) = body(Kind::Tokens, 2048, 0);
    let mut refresh = serde_json::Map::new();
    for (name, side) in &mut sides {
        let mut fuel = Vec::new();
        for _ in 0..warm + measured {
            side.republish(&t);
            fuel.push(side.request(path, &b).1.total_fuel());
        }
        let with = median(fuel.split_off(warm));
        let without = median(
            (0..measured)
                .map(|_| side.request(path, &b).1.total_fuel())
                .collect(),
        );
        table.push_str(&format!(
            "\n{name}: a 2k token-id request that finds a new snapshot (16 workers) costs {with} fuel, {without} without: the decode adds {}.\n",
            with.saturating_sub(without)
        ));
        refresh.insert(
            (*name).into(),
            json!({"with_new_snapshot": with, "without": without}),
        );
    }
    // What a request saves when earlier requests of the same update read
    // its shards.
    let mut held = serde_json::Map::new();
    for kind in [Kind::Tokens, Kind::Chat] {
        let (path, b) = body(kind, 2048, 0);
        for (name, side) in &mut sides {
            let (mut read, mut kept) = (Vec::new(), Vec::new());
            for _ in 0..warm + measured {
                side.touch();
                read.push(side.request(path, &b).1);
                // A VM keeps a shard from its second read in an update.
                side.request(path, &b);
                kept.push(side.request(path, &b).1);
            }
            let (read, kept) = (read.split_off(warm), kept.split_off(warm));
            let fuel = |c: &[Cost]| median(c.iter().map(Cost::total_fuel).collect());
            let calls = |c: &[Cost]| median(c.iter().map(Cost::total_calls).collect());
            table.push_str(&format!(
                "{name}: a 2k {} request whose shards it reads costs {} fuel and {} host calls; with its shards held from earlier requests of the same update, {} and {}.\n",
                kind.name(),
                fuel(&read),
                calls(&read),
                fuel(&kept),
                calls(&kept),
            ));
            held.insert(
                format!("{name} {}", kind.name()),
                json!({"read": {"fuel": fuel(&read), "host_calls": calls(&read)},
                       "held": {"fuel": fuel(&kept), "host_calls": calls(&kept)}}),
            );
        }
    }
    if baseline.is_some() {
        table.push_str(&format!(
            "\nDecisions compared: {} aggregated, {} split; {} differ.\n",
            verdict.aggregated, verdict.split, verdict.differing
        ));
    }
    eprintln!("{table}");
    let mut out = json!({
        "name": "decision_cost",
        "workers": WORKERS,
        "blocks_per_worker": blocks,
        "requests_measured": measured,
        "rows": rows,
        "split_fleet": split::FLEET,
        "split_rows": split_rows,
        "new_snapshot_2k_token_ids": refresh,
        "shards_held_2k": held,
    });
    if baseline.is_some() {
        out["decisions"] = verdict.report();
    }
    println!("{out}");
    if verdict.differing > 0 {
        if let Some(first) = &verdict.first {
            eprintln!(
                "decision_cost: {} requests decided differently; the first: {first}",
                verdict.differing
            );
        }
        std::process::exit(1);
    }
}

/// One row's fuel per request on each side.
struct Ratio {
    kind: String,
    tokens: usize,
    candidate: u64,
    baseline: Option<u64>,
}

fn ratio(kind: &str, tokens: usize, row: &Value) -> Ratio {
    Ratio {
        kind: kind.to_string(),
        tokens,
        candidate: row["candidate"]["fuel"].as_u64().unwrap_or(0),
        baseline: row["baseline"]["fuel"].as_u64(),
    }
}

const TABLE_HEAD: &str = "| prompt | tokens | body bytes | side | fuel / request | parse | gather | selection | decision (kfuel) | host calls | bytes copied in |\n\
     | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";

/// One side's figures for one row of the table.
fn table_row(table: &mut String, kind: &str, n: usize, bytes: usize, side: &str, s: &Value) {
    let f = |p: &str| {
        s["phases_kfuel"][p]
            .as_u64()
            .map_or("—".to_string(), |v| v.to_string())
    };
    table.push_str(&format!(
        "| {kind} | {}k | {bytes} | {side} | {} | {} | {} | {} | {} | {} | {} |\n",
        n / 1024,
        s["fuel"],
        f("parse"),
        f("gather"),
        f("selection"),
        f("decision"),
        s["host_calls"],
        s["bytes_out"],
    ));
}
