//! Predictors of the next interval's request count, ISL and OSL (the
//! throughput loop's traffic shape).
//!
//! * [`Constant`]: the last value; also every predictor's answer while it
//!   warms up.
//! * [`Kalman`]: a local linear trend (level and slope) filtered from
//!   noisy observations: follows a ramp without lagging a whole interval.
//! * [`Seasonal`]: additive Holt-Winters with a fixed season length: a
//!   daily (or, in a bench, a minutes-long) pattern on top of a trend.
//! * [`Arima`]: a seasonal ARIMA whose orders are chosen by AIC and
//!   refitted every few intervals.
//!
//! All warm-start from a trace: [`Predictor::observe`] each past value.

mod arima;
mod nelder_mead;

pub use arima::Arima;

use crate::config::PredictorKind;

/// A fresh predictor of `kind`; `season` is the seasonal ones' period
/// in intervals.
pub fn build(kind: PredictorKind, season: usize) -> Box<dyn Predictor + Send> {
    match kind {
        PredictorKind::Constant => Box::new(Constant::default()),
        PredictorKind::Kalman => Box::new(Kalman::default()),
        PredictorKind::Seasonal => Box::new(Seasonal::new(season)),
        PredictorKind::Arima => Box::new(Arima::new(season)),
    }
}

pub trait Predictor {
    /// One interval's observed value.
    fn observe(&mut self, y: f64);
    /// The next interval's value; `None` before any observation.
    fn predict(&self) -> Option<f64>;
    /// Whether it has seen enough to predict on its own; before, the
    /// caller uses the last value.
    fn warm(&self) -> bool;
}

/// The last value.
#[derive(Debug, Clone, Default)]
pub struct Constant {
    last: Option<f64>,
}

impl Predictor for Constant {
    fn observe(&mut self, y: f64) {
        if y.is_finite() {
            self.last = Some(y);
        }
    }
    fn predict(&self) -> Option<f64> {
        self.last
    }
    fn warm(&self) -> bool {
        self.last.is_some()
    }
}

/// Local linear trend: state (level, slope) with covariance `p`; process
/// noise scaled to the observations' own variance so that one setting
/// suits request counts and token lengths alike.
#[derive(Debug, Clone)]
pub struct Kalman {
    x: [f64; 2],
    p: [[f64; 2]; 2],
    n: usize,
    last: Option<f64>,
    /// Running mean and variance of the observations (Welford).
    mean: f64,
    m2: f64,
}

impl Default for Kalman {
    fn default() -> Self {
        Kalman {
            x: [0.0, 0.0],
            p: [[1e6, 0.0], [0.0, 1e6]],
            n: 0,
            last: None,
            mean: 0.0,
            m2: 0.0,
        }
    }
}

/// Observations before the Kalman filter predicts on its own (Dynamo's
/// `kalman-min-points` idea).
const KALMAN_MIN_POINTS: usize = 5;

impl Kalman {
    fn variance(&self) -> f64 {
        if self.n < 2 {
            1.0
        } else {
            (self.m2 / (self.n - 1) as f64).max(1e-9)
        }
    }
}

impl Predictor for Kalman {
    fn observe(&mut self, y: f64) {
        if !y.is_finite() {
            return;
        }
        if self.n == 0 {
            self.x = [y, 0.0];
        }
        self.n += 1;
        let d = y - self.mean;
        self.mean += d / self.n as f64;
        self.m2 += d * (y - self.mean);
        let var = self.variance();
        // Predict: level += slope.
        let [l, s] = self.x;
        let x = [l + s, s];
        let p = self.p;
        let q_level = 0.05 * var;
        let q_slope = 0.01 * var;
        let pp = [
            [
                p[0][0] + p[0][1] + p[1][0] + p[1][1] + q_level,
                p[0][1] + p[1][1],
            ],
            [p[1][0] + p[1][1], p[1][1] + q_slope],
        ];
        // Update with y (observing the level), noise a fifth of the
        // variance: trusts the data, smooths single spikes.
        let r = 0.2 * var;
        let innov = y - x[0];
        let sk = pp[0][0] + r;
        let k = [pp[0][0] / sk, pp[1][0] / sk];
        self.x = [x[0] + k[0] * innov, x[1] + k[1] * innov];
        self.p = [
            [(1.0 - k[0]) * pp[0][0], (1.0 - k[0]) * pp[0][1]],
            [pp[1][0] - k[1] * pp[0][0], pp[1][1] - k[1] * pp[0][1]],
        ];
        self.last = Some(y);
    }

    fn predict(&self) -> Option<f64> {
        if !self.warm() {
            return self.last;
        }
        Some((self.x[0] + self.x[1]).max(0.0))
    }

    fn warm(&self) -> bool {
        self.n >= KALMAN_MIN_POINTS
    }
}

/// Additive Holt-Winters: level, trend and one seasonal term per position
/// in the season, initialised from the first two seasons.
#[derive(Debug, Clone)]
pub struct Seasonal {
    period: usize,
    history: Vec<f64>,
    level: f64,
    trend: f64,
    season: Vec<f64>,
    t: usize,
    ready: bool,
}

const ALPHA: f64 = 0.4;
const BETA: f64 = 0.1;
const GAMMA: f64 = 0.3;

