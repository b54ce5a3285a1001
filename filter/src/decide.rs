//! The per-request decision, free of any host call: given the fleet
//! snapshot and a parsed request, route it or answer it.

use crate::config::Config;
use crate::reply::Reply;
use crate::request::Parsed;
use kvgate_core::Policy;
use kvgate_core::select::{Choice, Decision, Overlap, RequestShape, select_with_runner_up};
use kvgate_core::{RankLoad, Snapshot, WorkerState};

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome<'a> {
    Route {
        worker: &'a WorkerState,
        rank: &'a RankLoad,
        /// Whether the engine must be told the rank (more than one rank).
        set_rank: bool,
        /// Where Envoy retries if `worker` refuses the connection: the
        /// cheapest rank on another worker that the same rank header suits.
        fallback: Option<(&'a WorkerState, &'a RankLoad)>,
    },
    Reply(Reply),
}

pub fn decide<'a>(
    cfg: &Config,
    policy: &Policy,
    snap: &'a Snapshot,
    req: &Parsed,
    tenant: &str,
    tie_break: u64,
    overlap: impl FnMut(&WorkerState, &RankLoad) -> Overlap,
) -> Outcome<'a> {
    let Some(model) = snap.model(&req.model) else {
        return Outcome::Reply(Reply::unknown_model(&req.model));
    };
    let shape = RequestShape {
        isl_tokens: req.isl_tokens,
        tie_break,
        sample: (tie_break % 1_000_003) as f64 / 1_000_003.0,
    };
    let (decision, runner_up) = select_with_runner_up(model, tenant, &shape, policy, overlap);
    match decision {
        Decision::Route(Choice { worker, rank, .. }) => {
            let set_rank = worker.ranks.len() > 1;
            // The retry carries the same headers: a rank header names the
            // same rank on the other worker, and no header suits any worker
            // (a multi-rank engine then balances by itself).
            let fallback = runner_up
                .filter(|r| !set_rank || (r.worker.ranks.len() > 1 && r.rank.rank == rank.rank))
                .map(|r| (r.worker, r.rank));
            Outcome::Route {
                worker,
                rank,
                set_rank,
                fallback,
            }
        }
        // The sidecar's estimate from the drain rate, when it has one.
        Decision::AllBusy => Outcome::Reply(Reply::busy(match model.retry_after_s {
            0 => cfg.retry_after_s,
            s => s,
        })),
        Decision::NoWorkers => Outcome::Reply(Reply::no_workers(&req.model)),
    }
}

/// A VM's cached copy of the snapshot, re-decoded only when its version
/// changes.
#[derive(Debug, Default)]
pub struct View {
    pub snapshot: Option<Snapshot>,
    pub version: u64,
}

