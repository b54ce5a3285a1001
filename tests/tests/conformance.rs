//! The three front doors render one decision: the same snapshot, index
//! shards and request, over generated fleets, go to
//!
//! * the filter, through the wasmtime proxy-wasm host (its prefill
//!   callout answered as a worker would), with `Door::CALLOUT`;
//! * the selection API's `/select` (`kvgate_sidecar::api::route::select_in`,
//!   the handler's own path over a snapshot of the test's), with
//!   `Door::CLIENT_SENDS`;
//! * the ext_proc door (`kvgate_sidecar::api::route::place`, the decision
//!   `kvgate-extproc` renders), with `Door::ONE_UPSTREAM`;
//!
//! and each door's observable outcome must be what
//! `kvgate_core::dispatch::dispatch` over `kvgate_core::plan::plan` says
//! for its door. The doors use tie-break counters of their own, so every
//! fleet's loads make each choice unique; each expected dispatch is
//! checked to be the same under several tie-breaks.
//!
//! Where the doors legitimately differ, the test asserts the documented
//! behaviour: the ext_proc door makes no prefill leg, so a request the
//! others split is computed whole on its decode worker or refused 503
//! `prefill_failed`, as the model's `on_prefill_failure` (and SGLang)
//! says; failing open on stale state is the filter's alone (the sidecar's
//! doors read the state they hold).
//!
//! Before the doors rendered `dispatch`, these cases failed: `/select`
//! answered an SGLang request placed whole on a `decode` worker (the
//! prefill pool down, no free prefill worker with `on_prefill_failure =
//! "local"`, the conditional rule on a decode worker) with that worker
//! and `local_prefill: true`, which the engine cannot serve, where the
//! filter refuses it; and the ext_proc door sent every request of a
//! disaggregated model whole with the client's body and request id
//! (transfer fields included), sent split NIXL requests whole even with
//! `on_prefill_failure = "fail"`, and sent split SGLang requests whole to
//! a decode worker.

use kvgate_core::dispatch::{Body, Dispatch, Door, Refusal, Target, WholeBody, WholeWhy, dispatch};
use kvgate_core::hash::{XXH3_SEED, block_hashes, sequence_hashes};
use kvgate_core::plan::request::{Endpoint, parse};
use kvgate_core::plan::{Ask, plan};
use kvgate_core::reply::{Reason, Reply};
use kvgate_core::shard::{Holder, TIER_DEVICE, encode, shard_of};
use kvgate_core::state::{Disaggregation, OnPrefillFailure, Protocol, Role};
use kvgate_core::update::{self, shard_key};
use kvgate_core::{
    DEFAULT_TENANT, ModelState, RankLoad, Snapshot, Thermal, ThermalState, WorkerState,
};
use kvgate_sidecar::api::route::{self, Refused, RouteError};
use kvgate_sidecar::api::views::{Prompt, SelectRequest};
use kvgate_tests::host::{Shared, Vm};
use serde_json::{Value, json};
use std::collections::HashMap;

const MODEL: &str = "m";
const SHARDS: u32 = 8;
const EPOCH: u64 = 4242;
/// Long enough that, with nothing cached, the conditional rule sends the
/// prompt to a prefill worker.
const ISL: u32 = 3000;
/// The filter's default `max_body_bytes`.
const MAX_BODY: usize = 1 << 20;
const RANK_HEADER: &str = "x-data-parallel-rank";

/// What is done to a generated fleet, relative to where its idle
/// version's request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Idle,
    /// The chosen rank is busy.
    BusyRank,
    /// The chosen worker is at its thermal cap.
    Hot,
    /// Every rank of every `prefill` worker is busy.
    NoFreePrefill,
    /// The chosen worker holds 2,400 of the 3,000 tokens on its GPU: a
    /// decode worker computes the rest itself.
    Conditional,
    /// Every worker has two or three data-parallel ranks.
    DpRanks,
    /// Every worker has two or three ranks, and the chosen one is busy.
    BusyDpRank,
    AllBusy,
    AllHot,
    /// The filter's state is stale (filter only: it fails open).
    Stale,
}

