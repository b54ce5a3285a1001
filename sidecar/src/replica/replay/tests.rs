use super::*;

const NOW_MS: u64 = 1_700_000_000_000;
const AGE: Duration = Duration::from_secs(30);

fn stamp(origin: u64, seq: u64) -> Stamp {
    Stamp {
        origin,
        seq,
        sent_at_ms: NOW_MS,
    }
}

fn check(g: &mut ReplayGuard, origin: u64, seq: u64) -> Verdict {
    g.check(&stamp(origin, seq), NOW_MS, Instant::now())
}

#[test]
fn a_message_seen_once_is_a_replay_after() {
    let mut g = ReplayGuard::new(AGE);
    assert_eq!(check(&mut g, 1, 1), Verdict::Fresh);
    assert_eq!(check(&mut g, 1, 2), Verdict::Fresh);
    assert_eq!(check(&mut g, 1, 1), Verdict::Replayed);
    assert_eq!(check(&mut g, 1, 2), Verdict::Replayed);
    // Another origin has its own numbers.
    assert_eq!(check(&mut g, 2, 1), Verdict::Fresh);
}

#[test]
fn reordering_within_the_window_is_fresh_and_behind_it_is_not() {
    let mut g = ReplayGuard::new(AGE);
    assert_eq!(check(&mut g, 1, 10), Verdict::Fresh);
    // Late, never seen: fresh, once.
    assert_eq!(check(&mut g, 1, 7), Verdict::Fresh);
    assert_eq!(check(&mut g, 1, 7), Verdict::Replayed);
    assert_eq!(check(&mut g, 1, 9), Verdict::Fresh);
    // The window now ends just above 9.
    let top = 10 + WINDOW - 1;
    assert_eq!(check(&mut g, 1, top), Verdict::Fresh);
    assert_eq!(
        check(&mut g, 1, 11),
        Verdict::Fresh,
        "in the window, not seen"
    );
    assert_eq!(
        check(&mut g, 1, 10),
        Verdict::Replayed,
        "in the window, seen"
    );
    assert_eq!(check(&mut g, 1, 8), Verdict::Replayed, "behind the window");
}

#[test]
fn sliding_forgets_what_the_slots_held_before() {
    let mut g = ReplayGuard::new(AGE);
    for seq in 1..=3 * WINDOW {
        assert_eq!(check(&mut g, 1, seq), Verdict::Fresh, "{seq}");
    }
    // A jump of more than the window, then the numbers it skipped that
    // are still within it.
    let top = 5 * WINDOW;
    assert_eq!(check(&mut g, 1, top), Verdict::Fresh);
    assert_eq!(check(&mut g, 1, top - 1), Verdict::Fresh);
    assert_eq!(check(&mut g, 1, top - WINDOW + 1), Verdict::Fresh);
    assert_eq!(check(&mut g, 1, 3 * WINDOW), Verdict::Replayed);
}

#[test]
fn a_restarted_origin_is_a_new_one_and_starts_over() {
    let mut g = ReplayGuard::new(AGE);
    for seq in 1..=100 {
        check(&mut g, 7, seq);
    }
    // The restarted sidecar drew another origin: its 1 is fresh.
    assert_eq!(check(&mut g, 8, 1), Verdict::Fresh);
    assert_eq!(check(&mut g, 7, 50), Verdict::Replayed);
}

#[test]
fn messages_outside_the_age_are_stale_and_leave_no_trace() {
    let mut g = ReplayGuard::new(AGE);
    let old = Stamp {
        origin: 1,
        seq: 5,
        sent_at_ms: NOW_MS - 30_001,
    };
    let ahead = Stamp {
        sent_at_ms: NOW_MS + 30_001,
        ..old
    };
    assert_eq!(g.check(&old, NOW_MS, Instant::now()), Verdict::Stale);
    assert_eq!(g.check(&ahead, NOW_MS, Instant::now()), Verdict::Stale);
    assert!(!g.remembers(1));
    let edge = Stamp {
        sent_at_ms: NOW_MS - 30_000,
        ..old
    };
    assert_eq!(g.check(&edge, NOW_MS, Instant::now()), Verdict::Fresh);
}

#[test]
fn origins_are_bounded_and_the_quiet_ones_go_first() {
    let mut g = ReplayGuard::new(AGE);
    let start = Instant::now();
    for origin in 0..MAX_ORIGINS as u64 {
        g.check(&stamp(origin, 1), NOW_MS, start);
    }
    // Origin 0 speaks again later; the others stay quiet past twice the
    // age, so room is made by forgetting them, not it.
    let later = start + 3 * AGE;
    assert_eq!(g.check(&stamp(0, 2), NOW_MS, later), Verdict::Fresh);
    assert_eq!(g.check(&stamp(u64::MAX, 1), NOW_MS, later), Verdict::Fresh);
    assert!(g.remembers(0) && g.remembers(u64::MAX));
    assert_eq!(g.origins.len(), 2);
    // Full of live origins: the least recently heard one goes.
    let mut g = ReplayGuard::new(AGE);
    for origin in 0..MAX_ORIGINS as u64 {
        g.check(
            &stamp(origin, 1),
            NOW_MS,
            start + Duration::from_millis(origin),
        );
    }
    g.check(&stamp(u64::MAX, 1), NOW_MS, start + AGE);
    assert_eq!(g.origins.len(), MAX_ORIGINS);
    assert!(!g.remembers(0) && g.remembers(1));
}