impl View {
    /// Brings the view to `version`, reading the bytes only if needed.
    /// Returns whether a new snapshot replaced the view, or an error
    /// (keeping the old view) when the bytes do not decode.
    pub fn refresh(
        &mut self,
        version: u64,
        read: impl FnOnce() -> Option<Vec<u8>>,
    ) -> Result<bool, kvgate_core::SnapshotError> {
        if version == self.version && self.snapshot.is_some() {
            return Ok(false);
        }
        let Some(bytes) = read() else {
            return Ok(false);
        };
        let snap = Snapshot::decode(&bytes)?;
        self.version = snap.version;
        self.snapshot = Some(snap);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::Reason;
    use crate::request::{Endpoint, parse};
    use kvgate_core::DEFAULT_TENANT;
    use kvgate_core::{ModelState, Thresholds};

    fn rank(rank: u32, decode: u64, busy: bool) -> RankLoad {
        RankLoad {
            rank,
            active_decode_blocks: decode,
            busy,
            ..Default::default()
        }
    }

    fn snapshot() -> Snapshot {
        Snapshot {
            version: 5,
            built_at_ms: 1,
            models: vec![
                ModelState {
                    name: "m".into(),
                    thresholds: Thresholds::default(),
                    shard_count: 0,
                    retry_after_s: 0,
                    lora_adapters: Vec::new(),
                    policy: Policy::default(),
                    workers: vec![
                        WorkerState {
                            id: 1,
                            endpoint: "10.0.0.1:8000".into(),
                            block_size: 16,
                            ranks: vec![rank(0, 50, false)],
                            tenant: DEFAULT_TENANT.into(),
                        },
                        WorkerState {
                            id: 2,
                            endpoint: "10.0.0.2:8000".into(),
                            block_size: 16,
                            ranks: vec![rank(0, 10, true), rank(1, 20, false)],
                            tenant: DEFAULT_TENANT.into(),
                        },
                    ],
                },
                ModelState {
                    name: "empty".into(),
                    ..Default::default()
                },
                ModelState {
                    name: "busy".into(),
                    workers: vec![WorkerState {
                        id: 3,
                        endpoint: "10.0.0.3:8000".into(),
                        block_size: 16,
                        ranks: vec![rank(0, 0, true)],
                        tenant: DEFAULT_TENANT.into(),
                    }],
                    retry_after_s: 7,
                    ..Default::default()
                },
            ],
            applied: Vec::new(),
        }
    }

    fn run<'a>(snap: &'a Snapshot, model: &str) -> Outcome<'a> {
        let body = format!(r#"{{"model":"{model}","prompt":"hello"}}"#);
        let req = parse(Endpoint::Completions, body.as_bytes()).unwrap();
        decide(
            &Config::default(),
            &Policy::default(),
            snap,
            &req,
            DEFAULT_TENANT,
            0,
            |_, _| Overlap::default(),
        )
    }

    #[test]
    fn routes_to_the_least_loaded_free_rank() {
        let s = snapshot();
        match run(&s, "m") {
            Outcome::Route {
                worker,
                rank,
                set_rank,
                fallback,
            } => {
                assert_eq!((worker.id, rank.rank, set_rank), (2, 1, true));
                assert_eq!(
                    fallback, None,
                    "worker 1 has no rank 1 to take the rank header"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_fallback_is_the_next_cheapest_worker_the_headers_suit() {
        let mut s = snapshot();
        // Worker 2 with one rank, and a third, busier worker.
        s.models[0].workers[1].ranks.remove(0);
        let mut third = s.models[0].workers[0].clone();
        third.id = 9;
        third.endpoint = "10.0.0.9:8000".into();
        third.ranks[0].active_decode_blocks = 90;
        s.models[0].workers.push(third);
        match run(&s, "m") {
            Outcome::Route {
                worker,
                set_rank,
                fallback: Some((fb, _)),
                ..
            } => {
                assert_eq!((worker.id, set_rank, fb.id), (2, false, 1));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn replies() {
        let s = snapshot();
        let reason = |o: Outcome<'_>| match o {
            Outcome::Reply(r) => (r.status, r.reason),
            other => panic!("{other:?}"),
        };
        assert_eq!(reason(run(&s, "nope")), (404, Reason::UnknownModel));
        assert_eq!(reason(run(&s, "empty")), (503, Reason::NoWorkers));
        assert_eq!(reason(run(&s, "busy")), (503, Reason::AllWorkersBusy));
        match run(&s, "busy") {
            Outcome::Reply(r) => assert_eq!(r.retry_after_s, Some(7), "the sidecar's hint wins"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn single_rank_workers_get_no_rank_header() {
        let mut s = snapshot();
        s.models[0].workers.remove(1);
        assert!(matches!(
            run(&s, "m"),
            Outcome::Route {
                set_rank: false,
                ..
            }
        ));
    }

    #[test]
    fn view_decodes_once_per_version() {
        let s = snapshot();
        let bytes = s.encode().unwrap();
        let mut v = View::default();
        let mut reads = 0;
        v.refresh(5, || {
            reads += 1;
            Some(bytes.clone())
        })
        .unwrap();
        v.refresh(5, || {
            reads += 1;
            Some(bytes.clone())
        })
        .unwrap();
        assert_eq!(reads, 1);
        assert_eq!(v.version, 5);
        assert!(v.refresh(6, || Some(vec![1, 2, 3])).is_err());
        assert_eq!(v.version, 5, "a bad snapshot keeps the old view");
        assert!(v.snapshot.is_some());
    }
}