impl Seasonal {
    pub fn new(period: usize) -> Seasonal {
        let period = period.max(2);
        Seasonal {
            period,
            history: Vec::new(),
            level: 0.0,
            trend: 0.0,
            season: vec![0.0; period],
            t: 0,
            ready: false,
        }
    }

    fn initialise(&mut self) {
        let m = self.period;
        let first: f64 = self.history[..m].iter().sum::<f64>() / m as f64;
        let second: f64 = self.history[m..2 * m].iter().sum::<f64>() / m as f64;
        self.trend = (second - first) / m as f64;
        for i in 0..m {
            self.season[i] = ((self.history[i] - first) + (self.history[m + i] - second)) / 2.0;
        }
        // Run the smoothing over the second season so the state is current.
        self.level = first + self.trend * (m as f64 - 1.0) / 2.0;
        self.t = 0;
        for i in m..2 * m {
            let y = self.history[i];
            self.update(y);
        }
        self.ready = true;
    }

    fn update(&mut self, y: f64) {
        let idx = self.t % self.period;
        let s = self.season[idx];
        let prev_level = self.level;
        self.level = ALPHA * (y - s) + (1.0 - ALPHA) * (self.level + self.trend);
        self.trend = BETA * (self.level - prev_level) + (1.0 - BETA) * self.trend;
        self.season[idx] = GAMMA * (y - self.level) + (1.0 - GAMMA) * s;
        self.t += 1;
    }
}

impl Predictor for Seasonal {
    fn observe(&mut self, y: f64) {
        if !y.is_finite() {
            return;
        }
        if self.ready {
            self.update(y);
            self.history.clear();
            self.history.push(y);
            return;
        }
        self.history.push(y);
        if self.history.len() >= 2 * self.period {
            self.initialise();
            if let Some(last) = self.history.last().copied() {
                self.history = vec![last];
            }
        }
    }

    fn predict(&self) -> Option<f64> {
        if !self.ready {
            return self.history.last().copied();
        }
        let s = self.season[self.t % self.period];
        Some((self.level + self.trend + s).max(0.0))
    }

    fn warm(&self) -> bool {
        self.ready
    }
}

/// Mean absolute percentage error of one-step-ahead predictions over
/// `series`, skipping the warm-up and intervals whose actual value is 0.
pub fn mape(kind: PredictorKind, season: usize, series: &[f64]) -> Option<f64> {
    let mut p = build(kind, season);
    let (mut sum, mut n) = (0.0, 0usize);
    for y in series {
        if p.warm()
            && let Some(f) = p.predict()
            && *y != 0.0
        {
            sum += ((y - f) / y).abs();
            n += 1;
        }
        p.observe(*y);
    }
    (n > 0).then(|| 100.0 * sum / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &mut dyn Predictor, ys: &[f64]) -> f64 {
        for y in ys {
            p.observe(*y);
        }
        p.predict().unwrap()
    }

    #[test]
    fn constant_says_the_last_value() {
        let mut c = Constant::default();
        assert_eq!(c.predict(), None);
        assert_eq!(run(&mut c, &[3.0, 7.0, f64::NAN]), 7.0);
    }

    #[test]
    fn kalman_follows_a_ramp_and_falls_back_while_warming() {
        let mut k = Kalman::default();
        assert_eq!(run(&mut k, &[10.0, 12.0]), 12.0, "warming: the last value");
        assert!(!k.warm());
        let ramp: Vec<f64> = (0..40).map(|i| 100.0 + 10.0 * f64::from(i)).collect();
        let mut k = Kalman::default();
        let next = run(&mut k, &ramp);
        assert!(
            (next - 500.0).abs() < 5.0,
            "the next point of the ramp: {next}"
        );
        // Flat and noisy: it does not chase the noise.
        let flat: Vec<f64> = (0..60)
            .map(|i| 50.0 + if i % 2 == 0 { 5.0 } else { -5.0 })
            .collect();
        let mut k = Kalman::default();
        let next = run(&mut k, &flat);
        assert!((next - 50.0).abs() < 4.0, "{next}");
    }

    #[test]
    fn seasonal_learns_a_season_on_a_trend() {
        let period = 12;
        let series: Vec<f64> = (0..120)
            .map(|i| {
                let i = i as f64;
                200.0 + 0.5 * i + 80.0 * (2.0 * std::f64::consts::PI * i / period as f64).sin()
            })
            .collect();
        let s = mape(PredictorKind::Seasonal, period, &series).unwrap();
        let c = mape(PredictorKind::Constant, period, &series).unwrap();
        let k = mape(PredictorKind::Kalman, period, &series).unwrap();
        assert!(s < 3.0, "seasonal {s:.2}%");
        assert!(
            s < c / 3.0 && s < k,
            "seasonal {s:.2}% constant {c:.2}% kalman {k:.2}%"
        );
        let mut p = Seasonal::new(period);
        assert_eq!(
            run(&mut p, &series[..5]),
            series[4],
            "warming: the last value"
        );
    }

    #[test]
    fn mape_is_the_mean_relative_error() {
        // Constant predicts the previous value: errors 100 %, 50 %.
        assert_eq!(
            mape(PredictorKind::Constant, 2, &[1.0, 2.0, 3.0]),
            Some(((1.0 / 2.0) + (1.0 / 3.0)) / 2.0 * 100.0)
        );
        assert_eq!(mape(PredictorKind::Constant, 2, &[1.0]), None);
    }
}
