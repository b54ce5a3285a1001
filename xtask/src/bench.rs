//! `cargo xtask bench`: placeholder until the benchmark suite lands.
use anyhow::Result;
pub fn run(_args: &[String]) -> Result<()> {
    anyhow::bail!("benchmarks are not written yet")
}
