//! Requests per second one replica serves within the SLA, from a profile
//! table measured beforehand (the seed's pre-deployment profiling, in its
//! simplest form): rows at given ISL/OSL, interpolated between.

use crate::config::ProfileRow;

/// The capacity at (`isl`, `osl`): inverse-distance weighting of the rows
/// in log-length space (a request's cost grows with its lengths, roughly
/// in proportion), exact at a profiled point. `None` without rows.
pub fn per_replica(rows: &[ProfileRow], isl: f64, osl: f64) -> Option<f64> {
    let point = |r: &ProfileRow| ((r.isl + 1.0).ln(), (r.osl + 1.0).ln());
    let here = ((isl.max(0.0) + 1.0).ln(), (osl.max(0.0) + 1.0).ln());
    let (mut num, mut den) = (0.0, 0.0);
    for r in rows {
        let (x, y) = point(r);
        let d2 = (x - here.0).powi(2) + (y - here.1).powi(2);
        if d2 < 1e-12 {
            return Some(r.rps);
        }
        let w = 1.0 / d2;
        // Interpolate time per request, not its inverse: costs add.
        num += w / r.rps;
        den += w;
    }
    (den > 0.0).then(|| den / num)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_between_profiled_points() {
        let rows = [
            ProfileRow {
                isl: 1000.0,
                osl: 100.0,
                rps: 10.0,
            },
            ProfileRow {
                isl: 4000.0,
                osl: 100.0,
                rps: 4.0,
            },
        ];
        assert_eq!(per_replica(&rows, 1000.0, 100.0), Some(10.0));
        let mid = per_replica(&rows, 2000.0, 100.0).unwrap();
        assert!(mid < 10.0 && mid > 4.0, "{mid}");
        assert!(
            per_replica(&rows, 8000.0, 100.0).unwrap() < mid,
            "longer prompts, less capacity"
        );
        assert_eq!(per_replica(&[], 1.0, 1.0), None);
    }
}
