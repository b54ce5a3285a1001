//! The blocks' templates. Every figure goes through the [`Pen`], which
//! takes it from a results file (or a declared target) and remembers it;
//! a number with a unit typed into a template fails the docs check.

use super::Pen;
use crate::shapebench::{self, LLMD_CORE_S_PER_100K_REQUEST};

const OVERHEAD: &str = "overhead";
const KV: &str = "kv";
const TEXT: &str = "text";
const INGEST: &str = "ingest";
const SHEDDING: &str = "shedding";
const QUALITY: &str = "quality";
const DISAGG: &str = "disagg";
const THERMAL: &str = "thermal";
const PLANNER: &str = "planner";
const ADMISSION: &str = "admission";
const PULL: &str = "pull";
const SYNC: &str = "sync";
const DUMP: &str = "dump";

/// The quality bench's workloads and the rates the figures quote.
const SHARED_PREFIX: &str = "workloads/name=shared_prefix";
const SHARED_PREFIX_RATE: &str = "rate_per_s=80";
const MOONCAKE: &str = "workloads/name=mooncake";
const MOONCAKE_RATE: &str = "rate_per_s=16";

/// A table row: its cells, then the run `file` came from.
fn row(p: &mut Pen, file: &str, cells: [String; 3]) -> String {
    let run = p.run(file);
    format!("| {} | {} | {} | {run} |\n", cells[0], cells[1], cells[2])
}

const TABLE_HEAD: &str =
    "| figure | kvgate | baseline / target | run |\n| --- | --- | --- | --- |\n";

/// The figures at `paths` in `file`, `a / b unit`.
fn slash(
    p: &mut Pen,
    file: &str,
    paths: &[impl AsRef<str>],
    decimals: usize,
    unit: &str,
) -> String {
    let figures: Vec<String> = paths
        .iter()
        .map(|at| p.num(file, at.as_ref(), decimals))
        .collect();
    format!("{} {unit}", figures.join(" / "))
}

/// Selection with the KV bench's index, P50 / P99, and its target.
fn selection_cells(p: &mut Pen) -> [String; 2] {
    [
        slash(p, KV, &["selection_us/P50", "selection_us/P99"], 0, "µs"),
        format!("target ≤ {} µs P50", p.stated("20", "selection P50 target")),
    ]
}

/// From a KV event published to decisions that follow it, p50 / p99, and
/// its target.
fn freshness_cells(p: &mut Pen) -> [String; 2] {
    [
        slash(p, KV, &["freshness_ms_p50", "freshness_ms_p99"], 1, "ms"),
        format!("target ≤ {} ms p99", p.stated("25", "freshness p99 target")),
    ]
}

/// `P50 [spread] / P99` of one side of a decision in turns.
fn turns_cell(p: &mut Pen, file: &str, at: &str) -> String {
    format!(
        "{} [{}] / {} µs",
        p.num(file, &format!("{at}/p50_us"), 0),
        p.num(file, &format!("{at}/p50_spread_us"), 0),
        p.num(file, &format!("{at}/p99_us"), 0),
    )
}

/// A quality policy's TTFT p90 and hit rate at the quoted rate.
fn quality_cells(p: &mut Pen, workload: &str, rate: &str, policy: &str) -> (String, String) {
    let at = format!("{workload}/rates/{rate}/policies/{policy}");
    (
        p.num(QUALITY, &format!("{at}/ttft_ms/p90"), 0),
        p.pct(QUALITY, &format!("{at}/hit_rate"), 1),
    )
}

/// The index size the KV bench built, `1.6M`.
fn index_size(p: &mut Pen) -> String {
    p.millions(KV, "indexed_blocks", 1)
}

/// Decisions per turn, and turns, of the turns table in `file` at `at`.
fn turn_sizes(p: &mut Pen, file: &str, at: &str) -> (String, String) {
    let turns = p.value(file, &format!("{at}/turns"));
    let requests = p.value(file, &format!("{at}/requests"));
    (
        p.put(file, &format!("{at}/requests / turns"), requests / turns, 0),
        p.put(file, &format!("{at}/turns"), turns, 0),
    )
}

/// The 128k token-id row's routing cost scaled to 100k tokens, and the
/// llm-d router's reported cost it is set against.
struct LongCost {
    /// `1.59 ms: 0.16 cores for 100 req/s`, or that it is below the noise.
    kvgate: String,
    /// llm-d's core-seconds a request.
    llmd: String,
    /// How many times less than llm-d's; none when below the noise.
    times_less: Option<String>,
}

impl LongCost {
    /// The report's baseline cell.
    fn llmd_cell(&self) -> String {
        let times = self
            .times_less
            .as_ref()
            .map_or(String::new(), |t| format!(" ({t}×)"));
        format!(
            "llm-d's router, reported: {} core-seconds a request{times}",
            self.llmd
        )
    }
}

fn long_prompt_cost(p: &mut Pen) -> LongCost {
    let by_shape = p.raw(OVERHEAD, "by_shape");
    let llmd = p.stated(
        &LLMD_CORE_S_PER_100K_REQUEST.to_string(),
        "llm-d's router, reported core-seconds a 100k-token request",
    );
    let Some(c) = shapebench::long_prompt(by_shape, shapebench::LONG_PROMPTS[0]) else {
        p.value(OVERHEAD, "by_shape/shapes/shape=128k token ids");
        return LongCost {
            kvgate: "?".into(),
            llmd,
            times_less: None,
        };
    };
    let how = "by_shape: 128k token ids, added CPU scaled to 100k tokens";
    if c.added_ms > 0.0 {
        LongCost {
            kvgate: format!(
                "{} ms: {} cores for {} req/s",
                p.put(OVERHEAD, how, c.added_ms, 2),
                p.put(OVERHEAD, how, c.added_cores(), 2),
                p.stated("100", "the request rate the long-prompt cost is put at")
            ),
            llmd,
            times_less: Some(p.put(OVERHEAD, how, c.times_less_than_llmd(), 0)),
        }
    } else {
        LongCost {
            kvgate: "below the run's noise (kvgate's route took no more CPU than the plain one)"
                .into(),
            llmd,
            times_less: None,
        }
    }
}

/// The streamed and one-piece responses' added worker-thread CPU.
fn streaming(p: &mut Pen) -> (String, String) {
    let by_shape = p.raw(OVERHEAD, "by_shape");
    let Some((streamed, one_piece)) = shapebench::streaming(by_shape) else {
        p.value(
            OVERHEAD,
            "by_shape/shapes/shape=streamed response, 256 chunks",
        );
        return ("?".into(), "?".into());
    };
    let how = "by_shape: kvgate's worker-thread CPU minus the plain route's";
    (
        p.put(OVERHEAD, how, streamed, 0),
        p.put(OVERHEAD, how, one_piece, 0),
    )
}

