//! Placement on a disaggregated model: two placements per request, the
//! conditional rule between them, and shedding per leg.

use super::fixtures::{held, prompt, rank, worker};
use super::request::{Endpoint, parse};
use super::*;
use crate::state::{DEFAULT_TENANT, Disaggregation, RankLoad, Role, Thresholds, WorkerState};
use std::collections::HashMap;

fn with_role(id: u64, role: Role, r: RankLoad) -> WorkerState {
    WorkerState {
        role,
        ..worker(id, vec![r])
    }
}

/// Prefill workers 1 and 2 (slots 0, 1), decode workers 3 and 4 (slots
/// 2, 3), all idle; the default disaggregation.
fn fleet() -> Snapshot {
    Snapshot {
        models: vec![ModelState {
            name: "m".into(),
            shard_count: 8,
            retry_after_s: 7,
            workers: vec![
                with_role(1, Role::Prefill, rank(0, 0, 0)),
                with_role(2, Role::Prefill, rank(1, 0, 0)),
                with_role(3, Role::Decode, rank(2, 0, 0)),
                with_role(4, Role::Decode, rank(3, 0, 0)),
            ],
            disaggregation: Some(Disaggregation::default()),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn workers(s: &mut Snapshot) -> &mut Vec<WorkerState> {
    &mut s.models[0].workers
}

fn run<'a>(s: &'a Snapshot, store: &HashMap<String, Vec<u8>>, tenant: &str) -> Plan<'a> {
    let body = format!(r#"{{"model":"m","prompt":{:?}}}"#, prompt());
    let req = parse(Endpoint::Completions, body.as_bytes()).unwrap();
    let mut read = |k: &str| store.get(k).cloned();
    plan(s, &req, tenant, &Ask::default(), &mut read, &[])
}

fn route<'a>(s: &'a Snapshot, store: &HashMap<String, Vec<u8>>) -> Route<'a> {
    match run(s, store, DEFAULT_TENANT) {
        Plan::Route(r) => r,
        other => panic!("expected a route, got {other:?}"),
    }
}

fn remote<'r, 'a>(r: &'r Route<'a>) -> &'r PrefillLeg<'a> {
    match &r.prefill {
        Some(Prefill::Remote(leg)) => leg,
        other => panic!("expected a prefill leg, got {other:?}"),
    }
}

fn id(p: &Placement<'_>) -> u64 {
    p.choice.worker.id
}

#[test]
fn decode_goes_by_load_and_prefill_by_overlap_then_load() {
    let mut s = fleet();
    workers(&mut s)[2].ranks[0].active_decode_blocks = 50;
    workers(&mut s)[3].ranks[0].active_decode_blocks = 10;
    // Prefill worker 2 holds half the prompt.
    let store = held(&prompt(), &[(1, 10)]);
    let r = route(&s, &store);
    assert_eq!(id(&r.first), 4, "the less loaded decode worker");
    assert_eq!(r.fallback.map(|f| id(&f)), Some(3));
    let leg = remote(&r);
    assert_eq!(id(&leg.first), 2, "the holder of the prefix");
    assert_eq!(leg.runner_up.map(|p| id(&p)), Some(1));
    // Each leg books its own load: the prompt's uncached part where it is
    // computed, the blocks where they stay.
    assert_eq!(
        (leg.first.prefill_tokens, leg.first.decode_blocks),
        (160, 0)
    );
    assert_eq!((r.first.prefill_tokens, r.first.decode_blocks), (0, 20));
    assert_eq!(leg.local_prefill_tokens, 320);
    assert!(!r.set_rank && !leg.first.names_rank());

    // A prefix does not hold a prefill worker that is far busier.
    workers(&mut s)[1].ranks[0].active_prefill_tokens = 960;
    let r = route(&s, &store);
    assert_eq!(id(&remote(&r).first), 1);
}

#[test]
fn the_decode_affinity_weighs_the_decode_workers_own_prefix() {
    let mut s = fleet();
    // Decode worker 3 holds 12 of the 20 blocks but carries more load.
    workers(&mut s)[2].ranks[0].active_decode_blocks = 40;
    workers(&mut s)[3].ranks[0].active_decode_blocks = 10;
    let store = held(&prompt(), &[(2, 12)]);
    let r = route(&s, &store);
    assert_eq!(
        id(&r.first),
        3,
        "the default affinity is the overlap credit"
    );
    // 128 uncached tokens: under 2048 and under 70 % of 320.
    assert_eq!(r.prefill, Some(Prefill::Local(LocalReason::Conditional)));
    assert_eq!(
        (r.first.prefill_tokens, r.first.decode_blocks),
        (128, 8),
        "a local prefill books the prompt on the decode worker too"
    );
    // Affinity 0 (Dynamo's): by load alone; nothing cached there, so a
    // prefill leg.
    s.models[0].disaggregation = Some(Disaggregation {
        decode_affinity: 0.0,
        ..Disaggregation::default()
    });
    let r = route(&s, &store);
    assert_eq!(id(&r.first), 4);
    assert_eq!(remote(&r).first.prefill_tokens, 320);
    // The rule turned off: even a mostly cached prompt gets its leg.
    s.models[0].disaggregation = Some(Disaggregation {
        conditional: crate::disagg::Conditional {
            max_uncached_tokens: 0,
            max_uncached_ratio: 0.7,
        },
        ..Disaggregation::default()
    });
    let r = route(&s, &store);
    assert_eq!(id(&r.first), 3);
    assert_eq!(id(&remote(&r).first), 1, "tied prefill workers, idle");
    assert_eq!(r.first.prefill_tokens, 0);
}

#[test]
fn an_sglang_decode_worker_gets_a_prefill_leg_however_much_it_holds() {
    let mut s = fleet();
    s.models[0].disaggregation = Some(Disaggregation {
        protocol: crate::state::Protocol::Sglang,
        ..Disaggregation::default()
    });
    // Decode worker 3 holds 12 of the 20 blocks: the rule would keep the
    // prompt there, but an SGLang decode worker cannot compute it.
    let store = held(&prompt(), &[(2, 12)]);
    let r = route(&s, &store);
    assert_eq!(id(&r.first), 3);
    assert_eq!(remote(&r).first.prefill_tokens, 320);
    // A `both` worker can: the rule holds for it.
    workers(&mut s)[2].role = Role::Both;
    let r = route(&s, &store);
    assert_eq!(r.prefill, Some(Prefill::Local(LocalReason::Conditional)));
}

#[test]
fn both_workers_take_either_leg() {
    let mut s = fleet();
    let mut both = with_role(5, Role::Both, rank(4, 0, 30));
    both.endpoint = "10.0.0.5:8000".into();
    workers(&mut s).push(both);
    // Both prefill workers busy: the both worker computes the prompt for
    // the idle decode worker.
    workers(&mut s)[0].ranks[0].busy = true;
    workers(&mut s)[1].ranks[0].busy = true;
    let r = route(&s, &HashMap::new());
    assert_eq!(id(&r.first), 3);
    assert_eq!(id(&remote(&r).first), 5);
    // Every decode worker busy too: the both worker takes the decode leg,
    // and then the prompt stays on it, with nothing to transfer.
    workers(&mut s)[2].ranks[0].busy = true;
    workers(&mut s)[3].ranks[0].busy = true;
    let r = route(&s, &HashMap::new());
    assert_eq!(id(&r.first), 5);
    assert_eq!(r.prefill, Some(Prefill::Local(LocalReason::SameWorker)));
    assert_eq!((r.first.prefill_tokens, r.first.decode_blocks), (320, 20));
}

#[test]
fn each_leg_sheds_as_a_whole_request_does() {
    let mut s = fleet();
    for w in workers(&mut s)
        .iter_mut()
        .filter(|w| w.role == Role::Decode)
    {
        w.ranks[0].busy = true;
    }
    assert_eq!(
        run(&s, &HashMap::new(), DEFAULT_TENANT),
        Plan::Reject(Rejection::AllBusy { retry_after_s: 7 }),
        "no decode worker free"
    );
    workers(&mut s)[2].ranks[0].busy = false;
    workers(&mut s)[2].thermal = crate::state::Thermal {
        cap: 2,
        in_flight: 2,
        ..Default::default()
    };
    assert_eq!(
        run(&s, &HashMap::new(), DEFAULT_TENANT),
        Plan::Reject(Rejection::Thermal { retry_after_s: 7 })
    );

    // No prefill worker free: the default policy prefills on the decode
    // worker, which then books the whole prompt.
    let mut s = fleet();
    for w in workers(&mut s)
        .iter_mut()
        .filter(|w| w.role == Role::Prefill)
    {
        w.ranks[0].busy = true;
    }
    let r = route(&s, &HashMap::new());
    assert_eq!(
        r.prefill,
        Some(Prefill::Local(LocalReason::NoPrefillWorker))
    );
    assert_eq!(r.first.prefill_tokens, 320);
    // With `fail`, shed.
    s.models[0].disaggregation = Some(Disaggregation {
        on_prefill_failure: OnPrefillFailure::Fail,
        ..Disaggregation::default()
    });
    assert_eq!(
        run(&s, &HashMap::new(), DEFAULT_TENANT),
        Plan::Reject(Rejection::AllBusy { retry_after_s: 7 })
    );
    // Unless the rule keeps the prompt on the decode worker anyway.
    let store = held(&prompt(), &[(2, 15), (3, 15)]);
    let r = route(&s, &store);
    assert_eq!(r.prefill, Some(Prefill::Local(LocalReason::Conditional)));
}

#[test]
fn a_refused_leg_is_told_when_its_own_pool_frees() {
    let mut s = fleet();
    s.models[0].retry_after_by_pool_s = [30, 4];
    s.models[0].disaggregation = Some(Disaggregation {
        on_prefill_failure: OnPrefillFailure::Fail,
        ..Disaggregation::default()
    });
    for w in workers(&mut s)
        .iter_mut()
        .filter(|w| w.role == Role::Prefill)
    {
        w.ranks[0].busy = true;
    }
    assert_eq!(
        run(&s, &HashMap::new(), DEFAULT_TENANT),
        Plan::Reject(Rejection::AllBusy { retry_after_s: 30 }),
        "the prefill pool limits it"
    );
    let mut s = fleet();
    s.models[0].retry_after_by_pool_s = [30, 4];
    for w in workers(&mut s)
        .iter_mut()
        .filter(|w| w.role == Role::Decode)
    {
        w.ranks[0].busy = true;
    }
    assert_eq!(
        run(&s, &HashMap::new(), DEFAULT_TENANT),
        Plan::Reject(Rejection::AllBusy { retry_after_s: 4 }),
        "the decode pool limits it"
    );
    s.models[0].retry_after_by_pool_s = [30, 0];
    assert_eq!(
        run(&s, &HashMap::new(), DEFAULT_TENANT),
        Plan::Reject(Rejection::AllBusy { retry_after_s: 7 }),
        "no hint of the pool's: the model's"
    );
}

#[test]
fn tenants_and_draining_apply_to_both_legs() {
    let mut s = fleet();
    workers(&mut s)[0].tenant = "team-a".into();
    workers(&mut s)[2].tenant = "team-a".into();
    workers(&mut s)[3].ranks[0].active_decode_blocks = 500;
    let r = route(&s, &HashMap::new());
    assert_eq!(
        (id(&r.first), id(&remote(&r).first)),
        (4, 2),
        "team-a's idle workers are not the default tenant's"
    );
    assert_eq!(remote(&r).runner_up, None);
    let team_a = match run(&s, &HashMap::new(), "team-a") {
        Plan::Route(r) => (id(&r.first), id(&remote(&r).first)),
        other => panic!("{other:?}"),
    };
    assert_eq!(team_a, (3, 1));
    // A tenant with no decode worker has no worker for the request.
    workers(&mut s)[2].tenant = DEFAULT_TENANT.into();
    assert_eq!(
        run(&s, &HashMap::new(), "team-a"),
        Plan::Reject(Rejection::NoWorkers)
    );
    // A draining decode worker takes nothing new.
    let mut s = fleet();
    workers(&mut s)[3].ranks[0].active_decode_blocks = 500;
    workers(&mut s)[2].draining = true;
    assert_eq!(id(&route(&s, &HashMap::new()).first), 4);
}

#[test]
fn a_model_without_both_specialised_roles_is_served_whole() {
    // Disaggregation configured, but no decode worker up: every worker
    // takes whole requests, as before roles.
    let mut s = fleet();
    workers(&mut s).retain(|w| w.role != Role::Decode);
    workers(&mut s)[0].ranks[0].active_decode_blocks = 90;
    assert!(!s.models[0].disaggregated());
    let r = route(&s, &HashMap::new());
    assert_eq!((id(&r.first), r.prefill), (2, None));
    assert_eq!((r.first.prefill_tokens, r.first.decode_blocks), (320, 20));
    // Roles without disaggregation settings change nothing either.
    let mut s = fleet();
    s.models[0].disaggregation = None;
    workers(&mut s)[0].ranks[0].active_decode_blocks = 90;
    workers(&mut s)[2].ranks[0].active_decode_blocks = 90;
    workers(&mut s)[3].ranks[0].active_decode_blocks = 90;
    let r = route(&s, &HashMap::new());
    assert_eq!(
        (id(&r.first), r.prefill),
        (2, None),
        "a prefill worker, whole"
    );
}

#[test]
fn a_retry_judges_each_worker_by_its_roles_conditions() {
    // The decode worker is busy by its blocks; the prefill threshold,
    // which it is not judged by, is far exceeded too.
    let mut s = fleet();
    s.models[0].thresholds = Thresholds {
        active_decode_blocks: Some(0.5),
        active_prefill_tokens: Some(100),
        ..Default::default()
    };
    workers(&mut s).truncate(3);
    let d = &mut workers(&mut s)[2].ranks[0];
    (d.busy, d.active_decode_blocks, d.kv_used_blocks) = (true, 600, 600);
    d.active_prefill_tokens = 10_000;
    let body = format!(r#"{{"model":"m","prompt":{:?}}}"#, prompt());
    let req = parse(Endpoint::Completions, body.as_bytes()).unwrap();
    let ask = |h| Ask {
        slo: None,
        tie_break: 0,
        thresholds_scale: h,
        one_upstream: false,
    };
    let placed = |h| plan(&s, &req, DEFAULT_TENANT, &ask(h), &mut |_: &str| None, &[]);
    assert!(matches!(
        placed(None),
        Plan::Reject(Rejection::AllBusy { .. })
    ));
    // 600 of 1000 blocks is within 0.5 widened by 30 %.
    match placed(Some(1.3)) {
        Plan::Route(r) => assert_eq!(id(&r.first), 3),
        other => panic!("{other:?}"),
    }
}

#[test]
fn local_bookings_judge_each_worker_by_its_role() {
    let mut s = fleet();
    s.models[0].thresholds = Thresholds {
        active_decode_blocks: Some(0.5),
        active_prefill_tokens: Some(1000),
        ..Default::default()
    };
    let mut local = local::LocalBookings::default();
    local.settle(&mut s, 9, 0, 1000);
    // Decode blocks on a prefill worker, prompt tokens on a decode worker:
    // neither is its leg's condition.
    local.book(&mut s, 1, 0, 0, 900, 0);
    local.book(&mut s, 2, 2, 5000, 0, 0);
    assert!(!workers(&mut s)[0].ranks[0].busy);
    assert!(!workers(&mut s)[2].ranks[0].busy);
    // Their own conditions still hold them.
    local.book(&mut s, 3, 1, 5000, 0, 0);
    local.book(&mut s, 4, 3, 0, 900, 0);
    assert!(workers(&mut s)[1].ranks[0].busy);
    assert!(workers(&mut s)[3].ranks[0].busy);
}
