use super::*;

fn key(seq: u64) -> Key {
    Key { vm: 7, seq }
}

fn book(seq: u64, slot: u16, prefill: u32, decode: u32) -> Event {
    Event::Book {
        key: key(seq),
        model: "m".into(),
        slot,
        prefill_tokens: prefill,
        decode_blocks: decode,
    }
}

fn any_slot(_: &str, _: u16) -> bool {
    true
}

#[test]
fn a_request_books_prefill_then_decode_and_releases_everything() {
    let mut b = Bookings::new(Duration::from_secs(300));
    let t = Instant::now();
    assert_eq!(
        b.apply(book(1, 3, 1000, 70), t, any_slot),
        Effect::Booked {
            model: "m".into(),
            slot: 3
        }
    );
    b.apply(book(2, 3, 500, 40), t, any_slot);
    let l = b.slot(3);
    assert_eq!(
        (l.prefill_tokens, l.decode_blocks, l.requests),
        (1500, 110, 2)
    );
    b.apply(Event::FirstByte { key: key(1) }, t, any_slot);
    assert_eq!(b.slot(3).prefill_tokens, 500);
    // Its end still knows what it booked as uncached, for the hit rate.
    assert_eq!(
        b.apply(
            Event::Done {
                key: key(1),
                timing: None,
            },
            t,
            any_slot,
        ),
        Effect::Ended {
            slot: 3,
            uncached: 1000
        }
    );
    b.apply(
        Event::Done {
            key: key(2),
            timing: None,
        },
        t,
        any_slot,
    );
    let l = b.slot(3);
    assert_eq!((l.prefill_tokens, l.decode_blocks, l.requests), (0, 0, 0));
    assert_eq!(b.active(), 0);
    assert_eq!(b.applied(), vec![Applied { vm: 7, seq: 2 }]);
}

#[test]
fn unknown_releases_and_missing_slots_change_nothing() {
    let mut b = Bookings::new(Duration::from_secs(300));
    let t = Instant::now();
    assert_eq!(
        b.apply(
            Event::Done {
                key: key(9),
                timing: None
            },
            t,
            any_slot
        ),
        Effect::Unknown
    );
    assert_eq!(
        b.apply(book(1, 4, 10, 1), t, |_, s| s != 4),
        Effect::Refused
    );
    assert_eq!(b.slot(4), SlotLoad::default());
    // The watermark still moves: the VM must stop adding it locally.
    assert_eq!(b.applied(), vec![Applied { vm: 7, seq: 1 }]);
}

#[test]
fn stale_bookings_expire() {
    let mut b = Bookings::new(Duration::from_secs(300));
    let t = Instant::now();
    b.apply(book(1, 1, 100, 10), t, any_slot);
    b.apply(book(2, 1, 100, 10), t + Duration::from_secs(200), any_slot);
    assert_eq!(b.sweep(t + Duration::from_secs(301)), 1);
    assert_eq!(b.slot(1).decode_blocks, 10);
    assert_eq!(b.sweep(t + Duration::from_secs(501)), 1);
    assert_eq!(b.slot(1).decode_blocks, 0);
    assert_eq!(b.expired_total, 2);
    assert!(b.applied().is_empty(), "a silent VM's mark goes too");
}

#[test]
fn drain_rate_follows_completions() {
    let mut b = Bookings::new(Duration::from_secs(300));
    let t = Instant::now();
    b.sweep(t);
    // 20 requests of 10 blocks finish each second for 10 s.
    let mut seq = 0;
    for s in 1..=10u64 {
        let now = t + Duration::from_secs(s);
        for _ in 0..20 {
            seq += 1;
            b.apply(book(seq, 2, 0, 10), now, any_slot);
            b.apply(
                Event::Done {
                    key: key(seq),
                    timing: None,
                },
                now,
                any_slot,
            );
        }
        b.sweep(now);
    }
    let rate = b.slot(2).decode_drain_per_s;
    assert!((150.0..=200.0).contains(&rate), "{rate}");
    let done = b.slot(2).completions_per_s;
    assert!((15.0..=20.0).contains(&done), "{done}");
}