/// The length curve's slopes, this build's and the baseline build's: each
/// `token ids 7.7 µs; text 2.3 µs, chat 0.8 µs` and `7.2, 5.3 and 5.0 µs`.
fn slopes(p: &mut Pen) -> (String, String) {
    let by_shape = p.raw(OVERHEAD, "by_shape");
    let lines = shapebench::lines(by_shape);
    let how = "by_shape: least squares through the five lengths";
    let mut this = Vec::new();
    let mut before = Vec::new();
    for (label, line, baseline) in lines {
        match line {
            Some((slope, _)) => this.push(format!("{label} {} µs", p.put(OVERHEAD, how, slope, 1))),
            None => {
                p.value(OVERHEAD, &format!("by_shape/shapes/shape=1k {label}"));
            }
        }
        if let Some((slope, _)) = baseline {
            before.push(p.put(OVERHEAD, how, slope, 1));
        }
    }
    let this = match this.as_slice() {
        [first, rest @ ..] => format!("{first}; {}", rest.join(", ")),
        [] => "?".into(),
    };
    let before = match before.as_slice() {
        [a, b, c] => format!("{a}, {b} and {c} µs"),
        [] => "—".into(),
        other => format!("{} µs", other.join(", ")),
    };
    (this, before)
}

/// The README's headline rows.
pub fn headline(p: &mut Pen) -> String {
    let mut s = String::from(
        "On the project's 2-vCPU machine, everything sharing those two cores; each \
figure next to a baseline from the same run, and the run's date and the commit \
it measured. All of them, with how to read them: \
[bench/report.md](bench/report.md#summary).\n\n",
    );
    s.push_str(TABLE_HEAD);

    let cells = [
        "filter decision time, a one-word chat (the overhead bench's request), P50 / P99".into(),
        slash(
            p,
            OVERHEAD,
            &["filter_decision_us/P50", "filter_decision_us/P99"],
            0,
            "µs",
        ),
        "—".into(),
    ];
    s.push_str(&row(p, OVERHEAD, cells));

    let size = index_size(p);
    let kv_before = p.baseline(KV);
    let cells = [
        format!(
            "the whole decision on a 2k-token prompt (token ids, {size}-block index), back to back, P50 / P99"
        ),
        slash(
            p,
            KV,
            &[
                "decision_turns/kvgate/back_to_back/p50_us",
                "decision_turns/kvgate/back_to_back/p99_us",
            ],
            0,
            "µs",
        ),
        format!(
            "{} / {} µs the build before ({kv_before}), same Envoy",
            p.num(KV, "decision_turns/baseline/back_to_back/p50_us", 0),
            p.num(KV, "decision_turns/baseline/back_to_back/p99_us", 0)
        ),
    ];
    s.push_str(&row(p, KV, cells));

    let chat = "cost/policies/precise_text/chat";
    let text_before = p.baseline(TEXT);
    let cells = [
        format!(
            "the same for a {}-token chat matched on the text index",
            p.num(TEXT, "cost/prompt_tokens", 0)
        ),
        slash(
            p,
            TEXT,
            &[
                &format!("{chat}/kvgate/back_to_back/p50_us"),
                &format!("{chat}/kvgate/back_to_back/p99_us"),
            ],
            0,
            "µs",
        ),
        format!(
            "{} / {} µs the build before ({text_before}), same Envoy",
            p.num(TEXT, &format!("{chat}/baseline/back_to_back/p50_us"), 0),
            p.num(TEXT, &format!("{chat}/baseline/back_to_back/p99_us"), 0)
        ),
    ];
    s.push_str(&row(p, TEXT, cells));

    let [selection, target] = selection_cells(p);
    let cells = [
        format!("selection with a {size}-block index, 2k-token prompts, P50 / P99"),
        selection,
        target,
    ];
    s.push_str(&row(p, KV, cells));

    let cells = [
        "throughput through Envoy, closed loop, both cores saturated".into(),
        format!(
            "{} req/s (×{} the plain route's)",
            p.num(OVERHEAD, "kvgate_route/rps", 0),
            p.num(OVERHEAD, "vs_plain/kvgate/throughput_ratio", 2)
        ),
        format!(
            "×{} for the same decision over `ext_proc`",
            p.num(OVERHEAD, "vs_plain/extproc/throughput_ratio", 2)
        ),
    ];
    s.push_str(&row(p, OVERHEAD, cells));

    let [fresh, target] = freshness_cells(p);
    let cells = [
        "KV event published → decisions follow it, p50 / p99".into(),
        fresh,
        target,
    ];
    s.push_str(&row(p, KV, cells));

    let cells = [
        "KV event ingest, one thread".into(),
        format!("{} blocks/s", p.millions(INGEST, "ingest_blocks_per_s", 2)),
        format!(
            "{} generic msgpack decode alone",
            p.millions(INGEST, "baseline_rmpv_decode_blocks_per_s", 2)
        ),
    ];
    s.push_str(&row(p, INGEST, cells));

    let on = "overload/shedding_on";
    let off = "overload/baseline_shedding_off";
    let cells = [
        format!(
            "admitted TTFT p50 / p99 at {}× capacity",
            p.ratio(
                SHEDDING,
                "overload/rate_per_s",
                "overload/estimated_capacity_per_s",
                0
            )
        ),
        format!(
            "{} / {} ms with shedding",
            p.num(SHEDDING, &format!("{on}/ttft_ms_p50"), 0),
            p.num(SHEDDING, &format!("{on}/ttft_ms_p99"), 0)
        ),
        format!(
            "{} / {} ms without",
            p.num(SHEDDING, &format!("{off}/ttft_ms_p50"), 0),
            p.num(SHEDDING, &format!("{off}/ttft_ms_p99"), 0)
        ),
    ];
    s.push_str(&row(p, SHEDDING, cells));

    let (precise_p90, precise_hits) =
        quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "precise");
    let (rr_p90, rr_hits) = quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "round_robin");
    let cells = [
        format!(
            "shared-prefix workload at {} req/s, {} workers: TTFT p90, hit rate",
            p.num(
                QUALITY,
                &format!("{SHARED_PREFIX}/rates/{SHARED_PREFIX_RATE}/rate_per_s"),
                0
            ),
            p.num(QUALITY, "workers", 0)
        ),
        format!("{precise_p90} ms, {precise_hits} %"),
        format!("round robin {rr_p90} ms, {rr_hits} %"),
    ];
    s.push_str(&row(p, QUALITY, cells));

    let arm = |a: &str, what: &str| format!("loads/load=2/arms/{a}/{what}");
    let cells = [
        "Mooncake trace at 2× capacity, 3 priority classes: goodput within the TTFT targets, critical requests within theirs".into(),
        format!(
            "{} req/s, {} % holding by class and deadline",
            p.num(ADMISSION, &arm("admission", "goodput_rps"), 1),
            p.pct(ADMISSION, &arm("admission", "classes/critical/attainment"), 0)
        ),
        format!(
            "{} req/s, {} % with today's 503 and retries",
            p.num(ADMISSION, &arm("today", "goodput_rps"), 1),
            p.pct(ADMISSION, &arm("today", "classes/critical/attainment"), 0)
        ),
    ];
    s.push_str(&row(p, ADMISSION, cells));

    let spill =
        |a: &str, what: &str| format!("workloads/name=load_spill/rates/load=0.5/arms/{a}/{what}");
    let cells = [
        format!(
            "load spill (a hot prefix group rotating) on {} simulated GPUs at half their capacity: TTFT p90, prompt tokens no worker computed",
            p.num(PULL, "workers", 0)
        ),
        format!(
            "{} ms, {} % moving the KV to idle workers",
            p.num(PULL, &spill("pulls", "ttft_ms/p90"), 0),
            p.pct(PULL, &spill("pulls", "hit_rate"), 1)
        ),
        format!(
            "{} ms, {} % today; least request {} ms",
            p.num(PULL, &spill("today", "ttft_ms/p90"), 0),
            p.pct(PULL, &spill("today", "hit_rate"), 1),
            p.num(PULL, &spill("least_request", "ttft_ms/p90"), 0)
        ),
    ];
    s.push_str(&row(p, PULL, cells));

    let (figure, split, aggregated) = disagg_cells(p, "2 prefill + 2 decode against 4 aggregated");
    s.push_str(&row(p, DISAGG, [figure, split, aggregated]));

    let cells = [
        "thermal soak, one worker's cooling degraded: hottest GPU after settling".into(),
        format!(
            "{} °C (target {})",
            p.num(THERMAL, "runs/controlled/hottest_gpu_c_after_settling", 1),
            p.num(THERMAL, "target_c", 0)
        ),
        format!(
            "{} °C without, past the slowdown",
            p.num(THERMAL, "runs/uncontrolled/hottest_gpu_c_after_settling", 1)
        ),
    ];
    s.push_str(&row(p, THERMAL, cells));
    s
}

