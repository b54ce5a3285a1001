//! The manifest: the small shared-data value every request reads.
//!
//! Written by the snapshot service after each poll response, read by every
//! router VM per request. It says which snapshot version is current (so a VM
//! re-reads the snapshot only when it changed) and when the sidecar was last
//! heard from, on Envoy's own clock.

pub const KEY: &str = "kvgate.manifest";
pub const SNAPSHOT_KEY: &str = "kvgate.snapshot";
pub const LEN: usize = 32;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Manifest {
    pub snapshot_version: u64,
    pub update_version: u64,
    pub epoch: u64,
    /// Envoy time (ms) of the last good poll response.
    pub fresh_at_ms: u64,
}

impl Manifest {
    /// The manifest in shared data; `None` when absent or not a manifest.
    pub fn read(h: &impl crate::host::Host) -> Option<Manifest> {
        h.get_shared(KEY).and_then(|b| Manifest::decode(&b))
    }

    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        for (i, v) in [
            self.snapshot_version,
            self.update_version,
            self.epoch,
            self.fresh_at_ms,
        ]
        .into_iter()
        .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Option<Manifest> {
        if b.len() != LEN {
            return None;
        }
        let word = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i * 8..i * 8 + 8]);
            u64::from_le_bytes(a)
        };
        Some(Manifest {
            snapshot_version: word(0),
            update_version: word(1),
            epoch: word(2),
            fresh_at_ms: word(3),
        })
    }

    /// Whether state this old may still be used.
    pub fn is_fresh(&self, now_ms: u64, stale_after_ms: u64) -> bool {
        self.snapshot_version > 0 && now_ms.saturating_sub(self.fresh_at_ms) <= stale_after_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bad_lengths() {
        let m = Manifest {
            snapshot_version: 3,
            update_version: 9,
            epoch: 77,
            fresh_at_ms: 1_700_000_000_000,
        };
        assert_eq!(Manifest::decode(&m.encode()), Some(m));
        assert_eq!(Manifest::decode(&[0; 31]), None);
        assert_eq!(Manifest::decode(&[]), None);
    }

    #[test]
    fn freshness() {
        let m = Manifest {
            snapshot_version: 1,
            fresh_at_ms: 1000,
            ..Default::default()
        };
        assert!(m.is_fresh(1500, 500));
        assert!(!m.is_fresh(1501, 500));
        assert!(m.is_fresh(900, 500), "a clock step back is not staleness");
        assert!(
            !Manifest::default().is_fresh(0, 500),
            "no snapshot yet is stale"
        );
    }
}
