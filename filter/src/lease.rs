//! The poller lease: which router VM polls the sidecar when there is no
//! snapshot service.
//!
//! Envoy Gateway and Istio load HTTP filters only, so no bootstrap singleton
//! runs there. With `"poller": "lease"` every worker thread's router root
//! ticks, and the one holding the lease in shared data plays the snapshot
//! service's part (poll, write shared data, forward bookings and reports);
//! the others only read, as they do in singleton mode. The holder renews the
//! lease every tick with a compare-and-swap; a root that finds it expired
//! takes it over with a compare-and-swap on the value it read, so of several
//! contenders exactly one wins. A holder whose renewal fails has lost it and
//! stops at once.
//!
//! The record is 16 bytes, the holder's random id and the lease's expiry on
//! Envoy's clock, both little-endian. Anything else reads as no lease.

pub const KEY: &str = "kvgate.lease";
const LEN: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub holder: u64,
    pub expires_ms: u64,
}

impl Record {
    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..8].copy_from_slice(&self.holder.to_le_bytes());
        b[8..].copy_from_slice(&self.expires_ms.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Record> {
        let (holder, expires) = b.split_at_checked(8)?;
        Some(Record {
            holder: u64::from_le_bytes(holder.try_into().ok()?),
            expires_ms: u64::from_le_bytes(expires.try_into().ok()?),
        })
    }
}

/// What a tick should do about the lease, given the record read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Write this record with the compare-and-swap value read: a renewal
    /// when this root holds the lease, a takeover when it had expired.
    Write(Record),
    /// Another root holds a live lease.
    Follow,
}

/// One root's side of the lease.
#[derive(Debug, Clone, Copy)]
pub struct Lease {
    /// Random per root, so roots of several VMs never share an id.
    pub me: u64,
    pub term_ms: u64,
}

impl Lease {
    pub fn step(&self, current: Option<&[u8]>, now_ms: u64) -> Step {
        let mine = Record {
            holder: self.me,
            expires_ms: now_ms.saturating_add(self.term_ms),
        };
        match current.and_then(Record::decode) {
            Some(r) if r.holder != self.me && r.expires_ms > now_ms => Step::Follow,
            _ => Step::Write(mine),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Lease = Lease {
        me: 1,
        term_ms: 1000,
    };
    const B: Lease = Lease {
        me: 2,
        term_ms: 1000,
    };

    fn rec(holder: u64, expires_ms: u64) -> Vec<u8> {
        Record { holder, expires_ms }.encode().to_vec()
    }

    #[test]
    fn an_absent_or_unreadable_lease_is_taken() {
        let take = Step::Write(Record {
            holder: 1,
            expires_ms: 1500,
        });
        assert_eq!(A.step(None, 500), take);
        for junk in [&b""[..], b"short", &[0u8; 17]] {
            assert_eq!(A.step(Some(junk), 500), take, "{junk:?}");
        }
    }

    #[test]
    fn a_live_lease_of_another_is_followed_and_an_expired_one_taken() {
        let held = rec(2, 1000);
        assert_eq!(A.step(Some(&held), 999), Step::Follow);
        assert_eq!(
            A.step(Some(&held), 1000),
            Step::Write(Record {
                holder: 1,
                expires_ms: 2000
            }),
            "expired at its deadline"
        );
    }

    #[test]
    fn the_holder_renews_its_own_lease_even_late() {
        // A holder that ticks late (its lease ran out) renews it unless
        // someone took it meanwhile, which its compare-and-swap then tells.
        for now in [10, 5000] {
            assert_eq!(
                B.step(Some(&rec(2, 1000)), now),
                Step::Write(Record {
                    holder: 2,
                    expires_ms: now + 1000
                })
            );
        }
    }

    #[test]
    fn records_round_trip() {
        let r = Record {
            holder: u64::MAX,
            expires_ms: 42,
        };
        assert_eq!(Record::decode(&r.encode()), Some(r));
    }
}
