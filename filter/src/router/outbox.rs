//! What a router VM hands the snapshot service, held back and sent as one
//! queue item per flush.
//!
//! Every item enqueued on a shared queue wakes the service's VM on Envoy's
//! main thread, and each wake with nothing in flight becomes an HTTP call
//! to the sidecar. Enqueued per event (a booking, its first byte, its end),
//! a saturated gateway pays for most of a wake and a call per request;
//! held for a flush interval, a VM's events of that interval travel
//! together. Records are self-delimiting, so concatenated records are what
//! the service forwards either way.

/// One queue's pending records.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    /// Resolved on first use: the service registers the queue when it
    /// starts, possibly after this VM.
    queue: Option<u32>,
    pending: Vec<u8>,
    /// No flush interval: each record is sent as it comes.
    immediate: bool,
}

/// Sent at once past this size, whatever the interval: a queue item stays
/// well under what the service forwards in one request.
const FULL_BYTES: usize = 32 << 10;

impl Outbox {
    pub fn new(immediate: bool) -> Outbox {
        Outbox {
            immediate,
            ..Outbox::default()
        }
    }

    /// Appends a record with `write`; sends at once when the box is
    /// immediate or full. Returns false when sending failed and the
    /// records were dropped.
    pub fn push(
        &mut self,
        write: impl FnOnce(&mut Vec<u8>),
        send: impl FnMut(&mut Option<u32>, &[u8]) -> bool,
    ) -> bool {
        write(&mut self.pending);
        if self.immediate || self.pending.len() >= FULL_BYTES {
            return self.flush(send);
        }
        true
    }

    /// Sends what is pending as one item. `send` resolves the queue when it
    /// is `None` and forgets it on failure (so the next flush resolves it
    /// again); a failed send drops the records: the sidecar's expiry
    /// cleans up bookings it never hears the end of.
    pub fn flush(&mut self, mut send: impl FnMut(&mut Option<u32>, &[u8]) -> bool) -> bool {
        if self.pending.is_empty() {
            return true;
        }
        let ok = send(&mut self.queue, &self.pending);
        self.pending.clear();
        ok
    }

    #[cfg(test)]
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::booking::{Event, Key};

    fn done(seq: u64) -> Event {
        Event::Done {
            key: Key { vm: 1, seq },
            timing: None,
        }
    }

    #[test]
    fn records_wait_for_the_flush_and_travel_as_one_item() {
        let sent = std::cell::RefCell::new(Vec::<Vec<u8>>::new());
        let send = |q: &mut Option<u32>, b: &[u8]| {
            q.get_or_insert(7);
            sent.borrow_mut().push(b.to_vec());
            true
        };
        let mut o = Outbox::new(false);
        for seq in 1..=3 {
            assert!(o.push(|b| done(seq).encode_into(b), send));
        }
        assert!(sent.borrow().is_empty(), "nothing leaves before the flush");
        assert!(o.flush(send));
        assert!(o.flush(send), "an empty box sends nothing");
        let sent = sent.into_inner();
        assert_eq!(sent.len(), 1);
        assert_eq!(o.queue, Some(7));
        let events = kvgate_core::booking::decode_batch(&sent[0]).unwrap();
        assert_eq!(events, vec![done(1), done(2), done(3)]);
        assert!(o.pending().is_empty());
    }

    #[test]
    fn immediate_mode_and_a_full_box_send_at_once() {
        let items = std::cell::Cell::new(0);
        let send = |_: &mut Option<u32>, _: &[u8]| {
            items.set(items.get() + 1);
            true
        };
        let mut o = Outbox::new(true);
        o.push(|b| done(1).encode_into(b), send);
        assert_eq!(items.get(), 1);
        let mut o = Outbox::new(false);
        let mut pushed = 0;
        while items.get() == 1 {
            o.push(|b| b.extend_from_slice(&[0; 1024]), send);
            pushed += 1;
        }
        assert_eq!(pushed, FULL_BYTES / 1024);
        assert!(o.pending().is_empty());
    }

    #[test]
    fn a_failed_send_drops_the_records_and_forgets_the_queue() {
        let mut o = Outbox::new(false);
        o.push(|b| done(1).encode_into(b), |_, _| true);
        let failed = o.flush(|q, _| {
            *q = None;
            false
        });
        assert!(!failed);
        assert!(o.pending().is_empty());
        assert_eq!(o.queue, None);
    }
}
