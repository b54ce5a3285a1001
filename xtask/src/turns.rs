//! The filter's decision time per listener of one Envoy: this tree's
//! build and, with `--baseline REV`, the old build on a listener of its
//! own. Envoy shares a Wasm histogram by name across every module that
//! defines it, so the listeners take turns: a turn's samples are the
//! difference between two readings of the histogram, with a stats flush
//! (every 5 s) between the turn's last request and the second reading.
//! Turns alternate in order, so drift on a shared machine hits every
//! listener alike.

use crate::stats::{histogram_buckets, median, percentiles_between, spread};
use anyhow::{Result, bail};
use kvgate_load::{RequestSpec, Target, run_closed_loop, run_open_loop};
use kvgate_stack::Stack;
use serde_json::{Value, json};
use std::time::Duration;

/// Longer than Envoy's stats flush interval: a reading taken this long
/// after a turn holds all of its samples.
const FLUSH_WAIT: Duration = Duration::from_millis(5500);

/// The phases the current build records beside the whole decision; the
/// baseline build may define none of them, so a phase without samples in
/// a turn is left out.
const PHASES: [&str; 3] = ["kvgate_parse_us", "kvgate_gather_us", "kvgate_selection_us"];

/// Requests a second in a paced turn.
pub const RATE: f64 = 200.0;

/// Requests per turn and turns per listener and pace: a paced turn is 5 s
/// (quick 2 s).
pub fn size(quick: bool) -> (usize, usize) {
    if quick { (400, 3) } else { (1000, 5) }
}

/// A listener measured in turns: its name in the results, its URL.
pub struct Listener {
    pub name: &'static str,
    pub url: String,
}

/// This build's listener and, when the stack runs one, the baseline's.
pub fn listeners(stack: &Stack, with_baseline: bool) -> Vec<Listener> {
    let mut out = vec![Listener {
        name: "kvgate",
        url: stack.envoy_url(),
    }];
    if with_baseline {
        out.push(Listener {
            name: "baseline",
            url: stack.baseline_url(),
        });
    }
    out
}

/// How a turn sends its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// At the specs' `at` times: the VM idles between requests, its
    /// caches cooling, as on a gateway between arrivals.
    Paced,
    /// One after another on one connection: the VM's code and data stay
    /// warm, which is the decision's own cost.
    BackToBack,
}

impl Pace {
    pub const ALL: [Pace; 2] = [Pace::Paced, Pace::BackToBack];

    fn key(self) -> &'static str {
        match self {
            Pace::Paced => "paced",
            Pace::BackToBack => "back_to_back",
        }
    }

    /// Its name in the report's table.
    fn label(self) -> &'static str {
        match self {
            Pace::Paced => "paced",
            Pace::BackToBack => "back to back",
        }
    }

    async fn send(self, target: &Target, specs: &[RequestSpec]) -> Vec<kvgate_load::Outcome> {
        match self {
            Pace::Paced => run_open_loop(target, specs, 1.0).await,
            Pace::BackToBack => run_closed_loop(target, specs, 1).await,
        }
    }
}

/// One listener's turns at one pace.
#[derive(Default, Clone)]
struct Series {
    p50: Vec<f64>,
    p99: Vec<f64>,
    phases: [Vec<f64>; PHASES.len()],
    preempted: u64,
    sent: usize,
    errors: usize,
}

impl Series {
    fn summary(&self) -> Value {
        let mut phase_p50 = serde_json::Map::new();
        for (name, v) in PHASES.iter().zip(&self.phases) {
            if !v.is_empty() {
                phase_p50.insert((*name).into(), json!(median(v.clone())));
            }
        }
        json!({
            "p50_us": median(self.p50.clone()),
            "p50_spread_us": spread(&self.p50),
            "p99_us": median(self.p99.clone()),
            "p99_spread_us": spread(&self.p99),
            "phase_p50_us": phase_p50,
            "preemptions_per_request": self.preempted as f64 / self.sent.max(1) as f64,
            "requests": self.sent,
            "errors": self.errors,
            "turns": self.p50.len(),
        })
    }
}

