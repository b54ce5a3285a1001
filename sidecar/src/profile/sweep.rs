//! The sweep: for each point, the unloaded figures first, then the rate
//! search, each step an open loop of Poisson arrivals judged by the SLA.
//!
//! A step passes when no request failed, the p90 TTFT (roles `both` and
//! `prefill`) and the p90 ITL (`both` and `decode`) are within the SLA,
//! and the worker kept up: its completions came at least 90 % as fast as
//! the arrivals did. Each step sends `n = max(min_requests, rate × step)`
//! requests at Poisson arrival times over `n / rate` seconds. A step that
//! can no longer pass (a request failed, more than a tenth already missed
//! the TTFT, the in-flight cap was reached) stops at once and drops what
//! it has in flight, and the next step waits until a lone request is as
//! fast as unloaded again.
//!
//! A step must last long against the TTFT limit: a rate a little over
//! what the worker serves builds its backlog slowly, and a step too short
//! for that backlog to exceed the limit passes it (the 20 s default is
//! forty times a 500 ms limit).
//!
//! Time: each point takes its calibration (four requests, one at a time),
//! then at most [`RateSearch::max_steps`] steps. A step's arrivals span
//! about `max(step, min_requests / rate)`, and the rate never falls below
//! a quarter of the start, which is at least `min_requests / step`: so at
//! most four steps' time, plus the last requests' drain (each bounded by
//! the request timeout), plus a settle of at most 30 s after a step that
//! stopped early.

use super::client::{Client, Failure, Lateness, Sample};
use super::search::RateSearch;
use super::{ProfileError, SweepOptions};
use crate::config::ProfileRow;
use kvgate_core::Role;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Requests sent one at a time before a point's search: the first warms
/// the worker up (a cold engine's first request is slow) and is not
/// counted; the rest give the unloaded figures.
const CALIBRATION: usize = 4;
/// One calibration request's limit: a cold worker may be slow.
const CALIBRATION_TIMEOUT: Duration = Duration::from_secs(120);
/// A failing start rate is halved at most this many times.
const HALVINGS: u32 = 2;
/// Completions must come at least this share of the arrivals' rate.
const KEEP_UP: f64 = 0.9;
/// Completions a step needs before its completion rate is judged.
const MIN_FOR_RATE: usize = 5;
/// Requests one step sends at most, whatever the rate and step asked.
const MAX_STEP_REQUESTS: usize = 200_000;
/// The longest wait for the worker to be fast again after a step that
/// stopped early.
const SETTLE: Duration = Duration::from_secs(30);

/// A sweep's outcome: the rows, and what the operator should know of the
/// points that gave none or hit the rate cap.
#[derive(Debug, Clone, Default)]
pub struct Sweep {
    pub rows: Vec<ProfileRow>,
    pub notes: Vec<String>,
}

/// Sweeps every point of `opts`: one row per point that met the SLA at
/// some rate. Points that miss it even one request at a time are left
/// out (and logged); if all do, [`ProfileError::NothingMet`].
pub async fn sweep(opts: &SweepOptions) -> Result<Vec<ProfileRow>, ProfileError> {
    run(opts).await.map(|s| s.rows)
}

/// [`sweep`], with the notes on the points.
pub async fn run(opts: &SweepOptions) -> Result<Sweep, ProfileError> {
    opts.validate()?;
    let client = Arc::new(
        Client::new(&opts.endpoint, &opts.model, opts.max_in_flight)
            .map_err(ProfileError::Options)?,
    );
    let mut rng = StdRng::seed_from_u64(rand::random());
    let points = opts.points();
    tracing::info!(
        endpoint = %opts.endpoint,
        model = %opts.model,
        role = opts.role.as_str(),
        points = points.len(),
        step_s = opts.step.as_secs_f64(),
        max_rps = opts.max_rps,
        "profile sweep"
    );
    let started = Instant::now();
    let mut out = Sweep::default();
    for (isl, osl) in points {
        let p = Point {
            isl,
            osl,
            max_tokens: if opts.role == Role::Prefill { 1 } else { osl },
        };
        match profile_point(&client, opts, p, &mut rng).await? {
            (Some(row), note) => {
                out.rows.push(row);
                out.notes.extend(note);
            }
            (None, note) => out.notes.extend(note),
        }
    }
    tracing::info!(
        elapsed_s = started.elapsed().as_secs_f64(),
        rows = out.rows.len(),
        "profile sweep done"
    );
    if out.rows.is_empty() {
        return Err(ProfileError::NothingMet);
    }
    Ok(out)
}

