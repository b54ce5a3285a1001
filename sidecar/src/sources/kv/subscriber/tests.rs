use super::*;
use std::sync::mpsc::{Receiver, Sender, channel, sync_channel};
use std::time::Instant;

enum Cmd {
    /// Publish the next batch (live too unless `drop`).
    Publish { payload: Vec<u8>, drop: bool },
    /// A new process: sequence and buffer start over.
    Restart,
    /// Send a raw multipart message on the PUB socket.
    Raw(Vec<Vec<u8>>),
}

/// A stand-in engine publisher speaking the engines' protocol: PUB with
/// 3-frame messages and a ROUTER replay buffer.
struct FakeEngine {
    tx: Sender<Cmd>,
    thread: Option<JoinHandle<()>>,
}

impl FakeEngine {
    fn start(ctx: &zmq::Context, name: &str, buffer: usize, topic_shape: bool) -> FakeEngine {
        let pub_sock = ctx.socket(zmq::PUB).unwrap();
        pub_sock.bind(&format!("inproc://{name}")).unwrap();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind(&format!("inproc://{name}-replay")).unwrap();
        router.set_rcvtimeo(5).unwrap();
        let (tx, rx): (Sender<Cmd>, Receiver<Cmd>) = channel();
        let thread = std::thread::spawn(move || {
            let mut seq = 0u64;
            let mut buf: Vec<(u64, Vec<u8>)> = Vec::new();
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Publish { payload, drop }) => {
                        if !drop {
                            pub_sock
                                .send_multipart([&b"kv"[..], &seq.to_be_bytes(), &payload], 0)
                                .unwrap();
                        }
                        buf.push((seq, payload));
                        if buf.len() > buffer {
                            buf.remove(0);
                        }
                        seq += 1;
                    }
                    Ok(Cmd::Restart) => {
                        seq = 0;
                        buf.clear();
                    }
                    Ok(Cmd::Raw(frames)) => pub_sock.send_multipart(frames, 0).unwrap(),
                    Err(std::sync::mpsc::TryRecvError::Empty) => {}
                    Err(_) => return,
                }
                if let Ok(req) = router.recv_multipart(0) {
                    let [id, empty, start] = req.as_slice() else {
                        continue;
                    };
                    assert!(empty.is_empty());
                    let start = u64::from_be_bytes(start.as_slice().try_into().unwrap());
                    for (s, p) in buf.iter().filter(|(s, _)| *s >= start) {
                        let sb = s.to_be_bytes();
                        if topic_shape {
                            router
                                .send_multipart([&id[..], b"", b"kv", &sb, p], 0)
                                .unwrap();
                        } else {
                            router.send_multipart([&id[..], b"", &sb, p], 0).unwrap();
                        }
                    }
                    let end = [0xFFu8; 8];
                    if topic_shape {
                        router
                            .send_multipart([&id[..], b"", b"", &end, b""], 0)
                            .unwrap();
                    } else {
                        router.send_multipart([&id[..], b"", &end, b""], 0).unwrap();
                    }
                }
            }
        });
        FakeEngine {
            tx,
            thread: Some(thread),
        }
    }

    fn publish(&self, tag: u8, drop: bool) {
        self.tx
            .send(Cmd::Publish {
                payload: vec![tag],
                drop,
            })
            .unwrap();
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        let (tx, _) = channel();
        self.tx = tx; // closes the command channel
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Counters of their own for each test's subscriber.
fn counters() -> SubscriberCounters {
    crate::metrics::Metrics::new()
        .unwrap()
        .kv
        .subscribers
        .of(7, 0)
}

fn spec(name: &str, replay: bool) -> SubscriberSpec {
    SubscriberSpec {
        slot: 3,
        endpoint: format!("inproc://{name}"),
        replay_endpoint: replay.then(|| format!("inproc://{name}-replay")),
        topic: Vec::new(),
        replay_timeout: Duration::from_secs(2),
        max_replay_bytes: 256 << 20,
        limits: SocketLimits::default(),
    }
}

/// Collects ingest messages until `n` batches arrived, as
/// (seq, payload tag) or ("resync", reason).
fn collect(rx: &Receiver<Ingest>, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut out = Vec::new();
    let mut batches = 0;
    while batches < n && Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(Ingest::Batch { slot, seq, payload }) => {
                assert_eq!(slot, 3);
                out.push(format!("{seq}:{}", payload[0]));
                batches += 1;
            }
            Ok(Ingest::Resync { reason, .. }) => out.push(format!("resync:{}", reason.as_str())),
            Err(_) => {}
        }
    }
    out
}