/// The disaggregation row: long prompts on 2P+2D against the aggregated
/// fleet, ITL p90 and goodput.
fn disagg_cells(p: &mut Pen, fleets: &str) -> (String, String, String) {
    let isl = |p: &mut Pen, i: usize| {
        let tokens = p.value(DISAGG, &format!("long_prompt/isl/{i}"));
        p.put(DISAGG, "long_prompt/isl in thousands", tokens / 1024.0, 0)
    };
    let (low, high) = (isl(p, 0), isl(p, 1));
    let ttft_s = p.value(DISAGG, "slo/ttft_ms") / 1e3;
    let ttft_s = p.put(DISAGG, "slo/ttft_ms in seconds", ttft_s, 0);
    let figure = format!(
        "{low}–{high}k-token prompts on 4 simulated GPUs, {fleets}: ITL p90, goodput under TTFT ≤ {ttft_s} s and {} ms a token",
        p.num(DISAGG, "slo/tpot_ms", 0)
    );
    let fleet = |p: &mut Pen, name: &str| {
        format!(
            "{} ms, {} req/s",
            p.num(DISAGG, &format!("fleets/{name}/long_prompt/itl_ms/p90"), 1),
            p.num(
                DISAGG,
                &format!("fleets/{name}/long_prompt/goodput_per_s"),
                2
            )
        )
    };
    let split = fleet(p, "2P+2D");
    let aggregated = format!("{} aggregated", fleet(p, "aggregated"));
    (figure, split, aggregated)
}

/// The report's Summary: its table, and how to read it.
pub fn summary(p: &mut Pen) -> String {
    let mut s = String::from(
        "The figures that matter, each from one file of `bench/results/` (the run column: \
the date, the commit measured, `+` when the tree had uncommitted changes, and whether \
it was a quick run), all on the project's 2-vCPU machine with the load generator, \
Envoy (2 worker threads), the sidecar and the simulated workers sharing those two \
cores. Every figure stands next to a baseline measured in the same run. \
`cargo xtask bench` writes this section from those files after every run, and \
`cargo xtask bench --report` without running one; the sections below have every \
figure of each run.\n\n",
    );
    s.push_str(TABLE_HEAD);
    s.push_str(&overhead_rows(p));
    s.push_str(&kv_rows(p));
    s.push_str(&sidecar_rows(p));
    s.push_str(&shedding_rows(p));
    s.push_str(&quality_rows(p));
    s.push_str(&text_rows(p));
    s.push_str(&fleet_rows(p));
    s.push_str(&how_to_read(p));
    s
}