const SCENARIOS: [Scenario; 10] = [
    Scenario::Idle,
    Scenario::BusyRank,
    Scenario::Hot,
    Scenario::NoFreePrefill,
    Scenario::Conditional,
    Scenario::DpRanks,
    Scenario::BusyDpRank,
    Scenario::AllBusy,
    Scenario::AllHot,
    Scenario::Stale,
];

use Role::{Both as B, Decode as D, Prefill as P};

/// The role mixes of a disaggregated model's fleet, by name.
const MIXES: [(&str, &[Role]); 8] = [
    ("both+both", &[B, B]),
    ("prefill+decode", &[P, D]),
    ("2prefill+2decode", &[P, P, D, D]),
    ("both+prefill+decode", &[B, P, D]),
    ("both+decode", &[B, D]),
    ("both+prefill", &[B, P]),
    // The decode pool down.
    ("prefill+prefill", &[P, P]),
    // The prefill pool down.
    ("decode+decode", &[D, D]),
];

struct Case {
    name: String,
    snap: Snapshot,
    /// The model's index shards, by shard.
    shards: Vec<(u32, Vec<u8>)>,
    stale: bool,
}

impl Case {
    fn store(&self) -> HashMap<String, Vec<u8>> {
        self.shards
            .iter()
            .map(|(s, b)| (shard_key(MODEL, *s), b.clone()))
            .collect()
    }
}

fn tokens() -> Vec<u32> {
    (0..ISL).map(|t| 7000 + t).collect()
}

/// The client's body: a completion carrying transfer fields of its own,
/// which no worker of a disaggregated model may get.
fn client_body() -> Vec<u8> {
    json!({
        "model": MODEL, "prompt": tokens(), "max_tokens": 9,
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "evil", "remote_port": 1},
        "bootstrap_room": 7
    })
    .to_string()
    .into_bytes()
}

/// Loads that no two ranks share, in an order unrelated to worker ids;
/// within a worker, rank 1 is the lightest.
const PREFILL_LOAD: [u64; 4] = [1500, 400, 2600, 900];
const DECODE_LOAD: [u64; 4] = [20, 90, 45, 130];
const RANK_PREFILL_LOAD: [u64; 3] = [250, 0, 120];
const RANK_DECODE_LOAD: [u64; 3] = [9, 0, 4];

fn fleet(roles: &[Role], settings: Option<Disaggregation>, dp: bool) -> Snapshot {
    let workers = roles
        .iter()
        .enumerate()
        .map(|(i, role)| {
            let id = i as u64 + 1;
            let n = if dp { 2 + i % 2 } else { 1 };
            let ranks = (0..n)
                .map(|r| RankLoad {
                    rank: r as u32,
                    slot: (id * 4) as u16 + r as u16,
                    active_prefill_tokens: PREFILL_LOAD[i] + RANK_PREFILL_LOAD[r],
                    active_decode_blocks: DECODE_LOAD[i] + RANK_DECODE_LOAD[r],
                    kv_total_blocks: 100_000,
                    ..Default::default()
                })
                .collect();
            WorkerState {
                id,
                endpoint: format!("10.0.0.{id}:8000"),
                block_size: 16,
                ranks,
                tenant: DEFAULT_TENANT.into(),
                thermal: Thermal::default(),
                draining: false,
                role: *role,
                bootstrap_port: 9100 + id as u16,
                fits: None,
                topology: Default::default(),
            }
        })
        .collect();
    Snapshot {
        version: 1,
        built_at_ms: 1,
        models: vec![ModelState {
            name: MODEL.into(),
            shard_count: SHARDS,
            workers,
            retry_after_s: 3,
            disaggregation: settings,
            ..Default::default()
        }],
        applied: Vec::new(),
    }
}