fn settle() {
    // Lets the SUB connection and subscription reach the PUB socket.
    std::thread::sleep(Duration::from_millis(150));
}

#[test]
fn initial_replay_then_live_in_order() {
    let ctx = zmq::Context::new();
    let eng = FakeEngine::start(&ctx, "e1", 100, false);
    eng.publish(10, false);
    eng.publish(11, false);
    let (tx, rx) = sync_channel(64);
    let sub = Subscriber::spawn(ctx.clone(), spec("e1", true), tx, counters()).unwrap();
    settle();
    eng.publish(12, false);
    eng.publish(13, false);
    assert_eq!(collect(&rx, 4), ["0:10", "1:11", "2:12", "3:13"]);
    assert_eq!(sub.counters.resyncs.get(), 0);
}

#[test]
fn a_gap_is_filled_by_replay_in_both_reply_shapes() {
    for (name, topic_shape) in [("e2", false), ("e3", true)] {
        let ctx = zmq::Context::new();
        let eng = FakeEngine::start(&ctx, name, 100, topic_shape);
        let (tx, rx) = sync_channel(64);
        let sub = Subscriber::spawn(ctx.clone(), spec(name, true), tx, counters()).unwrap();
        settle();
        eng.publish(1, false);
        eng.publish(2, true); // lost on the live socket, kept for replay
        eng.publish(3, true);
        eng.publish(4, false);
        assert_eq!(
            collect(&rx, 4),
            ["0:1", "1:2", "2:3", "3:4"],
            "topic shape {topic_shape}"
        );
        assert_eq!(sub.counters.gaps.get(), 1);
        assert_eq!(sub.counters.resyncs.get(), 0);
    }
}

#[test]
fn a_gap_beyond_the_replay_buffer_resyncs() {
    let ctx = zmq::Context::new();
    let eng = FakeEngine::start(&ctx, "e4", 2, false);
    let (tx, rx) = sync_channel(64);
    let _sub = Subscriber::spawn(ctx.clone(), spec("e4", true), tx, counters()).unwrap();
    settle();
    eng.publish(1, false);
    for t in 2..6 {
        eng.publish(t, true);
    }
    eng.publish(6, false);
    let got = collect(&rx, 3);
    assert_eq!(got[..2], ["0:1", "resync:gap_not_replayable"]);
    assert_eq!(got.last().map(String::as_str), Some("5:6"));
}

#[test]
fn a_gap_without_replay_resyncs() {
    let ctx = zmq::Context::new();
    let eng = FakeEngine::start(&ctx, "e5", 10, false);
    let (tx, rx) = sync_channel(64);
    let _sub = Subscriber::spawn(ctx.clone(), spec("e5", false), tx, counters()).unwrap();
    settle();
    eng.publish(1, false);
    eng.publish(2, true);
    eng.publish(3, false);
    assert_eq!(collect(&rx, 2), ["0:1", "resync:gap_no_replay", "2:3"]);
}

#[test]
fn a_restart_resyncs_and_recovers_from_zero() {
    let ctx = zmq::Context::new();
    let eng = FakeEngine::start(&ctx, "e6", 10, true);
    let (tx, rx) = sync_channel(64);
    let sub = Subscriber::spawn(ctx.clone(), spec("e6", true), tx, counters()).unwrap();
    settle();
    eng.publish(1, false);
    eng.publish(2, false);
    eng.tx.send(Cmd::Restart).unwrap();
    eng.publish(7, true); // the new process's first batch, missed live
    eng.publish(8, false);
    assert_eq!(
        collect(&rx, 4),
        ["0:1", "1:2", "resync:restart", "0:7", "1:8"]
    );
    assert_eq!(sub.counters.restarts.get(), 1);
}