fn overhead_rows(p: &mut Pen) -> String {
    let mut s = String::new();
    let cells = [
        "filter decision time, a one-word chat (the overhead bench's request; Envoy histogram P50 / P99 over the measured runs)".into(),
        slash(p, OVERHEAD, &["filter_decision_us/P50", "filter_decision_us/P99"], 0, "µs"),
        format!(
            "— (the P99 is scheduler waits: Envoy's workers were preempted {} times a request on the shared cores)",
            p.num(OVERHEAD, "envoy_worker_preemptions_per_request", 2)
        ),
    ];
    s.push_str(&row(p, OVERHEAD, cells));

    let cells = [
        format!(
            "request latency through Envoy, p50 (closed loop ×{}, instant workers, both cores saturated)",
            p.num(OVERHEAD, "concurrency", 0)
        ),
        format!(
            "{} µs (×{})",
            p.num(OVERHEAD, "kvgate_route/p50_us", 0),
            p.num(OVERHEAD, "vs_plain/kvgate/p50_ratio", 2)
        ),
        format!(
            "{} µs plain route; {} µs Envoy least request; {} µs (×{}) the same decision over `ext_proc`",
            p.num(OVERHEAD, "baseline_plain_route/p50_us", 0),
            p.num(OVERHEAD, "least_request_route/p50_us", 0),
            p.num(OVERHEAD, "extproc_route/p50_us", 0),
            p.num(OVERHEAD, "vs_plain/extproc/p50_ratio", 2)
        ),
    ];
    s.push_str(&row(p, OVERHEAD, cells));

    let cells = [
        "throughput through Envoy, same loop".into(),
        format!(
            "{} req/s (×{})",
            p.num(OVERHEAD, "kvgate_route/rps", 0),
            p.num(OVERHEAD, "vs_plain/kvgate/throughput_ratio", 2)
        ),
        format!(
            "{} req/s plain route; least request ×{}; over `ext_proc` ×{}",
            p.num(OVERHEAD, "baseline_plain_route/rps", 0),
            p.num(OVERHEAD, "vs_plain/least_request/throughput_ratio", 2),
            p.num(OVERHEAD, "vs_plain/extproc/throughput_ratio", 2)
        ),
    ];
    s.push_str(&row(p, OVERHEAD, cells));

    let cpu = "cpu_us_per_request";
    let cells = [
        "CPU per request: Envoy / sidecar (same loop)".into(),
        slash(
            p,
            OVERHEAD,
            &[
                &format!("{cpu}/kvgate/envoy"),
                &format!("{cpu}/kvgate/sidecar"),
            ],
            0,
            "µs",
        ),
        format!(
            "{} / {} µs plain route; over `ext_proc` {} µs Envoy + {} µs the picker",
            p.num(OVERHEAD, &format!("{cpu}/plain/envoy"), 0),
            p.num(OVERHEAD, &format!("{cpu}/plain/sidecar"), 0),
            p.num(OVERHEAD, &format!("{cpu}/extproc/envoy"), 0),
            p.num(OVERHEAD, &format!("{cpu}/extproc/extproc"), 0)
        ),
    ];
    s.push_str(&row(p, OVERHEAD, cells));

    let (streamed, one_piece) = streaming(p);
    let cells = [
        "a response streamed in 256 chunks: CPU the filter adds on Envoy's worker threads (same run)".into(),
        format!("{streamed} µs"),
        format!("{one_piece} µs for the same response in one piece"),
    ];
    s.push_str(&row(p, OVERHEAD, cells));

    let long = long_prompt_cost(p);
    let cells = [
        "long prompts, 128k token ids: routing CPU per 100k-token request (Envoy + sidecar over the plain route; same run)".into(),
        long.kvgate.clone(),
        long.llmd_cell(),
    ];
    s.push_str(&row(p, OVERHEAD, cells));

    let (this, before) = slopes(p);
    let rev = p.baseline(OVERHEAD);
    let cells = [
        "routing on Envoy's worker threads per 1k prompt tokens, 1k to 128k (the line through five lengths; same run)".into(),
        this,
        format!(
            "the baseline build ({rev}) in the same run: {before}; target ≤ {} µs",
            p.stated("10", "routing per 1k prompt tokens target")
        ),
    ];
    s.push_str(&row(p, OVERHEAD, cells));
    s
}

fn kv_rows(p: &mut Pen) -> String {
    let mut s = String::new();
    let size = index_size(p);
    let (per_turn, turns) = turn_sizes(p, KV, "decision_turns/kvgate/paced");
    let rev = p.baseline(KV);
    let now = "decision_turns/kvgate";
    let before = "decision_turns/baseline";
    let cells = [
        format!(
            "the whole decision on a 2k-token prompt in Envoy, token ids, {size}-block index (Envoy histogram, {turns} turns of {per_turn} requests at each pace, the builds alternating in one Envoy): back to back / paced, P50 [spread] / P99"
        ),
        format!(
            "{}; {}",
            turns_cell(p, KV, &format!("{now}/back_to_back")),
            turns_cell(p, KV, &format!("{now}/paced"))
        ),
        format!(
            "{rev}, same Envoy: {}; {}; target ≤ {} µs P50",
            turns_cell(p, KV, &format!("{before}/back_to_back")),
            turns_cell(p, KV, &format!("{before}/paced")),
            p.stated("30", "whole decision P50 target")
        ),
    ];
    s.push_str(&row(p, KV, cells));

    let [selection, target] = selection_cells(p);
    let cells = [
        format!(
            "selection with a {size}-block index, 2k-token prompts (Envoy histogram P50 / P99)"
        ),
        selection,
        target,
    ];
    s.push_str(&row(p, KV, cells));

    let cells = [
        "requests routed to the worker holding their prefix".into(),
        format!(
            "{} of {}",
            p.num(KV, "routed_to_prefix_holder", 0),
            p.num(KV, "requests", 0)
        ),
        "—".into(),
    ];
    s.push_str(&row(p, KV, cells));

    let [fresh, target] = freshness_cells(p);
    let cells = [
        format!(
            "KV event published → decisions follow it (p50 / p99, {} samples)",
            p.num(KV, "freshness_samples", 0)
        ),
        fresh,
        target,
    ];
    s.push_str(&row(p, KV, cells));

    let cells = [
        format!("Envoy memory growth for {size} indexed blocks, 2 worker threads"),
        format!("{} MiB", p.num(KV, "envoy_rss_growth_mib", 1)),
        format!(
            "target ≤ {} MiB",
            p.stated("64", "Envoy memory growth target")
        ),
    ];
    s.push_str(&row(p, KV, cells));

    let api = "selection_api";
    let call = |p: &mut Pen, name: &str| {
        format!(
            "{} / {} µs, {} µs",
            p.num(KV, &format!("{api}/{name}/p50_us"), 0),
            p.num(KV, &format!("{api}/{name}/p99_us"), 0),
            p.num(KV, &format!("{api}/{name}/sidecar_cpu_us_per_call"), 0)
        )
    };
    let hashes = call(p, "select_sequence_hashes");
    let ids = call(p, "select_token_ids");
    let cells = [
        format!(
            "selection API over loopback HTTP, same index, {}-token prompts as `sequence_hashes`: `/select` p50 / p99, sidecar CPU per call",
            p.num(KV, &format!("{api}/prompt_tokens"), 0)
        ),
        format!(
            "{hashes} ({} selections per core-second)",
            p.num(
                KV,
                &format!("{api}/select_sequence_hashes/per_core_second"),
                0
            )
        ),
        format!(
            "target p50 ≤ {} µs, ≥ 10000 per core-second; as `token_ids` hashed by kvgate {ids}",
            p.stated("100", "selection API p50 target")
        ),
    ];
    s.push_str(&row(p, KV, cells));

    let reserve = call(p, "select_and_reserve");
    let cells = [
        "`/select_and_reserve`, same".into(),
        format!(
            "{reserve} ({} per core-second)",
            p.num(KV, &format!("{api}/select_and_reserve/per_core_second"), 0)
        ),
        "same targets".into(),
    ];
    s.push_str(&row(p, KV, cells));
    s
}

