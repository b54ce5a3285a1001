use super::*;
use crate::publish::{ShardLog, Versions};
use kvgate_core::hash::{XXH3_SEED, block_hashes, sequence_hashes};
use kvgate_core::shard::{ShardView, shard_of};
use rmpv::Value;

/// A plane that publishes into a shard log of its own.
fn start(config: PlaneConfig) -> (Plane, Arc<ShardLog>) {
    let log = Arc::new(ShardLog::new(Arc::new(Versions::new())));
    let sink = log.clone();
    let plane = Plane::start(config, Box::new(move |changed| sink.publish(changed))).unwrap();
    (plane, log)
}

fn batch(hashes: &[u64], tokens: &[u32]) -> Vec<u8> {
    batch_after(hashes, None, tokens)
}

/// A store whose first block's parent is `parent`.
fn batch_after(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Vec<u8> {
    stamped(1.0, hashes, parent, tokens)
}

/// The same, stamped by the engine at `ts` (Unix seconds).
fn stamped(ts: f64, hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Vec<u8> {
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        (
            "parent_block_hash".into(),
            parent.map_or(Value::Nil, Value::from),
        ),
        (
            "token_ids".into(),
            Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
        ),
        ("block_size".into(), 4.into()),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(
        &mut buf,
        &Value::Array(vec![ts.into(), Value::Array(vec![ev]), 0.into()]),
    )
    .unwrap();
    buf
}

/// Slot `n` is worker `n`'s rank 0 in these tests.
fn rank(n: u16) -> RankId {
    RankId {
        worker_id: u64::from(n),
        dp_rank: 0,
    }
}

fn wait_version(log: &ShardLog, above: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(2);
    while log.version() <= above {
        assert!(Instant::now() < deadline, "nothing published");
        std::thread::sleep(Duration::from_millis(1));
    }
    log.version()
}

fn holders_of(log: &ShardLog, model: &str, since: u64, tokens: &[u32]) -> Vec<u16> {
    let seq = sequence_hashes(&block_hashes(tokens, 4, XXH3_SEED));
    let last = *seq.last().unwrap();
    let updates = log.changed_since(since);
    let count = log
        .shard_counts()
        .into_iter()
        .find(|(m, _)| m == model)
        .unwrap()
        .1;
    let want = shard_of(last, count);
    updates
        .iter()
        .filter(|u| u.model == model && u.shard == want)
        .flat_map(|u| {
            ShardView::parse(&u.bytes)
                .unwrap()
                .holders(last)
                .map(|h| h.slot)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn batches_become_published_shards_and_removal_republishes() {
    let (plane, log) = start(PlaneConfig {
        shard_count: 64,
        ..Default::default()
    });
    plane.add_slot(1, "m", rank(1), 4, 0);
    plane.add_slot(2, "m", rank(2), 4, 0);
    let tx = plane.sender();
    let toks = [1, 2, 3, 4, 5, 6, 7, 8];
    tx.send(Ingest::Batch {
        slot: 1,
        seq: 0,
        payload: batch(&[10, 11], &toks),
    })
    .unwrap();
    tx.send(Ingest::Batch {
        slot: 2,
        seq: 0,
        payload: batch(&[20, 21], &toks),
    })
    .unwrap();
    let v1 = wait_version(&log, 0);
    // Both batches may land in one publish or two.
    let v1 = if holders_of(&log, "m", 0, &toks).len() < 2 {
        wait_version(&log, v1)
    } else {
        v1
    };
    assert_eq!(holders_of(&log, "m", 0, &toks), vec![1, 2]);

    plane.remove_slot(1);
    // Give the index thread a batch to notice the control message.
    tx.send(Ingest::Batch {
        slot: 2,
        seq: 1,
        payload: batch(&[22], &[9, 9, 9, 9]),
    })
    .unwrap();
    let v2 = wait_version(&log, v1);
    assert_eq!(
        holders_of(&log, "m", v1, &toks),
        vec![2],
        "slot 1's blocks are gone from the republished shard"
    );
    assert!(v2 > v1);
    let none = log.changed_since(log.version());
    assert!(none.is_empty());
}

#[test]
fn malformed_batches_are_counted_and_the_index_kept() {
    let (plane, log) = start(PlaneConfig::default());
    plane.add_slot(0, "m", rank(0), 4, 0);
    let tx = plane.sender();
    tx.send(Ingest::Batch {
        slot: 0,
        seq: 0,
        payload: batch(&[1], &[1, 2, 3, 4]),
    })
    .unwrap();
    tx.send(Ingest::Batch {
        slot: 0,
        seq: 1,
        payload: vec![0x93, 0xc1],
    })
    .unwrap();
    wait_version(&log, 0);
    std::thread::sleep(Duration::from_millis(20));
    let stats = plane.stats().unwrap();
    assert_eq!(stats.malformed_batches, 1);
    assert_eq!(stats.per_model[0].2, 1, "the good block is still indexed");
}

#[test]
fn a_flood_of_malformed_batches_is_counted_in_full_and_logged_once() {
    let (plane, _log) = start(PlaneConfig::default());
    plane.add_slot(0, "m", rank(0), 4, 0);
    plane.add_slot(1, "m", rank(1), 4, 0);
    let tx = plane.sender();
    for seq in 0..1000 {
        tx.send(Ingest::Batch {
            slot: 0,
            seq,
            payload: vec![0x93, 0xc1],
        })
        .unwrap();
    }
    // Another rank's first malformed batch has a line of its own.
    tx.send(Ingest::Batch {
        slot: 1,
        seq: 0,
        payload: vec![0x93, 0xc1],
    })
    .unwrap();
    let mut stats = plane.stats().unwrap();
    for _ in 0..200 {
        if stats.malformed_batches == 1001 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        stats = plane.stats().unwrap();
    }
    assert_eq!(stats.malformed_batches, 1001);
    assert_eq!(stats.malformed_batches_logged, 2);
}

#[test]
fn a_rate_limited_log_writes_the_first_then_one_a_period_with_the_count() {
    let every = Duration::from_secs(60);
    let t0 = Instant::now();
    let mut l = LogEvery::default();
    assert_eq!(l.due(t0, every), Some(1));
    assert_eq!(l.due(t0 + Duration::from_secs(1), every), None);
    assert_eq!(l.due(t0 + Duration::from_secs(59), every), None);
    assert_eq!(
        l.due(t0 + every, every),
        Some(3),
        "this one and two unlogged"
    );
    assert_eq!(l.due(t0 + every, every), None);
}

#[test]
fn events_of_another_block_size_are_counted_per_slot() {
    let (plane, _log) = start(PlaneConfig::default());
    plane.add_slot(0, "m", rank(0), 4, 0);
    // An engine paging by 4 behind a worker configured for 16.
    plane.add_slot(1, "m", rank(1), 16, 0);
    let tx = plane.sender();
    for (slot, seq) in [(0, 0), (1, 0), (1, 1)] {
        tx.send(Ingest::Batch {
            slot,
            seq,
            payload: batch(&[100 + seq], &[1, 2, 3, 4]),
        })
        .unwrap();
    }
    let want = BlockSizeMismatch {
        events: 2,
        engine_block_size: 4,
        block_size: 16,
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let stats = plane.stats().unwrap();
        if stats.block_size_mismatch.get(&1) == Some(&want) {
            assert!(
                !stats.block_size_mismatch.contains_key(&0),
                "slot 0 matches"
            );
            break;
        }
        assert!(Instant::now() < deadline, "{:?}", stats.block_size_mismatch);
        std::thread::sleep(Duration::from_millis(5));
    }
    // A reused slot starts its count over.
    plane.remove_slot(1);
    assert!(plane.stats().unwrap().block_size_mismatch.is_empty());
}

#[test]
fn each_slot_reports_its_latest_batch_lag() {
    let (plane, _log) = start(PlaneConfig::default());
    plane.add_slot(0, "m", rank(0), 4, 0);
    plane.add_slot(1, "m", rank(1), 4, 0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let tx = plane.sender();
    // Slot 0: stamped 30 s ago, then 3 s ago (the latest counts); slot 1:
    // by a clock 60 s ahead of ours.
    for (slot, seq, ts) in [(0, 0, now - 30.0), (0, 1, now - 3.0), (1, 0, now + 60.0)] {
        tx.send(Ingest::Batch {
            slot,
            seq,
            payload: stamped(ts, &[200 + seq + 10 * u64::from(slot)], None, &[1, 2, 3, 4]),
        })
        .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    let lag = loop {
        let stats = plane.stats().unwrap();
        if stats
            .per_model
            .first()
            .is_some_and(|m| m.1.stored_blocks == 3)
        {
            break stats.event_lag;
        }
        assert!(Instant::now() < deadline, "{:?}", stats.per_model);
        std::thread::sleep(Duration::from_millis(5));
    };
    let l0 = lag[&0];
    assert!((3.0..5.0).contains(&l0), "slot 0 lag {l0}");
    assert_eq!(lag[&1], 0.0, "a stamp from the future is no lag");
    // A removed slot's figure goes with it.
    plane.remove_slot(1);
    assert!(!plane.stats().unwrap().event_lag.contains_key(&1));
}

#[test]
fn unstamped_batches_report_no_lag() {
    assert_eq!(lag_seconds(0.0), None);
    assert_eq!(lag_seconds(f64::NAN), None);
    assert!(lag_seconds(1.0).is_some_and(|l| l > 1e9));
}

fn indexed(plane: &Plane) -> (usize, IngestStats) {
    plane
        .stats()
        .unwrap()
        .per_model
        .into_iter()
        .find(|(m, _, _)| m == "m")
        .map_or((0, IngestStats::default()), |(_, s, n)| (n, s))
}

fn wait_indexed(plane: &Plane, n: usize) -> IngestStats {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (have, stats) = indexed(plane);
        if have == n {
            return stats;
        }
        assert!(Instant::now() < deadline, "{have} blocks indexed, not {n}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits until `n` blocks have been stored across the model's ranks (one
/// block held by several ranks counts once per rank).
fn wait_stored(plane: &Plane, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, stats) = indexed(plane);
        if stats.stored_blocks >= n {
            assert_eq!(stats.stored_blocks, n, "more stores than sent");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} blocks stored, not {n}",
            stats.stored_blocks
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[tokio::test]
async fn a_recovery_replays_by_rank_and_batches_wait_for_it() {
    let id = |worker_id, dp_rank| RankId { worker_id, dp_rank };
    let (peer, _peer_log) = start(PlaneConfig::default());
    // Worker 1 ranks 0 and 1, worker 3 (block size 4 there), worker 4.
    peer.add_slot(0, "m", id(1, 0), 4, 0);
    peer.add_slot(1, "m", id(1, 1), 4, 0);
    peer.add_slot(2, "m", id(3, 0), 4, 0);
    peer.add_slot(3, "m", id(4, 0), 4, 0);
    let toks: Vec<u32> = (1..=12).collect();
    let tx = peer.sender();
    for (slot, hashes) in [(0, [10, 11]), (1, [20, 21]), (2, [30, 31]), (3, [40, 41])] {
        tx.send(Ingest::Batch {
            slot,
            seq: 0,
            payload: batch(&hashes, &toks[..8]),
        })
        .unwrap();
    }
    // Same tokens on every rank: two distinct blocks, eight entries. The
    // first batch alone makes the two distinct blocks, so wait for all
    // eight stores, which is what the dump below is asserted to hold.
    wait_stored(&peer, 8);
    let dump = peer.dump().await.unwrap();
    assert_eq!(dump.blocks(), 8);
    let bytes = crate::sources::kv::dump::encode(dump);

    // Here the slots are numbered otherwise, worker 3 has blocks of 16
    // and worker 4 is not in the catalog.
    let (here, here_log) = start(PlaneConfig {
        hold: Some(Duration::from_secs(30)),
        ..Default::default()
    });
    here.add_slot(7, "m", id(1, 1), 4, 0);
    here.add_slot(8, "m", id(1, 0), 4, 0);
    here.add_slot(9, "m", id(3, 0), 16, 0);
    // A child of a recovered block arrives before the recovery.
    here.sender()
        .send(Ingest::Batch {
            slot: 8,
            seq: 1,
            payload: batch_after(&[12], Some(11), &toks[8..]),
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(indexed(&here).0, 0, "held back");
    assert_eq!(here.dump().await, Err(DumpUnavailable::Recovering));

    let dump = crate::sources::kv::dump::decode(&bytes).unwrap();
    let report = here.restore(dump).await.unwrap();
    assert_eq!(report.recovered, 4);
    assert_eq!(
        report.dropped,
        [(Dropped::UnknownRank, 2), (Dropped::BlockSize, 2)].into()
    );
    assert_eq!(
        report.dropped_ranks,
        [
            ("m".to_string(), 3, 0, Dropped::BlockSize),
            ("m".to_string(), 4, 0, Dropped::UnknownRank)
        ]
    );
    let stats = wait_indexed(&here, 3);
    assert_eq!(
        stats.orphan_events, 0,
        "the child found its recovered parent"
    );
    let v = wait_version(&here_log, 0);
    assert_eq!(holders_of(&here_log, "m", 0, &toks), vec![8]);
    assert_eq!(holders_of(&here_log, "m", 0, &toks[..8]), vec![7, 8]);
    assert!(v > 0);
    // Recovered, it dumps what it holds under the same names.
    let again = here.dump().await.unwrap();
    assert_eq!(again.blocks(), 5);
}

#[tokio::test]
async fn a_release_or_the_bound_ends_the_hold() {
    for (hold, release) in [
        (Duration::from_secs(30), true),
        (Duration::from_millis(50), false),
    ] {
        let (plane, _log) = start(PlaneConfig {
            hold: Some(hold),
            ..Default::default()
        });
        plane.add_slot(0, "m", rank(0), 4, 0);
        plane
            .sender()
            .send(Ingest::Batch {
                slot: 0,
                seq: 0,
                payload: batch(&[1], &[1, 2, 3, 4]),
            })
            .unwrap();
        if release {
            plane.release();
        }
        wait_indexed(&plane, 1);
        assert!(plane.dump().await.is_ok());
    }
}
