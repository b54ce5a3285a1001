use super::*;
use crate::config::LedgerCaps;

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
        tenant: TENANT.into(),
    }
}

/// Whose requests the tests book, unless they say.
const TENANT: &str = kvgate_core::DEFAULT_TENANT;

fn any_slot(_: &str, _: u16) -> bool {
    true
}

#[test]
fn a_request_books_prefill_then_decode_and_releases_everything() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    assert_eq!(
        b.apply(book(1, 3, 1000, 70), t, any_slot),
        Effect::Booked {
            model: "m".into(),
            slot: 3,
            tenant: TENANT.into(),
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
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
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
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    b.apply(book(1, 1, 100, 10), t, any_slot);
    b.apply(book(2, 1, 100, 10), t + Duration::from_secs(200), any_slot);
    assert_eq!(b.sweep(t + Duration::from_secs(301)).expired, 1);
    assert_eq!(b.slot(1).decode_blocks, 10);
    assert_eq!(b.sweep(t + Duration::from_secs(501)).expired, 1);
    assert_eq!(b.slot(1).decode_blocks, 0);
    assert_eq!(b.expired_total, 2);
    assert!(b.applied().is_empty(), "a silent VM's mark goes too");
}

#[test]
fn drain_rate_follows_completions() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
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
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
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
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    b.apply(book(1, 3, 100, 10), t, any_slot);
    let r = b.reserve("r", load(3, 50, 4), TENANT, t).unwrap();
    assert_eq!(
        b.reserve("r", load(4, 1, 1), TENANT, t),
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

/// Each tenant's sums on a slot, by name.
fn tenants(b: &Bookings, slot: u16) -> Vec<(String, u64, u64, u64)> {
    let mut v: Vec<_> = b
        .slot_tenants(slot)
        .map(|(t, l)| (t.to_string(), l.prefill_tokens, l.decode_blocks, l.requests))
        .collect();
    v.sort();
    v
}

#[test]
fn each_tenants_sums_move_with_its_holders_and_go_with_the_last() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    let mut a = book(1, 3, 100, 10);
    if let Event::Book { tenant, .. } = &mut a {
        *tenant = "team-a".into();
    }
    b.apply(a, t, any_slot);
    let r = b.reserve("r", load(3, 50, 4), "team-b", t).unwrap();
    let peer = Holder {
        origin: Origin::Peer(9),
        id: Id::Gateway(key(1)),
    };
    b.admit(peer.clone(), load(3, 7, 1), "team-a", t).unwrap();
    assert_eq!(
        tenants(&b, 3),
        [("team-a".into(), 107, 11, 2), ("team-b".into(), 50, 4, 1)]
    );
    // The first byte, output blocks and their weight move the tenant's
    // sums as they move the slot's.
    assert!(b.prefill_complete(&r, t));
    assert!(b.output_block(&r, Some(0.5), t));
    assert_eq!(tenants(&b, 3)[1], ("team-b".into(), 0, 3, 1));
    // A peer's admission heard twice counts once.
    b.admit(peer.clone(), load(3, 7, 1), "team-a", t).unwrap();
    assert_eq!(tenants(&b, 3)[0], ("team-a".into(), 107, 11, 2));
    b.free(&r);
    b.free(&peer);
    assert_eq!(tenants(&b, 3), [("team-a".into(), 100, 10, 1)]);
    // The last one expires: nothing of the tenant is left.
    b.sweep(t + Duration::from_secs(301));
    assert_eq!(tenants(&b, 3), []);
    assert_eq!(b.slot(3).requests, 0);
    assert_eq!(tenants(&b, 4), []);
}

#[test]
fn a_peers_holders_are_its_own_even_with_the_same_names() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    let here = Holder::here(Id::Gateway(key(1)));
    let there = Holder {
        origin: Origin::Peer(42),
        id: Id::Gateway(key(1)),
    };
    b.admit(here.clone(), load(1, 10, 1), TENANT, t).unwrap();
    b.admit(there.clone(), load(1, 20, 2), TENANT, t).unwrap();
    // A message heard twice is counted once.
    b.admit(there.clone(), load(1, 20, 2), TENANT, t).unwrap();
    assert_eq!(b.slot(1).prefill_tokens, 30);
    assert_eq!(b.census(), (1, 0, 1));
    b.free(&there);
    assert_eq!(b.slot(1).prefill_tokens, 10);
    // A lost free is repaired by the expiry.
    b.admit(there, load(1, 20, 2), TENANT, t).unwrap();
    b.sweep(t + Duration::from_secs(301));
    assert_eq!(b.slot(1), SlotLoad::default());
}

