//! The NIXL-style side channel between sims: a prefill engine's ranks each
//! listen on a TCP port (the answer's `remote_port`); a decode worker
//! connects, names the engine, the request and the blocks it lacks, and
//! gets their identities back, or a "gone" when the lease has ended. The
//! KV bytes themselves are not sent: the answer waits until they would be
//! through this worker's [`Link`], which the holder owns and every pull
//! from it shares, so the decode side's wait for the answer is the
//! transfer.

use super::Counters;
use super::frame::{self, BlockIdentity, Message};
use super::lease::{Leases, TakeError};
use super::link::Link;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// A peer idle this long between frames is dropped: a stalled or hostile
/// client cannot hold a connection task forever.
const IDLE: Duration = Duration::from_secs(10);
/// Connections served at once per rank; more wait to be accepted.
const MAX_CONNECTIONS: usize = 256;

/// Serves one rank's side channel until the listener fails.
pub async fn serve(
    listener: TcpListener,
    engine_id: String,
    leases: Arc<Leases>,
    counters: Arc<Counters>,
    link: Arc<Link>,
    bytes_per_block: u64,
) {
    let engine_id: Arc<str> = engine_id.into();
    super::listen::serve_bounded(listener, MAX_CONNECTIONS, "side channel", move |stream| {
        let (engine_id, leases, counters, link) = (
            engine_id.clone(),
            leases.clone(),
            counters.clone(),
            link.clone(),
        );
        async move {
            let holder = Holder {
                engine_id: &engine_id,
                leases: &leases,
                counters: &counters,
                link: &link,
                bytes_per_block,
            };
            connection(stream, holder).await
        }
    })
    .await;
}

/// What a connection serves pulls from.
struct Holder<'a> {
    engine_id: &'a str,
    leases: &'a Leases,
    counters: &'a Counters,
    link: &'a Link,
    bytes_per_block: u64,
}

async fn connection(mut stream: TcpStream, h: Holder<'_>) -> Result<(), frame::FrameError> {
    loop {
        let msg = match tokio::time::timeout(IDLE, frame::read(&mut stream)).await {
            Ok(Ok(Some(m))) => m,
            Ok(Ok(None)) | Err(_) => return Ok(()),
            Ok(Err(e)) => {
                // Tell a confused peer why, then drop it: after a bad
                // frame the stream cannot be resynchronised.
                let _ = frame::write(&mut stream, &Message::Refused(e.to_string())).await;
                return Err(e);
            }
        };
        let answer = match msg {
            Message::Pull {
                engine_id: asked,
                request_id,
                block_ids,
            } if asked == h.engine_id => match h.leases.take(&request_id, &block_ids) {
                Ok(mut taken) => {
                    let bytes = (taken.blocks.len() as u64).saturating_mul(h.bytes_per_block);
                    h.link.carry(bytes).await;
                    h.counters.pulls_served.fetch_add(1, Ordering::Relaxed);
                    Message::Blocks(std::mem::take(&mut taken.blocks))
                }
                Err(e @ TakeError::Gone(_)) => Message::Gone(e.to_string()),
                Err(e @ TakeError::Foreign(..)) => Message::Refused(e.to_string()),
            },
            Message::Pull {
                engine_id: asked, ..
            } => Message::Refused(format!("this is engine {}, not {asked}", h.engine_id)),
            other => Message::Refused(format!("a side channel serves pulls, not {other:?}")),
        };
        frame::write(&mut stream, &answer).await?;
    }
}

/// Why a decode worker could not load a request's blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullError {
    #[error("side channel {0} unreachable: {1}")]
    Unreachable(String, String),
    #[error("the prefill engine no longer holds the blocks: {0}")]
    Gone(String),
    #[error("the prefill engine refused the pull: {0}")]
    Refused(String),
    #[error("side channel protocol error: {0}")]
    Protocol(String),
}

/// Asks `host:port` for `block_ids` of `request_id` on `engine_id`.
pub async fn pull(
    host: &str,
    port: u16,
    engine_id: &str,
    request_id: &str,
    block_ids: &[u32],
    timeout: Duration,
) -> Result<Vec<BlockIdentity>, PullError> {
    let addr = format!("{host}:{port}");
    let work = async {
        let mut s = TcpStream::connect(&addr)
            .await
            .map_err(|e| PullError::Unreachable(addr.clone(), e.to_string()))?;
        let _ = s.set_nodelay(true);
        let ask = Message::Pull {
            engine_id: engine_id.to_string(),
            request_id: request_id.to_string(),
            block_ids: block_ids.to_vec(),
        };
        frame::write(&mut s, &ask)
            .await
            .map_err(|e| PullError::Unreachable(addr.clone(), e.to_string()))?;
        match frame::read(&mut s).await {
            Ok(Some(Message::Blocks(b))) if b.len() == block_ids.len() => Ok(b),
            Ok(Some(Message::Gone(why))) => Err(PullError::Gone(why)),
            Ok(Some(Message::Refused(why))) => Err(PullError::Refused(why)),
            Ok(Some(other)) => Err(PullError::Protocol(format!("unexpected answer {other:?}"))),
            Ok(None) => Err(PullError::Protocol("closed without an answer".into())),
            Err(e) => Err(PullError::Protocol(e.to_string())),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(PullError::Unreachable(addr.clone(), "timed out".into())))
}
