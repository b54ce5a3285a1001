//! Durations in configuration files: whole milliseconds, the unit every
//! `_ms` key has always been in.

use serde::{Deserialize, Deserializer, Serializer};
use std::time::Duration;

/// Reads a non-negative integer number of milliseconds.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    u64::deserialize(d).map(Duration::from_millis)
}

/// Writes whole milliseconds, for settings the API shows back.
pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