#[test]
fn malformed_messages_are_counted_and_skipped() {
    let ctx = zmq::Context::new();
    let eng = FakeEngine::start(&ctx, "e7", 10, false);
    let (tx, rx) = sync_channel(64);
    let sub = Subscriber::spawn(ctx.clone(), spec("e7", true), tx, counters()).unwrap();
    settle();
    eng.tx
        .send(Cmd::Raw(vec![b"kv".to_vec(), vec![1, 2, 3]]))
        .unwrap();
    eng.tx
        .send(Cmd::Raw(vec![b"kv".to_vec(), vec![0; 4], vec![1]]))
        .unwrap();
    eng.publish(1, false);
    assert_eq!(collect(&rx, 1), ["0:1"]);
    assert_eq!(sub.counters.malformed_frames.get(), 2);
}

/// A publisher on loopback TCP whose replay ROUTER answers each request as
/// the test tells it, in vLLM's reply shape (`[id, "", topic, seq,
/// payload]`, then the end marker): a hostile or broken one as well as an
/// honest one. Its XPUB socket tells when the subscription is in, so live
/// batches are not dropped before it.
struct Scripted {
    xpub: zmq::Socket,
    endpoint: String,
    replay_endpoint: String,
    requests: Receiver<u64>,
    answers: Sender<Vec<(u64, Vec<u8>)>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Scripted {
    fn start(ctx: &zmq::Context) -> Scripted {
        let bind = |kind| {
            let s = ctx.socket(kind).unwrap();
            s.set_linger(0).unwrap();
            s.bind("tcp://127.0.0.1:*").unwrap();
            let endpoint = s.get_last_endpoint().unwrap().unwrap();
            (s, endpoint)
        };
        let (xpub, endpoint) = bind(zmq::XPUB);
        xpub.set_rcvtimeo(5000).unwrap();
        let (router, replay_endpoint) = bind(zmq::ROUTER);
        router.set_rcvtimeo(20).unwrap();
        let (req_tx, requests) = channel();
        let (answers, ans_rx) = channel::<Vec<(u64, Vec<u8>)>>();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok(req) = router.recv_multipart(0) else {
                    continue;
                };
                let [id, _, start] = req.as_slice() else {
                    continue;
                };
                let start = u64::from_be_bytes(start.as_slice().try_into().unwrap());
                if req_tx.send(start).is_err() {
                    return;
                }
                let Ok(answer) = ans_rx.recv_timeout(Duration::from_secs(10)) else {
                    return;
                };
                // A subscriber that stopped reading is gone from the
                // ROUTER, which then drops the rest.
                for (seq, payload) in answer {
                    let _ = router
                        .send_multipart([&id[..], b"", b"kv", &seq.to_be_bytes(), &payload], 0);
                }
                let _ = router.send_multipart([&id[..], b"", b"kv", &[0xFF; 8], b""], 0);
            }
        });
        Scripted {
            xpub,
            endpoint,
            replay_endpoint,
            requests,
            answers,
            stop,
            thread: Some(thread),
        }
    }

    fn spec(&self, limits: SocketLimits, max_replay_bytes: u64) -> SubscriberSpec {
        SubscriberSpec {
            slot: 3,
            endpoint: self.endpoint.clone(),
            replay_endpoint: Some(self.replay_endpoint.clone()),
            topic: Vec::new(),
            replay_timeout: Duration::from_secs(2),
            max_replay_bytes,
            limits,
        }
    }

    /// Waits for the next replay request, which must ask from `start`,
    /// and answers it with `replies`.
    fn answer(&self, start: u64, replies: Vec<(u64, Vec<u8>)>) {
        let asked = self
            .requests
            .recv_timeout(Duration::from_secs(5))
            .expect("a replay request");
        assert_eq!(asked, start, "the replay's start");
        self.answers.send(replies).unwrap();
    }

    fn wait_subscribed(&self) {
        let msg = self.xpub.recv_bytes(0).expect("the subscription");
        assert_eq!(msg.first(), Some(&1), "a subscribe message");
    }

    fn publish(&self, seq: u64, payload: &[u8]) {
        self.xpub
            .send_multipart([&b"kv"[..], &seq.to_be_bytes(), payload], 0)
            .unwrap();
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The first `n` ingest messages, or those before a deadline passed.
fn receive(rx: &Receiver<Ingest>, n: usize) -> Vec<Ingest> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        if let Ok(m) = rx.recv_timeout(Duration::from_millis(50)) {
            out.push(m);
        }
    }
    out
}

