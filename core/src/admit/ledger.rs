//! Requests in flight per decode worker, counted by every worker thread
//! of one proxy in one shared-data value per model, so that the bound on
//! a worker's requests holds at the moment each request is sent: a thread
//! reads the value, checks the worker's count against the bound, and
//! writes it back one higher with compare-and-swap; a thread that lost
//! the swap reads again. Each thread's counts are its own entries, stamped
//! when it last said it was alive: the entries of a thread that died (a
//! trapped VM) stop counting once stale, instead of holding their slots
//! for good.

use crate::wire::Reader;

/// How long a thread's entries count after its last stamp. Threads
/// restamp theirs every second on their tick.
pub const STALE_MS: u64 = 10_000;
/// Entries a value holds at most: threads × workers of one model.
pub const MAX_ENTRIES: usize = 4096;
const ENTRY_LEN: usize = 8 + 8 + 4 + 8;

/// One thread's requests in flight on one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The thread's VM tag (as on its bookings).
    pub vm: u64,
    pub worker: u64,
    pub count: u32,
    pub seen_ms: u64,
}

/// The shared-data key of `model`'s counts.
pub fn key(model: &str) -> String {
    format!("kvgate.inflight.{model}")
}

pub fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * ENTRY_LEN);
    for e in entries {
        out.extend_from_slice(&e.vm.to_le_bytes());
        out.extend_from_slice(&e.worker.to_le_bytes());
        out.extend_from_slice(&e.count.to_le_bytes());
        out.extend_from_slice(&e.seen_ms.to_le_bytes());
    }
    out
}

/// The entries a value holds whole, at most [`MAX_ENTRIES`]; a torn or
/// foreign tail is ignored.
pub fn decode(bytes: &[u8]) -> Vec<Entry> {
    let mut r = Reader::new(bytes);
    let mut out = Vec::with_capacity((bytes.len() / ENTRY_LEN).min(MAX_ENTRIES));
    while out.len() < MAX_ENTRIES {
        let (Ok(vm), Ok(worker), Ok(count), Ok(seen_ms)) = (r.u64(), r.u64(), r.u32(), r.u64())
        else {
            break;
        };
        out.push(Entry {
            vm,
            worker,
            count,
            seen_ms,
        });
    }
    out
}

fn fresh(e: &Entry, now_ms: u64) -> bool {
    e.count > 0 && e.seen_ms.saturating_add(STALE_MS) >= now_ms
}

/// Requests in flight on `worker`, by every thread still alive.
pub fn count(entries: &[Entry], worker: u64, now_ms: u64) -> u64 {
    entries
        .iter()
        .filter(|e| e.worker == worker && fresh(e, now_ms))
        .map(|e| u64::from(e.count))
        .sum()
}

/// `entries` with one more request of `vm` on `worker`, if the worker
/// holds fewer than `bound`; else the count that stopped it. Stale and
/// empty entries go.
pub fn acquire(
    mut entries: Vec<Entry>,
    vm: u64,
    worker: u64,
    bound: u64,
    now_ms: u64,
) -> Result<Vec<Entry>, u64> {
    let held = count(&entries, worker, now_ms);
    if held >= bound {
        return Err(held);
    }
    entries.retain(|e| fresh(e, now_ms) || (e.vm == vm && e.count > 0));
    if let Some(e) = entries
        .iter_mut()
        .find(|e| e.vm == vm && e.worker == worker)
    {
        e.count = e.count.saturating_add(1);
        e.seen_ms = now_ms;
    } else if entries.len() < MAX_ENTRIES {
        entries.push(Entry {
            vm,
            worker,
            count: 1,
            seen_ms: now_ms,
        });
    } else {
        // Full of live entries: refuse rather than count nothing.
        return Err(held);
    }
    Ok(entries)
}

/// `entries` with one request of `vm` on `worker` fewer; `None` when it
/// held none there (nothing to write).
pub fn release(mut entries: Vec<Entry>, vm: u64, worker: u64, now_ms: u64) -> Option<Vec<Entry>> {
    let e = entries
        .iter_mut()
        .find(|e| e.vm == vm && e.worker == worker && e.count > 0)?;
    e.count -= 1;
    e.seen_ms = now_ms;
    entries.retain(|e| e.count > 0);
    Some(entries)
}

/// `entries` with `vm`'s restamped; `None` when it holds none.
pub fn refresh(mut entries: Vec<Entry>, vm: u64, now_ms: u64) -> Option<Vec<Entry>> {
    let mut any = false;
    for e in entries.iter_mut().filter(|e| e.vm == vm && e.count > 0) {
        e.seen_ms = now_ms;
        any = true;
    }
    any.then_some(entries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_bound_counts_every_thread_and_a_release_frees_a_slot() {
        let v = Vec::new();
        let v = acquire(v, 1, 7, 2, 1000).unwrap();
        let v = acquire(v, 2, 7, 2, 1001).unwrap();
        assert_eq!(count(&v, 7, 1002), 2);
        assert_eq!(
            acquire(v.clone(), 3, 7, 2, 1002),
            Err(2),
            "the last slot is taken"
        );
        let other = acquire(v.clone(), 3, 8, 2, 1002).unwrap();
        assert_eq!(count(&other, 8, 1002), 1, "another worker has its own");
        let v = release(v, 2, 7, 1003).unwrap();
        assert_eq!(v.len(), 1, "an empty entry goes");
        assert_eq!(
            release(v.clone(), 2, 7, 1003),
            None,
            "nothing left to release"
        );
        let v = acquire(v, 3, 7, 2, 1004).unwrap();
        assert_eq!(count(&v, 7, 1004), 2);
        assert_eq!(decode(&encode(&v)), v);
    }

    #[test]
    fn a_silent_thread_stops_counting() {
        let v = acquire(Vec::new(), 1, 7, 1, 1000).unwrap();
        assert_eq!(acquire(v.clone(), 2, 7, 1, 1000 + STALE_MS), Err(1));
        let kept = refresh(v.clone(), 1, 5000).unwrap();
        assert_eq!(acquire(kept, 2, 7, 1, 1000 + STALE_MS), Err(1), "restamped");
        let v = acquire(v, 2, 7, 1, 1001 + STALE_MS).unwrap();
        assert_eq!(v.iter().map(|e| e.vm).collect::<Vec<_>>(), vec![2]);
        assert_eq!(refresh(v, 9, 1), None);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_to_a_bounded_list(bytes in proptest::collection::vec(any::<u8>(), 0..8192)) {
            let v = decode(&bytes);
            prop_assert!(v.len() <= MAX_ENTRIES);
            prop_assert_eq!(v.len(), bytes.len() / ENTRY_LEN);
        }
    }
}
