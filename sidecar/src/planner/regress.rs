//! Online linear regressions of latency on load, fitted from what the
//! gateway observes (the load loop's perf model):
//!
//! * prefill: prompt tokens in flight on a rank when a request was routed
//!   → its time to first token;
//! * decode: KV tokens in flight on a rank → inter-token latency.
//!
//! Recursive least squares with a forgetting factor, so the fit follows an
//! engine whose speed changes (a hot GPU, a new version) and forgets old
//! points at about `1 / (1 − λ)` samples.

/// A fit's coefficients: latency (ms) = `intercept` + `slope_per_ktok` ×
/// thousands of tokens in flight. One format for every latency fit, per
/// worker or pooled per role.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LineView {
    pub intercept: f64,
    pub slope_per_ktok: f64,
    pub samples: u64,
    /// Enough samples to be used.
    pub trusted: bool,
}

/// y = a + b·x, fitted online.
#[derive(Debug, Clone)]
pub struct Line {
    theta: [f64; 2],
    p: [[f64; 2]; 2],
    n: u64,
    lambda: f64,
}

/// About 200 samples of memory.
pub const LAMBDA: f64 = 0.995;
/// Samples before a fit is trusted.
pub const MIN_SAMPLES: u64 = 10;

impl Default for Line {
    fn default() -> Self {
        Line {
            theta: [0.0, 0.0],
            // A large prior covariance: the first points decide.
            p: [[1e6, 0.0], [0.0, 1e6]],
            n: 0,
            lambda: LAMBDA,
        }
    }
}

impl Line {
    /// Adds a sample; non-finite ones are ignored. `x` is scaled by the
    /// caller to keep both coefficients of similar size (thousands of
    /// tokens, not tokens).
    pub fn add(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite()) {
            return;
        }
        let phi = [1.0, x];
        let p = self.p;
        let pphi = [
            p[0][0] * phi[0] + p[0][1] * phi[1],
            p[1][0] * phi[0] + p[1][1] * phi[1],
        ];
        let denom = self.lambda + phi[0] * pphi[0] + phi[1] * pphi[1];
        if !(denom.is_finite() && denom > 0.0) {
            return;
        }
        let k = [pphi[0] / denom, pphi[1] / denom];
        let err = y - (self.theta[0] + self.theta[1] * x);
        self.theta = [self.theta[0] + k[0] * err, self.theta[1] + k[1] * err];
        let mut np = [[0.0; 2]; 2];
        for (i, row) in np.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = (p[i][j] - k[i] * pphi[j]) / self.lambda;
            }
        }
        // Keep it symmetric and bounded: forgetting inflates the
        // covariance of a direction no sample excites.
        let off = (np[0][1] + np[1][0]) / 2.0;
        np[0][1] = off;
        np[1][0] = off;
        for (i, row) in np.iter_mut().enumerate() {
            row[i] = row[i].clamp(1e-12, 1e9);
        }
        self.p = np;
        self.n += 1;
    }

    pub fn samples(&self) -> u64 {
        self.n
    }

    pub fn ready(&self) -> bool {
        self.n >= MIN_SAMPLES
    }

    /// (intercept, slope).
    pub fn coefficients(&self) -> (f64, f64) {
        (self.theta[0], self.theta[1])
    }

    pub fn predict(&self, x: f64) -> Option<f64> {
        self.ready()
            .then(|| (self.theta[0] + self.theta[1] * x).max(0.0))
    }

    /// What it has learned, as the status view and other readers show
    /// it; `None` before any sample.
    pub fn view(&self) -> Option<LineView> {
        let (intercept, slope) = self.coefficients();
        (self.n > 0).then_some(LineView {
            intercept,
            slope_per_ktok: slope,
            samples: self.n,
            trusted: self.ready(),
        })
    }

    /// The `x` at which the line reaches `y`: how much load a rank takes
    /// before its latency reaches an SLA. `None` when latency does not
    /// grow with load (nothing bounds it) or the fit is not ready.
    pub fn solve_for(&self, y: f64) -> Option<f64> {
        let (a, b) = self.coefficients();
        // A slope lost in rounding is no slope.
        (self.ready() && b > 1e-6 * (a.abs() + 1.0)).then(|| ((y - a) / b).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_noisy_line_and_solves_it() {
        let mut l = Line::default();
        assert_eq!(l.predict(1.0), None, "not before enough samples");
        // ttft_ms = 40 + 12 × (k tokens in flight), ±3 ms noise.
        for i in 0..400 {
            let x = f64::from(i % 40) / 4.0;
            let noise = if i % 3 == 0 { 3.0 } else { -1.5 };
            l.add(x, 40.0 + 12.0 * x + noise);
        }
        let (a, b) = l.coefficients();
        assert!((a - 40.0).abs() < 1.5 && (b - 12.0).abs() < 0.3, "{a} {b}");
        assert!((l.predict(5.0).unwrap() - 100.0).abs() < 2.0);
        let x = l.solve_for(160.0).unwrap();
        assert!((x - 10.0).abs() < 0.3, "{x}");
        l.add(f64::NAN, 1.0);
        assert_eq!(l.samples(), 400);
    }

    #[test]
    fn follows_a_change_and_refuses_a_flat_line() {
        let mut l = Line::default();
        for i in 0..300 {
            let x = f64::from(i % 10);
            l.add(x, 10.0 + x);
        }
        for i in 0..600 {
            let x = f64::from(i % 10);
            l.add(x, 10.0 + 3.0 * x);
        }
        let (_, b) = l.coefficients();
        assert!((b - 3.0).abs() < 0.1, "forgets the old slope: {b}");
        let mut flat = Line::default();
        for i in 0..50 {
            flat.add(f64::from(i), 20.0);
        }
        assert_eq!(
            flat.solve_for(100.0),
            None,
            "load does not slow it: no bound"
        );
    }
}
