//! The index thread's side of `GET /dump` and of start-up recovery: slots
//! named by their ranks on the way out, ranks resolved to this catalog's
//! slots on the way in.

use super::State;
use crate::sources::kv::dump::{Dump, Group};
use std::collections::{BTreeMap, HashMap};

/// Why a recovered block was not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dropped {
    /// Its (model, worker, rank) has no KV-event slot in this catalog.
    UnknownRank,
    /// The rank's block size here is not the dump's.
    BlockSize,
    /// The rank would exceed `kv.max_blocks_per_rank`.
    OverBound,
    /// The rank already held its engine hash (a live event came first).
    AlreadyIndexed,
}

impl Dropped {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::UnknownRank => "unknown_rank",
            Dropped::BlockSize => "block_size",
            Dropped::OverBound => "over_bound",
            Dropped::AlreadyIndexed => "already_indexed",
        }
    }
}

/// What replaying a dump did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreReport {
    pub recovered: u64,
    pub dropped: BTreeMap<Dropped, u64>,
    /// The first few ranks dropped whole, as (model, worker_id, dp_rank),
    /// for the log.
    pub dropped_ranks: Vec<(String, u64, u32, Dropped)>,
}

/// Ranks named in the log line of a recovery; the counts tell the rest.
const NAMED_RANKS: usize = 8;

impl RestoreReport {
    fn drop(&mut self, why: Dropped, n: u64) {
        if n > 0 {
            *self.dropped.entry(why).or_default() += n;
        }
    }

    fn drop_rank(&mut self, g: &Group, why: Dropped) {
        self.drop(why, g.blocks.len() as u64);
        if self.dropped_ranks.len() < NAMED_RANKS {
            self.dropped_ranks
                .push((g.model.clone(), g.worker_id, g.dp_rank, why));
        }
    }
}

impl State {
    /// Every slot's blocks, under its rank's name. Slots holding nothing
    /// are left out.
    pub(super) fn dump(&self) -> Dump {
        let mut groups = Vec::with_capacity(self.slot_model.len());
        let mut pages = 0;
        for (&slot, owner) in &self.slot_model {
            let Some(idx) = self.models.get(&owner.model) else {
                continue;
            };
            pages += idx.pages_len(slot);
            let blocks = idx.blocks(slot);
            if blocks.is_empty() {
                continue;
            }
            groups.push(Group {
                model: owner.model.clone(),
                worker_id: owner.rank.worker_id,
                dp_rank: owner.rank.dp_rank,
                block_size: idx.block_size(slot),
                blocks,
            });
        }
        if pages > 0 {
            tracing::debug!(pages, "re-chunked pages are not dumped");
        }
        Dump {
            created_at_ms: crate::clock::now_ms(),
            groups,
        }
    }

    /// Replays each group into the slot of its rank here, if this catalog
    /// has one of the same block size.
    pub(super) fn restore(&mut self, dump: Dump) -> RestoreReport {
        let mut report = RestoreReport::default();
        let slots: HashMap<(&str, u64, u32), u16> = self
            .slot_model
            .iter()
            .map(|(&slot, o)| ((o.model.as_str(), o.rank.worker_id, o.rank.dp_rank), slot))
            .collect();
        for g in &dump.groups {
            let slot = slots.get(&(g.model.as_str(), g.worker_id, g.dp_rank));
            let (Some(&slot), Some(idx)) = (slot, self.models.get_mut(&g.model)) else {
                report.drop_rank(g, Dropped::UnknownRank);
                continue;
            };
            if idx.block_size(slot) != g.block_size {
                report.drop_rank(g, Dropped::BlockSize);
                continue;
            }
            let Some(r) = idx.restore(slot, &g.blocks) else {
                report.drop_rank(g, Dropped::UnknownRank);
                continue;
            };
            if r.over_bound > 0 {
                report.drop_rank(g, Dropped::OverBound);
            }
            report.recovered += r.blocks;
            report.drop(Dropped::AlreadyIndexed, r.known);
        }
        report
    }
}
