//! The accept loop both side channels share: connections are served
//! concurrently, but at most a bounded number at once, so that a flood of
//! peers waits in the listen backlog instead of growing tasks and sockets.

use super::frame::FrameError;
use std::future::Future;
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Serves `listener` until it fails: `handle` runs per connection, at most
/// `max` at once. `what` names the channel in logs.
pub async fn serve_bounded<F, Fut>(listener: TcpListener, max: usize, what: &'static str, handle: F)
where
    F: Fn(TcpStream) -> Fut,
    Fut: Future<Output = Result<(), FrameError>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(max));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, channel = what, "accept failed");
                continue;
            }
        };
        let served = handle(stream);
        tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::debug!(%peer, error = %e, channel = what, "connection ended");
            }
            drop(permit);
        });
    }
}
