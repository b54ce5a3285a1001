//! Seasonal ARIMA (p,d,q)(P,D,Q)_s.
//!
//! The series, differenced `d` times at lag 1 and `D` times at lag `s`,
//! is taken as a stationary ARMA with multiplicative seasonal factors:
//! `φ(B) Φ(B^s) (w_t - μ) = θ(B) Θ(B^s) e_t`, with `μ` the mean when
//! nothing is differenced and 0 otherwise.
//!
//! * Fitting: conditional sum of squares (the residuals' recursion
//!   started from zeros) minimised by Nelder-Mead. Each polynomial is
//!   parameterised by partial autocorrelations squashed into ±[`R_MAX`],
//!   so every point the optimiser tries is stationary and invertible and
//!   the forecasts cannot run away.
//! * Selection: AICc (AIC with the small-sample correction) over p, q in
//!   0..=2, d in 0..=1 and P, D, Q in 0..=1, each candidate admitted only
//!   when the history holds enough points beyond its lags for its
//!   parameters ([`need`]). Every candidate's residuals are one-step
//!   errors of the series itself, whatever its differencing, and all are
//!   scored over the same window (after the largest candidate's lags),
//!   so their likelihoods are comparable across `d` and `D`. Optimising
//!   all 144 would cost too much per tick: each is scored at
//!   Hannan-Rissanen estimates (two least-squares passes) and only the
//!   best [`REFINE`] are optimised.
//! * Online: between refits each observation only extends the residual
//!   recursion, so a prediction is the one-step forecast from current
//!   state; the fit is redone every [`REFIT_EVERY`] observations (sooner
//!   while the history is short), lazily, by the next prediction.

use super::Predictor;
use super::nelder_mead::minimize;
use std::cell::OnceCell;
use std::collections::VecDeque;

/// Observations kept for fitting: at a minute per interval, eight and a
/// half hours, several seasons of the default 24; the fit's cost grows
/// linearly with it.
const HISTORY: usize = 512;
/// Observations before it predicts on its own: the smallest models
/// (a mean, a random walk, one coefficient) are then admitted.
const WARM_POINTS: usize = 8;
/// Observations between refits once the history is long: twelve new
/// points move estimates from hundreds by little, while the residual
/// recursion already takes each point into the forecast; at a minute per
/// interval it is a refit per quarter hour or so, per series.
const REFIT_EVERY: usize = 12;
const MAX_P: usize = 2;
const MAX_D: usize = 1;
const MAX_Q: usize = 2;
const MAX_SEASONAL: usize = 1;
/// Bound on each partial autocorrelation: keeps the polynomials strictly
/// inside the stationary/invertible region, where the conditional sum of
/// squares and the forecasts are well behaved; a unit root is what `d`
/// and `D` are for.
const R_MAX: f64 = 0.99;
/// Candidates optimised after screening. Optimising all of them took
/// fifteen times as long on 512 points and gained a few AICc points,
/// mostly by fitting noise with extra MA terms.
const REFINE: usize = 4;
/// The optimiser's first step in the unconstrained parameters (tanh
/// space): about 0.2 in a partial autocorrelation near 0.
const NM_STEP: f64 = 0.2;
const NM_FTOL: f64 = 1e-8;
/// Residual variance floor, in units of the series' variance: a series
/// a model predicts exactly would otherwise score minus infinity.
const VAR_FLOOR: f64 = 1e-12;

/// Evaluations allowed to optimise `k` coefficients.
fn budget(k: usize) -> usize {
    100 + 60 * k
}

/// Points a candidate with `k` parameters needs beyond its lags: two per
/// parameter plus a few for the residual variance.
fn need(k: usize) -> usize {
    4 + 2 * k
}

/// Observations between refits of a fit on `points` observations: a
/// quarter of them, so that early fits, each new point a large share of
/// the data, are redone quickly.
fn refit_interval(points: usize) -> usize {
    (points / 4).clamp(1, REFIT_EVERY)
}

/// Seasonal ARIMA predictor; see the module documentation.
#[derive(Debug, Clone)]
pub struct Arima {
    season: usize,
    history: VecDeque<f64>,
    /// Whether every observation so far was non-negative: then so must
    /// the forecast be.
    nonneg: bool,
    /// Made by the first prediction after the last one fell due, so that
    /// a warm start of thousands of intervals costs one fit, not one per
    /// refit interval.
    fit: OnceCell<Fit>,
}

#[derive(Debug, Clone)]
struct Fit {
    /// Observations it was fitted on.
    points: usize,
    /// Observations since.
    since: usize,
    /// `None` when no candidate could be fitted: the last value stands in.
    model: Option<Model>,
}

