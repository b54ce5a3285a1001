//! Retry admission: an honest `Retry-After` under sustained overload.
//!
//! A retry made at an arbitrary time competes with new requests for the
//! slots that free up, so under overload it is shed about as often as a
//! first attempt, whatever `Retry-After` said. So a request shed because
//! every worker of its model was busy takes a place in a queue of retries,
//! spaced by the rate at which the model completes requests: its
//! `Retry-After` is when its place comes. It is remembered by a ticket, the
//! hash of its tenant and body (clients retry with the same body), and a
//! retry that arrives within its ticket's window is admitted ahead of new
//! work: it may use a rank up to a headroom over the busy thresholds,
//! while new requests still stop at the thresholds. Retries then come back
//! at about the rate the fleet frees up, and find room.
//!
//! The queue's head and the tickets live in Envoy's shared data, so every
//! worker thread's VM sees them; this module is their pure logic and
//! formats, the filter does the host calls.

use crate::wire::Reader;

/// The share of the model's completions that retries are paced to: the
/// rest is left to new work, which still takes a rank whenever it drops
/// under the thresholds, so retries paced at the full rate would find the
/// headroom taken.
pub const RETRY_SHARE: f64 = 0.75;

/// Tickets per shared-data bucket; older ones make room for new.
pub const BUCKET_TICKETS: usize = 64;
/// Ticket buckets: a shed request and its retry touch one of them.
pub const BUCKETS: u64 = 32;

/// A retry's place: its body hash and when its slot comes (unix ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub hash: u64,
    pub due_ms: u64,
}

/// How early and how late after its slot a retry still holds its ticket:
/// clients add jitter and round `Retry-After` to whole seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub early_ms: u64,
    pub late_ms: u64,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            early_ms: 100,
            late_ms: 10_000,
        }
    }
}

/// The shared-data key of `model`'s queue head.
pub fn queue_key(model: &str) -> String {
    format!("kvgate.retry.queue.{model}")
}

/// The shared-data key of the bucket holding `hash`'s ticket.
pub fn bucket_key(hash: u64) -> String {
    format!("kvgate.retry.tickets.{}", hash % BUCKETS)
}

/// The ticket's name for a request: tenant and body, so a retry finds it
/// and another tenant's identical body does not.
pub fn ticket_hash(tenant: &str, body: &[u8]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(tenant.as_bytes());
    h.update(&[0]);
    h.update(body);
    h.digest()
}

/// Where a shed request's retry goes in the queue whose next free slot is
/// `next_ms`: at least `min_wait_ms` from now and after every place taken,
/// at most `max_wait_ms` away. Returns its slot and the queue's new next
/// slot, one retry interval later (`1000 / (rate_per_s × RETRY_SHARE)` ms). With no
/// known rate, the slot is `min_wait_ms` away and the queue does not move.
pub fn take_place(
    next_ms: u64,
    now_ms: u64,
    min_wait_ms: u64,
    max_wait_ms: u64,
    rate_per_s: f64,
) -> (u64, u64) {
    let earliest = now_ms.saturating_add(min_wait_ms);
    if !(rate_per_s.is_finite() && rate_per_s > 0.0) {
        return (earliest, next_ms);
    }
    let slot = next_ms
        .max(earliest)
        .min(now_ms.saturating_add(max_wait_ms.max(min_wait_ms)));
    let interval = (1000.0 / (rate_per_s * RETRY_SHARE)).clamp(1.0, 60_000.0) as u64;
    (slot, slot.saturating_add(interval))
}

/// `Retry-After` in whole seconds for a slot: at least 1.
pub fn retry_after_s(slot_ms: u64, now_ms: u64) -> u32 {
    u32::try_from(slot_ms.saturating_sub(now_ms).div_ceil(1000))
        .unwrap_or(u32::MAX)
        .max(1)
}

pub fn encode_queue(next_ms: u64) -> Vec<u8> {
    next_ms.to_le_bytes().to_vec()
}

/// The queue head; 0 (no place taken) for anything that is not one.
pub fn decode_queue(bytes: &[u8]) -> u64 {
    Reader::new(bytes).u64().unwrap_or(0)
}

pub fn encode_bucket(tickets: &[Ticket]) -> Vec<u8> {
    let mut out = Vec::with_capacity(tickets.len() * 16);
    for t in tickets {
        out.extend_from_slice(&t.hash.to_le_bytes());
        out.extend_from_slice(&t.due_ms.to_le_bytes());
    }
    out
}