fn sidecar_rows(p: &mut Pen) -> String {
    let mut s = String::new();
    let cells = [
        format!(
            "replica sync: a peer counts a new admission / its free, p50 / p99, under {} admissions a second",
            p.num(SYNC, "background_admissions_per_s", 0)
        ),
        format!(
            "{} / {} ms, {} / {} ms, {} dropped",
            p.num(SYNC, "admission_ms_p50", 1),
            p.num(SYNC, "admission_ms_p99", 1),
            p.num(SYNC, "free_ms_p50", 1),
            p.num(SYNC, "free_ms_p99", 1),
            p.num(SYNC, "dropped_events", 0)
        ),
        "—".into(),
    ];
    s.push_str(&row(p, SYNC, cells));

    let cells = [
        "KV event ingest, one thread (decode + hash + index)".into(),
        format!("{} blocks/s", p.millions(INGEST, "ingest_blocks_per_s", 2)),
        format!(
            "{} generic msgpack decode alone (×{}); target {}",
            p.millions(INGEST, "baseline_rmpv_decode_blocks_per_s", 2),
            p.num(INGEST, "ratio_ingest_vs_baseline_decode", 2),
            p.stated("2", "ingest target, millions of blocks a second") + "M"
        ),
    ];
    s.push_str(&row(p, INGEST, cells));

    let cells = [
        "sidecar memory per indexed block".into(),
        format!("{} bytes", p.num(INGEST, "sidecar_heap_bytes_per_block", 0)),
        "—".into(),
    ];
    s.push_str(&row(p, INGEST, cells));

    let size = p.millions(DUMP, "in_process/blocks", 2);
    let bytes = p.value(DUMP, "in_process/dump_bytes") / 1e6;
    let cells = [
        format!(
            "`GET /dump` of {size} blocks; a new sidecar's recovery from it (fetch + decode + replay, loopback)"
        ),
        format!(
            "{} MB; {} ms",
            p.put(DUMP, "in_process/dump_bytes in MB", bytes, 1),
            p.num(DUMP, "over_http/recovery_ms", 0)
        ),
        format!(
            "index thread busy {} ms copying its tables for the dump",
            p.num(DUMP, "in_process/copy_ms", 1)
        ),
    ];
    s.push_str(&row(p, DUMP, cells));
    s
}

fn shedding_rows(p: &mut Pen) -> String {
    let mut s = String::new();
    let busy = "reply_latency/busy_503_through_envoy";
    let pass = "reply_latency/baseline_pass_through";
    let cells = [
        "busy 503 answered by the filter, p50 / p99".into(),
        slash(
            p,
            SHEDDING,
            &[&format!("{busy}/p50_us"), &format!("{busy}/p99_us")],
            0,
            "µs",
        ),
        format!(
            "{} / {} µs pass-through round trip to an instant worker (×{})",
            p.num(SHEDDING, &format!("{pass}/p50_us"), 0),
            p.num(SHEDDING, &format!("{pass}/p99_us"), 0),
            p.ratio(
                SHEDDING,
                &format!("{busy}/p50_us"),
                &format!("{pass}/p50_us"),
                2
            )
        ),
    ];
    s.push_str(&row(p, SHEDDING, cells));

    let on = "overload/shedding_on";
    let off = "overload/baseline_shedding_off";
    let ttft = |p: &mut Pen, at: &str| {
        slash(
            p,
            SHEDDING,
            &[
                &format!("{at}/ttft_ms_p50"),
                &format!("{at}/ttft_ms_p90"),
                &format!("{at}/ttft_ms_p99"),
            ],
            0,
            "ms",
        )
    };
    let cells = [
        format!(
            "admitted TTFT p50 / p90 / p99 at {}× capacity ({} req/s offered, about {} req/s served, {} s)",
            p.ratio(
                SHEDDING,
                "overload/rate_per_s",
                "overload/estimated_capacity_per_s",
                0
            ),
            p.num(SHEDDING, "overload/rate_per_s", 0),
            p.num(SHEDDING, "overload/estimated_capacity_per_s", 0),
            p.num(SHEDDING, "overload/seconds", 0)
        ),
        format!(
            "{} with shedding ({} % shed)",
            ttft(p, on),
            p.pct(SHEDDING, &format!("{on}/shed_rate"), 0)
        ),
        format!("{} without, same arrivals", ttft(p, off)),
    ];
    s.push_str(&row(p, SHEDDING, cells));

    let retry = "overload/retry_after";
    let cells = [
        "Retry-After under sustained overload: retries made at the advertised time, during the overload, that were admitted".into(),
        format!(
            "{} of {} ({} %); advertised p50 {} s, max {} s",
            p.num(SHEDDING, &format!("{retry}/retries_admitted"), 0),
            p.num(SHEDDING, &format!("{retry}/retries_in_overload"), 0),
            p.pct(SHEDDING, &format!("{retry}/admitted_share"), 0),
            p.num(SHEDDING, &format!("{retry}/retry_after_s_p50"), 0),
            p.num(SHEDDING, &format!("{retry}/retry_after_s_max"), 0)
        ),
        format!("target ≥ {} %", p.stated("80", "retries admitted target")),
    ];
    s.push_str(&row(p, SHEDDING, cells));
    s
}

fn quality_rows(p: &mut Pen) -> String {
    let mut s = String::new();
    let at = |policy: &str| format!("{SHARED_PREFIX}/rates/{SHARED_PREFIX_RATE}/policies/{policy}");
    let rps =
        |p: &mut Pen, policy: &str| p.num(QUALITY, &format!("{}/throughput_rps", at(policy)), 1);
    let (precise_p90, precise_hits) =
        quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "precise");
    let precise_rps = rps(p, "precise");
    let (credit_p90, credit_hits) =
        quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "precise_credit_1");
    let (approx_p90, approx_hits) =
        quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "approximate");
    let (rr_p90, rr_hits) = quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "round_robin");
    let rr_rps = rps(p, "round_robin");
    let (lr_p90, lr_hits) = quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "least_request");
    let lr_rps = rps(p, "least_request");
    let cells = [
        format!(
            "shared-prefix workload at {} req/s, {} workers: TTFT p90, prefix hit rate, throughput",
            p.num(
                QUALITY,
                &format!("{SHARED_PREFIX}/rates/{SHARED_PREFIX_RATE}/rate_per_s"),
                0
            ),
            p.num(QUALITY, "workers", 0)
        ),
        format!("{precise_p90} ms, {precise_hits} %, {precise_rps} req/s (precise)"),
        format!(
            "Dynamo's `overlap_credit` 1.0: {credit_p90} ms, {credit_hits} %; approximate (text) {approx_p90} ms, {approx_hits} %; round robin {rr_p90} ms, {rr_hits} %, {rr_rps} req/s; Envoy least-request {lr_p90} ms, {lr_hits} %, {lr_rps} req/s"
        ),
    ];
    s.push_str(&row(p, QUALITY, cells));

    let mooncake = |p: &mut Pen, policy: &str| {
        let at = format!("{MOONCAKE}/rates/{MOONCAKE_RATE}/policies/{policy}");
        format!(
            "{} / {} ms, {} %",
            p.num(QUALITY, &format!("{at}/ttft_ms/p50"), 0),
            p.num(QUALITY, &format!("{at}/ttft_ms/p90"), 0),
            p.pct(QUALITY, &format!("{at}/hit_rate"), 1)
        )
    };
    let precise = mooncake(p, "precise");
    let credit = mooncake(p, "precise_credit_1");
    let rr = mooncake(p, "round_robin");
    let lr = mooncake(p, "least_request");
    let cells = [
        format!(
            "Mooncake conversation trace at {} req/s: TTFT p50 / p90, hit rate (same run)",
            p.num(
                QUALITY,
                &format!("{MOONCAKE}/rates/{MOONCAKE_RATE}/rate_per_s"),
                0
            )
        ),
        format!("{precise} (precise)"),
        format!("Dynamo's `overlap_credit` 1.0: {credit}; round robin {rr}; least-request {lr}"),
    ];
    s.push_str(&row(p, QUALITY, cells));
    s
}

