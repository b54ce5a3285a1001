use super::*;
use crate::config::LedgerCaps;
use crate::sources::bookings::{Bookings, Load};
use kvgate_core::{Role, Snapshot, Thresholds};
use std::time::{Duration, Instant};

fn config() -> Config {
    Config::parse(
        r#"
[[models]]
name = "m"
active_decode_blocks_threshold = 0.5
[[models]]
name = "idle"
[[workers]]
worker_id = 1
model_name = "m"
endpoint = "127.0.0.1:8001"
data_parallel_size = 2
[[workers]]
worker_id = 2
model_name = "m"
endpoint = "127.0.0.1:8002"
"#,
    )
    .unwrap()
}

fn metrics(usage: f64) -> RankMetrics {
    RankMetrics {
        kv_usage: usage,
        kv_total_blocks: 100,
        running: 1,
        ..Default::default()
    }
}

#[test]
fn the_snapshot_names_each_models_adapters() {
    let c = Config::parse("[[models]]\nname = \"m\"\nlora_adapters = [\"sql-lora\"]").unwrap();
    let mut f = Fleet::new(&c).unwrap();
    let s = f.build_snapshot(
        &Bookings::new(Duration::from_secs(300), LedgerCaps::default()),
        30,
    );
    assert_eq!(s.models[0].lora_adapters, ["sql-lora"]);
    assert_eq!(s.model("sql-lora").map(|m| m.name.as_str()), Some("m"));
}

#[test]
fn only_scraped_workers_are_listed_and_every_model_is() {
    let mut f = Fleet::new(&config()).unwrap();
    let s = f.build_snapshot(
        &Bookings::new(Duration::from_secs(300), LedgerCaps::default()),
        30,
    );
    assert_eq!(s.models.len(), 2);
    assert!(s.models.iter().all(|m| m.workers.is_empty()));
    let now = Instant::now();
    f.record_scrape(1, Ok(vec![metrics(0.1), metrics(0.9)]), now);
    let s = f.build_snapshot(
        &Bookings::new(Duration::from_secs(300), LedgerCaps::default()),
        30,
    );
    let m = s.model("m").unwrap();
    assert_eq!(m.workers.len(), 1);
    let w = &m.workers[0];
    assert_eq!(w.ranks.len(), 2);
    assert_eq!((w.ranks[0].kv_used_blocks, w.ranks[0].busy), (10, false));
    assert_eq!((w.ranks[1].kv_used_blocks, w.ranks[1].busy), (90, true));
    assert_ne!(w.ranks[0].slot, w.ranks[1].slot);
}

#[test]
fn down_after_bound_and_back() {
    let mut f = Fleet::new(&config()).unwrap();
    let t0 = Instant::now();
    assert!(f.record_scrape(2, Ok(vec![metrics(0.0)]), t0));
    assert!(
        f.expire(t0 + Duration::from_millis(500), Duration::from_secs(1))
            .is_empty()
    );
    assert!(!f.record_scrape(
        2,
        Err("connection refused".into()),
        t0 + Duration::from_millis(600)
    ));
    assert_eq!(
        f.expire(t0 + Duration::from_millis(1500), Duration::from_secs(1)),
        vec![2]
    );
    assert_eq!(f.up_count(), 0);
    assert!(f.record_scrape(2, Ok(vec![metrics(0.0)]), t0 + Duration::from_secs(2)));
    assert_eq!(f.up_count(), 1);
}