#[test]
fn slot_sums_saturate_rather_than_wrap() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    let huge = 1u64 << 63;
    // Wrapping, these two would read as an idle slot (and in a debug
    // build, panic inside the ledger's lock).
    let r1 = b.reserve("a", load(1, huge, huge), TENANT, t).unwrap();
    b.reserve("b", load(1, huge, huge), TENANT, t).unwrap();
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

fn peer(origin: u64, seq: u64) -> Holder {
    Holder {
        origin: Origin::Peer(origin),
        id: Id::Gateway(Key { vm: 1, seq }),
    }
}

fn small_caps() -> LedgerCaps {
    LedgerCaps {
        holders: 60,
        holders_per_origin: 10,
        gateway_holders: 15,
        peer_holders: 20,
        gateway_vms: 3,
    }
}

#[test]
fn a_flood_from_one_origin_is_refused_at_its_cap_and_others_still_book() {
    let mut b = Bookings::new(Duration::from_secs(300), small_caps());
    let t = Instant::now();
    let refused = (0..1000)
        .filter(|i| b.admit(peer(1, *i), load(1, 10, 1), TENANT, t).is_err())
        .count();
    assert_eq!(refused, 990);
    assert_eq!(
        b.admit(peer(1, 5000), load(1, 10, 1), TENANT, t),
        Err(Full::Origin(10))
    );
    assert_eq!(b.slot(1).requests, 10, "a refused holder books nothing");
    // Heard again, a holder it already has is no new one.
    assert_eq!(b.admit(peer(1, 3), load(1, 10, 1), TENANT, t), Ok(()));
    // Another peer, the API and the gateways keep their room.
    assert_eq!(b.admit(peer(2, 0), load(2, 1, 1), TENANT, t), Ok(()));
    assert!(b.reserve("r", load(2, 1, 1), TENANT, t).is_ok());
    assert!(matches!(
        b.apply(book(1, 2, 1, 1), t, any_slot),
        Effect::Booked { .. }
    ));
    assert_eq!(b.census(), (1, 1, 11));
    // An end makes room again.
    b.free(&peer(1, 0));
    assert_eq!(b.admit(peer(1, 5000), load(1, 10, 1), TENANT, t), Ok(()));
}

#[test]
fn origins_that_rename_themselves_meet_their_kinds_cap() {
    let mut b = Bookings::new(Duration::from_secs(300), small_caps());
    let t = Instant::now();
    // A peer announcing a new process id with every admission.
    let peers = (0..1000)
        .filter(|o| b.admit(peer(*o, 0), load(1, 1, 1), TENANT, t).is_ok())
        .count();
    assert_eq!(peers, 20);
    assert_eq!(
        b.admit(peer(5000, 0), load(1, 1, 1), TENANT, t),
        Err(Full::Peers(20))
    );
    // Gateway VMs choose their tags: new tags stop at the VMs tracked, and
    // the gateways together at their cap.
    let vm_book = |vm: u64, seq: u64| Event::Book {
        key: Key { vm, seq },
        model: "m".into(),
        slot: 2,
        prefill_tokens: 1,
        decode_blocks: 1,
        tenant: TENANT.into(),
    };
    assert_eq!(
        b.apply(vm_book(99, 1), t, any_slot),
        Effect::Booked {
            model: "m".into(),
            slot: 2,
            tenant: TENANT.into(),
        }
    );
    for vm in 100..102 {
        for seq in 0..10 {
            b.apply(vm_book(vm, seq), t, any_slot);
        }
    }
    assert_eq!(b.census().0, 15, "all gateways together");
    assert_eq!(
        b.apply(vm_book(99, 2), t, any_slot),
        Effect::Full(Full::Gateways(15))
    );
    assert_eq!(
        b.apply(vm_book(103, 1), t, any_slot),
        Effect::Full(Full::GatewayVms(3))
    );
    assert_eq!(b.applied().len(), 3, "only the VMs tracked are echoed");
    // The API still books, up to its own share.
    let api = (0..100)
        .filter(|i| {
            b.reserve(&format!("r{i}"), load(3, 1, 1), TENANT, t)
                .is_ok()
        })
        .count();
    assert_eq!(api, 10);
    assert_eq!(
        b.reserve("one-more", load(3, 1, 1), TENANT, t),
        Err(LedgerError::Full(Full::Origin(10)))
    );
}

