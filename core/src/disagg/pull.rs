//! Moving a prompt's KV instead of its work.
//!
//! On a model of `both` workers, the worker that holds a request's prefix
//! may be too loaded to decode one more answer, while an idle worker
//! holds none of it. Today's cost picks one of two losses: queue on the
//! holder, or recompute the whole prefix elsewhere. A third placement
//! keeps the cache and spreads the work: the holder prefills only the
//! uncached tail (a NIXL prefill leg), and the idle worker pulls the
//! whole prompt's KV over NIXL and decodes.
//!
//! The three are priced in one unit, the selection logit's (prefill
//! blocks, see [`crate::plan::select`]):
//!
//! ```text
//! holder     = (prefill_H + decode_H) × heat_H          (selection's own logit)
//! recompute  = (prefill_W + decode_W) × heat_W          (likewise)
//! pull       = prefill_H × heat_H + transfer + decode_W × heat_W
//! transfer   = moved × block_size × kv_bytes_per_token × 8 / link_gbps
//!              × prefill_tokens_per_s / block_size × prefill_load_scale
//! ```
//!
//! `prefill_X` is X's queue (booked prefill tokens) and the prompt it
//! would compute there (its uncached part, the cached part credited);
//! `decode_X` is X's decode load and the blocks the answer adds; `moved`
//! is every block of the prompt the decode worker lacks. The transfer is
//! priced as the prefill the holder could have done in its time, so a
//! pull wins exactly when the recompute it saves (`prefill_W` against
//! `prefill_H`) and the decode load it moves (`decode_H` against
//! `decode_W`) outweigh the time the blocks spend on the link. A pull
//! that reuses fewer cached blocks than [`Pull::min_blocks`] is not
//! considered: it would be an ordinary disaggregated request.

use crate::state::{InvalidValue, Topology};
#[cfg(feature = "serde")]
use serde::{Deserialize, Serialize};

/// A model's pull settings.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct Pull {
    /// The fewest cached blocks a pull must reuse (held by the holder and
    /// not by the decode worker): below it, a transfer's fixed costs and
    /// a second hop buy nothing.
    pub min_blocks: u32,
    /// KV bytes per prompt token, every layer's K and V (Llama-3-8B in
    /// bf16: 32 layers × 8 heads × 128 × 2 × 2 bytes = 128 KiB).
    pub kv_bytes_per_token: u64,
    /// Prompt tokens a worker prefills per second when idle: what a
    /// transfer's time is worth in prefill. The holder's TTFT fit, once
    /// usable, says it instead.
    pub prefill_tokens_per_s: f64,
    /// The link a pull crosses, by where the two workers run.
    pub link: Links,
}

impl Default for Pull {
    fn default() -> Pull {
        Pull {
            min_blocks: 4,
            kv_bytes_per_token: 128 * 1024,
            prefill_tokens_per_s: 10_000.0,
            link: Links::default(),
        }
    }
}

/// Link bandwidth in Gbit/s, by what a transfer crosses.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "serde", serde(default, deny_unknown_fields))]
pub struct Links {
    /// Two workers on one machine (NVLink or PCIe).
    pub same_node_gbps: f64,
    /// Two machines behind one switch.
    pub same_rack_gbps: f64,
    /// Anywhere else, and wherever a worker's place is unknown.
    pub elsewhere_gbps: f64,
}

impl Default for Links {
    fn default() -> Links {
        Links {
            same_node_gbps: 400.0,
            same_rack_gbps: 200.0,
            elsewhere_gbps: 100.0,
        }
    }
}

/// What a transfer between two workers crosses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distance {
    SameNode,
    SameRack,
    Elsewhere,
}

impl Distance {
    /// Between workers at `a` and `b`: a place named the same on both
    /// sides; an unnamed one matches nothing.
    pub fn between(a: &Topology, b: &Topology) -> Distance {
        let same = |x: &str, y: &str| !x.is_empty() && x == y;
        if same(&a.node, &b.node) {
            Distance::SameNode
        } else if same(&a.rack, &b.rack) {
            Distance::SameRack
        } else {
            Distance::Elsewhere
        }
    }
}

