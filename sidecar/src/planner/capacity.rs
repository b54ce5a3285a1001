//! Requests per second one replica serves within the SLA, from a profile
//! table measured beforehand (the seed's pre-deployment profiling, in its
//! simplest form): rows at given ISL/OSL, interpolated between, per role.

use crate::config::ProfileRow;
use kvgate_core::Role;

/// The capacity of one worker of `role` at (`isl`, `osl`): inverse-distance
/// weighting of that role's rows in log-length space (a request's cost
/// grows with its lengths, roughly in proportion), exact at a profiled
/// point. `None` without rows of the role.
pub fn per_replica(rows: &[ProfileRow], role: Role, isl: f64, osl: f64) -> Option<f64> {
    let point = |r: &ProfileRow| ((r.isl + 1.0).ln(), (r.osl + 1.0).ln());
    let here = ((isl.max(0.0) + 1.0).ln(), (osl.max(0.0) + 1.0).ln());
    let (mut num, mut den) = (0.0, 0.0);
    for r in rows.iter().filter(|r| r.role == role) {
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
        let row = |role, isl, rps| ProfileRow {
            role,
            isl,
            osl: 100.0,
            rps,
            ttft_ms: None,
            itl_ms: None,
        };
        let rows = [
            row(Role::Both, 1000.0, 10.0),
            row(Role::Both, 4000.0, 4.0),
            row(Role::Prefill, 1000.0, 50.0),
        ];
        let both = |isl| per_replica(&rows, Role::Both, isl, 100.0);
        assert_eq!(both(1000.0), Some(10.0));
        let mid = both(2000.0).unwrap();
        assert!(mid < 10.0 && mid > 4.0, "{mid}");
        assert!(both(8000.0).unwrap() < mid, "longer prompts, less capacity");
        assert_eq!(
            per_replica(&rows, Role::Prefill, 4000.0, 100.0),
            Some(50.0),
            "a role's rows only"
        );
        assert_eq!(per_replica(&rows, Role::Decode, 1.0, 1.0), None);
    }
}