impl Arima {
    /// `season`: the seasonal period in intervals; below 2, or too long
    /// for the history, only non-seasonal orders are tried.
    pub fn new(season: usize) -> Arima {
        Arima {
            // Longer than the history it can never be fitted; capping it
            // keeps the lag arithmetic small.
            season: season.min(HISTORY),
            history: VecDeque::with_capacity(HISTORY),
            nonneg: true,
            fit: OnceCell::new(),
        }
    }

    /// The model in use, e.g. `(1,0,1)(0,1,1)[10] φ=[0.61] θ=[-0.20]
    /// Θ=[-0.71] AICc=-85.3`, for logs; `None` while warming, before the
    /// first prediction fits it, or when no candidate could be fitted.
    pub fn describe(&self) -> Option<String> {
        let m = self.fit.get()?.model.as_ref()?;
        let o = m.order;
        let mut out = format!(
            "({},{},{})({},{},{})[{}]",
            o.p, o.d, o.q, o.sp, o.sd, o.sq, self.season
        );
        for (name, c) in [
            ("φ", &m.coefs.phi),
            ("θ", &m.coefs.theta),
            ("Φ", &m.coefs.sphi),
            ("Θ", &m.coefs.stheta),
        ] {
            if !c.is_empty() {
                let c: Vec<String> = c.iter().map(|c| format!("{c:.2}")).collect();
                out += &format!(" {name}=[{}]", c.join(", "));
            }
        }
        out += &format!(" AICc={:.1}", m.aic);
        Some(out)
    }

    fn fitted(&self) -> &Fit {
        self.fit.get_or_init(|| {
            let y: Vec<f64> = self.history.iter().copied().collect();
            Fit {
                points: y.len(),
                since: 0,
                model: Model::fit(&y, self.season),
            }
        })
    }
}

impl Predictor for Arima {
    fn observe(&mut self, y: f64) {
        if !y.is_finite() {
            return;
        }
        self.nonneg &= y >= 0.0;
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(y);
        let mut due = false;
        if let Some(fit) = self.fit.get_mut() {
            fit.since += 1;
            due = fit.since >= refit_interval(fit.points);
            if !due && let Some(model) = &mut fit.model {
                model.update(y);
            }
        }
        if due {
            self.fit.take();
        }
    }

    fn predict(&self) -> Option<f64> {
        let last = *self.history.back()?;
        if !self.warm() {
            return Some(last);
        }
        let forecast = self
            .fitted()
            .model
            .as_ref()
            .map(Model::forecast)
            .filter(|f| f.is_finite())
            .unwrap_or(last);
        Some(if self.nonneg {
            forecast.max(0.0)
        } else {
            forecast
        })
    }

    fn warm(&self) -> bool {
        self.history.len() >= WARM_POINTS
    }
}

/// (p,d,q)(P,D,Q): `sp`, `sd`, `sq` the seasonal ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Order {
    p: usize,
    d: usize,
    q: usize,
    sp: usize,
    sd: usize,
    sq: usize,
}

impl Order {
    /// Coefficients the optimiser fits.
    fn coefs(self) -> usize {
        self.p + self.q + self.sp + self.sq
    }
    fn has_mean(self) -> bool {
        self.d + self.sd == 0
    }
    /// Parameters AIC charges for (the mean, when estimated, is one).
    fn params(self) -> usize {
        self.coefs() + usize::from(self.has_mean())
    }
    fn diff_lag(self, s: usize) -> usize {
        self.d + s * self.sd
    }
    fn ar_lag(self, s: usize) -> usize {
        self.p + s * self.sp
    }
    /// Observations consumed before the first residual.
    fn lag(self, s: usize) -> usize {
        self.diff_lag(s) + self.ar_lag(s)
    }
}