#[test]
fn the_total_cap_holds_when_the_kinds_would_allow_more() {
    let caps = LedgerCaps {
        holders: 12,
        ..small_caps()
    };
    let mut b = Bookings::new(Duration::from_secs(300), caps);
    let t = Instant::now();
    for o in 0..10 {
        b.admit(peer(o, 0), load(1, 1, 1), TENANT, t).unwrap();
    }
    b.reserve("a", load(1, 1, 1), TENANT, t).unwrap();
    b.reserve("b", load(1, 1, 1), TENANT, t).unwrap();
    assert_eq!(
        b.reserve("c", load(1, 1, 1), TENANT, t),
        Err(LedgerError::Full(Full::Total(12)))
    );
    assert_eq!(b.active(), 12);
}

#[test]
fn the_census_follows_ends_expiry_and_dropped_slots() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    b.apply(book(1, 1, 1, 1), t, any_slot);
    b.apply(book(2, 2, 1, 1), t, any_slot);
    b.reserve("r", load(1, 1, 1), TENANT, t).unwrap();
    b.admit(peer(4, 1), load(2, 1, 1), TENANT, t).unwrap();
    b.admit(
        peer(4, 2),
        load(1, 1, 1),
        TENANT,
        t + Duration::from_secs(100),
    )
    .unwrap();
    assert_eq!(b.census(), (2, 1, 2));
    b.drop_slot(2);
    assert_eq!(b.census(), (1, 1, 1));
    assert_eq!(b.sweep(t + Duration::from_secs(301)).expired, 2);
    assert_eq!(b.census(), (0, 0, 1));
    b.free(&peer(4, 2));
    assert_eq!(b.census(), (0, 0, 0));
}

/// `held` holders heard of recently and `due` holders past the expiry:
/// a sweep looks at the `due` ones only.
fn visited_by_one_tick(held: u64, due: u64) -> Sweep {
    let caps = LedgerCaps {
        holders: 1 << 21,
        holders_per_origin: 1 << 21,
        gateway_holders: 1 << 21,
        peer_holders: 1 << 21,
        gateway_vms: 1,
    };
    let mut b = Bookings::new(Duration::from_secs(300), caps);
    let t = Instant::now();
    for seq in 0..due {
        b.admit(peer(1, seq), load(1, 1, 1), TENANT, t).unwrap();
    }
    let recent = t + Duration::from_secs(200);
    for seq in due..due + held {
        b.admit(peer(2, seq), load(2, 1, 1), TENANT, recent)
            .unwrap();
    }
    let sweep = b.sweep(t + Duration::from_secs(301));
    assert_eq!(b.active() as u64, held);
    assert_eq!(b.slot(1), SlotLoad::default());
    sweep
}

#[test]
fn a_tick_visits_the_holders_due_not_the_holders_held() {
    for held in [10_000, 1_000_000] {
        let sweep = visited_by_one_tick(held, 100);
        assert_eq!(
            sweep,
            Sweep {
                expired: 100,
                visited: 100,
                rebuilt: 0,
                silenced: Vec::new(),
            },
            "{held} held"
        );
    }
}

