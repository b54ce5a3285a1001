//! Replica sync under a peer that sends one frame over the 1 MiB cap, on
//! real ZMQ sockets: libzmq drops the connection and would never connect
//! again; the sidecar must notice, count it, connect again and hear the
//! peer's later messages.

use kvgate_core::booking::Key;
use kvgate_sidecar::replica::wire::{self, SyncEvent, SyncId};
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