#[test]
fn catalog_changes_and_slot_reuse() {
    let mut f = Fleet::new(&config()).unwrap();
    let now = Instant::now();
    let spec = |id: u64, model: &str| -> WorkerSpec {
        serde_json::from_value(
            serde_json::json!({"worker_id": id, "model_name": model, "endpoint": "127.0.0.1:9000"}),
        )
        .unwrap()
    };
    assert_eq!(
        f.add_worker(spec(1, "m"), now).unwrap_err(),
        FleetError::Duplicate(1)
    );
    assert_eq!(
        f.add_worker(spec(9, "x"), now).unwrap_err(),
        FleetError::UnknownModel("x".into())
    );
    let slot_of_2 = f.workers[&2].slots[0];
    f.remove_worker(2).unwrap();
    assert_eq!(
        f.remove_worker(2).unwrap_err(),
        FleetError::UnknownWorker(2)
    );
    assert_eq!(
        f.add_worker(spec(3, "idle"), now).unwrap().slots,
        vec![slot_of_2],
        "freed slots are reused"
    );
    let w = f
        .patch_worker(3, &serde_json::json!({"data_parallel_size": 2}), now)
        .unwrap();
    assert_eq!(w.slots.len(), 2);
    assert!(
        f.patch_worker(3, &serde_json::json!({"block_size": 0}), now)
            .is_err()
    );
    assert_eq!(
        f.workers[&3].spec.block_size, 16,
        "a rejected patch changes nothing"
    );
    assert!(
        f.patch_worker(3, &serde_json::json!({"worker_id": 4}), now)
            .is_err()
    );
}

fn book(b: &mut Bookings, seq: u64, slot: u16, prefill: u32, decode: u32, at: Instant) {
    use kvgate_core::booking::{Event, Key};
    let ev = Event::Book {
        key: Key { vm: 1, seq },
        model: "m".into(),
        slot,
        prefill_tokens: prefill,
        decode_blocks: decode,
        tenant: kvgate_core::DEFAULT_TENANT.into(),
    };
    b.apply(ev, at, |_, _| true);
}

#[test]
fn bookings_merge_with_engine_load() {
    let mut f = Fleet::new(&config()).unwrap();
    let now = Instant::now();
    f.record_scrape(1, Ok(vec![metrics(0.1), metrics(0.1)]), now);
    let slots = f.workers[&1].slots.clone();
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    book(&mut b, 1, slots[0], 700, 30, now);
    book(&mut b, 2, slots[1], 50, 4, now);
    let s = f.build_snapshot(&b, 30);
    let r = &s.model("m").unwrap().workers[0].ranks;
    // Booked load is the active load; the engine's usage stays beside it.
    assert_eq!(
        (r[0].active_prefill_tokens, r[0].active_decode_blocks),
        (700, 30)
    );
    assert_eq!(
        (r[1].active_prefill_tokens, r[1].active_decode_blocks),
        (50, 4)
    );
    assert_eq!((r[0].kv_used_blocks, r[1].kv_used_blocks), (10, 10));
    assert_eq!(s.applied, vec![kvgate_core::Applied { vm: 1, seq: 2 }]);
}

#[test]
fn a_model_lists_the_tenants_with_the_largest_shares_by_name() {
    let mut f = Fleet::new(&config()).unwrap();
    let now = Instant::now();
    f.record_scrape(1, Ok(vec![metrics(0.1), metrics(0.1)]), now);
    let slots = f.workers[&1].slots.clone();
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    // Tenant i books i prompt tokens and no blocks, over both ranks; one
    // books only blocks, and one's requests hold nothing now.
    let extra = 6;
    for i in 1..=(snapshot::MAX_TENANTS + extra) as u64 {
        for (r, slot) in slots.iter().enumerate() {
            let load = Load {
                slot: *slot,
                prefill_tokens: i,
                decode_blocks: 0,
            };
            b.reserve(&format!("r{i}-{r}"), load, &format!("t{i:03}"), now)
                .unwrap();
        }
    }
    let blocks = Load {
        slot: slots[1],
        prefill_tokens: 0,
        decode_blocks: 1,
    };
    b.reserve("blocks", blocks, "t000", now).unwrap();
    let nothing = Load {
        decode_blocks: 0,
        ..blocks
    };
    b.reserve("nothing", nothing, "idle", now).unwrap();
    let s = f.build_snapshot(&b, 30);
    let t = &s.model("m").unwrap().tenants;
    assert_eq!(t.len(), snapshot::MAX_TENANTS);
    // t000 holds every block: the largest share there is.
    assert_eq!((t[0].tenant.as_str(), t[0].decode_blocks), ("t000", 1));
    let first = format!("t{:03}", extra + 2);
    assert_eq!(
        (t[1].tenant.as_str(), t[1].prefill_tokens),
        (first.as_str(), 2 * (extra as u64 + 2)),
        "the smallest shares are left out"
    );
    assert!(t.windows(2).all(|w| w[0].tenant < w[1].tenant));
    assert!(s.model("idle").unwrap().tenants.is_empty());
}