/// `specs` sent to each listener in turn at each [`Pace`], `reps` turns
/// of each, after a warm-up turn per listener that is not counted (V8
/// tiers the filter up on its first requests). Per listener and pace:
/// the medians of the turns' decision P50 and P99 with their spread, the
/// phases' P50s, and Envoy's worker threads' involuntary context switches
/// per request, which set much of a P99 on shared cores.
pub fn decision(
    stack: &Stack,
    rt: &tokio::runtime::Runtime,
    listeners: &[Listener],
    specs: &[RequestSpec],
    reps: usize,
) -> Result<Value> {
    for l in listeners {
        rt.block_on(run_open_loop(&Target::new(&l.url), specs, 1.0));
    }
    std::thread::sleep(FLUSH_WAIT);
    let n = listeners.len();
    let mut series = vec![[Series::default(), Series::default()]; n];
    for rep in 0..reps {
        let mut order: Vec<usize> = (0..n).collect();
        if rep % 2 == 1 {
            order.reverse();
        }
        for i in order {
            for (k, pace) in Pace::ALL.into_iter().enumerate() {
                turn(stack, rt, &listeners[i], pace, specs, &mut series[i][k])?;
            }
        }
    }
    let mut out = serde_json::Map::new();
    for (l, s) in listeners.iter().zip(&series) {
        let mut by_pace = serde_json::Map::new();
        for (pace, s) in Pace::ALL.iter().zip(s) {
            by_pace.insert(pace.key().into(), s.summary());
        }
        out.insert(l.name.into(), Value::Object(by_pace));
    }
    Ok(Value::Object(out))
}

/// One turn: `specs` to `listener` at `pace`, its samples read from the
/// histograms once Envoy has flushed them.
fn turn(
    stack: &Stack,
    rt: &tokio::runtime::Runtime,
    listener: &Listener,
    pace: Pace,
    specs: &[RequestSpec],
    series: &mut Series,
) -> Result<()> {
    let before = histogram_buckets(stack, "kvgate_decision_us")?;
    let phases_before = PHASES
        .iter()
        .map(|p| histogram_buckets(stack, p))
        .collect::<Result<Vec<_>>>()?;
    let switches = stack.envoy_worker_preemptions();
    let outcomes = rt.block_on(pace.send(&Target::new(&listener.url), specs));
    series.preempted += stack.envoy_worker_preemptions().saturating_sub(switches);
    series.sent += outcomes.len();
    series.errors += outcomes.iter().filter(|o| o.status != 200).count();
    std::thread::sleep(FLUSH_WAIT);
    let decisions = percentiles_between(
        &before,
        &histogram_buckets(stack, "kvgate_decision_us")?,
        &[50.0, 99.0],
    );
    if decisions["count"].as_u64() != Some(outcomes.len() as u64) {
        bail!(
            "{}: {} decisions recorded for {} requests (did a turn miss the flush?)",
            listener.name,
            decisions["count"],
            outcomes.len()
        );
    }
    series
        .p50
        .push(decisions["P50"].as_f64().unwrap_or(f64::NAN));
    series
        .p99
        .push(decisions["P99"].as_f64().unwrap_or(f64::NAN));
    for (k, (name, old)) in PHASES.iter().zip(&phases_before).enumerate() {
        let phase = percentiles_between(old, &histogram_buckets(stack, name)?, &[50.0]);
        if phase["count"].as_u64().unwrap_or(0) > 0 {
            series.phases[k].push(phase["P50"].as_f64().unwrap_or(f64::NAN));
        }
    }
    Ok(())
}

/// `body`s at [`RATE`] a second: the open-loop schedule of a turn.
pub fn paced(path: &str, bodies: impl IntoIterator<Item = Value>) -> Vec<RequestSpec> {
    bodies
        .into_iter()
        .enumerate()
        .map(|(i, body)| RequestSpec {
            path: path.into(),
            body: bytes::Bytes::from(body.to_string()),
            stream: false,
            at: Duration::from_secs_f64(i as f64 / RATE),
            tag: "decision".into(),
            prompt_tokens: None,
        })
        .collect()
}

