//! The requests a front door holds: ordered by class (its priority, 0
//! first), then by deadline, then by arrival; bounded per model. A full
//! model's queue makes room by shedding its last entry when the newcomer
//! comes before it, and refuses the newcomer otherwise.

/// One held request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held<T> {
    pub model: String,
    /// Its class's priority: 0 goes first.
    pub priority: u8,
    /// When it is answered if still held (ms, the front door's clock).
    pub deadline_ms: u64,
    /// Arrival order among equals.
    seq: u64,
    pub item: T,
}

impl<T> Held<T> {
    fn key(&self) -> (u8, u64, u64) {
        (self.priority, self.deadline_ms, self.seq)
    }
}

/// What [`Queue::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed<T> {
    /// Held.
    Held,
    /// Held, and to make room the model's last entry left: shed it.
    Displaced(Held<T>),
    /// The model's queue is full of entries that come first: shed it.
    Full(T),
}

/// Held requests, in order.
#[derive(Debug)]
pub struct Queue<T> {
    /// Sorted by [`Held::key`].
    entries: Vec<Held<T>>,
    seq: u64,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            entries: Vec::new(),
            seq: 0,
        }
    }
}

impl<T> Queue<T> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries of `model` held now.
    pub fn len_of(&self, model: &str) -> usize {
        self.entries.iter().filter(|e| e.model == model).count()
    }

    /// Holds `item` unless `model` already holds `max_per_model` entries
    /// that all come before it.
    pub fn push(
        &mut self,
        model: &str,
        priority: u8,
        deadline_ms: u64,
        item: T,
        max_per_model: usize,
    ) -> Pushed<T> {
        self.seq += 1;
        let new = Held {
            model: model.to_string(),
            priority,
            deadline_ms,
            seq: self.seq,
            item,
        };
        let mut displaced = None;
        if self.len_of(model) >= max_per_model {
            let last = self.entries.iter().rposition(|e| e.model == model);
            match last {
                Some(i) if self.entries[i].key() > new.key() => {
                    displaced = Some(self.entries.remove(i));
                }
                _ => return Pushed::Full(new.item),
            }
        }
        let at = self.entries.partition_point(|e| e.key() <= new.key());
        self.entries.insert(at, new);
        match displaced {
            Some(d) => Pushed::Displaced(d),
            None => Pushed::Held,
        }
    }

    /// Takes out every entry whose deadline is at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Held<T>> {
        let (due, kept) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| e.deadline_ms <= now_ms);
        self.entries = kept;
        due
    }

    /// The entries in the order they go.
    pub fn iter(&self) -> impl Iterator<Item = &Held<T>> {
        self.entries.iter()
    }

    /// Takes out the first entry `f` picks.
    pub fn take(&mut self, mut f: impl FnMut(&Held<T>) -> bool) -> Option<Held<T>> {
        let at = self.entries.iter().position(&mut f)?;
        Some(self.entries.remove(at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &Queue<u32>) -> Vec<u32> {
        q.iter().map(|e| e.item).collect()
    }

    #[test]
    fn class_first_then_deadline_then_arrival() {
        let mut q = Queue::default();
        assert_eq!(q.push("m", 2, 500, 1, 10), Pushed::Held);
        assert_eq!(q.push("m", 1, 900, 2, 10), Pushed::Held);
        assert_eq!(q.push("m", 2, 400, 3, 10), Pushed::Held);
        assert_eq!(q.push("m", 2, 400, 4, 10), Pushed::Held);
        assert_eq!(q.push("m", 0, 1000, 5, 10), Pushed::Held);
        assert_eq!(order(&q), vec![5, 2, 3, 4, 1]);
        assert_eq!(q.take(|e| e.item == 2).map(|e| e.item), Some(2));
        assert_eq!(order(&q), vec![5, 3, 4, 1]);
    }

    #[test]
    fn a_full_model_sheds_its_last_for_a_better_one_only() {
        let mut q = Queue::default();
        q.push("m", 1, 100, 1, 2);
        q.push("m", 2, 100, 2, 2);
        // Another model's queue is its own.
        assert_eq!(q.push("other", 2, 100, 9, 2), Pushed::Held);
        // Same class, later deadline: it would be last, so it is refused.
        assert_eq!(q.push("m", 2, 200, 3, 2), Pushed::Full(3));
        // A better class displaces the last.
        match q.push("m", 0, 300, 4, 2) {
            Pushed::Displaced(d) => assert_eq!((d.item, d.priority), (2, 2)),
            other => panic!("{other:?}"),
        }
        assert_eq!(order(&q), vec![4, 1, 9]);
        assert_eq!(q.len_of("m"), 2);
        // A bound of 0 holds nothing.
        assert_eq!(q.push("z", 0, 1, 7, 0), Pushed::Full(7));
    }

    #[test]
    fn expiry_takes_what_is_due_and_keeps_the_order() {
        let mut q = Queue::default();
        q.push("m", 1, 100, 1, 10);
        q.push("m", 0, 300, 2, 10);
        q.push("m", 1, 200, 3, 10);
        let due: Vec<u32> = q.expire(200).into_iter().map(|e| e.item).collect();
        assert_eq!(due, vec![1, 3]);
        assert_eq!(order(&q), vec![2]);
        assert!(q.expire(299).is_empty());
        assert_eq!(q.expire(300).len(), 1);
        assert!(q.is_empty());
    }
}