#[test]
fn dropping_a_slot_forgets_its_bookings() {
    let mut b = Bookings::new(Duration::from_secs(300));
    let t = Instant::now();
    b.apply(book(1, 5, 100, 10), t, any_slot);
    b.apply(book(2, 6, 100, 10), t, any_slot);
    b.drop_slot(5);
    assert_eq!(b.active(), 1);
    assert_eq!(b.slot(5), SlotLoad::default());
    assert_eq!(b.slot(6).requests, 1);
}

fn load(slot: u16, prefill: u64, decode: u64) -> Load {
    Load {
        slot,
        prefill_tokens: prefill,
        decode_blocks: decode,
    }
}

#[test]
fn reservations_and_gateway_bookings_share_the_slot_totals() {
    let mut b = Bookings::new(Duration::from_secs(300));
    let t = Instant::now();
    b.apply(book(1, 3, 100, 10), t, any_slot);
    let r = b.reserve("r", load(3, 50, 4), t).unwrap();
    assert_eq!(
        b.reserve("r", load(4, 1, 1), t),
        Err(LedgerError::Duplicate("r".into()))
    );
    assert_eq!(
        b.slot(4),
        SlotLoad::default(),
        "a refused reservation books nothing"
    );
    let l = b.slot(3);
    assert_eq!(
        (l.prefill_tokens, l.decode_blocks, l.requests),
        (150, 14, 2)
    );
    assert!(b.prefill_complete(&r, t));
    assert!(b.output_block(&r, None, t));
    assert_eq!(b.slot(3).decode_blocks, 15);
    // Half weight: five blocks count as three (rounded), not five.
    assert!(b.output_block(&r, Some(0.5), t));
    assert_eq!(b.slot(3).decode_blocks, 10 + 3);
    assert_eq!(b.census(), (1, 1, 0));
    assert_eq!(b.free(&r), Some(3));
    assert_eq!(b.free(&r), None);
    assert!(!b.prefill_complete(&r, t));
    assert!(!b.output_block(&r, None, t));
    assert_eq!(b.slot(3).decode_blocks, 10);
}

#[test]
fn a_peers_holders_are_its_own_even_with_the_same_names() {
    let mut b = Bookings::new(Duration::from_secs(300));
    let t = Instant::now();
    let here = Holder::here(Id::Gateway(key(1)));
    let there = Holder {
        origin: Origin::Peer(42),
        id: Id::Gateway(key(1)),
    };
    b.admit(here.clone(), load(1, 10, 1), t);
    b.admit(there.clone(), load(1, 20, 2), t);
    // A message heard twice is counted once.
    b.admit(there.clone(), load(1, 20, 2), t);
    assert_eq!(b.slot(1).prefill_tokens, 30);
    assert_eq!(b.census(), (1, 0, 1));
    b.free(&there);
    assert_eq!(b.slot(1).prefill_tokens, 10);
    // A lost free is repaired by the expiry.
    b.admit(there, load(1, 20, 2), t);
    b.sweep(t + Duration::from_secs(301));
    assert_eq!(b.slot(1), SlotLoad::default());
}

#[test]
fn slot_sums_saturate_rather_than_wrap() {
    let mut b = Bookings::new(Duration::from_secs(300));
    let t = Instant::now();
    let huge = 1u64 << 63;
    // Wrapping, these two would read as an idle slot (and in a debug
    // build, panic inside the ledger's lock).
    let r1 = b.reserve("a", load(1, huge, huge), t).unwrap();
    b.reserve("b", load(1, huge, huge), t).unwrap();
    let l = b.slot(1);
    assert_eq!(
        (l.prefill_tokens, l.decode_blocks, l.requests),
        (u64::MAX, u64::MAX, 2)
    );
    assert!(b.output_block(&r1, None, t));
    assert_eq!(b.slot(1).decode_blocks, u64::MAX);
    // Releasing takes off no more than what is there.
    b.free(&r1);
    assert_eq!(b.slot(1).prefill_tokens, u64::MAX - huge);
    b.sweep(t + Duration::from_secs(1));
    b.sweep(t + Duration::from_secs(2));
}

#[test]
fn a_bound_names_the_field_over_it() {
    let bound = Bound::of_prompt(1 << 24);
    assert_eq!(bound.check(1 << 24, 1 << 25), Ok(()));
    assert!(
        bound
            .check((1 << 24) + 1, 0)
            .unwrap_err()
            .contains("prefill")
    );
    assert!(
        bound
            .check(0, (1 << 25) + 1)
            .unwrap_err()
            .contains("decode")
    );
}