#[derive(Debug, Clone, Copy)]
struct Point {
    isl: u32,
    /// The row's osl: 0 for `prefill`.
    osl: u32,
    max_tokens: u32,
}

impl std::fmt::Display for Point {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "isl {} osl {}", self.isl, self.osl)
    }
}

/// A point's figures one request at a time (the slowest of the counted).
#[derive(Debug, Clone, Copy)]
struct Unloaded {
    ttft: Duration,
    itl: Option<Duration>,
    latency: Duration,
}

async fn profile_point(
    client: &Arc<Client>,
    opts: &SweepOptions,
    p: Point,
    rng: &mut StdRng,
) -> Result<(Option<ProfileRow>, Option<String>), ProfileError> {
    let idle = calibrate(client, opts, p, rng).await?;
    tracing::info!(
        "{p}: unloaded TTFT {:.1} ms, ITL {}, {:.1} ms a request",
        ms(idle.ttft),
        idle.itl.map_or("-".into(), |i| format!("{:.2} ms", ms(i))),
        ms(idle.latency)
    );
    let judge_ttft = opts.ttft_ms.filter(|_| opts.role != Role::Decode);
    let judge_itl = opts.itl_ms.filter(|_| opts.role != Role::Prefill);
    let missed = judge_ttft.is_some_and(|sla| ms(idle.ttft) > sla)
        || judge_itl.is_some_and(|sla| idle.itl.is_none_or(|i| ms(i) > sla));
    if missed {
        let note = format!(
            "{p}: no row, one request at a time already misses the SLA (TTFT {:.1} ms, ITL {})",
            ms(idle.ttft),
            idle.itl.map_or("-".into(), |i| format!("{:.2} ms", ms(i)))
        );
        tracing::warn!("{note}");
        return Ok((None, Some(note)));
    }
    // What the SLA allows a whole request, or what one took alone if more.
    let allowed_ms = judge_ttft.unwrap_or(ms(idle.ttft))
        + f64::from(p.max_tokens.saturating_sub(1)) * judge_itl.unwrap_or(0.0);
    let timeout = opts.request_timeout.unwrap_or_else(|| {
        Duration::from_secs_f64((4.0 * allowed_ms.max(ms(idle.latency)) / 1e3).max(10.0))
    });
    // Half what one request at a time would serve, and enough requests
    // for a percentile within one step.
    let start = (0.5 / idle.latency.as_secs_f64().max(1e-6))
        .max(opts.min_requests as f64 / opts.step.as_secs_f64())
        .min(opts.max_rps);
    let mut search = RateSearch::new(start, opts.max_rps, HALVINGS, opts.bisect_steps);
    tracing::info!(
        "{p}: searching from {start:.3} rps, at most {} steps of about {:.1} s, requests time out after {:.1} s",
        RateSearch::max_steps(start, opts.max_rps, HALVINGS, opts.bisect_steps),
        opts.step.as_secs_f64(),
        timeout.as_secs_f64()
    );
    let sla = Sla {
        ttft_ms: judge_ttft,
        itl_ms: judge_itl,
    };
    let mut best: Option<(f64, Step)> = None;
    while let Some(rate) = search.next_rate() {
        let step = run_step(client, opts, p, rate, sla, timeout, rng).await;
        if step.samples.is_empty() && step.connect_failures > 0 {
            return Err(ProfileError::Unreachable {
                endpoint: opts.endpoint.clone(),
                reason: step.first_failure.unwrap_or_default(),
            });
        }
        let verdict = judge(&step, sla);
        tracing::info!(
            "{p}: {rate:.3} rps: {} ({} sent, {} done, p90 TTFT {}, p90 ITL {}, completions {})",
            match &verdict {
                Ok(()) => "pass".to_string(),
                Err(why) => format!("fail, {why}"),
            },
            step.sent,
            step.samples.len(),
            fmt_ms(step.p90_ttft_ms()),
            fmt_ms(step.p90_itl_ms()),
            match (step.achieved(), step.offered()) {
                (Some(a), Some(o)) => format!("{a:.2} rps of {o:.2} offered"),
                _ => "-".into(),
            }
        );
        search.record(rate, verdict.is_ok());
        if verdict.is_ok() {
            if best.as_ref().is_none_or(|(r, _)| rate > *r) {
                best = Some((rate, step));
            }
        } else if step.stopped.is_some() {
            settle(client, p, idle.ttft, rng).await;
        }
    }
    let Some((rate, step)) = best else {
        let note = format!("{p}: no row, no rate passed down to a quarter of {start:.3} rps");
        tracing::warn!("{note}");
        return Ok((None, Some(note)));
    };
    let note = search.capped().then(|| {
        let n = format!(
            "{p}: kept up at the cap, {} rps: the worker may serve more (raise the cap)",
            opts.max_rps
        );
        tracing::warn!("{n}");
        n
    });
    let row = ProfileRow {
        role: opts.role,
        isl: f64::from(p.isl),
        osl: f64::from(p.osl),
        rps: floor_significant(rate, 4),
        ttft_ms: sla.ttft_ms.and(step.p90_ttft_ms()).map(hundredths),
        itl_ms: sla.itl_ms.and(step.p90_itl_ms()).map(hundredths),
    };
    tracing::info!("{p}: {} rps", row.rps);
    Ok((Some(row), note))
}

