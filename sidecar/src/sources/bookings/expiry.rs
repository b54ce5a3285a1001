//! When each holder falls due: a min-heap of the times holders were last
//! heard of, so that a tick looks at the holders that may have expired
//! and at no other.
//!
//! Entries are never removed from the middle. A holder that ends leaves
//! its entry behind, and one heard of again keeps its old entry: each
//! entry carries the serial its holder was admitted with, so a popped
//! entry whose holder is gone or was admitted again is dropped, and one
//! whose holder was heard of since is pushed back with its later time.
//! Left-behind entries are bounded by rebuilding the heap from the live
//! holders once they outnumber them.

use super::Holder;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Due {
    /// When the holder was last heard of as this entry was pushed.
    pub at: Instant,
    pub serial: u64,
    pub holder: Holder,
}

#[derive(Debug, Default)]
pub(super) struct Deadlines {
    heap: BinaryHeap<Reverse<Due>>,
}

/// Below this many entries, left-behind ones are not worth a rebuild.
const REBUILD_FLOOR: usize = 1024;

impl Deadlines {
    pub fn push(&mut self, due: Due) {
        self.heap.push(Reverse(due));
    }

    /// The earliest entry, if `due` says it is due.
    pub fn pop_if(&mut self, due: impl Fn(Instant) -> bool) -> Option<Due> {
        match self.heap.peek() {
            Some(Reverse(d)) if due(d.at) => self.heap.pop().map(|Reverse(d)| d),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.heap.capacity()
    }

    /// Whether left-behind entries outnumber the `live` holders enough to
    /// rebuild: each rebuild's cost is paid for by at least as many ends
    /// since the last one.
    pub fn needs_rebuild(&self, live: usize) -> bool {
        self.heap.len() > REBUILD_FLOOR.max(live.saturating_mul(2))
    }

    /// Replaces every entry with one per live holder, sized to them.
    pub fn rebuild(&mut self, live: impl Iterator<Item = Due>) {
        let entries: Vec<Reverse<Due>> = live.map(Reverse).collect();
        self.heap = BinaryHeap::from(entries);
    }

    /// Gives back memory a surge left behind; true when it did.
    pub fn shrink(&mut self) -> bool {
        if !super::sparse(self.heap.len(), self.heap.capacity()) {
            return false;
        }
        self.heap.shrink_to(self.heap.len().saturating_mul(2));
        true
    }
}