fn text_rows(p: &mut Pen) -> String {
    let mut s = String::new();
    let rev = p.baseline(TEXT);
    let (per_turn, turns) = turn_sizes(p, TEXT, "cost/policies/precise_text/chat/kvgate/paced");
    let sides = |p: &mut Pen, kind: &str, build: &str| {
        let side = |p: &mut Pen, policy: &str| {
            let at = format!("cost/policies/{policy}/{kind}/{build}");
            format!(
                "{}, {}",
                turns_cell(p, TEXT, &format!("{at}/back_to_back")),
                turns_cell(p, TEXT, &format!("{at}/paced"))
            )
        };
        (side(p, "precise_text"), side(p, "approximate"))
    };
    let (precise, approximate) = sides(p, "chat", "kvgate");
    let (precise_before, approximate_before) = sides(p, "chat", "baseline");
    let cells = [
        format!(
            "the whole decision on a {}-token chat in Envoy (Envoy histogram, {turns} turns of {per_turn} requests at each pace, the builds alternating in one Envoy): back to back, paced, P50 [spread] / P99",
            p.num(TEXT, "cost/prompt_tokens", 0)
        ),
        format!("precise text {precise}; approximate {approximate}"),
        format!(
            "{rev}, same Envoy: precise {precise_before}; approximate {approximate_before}; target ≤ {} µs P50",
            p.stated("30", "whole decision P50 target")
        ),
    ];
    s.push_str(&row(p, TEXT, cells));

    let (precise, approximate) = sides(p, "text", "kvgate");
    let (precise_before, approximate_before) = sides(p, "text", "baseline");
    let cells = [
        "the same words as a text completion, same run".into(),
        format!("precise text {precise}; approximate {approximate}"),
        format!("{rev}: {precise_before}; {approximate_before}"),
    ];
    s.push_str(&row(p, TEXT, cells));

    let w = "workloads/name=chat_shared_prefix";
    let policy = |p: &mut Pen, name: &str| {
        format!(
            "{} %, {} ms",
            p.pct(TEXT, &format!("{w}/policies/{name}/hit_rate"), 1),
            p.num(TEXT, &format!("{w}/policies/{name}/ttft_ms/p90"), 0)
        )
    };
    let (text, tokens, approximate) = (
        policy(p, "precise_text"),
        policy(p, "precise_token"),
        policy(p, "approximate"),
    );
    let cells = [
        format!(
            "chat shared-prefix workload at about twice what the fleet's caches hold ({} KV blocks a worker, {} req/s): prefix hit rate, TTFT p90",
            p.num(TEXT, &format!("{w}/kv_blocks_per_worker"), 0),
            p.num(TEXT, &format!("{w}/rate_per_s"), 0)
        ),
        format!("{text} (precise text)"),
        format!(
            "precise tokens {tokens}; approximate {approximate}; offline reference {} %",
            p.pct(TEXT, &format!("{w}/reference_hit_rate"), 1)
        ),
    ];
    s.push_str(&row(p, TEXT, cells));

    let rss = |p: &mut Pen, policy: &str| {
        slash(
            p,
            TEXT,
            &[
                &format!("cost/policies/{policy}/envoy_rss_mb"),
                &format!("cost/policies/{policy}/sidecar_rss_mb"),
            ],
            0,
            "MB",
        )
    };
    let cells = [
        "memory with the text index and the tokenizer's vocabulary: Envoy / sidecar RSS".into(),
        rss(p, "precise_text"),
        format!("{} without (the approximate run)", rss(p, "approximate")),
    ];
    s.push_str(&row(p, TEXT, cells));
    s
}

fn fleet_rows(p: &mut Pen) -> String {
    let mut s = String::new();
    let (figure, split, aggregated) = disagg_cells(p, "2P+2D against 4 aggregated");
    s.push_str(&row(p, DISAGG, [figure, split, aggregated]));

    let cells = [
        format!(
            "thermal soak: {} workers at {} req/s, one worker's cooling degraded at {} s; hottest GPU after settling, throttle entries per worker per minute, goodput",
            p.num(THERMAL, "workers", 0),
            p.num(THERMAL, "rate_per_s", 0),
            p.num(THERMAL, "degrade_at_s", 0)
        ),
        format!(
            "{} °C (target {}), {}, {} tok/s with control",
            p.num(THERMAL, "runs/controlled/hottest_gpu_c_after_settling", 1),
            p.num(THERMAL, "target_c", 0),
            p.num(
                THERMAL,
                "runs/controlled/throttle_entries_per_worker_per_minute_max",
                2
            ),
            p.num(THERMAL, "runs/controlled/goodput_tokens_per_s", 0)
        ),
        format!(
            "{} °C without: past the {} °C slowdown; goodput ×{}; TTFT p99 with control idle / off ×{}",
            p.num(THERMAL, "runs/uncontrolled/hottest_gpu_c_after_settling", 1),
            p.num(THERMAL, "slowdown_c", 0),
            p.num(THERMAL, "goodput_ratio_controlled_vs_uncontrolled", 3),
            p.num(THERMAL, "ttft_p99_ratio_idle_on_vs_off", 3)
        ),
    ];
    s.push_str(&row(p, THERMAL, cells));

    let fleet = |p: &mut Pen, run: &str| {
        let replicas = p.value(PLANNER, &format!("runs/{run}/replica_seconds"))
            / p.value(PLANNER, &format!("runs/{run}/seconds"));
        format!(
            "({}): {} %, {}",
            p.put(PLANNER, "replica_seconds / seconds", replicas, 0),
            p.pct(PLANNER, &format!("runs/{run}/sla_attainment"), 1),
            p.num(PLANNER, &format!("runs/{run}/replica_seconds"), 0)
        )
    };
    let (peak, mean) = (fleet(p, "static_peak"), fleet(p, "static_mean"));
    let cells = [
        format!(
            "planner closed loop: {base} → {} → {base} req/s over {} s, SLA TTFT {} ms and ITL {} ms, {} s model load; SLA attainment, replica-seconds",
            p.num(PLANNER, "peak_rate", 0),
            p.num(PLANNER, "seconds", 0),
            p.num(PLANNER, "ttft_sla_ms", 0),
            p.num(PLANNER, "itl_sla_ms", 0),
            p.num(PLANNER, "startup_s", 0),
            base = p.num(PLANNER, "base_rate", 0),
        ),
        format!(
            "{} %, {} ({} scaling actions)",
            p.pct(PLANNER, "runs/planner/sla_attainment", 1),
            p.num(PLANNER, "runs/planner/replica_seconds", 0),
            p.num(PLANNER, "runs/planner/scaling_actions", 0)
        ),
        format!("fleet fixed for the peak {peak}; for the mean {mean}"),
    ];
    s.push_str(&row(p, PLANNER, cells));

    let mape = |p: &mut Pen, predictor: &str| {
        let at = format!("predictors/mape_pct/{predictor}");
        slash(
            p,
            PLANNER,
            &[
                &format!("{at}/requests"),
                &format!("{at}/isl"),
                &format!("{at}/osl"),
            ],
            1,
            "%",
        )
    };
    let (arima, kalman, seasonal, constant) = (
        mape(p, "arima"),
        mape(p, "kalman"),
        mape(p, "seasonal"),
        mape(p, "constant"),
    );
    let cells = [
        "planner predictors, one-step MAPE on the Mooncake trace per minute (requests / ISL / OSL)"
            .into(),
        format!("ARIMA (the default) {arima}; Kalman {kalman}; seasonal {seasonal}"),
        format!("constant {constant}"),
    ];
    s.push_str(&row(p, PLANNER, cells));
    s
}

