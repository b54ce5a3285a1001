//! This VM's decoded snapshot, re-read only when the manifest names a new
//! version.

use kvgate_core::{Snapshot, SnapshotError};

#[derive(Debug, Default)]
pub(crate) struct View {
    pub snapshot: Option<Snapshot>,
    pub version: u64,
}

impl View {
    /// Decodes the snapshot `read` returns when `version` differs from the
    /// cached one. Returns whether the view changed; a snapshot that does
    /// not decode leaves the old view in place.
    pub fn refresh(
        &mut self,
        version: u64,
        read: impl FnOnce() -> Option<Vec<u8>>,
    ) -> Result<bool, SnapshotError> {
        if version == self.version && self.snapshot.is_some() {
            return Ok(false);
        }
        let Some(bytes) = read() else {
            return Ok(false);
        };
        let snap = Snapshot::decode(&bytes)?;
        self.version = snap.version;
        self.snapshot = Some(snap);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_once_per_version() {
        let s = Snapshot {
            version: 5,
            ..Default::default()
        };
        let bytes = s.encode().unwrap();
        let mut v = View::default();
        let mut reads = 0;
        for _ in 0..2 {
            v.refresh(5, || {
                reads += 1;
                Some(bytes.clone())
            })
            .unwrap();
        }
        assert_eq!(reads, 1);
        assert_eq!(v.version, 5);
        assert!(v.refresh(6, || Some(vec![1, 2, 3])).is_err());
        assert_eq!(v.version, 5, "a bad snapshot keeps the old view");
        assert!(v.snapshot.is_some());
    }
}
