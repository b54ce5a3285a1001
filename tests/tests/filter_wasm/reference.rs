//! Every decision the filter makes equals core's reference `plan` over the
//! same shared data: many random prompts of every kind (token ids, batches,
//! text, chats with and without a template, salts, an adapter), with
//! snapshot and index updates, and the routed-prefix reports fed back as
//! the sidecar would, between requests. What the filter's hot path does
//! to go faster must never change where a request goes, what it books or
//! what it reports.

use super::{EPOCH, Envoy, events};
use kvgate_core::approx::{self, Routed};
use kvgate_core::booking::Event;
use kvgate_core::hash::{CacheScope, XXH3_SEED, block_hashes, lora_seed, sequence_hashes};
use kvgate_core::plan::request::{Endpoint, parse};
use kvgate_core::plan::{self, Ask, Plan};
use kvgate_core::shard::{Holder, TIER_DEVICE, TIER_HOST, encode, shard_of};
use kvgate_core::text::template::{PromptTemplate, Renderer};
use kvgate_core::text::{self, prefix_keys};
use kvgate_core::{ModelState, RankLoad, Snapshot, WorkerState, update};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};

/// A small deterministic generator (splitmix64): the test needs no crate
/// and replays the same requests every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

const WORKERS: usize = 6;
const SHARDS: u32 = 8;
const ADAPTER: &str = "m-adapter";
const DATE: &str = "26 Jul 2024";

fn template() -> PromptTemplate {
    kvgate_tests::fixture_template("llama3-style")
}

/// Six workers of two block sizes. Each rank's running requests differ
/// and weigh an irrational-looking amount, so no two candidates cost the
/// same: the reference needs no tie-break to agree with the filter.
fn fleet(version: u64, rng: &mut Rng, template_version: u64) -> Snapshot {
    let workers: Vec<WorkerState> = (0..WORKERS)
        .map(|i| WorkerState {
            id: i as u64 + 1,
            endpoint: format!("10.0.1.{}:8000", i + 1),
            block_size: if i % 3 == 2 { 32 } else { 16 },
            ranks: vec![RankLoad {
                slot: i as u16,
                running: (i as u32 + 1) * 3 + rng.below(3) as u32,
                active_decode_blocks: rng.below(60) as u64,
                kv_total_blocks: 4000,
                busy: rng.chance(8),
                ..Default::default()
            }],
            tenant: "default".into(),
            thermal: Default::default(),
            draining: false,
            role: Default::default(),
            bootstrap_port: 0,
            fits: None,
            topology: Default::default(),
        })
        .collect();
    let m = |name: &str, shard_count: u32, template: u64| {
        let mut model = ModelState {
            name: name.into(),
            workers: workers.clone(),
            shard_count,
            prompt_template: template,
            ..Default::default()
        };
        model.policy.decode_active_request_weight = 0.141_421_356;
        model
    };
    let mut with_template = m("m", SHARDS, template_version);
    with_template.lora_adapters = vec![ADAPTER.into()];
    Snapshot {
        version,
        built_at_ms: 1,
        models: vec![with_template, m("a", 0, 0)],
        applied: Vec::new(),
    }
}

/// The index as the sidecar holds it: namespace → hash → holders.
#[derive(Default)]
struct Index(BTreeMap<String, HashMap<u64, Vec<Holder>>>);

impl Index {
    fn hold(&mut self, ns: &str, hashes: &[u64], slot: u16, tiers: u8) {
        let m = self.0.entry(ns.to_string()).or_default();
        for &h in hashes {
            let hs = m.entry(h).or_default();
            hs.retain(|x| x.slot != slot);
            hs.push(Holder { slot, tiers });
            hs.sort();
        }
    }

    fn clear_slot(&mut self, slot: u16) {
        for m in self.0.values_mut() {
            for hs in m.values_mut() {
                hs.retain(|h| h.slot != slot);
            }
            m.retain(|_, hs| !hs.is_empty());
        }
    }

    /// Every shard of every namespace that holds an entry, encoded; one
    /// that holds none is left out ([`publish`] writes it empty).
    fn shards(&self) -> Vec<(String, u32, Vec<u8>)> {
        let mut out = Vec::new();
        for (ns, m) in &self.0 {
            let count = if ns == "m" {
                SHARDS
            } else if ns.starts_with("~text~") {
                text::SHARDS
            } else {
                approx::SHARDS
            };
            let mut per: BTreeMap<u32, Vec<(u64, Vec<Holder>)>> = BTreeMap::new();
            for (h, hs) in m {
                per.entry(shard_of(*h, count))
                    .or_default()
                    .push((*h, hs.clone()));
            }
            for (s, mut e) in per {
                out.push((ns.clone(), s, encode(&mut e)));
            }
        }
        out
    }
}

/// The prompt families requests share prefixes of.
struct Families {
    tokens: Vec<Vec<u32>>,
    texts: Vec<String>,
}

fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::new();
    for _ in 0..n {
        s.push_str(&format!("w{} ", rng.below(3000)));
    }
    s.trim_end().to_string()
}

impl Families {
    fn new(rng: &mut Rng) -> Families {
        Families {
            tokens: (0..5)
                .map(|_| (0..700).map(|_| rng.below(100_000) as u32).collect())
                .collect(),
            texts: (0..5).map(|_| words(rng, 500)).collect(),
        }
    }
}

/// A random request: its path and body.
fn request(rng: &mut Rng, f: &Families) -> (&'static str, String) {
    let salt = rng.chance(15).then(|| format!("s{}", rng.below(2)));
    let model = match rng.below(100) {
        0..3 => "unknown-model",
        3..18 => ADAPTER,
        _ => "m",
    };
    let mut body = match rng.below(6) {
        0 | 1 => {
            let fam = &f.tokens[rng.below(f.tokens.len())];
            let mut t = fam[..rng.below(fam.len()) + 1].to_vec();
            t.extend((0..rng.below(300)).map(|_| rng.below(100_000) as u32));
            let prompt = if rng.chance(20) {
                json!([t, [1, 2, 3]])
            } else {
                json!(t)
            };
            json!({"model": model, "prompt": prompt, "max_tokens": rng.below(50) + 1})
        }
        2 => {
            let fam = &f.texts[rng.below(f.texts.len())];
            let cut = fam.floor_char_boundary(rng.below(fam.len()) + 1);
            let n = rng.below(100);
            let p = format!("{}{}", &fam[..cut], words(rng, n));
            json!({"model": model, "prompt": p})
        }
        n => {
            let fam = &f.texts[rng.below(f.texts.len())];
            let cut = fam.floor_char_boundary(rng.below(fam.len()) + 1);
            let model = if n == 5 { "a" } else { model };
            let n = rng.below(40) + 1;
            let mut messages = vec![
                json!({"role": "system", "content": fam[..cut].trim_end()}),
                json!({"role": "user", "content": format!("q {}", words(rng, n))}),
            ];
            if rng.chance(30) {
                messages.push(json!({"role": "assistant", "content": "an answer"}));
                messages.push(json!({"role": "user", "content": "and then?"}));
            }
            json!({"model": model, "messages": messages, "stream": rng.chance(50),
                   "chat_template_kwargs": {"date_string": DATE}})
        }
    };
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    let path = if body.get("messages").is_some() {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    (path, body.to_string())
}

/// Random index changes: some slots hold more or less of the families
/// (token blocks at their worker's block size, text keys of the chats'
/// and completions' rendered prefixes), some are cleared.
fn churn(rng: &mut Rng, idx: &mut Index, f: &Families, snap: &Snapshot, r: &Renderer) {
    for _ in 0..3 {
        let w = &snap.models[0].workers[rng.below(WORKERS)];
        let slot = w.ranks[0].slot;
        if rng.chance(15) {
            idx.clear_slot(slot);
            continue;
        }
        let tiers = if rng.chance(25) {
            TIER_HOST
        } else {
            TIER_DEVICE
        };
        let fam = &f.tokens[rng.below(f.tokens.len())];
        let seed = if rng.chance(20) {
            lora_seed(Some(ADAPTER))
        } else {
            XXH3_SEED
        };
        let seq = sequence_hashes(&block_hashes(fam, w.block_size as usize, seed));
        let depth = rng.below(seq.len() + 1);
        idx.hold("m", &seq[..depth], slot, tiers);
        let fam = &f.texts[rng.below(f.texts.len())];
        let rendered = if rng.chance(50) {
            r.completion(fam)
        } else {
            let messages = json!([{"role": "system", "content": fam}]);
            let kwargs = json!({"date_string": DATE});
            r.chat(&messages, None, kwargs.as_object(), 0).unwrap()
        };
        let keys = prefix_keys(&rendered, CacheScope::default());
        let depth = rng.below(keys.len() + 1);
        idx.hold(&text::index_key("m"), &keys[..depth], slot, tiers);
    }
}

/// What the sidecar last published of each shard, by (namespace, shard).
type Published = HashMap<(String, u32), Vec<u8>>;

/// Answers the service's poll with `snap` (if any) and, as the sidecar
/// does, only the shards that changed since `last` (a shard that lost
/// every entry written empty): the others stay in shared data as they
/// were, beside the rewritten ones.
fn publish(
    e: &mut Envoy,
    version: u64,
    snap: Option<&Snapshot>,
    idx: &Index,
    last: &mut Published,
    extra: &[u8],
) {
    let bytes = snap.map(|s| s.encode().unwrap());
    let now: Published = idx
        .shards()
        .into_iter()
        .map(|(ns, s, b)| ((ns, s), b))
        .collect();
    let mut changed: Vec<(&str, u32, &[u8])> = now
        .iter()
        .filter(|(k, b)| last.get(*k) != Some(*b))
        .map(|((ns, s), b)| (ns.as_str(), *s, b.as_slice()))
        .collect();
    changed.extend(
        last.keys()
            .filter(|k| !now.contains_key(*k))
            .map(|(ns, s)| (ns.as_str(), *s, &[][..])),
    );
    let template_ns = text::template_key("m");
    if !extra.is_empty() {
        changed.push((template_ns.as_str(), 0, extra));
    }
    let frame = update::encode(version, EPOCH, false, bytes.as_deref(), changed);
    let c = e.service.pending().pop().expect("a poll in flight");
    e.service.respond(c.token, 200, &[], &frame).unwrap();
    *last = now;
}

#[test]
fn every_decision_equals_the_reference_plan() {
    let mut rng = Rng(0x6b76_6761_7465);
    let t = template();
    let mut renderer = Renderer::new(t.clone()).unwrap();
    let families = Families::new(&mut rng);
    let mut e = Envoy::start(r#"{"flush_ms": 0, "max_body_bytes": 4194304}"#);
    let mut snap = fleet(1, &mut rng, t.version());
    let mut idx = Index::default();
    churn(&mut rng, &mut idx, &families, &snap, &renderer);
    let mut last = Published::new();
    publish(&mut e, 1, Some(&snap), &idx, &mut last, &t.encode());
    let mut version = 1;
    let (mut routed, mut rejected) = (0, 0);
    for i in 0..300 {
        if i % 7 == 6 {
            version += 1;
            let new_snapshot = rng.chance(60);
            if new_snapshot {
                snap = fleet(version, &mut rng, t.version());
            }
            churn(&mut rng, &mut idx, &families, &snap, &renderer);
            let snap = new_snapshot.then_some(&snap);
            publish(&mut e, version, snap, &idx, &mut last, &[]);
        }
        let (path, body) = request(&mut rng, &families);
        let vm = rng.below(2);
        let ex = e.routers[vm].request(&[(":method", "POST"), (":path", path)], &[body.as_bytes()]);
        assert_eq!(ex.trapped, None, "{body}");
        let endpoint = Endpoint::from_path(path).unwrap();
        let mut req = parse(endpoint, body.as_bytes()).unwrap();
        let now_s = e.shared.lock().unwrap().now_ms() / 1000;
        if req.tokens.is_none()
            && snap
                .model(&req.model)
                .is_some_and(|m| m.prompt_template != 0)
        {
            req.render(&mut renderer, body.as_bytes(), now_s).unwrap();
        }
        let shared = e.shared.clone();
        let mut read = |k: &str| shared.lock().unwrap().get(k).map(<[u8]>::to_vec);
        let planned = plan::plan(&snap, &req, "default", &Ask::default(), &mut read, &[]);
        let reports: Vec<Routed> = e.routers[vm]
            .drain_queue("kvgate", "kvgate.routed")
            .iter()
            .flat_map(|b| Routed::decode_all(b).unwrap())
            .collect();
        let books: Vec<Event> = events(&e.routers[vm].drain_queue("kvgate", "kvgate.bookings"))
            .into_iter()
            .filter(|ev| matches!(ev, Event::Book { .. }))
            .collect();
        match planned {
            Plan::Route(r) => {
                routed += 1;
                let mut want = r.first.choice.worker.endpoint.clone();
                if let Some(fb) = &r.fallback {
                    want = format!("{want},{}", fb.choice.worker.endpoint);
                }
                assert_eq!(
                    ex.header("x-gateway-destination-endpoint"),
                    Some(want.as_str()),
                    "request {i}: {body}"
                );
                assert_eq!(
                    reports,
                    r.report.clone().into_iter().collect::<Vec<_>>(),
                    "request {i}"
                );
                match books.as_slice() {
                    [
                        Event::Book {
                            slot,
                            prefill_tokens,
                            decode_blocks,
                            ..
                        },
                    ] => assert_eq!(
                        (*slot, u64::from(*prefill_tokens), u64::from(*decode_blocks)),
                        (
                            r.first.choice.rank.slot,
                            r.first.prefill_tokens,
                            r.first.decode_blocks
                        ),
                        "request {i}"
                    ),
                    other => panic!("request {i}: bookings {other:?}"),
                }
                // Feed the report back as the sidecar does, so later
                // requests match the routed-prefix index too.
                for rep in &reports {
                    idx.hold(
                        &approx::model_key(&rep.model),
                        &rep.hashes,
                        rep.slot,
                        TIER_DEVICE,
                    );
                }
            }
            Plan::Reject(why) => {
                rejected += 1;
                assert!(
                    ex.reply.is_some(),
                    "request {i} should be refused ({why:?})"
                );
                assert!(reports.is_empty() && books.is_empty());
            }
        }
    }
    assert!(
        routed > 200 && rejected > 0,
        "{routed} routed, {rejected} refused"
    );
}