/// The shards of an index in which `slot` holds the prompt's first
/// `tokens` tokens on its GPU.
fn holding(slot: u16, tokens_held: usize) -> Vec<(u32, Vec<u8>)> {
    let held = sequence_hashes(&block_hashes(&tokens()[..tokens_held], 16, XXH3_SEED));
    let mut per_shard: std::collections::BTreeMap<u32, Vec<(u64, Vec<Holder>)>> =
        Default::default();
    for h in held {
        per_shard.entry(shard_of(h, SHARDS)).or_default().push((
            h,
            vec![Holder {
                slot,
                tiers: TIER_DEVICE,
            }],
        ));
    }
    per_shard
        .into_iter()
        .map(|(s, mut v)| (s, encode(&mut v)))
        .collect()
}

/// The worker and rank the request goes to (the decode worker of a
/// split), when it goes somewhere.
fn chosen(d: &Dispatch) -> Option<&Target> {
    match d {
        Dispatch::Whole(w) => Some(&w.target),
        Dispatch::Split(s) => Some(&s.decode),
        Dispatch::Refuse(_) => None,
    }
}

fn each_rank(snap: &mut Snapshot, mut f: impl FnMut(&WorkerState, &mut RankLoad)) {
    for w in &mut snap.models[0].workers {
        let mut ranks = std::mem::take(&mut w.ranks);
        for r in &mut ranks {
            f(w, r);
        }
        w.ranks = ranks;
    }
}

fn capped(w: &mut WorkerState) {
    w.thermal = Thermal {
        state: ThermalState::Throttling,
        heat: 1.0,
        cap: 1,
        in_flight: 1,
    };
}

fn case(name: String, roles: &[Role], settings: Option<Disaggregation>, sc: Scenario) -> Case {
    let dp = matches!(sc, Scenario::DpRanks | Scenario::BusyDpRank);
    let mut snap = fleet(roles, settings, dp);
    let mut shards = Vec::new();
    let idle = expected(&snap, &HashMap::new(), At::Filter);
    let target = chosen(&idle).map(|t| (t.worker_id, t.rank, t.slot));
    match (sc, target) {
        (Scenario::BusyRank | Scenario::BusyDpRank, Some((id, rank, _))) => {
            each_rank(&mut snap, |w, r| {
                r.busy |= w.id == id && r.rank == rank;
            })
        }
        (Scenario::Hot, Some((id, _, _))) => {
            for w in &mut snap.models[0].workers {
                if w.id == id {
                    capped(w);
                }
            }
        }
        (Scenario::NoFreePrefill, _) => each_rank(&mut snap, |w, r| {
            r.busy |= w.role == Role::Prefill;
        }),
        (Scenario::Conditional, Some((_, _, slot))) => shards = holding(slot, 2400),
        (Scenario::AllBusy, _) => each_rank(&mut snap, |_, r| r.busy = true),
        (Scenario::AllHot, _) => snap.models[0].workers.iter_mut().for_each(capped),
        _ => {}
    }
    Case {
        name,
        snap,
        shards,
        stale: sc == Scenario::Stale,
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for sc in SCENARIOS {
        out.push(case(format!("aggregated/{sc:?}"), &[B, B, B], None, sc));
    }
    for protocol in [Protocol::VllmNixl, Protocol::Sglang] {
        for on_prefill_failure in [OnPrefillFailure::Local, OnPrefillFailure::Fail] {
            let settings = Disaggregation {
                protocol,
                on_prefill_failure,
                prefill_timeout_ms: 2000,
                ..Disaggregation::default()
            };
            for (mix, roles) in MIXES {
                for sc in SCENARIOS {
                    out.push(case(
                        format!("{protocol:?}/{on_prefill_failure:?}/{mix}/{sc:?}"),
                        roles,
                        Some(settings),
                        sc,
                    ));
                }
            }
        }
    }
    out
}

/// Which door a request is dispatched for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    Filter,
    Select,
    ExtProc,
}

