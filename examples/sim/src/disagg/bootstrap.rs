//! SGLang-style PD pairing. The router sends the same body, carrying a
//! `bootstrap_room`, to a prefill and a decode worker at once. The decode
//! worker connects to the prefill worker's bootstrap listener and joins
//! the room; the prefill request waits for that join before it prefills
//! (so waiting for the prefill's answer before sending the decode leg
//! deadlocks, as it does with SGLang), then hands the blocks' identities
//! over the decoder's connection. Either side gives up after the engine's
//! bootstrap timeout.

use super::Counters;
use super::frame::{self, BlockIdentity, Message};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

/// What the prefill hands the decoder: the blocks, or why there are none.
pub type Handoff = Result<Vec<BlockIdentity>, String>;

/// How long a decoder may take to send its join frame.
const JOIN_WITHIN: Duration = Duration::from_secs(10);
/// Decoders waiting at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 1024;

/// A room both sides have not yet fully claimed.
struct Room {
    /// Tells a seat's drop whether the entry it finds is still its own.
    generation: u64,
    to_decoder: Option<oneshot::Sender<Handoff>>,
    from_prefill: Option<oneshot::Receiver<Handoff>>,
    joined: watch::Sender<bool>,
}

#[derive(Default)]
pub struct Rooms {
    map: Mutex<HashMap<u64, Room>>,
    generations: AtomicU64,
}

impl Rooms {
    fn map(&self) -> MutexGuard<'_, HashMap<u64, Room>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn entry<'a>(&self, map: &'a mut HashMap<u64, Room>, room: u64) -> &'a mut Room {
        map.entry(room).or_insert_with(|| {
            let (tx, rx) = oneshot::channel();
            Room {
                generation: self.generations.fetch_add(1, Ordering::Relaxed),
                to_decoder: Some(tx),
                from_prefill: Some(rx),
                joined: watch::channel(false).0,
            }
        })
    }

    /// Rooms open now (tests check that none leak).
    pub fn open(&self) -> usize {
        self.map().len()
    }

    /// The prefill side's place in `room`.
    pub fn claim_prefill(self: &Arc<Self>, room: u64) -> Result<PrefillSeat, String> {
        let mut map = self.map();
        let entry = self.entry(&mut map, room);
        let tx = entry
            .to_decoder
            .take()
            .ok_or_else(|| format!("bootstrap_room {room} already has a prefill request"))?;
        let seat = PrefillSeat {
            rooms: self.clone(),
            room,
            generation: entry.generation,
            joined: entry.joined.subscribe(),
            tx: Some(tx),
        };
        if entry.from_prefill.is_none() {
            map.remove(&room);
        }
        Ok(seat)
    }

    fn claim_decoder(self: &Arc<Self>, room: u64) -> Result<DecoderSeat, String> {
        let mut map = self.map();
        let entry = self.entry(&mut map, room);
        let rx = entry
            .from_prefill
            .take()
            .ok_or_else(|| format!("bootstrap_room {room} already has a decode worker"))?;
        entry.joined.send_replace(true);
        let seat = DecoderSeat {
            rooms: self.clone(),
            room,
            generation: entry.generation,
            rx: Some(rx),
        };
        if entry.to_decoder.is_none() {
            map.remove(&room);
        }
        Ok(seat)
    }

    /// Drops `room` if it is still `generation`'s and the other side never
    /// came: a side that gives up leaves nothing behind.
    fn abandon(&self, room: u64, generation: u64) {
        let mut map = self.map();
        if map.get(&room).is_some_and(|r| r.generation == generation) {
            map.remove(&room);
        }
    }
}

/// A prefill request's claim on its room.
pub struct PrefillSeat {
    rooms: Arc<Rooms>,
    room: u64,
    generation: u64,
    joined: watch::Receiver<bool>,
    tx: Option<oneshot::Sender<Handoff>>,
}

impl PrefillSeat {
    /// Waits until the decode worker has joined the room.
    pub async fn wait_for_decoder(&mut self, timeout: Duration) -> Result<(), String> {
        let room = self.room;
        match tokio::time::timeout(timeout, self.joined.wait_for(|j| *j)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) | Err(_) => Err(format!(
                "bootstrap timeout: no decode worker joined room {room} within {timeout:?}"
            )),
        }
    }

