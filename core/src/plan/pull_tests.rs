//! Placement on a model that pulls: the holder, a recompute, or a pull,
//! chosen per request by one cost.

use super::fixtures::{held, prompt, rank, worker};
use super::request::{Endpoint, parse};
use super::*;
use crate::disagg::pull::{Links, Pull};
use crate::dispatch::{AfterFailure, Dispatch, Door, dispatch};
use crate::fit::{Fit, WorkerFits};
use crate::state::{
    DEFAULT_TENANT, Disaggregation, OnPrefillFailure, Role, Slo, Thresholds, Topology,
};
use std::collections::HashMap;

/// Three idle `both` workers (slots 0, 1, 2) of a model that pulls, with
/// a busy bound on decode blocks at 40 % of the cache and on prefill
/// tokens at 4096; a model that would fail a split's failed leg.
fn fleet() -> Snapshot {
    Snapshot {
        models: vec![ModelState {
            name: "m".into(),
            shard_count: 8,
            thresholds: Thresholds {
                active_decode_blocks: Some(0.4),
                active_prefill_tokens: Some(4096),
                ..Default::default()
            },
            workers: (0..3u16)
                .map(|s| worker(u64::from(s) + 1, vec![rank(s, 0, 0)]))
                .collect(),
            disaggregation: Some(Disaggregation {
                on_prefill_failure: OnPrefillFailure::Fail,
                pull: Some(Pull {
                    min_blocks: 4,
                    ..Pull::default()
                }),
                ..Disaggregation::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Worker 1 holds the first 18 of the prompt's 20 blocks.
fn holder_store() -> HashMap<String, Vec<u8>> {
    held(&prompt(), &[(0, 18)])
}

/// Worker 1 with 500 decode blocks resident: busy by the decode bound.
fn decode_loaded(s: &mut Snapshot) {
    let r = &mut s.models[0].workers[0].ranks[0];
    (r.active_decode_blocks, r.kv_used_blocks, r.busy) = (500, 500, true);
}

fn run_with<'a>(s: &'a Snapshot, store: &HashMap<String, Vec<u8>>, ask: &Ask) -> Plan<'a> {
    let body = format!(r#"{{"model":"m","prompt":{:?}}}"#, prompt());
    let req = parse(Endpoint::Completions, body.as_bytes()).unwrap();
    let mut read = |k: &str| store.get(k).cloned();
    plan(s, &req, DEFAULT_TENANT, ask, &mut read, &[])
}

fn route<'a>(s: &'a Snapshot, store: &HashMap<String, Vec<u8>>) -> Route<'a> {
    match run_with(s, store, &Ask::default()) {
        Plan::Route(r) => r,
        other => panic!("expected a route, got {other:?}"),
    }
}

fn kind(r: &Route<'_>) -> Kind {
    r.pull.expect("a model that pulls names its placement").kind
}

#[test]
fn an_idle_holder_keeps_its_request_whole() {
    let s = fleet();
    let r = route(&s, &holder_store());
    assert_eq!(kind(&r), Kind::Holder);
    assert_eq!(r.first.choice.worker.id, 1);
    assert_eq!(r.prefill, None);
    assert_eq!(r.first.prefill_tokens, 320 - 18 * 16);
}

#[test]
fn a_holder_busy_with_decode_prefills_and_an_idle_worker_pulls() {
    let mut s = fleet();
    decode_loaded(&mut s);
    let r = route(&s, &holder_store());
    let placed = r.pull.expect("placed");
    assert_eq!(placed.kind, Kind::Pull);
    assert_eq!(placed.blocks, 20, "every block the decode worker lacks");
    assert!(placed.transfer_ms > 0.0);
    let Some(Prefill::Remote(leg)) = &r.prefill else {
        panic!("a pull is a prefill leg on the holder: {:?}", r.prefill);
    };
    assert_eq!(leg.first.choice.worker.id, 1);
    assert_eq!(
        (leg.first.prefill_tokens, leg.first.decode_blocks),
        (32, 0),
        "the holder computes the uncached tail and keeps no blocks"
    );
    assert_eq!(leg.runner_up, None);
    assert_ne!(r.first.choice.worker.id, 1);
    assert_eq!(
        (r.first.prefill_tokens, r.first.decode_blocks),
        (0, 20),
        "the decode worker computes nothing and holds the whole prompt"
    );
    assert_eq!(leg.local_prefill_tokens, 320);
    // Its failed leg is computed on the decode worker, though the model
    // fails a split's.
    let Dispatch::Split(mut split) = dispatch(&Plan::Route(r), Door::CALLOUT, None) else {
        panic!("a pull is split");
    };
    assert_eq!(split.pull.map(|p| p.kind), Some(Kind::Pull));
    assert_eq!(
        split.after_failure(false, u64::MAX),
        AfterFailure::Local {
            prefill_tokens: 320
        }
    );
}

#[test]
fn a_holder_queued_with_prompts_loses_to_a_recompute() {
    let mut s = fleet();
    decode_loaded(&mut s);
    s.models[0].workers[0].ranks[0].active_prefill_tokens = 5000;
    let r = route(&s, &holder_store());
    assert_eq!(kind(&r), Kind::Recompute);
    assert_eq!(r.pull.map(|p| p.blocks), Some(18));
    assert_ne!(r.first.choice.worker.id, 1);
    assert_eq!(r.prefill, None);
}

#[test]
fn a_holder_with_requests_waiting_queues_no_prefill_leg() {
    // Its engine has a queue: a prefill leg would wait behind it as long
    // as a whole request, so the idle worker recomputes instead.
    let mut s = fleet();
    decode_loaded(&mut s);
    s.models[0].workers[0].ranks[0].waiting = 2;
    let r = route(&s, &holder_store());
    assert_eq!(kind(&r), Kind::Recompute);
    assert_eq!(r.prefill, None);
}

#[test]
fn the_floor_keeps_a_short_prefix_where_it_is_computed() {
    let mut s = fleet();
    decode_loaded(&mut s);
    if let Some(d) = &mut s.models[0].disaggregation {
        d.pull = d.pull.map(|p| Pull {
            min_blocks: 19,
            ..p
        });
    }
    let r = route(&s, &holder_store());
    assert_eq!(kind(&r), Kind::Recompute);
    assert_eq!(r.prefill, None);
}

#[test]
fn an_evicted_holder_leaves_nothing_to_pull() {
    let mut s = fleet();
    decode_loaded(&mut s);
    let r = route(&s, &HashMap::new());
    assert_eq!(kind(&r), Kind::Holder, "no worker holds a prefix");
    assert_eq!(r.pull.map(|p| p.blocks), Some(0));
    assert_eq!(r.prefill, None);
    assert_ne!(r.first.choice.worker.id, 1, "the loaded worker is busy");
}

#[test]
fn the_link_follows_topology() {
    // Workers 1 and 2 share a node; worker 3, a little less loaded, is
    // elsewhere behind a link too slow for a pull to pay.
    let mut s = fleet();
    decode_loaded(&mut s);
    if let Some(d) = &mut s.models[0].disaggregation {
        d.pull = d.pull.map(|p| Pull {
            link: Links {
                same_node_gbps: 400.0,
                same_rack_gbps: 100.0,
                elsewhere_gbps: 1.0,
            },
            ..p
        });
    }
    let on = |node: &str, rack: &str| Topology {
        node: node.into(),
        rack: rack.into(),
    };
    let w = &mut s.models[0].workers;
    w[0].topology = on("a", "r1");
    w[1].topology = on("a", "r1");
    w[1].ranks[0].active_decode_blocks = 5;
    w[2].topology = on("b", "r2");
    let r = route(&s, &holder_store());
    assert_eq!(kind(&r), Kind::Pull);
    assert_eq!(
        r.first.choice.worker.id, 2,
        "the worker on the holder's node"
    );
    // Where the place is unknown, the link is the slow one: the pull
    // costs more than it saves.
    s.models[0].workers[1].topology = Topology::default();
    let r = route(&s, &holder_store());
    assert_eq!(kind(&r), Kind::Recompute);
}

#[test]
fn a_door_without_a_prefill_leg_never_pulls() {
    let mut s = fleet();
    decode_loaded(&mut s);
    let ask = Ask {
        one_upstream: true,
        ..Ask::default()
    };
    let Plan::Route(r) = run_with(&s, &holder_store(), &ask) else {
        panic!("routed");
    };
    assert_eq!(r.pull, None);
    assert_eq!(r.prefill, None);
}

#[test]
fn a_pull_predicted_to_miss_the_target_is_not_made() {
    let mut s = fleet();
    decode_loaded(&mut s);
    let fit = |ms_per_ktok: f32| WorkerFits {
        ttft: Fit {
            intercept_ms: 20.0,
            slope_ms_per_ktok: ms_per_ktok,
            samples: 50,
            age_s: 1,
        },
        itl: Fit::default(),
    };
    s.models[0].workers[0].fits = Some(fit(100.0));
    let ask = |ttft_ms| Ask {
        slo: Some(Slo { ttft_ms, itl_ms: 0 }),
        ..Ask::default()
    };
    let Plan::Route(r) = run_with(&s, &holder_store(), &ask(1000)) else {
        panic!("routed");
    };
    assert_eq!(kind(&r), Kind::Pull);
    let predicted = r.first.choice.ttft_ms.expect("the holder's fit predicts");
    // 32 tokens at 100 ms per thousand after 20 ms, and the transfer.
    assert!(
        predicted > 23.2 && predicted < 23.2 + r.pull.unwrap().transfer_ms + 0.01,
        "{predicted}"
    );
    let Plan::Route(r) = run_with(&s, &holder_store(), &ask(21)) else {
        panic!("routed");
    };
    assert_ne!(kind(&r), Kind::Pull);
}

#[test]
fn only_a_nixl_model_of_both_workers_pulls() {
    let mut s = fleet();
    decode_loaded(&mut s);
    s.models[0].workers[1].role = Role::Prefill;
    s.models[0].workers[2].role = Role::Decode;
    assert!(s.models[0].pulls().is_none(), "a split model splits");
    let mut s = fleet();
    if let Some(d) = &mut s.models[0].disaggregation {
        d.protocol = crate::state::Protocol::Sglang;
    }
    assert!(
        s.models[0].pulls().is_none(),
        "SGLang's decode pulls nothing"
    );
    let mut s = fleet();
    if let Some(d) = &mut s.models[0].disaggregation {
        d.pull = None;
    }
    decode_loaded(&mut s);
    let r = route(&s, &holder_store());
    assert_eq!((r.pull, r.prefill), (None, None), "pulls are off");
}
