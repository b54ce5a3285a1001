//! Loopback port allocation for parallel stacks and tests.
//!
//! A port is probed, released, and bound again later by whoever asked for
//! it. Probing `:0` would hand out a port from the kernel's ephemeral range,
//! which every outgoing connection on the machine also draws from: a test's
//! client socket can take the port in that gap, and the later bind fails
//! with "address in use" (it did in CI). So ports come from below the
//! ephemeral range, where the kernel never assigns one on its own, and a
//! process-wide cursor keeps two threads of one test binary from being
//! handed the same port.

use anyhow::{Result, bail};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// Below Linux's default ephemeral range (32768–60999).
const LOW: u32 = 20_000;
const SPAN: u32 = 12_000;
const UNSEEDED: u32 = u32::MAX;

static CURSOR: AtomicU32 = AtomicU32::new(UNSEEDED);

/// `n` distinct free ports.
pub fn free_ports(n: usize) -> Result<Vec<u16>> {
    (0..n).map(|_| free_block(1)).collect()
}

/// A run of `n` consecutive free ports, for engines that put DP rank `r` on
/// `base + r`.
pub fn free_block(n: u16) -> Result<u16> {
    let n = u32::from(n);
    if n == 0 || n > SPAN {
        bail!("a block of {n} ports cannot be allocated");
    }
    for _ in 0..SPAN {
        let offset = claim(n) % SPAN;
        if offset + n > SPAN {
            continue;
        }
        let base = LOW + offset;
        let held: std::io::Result<Vec<TcpListener>> = (base..base + n)
            .map(|p| TcpListener::bind(("127.0.0.1", p as u16)))
            .collect();
        if held.is_ok() {
            return Ok(base as u16);
        }
    }
    bail!("no block of {n} consecutive free ports found")
}

/// Advances the cursor by `n` and returns where it was. The first call
/// seeds it from the process id and the clock, so test binaries that run
/// at the same time start in different places.
fn claim(n: u32) -> u32 {
    let seed = (std::process::id() ^ nanos()).wrapping_mul(2_654_435_761) % SPAN;
    let _ = CURSOR.compare_exchange(UNSEEDED, seed, Ordering::Relaxed, Ordering::Relaxed);
    CURSOR.fetch_add(n, Ordering::Relaxed)
}

fn nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ d.as_secs() as u32)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports = free_ports(64).unwrap();
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ports.len(), "{ports:?}");
        for p in ports {
            assert!((LOW..LOW + SPAN).contains(&u32::from(p)), "{p}");
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }

    #[test]
    fn a_block_is_consecutive_and_free() {
        let base = free_block(4).unwrap();
        let held: Vec<TcpListener> = (base..base + 4)
            .map(|p| TcpListener::bind(("127.0.0.1", p)).unwrap())
            .collect();
        assert_eq!(held.len(), 4);
        assert_ne!(free_block(4).unwrap(), base, "the cursor moved on");
        assert!(free_block(0).is_err());
    }
}