/// What the door does with the client's request on `snap`: the same
/// under every tie-break, or the fleet is not one the doors can agree on.
fn expected(snap: &Snapshot, store: &HashMap<String, Vec<u8>>, at: At) -> Dispatch {
    let body = client_body();
    let req = parse(Endpoint::Completions, &body).unwrap();
    let (door, limit) = match at {
        // The filter is the one door with a body limit of its own.
        At::Filter => (
            Door::CALLOUT,
            Some(Body {
                len: body.len(),
                max: MAX_BODY,
                isl_tokens: req.isl_tokens,
            }),
        ),
        At::Select => (Door::CLIENT_SENDS, None),
        At::ExtProc => (Door::ONE_UPSTREAM, None),
    };
    let mut read = |k: &str| store.get(k).cloned();
    let mut first: Option<Dispatch> = None;
    for tie_break in [0, 1, 2, 7, 1_000_001] {
        let ask = Ask {
            slo: None,
            tie_break,
            thresholds_scale: None,
            one_upstream: !door.prefill_leg,
        };
        let p = plan(snap, &req, DEFAULT_TENANT, &ask, &mut read, &[]);
        let d = dispatch(&p, door, limit);
        match &first {
            None => first = Some(d),
            Some(f) => assert_eq!(f, &d, "a tie in the fleet: tie-break {tie_break} differs"),
        }
    }
    first.unwrap()
}

/// A worker and rank as a door shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Leg {
    endpoint: String,
    /// The rank: named only when the worker has several (the filter's and
    /// the ext_proc's rank header), always on `/select`.
    rank: Option<u32>,
    /// What it books there (prompt tokens, decode blocks), where the door
    /// shows it.
    booked: Option<(u64, u64)>,
}

/// How a worker's body went.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Sent {
    /// The client's bytes and request id.
    Verbatim,
    /// Without the client's transfer fields, under kvgate's request id.
    Scrubbed,
    /// Not the door's to send (`/select`).
    Unseen,
    Other(String),
}

/// A door's observable outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Whole {
        to: Leg,
        /// Where a refused connection is retried.
        fallback: Option<String>,
        body: Sent,
        /// Why a disaggregated model's request went whole, where shown.
        why: Option<String>,
    },
    Split {
        decode: Leg,
        decode_fallback: Option<String>,
        prefill: Leg,
    },
    Refused {
        status: u16,
        reason: Reason,
    },
    /// The filter failed open: no destination, Envoy balances; whether
    /// the body lost the client's transfer fields.
    FailedOpen {
        scrubbed: bool,
    },
}

fn refusal(r: &Refusal) -> Seen {
    let reply = match r {
        Refusal::Plan(r) => Reply::rejected(*r, MODEL, 1),
        Refusal::Unservable(reply) => reply.clone(),
    };
    Seen::Refused {
        status: reply.status,
        reason: reply.reason,
    }
}

fn body_rule(b: WholeBody) -> Sent {
    match b {
        WholeBody::Verbatim => Sent::Verbatim,
        WholeBody::Scrubbed => Sent::Scrubbed,
    }
}

/// A leg as the filter and the ext_proc door name it: the rank only to a
/// worker of several.
fn header_leg(t: &Target, booked: bool) -> Leg {
    Leg {
        endpoint: t.endpoint.clone(),
        rank: t.names_rank.then_some(t.rank),
        booked: booked.then_some((t.prefill_tokens, t.decode_blocks)),
    }
}

fn want_filter(d: &Dispatch) -> Seen {
    match d {
        Dispatch::Whole(w) => Seen::Whole {
            to: header_leg(&w.target, false),
            fallback: w.fallback.as_ref().map(|f| f.endpoint.clone()),
            body: body_rule(w.body),
            why: None,
        },
        Dispatch::Split(s) => Seen::Split {
            decode: header_leg(&s.decode, false),
            decode_fallback: s.decode_fallback.as_ref().map(|f| f.endpoint.clone()),
            prefill: header_leg(&s.prefill, false),
        },
        Dispatch::Refuse(r) => refusal(r),
    }
}

