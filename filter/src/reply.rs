//! Replies the filter sends itself, without contacting a worker: the
//! contract is `kvgate_core::reply`'s, shared with the ext_proc server;
//! `Host::send_reply` renders it.

pub use kvgate_core::reply::{Reason, Reply};
