//! The rules between a plan and a door, one test per rule.

use super::*;
use crate::plan::fixtures::worker;
use crate::plan::request::{Endpoint, parse};
use crate::plan::{Ask, plan};
use crate::reply::Reason;
use crate::state::{
    DEFAULT_TENANT, Disaggregation, ModelState, RankLoad, Role, Snapshot, WorkerState,
};
use std::collections::HashMap;

fn rank(slot: u16) -> RankLoad {
    RankLoad {
        slot,
        kv_total_blocks: 1000,
        max_num_batched_tokens: 8192,
        ..Default::default()
    }
}

fn with_role(id: u64, role: Role, slot: u16) -> WorkerState {
    WorkerState {
        role,
        ..worker(id, vec![rank(slot)])
    }
}

/// A model of `roles` (worker ids 1.., slots 0..), idle, with
/// `disaggregation` settings.
fn fleet(roles: &[Role], disaggregation: Option<Disaggregation>) -> Snapshot {
    Snapshot {
        models: vec![ModelState {
            name: "m".into(),
            shard_count: 8,
            workers: roles
                .iter()
                .enumerate()
                .map(|(i, r)| with_role(i as u64 + 1, *r, i as u16))
                .collect(),
            disaggregation,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn nixl() -> Option<Disaggregation> {
    Some(Disaggregation::default())
}

fn sglang(on_prefill_failure: OnPrefillFailure) -> Option<Disaggregation> {
    Some(Disaggregation {
        protocol: Protocol::Sglang,
        on_prefill_failure,
        ..Disaggregation::default()
    })
}

/// 320 tokens, none cached: never local by the conditional rule.
fn decide(s: &Snapshot, door: Door, body: Option<Body>) -> Dispatch {
    let tokens: Vec<u32> = (0..320).collect();
    let text = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let req = parse(Endpoint::Completions, text.as_bytes()).unwrap();
    let store: HashMap<String, Vec<u8>> = HashMap::new();
    let mut read = |k: &str| store.get(k).cloned();
    let p = plan(s, &req, DEFAULT_TENANT, &Ask::default(), &mut read, &[]);
    dispatch(&p, door, body)
}

fn refused_for(d: &Dispatch) -> Reason {
    match d {
        Dispatch::Refuse(Refusal::Unservable(r)) => r.reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_model_without_settings_goes_whole_and_verbatim() {
    let s = fleet(&[Role::Both, Role::Both], None);
    let Dispatch::Whole(w) = decide(&s, Door::CALLOUT, None) else {
        panic!("whole");
    };
    assert_eq!(w.body, WholeBody::Verbatim);
    assert_eq!(w.why, None);
    assert_eq!((w.target.prefill_tokens, w.target.decode_blocks), (320, 20));
    assert!(w.fallback.is_some());
}

#[test]
fn a_split_books_the_prompt_on_the_prefill_leg_and_the_blocks_on_the_decode_leg() {
    let s = fleet(&[Role::Prefill, Role::Prefill, Role::Decode], nixl());
    let Dispatch::Split(sp) = decide(&s, Door::CALLOUT, None) else {
        panic!("split");
    };
    assert_eq!(sp.protocol, Protocol::VllmNixl);
    assert_eq!(sp.decode.role, Role::Decode);
    assert_eq!((sp.decode.prefill_tokens, sp.decode.decode_blocks), (0, 20));
    assert_eq!(
        (sp.prefill.prefill_tokens, sp.prefill.decode_blocks),
        (320, 0)
    );
    assert!(sp.runner_up.is_some());
    assert_eq!(sp.local_prefill_tokens, 320);
    assert_eq!(sp.timeout_ms, Disaggregation::default().prefill_timeout_ms);
}

#[test]
fn a_disaggregated_model_is_scrubbed_whole_whatever_the_reason() {
    // The prefill pool is down: not split now, scrubbed all the same.
    let s = fleet(&[Role::Decode, Role::Decode], nixl());
    let Dispatch::Whole(w) = decide(&s, Door::CALLOUT, None) else {
        panic!("whole");
    };
    assert_eq!(w.body, WholeBody::Scrubbed);
    assert_eq!(w.why, Some(WholeWhy::NotSplit));
    // A `both` worker chosen for both legs computes the prompt itself.
    let mut s = fleet(&[Role::Both, Role::Prefill, Role::Decode], nixl());
    s.models[0].workers[1].ranks[0].active_prefill_tokens = 6000;
    s.models[0].workers[2].ranks[0].active_decode_blocks = 600;
    let Dispatch::Whole(w) = decide(&s, Door::CALLOUT, None) else {
        panic!("whole");
    };
    assert_eq!(w.why, Some(WholeWhy::Local(LocalReason::SameWorker)));
    assert_eq!(w.body, WholeBody::Scrubbed);
}

#[test]
fn sglang_goes_whole_only_to_a_both_worker_and_never_retries_on_another_role() {
    for on_failure in [OnPrefillFailure::Local, OnPrefillFailure::Fail] {
        // The prefill pool down: a decode worker cannot take it whole.
        let s = fleet(&[Role::Decode, Role::Decode], sglang(on_failure));
        assert_eq!(
            refused_for(&decide(&s, Door::CALLOUT, None)),
            Reason::PrefillFailed
        );
    }
    // A `both` worker takes it whole; a decode worker beside it is no
    // fallback.
    let mut s = fleet(&[Role::Both, Role::Decode], sglang(OnPrefillFailure::Local));
    s.models[0].workers[1].ranks[0].active_decode_blocks = 500;
    let Dispatch::Whole(w) = decide(&s, Door::CALLOUT, None) else {
        panic!("whole");
    };
    assert_eq!(w.target.role, Role::Both);
    assert_eq!(w.fallback, None);
}

#[test]
fn a_door_without_a_prefill_leg_serves_a_split_as_a_failed_leg() {
    let s = fleet(&[Role::Prefill, Role::Decode], nixl());
    let Dispatch::Whole(w) = decide(&s, Door::ONE_UPSTREAM, None) else {
        panic!("whole");
    };
    assert_eq!(w.why, Some(WholeWhy::NoLegAtDoor));
    assert_eq!(w.target.role, Role::Decode);
    assert_eq!(
        w.target.prefill_tokens, 320,
        "the decode worker books the prompt it computes"
    );
    let fail = Some(Disaggregation {
        on_prefill_failure: OnPrefillFailure::Fail,
        ..Disaggregation::default()
    });
    let s = fleet(&[Role::Prefill, Role::Decode], fail);
    assert_eq!(
        refused_for(&decide(&s, Door::ONE_UPSTREAM, None)),
        Reason::PrefillFailed
    );
    // SGLang's decode worker cannot compute it, whatever the policy.
    let s = fleet(
        &[Role::Prefill, Role::Decode],
        sglang(OnPrefillFailure::Local),
    );
    assert_eq!(
        refused_for(&decide(&s, Door::ONE_UPSTREAM, None)),
        Reason::PrefillFailed
    );
}

#[test]
fn a_decode_body_past_the_headroom_is_computed_where_it_is_decoded() {
    let s = fleet(&[Role::Prefill, Role::Decode], nixl());
    let fits = Body {
        len: 1000,
        max: 4096,
        isl_tokens: 320,
    };
    assert!(matches!(
        decide(&s, Door::CALLOUT, Some(fits)),
        Dispatch::Split(_)
    ));
    let over = Body {
        len: 4096 + disagg::DECODE_HEADROOM_BYTES,
        ..fits
    };
    let Dispatch::Whole(w) = decide(&s, Door::CALLOUT, Some(over)) else {
        panic!("whole");
    };
    assert_eq!(w.why, Some(WholeWhy::NoRoom));
    let fail = Some(Disaggregation {
        on_prefill_failure: OnPrefillFailure::Fail,
        ..Disaggregation::default()
    });
    let s = fleet(&[Role::Prefill, Role::Decode], fail);
    assert_eq!(
        refused_for(&decide(&s, Door::CALLOUT, Some(over))),
        Reason::BodyTooLarge
    );
}

#[test]
fn a_failed_leg_tries_the_runner_up_once_while_a_tenth_of_the_budget_is_left() {
    let s = fleet(&[Role::Prefill, Role::Prefill, Role::Decode], nixl());
    let Dispatch::Split(mut sp) = decide(&s, Door::CALLOUT, None) else {
        panic!("split");
    };
    let budget_us = sp.timeout_ms * 1000;
    let mut late = sp.clone();
    assert!(
        matches!(
            late.after_failure(false, budget_us / 10 - 1),
            AfterFailure::Local {
                prefill_tokens: 320
            }
        ),
        "too little left for a second try"
    );
    let AfterFailure::Retry(next) = sp.after_failure(false, budget_us / 10) else {
        panic!("retry");
    };
    assert_ne!(next.worker_id, sp.prefill.worker_id);
    assert_eq!(
        sp.after_failure(true, budget_us),
        AfterFailure::Local {
            prefill_tokens: 320
        }
    );
    sp.on_failure = OnPrefillFailure::Fail;
    assert_eq!(sp.after_failure(true, budget_us), AfterFailure::Refuse);
}

#[test]
fn a_plan_rejection_is_the_doors_to_answer() {
    let s = fleet(&[], nixl());
    assert_eq!(
        decide(&s, Door::CALLOUT, None),
        Dispatch::Refuse(Refusal::Plan(Rejection::NoWorkers))
    );
}