/// Where a request of a model that pulls was placed, as its metrics and
/// reason header name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Whole, on a worker holding the longest cached prefix (or on any,
    /// when no worker holds one).
    Holder,
    /// Whole, on a worker that computes again blocks of the prefix
    /// another worker holds.
    Recompute,
    /// Prefilled on the holder, decoded on another worker that pulls.
    Pull,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Holder, Kind::Recompute, Kind::Pull];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Holder => "holder",
            Kind::Recompute => "recompute",
            Kind::Pull => "pull",
        }
    }
}

/// What a model that pulls made of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placed {
    pub kind: Kind,
    /// A pull's blocks moved; a recompute's cached blocks (held by another
    /// worker) computed again; 0 on the holder.
    pub blocks: u64,
    /// A pull's cached blocks of the holder's that the decode worker
    /// lacked: what it computes again should the pull fall through.
    pub reused: u64,
    /// A pull's transfer time, alone on its link; 0 otherwise.
    pub transfer_ms: f64,
}

impl Placed {
    /// The placement header's value: the kind, and what moved or was
    /// computed again.
    pub fn header_value(&self) -> String {
        match self.kind {
            Kind::Holder => self.kind.as_str().to_string(),
            Kind::Recompute => format!("recompute; blocks={}", self.blocks),
            Kind::Pull => format!(
                "pull; blocks={}; transfer_ms={:.1}",
                self.blocks, self.transfer_ms
            ),
        }
    }

    /// What a pull becomes when its decode worker computes the prompt
    /// after all (its prefill leg failed, or the door makes none).
    pub fn recomputed(self) -> Placed {
        Placed {
            kind: Kind::Recompute,
            blocks: self.reused,
            reused: self.reused,
            transfer_ms: 0.0,
        }
    }
}

/// One worker's side of the comparison, in the logit's unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Side {
    /// Its device's cached prefix of the prompt, in blocks.
    pub cached_blocks: u32,
    /// Its queue and the prompt it would compute (selection's prefill
    /// term), with its extra terms.
    pub prefill: f64,
    /// Its decode load and the blocks the answer adds there.
    pub decode: f64,
    /// Its heat multiplier (1 when cool).
    pub heat: f64,
}

impl Side {
    /// What the request costs served whole there: selection's logit.
    pub fn whole(&self) -> f64 {
        (self.prefill + self.decode) * self.heat
    }
}

/// A pull's price and what it moves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quote {
    pub cost: f64,
    /// Blocks the decode worker pulls: every block of the prompt it lacks.
    pub moved_blocks: u64,
    /// Cached blocks of the holder's that the pull reuses (the recompute
    /// it saves).
    pub reused_blocks: u64,
    /// The transfer's time on the link, alone on it.
    pub transfer_ms: f64,
}

/// The prompt, as a pull sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prompt {
    /// Its blocks, the last partial one included.
    pub blocks: u64,
    pub block_size: u32,
    /// The model's `prefill_load_scale`: a prefill block's weight.
    pub prefill_load_scale: f64,
}