    pub fn hand_off(mut self, handoff: Handoff) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(handoff);
        }
    }
}

impl Drop for PrefillSeat {
    fn drop(&mut self) {
        self.rooms.abandon(self.room, self.generation);
    }
}

struct DecoderSeat {
    rooms: Arc<Rooms>,
    room: u64,
    generation: u64,
    rx: Option<oneshot::Receiver<Handoff>>,
}

impl DecoderSeat {
    async fn wait(&mut self, timeout: Duration) -> Handoff {
        let room = self.room;
        let Some(rx) = self.rx.as_mut() else {
            return Err("already answered".into());
        };
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(h)) => h,
            Ok(Err(_)) => Err(format!(
                "the prefill request of room {room} ended without blocks"
            )),
            Err(_) => Err(format!(
                "waiting timeout: no prefill request for room {room} within {timeout:?}"
            )),
        }
    }
}

impl Drop for DecoderSeat {
    fn drop(&mut self) {
        self.rooms.abandon(self.room, self.generation);
    }
}

/// Serves the bootstrap listener until it fails.
pub async fn serve(
    listener: TcpListener,
    rooms: Arc<Rooms>,
    timeout: Duration,
    counters: Arc<Counters>,
) {
    super::listen::serve_bounded(listener, MAX_CONNECTIONS, "bootstrap", move |stream| {
        let (rooms, counters) = (rooms.clone(), counters.clone());
        async move { decoder(stream, &rooms, timeout, &counters).await }
    })
    .await;
}

async fn decoder(
    mut stream: TcpStream,
    rooms: &Arc<Rooms>,
    timeout: Duration,
    counters: &Counters,
) -> Result<(), frame::FrameError> {
    let room = match tokio::time::timeout(JOIN_WITHIN, frame::read(&mut stream)).await {
        Ok(Ok(Some(Message::Join { room }))) => room,
        Ok(Ok(Some(other))) => {
            let why = format!("a bootstrap server takes joins, not {other:?}");
            return frame::write(&mut stream, &Message::Refused(why)).await;
        }
        Ok(Ok(None)) | Err(_) => return Ok(()),
        Ok(Err(e)) => {
            let _ = frame::write(&mut stream, &Message::Refused(e.to_string())).await;
            return Err(e);
        }
    };
    let mut seat = match rooms.claim_decoder(room) {
        Ok(s) => s,
        Err(why) => return frame::write(&mut stream, &Message::Refused(why)).await,
    };
    let answer = match seat.wait(timeout).await {
        Ok(blocks) => {
            counters.bootstrap_pairs.fetch_add(1, Ordering::Relaxed);
            Message::Blocks(blocks)
        }
        Err(why) => Message::Gone(why),
    };
    frame::write(&mut stream, &answer).await
}

/// The decode side: joins `room` at `host:port` and waits for the blocks.
/// A refused connection is retried until the deadline, as a decode worker
/// retries a prefill server that is still starting.
pub async fn join(host: &str, port: u16, room: u64, timeout: Duration) -> Handoff {
    let addr = format!("{host}:{port}");
    let work = async {
        let mut s = loop {
            match TcpStream::connect(&addr).await {
                Ok(s) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(format!("bootstrap server {addr} unreachable: {e}")),
            }
        };
        let _ = s.set_nodelay(true);
        frame::write(&mut s, &Message::Join { room })
            .await
            .map_err(|e| format!("bootstrap server {addr}: {e}"))?;
        match frame::read(&mut s).await {
            Ok(Some(Message::Blocks(b))) => Ok(b),
            Ok(Some(Message::Gone(why) | Message::Refused(why))) => Err(why),
            Ok(Some(other)) => Err(format!("unexpected bootstrap answer {other:?}")),
            Ok(None) => Err(format!("bootstrap server {addr} closed without an answer")),
            Err(e) => Err(format!("bootstrap server {addr}: {e}")),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(format!("bootstrap timeout: room {room} at {addr}")))
}
