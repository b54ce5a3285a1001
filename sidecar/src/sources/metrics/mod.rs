//! Engine load from each worker's Prometheus page.
//!
//! * [`scrape`]: fetching a page with a timeout and a size bound.
//! * [`promtext`]: parsing it, and reading vLLM's and SGLang's load series
//!   per DP rank.

pub mod promtext;
pub mod scrape;