fn want_select(d: &Dispatch) -> Seen {
    let leg = |t: &Target| Leg {
        endpoint: t.endpoint.clone(),
        rank: Some(t.rank),
        booked: Some((t.prefill_tokens, t.decode_blocks)),
    };
    match d {
        Dispatch::Whole(w) => {
            // A model not split now answers as one served whole, without
            // the legs (and their decode blocks).
            let why = w.why.filter(|y| *y != WholeWhy::NotSplit);
            let mut to = leg(&w.target);
            if why.is_none() {
                to.booked = Some((w.target.prefill_tokens, 0));
            }
            Seen::Whole {
                to,
                fallback: None,
                body: Sent::Unseen,
                why: why.map(|y| y.as_str().to_string()),
            }
        }
        Dispatch::Split(s) => Seen::Split {
            decode: leg(&s.decode),
            decode_fallback: None,
            prefill: leg(&s.prefill),
        },
        Dispatch::Refuse(r) => refusal(r),
    }
}

fn want_extproc(d: &Dispatch) -> Seen {
    match d {
        Dispatch::Whole(w) => Seen::Whole {
            to: header_leg(&w.target, true),
            fallback: w.fallback.as_ref().map(|f| f.endpoint.clone()),
            body: body_rule(w.body),
            why: None,
        },
        Dispatch::Split(_) => panic!("a door without a prefill leg has no split"),
        Dispatch::Refuse(r) => refusal(r),
    }
}

const TRANSFER_FIELDS: [&str; 5] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "request_id",
];

fn has_no_transfer_field(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .is_some_and(|o| TRANSFER_FIELDS.iter().all(|f| !o.contains_key(*f)))
}

fn kvgates_id(id: Option<&str>) -> bool {
    id.and_then(|i| i.strip_prefix("kvgate-"))
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn sent(client: &[u8], body: &[u8], request_id: Option<&str>) -> Sent {
    if body == client && !kvgates_id(request_id) {
        Sent::Verbatim
    } else if has_no_transfer_field(body) && kvgates_id(request_id) {
        Sent::Scrubbed
    } else {
        Sent::Other(format!(
            "request id {request_id:?}, body {}",
            String::from_utf8_lossy(&body[..body.len().min(120)])
        ))
    }
}

/// A NIXL prefill answer, as vLLM gives it.
fn nixl_answer() -> Vec<u8> {
    json!({
        "id": "cmpl-1", "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": {
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "engine-1", "remote_block_ids": [[1, 2]],
            "remote_host": "10.0.0.9", "remote_port": 5600, "tp_size": 1
        }
    })
    .to_string()
    .into_bytes()
}

fn destinations(headers: &[(String, String)]) -> Vec<String> {
    headers
        .iter()
        .find(|(k, _)| k == "x-gateway-destination-endpoint")
        .map(|(_, v)| v.split(',').map(str::to_string).collect())
        .unwrap_or_default()
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn rank_of(headers: &[(String, String)]) -> Option<u32> {
    header(headers, RANK_HEADER).and_then(|r| r.parse().ok())
}

/// The filter's outcome: one service VM and one router VM, the case's
/// snapshot and shards published, the request sent and any prefill
/// callout answered as the worker would.
fn filter_seen(c: &Case) -> Seen {
    let filter = kvgate_tests::shared_filter();
    let config = if c.stale {
        r#"{"stale_after_ms": 2000}"#
    } else {
        ""
    };
    let shared = Shared::new();
    let mut service = Vm::start(filter, &shared, "kvgate", "kvgate_snapshot_service", config)
        .expect("the service VM starts");
    let mut router =
        Vm::start(filter, &shared, "kvgate", "kvgate_router", config).expect("a router starts");
    assert!(service.configured && router.configured, "{}", router.logs());
    let snap = c.snap.encode().unwrap();
    let frame = update::encode(
        1,
        EPOCH,
        true,
        Some(&snap),
        c.shards.iter().map(|(s, b)| (MODEL, *s, b.as_slice())),
    );
    let poll = service.pending().pop().expect("a poll in flight");
    service.respond(poll.token, 200, &[], &frame).unwrap();
    if c.stale {
        shared.lock().unwrap().advance_ms(2500);
    }
    let client = client_body();
    let headers = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "gw"),
        ("x-request-id", "client-chosen"),
    ];
    let (ex, ctx) = router.open(&headers, &[&client]);
    assert_eq!(ex.trapped, None, "{}", router.logs());
    if let Some(r) = &ex.reply {
        return Seen::Refused {
            status: r.status as u16,
            reason: r
                .header("x-kvgate-reason")
                .and_then(Reason::from_name)
                .unwrap_or(Reason::Internal),
        };
    }
    if header(&ex.headers, "x-kvgate-fallback") == Some("stale") {
        assert!(destinations(&ex.headers).is_empty());
        return Seen::FailedOpen {
            scrubbed: has_no_transfer_field(&ex.body),
        };
    }
    let pending = router.pending();
    let Some(call) = pending.first() else {
        let to = destinations(&ex.headers);
        return Seen::Whole {
            to: Leg {
                endpoint: to.first().cloned().unwrap_or_default(),
                rank: rank_of(&ex.headers),
                booked: None,
            },
            fallback: to.get(1).cloned(),
            body: sent(&client, &ex.body, header(&ex.headers, "x-request-id")),
            why: None,
        };
    };
    assert_eq!(pending.len(), 1, "one prefill callout: {pending:?}");
    let prefill = Leg {
        endpoint: call.header("x-kvgate-prefill-host").unwrap_or("").into(),
        rank: call.header(RANK_HEADER).and_then(|r| r.parse().ok()),
        booked: None,
    };
    // SGLang's decode leg goes on at once; NIXL's waits for the answer.
    let decode_headers = if ex.continued {
        ex.headers.clone()
    } else {
        router
            .respond(
                call.token,
                200,
                &[("content-type", "application/json")],
                &nixl_answer(),
            )
            .unwrap();
        let s = router.stream(ctx).expect("the stream is open");
        s.headers.clone()
    };
    let to = destinations(&decode_headers);
    Seen::Split {
        decode: Leg {
            endpoint: to.first().cloned().unwrap_or_default(),
            rank: rank_of(&decode_headers),
            booked: None,
        },
        decode_fallback: to.get(1).cloned(),
        prefill,
    }
}