/// `seq:len` of each batch, `resync:reason` of each resync.
fn sizes(msgs: &[Ingest]) -> Vec<String> {
    msgs.iter()
        .map(|m| match m {
            Ingest::Batch { seq, payload, .. } => format!("{seq}:{}", payload.len()),
            Ingest::Resync { reason, .. } => format!("resync:{}", reason.as_str()),
        })
        .collect()
}

fn payload_bytes(msgs: &[Ingest]) -> usize {
    msgs.iter()
        .map(|m| match m {
            Ingest::Batch { payload, .. } => payload.len(),
            Ingest::Resync { .. } => 0,
        })
        .sum()
}

#[test]
fn a_replay_that_repeats_its_sequences_is_refused_and_the_gap_resyncs() {
    let ctx = zmq::Context::new();
    let eng = Scripted::start(&ctx);
    let (tx, rx) = sync_channel(64);
    let spec = eng.spec(SocketLimits::default(), 256 << 20);
    let sub = Subscriber::spawn(ctx.clone(), spec, tx, counters()).unwrap();
    eng.answer(0, vec![(0, vec![10])]);
    eng.wait_subscribed();

    // 1..5 are lost live; the replay sends them over and over, in range
    // every time, as the hostile worker did.
    eng.publish(5, &[15]);
    let repeating = (0..1000)
        .flat_map(|_| [(1, vec![11]), (2, vec![12])])
        .collect();
    eng.answer(1, repeating);
    assert_eq!(
        collect(&rx, 4),
        ["0:10", "1:11", "2:12", "resync:gap_not_replayable", "5:15"],
        "what came before the repeat is applied, then dropped with the slot"
    );
    assert_eq!(sub.counters.replays_refused.get(), 1);
    assert_eq!(sub.counters.replay_failures.get(), 0);

    // The next gap, answered as an engine does, is filled as before.
    eng.publish(8, &[18]);
    eng.answer(6, vec![(6, vec![16]), (7, vec![17]), (8, vec![18])]);
    assert_eq!(collect(&rx, 3), ["6:16", "7:17", "8:18"]);
    assert_eq!(sub.counters.resyncs.get(), 1);
    assert_eq!(sub.counters.replays_refused.get(), 1);
    assert_eq!(sub.counters.replayed_batches.get(), 5);
}

#[test]
fn a_replay_past_its_byte_bound_is_refused_before_the_batch_that_passes_it() {
    const FRAME: usize = 64 << 10;
    const CAP: usize = 4 * FRAME;
    let ctx = zmq::Context::new();
    let eng = Scripted::start(&ctx);
    let (tx, rx) = sync_channel(64);
    let limits = SocketLimits {
        max_message_bytes: FRAME as u64,
        ..SocketLimits::default()
    };
    let sub = Subscriber::spawn(ctx.clone(), eng.spec(limits, CAP as u64), tx, counters()).unwrap();

    // At connect, far more than kv.max_replay_bytes, in order and in range.
    eng.answer(0, (0..200).map(|s| (s, vec![s as u8; FRAME])).collect());
    let got = receive(&rx, 5);
    assert!(payload_bytes(&got) <= CAP);
    assert_eq!(
        sizes(&got),
        [
            "0:65536",
            "1:65536",
            "2:65536",
            "3:65536",
            "resync:replay_incomplete"
        ]
    );
    assert_eq!(sub.counters.replays_refused.get(), 1);

    // The slot starts over from the live batches.
    eng.wait_subscribed();
    eng.publish(300, &[1]);
    assert_eq!(collect(&rx, 1), ["300:1"]);

    // A gap of two may take two frames: batches below its range count too.
    eng.publish(303, &[4]);
    eng.answer(301, (0..10).map(|s| (s, vec![0; FRAME])).collect());
    let got = receive(&rx, 2);
    assert_eq!(sizes(&got), ["resync:gap_not_replayable", "303:1"]);
    assert_eq!(sub.counters.replays_refused.get(), 2);

    // An honest replay of the next gap still fills it.
    eng.publish(306, &[7]);
    eng.answer(304, vec![(304, vec![5]), (305, vec![6]), (306, vec![7])]);
    assert_eq!(collect(&rx, 3), ["304:5", "305:6", "306:7"]);
    assert_eq!(sub.counters.resyncs.get(), 2);
    assert_eq!(sub.counters.replays_refused.get(), 2);
    assert_eq!(sub.counters.replay_failures.get(), 0);
}
