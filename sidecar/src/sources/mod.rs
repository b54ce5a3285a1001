//! Everything the sidecar learns from outside.
//!
//! * [`metrics`]: each worker's Prometheus page, scraped for load.
//! * [`kv`]: the engines' ZMQ KV events, folded into the prefix index.
//! * `bookings`: what the gateways routed and what finished.
//! * `routed`: the gateways' routing decisions, as a routed-prefix index.
//! * `body`: every HTTP body read from a worker or peer, under a cap.
//! * [`thermal`]: GPU temperatures and power, from dcgm-exporter pages or
//!   NVML; the controller that acts on them is `crate::fleet`'s.
//!
//! A new input gets its own module here; what it produces is recorded in
//! `crate::fleet`.

pub(crate) mod body;
pub mod bookings;
pub mod kv;
pub mod metrics;
pub(crate) mod routed;
pub mod thermal;