/// A bucket's tickets; a torn or foreign value reads as the tickets it
/// holds whole (at most [`BUCKET_TICKETS`]).
pub fn decode_bucket(bytes: &[u8]) -> Vec<Ticket> {
    let mut r = Reader::new(bytes);
    let mut out = Vec::new();
    while out.len() < BUCKET_TICKETS {
        let (Ok(hash), Ok(due_ms)) = (r.u64(), r.u64()) else {
            break;
        };
        out.push(Ticket { hash, due_ms });
    }
    out
}

/// `bucket` with `t` in it: expired tickets go, a ticket of the same hash
/// is replaced, and when full the ticket due first makes room.
pub fn with_ticket(mut bucket: Vec<Ticket>, t: Ticket, now_ms: u64, w: Window) -> Vec<Ticket> {
    bucket.retain(|x| x.hash != t.hash && x.due_ms.saturating_add(w.late_ms) >= now_ms);
    if bucket.len() >= BUCKET_TICKETS {
        bucket.sort_by_key(|x| x.due_ms);
        bucket.drain(..=bucket.len() - BUCKET_TICKETS);
    }
    bucket.push(t);
    bucket
}

/// If `bucket` holds a ticket for `hash` whose window includes now, the
/// bucket without it.
pub fn redeem(bucket: &[Ticket], hash: u64, now_ms: u64, w: Window) -> Option<Vec<Ticket>> {
    let at = bucket.iter().position(|x| {
        x.hash == hash
            && now_ms.saturating_add(w.early_ms) >= x.due_ms
            && now_ms <= x.due_ms.saturating_add(w.late_ms)
    })?;
    let mut rest = bucket.to_vec();
    rest.remove(at);
    Some(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn places_are_spaced_by_the_service_rate_and_capped() {
        // 20 completions a second, 15 of them for retries: a place every
        // 66 ms, at least 1 s away.
        let (slot, next) = take_place(0, 10_000, 1_000, 30_000, 20.0);
        assert_eq!((slot, next), (11_000, 11_066));
        let (slot, next) = take_place(next, 10_010, 1_000, 30_000, 20.0);
        assert_eq!((slot, next), (11_066, 11_132));
        assert_eq!(retry_after_s(slot, 10_010), 2);
        // A queue far ahead is capped at the longest wait.
        let (slot, _) = take_place(100_000, 10_000, 1_000, 30_000, 20.0);
        assert_eq!(slot, 40_000);
        // No rate known: the minimum wait, and the queue stays.
        assert_eq!(take_place(500, 10_000, 1_000, 30_000, 0.0), (11_000, 500));
        assert_eq!(
            take_place(500, 10_000, 1_000, 30_000, f64::NAN),
            (11_000, 500)
        );
        assert_eq!(retry_after_s(10_000, 10_000), 1);
    }

    #[test]
    fn a_ticket_is_redeemed_once_within_its_window() {
        let w = Window::default();
        let t = Ticket {
            hash: ticket_hash("team-a", b"{\"model\":\"m\"}"),
            due_ms: 20_000,
        };
        let bucket = with_ticket(Vec::new(), t, 10_000, w);
        assert_eq!(redeem(&bucket, t.hash, 19_800, w), None, "too early");
        assert_eq!(redeem(&bucket, t.hash, 31_000, w), None, "too late");
        let rest = redeem(&bucket, t.hash, 19_950, w).unwrap();
        assert!(rest.is_empty());
        assert_eq!(redeem(&rest, t.hash, 19_950, w), None, "used up");
        let other = ticket_hash("team-b", b"{\"model\":\"m\"}");
        assert_eq!(redeem(&bucket, other, 20_000, w), None, "another tenant's");
    }

    #[test]
    fn buckets_stay_bounded_and_drop_expired_tickets() {
        let w = Window::default();
        let mut b = Vec::new();
        for i in 0..200u64 {
            b = with_ticket(
                b,
                Ticket {
                    hash: i,
                    due_ms: 1_000 + i,
                },
                0,
                w,
            );
        }
        assert_eq!(b.len(), BUCKET_TICKETS);
        assert!(b.iter().all(|t| t.hash >= 200 - BUCKET_TICKETS as u64));
        assert_eq!(decode_bucket(&encode_bucket(&b)), b);
        // Expired ones go when the next is added.
        let b = with_ticket(
            b,
            Ticket {
                hash: 999,
                due_ms: 50_000,
            },
            40_000,
            w,
        );
        assert_eq!(b.len(), 1);
        assert_eq!(decode_queue(&encode_queue(77)), 77);
        assert_eq!(decode_queue(b"xx"), 0);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_to_a_bounded_bucket(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            prop_assert!(decode_bucket(&bytes).len() <= BUCKET_TICKETS);
            let _ = decode_queue(&bytes);
        }
    }
}