/// Worker 2's rank at `usage` of 100 blocks with `running` requests,
/// after 30 s of four `blocks`-block bookings finishing each second.
fn draining(usage: f64, running: u32, blocks: u32) -> (Fleet, Bookings) {
    use kvgate_core::booking::{Event, Key};
    let mut f = Fleet::new(&config()).unwrap();
    let t = Instant::now();
    f.record_scrape(
        2,
        Ok(vec![RankMetrics {
            running,
            ..metrics(usage)
        }]),
        t,
    );
    let slot = f.workers[&2].slots[0];
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    b.sweep(t);
    let mut seq = 0;
    for s in 1..=30u64 {
        let now = t + Duration::from_secs(s);
        for _ in 0..4 {
            seq += 1;
            book(&mut b, seq, slot, 0, blocks, now);
            b.apply(
                Event::Done {
                    key: Key { vm: 1, seq },
                    timing: None,
                },
                now,
                |_, _| true,
            );
        }
        b.sweep(now);
    }
    (f, b)
}

#[test]
fn retry_after_follows_the_engine_when_its_usage_keeps_the_rank_busy() {
    // 90 of 100 blocks in use by 16 running requests, most of them not
    // this gateway's: its own requests are one block each.
    let (mut f, b) = draining(0.9, 16, 1);
    let s = f.build_snapshot(&b, 30);
    let m = s.model("m").unwrap();
    assert!(m.workers[0].ranks[0].busy);
    // 42 blocks over the line; four requests of ~5.6 blocks finish a
    // second: about 1.9 s. The bookings' own drain (4 blocks/s) would
    // have said 11.
    assert_eq!(m.retry_after_s, 2);
}

#[test]
fn retry_after_follows_the_drain_rate_of_the_first_worker_to_free() {
    // Threshold 0.5 of 100 blocks: a rank clears under 48 blocks.
    let (mut f, b) = draining(0.78, 12, 5);
    let s = f.build_snapshot(&b, 30);
    let m = s.model("m").unwrap();
    assert!(m.workers[0].ranks[0].busy);
    // 30 blocks over the clearing line; four of the twelve running
    // requests (6.5 blocks each) finish a second: 1.15 s, rounded up.
    assert_eq!(m.retry_after_s, 2);
    // Nothing drains: the filter's default applies (0 here).
    let s = f.build_snapshot(
        &Bookings::new(Duration::from_secs(300), LedgerCaps::default()),
        30,
    );
    assert_eq!(s.model("m").unwrap().retry_after_s, 0);
}

