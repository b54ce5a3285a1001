use anyhow::Result;
pub fn run(_args: &[String]) -> Result<()> {
    anyhow::bail!("demo not written yet")
}
