//! A derivative-free minimiser (Nelder-Mead simplex) for the ARIMA fit:
//! the conditional sum of squares has no cheap gradient once moving
//! average terms enter, and with at most six parameters a simplex
//! converges in a few hundred evaluations.

/// Reflection, expansion, contraction and shrink coefficients: the
/// textbook values, which need no tuning for problems this small.
const REFLECT: f64 = 1.0;
const EXPAND: f64 = 2.0;
const CONTRACT: f64 = 0.5;
const SHRINK: f64 = 0.5;

/// Minimises `f` from `x0`, the first simplex spanning `step` along each
/// axis. Stops after `max_evals` evaluations or once the simplex's values
/// agree to `ftol` (relative). Returns the best point and its value; a
/// non-finite value counts as worse than any finite one.
pub(super) fn minimize(
    mut f: impl FnMut(&[f64]) -> f64,
    x0: &[f64],
    step: f64,
    max_evals: usize,
    ftol: f64,
) -> (Vec<f64>, f64) {
    let mut eval = |x: &[f64]| {
        let v = f(x);
        if v.is_nan() { f64::INFINITY } else { v }
    };
    let n = x0.len();
    let f0 = eval(x0);
    if n == 0 {
        return (Vec::new(), f0);
    }
    let mut simplex: Vec<(Vec<f64>, f64)> = Vec::with_capacity(n + 1);
    simplex.push((x0.to_vec(), f0));
    for i in 0..n {
        let mut x = x0.to_vec();
        x[i] += step;
        let v = eval(&x);
        simplex.push((x, v));
    }
    let mut evals = n + 1;
    let mut centroid = vec![0.0; n];
    let along = |c: &[f64], towards: &[f64], t: f64| -> Vec<f64> {
        c.iter()
            .zip(towards)
            .map(|(c, x)| c + t * (x - c))
            .collect()
    };
    loop {
        simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
        let best = simplex[0].1;
        let worst = simplex[n].1;
        let spread = worst - best;
        // Both ends finite and close: converged. An infinite worst
        // vertex keeps it going, since the spread is then infinite.
        if evals >= max_evals || spread <= ftol * (best.abs() + worst.abs()) + f64::MIN_POSITIVE {
            break;
        }
        centroid.iter_mut().for_each(|c| *c = 0.0);
        for (x, _) in &simplex[..n] {
            for (c, xi) in centroid.iter_mut().zip(x) {
                *c += xi / n as f64;
            }
        }
        let reflected = along(&centroid, &simplex[n].0, -REFLECT);
        let fr = eval(&reflected);
        evals += 1;
        if fr < best {
            let expanded = along(&centroid, &reflected, EXPAND);
            let fe = eval(&expanded);
            evals += 1;
            simplex[n] = if fe < fr {
                (expanded, fe)
            } else {
                (reflected, fr)
            };
            continue;
        }
        if fr < simplex[n - 1].1 {
            simplex[n] = (reflected, fr);
            continue;
        }
        // Contract towards the better of the reflected and worst points.
        let (towards, bar) = if fr < worst {
            (&reflected, fr)
        } else {
            (&simplex[n].0, worst)
        };
        let contracted = along(&centroid, towards, CONTRACT);
        let fc = eval(&contracted);
        evals += 1;
        if fc < bar {
            simplex[n] = (contracted, fc);
            continue;
        }
        let anchor = simplex[0].0.clone();
        for (x, v) in &mut simplex[1..] {
            *x = along(&anchor, x, SHRINK);
            *v = eval(x);
        }
        evals += n;
    }
    simplex.swap_remove(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_minimum_of_a_curved_valley() {
        // Rosenbrock: the minimum at (1, 1) lies along a bent valley.
        let rosen = |x: &[f64]| (1.0 - x[0]).powi(2) + 100.0 * (x[1] - x[0] * x[0]).powi(2);
        let (x, v) = minimize(rosen, &[-1.2, 1.0], 0.5, 5000, 1e-14);
        assert!(v < 1e-8, "{v} at {x:?}");
        assert!(
            (x[0] - 1.0).abs() < 1e-3 && (x[1] - 1.0).abs() < 1e-3,
            "{x:?}"
        );
    }

    #[test]
    fn treats_nan_as_worse_and_respects_the_budget() {
        let mut calls = 0;
        let (x, v) = minimize(
            |x: &[f64]| {
                calls += 1;
                if x[0] < 0.0 {
                    f64::NAN
                } else {
                    (x[0] - 2.0).powi(2)
                }
            },
            &[0.5],
            1.0,
            40,
            0.0,
        );
        assert!(v.is_finite() && (x[0] - 2.0).abs() < 0.1, "{x:?} {v}");
        // The budget is checked between steps: a shrink may overrun it by
        // one vertex per dimension.
        assert!(calls <= 40 + 2, "{calls} evaluations");
    }
}
