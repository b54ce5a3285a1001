use super::*;
use kvgate_core::hash::{XXH3_SEED, block_hashes};
use kvgate_core::shard::{Holder, TIER_DEVICE, TIER_HOST, encode, shard_of};
use kvgate_core::update::shard_key;
use kvgate_core::{RankLoad, Snapshot, WorkerState};
use std::collections::HashMap;

const SHARDS: u32 = 8;

fn snapshot() -> Snapshot {
    let worker = |id: u64, slots: &[u16]| WorkerState {
        id,
        endpoint: format!("10.0.0.{id}:8000"),
        block_size: 16,
        ranks: slots
            .iter()
            .enumerate()
            .map(|(r, s)| RankLoad {
                rank: r as u32,
                slot: *s,
                ..Default::default()
            })
            .collect(),
        tenant: kvgate_core::DEFAULT_TENANT.into(),
        thermal: Default::default(),
        draining: false,
        role: Default::default(),
        bootstrap_port: 0,
        fits: None,
        topology: Default::default(),
    };
    Snapshot {
        version: 1,
        models: vec![ModelState {
            name: "m".into(),
            shard_count: SHARDS,
            workers: vec![worker(1, &[0]), worker(2, &[1, 2])],
            retry_after_s: 3,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn tokens() -> Vec<u32> {
    (0..160).collect()
}

/// Worker 2's rank 1 (slot 2) holds the first 6 blocks on the GPU and 8 on
/// host; its rank 0 (slot 1) the first 2 on the GPU.
fn shards() -> HashMap<String, Vec<u8>> {
    let seq = sequence_hashes(&block_hashes(&tokens(), 16, XXH3_SEED));
    let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
    for (i, h) in seq.iter().enumerate() {
        let mut holders = Vec::new();
        if i < 2 {
            holders.push(Holder {
                slot: 1,
                tiers: TIER_DEVICE,
            });
        }
        if i < 8 {
            let tiers = if i < 6 {
                TIER_DEVICE | TIER_HOST
            } else {
                TIER_HOST
            };
            holders.push(Holder { slot: 2, tiers });
        }
        if !holders.is_empty() {
            per_shard
                .entry(shard_of(*h, SHARDS))
                .or_default()
                .push((*h, holders));
        }
    }
    per_shard
        .into_iter()
        .map(|(s, mut e)| (shard_key("m", s), encode(&mut e)))
        .collect()
}

fn run(snap: &Snapshot, req: &SelectRequest) -> Result<SelectionView, Refused> {
    let store = shards();
    let model = snap
        .model(&req.model_name)
        .ok_or(Refused::Plan(Rejection::UnknownModel))?;
    selection(model, req, 0, &mut |k: &str| store.get(k).cloned()).map(|s| s.view)
}

fn by_tokens() -> SelectRequest {
    SelectRequest {
        selection_id: Some("select-1".into()),
        model_name: "m".into(),
        tenant_id: "default".into(),
        prompt: Prompt {
            token_ids: Some(tokens()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// [`by_tokens`] with another prompt.
fn with_prompt(prompt: Prompt) -> SelectRequest {
    SelectRequest {
        prompt,
        ..by_tokens()
    }
}

#[test]
fn the_holder_is_selected_with_dynamos_overlap_shape() {
    let v = run(&snapshot(), &by_tokens()).unwrap();
    assert_eq!((v.worker_id, v.dp_rank), (2, 1));
    assert_eq!(v.endpoint, "10.0.0.2:8000");
    assert_eq!(v.selection_id.as_deref(), Some("select-1"));
    assert_eq!(
        v.overlap,
        OverlapView {
            longest_matched: 128,
            gpu: 96,
            dp: [("0".to_string(), 32), ("1".to_string(), 96)].into(),
            cpu: 128,
            disk: 128,
        }
    );
    assert_eq!(v.effective_prefill_tokens, 160 - 96);
}

#[test]
fn hashes_from_the_client_select_as_its_tokens_do() {
    let snap = snapshot();
    let want = run(&snap, &by_tokens()).unwrap();
    let local = block_hashes(&tokens(), 16, XXH3_SEED);
    let by_seq = with_prompt(Prompt {
        sequence_hashes: Some(sequence_hashes(&local)),
        isl_tokens: Some(160),
        ..Default::default()
    });
    assert_eq!(run(&snap, &by_seq).unwrap(), want);
    let by_local = with_prompt(Prompt {
        sequence_hashes: None,
        block_hashes: Some(local),
        ..by_seq.prompt.clone()
    });
    assert_eq!(run(&snap, &by_local).unwrap(), want);
}

#[test]
fn a_prompt_given_wrongly_is_a_bad_request() {
    let snap = snapshot();
    let bad = |r: SelectRequest| match run(&snap, &r) {
        Err(Refused::BadRequest(m)) => m,
        other => panic!("{other:?}"),
    };
    let none = with_prompt(Prompt::default());
    assert!(bad(none).contains("one way"));
    let two = with_prompt(Prompt {
        text: Some("hello".into()),
        ..by_tokens().prompt
    });
    assert!(bad(two).contains("one way"));
    let hashes = |isl| Prompt {
        sequence_hashes: Some(vec![1, 2, 3]),
        isl_tokens: isl,
        ..Default::default()
    };
    assert!(bad(with_prompt(hashes(None))).contains("isl_tokens"));
    assert!(bad(with_prompt(hashes(Some(40)))).contains("more than isl_tokens"));
    let salted = with_prompt(Prompt {
        cache_salt: Some("s".into()),
        ..hashes(Some(64))
    });
    assert!(bad(salted).contains("cache_salt"));
    let empty = with_prompt(Prompt {
        token_ids: Some(Vec::new()),
        ..Default::default()
    });
    assert!(bad(empty).contains("empty"));
}

#[test]
fn refusals_say_why() {
    let mut snap = snapshot();
    let unknown = SelectRequest {
        model_name: "other".into(),
        ..by_tokens()
    };
    assert_eq!(
        run(&snap, &unknown),
        Err(Refused::Plan(Rejection::UnknownModel))
    );
    let stranger = SelectRequest {
        tenant_id: "team-x".into(),
        ..by_tokens()
    };
    assert_eq!(
        run(&snap, &stranger),
        Err(Refused::Plan(Rejection::NoWorkers))
    );
    for w in &mut snap.models[0].workers {
        for r in &mut w.ranks {
            r.busy = true;
        }
    }
    assert_eq!(
        run(&snap, &by_tokens()),
        Err(Refused::Plan(Rejection::AllBusy { retry_after_s: 3 }))
    );
}

/// [`snapshot`] split: worker 1 prefills, worker 2 (ranks 0 and 1)
/// decodes.
fn split(d: kvgate_core::Disaggregation) -> Snapshot {
    let mut s = snapshot();
    s.models[0].workers[0].role = kvgate_core::Role::Prefill;
    s.models[0].workers[1].role = kvgate_core::Role::Decode;
    s.models[0].disaggregation = Some(d);
    s
}

#[test]
fn a_disaggregated_model_answers_both_legs() {
    use super::views::{LegView, SplitView};
    use kvgate_core::Disaggregation;
    use kvgate_core::disagg::Conditional;
    // The decode worker's rank 1 holds 96 of the 160 tokens: 64 uncached,
    // under 2048 and under 70 %: computed there.
    let v = run(&split(Disaggregation::default()), &by_tokens()).unwrap();
    assert_eq!(
        (v.worker_id, v.dp_rank, v.effective_prefill_tokens),
        (2, 1, 64)
    );
    let d = v.disaggregation.expect("a split model says so");
    assert_eq!(
        (d.local_prefill, d.local_reason.as_deref()),
        (true, Some("conditional"))
    );
    assert_eq!(d.prefill, None);
    assert_eq!((d.decode.worker_id, d.decode.dp_rank), (2, 1));
    // With the rule off, a prefill leg on the prefill worker, and the
    // client's worker (the decode worker) computes no prompt.
    let off = Disaggregation {
        conditional: Conditional {
            max_uncached_tokens: 0,
            ..Conditional::default()
        },
        ..Disaggregation::default()
    };
    let v = run(&split(off), &by_tokens()).unwrap();
    assert_eq!(
        (v.worker_id, v.dp_rank, v.effective_prefill_tokens),
        (2, 1, 0)
    );
    assert_eq!(
        v.disaggregation,
        Some(SplitView {
            decode: LegView {
                worker_id: 2,
                dp_rank: 1,
                endpoint: "10.0.0.2:8000".into(),
                effective_prefill_tokens: 0,
                decode_blocks: 4,
                reservation_id: None,
            },
            prefill: Some(LegView {
                worker_id: 1,
                dp_rank: 0,
                endpoint: "10.0.0.1:8000".into(),
                effective_prefill_tokens: 160,
                decode_blocks: 0,
                reservation_id: None,
            }),
            local_prefill: false,
            local_reason: None,
        })
    );
    // A model served whole answers in Dynamo's shape, unchanged.
    let whole = serde_json::to_value(run(&snapshot(), &by_tokens()).unwrap()).unwrap();
    assert!(whole.get("disaggregation").is_none(), "{whole}");
}

#[test]
fn a_disaggregated_model_sheds_when_no_decode_worker_is_free() {
    let mut s = split(kvgate_core::Disaggregation::default());
    for r in &mut s.models[0].workers[1].ranks {
        r.busy = true;
    }
    assert_eq!(
        run(&s, &by_tokens()),
        Err(Refused::Plan(Rejection::AllBusy { retry_after_s: 3 }))
    );
}

/// [`split`] with SGLang's protocol.
fn sglang(on_prefill_failure: kvgate_core::OnPrefillFailure) -> Snapshot {
    split(kvgate_core::Disaggregation {
        protocol: kvgate_core::Protocol::Sglang,
        on_prefill_failure,
        ..kvgate_core::Disaggregation::default()
    })
}

#[test]
fn an_sglang_request_for_a_decode_worker_alone_is_refused_as_the_filter_refuses_it() {
    use kvgate_core::OnPrefillFailure;
    use kvgate_core::reply::Reason;
    let refused = |s: &Snapshot| match run(s, &by_tokens()) {
        Err(Refused::Unservable(r)) => r,
        other => panic!("{other:?}"),
    };
    // Decode worker 2 holds enough of the prompt for the conditional rule,
    // but SGLang's decode worker cannot compute it: it gets a prefill leg.
    let v = run(&sglang(OnPrefillFailure::Local), &by_tokens()).unwrap();
    let split = v.disaggregation.expect("a split");
    assert!(!split.local_prefill);
    assert_eq!(split.decode.worker_id, 2);
    assert_eq!(split.prefill.map(|p| p.worker_id), Some(1));
    // Without a prefill worker it is refused, whatever the policy.
    for policy in [OnPrefillFailure::Local, OnPrefillFailure::Fail] {
        let mut s = sglang(policy);
        s.models[0].workers.remove(0);
        assert_eq!(refused(&s).reason, Reason::PrefillFailed);
    }
    // A `both` worker takes it whole (with no decode worker up, the model
    // is not split now: answered as one served whole).
    let mut s = sglang(OnPrefillFailure::Local);
    s.models[0].workers[1].role = kvgate_core::Role::Both;
    let v = run(&s, &by_tokens()).unwrap();
    assert_eq!((v.worker_id, v.dp_rank), (2, 1));
    assert_eq!(v.disaggregation, None);
}

#[tokio::test]
async fn an_unservable_selection_is_a_503_naming_its_reason() {
    use http_body_util::BodyExt;
    let r = refused(
        &by_tokens(),
        Refused::Unservable(kvgate_core::reply::Reply::prefill_failed(
            "no prefill worker",
        )),
    );
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        r.headers().get(header::REASON).map(|v| v.as_bytes()),
        Some(&b"prefill_failed"[..])
    );
    let body = r.into_body().collect().await.unwrap().to_bytes();
    let e: views::ErrorView = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        e.error,
        "The prompt could not be prefilled: no prefill worker"
    );
}

#[test]
fn scheduler_fields_not_applied_are_named() {
    let plain = serde_json::to_value(run(&snapshot(), &by_tokens()).unwrap()).unwrap();
    assert!(plain.get("not_applied").is_none(), "{plain}");
    let knobs: SelectRequest = views::parse(
        serde_json::json!({
            "model_name": "m",
            "token_ids": tokens(),
            "priority_jump": 2.5,
            "routing_constraints": {"zone": "a"},
            "strict_priority": null,
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    // The priority fields pick the class; the others are not applied.
    assert_eq!(knobs.not_applied(), ["routing_constraints"]);
    let v = run(&snapshot(), &knobs).unwrap();
    assert_eq!(v.not_applied, ["routing_constraints"]);
    assert_eq!(
        (v.class.as_str(), plain["class"].as_str()),
        ("critical", Some("standard"))
    );
    // Nothing else changes on an idle fleet: the placement is the plain one's.
    assert_eq!(
        (v.worker_id, v.dp_rank),
        (plain["worker_id"].as_u64().unwrap(), 1)
    );
}

/// Index shards of model `m` in which `slot` holds the first `blocks`
/// blocks of [`tokens`] on its device.
fn held_by(slot: u16, blocks: usize) -> HashMap<String, Vec<u8>> {
    let seq = sequence_hashes(&block_hashes(&tokens(), 16, XXH3_SEED));
    let mut per_shard: HashMap<u32, Vec<(u64, Vec<Holder>)>> = HashMap::new();
    for h in seq.into_iter().take(blocks) {
        let holder = Holder {
            slot,
            tiers: TIER_DEVICE,
        };
        per_shard
            .entry(shard_of(h, SHARDS))
            .or_default()
            .push((h, vec![holder]));
    }
    per_shard
        .into_iter()
        .map(|(s, mut e)| (shard_key("m", s), encode(&mut e)))
        .collect()
}

/// Three `both` workers (1, 2, 3 on slots 0, 1, 2) of a model that pulls,
/// busy past 40 % of a cache in decode blocks; with `loaded`, worker 1
/// has 500 of its 1000 blocks in decode and is busy.
fn pulling(loaded: bool) -> Snapshot {
    use kvgate_core::disagg::pull::Pull;
    use kvgate_core::{Disaggregation, Protocol, Role, Thresholds};
    let mut s = snapshot();
    let template = s.models[0].workers[0].clone();
    let m = &mut s.models[0];
    m.workers = (1..=3u64)
        .map(|id| WorkerState {
            id,
            endpoint: format!("10.0.0.{id}:8000"),
            role: Role::Both,
            ranks: vec![RankLoad {
                slot: id as u16 - 1,
                kv_total_blocks: 1000,
                ..Default::default()
            }],
            ..template.clone()
        })
        .collect();
    if loaded {
        let r = &mut m.workers[0].ranks[0];
        (r.active_decode_blocks, r.kv_used_blocks, r.busy) = (500, 500, true);
    }
    m.thresholds = Thresholds {
        active_decode_blocks: Some(0.4),
        ..Default::default()
    };
    m.disaggregation = Some(Disaggregation {
        protocol: Protocol::VllmNixl,
        pull: Some(Pull::default()),
        ..Disaggregation::default()
    });
    s
}

fn run_held(snap: &Snapshot, store: &HashMap<String, Vec<u8>>) -> SelectionView {
    let model = snap.model("m").unwrap();
    selection(model, &by_tokens(), 0, &mut |k: &str| store.get(k).cloned())
        .unwrap()
        .view
}

#[test]
fn a_holder_busy_with_decode_is_named_for_the_prefill_leg_of_a_pull() {
    use super::views::{LegView, PlacementView};
    // Worker 1 holds 8 of the prompt's 10 blocks.
    let store = held_by(0, 8);
    let v = run_held(&pulling(true), &store);
    // 10 blocks of 16 tokens at 128 KiB a token over 100 Gbit/s.
    assert_eq!(
        v.placement,
        Some(PlacementView {
            kind: "pull".into(),
            blocks: 10,
            transfer_us: 1678,
        })
    );
    let d = v.disaggregation.clone().expect("a pull names both legs");
    assert_eq!(
        d.prefill,
        Some(LegView {
            worker_id: 1,
            dp_rank: 0,
            endpoint: "10.0.0.1:8000".into(),
            effective_prefill_tokens: 32,
            decode_blocks: 0,
            reservation_id: None,
        }),
        "the holder computes the uncached tail and keeps nothing"
    );
    assert!(!d.local_prefill);
    assert_ne!(d.decode.worker_id, 1);
    assert_eq!(
        (d.decode.effective_prefill_tokens, d.decode.decode_blocks),
        (0, 10),
        "the decode worker pulls the whole prompt"
    );
    // The client sends its request to the decode worker.
    assert_eq!(
        (v.worker_id, v.effective_prefill_tokens),
        (d.decode.worker_id, 0)
    );
    let json = serde_json::to_value(&v).unwrap();
    assert_eq!(json["placement"]["kind"], "pull", "{json}");

    // Idle, the holder keeps the request whole: one worker, no legs.
    let v = run_held(&pulling(false), &store);
    assert_eq!((v.worker_id, v.effective_prefill_tokens), (1, 32));
    assert_eq!(v.placement.map(|p| p.kind), Some("holder".to_string()));
    assert_eq!(v.disaggregation, None);
}
