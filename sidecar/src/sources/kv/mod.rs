//! The KV event plane: engines' ZMQ KV events in, a prefix index and its
//! published shards out.
//!
//! * [`wire`] / [`msgpack`]: decoding vLLM and SGLang batches, every shape.
//! * [`stage`]: a whole batch decoded and hashed before it is applied.
//! * [`index`]: which worker-rank slots hold which blocks, per tier.
//! * [`dump`]: the index in a recovery format, for a peer starting up.
//! * `seq`, [`replay`], `subscriber`: one subscriber per rank with gap
//!   detection and replay; `socket`: the limits both of their sockets take.
//! * [`plane`]: the index thread and the versioned shard log.

pub mod dump;
pub mod index;
pub mod msgpack;
pub mod plane;
pub mod replay;
pub(crate) mod seq;
pub(crate) mod socket;
pub mod stage;
pub(crate) mod subscriber;
pub mod wire;