impl Pull {
    /// Every number finite, the rates and the bytes above 0.
    pub fn validate(&self) -> Result<(), InvalidValue> {
        for (field, value) in [
            ("pull.prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("pull.link.same_node_gbps", self.link.same_node_gbps),
            ("pull.link.same_rack_gbps", self.link.same_rack_gbps),
            ("pull.link.elsewhere_gbps", self.link.elsewhere_gbps),
            ("pull.kv_bytes_per_token", self.kv_bytes_per_token as f64),
        ] {
            if !(value > 0.0 && value.is_finite()) {
                return Err(InvalidValue {
                    field,
                    rule: "finite and above 0",
                    value,
                });
            }
        }
        Ok(())
    }

    /// The link's bandwidth over `distance`, Gbit/s.
    pub fn gbps(&self, distance: Distance) -> f64 {
        match distance {
            Distance::SameNode => self.link.same_node_gbps,
            Distance::SameRack => self.link.same_rack_gbps,
            Distance::Elsewhere => self.link.elsewhere_gbps,
        }
    }

    /// How long `blocks` of `block_size` tokens take over `distance`, ms.
    pub fn transfer_ms(&self, blocks: u64, block_size: u32, distance: Distance) -> f64 {
        let bits =
            blocks as f64 * f64::from(block_size.max(1)) * self.kv_bytes_per_token as f64 * 8.0;
        let gbps = self.gbps(distance);
        if gbps > 0.0 && gbps.is_finite() {
            bits / (gbps * 1e9) * 1e3
        } else {
            f64::INFINITY
        }
    }

    /// A pull of `prompt` from `holder` to `decoder` over `distance`,
    /// with the holder prefilling at `tokens_per_s`; `None` when it
    /// reuses fewer cached blocks than the floor.
    pub fn quote(
        &self,
        prompt: Prompt,
        holder: &Side,
        decoder: &Side,
        distance: Distance,
        tokens_per_s: f64,
    ) -> Option<Quote> {
        let reused = holder.cached_blocks.saturating_sub(decoder.cached_blocks);
        if reused == 0 || reused < self.min_blocks {
            return None;
        }
        let moved = prompt
            .blocks
            .saturating_sub(u64::from(decoder.cached_blocks));
        let transfer_ms = self.transfer_ms(moved, prompt.block_size, distance);
        // The transfer, as the prefill blocks the holder could compute
        // in its time.
        let transfer = transfer_ms / 1e3 * tokens_per_s / f64::from(prompt.block_size.max(1))
            * prompt.prefill_load_scale;
        let cost = holder.prefill * holder.heat + transfer + decoder.decode * decoder.heat;
        cost.is_finite().then_some(Quote {
            cost,
            moved_blocks: moved,
            reused_blocks: u64::from(reused),
            transfer_ms,
        })
    }
}

/// The cheaper of the best whole placement (`whole`, costing
/// [`Side::whole`]) and a pull: the pull only when it costs strictly
/// less, so that no pull costs more than it saves.
pub fn choose(whole: f64, pull: Option<&Quote>) -> bool {
    pull.is_some_and(|q| q.cost < whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROMPT: Prompt = Prompt {
        blocks: 64,
        block_size: 16,
        prefill_load_scale: 1.0,
    };

    /// A worker with `queue` prefill blocks booked, holding `cached` of the
    /// prompt's 64 blocks, with `decode` blocks resident: its sides as
    /// selection's default policy (overlap credit 1 here) prices them.
    fn side(cached: u32, queue: f64, decode: f64) -> Side {
        let uncached = PROMPT.blocks as f64 - f64::from(cached);
        Side {
            cached_blocks: cached,
            prefill: (queue + uncached).max(0.0),
            decode: decode + uncached.max(1.0),
            heat: 1.0,
        }
    }

    fn pull() -> Pull {
        Pull {
            min_blocks: 4,
            kv_bytes_per_token: 128 * 1024,
            prefill_tokens_per_s: 10_000.0,
            link: Links {
                same_node_gbps: 400.0,
                same_rack_gbps: 100.0,
                elsewhere_gbps: 10.0,
            },
        }
    }

    /// Which placement wins between a holder and an idle worker.
    fn winner(holder: Side, idle: Side, distance: Distance) -> Kind {
        let q = pull().quote(PROMPT, &holder, &idle, distance, 10_000.0);
        let (best, kind) = if holder.whole() <= idle.whole() {
            (holder.whole(), Kind::Holder)
        } else {
            (idle.whole(), Kind::Recompute)
        };
        if choose(best, q.as_ref()) {
            Kind::Pull
        } else {
            kind
        }
    }

    #[test]
    fn a_lightly_loaded_holder_keeps_the_request() {
        assert_eq!(
            winner(side(60, 0.0, 10.0), side(0, 0.0, 0.0), Distance::SameRack),
            Kind::Holder
        );
    }

    #[test]
    fn a_holder_loaded_with_decode_hands_the_answer_to_an_idle_worker() {
        // 60 cached blocks on a holder with 500 decode blocks resident: the
        // pull moves 64 blocks (128 MiB) in about 10.7 ms at 100 Gbit/s,
        // worth about 7 prefill blocks, against 64 to recompute.
        let holder = side(60, 0.0, 500.0);
        let idle = side(0, 0.0, 0.0);
        let q = pull()
            .quote(PROMPT, &holder, &idle, Distance::SameRack, 10_000.0)
            .expect("60 blocks reused");
        assert_eq!((q.moved_blocks, q.reused_blocks), (64, 60));
        assert!((q.transfer_ms - 64.0 * 16.0 * 131_072.0 * 8.0 / 100e9 * 1e3).abs() < 1e-9);
        assert_eq!(winner(holder, idle, Distance::SameRack), Kind::Pull);
    }

    #[test]
    fn a_holder_queued_with_prompts_loses_to_a_recompute() {
        // The holder's prefill queue delays the pull's prefill as much as
        // a whole request's: an idle worker computing 64 blocks wins.
        assert_eq!(
            winner(
                side(60, 400.0, 500.0),
                side(0, 0.0, 0.0),
                Distance::SameRack
            ),
            Kind::Recompute
        );
    }

    #[test]
    fn a_slow_link_makes_a_recompute_cheaper_than_a_pull() {
        // At 10 Gbit/s the same 64 blocks take 107 ms, worth 67 prefill
        // blocks: more than recomputing the 64.
        let holder = side(60, 0.0, 500.0);
        let idle = side(0, 0.0, 0.0);
        assert_eq!(winner(holder, idle, Distance::Elsewhere), Kind::Recompute);
        assert_eq!(winner(holder, idle, Distance::SameNode), Kind::Pull);
    }

    #[test]
    fn the_floor_keeps_small_reuses_whole() {
        let holder = side(3, 0.0, 500.0);
        let idle = side(0, 0.0, 0.0);
        assert_eq!(
            pull().quote(PROMPT, &holder, &idle, Distance::SameNode, 10_000.0),
            None
        );
        let four = side(4, 0.0, 500.0);
        assert!(
            pull()
                .quote(PROMPT, &four, &idle, Distance::SameNode, 10_000.0)
                .is_some()
        );
        // The floor counts what the decode worker lacks, not what the
        // holder has.
        let partial = side(2, 0.0, 0.0);
        assert_eq!(
            pull().quote(PROMPT, &four, &partial, Distance::SameNode, 10_000.0),
            None
        );
    }

    #[test]
    fn an_evicted_holder_has_nothing_to_pull() {
        // The index no longer shows the prefix on the loaded worker: no
        // pull is quoted, and the idle worker computes the prompt.
        let evicted = side(0, 0.0, 500.0);
        let idle = side(0, 0.0, 0.0);
        assert_eq!(
            pull().quote(PROMPT, &evicted, &idle, Distance::SameNode, 10_000.0),
            None
        );
        assert_eq!(winner(evicted, idle, Distance::SameNode), Kind::Recompute);
    }

    #[test]
    fn a_pull_costs_strictly_less_or_is_not_made() {
        let q = Quote {
            cost: 10.0,
            moved_blocks: 1,
            reused_blocks: 1,
            transfer_ms: 0.0,
        };
        assert!(!choose(10.0, Some(&q)));
        assert!(choose(10.5, Some(&q)));
        assert!(!choose(10.5, None));
    }

    #[test]
    fn topology_names_the_link() {
        let at = |node: &str, rack: &str| Topology {
            node: node.into(),
            rack: rack.into(),
        };
        assert_eq!(
            Distance::between(&at("n1", "r1"), &at("n1", "r1")),
            Distance::SameNode
        );
        assert_eq!(
            Distance::between(&at("n1", "r1"), &at("n2", "r1")),
            Distance::SameRack
        );
        assert_eq!(
            Distance::between(&at("n1", "r1"), &at("n2", "r2")),
            Distance::Elsewhere
        );
        assert_eq!(
            Distance::between(&at("", ""), &at("", "")),
            Distance::Elsewhere,
            "an unknown place is not the same place"
        );
        let p = pull();
        let ms = |d| p.transfer_ms(64, 16, d);
        assert!(ms(Distance::SameNode) < ms(Distance::SameRack));
        assert!(ms(Distance::SameRack) < ms(Distance::Elsewhere));
    }

    #[test]
    fn settings_out_of_range_are_refused() {
        assert!(Pull::default().validate().is_ok());
        for bad in [
            Pull {
                prefill_tokens_per_s: 0.0,
                ..Pull::default()
            },
            Pull {
                kv_bytes_per_token: 0,
                ..Pull::default()
            },
            Pull {
                link: Links {
                    same_rack_gbps: f64::NAN,
                    ..Links::default()
                },
                ..Pull::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