/// One request at a time; a failure here is the sweep's error, not a
/// point's verdict: nothing loaded the worker yet.
async fn calibrate(
    client: &Client,
    opts: &SweepOptions,
    p: Point,
    rng: &mut StdRng,
) -> Result<Unloaded, ProfileError> {
    let mut counted: Vec<Sample> = Vec::with_capacity(CALIBRATION);
    for i in 0..CALIBRATION {
        let body = client.body(p.isl as usize, p.max_tokens, rng);
        let s = client
            .send(body, CALIBRATION_TIMEOUT, None)
            .await
            .map_err(|f| fatal(opts, f))?;
        if i > 0 {
            counted.push(s);
        }
    }
    let worst = |f: fn(&Sample) -> Duration| counted.iter().map(f).max().unwrap_or_default();
    Ok(Unloaded {
        ttft: worst(|s| s.ttft),
        itl: counted.iter().filter_map(|s| s.itl).max(),
        latency: worst(|s| s.done - s.sent),
    })
}

fn fatal(opts: &SweepOptions, f: Failure) -> ProfileError {
    let endpoint = opts.endpoint.clone();
    match f {
        Failure::Connect(reason) => ProfileError::Unreachable { endpoint, reason },
        Failure::Timeout => ProfileError::Unreachable {
            endpoint,
            reason: format!(
                "one request alone had no end within {} s",
                CALIBRATION_TIMEOUT.as_secs()
            ),
        },
        Failure::Status(status, body) => ProfileError::Rejected {
            endpoint,
            status,
            body,
            hint: if opts.role == Role::Decode {
                " (a worker that serves only disaggregated decode legs cannot be profiled alone: profile one started without its disaggregation role)"
            } else {
                ""
            },
        },
        Failure::Stream(reason) => ProfileError::BadStream { endpoint, reason },
    }
}

/// The limits a step is judged by: `None` where the role is not judged
/// by that figure.
#[derive(Debug, Clone, Copy)]
struct Sla {
    ttft_ms: Option<f64>,
    itl_ms: Option<f64>,
}

/// What one step saw.
#[derive(Debug, Default)]
struct Step {
    sent: usize,
    samples: Vec<Sample>,
    failures: usize,
    connect_failures: usize,
    first_failure: Option<String>,
    /// Why the step stopped before its last request ended.
    stopped: Option<String>,
    sends: Vec<Instant>,
}

impl Step {
    fn fail(&mut self, f: Failure) {
        self.failures += 1;
        if matches!(f, Failure::Connect(_)) {
            self.connect_failures += 1;
        }
        self.first_failure.get_or_insert_with(|| f.to_string());
    }

    fn p90_ttft_ms(&self) -> Option<f64> {
        p90(self.samples.iter().map(|s| ms(s.ttft)).collect())
    }

    fn p90_itl_ms(&self) -> Option<f64> {
        p90(self.samples.iter().filter_map(|s| s.itl).map(ms).collect())
    }