/// What the rows mean, and where they mislead.
fn how_to_read(p: &mut Pen) -> String {
    let cpu = "cpu_us_per_request";
    let extra = p.value(OVERHEAD, &format!("{cpu}/kvgate/envoy"))
        - p.value(OVERHEAD, &format!("{cpu}/plain/envoy"));
    let extra = p.put(OVERHEAD, "Envoy CPU, kvgate route minus plain", extra, 0);
    let decision = p.num(OVERHEAD, "filter_decision_us/P50", 0);
    let extproc = p.num(OVERHEAD, "vs_plain/extproc/throughput_ratio", 2);

    let controlled = p.num(THERMAL, "runs/controlled/ttft_ms_p99", 0);
    let uncontrolled = p.num(THERMAL, "runs/uncontrolled/ttft_ms_p99", 0);

    let saved = 1.0
        - p.value(PLANNER, "runs/planner/replica_seconds")
            / p.value(PLANNER, "runs/static_peak/replica_seconds");
    let saved = p.put(
        PLANNER,
        "1 − planner / static_peak replica-seconds",
        saved * 100.0,
        0,
    );
    let attained = p.pct(PLANNER, "runs/planner/sla_attainment", 1);
    let downs = p.num(PLANNER, "runs/planner/scale_downs_after_peak", 0);
    let sensitivity = p.num(PLANNER, "sensitivity", 1);
    let before = "runs/planner_sensitivity_0.6";
    let attained_before = p.pct(PLANNER, &format!("{before}/sla_attainment"), 1);
    let downs_before = p.num(PLANNER, &format!("{before}/scale_downs_after_peak"), 0);
    let line_before = p.value(PLANNER, "itl_sla_ms") * 0.6;
    let line_before = p.put(PLANNER, "itl_sla_ms × 0.6", line_before, 1);
    let split_attained = p.pct(PLANNER, "split/runs/planner_split/sla_attainment", 1);
    let split_static = p.pct(PLANNER, "split/runs/static_split/sla_attainment", 1);
    let split_saved = 1.0
        - p.value(PLANNER, "split/runs/planner_split/replica_seconds")
            / p.value(PLANNER, "split/runs/static_split/replica_seconds");
    let split_saved = p.put(
        PLANNER,
        "1 − disaggregated planner / static split replica-seconds",
        split_saved * 100.0,
        0,
    );

    let ideal = p.pct(QUALITY, &format!("{MOONCAKE}/ideal_hit_rate"), 1);
    let reference = p.pct(QUALITY, &format!("{MOONCAKE}/reference_hit_rate"), 1);
    let low_rate = "rate_per_s=8";
    let low = p.num(
        QUALITY,
        &format!("{MOONCAKE}/rates/{low_rate}/rate_per_s"),
        0,
    );
    let precise_low = p.pct(
        QUALITY,
        &format!("{MOONCAKE}/rates/{low_rate}/policies/precise/hit_rate"),
        1,
    );
    let of_reference = p.value(
        QUALITY,
        &format!("{MOONCAKE}/rates/{low_rate}/policies/precise/hit_rate"),
    ) / p.value(QUALITY, &format!("{MOONCAKE}/reference_hit_rate"));
    let of_reference = p.put(
        QUALITY,
        "precise hit rate / reference",
        of_reference * 100.0,
        0,
    );
    let shared_reference = p.pct(QUALITY, &format!("{SHARED_PREFIX}/reference_hit_rate"), 1);

    let (p90, hits) = quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "precise");
    let (credit_p90, credit_hits) =
        quality_cells(p, SHARED_PREFIX, SHARED_PREFIX_RATE, "precise_credit_1");
    let shared_rate = p.num(
        QUALITY,
        &format!("{SHARED_PREFIX}/rates/{SHARED_PREFIX_RATE}/rate_per_s"),
        0,
    );
    let mooncake_at = format!("{MOONCAKE}/rates/{MOONCAKE_RATE}");
    let mooncake_rate = p.num(QUALITY, &format!("{mooncake_at}/rate_per_s"), 0);
    let mooncake_hits = p.pct(
        QUALITY,
        &format!("{mooncake_at}/policies/precise/hit_rate"),
        1,
    );
    let mooncake_credit = p.pct(
        QUALITY,
        &format!("{mooncake_at}/policies/precise_credit_1/hit_rate"),
        1,
    );

    let w = "workloads/name=chat_shared_prefix/policies";
    let shares: Vec<f64> = ["approximate", "precise_text", "precise_token"]
        .iter()
        .map(|policy| p.value(TEXT, &format!("{w}/{policy}/of_reference")))
        .collect();
    let lowest = shares.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = shares.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lowest = p.put(
        TEXT,
        "least of_reference of the chat policies",
        lowest * 100.0,
        0,
    );
    let highest = p.put(
        TEXT,
        "most of_reference of the chat policies",
        highest * 100.0,
        0,
    );

    format!(
        "\nHow to read them:\n\n\
* The closed-loop overhead rows saturate both cores, so they measure CPU per request, not \
added latency on an idle path; compare rows of one run (this machine's speed varies between \
runs). Envoy spends {extra} µs more per request on the kvgate route than on the plain one, \
of which the decision itself is {decision} µs at P50; where the rest goes: \
[architecture.md](../docs/architecture.md#per-request-cost-why-the-decision-stays-in-envoy). \
The same decision made outside Envoy over `ext_proc`, as the peers make it, leaves ×{extproc} \
of the plain route's throughput: the gRPC stream per request costs more than the decision.\n\
* Added CPU by request shape is kvgate's route minus the plain one over the same requests, \
so on the text and chat rows, where the simulated engine's tokenizer and the sidecar's \
indexing weigh most, it moves by more than the filter's own cost from run to run; the \
worker-thread length curve is the steadier figure \
([the section](#by-request-shape-streamed-responses-and-long-prompts)).\n\
* Thermal: control holds the degraded worker at its target by capping it, and its share \
moves to the other three, which then run nearer saturation (TTFT p99 {controlled} ms with \
control against {uncontrolled} ms without at this load, where the uncontrolled worker slows \
down but keeps its share). What control buys is GPUs kept out of the slowdown and its \
jitter, not lower latency at a fixed load on a smaller fleet.\n\
* Planner: on the 4× ramp, with a profile measured in the same run and sensitivity \
{sensitivity}, it used {saved} % fewer replica-seconds than the fleet sized for the peak, \
met the SLA for {attained} % of requests and scaled down {downs} times after the peak. At \
sensitivity 0.6, the setting before, it met it for {attained_before} % and scaled down \
{downs_before} times: its scale-down line ({line_before} ms) lies under what a replica shows at \
the base rate ([planner.md](../docs/planner.md#choosing-the-sensitivity)). Disaggregated, \
as prompts grow eightfold at a steady rate, the planner sized the prefill and decode pools \
apart with {split_saved} % fewer replica-seconds than a static split sized for the peak, \
meeting the SLA for {split_attained} % of requests against its {split_static} %.\n\
* Routing quality uses `kvgate-sim` with one prefill at a time per worker (an engine's \
shared compute), so queued prefill is what a request waits behind. On the Mooncake trace \
the ideal hit rate (infinite cache) is {ideal} %, and routing with perfect knowledge \
through the same caches (an offline replay, load ignored) reaches {reference} %: the cache \
size explains most of the gap; precise reaches {precise_low} % at {low} req/s \
({of_reference} % of that reference). On the shared-prefix workload the reference is \
{shared_reference} %.\n\
* `overlap_credit` defaults to 3.0, not Dynamo's 1.0: the cost's balance of cache against \
load decides heavy pressure, not what the router remembers. Shared prefix at {shared_rate} \
req/s: {hits} against {credit_hits} % hit rate, TTFT p90 {p90} against {credit_p90} ms; \
Mooncake at {mooncake_rate} req/s: {mooncake_hits} against {mooncake_credit} %. How it was \
found: [bench/notes/text-routing.md](notes/text-routing.md#routing-quality).\n\
* Chat and text prompts route about as well as token prompts of the same requests; at \
about twice what the fleet holds every policy is at {lowest}–{highest} % of the offline \
reference.\n"
    )
}

