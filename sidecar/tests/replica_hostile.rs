//! Replica sync under hostile peers, on real ZMQ sockets: one frame over
//! the 1 MiB cap (libzmq drops the connection and would never connect
//! again; the sidecar must notice, count it, connect again and hear the
//! peer's later messages), admissions past the bound, and signed
//! messages recorded off the wire and sent again.

use kvgate_core::booking::Key;
use kvgate_sidecar::replica::wire::{self, Placed, Stamp, SyncEvent, SyncId};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

mod support;

use support::{
    call_raw, fake_worker, json_of, metric, publisher, selection_api, sidecar_from, wait_until,
    workers_up,
};

fn free(seq: u64) -> Vec<u8> {
    wire::encode(
        &Stamp::now(42, seq),
        &[SyncEvent::Free(SyncId::Gateway(Key { vm: 7, seq }))],
        None,
    )
}

async fn peer_state(base: &str) -> Value {
    let (status, v) = json_of("GET", &format!("{base}/replica_sync/peers"), None).await;
    assert_eq!(status, 200);
    v["state"][0].clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_frame_costs_one_reconnect_not_the_peer() {
    let ctx = zmq::Context::new();
    let (publisher, endpoint) = publisher(&ctx);
    let toml = format!(
        "[replica_sync]\nlisten = \"127.0.0.1:0\"\npeers = [\"{endpoint}\"]\n[[models]]\nname = \"m\"\n"
    );
    let (base, sc) = sidecar_from(&toml, None).await;
    let received = "kvgate_sidecar_replica_sync_events_total{result=\"received\"}";
    let reconnects = format!("kvgate_sidecar_replica_peer_reconnects_total{{peer=\"{endpoint}\"}}");
    let connected = format!("kvgate_sidecar_replica_peer_connected{{peer=\"{endpoint}\"}}");

    // PUB drops what it sends before the subscription reaches it: send
    // until one message arrives.
    let mut seq = 0;
    let mut until_received = async |at_least: f64, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while metric(&sc, received) < at_least {
            assert!(Instant::now() < deadline, "{what}");
            seq += 1;
            publisher.send(free(seq), 0).unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    until_received(1.0, "the peer's first message never arrived").await;
    assert_eq!(metric(&sc, &connected), 1.0);
    let before = peer_state(&base).await;
    assert_eq!(before["connected"], true);
    assert_eq!(before["reconnects"], 0);
    assert!(before["messages"].as_u64().unwrap() >= 1);

    // One 2 MiB frame: over the cap, libzmq drops the connection.
    publisher.send(vec![0u8; 2 << 20], 0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&sc, &reconnects) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the lost connection was never noticed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The later messages arrive again.
    let heard = metric(&sc, received);
    until_received(
        heard + 1.0,
        "no message from the peer after its oversized frame",
    )
    .await;
    let after = peer_state(&base).await;
    assert_eq!(after["endpoint"], endpoint.as_str());
    assert_eq!(after["connected"], true);
    assert!(after["reconnects"].as_u64().unwrap() >= 1);
    assert!(after["messages"].as_u64() > before["messages"].as_u64());
    assert!(after["last_message_age_ms"].as_u64().unwrap() < 5_000);
    assert_eq!(metric(&sc, &connected), 1.0);
    // Nothing was decoded from the oversized frame: it never got through.
    assert_eq!(after["messages_refused"], 0);

    // One loss, one reconnect: starting the connection over does not
    // itself count as another loss.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(metric(&sc, &reconnects), 1.0);
}

/// A peer's admission on worker 1's only rank.
fn admit(id: &str, prefill_tokens: u64, decode_blocks: u64) -> SyncEvent {
    SyncEvent::Admit(
        SyncId::Reservation(id.into()),
        Placed {
            model: "m".into(),
            tenant: kvgate_core::DEFAULT_TENANT.into(),
            request_tenant: kvgate_core::DEFAULT_TENANT.into(),
            block_size: 16,
            worker_id: 1,
            dp_rank: 0,
            prefill_tokens,
            decode_blocks,
        },
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peers_admission_past_the_bound_is_refused_and_counted() {
    let ctx = zmq::Context::new();
    let (publisher, endpoint) = publisher(&ctx);
    let toml = format!(
        "[replica_sync]\nlisten = \"127.0.0.1:0\"\npeers = [\"{endpoint}\"]\n\
         [[models]]\nname = \"m\"\nmax_prompt_tokens = 4096\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:9\"\n"
    );
    let (_base, sc) = sidecar_from(&toml, None).await;
    let refused = "kvgate_sidecar_bookings_refused_total{reason=\"out_of_bound\",source=\"peer\"}";
    // One message: two admissions the ledger must not take (2^63 tokens
    // would wrap a rank's sum with one more), one at the bound.
    let message = wire::encode(
        &Stamp::now(42, 1),
        &[
            admit("huge", 1 << 63, 1),
            admit("over", 4097, 1),
            admit("blocks", 1, 8193),
            admit("ok", 4096, 8192),
        ],
        None,
    );
    // PUB drops what it sends before the subscription reaches it; the same
    // message again is a replay, whose admissions are refused as such.
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&sc, refused) < 3.0 {
        assert!(
            Instant::now() < deadline,
            "the peer's message never arrived"
        );
        publisher.send(&message, 0).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric(&sc, refused) % 3.0, 0.0, "counted per admission");
    assert_eq!(sc.active_bookings(), 1, "only the admission at the bound");
}

const TOKEN: &str = "s3cret";

/// A sidecar with worker 1 of model `m`, replica sync on, subscribed to
/// `peers`.
fn sync_config(worker: &str, peers: &[&str]) -> String {
    format!(
        "[server]\npublish_interval_ms = 10\n[scrape]\ninterval_ms = 50\n\
         [replica_sync]\nlisten = \"127.0.0.1:0\"\npeers = {peers:?}\n\
         [[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"{worker}\"\n"
    )
}

/// Sends `message` until `done`: PUB drops what it sends before the
/// subscription reaches it.
async fn send_until(
    publisher: &zmq::Socket,
    message: &[u8],
    what: &str,
    mut done: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        publisher.send(message, 0).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const REPLAYED: &str = "kvgate_sidecar_replica_sync_events_total{result=\"replayed\"}";
const STALE: &str = "kvgate_sidecar_replica_sync_events_total{result=\"stale\"}";

/// A reservation on A's selection API, with the token.
async fn reserve(api: &str, method: &str, path: &str, body: Value) -> u16 {
    let auth = format!("Bearer {TOKEN}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    call_raw(
        method,
        &format!("{api}{path}"),
        &headers,
        body.to_string().into_bytes(),
    )
    .await
    .0
}

/// The next message on `tap` that carries an event `pick` chooses, as
/// sent, and that event's reservation id.
fn recorded(
    tap: &zmq::Socket,
    pick: impl Fn(&SyncEvent) -> Option<String>,
) -> Option<(Vec<u8>, String)> {
    while let Ok(bytes) = tap.recv_bytes(0) {
        let (_, events) = wire::decode(&bytes, Some(TOKEN)).unwrap();
        if let Some(id) = events.iter().find_map(&pick) {
            return Some((bytes, id));
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recorded_admission_sent_again_after_its_free_books_nothing() {
    let (w, _) = fake_worker().await;
    let (a_base, a) = sidecar_from(&sync_config(&w, &[]), Some(TOKEN)).await;
    let a_api = selection_api(&a).await;
    wait_until("A's worker up", async || workers_up(&a_base).await == 1).await;
    // The selection API reads the published snapshot, a publish behind the
    // catalog: a reservation before it sees the worker is answered 404.
    wait_until("A's selection API sees the worker", async || {
        let pinned = json!({"model_name": "m", "token_ids": [1],
                            "pinned_worker": {"worker_id": 1, "dp_rank": 0}});
        let (status, v) = json_of("POST", &format!("{a_api}/select"), Some(pinned)).await;
        status == 200 && v["worker_id"].as_u64() == Some(1)
    })
    .await;

    // Someone reading A's sync port records an admission and its free,
    // signed as they are.
    let ctx = zmq::Context::new();
    let tap = ctx.socket(zmq::SUB).unwrap();
    tap.set_subscribe(b"").unwrap();
    tap.set_rcvtimeo(100).unwrap();
    tap.connect(a.replica().unwrap().endpoint()).unwrap();
    let admit_of = |e: &SyncEvent| match e {
        SyncEvent::Admit(SyncId::Reservation(id), _) => Some(id.to_string()),
        _ => None,
    };
    let mut n = 0;
    let (admission, id) = loop {
        n += 1;
        assert!(n < 100, "no admission recorded");
        let body = json!({"reservation_id": format!("r{n}"), "model_name": "m", "worker_id": 1, "isl_tokens": 16});
        assert_eq!(reserve(&a_api, "POST", "/reservations", body).await, 200);
        if let Some(got) = recorded(&tap, admit_of) {
            break got;
        }
    };
    assert_eq!(
        reserve(
            &a_api,
            "DELETE",
            &format!("/reservations/{id}"),
            Value::Null
        )
        .await,
        204
    );
    let (free, _) = recorded(&tap, |e| match e {
        SyncEvent::Free(SyncId::Reservation(r)) if **r == *id => Some(id.clone()),
        _ => None,
    })
    .expect("the free recorded");

    // B, with the same token, hears them from where A should be.
    let (publisher, endpoint) = publisher(&ctx);
    let (b_base, b) = sidecar_from(&sync_config(&w, &[&endpoint]), Some(TOKEN)).await;
    send_until(
        &publisher,
        &admission,
        "B never booked the admission",
        || b.active_bookings() == 1,
    )
    .await;
    send_until(&publisher, &free, "B never freed it", || {
        b.active_bookings() == 0
    })
    .await;

    // The admission again, after its free: signed, but a replay.
    let before = metric(&b, REPLAYED);
    send_until(&publisher, &admission, "the replay never arrived", || {
        metric(&b, REPLAYED) > before
    })
    .await;
    assert_eq!(b.active_bookings(), 0, "the replayed admission booked load");
    let (_, peers) = json_of("GET", &format!("{b_base}/replica_sync/peers"), None).await;
    assert!(
        peers["state"][0]["admissions_replayed"].as_u64().unwrap() >= 1,
        "{peers}"
    );
    let per_peer = format!(
        "kvgate_sidecar_replica_peer_refused_admissions_total{{peer=\"{endpoint}\",reason=\"replayed\"}}"
    );
    assert!(metric(&b, &per_peer) >= 1.0);
}

/// Message `seq` of `origin`, sent `ago_ms` before now, signed.
fn signed(origin: u64, seq: u64, ago_ms: u64, events: &[SyncEvent]) -> Vec<u8> {
    let mut s = Stamp::now(origin, seq);
    s.sent_at_ms -= ago_ms;
    wire::encode(&s, events, Some(TOKEN))
}

fn reservation_free(id: &str) -> SyncEvent {
    SyncEvent::Free(SyncId::Reservation(id.into()))
}

/// A version-1 message, as a peer on an older release signs it: no
/// sequence number or time.
fn version_one(events_free: &str) -> Vec<u8> {
    use hmac::Mac;
    let mut v = b"KVGR\x01".to_vec();
    v.extend_from_slice(&5u64.to_le_bytes());
    v.extend_from_slice(&1u16.to_le_bytes());
    v.extend_from_slice(&[3, 2]);
    v.extend_from_slice(&(events_free.len() as u16).to_le_bytes());
    v.extend_from_slice(events_free.as_bytes());
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(TOKEN.as_bytes()).unwrap();
    m.update(&v);
    v.extend_from_slice(&m.finalize().into_bytes());
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn late_frees_apply_restarted_origins_are_heard_and_old_versions_are_refused() {
    let ctx = zmq::Context::new();
    let (publisher, endpoint) = publisher(&ctx);
    let toml = format!(
        "[replica_sync]\nlisten = \"127.0.0.1:0\"\npeers = [\"{endpoint}\"]\n\
         [[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:9\"\n"
    );
    let (_base, sc) = sidecar_from(&toml, Some(TOKEN)).await;
    let send = |m: Vec<u8>| publisher.send(m, 0).unwrap();
    let held = || sc.active_bookings();
    let wait = async |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };

    // Origin 1's first admission, sent until the subscription is up;
    // from then on every message arrives, in order.
    let first = signed(1, 1, 0, &[admit("x", 10, 1)]);
    send_until(
        &publisher,
        &first,
        "the first admission never arrived",
        || held() == 1,
    )
    .await;
    send(signed(1, 2000, 0, &[admit("y", 10, 1)]));
    wait("y booked", &|| held() == 2).await;

    // A message from far behind origin 1's latest, as heavy reordering
    // would deliver it: its free applies, its admission does not.
    let replayed = metric(&sc, REPLAYED);
    send(signed(1, 2, 0, &[reservation_free("x"), admit("z", 10, 1)]));
    // The admission is refused on receipt, the free applied after it by
    // the ingest side: wait for both, not for the counter alone.
    wait("the late message's free", &|| {
        metric(&sc, REPLAYED) > replayed && held() == 1
    })
    .await;
    assert_eq!(held(), 1, "x freed, z refused, y kept");
    assert_eq!(metric(&sc, REPLAYED), replayed + 1.0);

    // Origin 1 restarted: a new origin, numbering from 1 again.
    send(signed(2, 1, 0, &[admit("x", 10, 1)]));
    wait("the restarted origin's admission", &|| held() == 2).await;

    // Sent ten minutes ago by its own clock: refused as stale.
    send(signed(2, 2, 600_000, &[admit("old", 10, 1)]));
    wait("the stale admission counted", &|| metric(&sc, STALE) == 1.0).await;
    assert_eq!(held(), 2);

    // A peer still on version 1, signed with the same token.
    send(version_one("x"));
    let version = "kvgate_sidecar_replica_sync_refused_messages_total{reason=\"version\"}";
    wait("the version-1 message refused", &|| {
        metric(&sc, version) == 1.0
    })
    .await;
    assert_eq!(held(), 2, "its free did not apply either");
}

/// The peer's entry in `/replica_sync/peers`.
async fn peer_named(base: &str, endpoint: &str) -> Value {
    let (status, v) = json_of("GET", &format!("{base}/replica_sync/peers"), None).await;
    assert_eq!(status, 200);
    v["state"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["endpoint"] == endpoint)
        .cloned()
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_holder_forging_another_peers_origin_cannot_mute_it() {
    let ctx = zmq::Context::new();
    let (honest, b) = publisher(&ctx);
    let (forger, a) = publisher(&ctx);
    let toml = format!(
        "[replica_sync]\nlisten = \"127.0.0.1:0\"\npeers = [\"{a}\", \"{b}\"]\n\
         [[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:9\"\n"
    );
    let (base, sc) = sidecar_from(&toml, Some(TOKEN)).await;
    let held = || sc.active_bookings();
    const B: u64 = 0xb0b;

    // B's first admission, until its subscription is up.
    send_until(
        &honest,
        &signed(B, 1, 0, &[admit("b1", 10, 1)]),
        "B's first admission never arrived",
        || held() == 1,
    )
    .await;
    // A holds the token too: it signs a message under B's origin, numbered
    // far past anything B will send.
    send_until(
        &forger,
        &signed(B, 1 << 40, 0, &[admit("forged", 10, 1)]),
        "the forged message never arrived",
        || held() == 2,
    )
    .await;

    // B's next admissions are its own, numbered on from its first.
    for seq in 2..=4 {
        honest
            .send(signed(B, seq, 0, &[admit(&format!("b{seq}"), 10, 1)]), 0)
            .unwrap();
    }
    wait_until("B's later admissions booked", async || held() == 5).await;
    let state = peer_named(&base, &b).await;
    assert_eq!(state["admissions_replayed"], 0, "{state}");
    assert_eq!(
        metric(
            &sc,
            &format!(
                "kvgate_sidecar_replica_peer_refused_admissions_total{{peer=\"{b}\",reason=\"replayed\"}}"
            )
        ),
        0.0
    );
}