fn select_request() -> SelectRequest {
    SelectRequest {
        model_name: MODEL.into(),
        tenant_id: DEFAULT_TENANT.into(),
        prompt: Prompt {
            token_ids: Some(tokens()),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn select_seen(c: &Case) -> Seen {
    let store = c.store();
    let answer = route::select_in(
        c.snap.models[0].clone(),
        &select_request(),
        0,
        &mut |k: &str| store.get(k).cloned(),
    );
    let v = match answer {
        Ok(v) => v,
        Err(r) => {
            let reason = match &r {
                Refused::Plan(p) => Reply::rejected(*p, MODEL, 1).reason,
                Refused::Unservable(reply) => reply.reason,
                Refused::BadRequest(m) => panic!("{}: a bad request: {m}", c.name),
            };
            return Seen::Refused {
                status: r.status().as_u16(),
                reason,
            };
        }
    };
    let leg = |l: &kvgate_sidecar::api::views::LegView| Leg {
        endpoint: l.endpoint.clone(),
        rank: Some(l.dp_rank),
        booked: Some((l.effective_prefill_tokens, l.decode_blocks)),
    };
    match &v.disaggregation {
        Some(split) if split.prefill.is_some() => {
            assert!(!split.local_prefill);
            assert_eq!(
                (split.decode.worker_id, split.decode.dp_rank),
                (v.worker_id, v.dp_rank)
            );
            Seen::Split {
                decode: leg(&split.decode),
                decode_fallback: None,
                prefill: split.prefill.as_ref().map(leg).unwrap(),
            }
        }
        split => {
            assert!(split.as_ref().is_none_or(|s| s.local_prefill));
            Seen::Whole {
                to: Leg {
                    endpoint: v.endpoint.clone(),
                    rank: Some(v.dp_rank),
                    // Decode blocks are shown on a disaggregated model
                    // only.
                    booked: Some((
                        v.effective_prefill_tokens,
                        split.as_ref().map_or(0, |s| s.decode.decode_blocks),
                    )),
                },
                fallback: None,
                body: Sent::Unseen,
                why: split.as_ref().and_then(|s| s.local_reason.clone()),
            }
        }
    }
}

fn extproc_seen(c: &Case) -> Seen {
    let store = c.store();
    let client = client_body();
    let req = parse(Endpoint::Completions, &client).unwrap();
    let placed = route::place(
        &c.snap.models[0],
        &req,
        DEFAULT_TENANT,
        &client,
        0,
        &mut |k: &str| store.get(k).cloned(),
    );
    match placed {
        Ok(p) => {
            let r = &p.routed;
            let mut to = r.destination.split(',').map(str::to_string);
            let body = r.body.clone().unwrap_or_else(|| client.clone());
            assert_eq!(p.rank.worker_id, r.worker_id);
            Seen::Whole {
                to: Leg {
                    endpoint: to.next().unwrap_or_default(),
                    rank: r.rank,
                    booked: Some((p.load.prefill_tokens, p.load.decode_blocks)),
                },
                fallback: to.next(),
                body: sent(&client, &body, r.request_id.as_deref()),
                why: None,
            }
        }
        // Rendered by `kvgate-extproc` as the filter renders a rejection.
        Err(RouteError::Refused(r)) => refusal(&Refusal::Plan(r)),
        Err(RouteError::Unservable(reply)) => refusal(&Refusal::Unservable(reply)),
        Err(RouteError::Ledger(e)) => panic!("{}: the ledger: {e}", c.name),
    }
}

/// The documented difference of the ext_proc door: what the others split
/// it serves as a prefill leg that failed.
fn check_no_leg_at_door(c: &Case, callout: &Dispatch, one: &Dispatch) -> Option<String> {
    let Dispatch::Split(s) = callout else {
        return None;
    };
    let local = s.on_failure == OnPrefillFailure::Local
        && (s.protocol == Protocol::VllmNixl || s.decode.role == Role::Both);
    let ok = match one {
        Dispatch::Whole(w) => {
            local
                && w.why == Some(WholeWhy::NoLegAtDoor)
                && w.target.worker_id == s.decode.worker_id
                && w.target.prefill_tokens == s.decode.prefill_tokens + s.local_prefill_tokens
        }
        Dispatch::Refuse(Refusal::Unservable(r)) => !local && r.reason == Reason::PrefillFailed,
        _ => false,
    };
    (!ok).then(|| format!("{}: ext_proc serves the split as {one:?}", c.name))
}

#[test]
fn every_door_renders_the_same_dispatch() {
    let cases = cases();
    let (mut wrong, mut filter_wrong) = (Vec::new(), Vec::new());
    let mut splits = 0;
    for c in &cases {
        let store = c.store();
        let callout = expected(&c.snap, &store, At::Filter);
        let client_sends = expected(&c.snap, &store, At::Select);
        let one = expected(&c.snap, &store, At::ExtProc);
        splits += usize::from(matches!(callout, Dispatch::Split(_)));

        let want = if c.stale {
            // Without fresh state the filter cannot tell a disaggregated
            // model: it scrubs every body.
            Seen::FailedOpen { scrubbed: true }
        } else {
            want_filter(&callout)
        };
        let seen = filter_seen(c);
        if seen != want {
            filter_wrong.push(format!(
                "{}: the filter\n    saw  {seen:?}\n    want {want:?}",
                c.name
            ));
        }
        let (seen, want) = (select_seen(c), want_select(&client_sends));
        if seen != want {
            wrong.push(format!(
                "{}: /select\n    saw  {seen:?}\n    want {want:?}",
                c.name
            ));
        }
        let (seen, want) = (extproc_seen(c), want_extproc(&one));
        if seen != want {
            wrong.push(format!(
                "{}: ext_proc\n    saw  {seen:?}\n    want {want:?}",
                c.name
            ));
        }
        wrong.extend(check_no_leg_at_door(c, &callout, &one));
    }
    // The generated fleets cover what they are meant to.
    assert!(splits > 20, "only {splits} split cases");
    wrong.extend(filter_wrong);
    assert!(
        wrong.is_empty(),
        "{} of {} cases disagree:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}