/// architecture.md's per-request cost, as the overhead bench measured it.
pub fn cost(p: &mut Pen) -> String {
    let cpu = "cpu_us_per_request";
    let run = p.run(OVERHEAD);
    let concurrency = p.num(OVERHEAD, "concurrency", 0);
    let plain = p.num(OVERHEAD, &format!("{cpu}/plain/envoy"), 0);
    let kvgate = p.num(OVERHEAD, &format!("{cpu}/kvgate/envoy"), 0);
    let extproc = p.num(OVERHEAD, &format!("{cpu}/extproc/envoy"), 0);
    let picker = p.num(OVERHEAD, &format!("{cpu}/extproc/extproc"), 0);
    let in_proxy = p.num(OVERHEAD, "vs_plain/kvgate/throughput_ratio", 2);
    let out_of_proxy = p.num(OVERHEAD, "vs_plain/extproc/throughput_ratio", 2);
    let p50 = p.num(OVERHEAD, "filter_decision_us/P50", 0);
    let p99 = p.num(OVERHEAD, "filter_decision_us/P99", 0);
    let preempted = p.num(OVERHEAD, "envoy_worker_preemptions_per_request", 2);
    let (streamed, one_piece) = streaming(p);
    let (this, _) = slopes(p);
    let long = long_prompt_cost(p);
    let against = match &long.times_less {
        Some(t) => format!(
            ", {t}× less than the {} core-seconds a request reported for llm-d's router",
            long.llmd
        ),
        None => String::new(),
    };
    let long = long.kvgate;
    format!(
        "Measured with `cargo xtask bench --only overhead` (run {run}; 2 vCPU, Envoy 1.40, 2 \
worker threads, closed loop of {concurrency}, four routes of one Envoy in one run; every \
figure in [bench/report.md](../bench/report.md#summary)): per request, Envoy spends \
{plain} µs of CPU on the plain route and {kvgate} µs with the filter; the same decision \
made by an endpoint picker behind `ext_proc` (`examples/extproc`: tonic, Envoy's gRPC \
client, request headers + buffered body + response headers crossing) costs Envoy \
{extproc} µs and the picker {picker} µs more. Throughput against the plain route: \
×{in_proxy} in-proxy, ×{out_of_proxy} over `ext_proc`. The gRPC stream per request (its \
frames, the protobuf on both sides, the picker's own HTTP/2 server and wake-ups) costs \
more than the whole decision, which is {p50} µs at P50 in the VM. Its P99, {p99} µs, is \
the scheduler's, not the code's: on two cores shared by Envoy, the sidecar, the simulated \
workers and the load generator, Envoy's worker threads were preempted {preempted} times a \
request, so a few percent of decision windows include a wait for the CPU.\n\n\
By request shape (same run): a response streamed in 256 chunks costs the filter \
{streamed} µs on Envoy's worker threads against {one_piece} µs for the same response in \
one piece (the body callback returns at once after the first chunk); what a stream adds \
is the main thread's and the sidecar's per-interval work spread over fewer requests a \
second. Long prompts: the filter's part on Envoy's worker threads per 1k prompt \
tokens, from 1k to 128k (the length curve's slopes), is {this}. Routing a 128k-token \
prompt of token ids takes, scaled to 100k tokens, {long}{against}.\n"
    )
}
