//! Durations in configuration files: whole milliseconds, the unit every
//! `_ms` key has always been in.

use serde::{Deserialize, Deserializer};
use std::time::Duration;

/// Reads a non-negative integer number of milliseconds.
pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    u64::deserialize(d).map(Duration::from_millis)
}