#[test]
fn a_holder_heard_of_again_is_due_later_and_ended_ones_are_dropped_in_bulk() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    let r = b.reserve("r", load(1, 10, 1), TENANT, t).unwrap();
    b.output_block(&r, None, t + Duration::from_secs(200));
    // Its first deadline is looked at once and pushed back.
    let s = b.sweep(t + Duration::from_secs(301));
    assert_eq!((s.expired, s.visited), (0, 1));
    assert_eq!(b.sweep(t + Duration::from_secs(400)).visited, 0);
    let s = b.sweep(t + Duration::from_secs(501));
    assert_eq!((s.expired, s.visited), (1, 1));
    // Ended holders' deadlines are not looked at one by one: once they
    // outnumber the live holders, one rebuild drops them all.
    let later = t + Duration::from_secs(500);
    for i in 0..5000u64 {
        let h = peer(1, i);
        b.admit(h.clone(), load(1, 1, 1), TENANT, later).unwrap();
        b.free(&h);
    }
    b.admit(peer(1, 9999), load(1, 1, 1), TENANT, later)
        .unwrap();
    let s = b.sweep(t + Duration::from_secs(502));
    assert_eq!((s.expired, s.visited, s.rebuilt), (0, 0, 1));
    assert_eq!(b.deadlines.len(), 1);
}

#[test]
fn the_tables_shrink_after_a_surge() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default());
    let t = Instant::now();
    for seq in 0..20_000 {
        b.admit(peer(seq % 8, seq), load(1, 1, 1), TENANT, t)
            .unwrap();
    }
    let kept = t + Duration::from_secs(100);
    for seq in 0..10 {
        b.admit(peer(100, seq), load(1, 1, 1), TENANT, kept)
            .unwrap();
    }
    let (held, deadlines) = (b.capacity(), b.deadlines.capacity());
    assert!(held >= 20_010 && deadlines >= 20_010);
    let s = b.sweep(t + Duration::from_secs(301));
    assert_eq!(s.expired, 20_000);
    assert!(s.rebuilt > 0);
    assert!(b.capacity() < SHRINK_ABOVE, "{held} → {}", b.capacity());
    assert!(b.deadlines.capacity() < SHRINK_ABOVE);
    // What is left is still there, and due when it should be.
    assert_eq!(b.active(), 10);
    assert_eq!(b.census(), (0, 0, 10));
    assert_eq!(b.sweep(t + Duration::from_secs(401)).expired, 10);
}

#[test]
fn a_vm_that_goes_silent_has_its_bookings_ended_and_one_that_never_beat_keeps_them() {
    let mut b = Bookings::new(Duration::from_secs(300), LedgerCaps::default())
        .with_vm_silence(Duration::from_secs(10));
    let t = Instant::now();
    // VM 7 beats and books two requests; VM 8 books one and never beats
    // (a filter of the previous release).
    assert_eq!(b.apply(Event::Alive { vm: 7 }, t, any_slot), Effect::Alive);
    b.apply(book(1, 3, 1000, 70), t, any_slot);
    b.apply(book(2, 4, 500, 40), t, any_slot);
    let old = Event::Book {
        key: Key { vm: 8, seq: 1 },
        model: "m".into(),
        slot: 3,
        prefill_tokens: 10,
        decode_blocks: 1,
        tenant: TENANT.into(),
    };
    b.apply(old, t, any_slot);
    // Beats keep it alive past the silence.
    b.apply(Event::Alive { vm: 7 }, t + Duration::from_secs(9), any_slot);
    assert!(b.sweep(t + Duration::from_secs(15)).silenced.is_empty());
    assert_eq!(b.active(), 3);
    // Then it stops: both of its bookings end, VM 8's stays.
    let mut s = b.sweep(t + Duration::from_secs(20));
    s.silenced.sort_unstable();
    assert_eq!((s.silenced, s.expired), (vec![key(1), key(2)], 0));
    assert_eq!(b.active(), 1);
    assert_eq!(b.silenced_total, 2);
    let l = b.slot(3);
    assert_eq!((l.prefill_tokens, l.decode_blocks, l.requests), (10, 1, 1));
    assert_eq!(b.slot(4).requests, 0);
    assert!(
        b.applied().iter().all(|a| a.vm != 7),
        "its watermark goes too"
    );
    // Its late end changes nothing.
    let late = Event::Done {
        key: key(1),
        timing: None,
    };
    assert_eq!(
        b.apply(late, t + Duration::from_secs(21), any_slot),
        Effect::Unknown
    );
    assert!(b.sweep(t + Duration::from_secs(40)).silenced.is_empty());
}
