//! Loopback port allocation for parallel stacks.

use anyhow::{Result, bail};
use std::net::TcpListener;

/// `n` distinct free ports. They are released before use, so another process
/// could take one in between; on loopback in a test run that is rare enough.
pub fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// A run of `n` consecutive free ports, for engines that put DP rank `r` on
/// `base + r`. Searches below Linux's ephemeral range so that kernel-assigned
/// client ports do not collide with it.
pub fn free_block(n: u16) -> Result<u16> {
    let seed = std::process::id() as u64 ^ nanos();
    for attempt in 0..200u64 {
        let base = 20_000
            + ((seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(attempt * 977))
                % 12_000) as u16;
        let held: std::io::Result<Vec<TcpListener>> = (0..n)
            .map(|i| TcpListener::bind(("127.0.0.1", base + i)))
            .collect();
        if held.is_ok() {
            return Ok(base);
        }
    }
    bail!("no block of {n} consecutive free ports found")
}

fn nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64 ^ d.as_secs())
        .unwrap_or(0)
}