#[test]
fn thresholds_are_validated() {
    let mut f = Fleet::new(&config()).unwrap();
    let bad = Thresholds {
        active_decode_blocks: Some(2.0),
        ..Default::default()
    };
    assert!(matches!(
        f.set_thresholds("m", bad),
        Err(FleetError::Invalid(_))
    ));
    assert_eq!(
        f.set_thresholds("zz", Thresholds::default()),
        Err(FleetError::UnknownModel("zz".into()))
    );
    f.set_thresholds(
        "idle",
        Thresholds {
            active_prefill_tokens: Some(5),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(f.models["idle"].thresholds.active_prefill_tokens, Some(5));
}

/// Model `pd` split over prefill worker 11 and decode worker 12, with a
/// `both` worker 13; decode threshold 0.5, prefill threshold 100 tokens.
fn split_config() -> Config {
    Config::parse(
        r#"
[[models]]
name = "pd"
active_decode_blocks_threshold = 0.5
active_prefill_tokens_threshold = 100
[models.disaggregation]
protocol = "vllm-nixl"
[[workers]]
worker_id = 11
model_name = "pd"
endpoint = "127.0.0.1:8011"
role = "prefill"
[[workers]]
worker_id = 12
model_name = "pd"
endpoint = "127.0.0.1:8012"
role = "decode"
[[workers]]
worker_id = 13
model_name = "pd"
endpoint = "127.0.0.1:8013"
"#,
    )
    .unwrap()
}

#[test]
fn in_a_split_model_each_worker_is_busy_by_its_roles_conditions() {
    let mut f = Fleet::new(&split_config()).unwrap();
    let now = Instant::now();
    // Every worker's KV cache 90 % full, and 500 prompt tokens booked on
    // each.
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    for (i, id) in [11u64, 12, 13].into_iter().enumerate() {
        f.record_scrape(id, Ok(vec![metrics(0.9)]), now);
        let load = Load {
            slot: f.workers[&id].slots[0],
            prefill_tokens: 500,
            decode_blocks: 0,
        };
        b.reserve(&format!("r{i}"), load, "default", now).unwrap();
    }
    let busy = |s: &Snapshot, id: u64| {
        let w = s.models[0].workers.iter().find(|w| w.id == id).unwrap();
        (w.role, w.ranks[0].busy)
    };
    let s = f.build_snapshot(&b, 30);
    assert!(s.models[0].disaggregated());
    assert_eq!(
        s.models[0].disaggregation.map(|d| d.decode_affinity),
        Some(3.0),
        "the affinity defaults to the model's overlap credit"
    );
    // The prefill worker is not judged by its KV cache, the decode worker
    // not by its prompt tokens; each is over its own threshold here.
    assert_eq!(busy(&s, 11), (Role::Prefill, true));
    assert_eq!(busy(&s, 12), (Role::Decode, true));
    assert_eq!(busy(&s, 13), (Role::Both, true));
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let mut f = Fleet::new(&split_config()).unwrap();
    for id in [11u64, 12, 13] {
        f.record_scrape(id, Ok(vec![metrics(0.9)]), now);
    }
    b.reserve(
        "p",
        Load {
            slot: f.workers[&12].slots[0],
            prefill_tokens: 500,
            decode_blocks: 0,
        },
        "default",
        now,
    )
    .unwrap();
    let s = f.build_snapshot(&b, 30);
    assert_eq!(busy(&s, 11), (Role::Prefill, false), "a full cache alone");
    assert_eq!(busy(&s, 12), (Role::Decode, true), "its cache");
    // Without its decode worker up the model is served whole: the prefill
    // worker is judged by every condition again.
    let mut f = Fleet::new(&split_config()).unwrap();
    for id in [11u64, 13] {
        f.record_scrape(id, Ok(vec![metrics(0.9)]), now);
    }
    let s = f.build_snapshot(
        &Bookings::new(Duration::from_secs(300), LedgerCaps::default()),
        30,
    );
    assert!(!s.models[0].disaggregated());
    assert_eq!(busy(&s, 11), (Role::Prefill, true));
}

#[test]
fn a_patch_changes_a_workers_role() {
    let mut f = Fleet::new(&split_config()).unwrap();
    let now = Instant::now();
    let w = f
        .patch_worker(13, &serde_json::json!({"role": "decode"}), now)
        .unwrap();
    assert_eq!(w.spec().role, Role::Decode);
    assert!(matches!(
        f.patch_worker(13, &serde_json::json!({"role": "encode"}), now),
        Err(FleetError::Invalid(m)) if m.contains("unknown variant `encode`")
    ));
    assert_eq!(f.workers[&13].spec().role, Role::Decode, "unchanged");
}

#[test]
fn bootstrap_ports_reach_the_snapshot_and_a_patch_changes_them() {
    let mut f = Fleet::new(&split_config()).unwrap();
    let now = Instant::now();
    let port = |f: &mut Fleet, id: u64| {
        f.record_scrape(id, Ok(vec![metrics(0.1)]), Instant::now());
        let s = f.build_snapshot(
            &Bookings::new(Duration::from_secs(300), LedgerCaps::default()),
            30,
        );
        s.models[0]
            .workers
            .iter()
            .find(|w| w.id == id)
            .unwrap()
            .bootstrap_port
    };
    assert_eq!(port(&mut f, 11), 8998, "SGLang's default");
    f.patch_worker(11, &serde_json::json!({"bootstrap_port": 9100}), now)
        .unwrap();
    assert_eq!(f.workers[&11].spec().bootstrap_port, Some(9100));
    assert_eq!(port(&mut f, 11), 9100);
    assert!(matches!(
        f.patch_worker(11, &serde_json::json!({"bootstrap_port": 0}), now),
        Err(FleetError::Invalid(m)) if m.contains("bootstrap_port")
    ));
    assert!(
        f.patch_worker(11, &serde_json::json!({"bootstrap_port": 70000}), now)
            .is_err()
    );
    assert_eq!(port(&mut f, 11), 9100, "unchanged");
}

#[test]
fn the_info_series_names_each_workers_role() {
    let mut f = Fleet::new(&split_config()).unwrap();
    let now = Instant::now();
    for id in [11u64, 12, 13] {
        f.record_scrape(id, Ok(vec![metrics(0.0)]), now);
    }
    let b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let m = crate::metrics::Metrics::new().unwrap();
    let s = f.build_snapshot(&b, 30);
    f.show(&b, &s, &m.snapshot, &m.ledger);
    let info = |id: &str, role: &str| {
        m.sample(
            "kvgate_sidecar_worker_info",
            &[("model", "pd"), ("worker_id", id), ("role", role)],
        )
    };
    assert_eq!(info("11", "prefill"), Some(1.0));
    assert_eq!(info("12", "decode"), Some(1.0));
    assert_eq!(info("13", "both"), Some(1.0));
    let by_role = |name: &str, role: &str| m.sample(name, &[("model", "pd"), ("role", role)]);
    assert_eq!(
        by_role("kvgate_sidecar_workers_up_by_role", "decode"),
        Some(1.0)
    );
    assert_eq!(
        by_role("kvgate_sidecar_workers_busy_by_role", "decode"),
        Some(0.0)
    );
    // The per-worker series keep their labels.
    assert_eq!(
        m.sample(
            "kvgate_sidecar_worker_up",
            &[("model", "pd"), ("worker_id", "12")]
        ),
        Some(1.0)
    );
    // A changed role moves the worker's info series.
    f.patch_worker(13, &serde_json::json!({"role": "prefill"}), now)
        .unwrap();
    f.record_scrape(13, Ok(vec![metrics(0.0)]), now);
    let s = f.build_snapshot(&b, 30);
    f.show(&b, &s, &m.snapshot, &m.ledger);
    assert_eq!(info("13", "prefill"), Some(1.0));
    assert_eq!(info("13", "both"), None);
    assert_eq!(
        by_role("kvgate_sidecar_workers_up_by_role", "prefill"),
        Some(2.0)
    );
    assert_eq!(
        by_role("kvgate_sidecar_workers_up_by_role", "both"),
        Some(0.0)
    );
}

/// A split model whose planner is on: prefill worker 11, decode worker 12
/// and `both` worker 13.
fn planned_split() -> Fleet {
    let mut c = split_config();
    c.models[0].planner =
        Some(toml::from_str("ttft_ms = 200.0\nitl_ms = 20.0").expect("a planner section"));
    Fleet::new(&c).unwrap()
}

/// Samples in worker `id`'s own (TTFT, ITL) fits.
fn fitted(f: &Fleet, id: u64) -> (u64, u64) {
    let p = &f.planning().models["pd"];
    let n = |l: Option<&crate::planner::regress::Line>| l.map_or(0, |l| l.samples());
    (n(p.ttft().worker(id)), n(p.itl().worker(id)))
}

fn leg(leg: kvgate_core::plan::Leg, status: u16) -> kvgate_core::booking::Timing {
    kvgate_core::booking::Timing {
        leg,
        first_byte_us: 40_000,
        total_us: 90_000,
        isl_tokens: 2000,
        output_tokens: 11,
        status,
        client_first_byte_us: 70_000,
    }
}

#[test]
fn each_leg_teaches_the_fit_its_worker_computed_it_on() {
    use kvgate_core::booking::Key;
    use kvgate_core::plan::Leg;
    let mut f = planned_split();
    let key = |seq| Key { vm: 9, seq };
    // One split request: its prefill leg on 11, its decode leg on 12.
    f.planner_booked(key(1), "pd", (11, Role::Prefill), (2000.0, 0.0), 2000);
    f.planner_booked(key(2), "pd", (12, Role::Decode), (0.0, 8000.0), 0);
    f.planner_ended(&key(1), Some(leg(Leg::Prefill, 200)));
    assert_eq!((fitted(&f, 11), fitted(&f, 12)), ((1, 0), (0, 0)));
    f.planner_ended(&key(2), Some(leg(Leg::Decode, 200)));
    assert_eq!((fitted(&f, 11), fitted(&f, 12)), ((1, 0), (0, 1)));
    let p = &f.planning().models["pd"];
    assert_eq!(
        (
            p.ttft().role(Role::Prefill).samples(),
            p.itl().role(Role::Decode).samples(),
            p.ttft().role(Role::Decode).samples(),
        ),
        (1, 1, 0),
        "each role's pool has its legs' samples"
    );
    // Legs that failed teach no latency.
    f.planner_booked(key(3), "pd", (11, Role::Prefill), (2000.0, 0.0), 2000);
    f.planner_booked(key(4), "pd", (12, Role::Decode), (0.0, 8000.0), 0);
    f.planner_ended(&key(3), Some(leg(Leg::Prefill, 503)));
    f.planner_ended(&key(4), Some(leg(Leg::Decode, 500)));
    assert_eq!((fitted(&f, 11), fitted(&f, 12)), ((1, 0), (0, 1)));
}

/// A filter of the release before leg records sends tag 5: a request
/// served whole with no status, which teaches both fits as before.
#[test]
fn an_older_filters_timed_end_is_a_whole_request() {
    use kvgate_core::booking::{Event, Key, decode_batch};
    let mut f = planned_split();
    let key = Key { vm: 9, seq: 1 };
    let mut tag5 = vec![5u8];
    tag5.extend_from_slice(&key.vm.to_le_bytes());
    tag5.extend_from_slice(&key.seq.to_le_bytes());
    for v in [40_000u32, 90_000, 2000, 11] {
        tag5.extend_from_slice(&v.to_le_bytes());
    }
    let [Event::Done { timing, .. }] = decode_batch(&tag5).unwrap()[..] else {
        panic!("one timed end");
    };
    f.planner_booked(key, "pd", (13, Role::Both), (2000.0, 8000.0), 500);
    f.planner_ended(&key, timing);
    assert_eq!(fitted(&f, 13), (1, 1));
    let p = &f.planning().models["pd"];
    assert_eq!(p.ttft().role(Role::Both).samples(), 1);
}

/// Ends `n` legs on `worker` (of `role`) that met `tokens` there, their
/// first byte at `ttft_ms` and 10 tokens `itl_ms` apart after it.
fn teach(
    f: &mut Fleet,
    model: &str,
    worker: u64,
    role: Role,
    tokens: f64,
    ttft_ms: u32,
    itl_ms: u32,
) {
    use kvgate_core::booking::{Key, Timing};
    use kvgate_core::plan::Leg;
    let leg = match role {
        Role::Prefill => Leg::Prefill,
        Role::Decode => Leg::Decode,
        Role::Both => Leg::Whole,
    };
    for i in 0..12u64 {
        let key = Key {
            vm: 7,
            seq: worker * 1000 + i,
        };
        let x = tokens * (1.0 + i as f64 / 10.0);
        f.planner_booked(key, model, (worker, role), (x, x), 0);
        f.planner_ended(
            &key,
            Some(Timing {
                leg,
                first_byte_us: ttft_ms * 1000,
                total_us: ttft_ms * 1000 + 10 * itl_ms * 1000,
                isl_tokens: 1000,
                output_tokens: 11,
                status: 200,
                client_first_byte_us: ttft_ms * 1000,
            }),
        );
    }
}

#[test]
fn a_split_models_decision_names_each_pools_target_and_drains_from_the_right_pool() {
    let mut f = planned_split();
    let now = Instant::now();
    for id in [11, 12, 13] {
        f.record_scrape(id, Ok(vec![metrics(0.1)]), now);
    }
    // The prefill worker far over its TTFT SLA; the decode pool (12 and
    // the `both` worker 13) far under its ITL SLA.
    teach(&mut f, "pd", 11, Role::Prefill, 4000.0, 900, 0);
    teach(&mut f, "pd", 12, Role::Decode, 4000.0, 5, 2);
    teach(&mut f, "pd", 13, Role::Both, 4000.0, 50, 2);
    let load = |_: &Fleet, id: u64| crate::planner::WorkerLoad {
        worker_id: id,
        role: match id {
            11 => Role::Prefill,
            12 => Role::Decode,
            _ => Role::Both,
        },
        prefill_tokens: 4000.0,
        decode_kv_tokens: 4000.0,
    };
    let planned = f.plan(now, 1, &|_| (true, false), &load);
    let d = planned[0].decision.clone().expect("a decision");
    assert_eq!((d.num_prefill, d.num_decode), (Some(2), Some(1)), "{d:?}");
    assert_eq!(d.desired, 3);
    assert_eq!(d.drain.len(), 1);
    assert!(
        [12, 13].contains(&d.drain[0]),
        "a decode-pool worker drains: {d:?}"
    );
    let pools: Vec<(Role, u32)> = d.pools.iter().map(|p| (p.role, p.ready)).collect();
    assert_eq!(pools, vec![(Role::Prefill, 1), (Role::Decode, 2)]);
    let json = serde_json::to_value(&d).unwrap();
    assert_eq!(json["num_prefill"], 2);
    assert!(json.get("switch").is_none(), "no switch unless allowed");
    let s = f.build_snapshot(
        &Bookings::new(Duration::from_secs(300), LedgerCaps::default()),
        30,
    );
    let drained = s
        .model("pd")
        .unwrap()
        .workers
        .iter()
        .find(|w| w.id == d.drain[0]);
    assert!(drained.is_some_and(|w| w.draining));
}

#[test]
fn the_power_budget_is_measured_from_the_workers_gpus() {
    use crate::sources::thermal::GpuReading;
    let mut c = config();
    c.models[0].planner = Some(
        toml::from_str("ttft_ms = 200.0\nitl_ms = 20.0\npower_budget_w = 1000.0")
            .expect("a planner section"),
    );
    c.workers[0].gpus = vec!["GPU-1".into()];
    c.workers[1].gpus = vec!["GPU-2".into()];
    let mut f = Fleet::new(&c).unwrap();
    let now = Instant::now();
    for id in [1, 2] {
        f.record_scrape(id, Ok(vec![metrics(0.1)]), now);
        teach(&mut f, "m", id, Role::Both, 4000.0, 900, 2);
    }
    let reading = |uuid: &str, watts| GpuReading {
        uuid: uuid.into(),
        index: None,
        labels: Default::default(),
        temp_c: 60.0,
        power_w: Some(watts),
        power_limit_w: Some(700.0),
        slowdown_c: None,
        shutdown_c: None,
        clock_reasons: None,
    };
    f.record_gpus(vec![reading("GPU-1", 450.0), reading("GPU-2", 470.0)], now);
    let load = |_: &Fleet, id: u64| crate::planner::WorkerLoad {
        worker_id: id,
        role: Role::Both,
        prefill_tokens: 4000.0,
        decode_kv_tokens: 4000.0,
    };
    // Both workers over the SLA want a third: 3 × 470 W (the median of
    // two is the upper) is over 1000 W.
    let planned = f.plan(now, 1, &|_| (true, false), &load);
    let t = &planned[0].tick;
    assert_eq!(
        (t.desired(), t.reason()),
        (2, crate::planner::Reason::Power)
    );
    let w = t.power.expect("a budget");
    assert!(w.binding);
    assert_eq!(w.planned_w, Some(940.0));
    assert!(planned[0].decision.is_none());
    // Without a fresh reading the draw is unknown: the budget cannot bind.
    let later = now + Duration::from_secs(3600);
    let planned = f.plan(later, 2, &|_| (true, false), &load);
    let w = planned[0].tick.power.expect("a budget");
    assert_eq!((w.binding, w.planned_w), (false, None));
}

/// A model with `[models.slo]` and no planner keeps latency fits: the
/// snapshot publishes each worker's own once trusted, else its role's,
/// beside the SLO. A model with neither keeps none; a planned model's SLO
/// is its planner's SLA.
#[test]
fn a_model_with_an_slo_publishes_its_workers_fits_without_a_planner() {
    use kvgate_core::Slo;
    let mut c = split_config();
    c.models[0].slo = Some(Slo {
        ttft_ms: 300,
        itl_ms: 30,
    });
    let mut f = Fleet::new(&c).unwrap();
    assert!(!f.plans() && f.observes());
    let now = Instant::now();
    for id in [11, 12, 13] {
        f.record_scrape(id, Ok(vec![metrics(0.1)]), now);
    }
    teach(&mut f, "pd", 11, Role::Prefill, 4000.0, 900, 0);
    teach(&mut f, "pd", 12, Role::Decode, 4000.0, 5, 2);
    let b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let s = f.build_snapshot(&b, 30);
    let m = s.model("pd").unwrap();
    assert_eq!(m.slo, c.models[0].slo.unwrap());
    let fits = |s: &Snapshot, id| {
        s.models[0]
            .workers
            .iter()
            .find(|w| w.id == id)
            .and_then(|w| w.fits)
    };
    let prefill = fits(&s, 11).expect("the prefill worker's fits");
    assert_eq!(prefill.ttft.samples, 12);
    assert!((prefill.ttft.predict(4.0).unwrap() - 900.0).abs() < 1.0);
    assert!(prefill.ttft.age_s <= 1);
    assert_eq!(prefill.itl.predict(4.0), None, "a prefill leg is no ITL");
    let decode = fits(&s, 12).expect("the decode worker's fits");
    assert!((decode.itl.predict(4.0).unwrap() - 2.0).abs() < 0.1);
    assert_eq!(decode.ttft.samples, 0, "a decode leg is no TTFT");
    assert_eq!(fits(&s, 13), None, "nothing learned of a `both` worker");
    // A worker too new for its own fit is published with its role's.
    f.patch_worker(13, &serde_json::json!({"role": "prefill"}), now)
        .unwrap();
    f.record_scrape(13, Ok(vec![metrics(0.1)]), now);
    let s = f.build_snapshot(&b, 30);
    assert_eq!(fits(&s, 13).map(|f| f.ttft.samples), Some(12));

    let mut plain = Fleet::new(&config()).unwrap();
    assert!(!plain.observes());
    plain.record_scrape(1, Ok(vec![metrics(0.1)]), now);
    teach(&mut plain, "m", 1, Role::Both, 4000.0, 900, 2);
    let s = plain.build_snapshot(&b, 30);
    let m = s.model("m").unwrap();
    assert_eq!(m.slo, Slo::default());
    assert_eq!(m.workers[0].fits, None, "no SLO, no fits");

    let s = planned_split().build_snapshot(&b, 30);
    assert_eq!(
        s.models[0].slo,
        Slo {
            ttft_ms: 200,
            itl_ms: 20
        }
    );
}
