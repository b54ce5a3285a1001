use super::*;
use proptest::prelude::*;
use serde_json::{Value, json};

fn value(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

fn rank(index: u32, size: u32) -> Rank {
    Rank { index, size }
}

#[test]
fn the_bootstrap_fields_follow_the_clients_own_bytes() {
    let client = br#"{"model":"m", "prompt":"hi","max_tokens":7,"temperature":0.10,"seed":1e3}  "#;
    let out = body(client, "10.0.0.7", 8998, 42).unwrap();
    let text = std::str::from_utf8(&out).unwrap();
    assert_eq!(
        text,
        r#"{"model":"m", "prompt":"hi","max_tokens":7,"temperature":0.10,"seed":1e3,"bootstrap_host":"10.0.0.7","bootstrap_port":8998,"bootstrap_room":42}  "#
    );
}

#[test]
fn a_clients_own_bootstrap_fields_are_replaced() {
    let client = br#"{"bootstrap_room":7,"model":"m","bootstrap_host":"evil","stream":true,"bootstrap_port":1,"temperature":0.10}"#;
    let out = body(client, "10.0.0.7", 9000, 5).unwrap();
    let text = std::str::from_utf8(&out).unwrap();
    assert_eq!(
        text,
        r#"{"model":"m","stream":true,"temperature":0.10,"bootstrap_host":"10.0.0.7","bootstrap_port":9000,"bootstrap_room":5}"#
    );
    // Only bootstrap fields, and an empty object.
    let out = body(br#"{"bootstrap_room":null}"#, "h", 1, 2).unwrap();
    assert_eq!(
        value(&out),
        json!({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2})
    );
    let out = body(b" { } ", "h", 1, 2).unwrap();
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#" { "bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2} "#
    );
}

#[test]
fn bodies_that_are_not_objects_are_refused() {
    for bad in [&b"[1]"[..], b"", b"{", b"\"x\"", br#"{"a":1}x"#, b"\xff"] {
        assert!(body(bad, "h", 1, 2).is_err(), "{bad:?}");
    }
}

#[test]
fn the_host_is_the_endpoints_ip() {
    assert_eq!(bootstrap_host("10.0.3.17:8000"), "10.0.3.17");
    assert_eq!(bootstrap_host("[fd00::1]:8000"), "fd00::1");
    assert_eq!(bootstrap_host("host"), "host");
    let out = body(b"{}", bootstrap_host("[::1]:80"), 1, 2).unwrap();
    assert_eq!(value(&out)["bootstrap_host"], "::1");
}

#[test]
fn rooms_land_on_both_ranks() {
    for (p, d) in [
        (rank(0, 1), rank(0, 1)),
        (rank(1, 2), rank(3, 4)),
        (rank(2, 3), rank(1, 4)),
        (rank(5, 8), rank(1, 2)),
        (rank(0, 6), rank(3, 9)),
    ] {
        for start in [0, 1, 12_345, ROOM_MAX - 3, u64::MAX] {
            let r = room(start, p, d);
            assert!(r.both, "{p:?} {d:?} {start}");
            assert!(r.room <= ROOM_MAX);
            assert_eq!(r.room % u64::from(p.size), u64::from(p.index));
            assert_eq!(r.room % u64::from(d.size), u64::from(d.index));
        }
    }
}

#[test]
fn rooms_that_cannot_land_on_both_land_on_the_prefill_rank() {
    // Even and odd: 2 and 4 ranks share the factor 2.
    let r = room(1000, rank(0, 2), rank(1, 4));
    assert!(!r.both);
    assert_eq!(r.room % 2, 0);
    let r = room(ROOM_MAX, rank(1, 6), rank(0, 4));
    assert!(!r.both);
    assert_eq!(r.room % 6, 1);
    assert!(r.room <= ROOM_MAX);
}

#[test]
fn rooms_are_deterministic_in_their_start_and_spread_by_it() {
    let (p, d) = (rank(1, 2), rank(2, 4));
    assert_eq!(room(77, p, d), room(77, p, d));
    let rooms: std::collections::HashSet<u64> = (0..64).map(|i| room(mix(i), p, d).room).collect();
    assert_eq!(rooms.len(), 64);
}

#[test]
fn a_size_of_zero_reads_as_one_rank() {
    let r = room(99, rank(0, 0), rank(7, 0));
    assert!(r.both);
    assert_eq!(r.room, 99);
}

proptest! {
    /// Any room is a u63 on the prefill rank, and on the decode rank
    /// whenever the two are compatible (the Chinese remainder theorem).
    #[test]
    fn any_ranks_get_a_fitting_room(start in any::<u64>(), ps in 1u32..64, ds in 1u32..64, pi in any::<u32>(), di in any::<u32>()) {
        let (p, d) = (rank(pi % ps, ps), rank(di % ds, ds));
        let r = room(start, p, d);
        prop_assert!(r.room <= ROOM_MAX);
        prop_assert_eq!(r.room % u64::from(ps), u64::from(p.index));
        let g = gcd(u64::from(ps), u64::from(ds));
        let compatible = u64::from(p.index) % g == u64::from(d.index) % g;
        prop_assert_eq!(r.both, compatible);
        if compatible {
            prop_assert_eq!(r.room % u64::from(ds), u64::from(d.index));
        }
    }

    /// Whatever the client's object holds, the body keeps its other
    /// fields, and the bootstrap fields are kvgate's, once each.
    #[test]
    fn any_object_gets_kvgates_fields(
        keys in proptest::collection::vec(prop_oneof![
            "[a-z_]{1,10}",
            Just("bootstrap_room".to_string()),
            Just("bootstrap_host".to_string()),
            Just("bootstrap_port".to_string()),
        ], 0..8),
        n in any::<i64>(),
        room_no in 0..=ROOM_MAX,
        port in any::<u16>(),
    ) {
        let inner: Vec<String> = keys.iter().map(|k| format!("\"{k}\":{n}")).collect();
        let client = format!("{{{}}}", inner.join(","));
        let out = body(client.as_bytes(), "10.1.2.3", port, room_no).unwrap();
        let text = String::from_utf8(out).unwrap();
        for f in FIELDS {
            prop_assert_eq!(text.matches(&format!("\"{f}\"")).count(), 1, "{}", text);
        }
        let v: Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(&v["bootstrap_room"], &json!(room_no));
        prop_assert_eq!(&v["bootstrap_port"], &json!(port));
        prop_assert_eq!(&v["bootstrap_host"], &json!("10.1.2.3"));
        for k in keys.iter().filter(|k| !FIELDS.contains(&k.as_str())) {
            prop_assert_eq!(&v[k.as_str()], &json!(n));
        }
    }
}
