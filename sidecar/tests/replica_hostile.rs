//! Replica sync under a peer that sends one frame over the 1 MiB cap, on
//! real ZMQ sockets: libzmq drops the connection and would never connect
//! again; the sidecar must notice, count it, connect again and hear the
//! peer's later messages.

use kvgate_core::booking::Key;
use kvgate_sidecar::replica::wire::{self, Placed, SyncEvent, SyncId};
use serde_json::Value;
use std::time::{Duration, Instant};

mod support;

use support::{json_of, metric, sidecar_from};

fn free(seq: u64) -> Vec<u8> {
    wire::encode(
        42,
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
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.set_linger(0).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
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
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.set_linger(0).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
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
        42,
        &[
            admit("huge", 1 << 63, 1),
            admit("over", 4097, 1),
            admit("blocks", 1, 8193),
            admit("ok", 4096, 8192),
        ],
        None,
    );
    // PUB drops what it sends before the subscription reaches it; the same
    // admissions again replace themselves.
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