    /// The arrivals' rate, per second.
    fn offered(&self) -> Option<f64> {
        rate_of(&self.sends)
    }

    /// The completions' rate, per second.
    fn achieved(&self) -> Option<f64> {
        let done: Vec<Instant> = self.samples.iter().map(|s| s.done).collect();
        (done.len() >= MIN_FOR_RATE)
            .then(|| rate_of(&done))
            .flatten()
    }
}

/// A step's verdict: `Err` says why it failed.
fn judge(step: &Step, sla: Sla) -> Result<(), String> {
    if let Some(why) = &step.stopped {
        return Err(why.clone());
    }
    if step.failures > 0 {
        return Err(format!(
            "{} of {} requests failed, the first: {}",
            step.failures,
            step.sent,
            step.first_failure.as_deref().unwrap_or("-")
        ));
    }
    if step.samples.is_empty() {
        return Err("no request completed".into());
    }
    if let Some(limit) = sla.ttft_ms {
        let p = step.p90_ttft_ms().unwrap_or(f64::INFINITY);
        if p > limit {
            return Err(format!("p90 TTFT {p:.1} ms over {limit} ms"));
        }
    }
    if let Some(limit) = sla.itl_ms {
        let Some(p) = step.p90_itl_ms() else {
            return Err("no ITL measured: every answer came in one chunk".into());
        };
        if p > limit {
            return Err(format!("p90 ITL {p:.2} ms over {limit} ms"));
        }
    }
    if let (Some(a), Some(o)) = (step.achieved(), step.offered())
        && a < KEEP_UP * o
    {
        return Err(format!(
            "the worker fell behind: completions at {a:.2} rps, arrivals at {o:.2}"
        ));
    }
    Ok(())
}

/// One step: Poisson arrivals at `rate`, each request streamed and timed,
/// until the last ends or the step cannot pass any more.
async fn run_step(
    client: &Arc<Client>,
    opts: &SweepOptions,
    p: Point,
    rate: f64,
    sla: Sla,
    timeout: Duration,
    rng: &mut StdRng,
) -> Step {
    let planned = ((rate * opts.step.as_secs_f64()).round() as usize)
        .max(opts.min_requests)
        .min(MAX_STEP_REQUESTS);
    let window = planned as f64 / rate;
    // Given how many arrive in a window, a Poisson process's arrival times
    // are uniform and independent: sorted uniform draws offer exactly the
    // rate, with Poisson's bunching. Drawing the gaps instead lets a short
    // step offer a rate well off the one it is credited with.
    let mut offsets: Vec<f64> = (0..planned).map(|_| rng.random::<f64>() * window).collect();
    offsets.sort_by(f64::total_cmp);
    let offsets: Vec<Duration> = offsets.into_iter().map(Duration::from_secs_f64).collect();
    // The p90 of `planned` TTFTs is over the limit once more than this
    // many are (nearest rank: the ceil(0.9 n)-th smallest).
    let may_be_late = planned - p90_rank(planned);
    let late = Arc::new(AtomicUsize::new(0));
    let ttft_after = sla.ttft_ms.map(|ms| Duration::from_secs_f64(ms / 1e3));
    let mut set: JoinSet<Result<Sample, Failure>> = JoinSet::new();
    // Lateness is counted inside the requests: the tick looks at it while
    // nothing else wakes the loop.
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut step = Step::default();
    let start = Instant::now();
    loop {
        if step.failures > 0 {
            step.stopped = Some(format!(
                "a request failed: {}",
                step.first_failure.as_deref().unwrap_or("-")
            ));
            break;
        }
        let late_now = late.load(Ordering::Relaxed);
        if late_now > may_be_late {
            step.stopped = Some(format!(
                "{late_now} of {planned} requests missed the TTFT: the p90 cannot pass"
            ));
            break;
        }
        if step.sent == planned && set.is_empty() {
            break;
        }
        let next = offsets.get(step.sent).map(|o| start + *o);
        tokio::select! {
            joined = set.join_next(), if !set.is_empty() => match joined {
                Some(Ok(Ok(s))) => step.samples.push(s),
                Some(Ok(Err(f))) => step.fail(f),
                Some(Err(e)) => step.fail(Failure::Stream(format!("the request's task ended: {e}"))),
                None => {}
            },
            _ = tokio::time::sleep_until(next.unwrap_or(start)), if next.is_some() => {
                if set.len() >= opts.max_in_flight {
                    step.stopped = Some(format!(
                        "{} requests in flight: the worker fell behind the arrivals",
                        set.len()
                    ));
                    break;
                }
                let body = client.body(p.isl as usize, p.max_tokens, rng);
                let (client, late) = (client.clone(), late.clone());
                set.spawn(async move {
                    let lateness = ttft_after.map(|after| Lateness { after, count: &late });
                    client.send(body, timeout, lateness).await
                });
                step.sent += 1;
                step.sends.push(Instant::now());
            },
            _ = tick.tick() => {}
        }
    }
    // What is still in flight belongs to a step that stopped: dropped, so
    // that the worker can abort it.
    set.shutdown().await;
    step
}