/// The grid, less the candidates `n` observations cannot support.
fn candidates(n: usize, s: usize) -> Vec<Order> {
    let smax = if s >= 2 { MAX_SEASONAL } else { 0 };
    let mut out = Vec::new();
    for sd in 0..=smax {
        for d in 0..=MAX_D {
            for sp in 0..=smax {
                for sq in 0..=smax {
                    for p in 0..=MAX_P {
                        for q in 0..=MAX_Q {
                            let o = Order {
                                p,
                                d,
                                q,
                                sp,
                                sd,
                                sq,
                            };
                            if n >= o.lag(s) + need(o.params()) {
                                out.push(o);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// A lag polynomial as (lag, coefficient) terms, the lag-0 term included.
type Poly = Vec<(usize, f64)>;

fn multiply(a: &[(usize, f64)], b: &[(usize, f64)]) -> Poly {
    let mut out: Poly = Vec::with_capacity(a.len() * b.len());
    for &(i, x) in a {
        for &(j, y) in b {
            match out.iter_mut().find(|t| t.0 == i + j) {
                Some(t) => t.1 += x * y,
                None => out.push((i + j, x * y)),
            }
        }
    }
    out
}

/// `1 + sign·Σ c_i B^(step·i)`.
fn factor(c: &[f64], step: usize, sign: f64) -> Poly {
    let mut out = vec![(0, 1.0)];
    out.extend(
        c.iter()
            .enumerate()
            .map(|(i, c)| ((i + 1) * step, sign * c)),
    );
    out
}

/// `(1 - B)^d (1 - B^s)^D` as the terms of lag 1 and more: `w_t = z_t +
/// Σ c_k z_{t-k}`.
fn difference_terms(d: usize, sd: usize, s: usize) -> Poly {
    let mut poly = vec![(0, 1.0)];
    for _ in 0..d {
        poly = multiply(&poly, &[(0, 1.0), (1, -1.0)]);
    }
    for _ in 0..sd {
        poly = multiply(&poly, &[(0, 1.0), (s, -1.0)]);
    }
    poly.retain(|t| t.0 > 0 && t.1 != 0.0);
    poly
}

/// Partial autocorrelations to AR coefficients (Durbin-Levinson): any
/// values in (-1, 1) give a stationary `1 - Σ φ_i B^i`.
fn pacf_to_ar(r: &[f64]) -> Vec<f64> {
    let mut a: Vec<f64> = Vec::with_capacity(r.len());
    for (j, &rj) in r.iter().enumerate() {
        let prev = a.clone();
        for i in 0..j {
            a[i] = prev[i] - rj * prev[j - 1 - i];
        }
        a.push(rj);
    }
    a
}

/// The inverse of [`pacf_to_ar`], each value clamped inside ±`bound`: a
/// starting point for the optimiser from possibly non-stationary
/// least-squares estimates.
fn ar_to_pacf(phi: &[f64], bound: f64) -> Vec<f64> {
    let mut a = phi.to_vec();
    let mut r = vec![0.0; a.len()];
    for j in (0..a.len()).rev() {
        let rj = a[j].clamp(-bound, bound);
        r[j] = rj;
        let denom = 1.0 - rj * rj;
        let prev = a.clone();
        for i in 0..j {
            a[i] = (prev[i] + rj * prev[j - 1 - i]) / denom;
        }
    }
    r
}

fn squash(u: &[f64]) -> Vec<f64> {
    u.iter().map(|u| R_MAX * u.tanh()).collect()
}

fn unsquash(r: &[f64]) -> Vec<f64> {
    r.iter()
        .map(|r| (r / R_MAX).clamp(-0.95, 0.95).atanh())
        .collect()
}

/// The fitted coefficients, in the sign convention of the module
/// documentation: `φ(B) = 1 - Σ φ_i B^i`, `θ(B) = 1 + Σ θ_i B^i`.
#[derive(Debug, Clone, Default, PartialEq)]
struct Coefs {
    phi: Vec<f64>,
    theta: Vec<f64>,
    sphi: Vec<f64>,
    stheta: Vec<f64>,
}

impl Coefs {
    /// From the optimiser's unconstrained parameters: p, q, P, Q of them.
    fn from_free(o: Order, u: &[f64]) -> Coefs {
        debug_assert_eq!(u.len(), o.coefs());
        let (a, rest) = u.split_at(o.p.min(u.len()));
        let (b, rest) = rest.split_at(o.q.min(rest.len()));
        let (c, d) = rest.split_at(o.sp.min(rest.len()));
        let neg = |v: Vec<f64>| v.into_iter().map(|x| -x).collect();
        // An invertible θ(B) = 1 + Σ θ_i B^i is a stationary AR
        // polynomial with φ_i = -θ_i.
        Coefs {
            phi: pacf_to_ar(&squash(a)),
            theta: neg(pacf_to_ar(&squash(b))),
            sphi: pacf_to_ar(&squash(c)),
            stheta: neg(pacf_to_ar(&squash(d))),
        }
    }

    fn to_free(&self) -> Vec<f64> {
        let neg = |v: &[f64]| v.iter().map(|x| -x).collect::<Vec<f64>>();
        let bound = R_MAX * 0.95;
        let mut u = unsquash(&ar_to_pacf(&self.phi, bound));
        u.extend(unsquash(&ar_to_pacf(&neg(&self.theta), bound)));
        u.extend(unsquash(&ar_to_pacf(&self.sphi, bound)));
        u.extend(unsquash(&ar_to_pacf(&neg(&self.stheta), bound)));
        u
    }

    /// The polynomials multiplied out, as (AR, MA) terms of lag 1 and
    /// more: `wc_t = Σ ar wc_{t-l} + e_t + Σ ma e_{t-l}`.
    fn expand(&self, s: usize) -> (Poly, Poly) {
        let mut ar = multiply(&factor(&self.phi, 1, -1.0), &factor(&self.sphi, s, -1.0));
        ar.retain(|t| t.0 > 0 && t.1 != 0.0);
        ar.iter_mut().for_each(|t| t.1 = -t.1);
        let mut ma = multiply(&factor(&self.theta, 1, 1.0), &factor(&self.stheta, s, 1.0));
        ma.retain(|t| t.0 > 0 && t.1 != 0.0);
        (ar, ma)
    }
}

/// Residuals of the ARMA `ar`/`ma` on the centred, differenced `wc`,
/// into `e` (zeros before the AR lags are available); returns their sum
/// of squares from `from` on, infinite if it overflowed.
fn css(wc: &[f64], ar: &[(usize, f64)], ma: &[(usize, f64)], from: usize, e: &mut Vec<f64>) -> f64 {
    let start = ar.iter().map(|t| t.0).max().unwrap_or(0);
    e.clear();
    e.resize(wc.len(), 0.0);
    let mut sse = 0.0;
    for t in start..wc.len() {
        let mut v = wc[t];
        for &(l, a) in ar {
            v -= a * wc[t - l];
        }
        for &(l, m) in ma {
            if l <= t {
                v -= m * e[t - l];
            }
        }
        e[t] = v;
        if t >= from {
            sse += v * v;
        }
    }
    if sse.is_finite() { sse } else { f64::INFINITY }
}

/// Akaike's criterion with the small-sample correction (AICc) for the
/// conditional likelihood of `n` residuals: early fits score a dozen
/// points, where plain AIC picks models far too large. `params` excludes
/// the residual variance, counted here.
fn aic(sse: f64, n: usize, params: usize) -> f64 {
    let k = params as f64 + 1.0;
    let n = n as f64;
    if n <= k + 1.0 {
        return f64::INFINITY;
    }
    n * (sse / n).max(VAR_FLOOR).ln() + 2.0 * k + 2.0 * k * (k + 1.0) / (n - k - 1.0)
}

/// The scaled series differenced one way, with what the candidates of
/// that differencing share.
struct Differenced {
    d: usize,
    sd: usize,
    diff: Poly,
    mean: f64,
    /// Differenced and centred; `wc[j]` is observation `j + d + s·D`.
    wc: Vec<f64>,
    /// Where the scored window starts in `wc`.
    from: usize,
    /// Residuals of a long autoregression, valid from `long`: the
    /// stand-in for the innovations in Hannan-Rissanen.
    innov: Vec<f64>,
    long: usize,
}

impl Differenced {
    fn new(z: &[f64], d: usize, sd: usize, s: usize, t0: usize, long: usize) -> Differenced {
        let diff = difference_terms(d, sd, s);
        let off = d + s * sd;
        let w: Vec<f64> = (off..z.len())
            .map(|t| z[t] + diff.iter().map(|&(k, c)| c * z[t - k]).sum::<f64>())
            .collect();
        let mean = if d + sd == 0 && !w.is_empty() {
            w.iter().sum::<f64>() / w.len() as f64
        } else {
            0.0
        };
        let wc: Vec<f64> = w.iter().map(|w| w - mean).collect();
        let long = long.min(wc.len() / 3);
        let phi = yule_walker(&wc, long);
        let long = phi.len();
        let mut innov = vec![0.0; wc.len()];
        for t in long..wc.len() {
            innov[t] = wc[t]
                - phi
                    .iter()
                    .enumerate()
                    .map(|(j, p)| p * wc[t - 1 - j])
                    .sum::<f64>();
        }
        Differenced {
            d,
            sd,
            diff,
            mean,
            wc,
            from: t0 - off,
            innov,
            long,
        }
    }

    /// Starting coefficients for `o` (Hannan-Rissanen): least squares of
    /// each point on its AR lags and the long autoregression's residuals
    /// at its MA lags; seasonal factors enter additively, which is close
    /// enough for a start. Zeros where the data are too few.
    fn start(&self, o: Order, s: usize) -> Vec<f64> {
        let zeros = vec![0.0; o.coefs()];
        let ar_lags: Vec<usize> = (1..=o.p).chain((1..=o.sp).map(|j| j * s)).collect();
        let ma_lags: Vec<usize> = (1..=o.q).chain((1..=o.sq).map(|j| j * s)).collect();
        let ar_start = ar_lags.iter().copied().max().unwrap_or(0);
        let ma_start = self.long + ma_lags.iter().copied().max().unwrap_or(0);
        let n = self.wc.len();
        let with_ma = !ma_lags.is_empty() && n >= ar_start.max(ma_start) + o.coefs() + 4;
        let r0 = if with_ma {
            ar_start.max(ma_start)
        } else {
            ar_start
        };
        let k = ar_lags.len() + if with_ma { ma_lags.len() } else { 0 };
        if k == 0 || n < r0 + k + 4 {
            return zeros;
        }
        let mut xtx = vec![0.0; k * k];
        let mut xty = vec![0.0; k];
        let mut x = vec![0.0; k];
        for t in r0..n {
            for (xi, l) in x.iter_mut().zip(&ar_lags) {
                *xi = self.wc[t - l];
            }
            if with_ma {
                for (xi, l) in x[ar_lags.len()..].iter_mut().zip(&ma_lags) {
                    *xi = self.innov[t - l];
                }
            }
            for i in 0..k {
                xty[i] += x[i] * self.wc[t];
                for j in 0..k {
                    xtx[i * k + j] += x[i] * x[j];
                }
            }
        }
        let Some(beta) = solve(&mut xtx, &mut xty, k) else {
            return zeros;
        };
        let mut b = beta.into_iter();
        let mut take = |n: usize| (&mut b).take(n).collect::<Vec<f64>>();
        let phi = take(o.p);
        let sphi = take(o.sp);
        let (theta, stheta) = if with_ma {
            (take(o.q), take(o.sq))
        } else {
            (vec![0.0; o.q], vec![0.0; o.sq])
        };
        Coefs {
            phi,
            theta,
            sphi,
            stheta,
        }
        .to_free()
    }
}

/// AR coefficients of order up to `m` from the sample autocovariances
/// (Durbin-Levinson): always stationary; shorter if the series runs out
/// of variance.
fn yule_walker(x: &[f64], m: usize) -> Vec<f64> {
    let n = x.len() as f64;
    let gamma: Vec<f64> = (0..=m)
        .map(|k| (k..x.len()).map(|t| x[t] * x[t - k]).sum::<f64>() / n)
        .collect();
    let mut phi: Vec<f64> = Vec::with_capacity(m);
    let mut v = gamma.first().copied().unwrap_or(0.0);
    for k in 1..=m {
        if !v.is_finite() || v <= 1e-12 * gamma[0] {
            break;
        }
        let acc = gamma[k] - (1..k).map(|j| phi[j - 1] * gamma[k - j]).sum::<f64>();
        let r = (acc / v).clamp(-R_MAX, R_MAX);
        let prev = phi.clone();
        for j in 1..k {
            phi[j - 1] = prev[j - 1] - r * prev[k - j - 1];
        }
        phi.push(r);
        v *= 1.0 - r * r;
    }
    phi
}

/// Solves `a·x = b` (`a` k×k, row-major) by Gaussian elimination with
/// partial pivoting and a touch of ridge; `None` if singular.
fn solve(a: &mut [f64], b: &mut [f64], k: usize) -> Option<Vec<f64>> {
    let ridge = 1e-9 * (0..k).map(|i| a[i * k + i]).sum::<f64>() / k as f64;
    for i in 0..k {
        a[i * k + i] += ridge;
    }
    for c in 0..k {
        let pivot = (c..k).max_by(|&i, &j| a[i * k + c].abs().total_cmp(&a[j * k + c].abs()))?;
        let p = a[pivot * k + c];
        if p == 0.0 || !p.is_finite() {
            return None;
        }
        if pivot != c {
            for j in 0..k {
                a.swap(pivot * k + j, c * k + j);
            }
            b.swap(pivot, c);
        }
        for r in c + 1..k {
            let f = a[r * k + c] / a[c * k + c];
            for j in c..k {
                a[r * k + j] -= f * a[c * k + j];
            }
            b[r] -= f * b[c];
        }
    }
    let mut x = vec![0.0; k];
    for c in (0..k).rev() {
        let s: f64 = (c + 1..k).map(|j| a[c * k + j] * x[j]).sum();
        x[c] = (b[c] - s) / a[c * k + c];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// A fitted model and its state: the last observations (scaled), the
/// differenced series (centred) and the residuals, as far back as the
/// longest lag.
#[derive(Debug, Clone)]
struct Model {
    order: Order,
    coefs: Coefs,
    aic: f64,
    center: f64,
    scale: f64,
    mean: f64,
    diff: Poly,
    ar: Poly,
    ma: Poly,
    z: VecDeque<f64>,
    wc: VecDeque<f64>,
    e: VecDeque<f64>,
    keep: usize,
}

/// `buf`'s value `lag` steps before the next one; 0 before its start.
fn at(buf: &VecDeque<f64>, lag: usize) -> f64 {
    buf.len()
        .checked_sub(lag)
        .and_then(|i| buf.get(i))
        .copied()
        .unwrap_or(0.0)
}

fn push(buf: &mut VecDeque<f64>, v: f64, keep: usize) {
    if buf.len() >= keep {
        buf.pop_front();
    }
    buf.push_back(v);
}

fn tail(v: &[f64], keep: usize) -> VecDeque<f64> {
    v[v.len().saturating_sub(keep)..].iter().copied().collect()
}

impl Model {
    /// Selects the orders by AIC and fits them on `y`.
    fn fit(y: &[f64], s: usize) -> Option<Model> {
        let mut cands = candidates(y.len(), s);
        let t0 = cands.iter().map(|o| o.lag(s)).max()?;
        // Scored after the longest lag, each must still have its points.
        cands.retain(|o| y.len() - t0 >= need(o.params()));
        Model::fit_among(y, s, &cands, t0)
    }

    /// The best of `cands` on `y`, scored from observation `t0` on (at
    /// least every candidate's lag).
    fn fit_among(y: &[f64], s: usize, cands: &[Order], t0: usize) -> Option<Model> {
        let n = y.len();
        if n <= t0 || cands.iter().any(|o| o.lag(s) > t0) {
            return None;
        }
        // Unit variance: the same floors and steps suit any series.
        let center = y.iter().sum::<f64>() / n as f64;
        let sd = (y.iter().map(|v| (v - center).powi(2)).sum::<f64>() / n as f64).sqrt();
        if !center.is_finite() || !sd.is_finite() {
            return None;
        }
        let scale = if sd > 1e-9 * (1.0 + center.abs()) {
            sd
        } else {
            1.0
        };
        let z: Vec<f64> = y.iter().map(|v| (v - center) / scale).collect();
        let seasonal = cands.iter().any(|o| o.sp + o.sd + o.sq > 0);
        // The long autoregression must reach past a season to stand in
        // for seasonal innovations.
        let long = if seasonal { s + 2 } else { 8 };
        let mut groups: Vec<Differenced> = Vec::new();
        let mut screened: Vec<(f64, Order, usize, Vec<f64>)> = Vec::new();
        let neff = n - t0;
        let mut e = Vec::with_capacity(n);
        for &o in cands {
            let g = match groups.iter().position(|g| g.d == o.d && g.sd == o.sd) {
                Some(g) => g,
                None => {
                    groups.push(Differenced::new(&z, o.d, o.sd, s, t0, long));
                    groups.len() - 1
                }
            };
            let x0 = groups[g].start(o, s);
            let (ar, ma) = Coefs::from_free(o, &x0).expand(s);
            let sse = css(&groups[g].wc, &ar, &ma, groups[g].from, &mut e);
            screened.push((aic(sse, neff, o.params()), o, g, x0));
        }
        screened.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.params().cmp(&b.1.params())));
        let mut best: Option<(f64, Order, usize, Vec<f64>)> = None;
        for (_, o, g, x0) in screened.into_iter().take(REFINE) {
            let grp = &groups[g];
            let objective = |u: &[f64]| {
                let (ar, ma) = Coefs::from_free(o, u).expand(s);
                css(&grp.wc, &ar, &ma, grp.from, &mut e)
            };
            let (u, sse) = minimize(objective, &x0, NM_STEP, budget(o.coefs()), NM_FTOL);
            let score = aic(sse, neff, o.params());
            let better = match &best {
                None => score.is_finite(),
                Some((b, bo, ..)) => score < *b || (score == *b && o.params() < bo.params()),
            };
            if better {
                best = Some((score, o, g, u));
            }
        }
        let (score, order, g, u) = best?;
        let grp = &groups[g];
        let coefs = Coefs::from_free(order, &u);
        let (ar, ma) = coefs.expand(s);
        css(&grp.wc, &ar, &ma, grp.from, &mut e);
        let keep = ar
            .iter()
            .chain(&ma)
            .chain(&grp.diff)
            .map(|t| t.0)
            .max()
            .unwrap_or(0)
            .max(1);
        Some(Model {
            order,
            coefs,
            aic: score,
            center,
            scale,
            mean: grp.mean,
            diff: grp.diff.clone(),
            ar,
            ma,
            z: tail(&z, keep),
            wc: tail(&grp.wc, keep),
            e: tail(&e, keep),
            keep,
        })
    }

    /// The next centred, differenced value.
    fn one_step(&self) -> f64 {
        self.ar
            .iter()
            .map(|&(l, a)| a * at(&self.wc, l))
            .sum::<f64>()
            + self
                .ma
                .iter()
                .map(|&(l, m)| m * at(&self.e, l))
                .sum::<f64>()
    }

    /// Extends the state by one observation, parameters unchanged.
    fn update(&mut self, y: f64) {
        let z = (y - self.center) / self.scale;
        let w = z + self
            .diff
            .iter()
            .map(|&(k, c)| c * at(&self.z, k))
            .sum::<f64>();
        let wc = w - self.mean;
        let e = wc - self.one_step();
        // A residual that overflowed would poison every later forecast
        // until the next refit; forgetting it costs one step's accuracy.
        let e = if e.is_finite() { e } else { 0.0 };
        push(&mut self.z, z, self.keep);
        push(&mut self.wc, wc, self.keep);
        push(&mut self.e, e, self.keep);
    }

    /// The next observation's forecast, in the series' units.
    fn forecast(&self) -> f64 {
        let w = self.one_step() + self.mean;
        let z = w - self
            .diff
            .iter()
            .map(|&(k, c)| c * at(&self.z, k))
            .sum::<f64>();
        self.center + self.scale * z
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PredictorKind;
    use crate::planner::predict::{Constant, mape};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Standard normal draws (Box-Muller).
    fn normals(seed: u64, n: usize) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                let u2: f64 = rng.random();
                (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
            })
            .collect()
    }

    fn ar1(seed: u64, n: usize, phi: f64, mean: f64) -> Vec<f64> {
        let mut x = 0.0;
        normals(seed, n + 50)
            .into_iter()
            .map(|e| {
                x = phi * x + e;
                mean + x
            })
            .skip(50)
            .collect()
    }

    fn order(p: usize, d: usize, q: usize) -> Order {
        Order {
            p,
            d,
            q,
            sp: 0,
            sd: 0,
            sq: 0,
        }
    }

    #[test]
    fn recovers_an_ar1_and_selects_an_autoregression() {
        let y = ar1(7, 400, 0.7, 100.0);
        let fixed = Model::fit_among(&y, 1, &[order(1, 0, 0)], 1).unwrap();
        let phi = fixed.coefs.phi[0];
        assert!((phi - 0.7).abs() < 0.06, "fixed-order phi {phi}");
        // Selected from the whole grid, seasonal candidates included.
        let m = Model::fit(&y, 12).unwrap();
        assert!(
            m.order.p >= 1 && m.order.d == 0 && m.order.sd == 0,
            "{:?}",
            m.order
        );
        // Whatever MA terms came along, the weight of the last value in
        // the forecast (the first AR(∞) coefficient, φ1 + θ1) is the
        // AR(1)'s φ.
        let pi1 = m.coefs.phi[0] + m.coefs.theta.first().unwrap_or(&0.0);
        assert!((pi1 - 0.7).abs() < 0.1, "{:?} {:?}", m.order, m.coefs);
    }

    #[test]
    fn one_step_errors_approach_the_noise() {
        // A persistent AR(1): the last value alone is a poor forecast
        // far from the mean; the model's errors are the unit innovations.
        let y = ar1(13, 400, 0.9, 100.0);
        let mut p = Arima::new(1);
        let mut sq = Vec::new();
        for (t, v) in y.iter().enumerate() {
            if t >= 200 {
                sq.push((v - p.predict().unwrap()).powi(2));
            }
            p.observe(*v);
        }
        let rmse = (sq.iter().sum::<f64>() / sq.len() as f64).sqrt();
        assert!(rmse < 1.15, "one-step RMSE {rmse:.3}, noise sd 1");
    }

    #[test]
    fn aic_prefers_the_smaller_model_on_white_noise() {
        let y: Vec<f64> = normals(11, 300).iter().map(|e| 50.0 + 5.0 * e).collect();
        let small = Model::fit_among(&y, 1, &[order(0, 0, 0)], 2).unwrap();
        let big = Model::fit_among(&y, 1, &[order(2, 0, 2)], 2).unwrap();
        assert!(
            small.aic < big.aic,
            "white noise: (0,0,0) {} vs (2,0,2) {}",
            small.aic,
            big.aic
        );
        let m = Model::fit(&y, 1).unwrap();
        assert!(
            m.order.d == 0 && m.order.coefs() <= 1,
            "white noise chose {:?}",
            m.order
        );
    }

    #[test]
    fn beats_the_last_value_on_a_seasonal_series() {
        let period = 6;
        let noise = normals(3, 150);
        let y: Vec<f64> = (0..150)
            .map(|i| {
                let phase = 2.0 * std::f64::consts::PI * i as f64 / period as f64;
                100.0 + 30.0 * phase.sin() + noise[i]
            })
            .collect();
        let a = mape(PredictorKind::Arima, period, &y).unwrap();
        let c = mape(PredictorKind::Constant, period, &y).unwrap();
        assert!(a < c / 3.0, "arima {a:.2}% constant {c:.2}%");
        let mut p = Arima::new(period);
        y.iter().for_each(|v| p.observe(*v));
        p.predict();
        let o = p.fit.get().and_then(|f| f.model.as_ref()).unwrap().order;
        assert!(o.sp + o.sd + o.sq > 0 || o.p == 2, "{o:?}");
    }

    #[test]
    fn predicts_the_last_value_until_warm() {
        let mut p = Arima::new(10);
        assert_eq!(p.predict(), None);
        for (i, v) in [5.0, 9.0, 4.0, 7.0, 6.0, 8.0, 5.0].iter().enumerate() {
            p.observe(*v);
            assert!(!p.warm(), "warm after {} points", i + 1);
            assert_eq!(p.predict(), Some(*v));
        }
        p.observe(6.0);
        assert!(p.warm());
        assert!(p.predict().unwrap().is_finite());
        // Agrees with the trait's reference behaviour while warming.
        let mut c = Constant::default();
        c.observe(3.0);
        let mut a = Arima::new(10);
        a.observe(3.0);
        assert_eq!(a.predict(), c.predict());
    }

    #[test]
    fn a_constant_series_predicts_itself() {
        // Every candidate fits exactly; the variance floor keeps the
        // scores finite and the fewest parameters win.
        let mut p = Arima::new(4);
        (0..40).for_each(|_| p.observe(37.5));
        assert_eq!(p.predict(), Some(37.5));
        let described = p.describe().unwrap();
        assert!(described.starts_with("(0,1,0)(0,0,0)"), "{described}");
    }

    #[test]
    fn ignores_non_finite_observations() {
        let y = ar1(5, 80, 0.5, 20.0);
        let (mut clean, mut dirty) = (Arima::new(10), Arima::new(10));
        for (i, v) in y.iter().enumerate() {
            clean.observe(*v);
            dirty.observe(*v);
            if i % 7 == 0 {
                dirty.observe(f64::NAN);
                dirty.observe(f64::INFINITY);
                dirty.observe(f64::NEG_INFINITY);
            }
            let (a, b) = (clean.predict(), dirty.predict());
            assert_eq!(a, b, "after {} points", i + 1);
            assert!(a.is_some_and(f64::is_finite));
        }
    }

    #[test]
    fn clamps_a_non_negative_series_at_zero_only() {
        let down: Vec<f64> = (0..=30).rev().map(|i| 10.0 * f64::from(i)).collect();
        let mut p = Arima::new(10);
        down.iter().for_each(|v| p.observe(*v));
        assert_eq!(p.predict(), Some(0.0), "a ramp down to 0");
        // The same ramp shifted below zero is not clamped.
        let mut p = Arima::new(10);
        down.iter().for_each(|v| p.observe(v - 1000.0));
        let f = p.predict().unwrap();
        assert!(f < -1000.0 + 1.0, "{f}");
    }

    #[test]
    fn refits_on_schedule_and_tracks_state_between() {
        let y = ar1(9, 200, 0.7, 50.0);
        let mut p = Arima::new(1);
        y[..100].iter().for_each(|v| p.observe(*v));
        assert!(p.fit.get().is_none(), "a warm start fits nothing");
        assert_eq!(p.describe(), None);
        p.predict();
        assert_eq!(p.fit.get().map(|f| f.points), Some(100));
        let described = p.describe().unwrap();
        assert!(described.contains("AICc="), "{described}");
        for (i, v) in y[100..100 + REFIT_EVERY - 1].iter().enumerate() {
            p.observe(*v);
            // Between refits the forecast is the model's from the new
            // state: for an AR(1) around its mean, it moves with the
            // last value.
            let fit = p.fit.get().unwrap();
            assert_eq!(fit.since, i + 1);
            let m = fit.model.as_ref().unwrap();
            let last = m.z.back().map(|z| m.center + m.scale * z).unwrap();
            assert!((last - v).abs() < 1e-9, "{last} vs {v}");
        }
        p.observe(y[100 + REFIT_EVERY - 1]);
        assert!(p.fit.get().is_none(), "due after {REFIT_EVERY}");
        p.predict();
        assert_eq!(p.fit.get().map(|f| f.points), Some(100 + REFIT_EVERY));
        // The history is capped.
        y.iter()
            .cycle()
            .take(3 * HISTORY)
            .for_each(|v| p.observe(*v));
        assert_eq!(p.history.len(), HISTORY);
        assert!(p.predict().is_some_and(f64::is_finite));
    }

    #[test]
    fn differencing_and_expansion_round_trip() {
        // (1 - B)(1 - B^4) = 1 - B - B^4 + B^5.
        let mut d = difference_terms(1, 1, 4);
        d.sort_by_key(|t| t.0);
        assert_eq!(d, vec![(1, -1.0), (4, -1.0), (5, 1.0)]);
        let c = Coefs {
            phi: vec![0.5],
            theta: vec![0.3],
            sphi: vec![0.2],
            stheta: vec![],
        };
        let (mut ar, ma) = c.expand(4);
        ar.sort_by_key(|t| t.0);
        // (1 - 0.5B)(1 - 0.2B^4) = 1 - 0.5B - 0.2B^4 + 0.1B^5.
        assert_eq!(ar.len(), 3);
        assert!((ar[0].1 - 0.5).abs() < 1e-12 && (ar[1].1 - 0.2).abs() < 1e-12);
        assert!((ar[2].0, (ar[2].1 + 0.1).abs() < 1e-12) == (5, true));
        assert_eq!(ma, vec![(1, 0.3)]);
        let o = Order {
            p: 2,
            d: 0,
            q: 1,
            sp: 1,
            sd: 0,
            sq: 1,
        };
        let u = [0.3, -0.4, 0.8, -0.2, 0.5];
        let back = Coefs::from_free(o, &u).to_free();
        for (a, b) in u.iter().zip(&back) {
            assert!((a - b).abs() < 1e-9, "{u:?} vs {back:?}");
        }
    }
}
