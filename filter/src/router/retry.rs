//! Retry admission in Envoy's shared data (`kvgate_core::plan::retry`):
//! the queue head per model and the ticket buckets, rewritten with
//! compare-and-swap since every worker thread's VM sheds and admits.

use crate::config::Config;
use crate::host::Host;
use crate::reply::Reply;
use kvgate_core::Snapshot;
use kvgate_core::plan::retry::{self, Ticket, Window};

/// Takes the ticket of `hash` if one is due now; whether it was there.
/// A ticket whose bucket could not be rewritten (other VMs kept winning
/// the swap) is honoured all the same: it expires by itself.
pub(super) fn redeem(h: &impl Host, hash: u64, now_ms: u64) -> bool {
    let mut found = false;
    h.update_shared(&retry::bucket_key(hash), &mut |v| {
        let bucket = retry::decode_bucket(v.unwrap_or_default());
        let rest = retry::redeem(&bucket, hash, now_ms, Window::default());
        found = rest.is_some();
        rest.map(|r| retry::encode_bucket(&r))
    });
    found
}

/// The busy 503 for a request whose ticket is `hash`: a place in the
/// model's retry queue, no sooner than the sidecar expects a worker to
/// free up (`retry_after_s`, else the configured default).
pub(super) fn shed(
    h: &impl Host,
    c: &Config,
    snap: &Snapshot,
    model: &str,
    hash: u64,
    retry_after_s: u32,
) -> Reply {
    let min_wait = if retry_after_s > 0 {
        retry_after_s
    } else {
        c.retry_after_s
    };
    let rate = snap.model(model).map_or(0.0, |m| m.service_rate_per_s);
    Reply::busy(enqueue(
        h,
        model,
        hash,
        h.now_ms(),
        min_wait.min(c.max_retry_after_s),
        c.max_retry_after_s,
        rate,
    ))
}

/// Gives a shed request its place in `model`'s retry queue and a ticket;
/// returns the `Retry-After` seconds that place means. Without shared
/// data (the swap kept failing) the place is the minimum wait.
fn enqueue(
    h: &impl Host,
    model: &str,
    hash: u64,
    now_ms: u64,
    min_wait_s: u32,
    max_wait_s: u32,
    rate_per_s: f64,
) -> u32 {
    let (min_ms, max_ms) = (u64::from(min_wait_s) * 1000, u64::from(max_wait_s) * 1000);
    let mut slot = now_ms.saturating_add(min_ms);
    h.update_shared(&retry::queue_key(model), &mut |v| {
        let next = retry::decode_queue(v.unwrap_or_default());
        let (s, new_next) = retry::take_place(next, now_ms, min_ms, max_ms, rate_per_s);
        slot = s;
        Some(retry::encode_queue(new_next))
    });
    let ticket = Ticket { hash, due_ms: slot };
    h.update_shared(&retry::bucket_key(hash), &mut |v| {
        let bucket = retry::decode_bucket(v.unwrap_or_default());
        Some(retry::encode_bucket(&retry::with_ticket(
            bucket,
            ticket,
            now_ms,
            Window::default(),
        )))
    });
    retry::retry_after_s(slot, now_ms).min(max_wait_s.max(1))
}