/// After a step that stopped early the worker may still be busy with
/// what it had queued; the next step waits until a lone prompt is about
/// as fast as unloaded, at most [`SETTLE`].
async fn settle(client: &Client, p: Point, idle_ttft: Duration, rng: &mut StdRng) {
    let deadline = Instant::now() + SETTLE;
    let fast = idle_ttft.mul_f64(1.5) + Duration::from_millis(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let body = client.body(p.isl as usize, 1, rng);
        if let Ok(s) = client
            .send(body, left.max(Duration::from_secs(1)), None)
            .await
            && s.ttft <= fast
        {
            return;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                "{p}: the worker was still slow {} s after a failed step; going on",
                SETTLE.as_secs()
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Events per second in `times`: the inverse of the least-squares slope
/// of the sorted times over their rank, leaving out the first and last
/// tenth. A backlog that grows steepens the whole line, so the trim hides
/// none of it; what it drops are the few stragglers the p90 allows at
/// either end, which a first-to-last span would count in full.
fn rate_of(times: &[Instant]) -> Option<f64> {
    let t0 = times.iter().min().copied()?;
    let mut y: Vec<f64> = times.iter().map(|t| (*t - t0).as_secs_f64()).collect();
    y.sort_by(f64::total_cmp);
    let trim = y.len() / 10;
    let y = &y[trim..y.len() - trim];
    if y.len() < 2 {
        return None;
    }
    let n = y.len() as f64;
    let mean_x = (n - 1.0) / 2.0;
    let mean_y = y.iter().sum::<f64>() / n;
    let (mut cov, mut var) = (0.0, 0.0);
    for (i, yi) in y.iter().enumerate() {
        let dx = i as f64 - mean_x;
        cov += dx * (yi - mean_y);
        var += dx * dx;
    }
    let slope = cov / var;
    (slope > 0.0).then(|| 1.0 / slope)
}

/// The nearest-rank 90th percentile.
fn p90(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    v.get(p90_rank(v.len()).saturating_sub(1)).copied()
}

/// The 90th percentile's rank among `n` (1-based), `ceil(0.9 n)` in
/// integers: in floating point 0.9 × n can land just above a whole number.
fn p90_rank(n: usize) -> usize {
    (9 * n).div_ceil(10)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1} ms"))
}

fn hundredths(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// `v` cut (not rounded: the row must not claim more than passed) to
/// `digits` significant digits.
fn floor_significant(v: f64, digits: i32) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return v;
    }
    let scale = 10f64.powi(digits - 1 - v.log10().floor() as i32);
    // The nudge keeps a value such as 0.3 (0.29999… × 10⁴) whole.
    let cut = (v * scale * (1.0 + 1e-12)).floor() / scale;
    if cut > 0.0 { cut } else { v }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p90_is_the_nearest_rank() {
        assert_eq!(p90(vec![]), None);
        assert_eq!(p90(vec![5.0]), Some(5.0));
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(p90(v), Some(9.0));
        let v: Vec<f64> = (1..=11).rev().map(f64::from).collect();
        assert_eq!(p90(v), Some(10.0));
        for (n, rank) in [
            (1, 1),
            (9, 9),
            (10, 9),
            (11, 10),
            (20, 18),
            (70, 63),
            (1000, 900),
        ] {
            assert_eq!(p90_rank(n), rank, "{n}");
        }
    }

    #[test]
    fn rates_come_from_the_slope() {
        let t0 = Instant::now();
        let even: Vec<Instant> = (0..20)
            .map(|i| t0 + Duration::from_millis(i * 100))
            .collect();
        let r = rate_of(&even).unwrap();
        assert!((r - 10.0).abs() < 1e-6, "{r}");
        // Stragglers at the ends are trimmed away.
        let mut late = even.clone();
        late[19] += Duration::from_millis(900);
        late[0] -= Duration::from_millis(900);
        let r = rate_of(&late).unwrap();
        assert!((r - 10.0).abs() < 1e-6, "{r}");
        // A backlog is not: every gap doubled halves the rate.
        let slow: Vec<Instant> = (0..20)
            .map(|i| t0 + Duration::from_millis(i * 200))
            .collect();
        let r = rate_of(&slow).unwrap();
        assert!((r - 5.0).abs() < 1e-6, "{r}");
        assert_eq!(rate_of(&even[..1]), None);
        assert_eq!(rate_of(&[]), None);
        assert_eq!(rate_of(&[t0, t0]), None);
    }

    #[test]
    fn rates_are_cut_to_four_digits_never_up() {
        assert_eq!(floor_significant(28.125, 4), 28.12);
        assert_eq!(floor_significant(0.3, 4), 0.3);
        assert_eq!(floor_significant(64.0, 4), 64.0);
        assert_eq!(floor_significant(1234.56, 4), 1234.0);
        assert_eq!(floor_significant(0.000123456, 4), 0.0001234);
    }

    fn sample(t0: Instant, i: u64, ttft_ms: u64, itl_ms: Option<u64>) -> Sample {
        let sent = t0 + Duration::from_millis(i * 100);
        Sample {
            sent,
            done: sent + Duration::from_millis(ttft_ms + 50),
            ttft: Duration::from_millis(ttft_ms),
            itl: itl_ms.map(Duration::from_millis),
        }
    }

    fn step_of(samples: Vec<Sample>) -> Step {
        Step {
            sent: samples.len(),
            sends: samples.iter().map(|s| s.sent).collect(),
            samples,
            ..Step::default()
        }
    }

    #[test]
    fn a_step_is_judged_by_its_role_s_figures() {
        let t0 = Instant::now();
        let both = Sla {
            ttft_ms: Some(100.0),
            itl_ms: Some(10.0),
        };
        // Nine of ten within both limits: the p90 passes.
        let mut s: Vec<Sample> = (0..9).map(|i| sample(t0, i, 50, Some(5))).collect();
        s.push(sample(t0, 9, 500, Some(50)));
        assert_eq!(judge(&step_of(s.clone()), both), Ok(()));
        // Two of ten over the TTFT: fails, but not a decode step.
        s[0] = sample(t0, 0, 500, Some(5));
        assert!(judge(&step_of(s.clone()), both).is_err_and(|e| e.contains("TTFT")));
        let decode = Sla {
            ttft_ms: None,
            itl_ms: Some(10.0),
        };
        assert_eq!(judge(&step_of(s.clone()), decode), Ok(()));
        // A prefill step has no ITL to meet.
        let prefill = Sla {
            ttft_ms: Some(100.0),
            itl_ms: None,
        };
        let one_token: Vec<Sample> = (0..10).map(|i| sample(t0, i, 50, None)).collect();
        assert_eq!(judge(&step_of(one_token.clone()), prefill), Ok(()));
        assert!(judge(&step_of(one_token), decode).is_err_and(|e| e.contains("ITL")));
        // A failure fails the step whatever the figures.
        let mut failed = step_of(s);
        failed.fail(Failure::Timeout);
        assert!(judge(&failed, decode).is_err_and(|e| e.contains("timed out")));
    }

    #[test]
    fn a_worker_that_falls_behind_fails_the_step() {
        let t0 = Instant::now();
        let sla = Sla {
            ttft_ms: Some(10_000.0),
            itl_ms: None,
        };
        // Sent every 100 ms, done every 200 ms: half the rate.
        let samples: Vec<Sample> = (0..20)
            .map(|i| {
                let sent = t0 + Duration::from_millis(i * 100);
                let done = t0 + Duration::from_millis(i * 200 + 50);
                Sample {
                    sent,
                    done,
                    ttft: done - sent,
                    itl: None,
                }
            })
            .collect();
        assert!(judge(&step_of(samples), sla).is_err_and(|e| e.contains("fell behind")));
    }
}