/// The report's table of [`decision`] results, a row per prompt and
/// pace: each listener's P50 / P99 with their spreads over the turns and
/// the preemptions beside them, and this build's phases.
pub fn table(rows: &[(String, &Value)]) -> String {
    let baseline = rows.iter().any(|(_, v)| v.get("baseline").is_some());
    let mut md = String::from(
        "| 2k-token prompt | sent | whole decision P50 / P99 µs [spread] | preemptions per request |",
    );
    if baseline {
        md.push_str(" baseline build P50 / P99 µs [spread] | its preemptions per request |");
    }
    md.push_str(" of it: parse / gather / selection P50 µs |\n| --- | --- | --- | --- |");
    if baseline {
        md.push_str(" --- | --- |");
    }
    md.push_str(" --- |\n");
    for (name, v) in rows {
        for pace in Pace::ALL {
            let this = &v["kvgate"][pace.key()];
            md.push_str(&format!("| {name} | {} | {} |", pace.label(), cell(this)));
            if baseline {
                md.push_str(&format!(" {} |", cell(&v["baseline"][pace.key()])));
            }
            let phases: Vec<String> = PHASES
                .iter()
                .map(|p| {
                    this["phase_p50_us"][*p]
                        .as_f64()
                        .map_or("—".to_string(), |x| format!("{x:.0}"))
                })
                .collect();
            md.push_str(&format!(" {} |\n", phases.join(" / ")));
        }
    }
    md
}

/// A listener's two cells: P50 / P99 with their spreads, then the
/// preemptions.
fn cell(v: &Value) -> String {
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    format!(
        "{:.0} [{:.0}] / {:.0} [{:.0}] | {:.2}",
        f("p50_us"),
        f("p50_spread_us"),
        f("p99_us"),
        f("p99_spread_us"),
        f("preemptions_per_request")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paced_schedule_spaces_requests_by_the_rate() {
        let specs = paced("/v1/completions", (0..3).map(|i| json!({"i": i})));
        let at: Vec<u128> = specs.iter().map(|s| s.at.as_millis()).collect();
        assert_eq!(at, [0, 5, 10]);
        assert_eq!(&specs[2].body[..], br#"{"i":2}"#);
    }

    #[test]
    fn the_table_shows_both_paces_percentiles_spread_preemptions_and_phases() {
        let this = json!({"p50_us": 21.4, "p50_spread_us": 2.0, "p99_us": 90.0,
                          "p99_spread_us": 30.2, "preemptions_per_request": 0.125,
                          "phase_p50_us": {"kvgate_parse_us": 9.0, "kvgate_selection_us": 11.0}});
        let warm = json!({"p50_us": 15.0, "p50_spread_us": 1.0, "p99_us": 40.0,
                          "p99_spread_us": 5.0, "preemptions_per_request": 0.5,
                          "phase_p50_us": {}});
        let alone = json!({"kvgate": {"paced": this.clone(), "back_to_back": warm.clone()}});
        let md = table(&[("token ids".into(), &alone)]);
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines.len(), 4, "{md}");
        assert_eq!(
            lines[2],
            "| token ids | paced | 21 [2] / 90 [30] | 0.12 | 9 / — / 11 |"
        );
        assert_eq!(
            lines[3],
            "| token ids | back to back | 15 [1] / 40 [5] | 0.50 | — / — / — |"
        );
        assert!(!md.contains("baseline"), "{md}");
        // Every row has as many cells as the header.
        let cells = |l: &str| l.matches('|').count();
        assert!(lines.iter().all(|l| cells(l) == cells(lines[0])), "{md}");

        let old = json!({"p50_us": 40.0, "p50_spread_us": 1.0, "p99_us": 200.0,
                         "p99_spread_us": 10.0, "preemptions_per_request": 0.5});
        let both = json!({"kvgate": {"paced": this, "back_to_back": warm},
                          "baseline": {"paced": old.clone(), "back_to_back": old}});
        let md = table(&[("token ids".into(), &both)]);
        let lines: Vec<&str> = md.lines().collect();
        assert!(lines[0].contains("baseline build"), "{md}");
        assert_eq!(
            lines[2],
            "| token ids | paced | 21 [2] / 90 [30] | 0.12 | 40 [1] / 200 [10] | 0.50 | 9 / — / 11 |"
        );
        assert!(lines.iter().all(|l| cells(l) == cells(lines[0])), "{md}");
    }
}
