//! This VM's decoded snapshot, re-read only when the manifest names a new
//! version.

use kvgate_core::{Snapshot, SnapshotError};

#[derive(Debug, Default)]
pub(crate) struct View {
    pub snapshot: Option<Snapshot>,
    pub version: u64,
    /// The sidecar epoch the version is of: a restarted sidecar numbers
    /// its snapshots anew.
    epoch: u64,
    /// The snapshot before the current one, whose allocations the next
    /// one is decoded into ([`Snapshot::decode_into`]): under load most
    /// requests find a new version.
    spare: Snapshot,
}

impl View {
    /// Decodes the snapshot `read` returns unless the view already holds
    /// `version` of `epoch`, or a later one (the root's tick may have read
    /// ahead of a request's manifest). Returns whether the view changed; a
    /// snapshot that does not decode leaves the old view in place.
    pub fn refresh(
        &mut self,
        epoch: u64,
        version: u64,
        read: impl FnOnce() -> Option<Vec<u8>>,
    ) -> Result<bool, SnapshotError> {
        if self.snapshot.is_some() && epoch == self.epoch && version <= self.version {
            return Ok(false);
        }
        let Some(bytes) = read() else {
            return Ok(false);
        };
        // Into the spare, so that a snapshot that does not decode leaves
        // the current one as it was.
        self.spare.decode_into(&bytes)?;
        self.version = self.spare.version;
        self.epoch = epoch;
        let new = std::mem::take(&mut self.spare);
        if let Some(old) = self.snapshot.replace(new) {
            self.spare = old;
        }
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
            v.refresh(1, 5, || {
                reads += 1;
                Some(bytes.clone())
            })
            .unwrap();
        }
        assert_eq!(reads, 1);
        assert_eq!(v.version, 5);
        assert!(v.refresh(1, 6, || Some(vec![1, 2, 3])).is_err());
        assert_eq!(v.version, 5, "a bad snapshot keeps the old view");
        assert_eq!(v.snapshot.as_ref(), Some(&s));
    }

    #[test]
    fn an_older_version_keeps_a_newer_view_until_the_epoch_changes() {
        let bytes = |version| {
            Snapshot {
                version,
                ..Default::default()
            }
            .encode()
            .unwrap()
        };
        let mut v = View::default();
        assert_eq!(v.refresh(1, 7, || Some(bytes(7))), Ok(true));
        let unread = || -> Option<Vec<u8>> { panic!("read again") };
        assert_eq!(v.refresh(1, 6, unread), Ok(false), "an older manifest");
        assert_eq!(v.refresh(1, 7, unread), Ok(false));
        // A restarted sidecar's versions start over.
        assert_eq!(v.refresh(2, 1, || Some(bytes(1))), Ok(true));
        assert_eq!(v.version, 1);
    }

    #[test]
    fn each_version_decodes_whole_into_the_spare_of_the_last() {
        let snap = |version: u64, endpoint: &str| {
            let mut s = kvgate_core::Snapshot {
                version,
                ..Default::default()
            };
            s.models.push(kvgate_core::ModelState {
                name: "m".into(),
                workers: vec![kvgate_core::WorkerState {
                    id: version,
                    endpoint: endpoint.into(),
                    ..Default::default()
                }],
                ..Default::default()
            });
            s
        };
        let mut v = View::default();
        let versions = [
            snap(1, "10.0.0.1:8000"),
            snap(2, "10.0.0.2:8000"),
            snap(3, "10.0.0.3:8000"),
            Snapshot {
                version: 4,
                ..Default::default()
            },
            snap(5, "10.0.0.5:8000"),
        ];
        for s in &versions {
            let bytes = s.encode().unwrap();
            assert_eq!(v.refresh(1, s.version, || Some(bytes)), Ok(true));
            assert_eq!(v.snapshot.as_ref(), Some(s));
            // A bad one between versions changes nothing the next sees.
            assert!(v.refresh(1, s.version + 100, || Some(vec![0; 3])).is_err());
            assert_eq!(v.snapshot.as_ref(), Some(s));
        }
    }
}
