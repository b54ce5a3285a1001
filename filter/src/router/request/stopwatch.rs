//! A decision's clock: its whole time on every request, its phases on one
//! request in `phase_timing_every` (8 unless configured).
//!
//! In Envoy each clock read is a host call (about 0.15 µs) and each
//! histogram sample another (0.6 to 1.8 µs, measured inside the VM), and
//! timing the three phases of every request took five reads and three
//! samples of its decision. The phase histograms are there to show where a
//! regression is, which a sample of the requests shows as well: their
//! percentiles are those of the requests sampled, one in eight spread
//! evenly over the VM's requests. The decision histogram still counts
//! every request, and a sampled request records its phases after its
//! decision is timed, so that what the decision histogram reports is
//! the same on every request.

use crate::host::Host;
use crate::metrics::RouterMetrics;

/// Where the decision is, for [`Stopwatch::mark`].
#[derive(Debug, Clone, Copy)]
pub enum Phase {
    /// The body copied out and parsed, the snapshot checked, a text prompt
    /// rendered: the gather starts here.
    Parsed,
    /// The prompt's overlap read from the index.
    Gathered,
    /// Placed.
    Selected,
}

#[derive(Debug)]
pub struct Stopwatch {
    started_us: u64,
    /// The phases' ends, on a sampled decision: `None` until marked.
    phases: Option<[Option<u64>; 3]>,
}

impl Stopwatch {
    /// Starts the clock; `n` counts the VM's decisions, and one in
    /// `every` has its phases timed (none when 0).
    pub fn start(h: &impl Host, n: u64, every: u64) -> Stopwatch {
        Stopwatch {
            started_us: h.now_us(),
            phases: (every > 0 && n.is_multiple_of(every)).then_some([None; 3]),
        }
    }

    /// Notes the end of `phase`, on a sampled decision only.
    pub fn mark(&mut self, h: &impl Host, phase: Phase) {
        if let Some(p) = self.phases.as_mut() {
            p[phase as usize] = Some(h.now_us());
        }
    }

    /// Stops the clock: records the whole decision and, on a sampled one,
    /// its phases (gather and selection from the end of the parse).
    pub fn finish(self, h: &impl Host, m: &RouterMetrics) {
        h.sample(m.decision_us, h.now_us().saturating_sub(self.started_us));
        let Some([Some(parsed), gathered, selected]) = self.phases else {
            return;
        };
        h.sample(m.parse_us, parsed.saturating_sub(self.started_us));
        for (id, end) in [(m.gather_us, gathered), (m.selection_us, selected)] {
            if let Some(end) = end {
                h.sample(id, end.saturating_sub(parsed));
            }
        }
    }
}
