//! The load ledger under floods, over real sockets: a replica-sync peer
//! announcing more admissions than its cap, and a selection API client
//! reserving past its share. Each is refused at its cap and counted, and
//! the other origins keep booking.

use kvgate_core::booking::{Event, Key};
use kvgate_sidecar::replica::wire::{self, Placed, Stamp, SyncEvent, SyncId};
use serde_json::json;
use std::time::{Duration, Instant};

mod support;

use support::*;

/// A peer's admission on worker 1's only rank.
fn admit(seq: u64) -> SyncEvent {
    SyncEvent::Admit(
        SyncId::Gateway(Key { vm: 7, seq }),
        Placed {
            model: "m".into(),
            tenant: kvgate_core::DEFAULT_TENANT.into(),
            request_tenant: kvgate_core::DEFAULT_TENANT.into(),
            block_size: 16,
            worker_id: 1,
            dp_rank: 0,
            prefill_tokens: 100,
            decode_blocks: 10,
        },
    )
}

const PEER_FULL: &str =
    "kvgate_sidecar_bookings_refused_total{reason=\"ledger_full\",source=\"peer\"}";

#[tokio::test(flavor = "multi_thread")]
async fn a_peers_flood_is_refused_at_its_cap_and_another_peer_still_books() {
    let ctx = zmq::Context::new();
    let (hostile, hostile_at) = publisher(&ctx);
    let (honest, honest_at) = publisher(&ctx);
    let toml = format!(
        "[server]\npublish_interval_ms = 10\n\
         [replica_sync]\nlisten = \"127.0.0.1:0\"\npeers = [\"{hostile_at}\", \"{honest_at}\"]\n\
         [load.caps]\nholders_per_origin = 50\n\
         [[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:9\"\n"
    );
    let (_base, sc) = sidecar_from(&toml, None).await;
    // Batches of new admissions from one process id until well past its
    // cap. PUB drops what it sends before the subscription reaches it, so
    // the flood goes on until the refusals show.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut seq, mut message_no) = (0, 0);
    while metric(&sc, PEER_FULL) < 500.0 {
        assert!(Instant::now() < deadline, "the flood never arrived");
        let events: Vec<SyncEvent> = (seq..seq + 200).map(admit).collect();
        seq += 200;
        message_no += 1;
        let stamp = Stamp::now(42, message_no);
        hostile
            .send(wire::encode(&stamp, &events, None), 0)
            .unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(sc.active_bookings(), 50, "the flooding peer's cap");
    // Another peer's admissions are still booked.
    let honest_events: Vec<SyncEvent> = (0..5).map(admit).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut message_no = 0;
    while sc.active_bookings() < 55 {
        assert!(
            Instant::now() < deadline,
            "the honest peer was starved: {} held",
            sc.active_bookings()
        );
        // The same admissions again, in a new message (a replayed one
        // would be refused), replace themselves.
        message_no += 1;
        let message = wire::encode(&Stamp::now(43, message_no), &honest_events, None);
        honest.send(&message, 0).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_until("the census shows both peers' holders", async || {
        metric(&sc, "kvgate_sidecar_ledger_holders{kind=\"peer\"}") == 55.0
    })
    .await;
}

async fn one_worker_up() -> (String, String, std::sync::Arc<kvgate_sidecar::Sidecar>) {
    let (w, _) = fake_worker().await;
    let toml = format!(
        "[scrape]\ninterval_ms = 50\ntimeout_ms = 200\n[server]\npublish_interval_ms = 10\n\
         [load.caps]\nholders = 22\nholders_per_origin = 20\n\
         [[models]]\nname = \"m\"\n\
         [[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"{w}\"\n"
    );
    let (base, sc) = sidecar_from(&toml, None).await;
    let api = selection_api(&sc).await;
    wait_until("the worker up", async || workers_up(&base).await == 1).await;
    wait_until("the selection API sees the worker", async || {
        let body = json!({"model_name": "m", "isl_tokens": 16, "sequence_hashes": [1]});
        json_of("POST", &format!("{api}/select"), Some(body))
            .await
            .0
            == 200
    })
    .await;
    (base, api, sc)
}

async fn gateway_books(base: &str, sc: &kvgate_sidecar::Sidecar, seq: u64) {
    let slot = sc.store().snapshot().models[0].workers[0].ranks[0].slot;
    let mut batch = Vec::new();
    Event::Book {
        key: Key { vm: 5, seq },
        model: "m".into(),
        slot,
        prefill_tokens: 16,
        decode_blocks: 1,
        tenant: kvgate_core::DEFAULT_TENANT.into(),
    }
    .encode_into(&mut batch);
    let url = format!("{base}/v1/bookings");
    assert_eq!(call_raw("POST", &url, &[], batch).await.0, 204);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_selection_api_past_its_share_is_answered_429_and_gateways_still_book() {
    let (base, api, sc) = one_worker_up().await;
    let reserve = |id: &str| json!({"model_name": "m", "worker_id": 1, "isl_tokens": 16, "reservation_id": id});
    let mut answers = Vec::new();
    for i in 0..25 {
        let (status, v) = json_of(
            "POST",
            &format!("{api}/reservations"),
            Some(reserve(&format!("r{i}"))),
        )
        .await;
        answers.push(status);
        if status == 429 {
            let m = v["error"].as_str().unwrap_or("");
            assert!(m.contains("load.caps.holders_per_origin"), "{v}");
        }
    }
    assert_eq!(answers.iter().filter(|s| **s == 200).count(), 20);
    assert_eq!(answers.iter().filter(|s| **s == 429).count(), 5);
    let body = json!({"model_name": "m", "isl_tokens": 16, "sequence_hashes": [1],
                      "reservation_id": "sr"});
    let (status, v) = json_of("POST", &format!("{api}/select_and_reserve"), Some(body)).await;
    assert_eq!(status, 429, "{v}");
    assert_eq!(
        metric(
            &sc,
            "kvgate_sidecar_bookings_refused_total{reason=\"ledger_full\",source=\"api\"}"
        ),
        6.0
    );
    // The gateways keep their room: two more fill the ledger's 22.
    gateway_books(&base, &sc, 1).await;
    gateway_books(&base, &sc, 2).await;
    assert_eq!(sc.active_bookings(), 22);
    gateway_books(&base, &sc, 3).await;
    assert_eq!(sc.active_bookings(), 22);
    assert_eq!(
        metric(
            &sc,
            "kvgate_sidecar_bookings_refused_total{reason=\"ledger_full\",source=\"gateway\"}"
        ),
        1.0
    );
    // A freed reservation is room for the gateways' next booking; the
    // ledger is then full as a whole, which is not the client's doing.
    let (status, _, _) = call("DELETE", &format!("{api}/reservations/r0"), None).await;
    assert_eq!(status, 204);
    gateway_books(&base, &sc, 4).await;
    let (status, v) = json_of(
        "POST",
        &format!("{api}/reservations"),
        Some(reserve("late")),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or("")
            .contains("load.caps.holders"),
        "{v}"
    );
}
