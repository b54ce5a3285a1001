//! Sequence numbers per publisher: in order, lost batches, or a restart.
//!
//! Engines number batches from 0 per process, +1 per batch. A jump forward
//! means the subscriber missed batches (slow consumer, network); a jump back
//! means the engine process restarted and its cache is empty.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The next batch, or the first one seen.
    InOrder,
    /// Batches `from..to` (exclusive) were missed.
    Gap { from: u64, to: u64 },
    /// The publisher started over.
    Restart,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Classifies `seq` against what was applied so far. Does not record it:
    /// call [`SeqTracker::applied`] once the batch is in the index.
    pub fn check(&self, seq: u64) -> SeqCheck {
        match self.last {
            None => SeqCheck::InOrder,
            Some(last) if seq == last.wrapping_add(1) => SeqCheck::InOrder,
            Some(last) if seq > last => SeqCheck::Gap {
                from: last + 1,
                to: seq,
            },
            // A live PUB socket never repeats a batch, so going backwards
            // (to 0, or to a low number if the first batches after the
            // restart were missed) means a new process.
            Some(_) => SeqCheck::Restart,
        }
    }

    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
    }

    pub fn reset(&mut self) {
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_sequences() {
        let mut t = SeqTracker::default();
        assert_eq!(
            t.check(5),
            SeqCheck::InOrder,
            "the first batch is taken as is"
        );
        t.applied(5);
        assert_eq!(t.check(6), SeqCheck::InOrder);
        assert_eq!(t.check(9), SeqCheck::Gap { from: 6, to: 9 });
        assert_eq!(t.check(0), SeqCheck::Restart);
        assert_eq!(
            t.check(3),
            SeqCheck::Restart,
            "restarted, and batch 0.. were missed"
        );
        assert_eq!(t.check(5), SeqCheck::Restart);
        t.reset();
        assert_eq!(t.check(0), SeqCheck::InOrder);
    }
}
