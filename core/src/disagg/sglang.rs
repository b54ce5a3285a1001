//! SGLang's protocol, as its router (`mini_lb`) speaks it: both legs get
//! the same body, the client's with `bootstrap_host`, `bootstrap_port`
//! (the prefill worker's bootstrap server) and `bootstrap_room` added, and
//! are sent at once. The decode worker connects to the prefill worker's
//! bootstrap server and joins the room; the prefill finishes only once it
//! has, so waiting for the prefill's answer before sending the decode leg
//! deadlocks.
//!
//! The body keeps the client's bytes verbatim, as [`super::nixl`]'s
//! rewrites do. The three fields are kvgate's alone: a client's copies are
//! replaced, for a client choosing the room or the host could join another
//! request's transfer or send a decode worker to any host.
//!
//! With data-parallel attention each side serves the request on rank
//! `bootstrap_room % dp_size`: [`room`] picks a room that lands on the
//! ranks the plan chose on both workers.

use super::nixl::{BodyError, Fields, push_key};

/// The fields kvgate adds, in the order it adds them.
pub const FIELDS: [&str; 3] = ["bootstrap_host", "bootstrap_port", "bootstrap_room"];

/// The largest room: SGLang's rooms are u63 (its router draws them with
/// `random.randint(0, 2**63 - 1)`).
pub const ROOM_MAX: u64 = (1 << 63) - 1;

/// Candidate rooms tried before settling for the prefill rank alone:
/// `decode size / gcd(sizes)` of them hold every solution, which is at
/// most a DP size; this bounds the search for sizes no fleet has.
const MAX_STEPS: u64 = 1 << 16;

/// A rank within a worker: its index (0-based, in the worker's rank order)
/// and the worker's number of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rank {
    pub index: u32,
    pub size: u32,
}

impl Rank {
    /// The size (at least 1) and the index within it.
    fn normal(self) -> (u64, u64) {
        let size = u64::from(self.size.max(1));
        (size, u64::from(self.index) % size)
    }
}

/// A bootstrap room and whether it lands on both chosen ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub room: u64,
    /// False when no u63 room lands on both (the sizes' common factor
    /// sends the two ranks apart): the room lands on the prefill rank
    /// only, and the decode worker serves it on `room % its size`.
    pub both: bool,
}

/// The room for a request from `start` (any random u64): the first room
/// from `start`'s block of `lcm(sizes)` rooms on that lands on `prefill`'s
/// rank and on `decode`'s. Deterministic in `start`, and as random as
/// `start` within the rooms that fit. When no room fits both, the prefill
/// rank decides: the prefill leg books that rank's prompt, and a decode
/// rank other than the plan's costs balance, not correctness.
pub fn room(start: u64, prefill: Rank, decode: Rank) -> Room {
    let start = start & ROOM_MAX;
    let (p_size, p) = prefill.normal();
    let (d_size, d) = decode.normal();
    let g = gcd(p_size, d_size);
    let steps = d_size / g;
    if p % g == d % g && steps <= MAX_STEPS {
        // Every solution is p + k·p_size for some k below steps, modulo
        // the lcm; search from the start of start's block of lcm rooms.
        let lcm = u128::from(p_size / g) * u128::from(d_size);
        let start = u128::from(start);
        let base = start - start % lcm;
        for k in 0..u128::from(steps) {
            let r = base + u128::from(p) + k * u128::from(p_size);
            if r % u128::from(d_size) != u128::from(d) {
                continue;
            }
            // Past the last room: the block's solution, one block down;
            // with no block below, no u63 room fits both.
            let r = if r > u128::from(ROOM_MAX) && r >= lcm {
                r - lcm
            } else {
                r
            };
            if let Ok(room) = u64::try_from(r)
                && room <= ROOM_MAX
            {
                return Room { room, both: true };
            }
            break;
        }
    }
    Room {
        room: prefill_room(start, p_size, p),
        both: d_size == 1,
    }
}

/// A room on the prefill rank alone, next to `start`.
fn prefill_room(start: u64, size: u64, index: u64) -> u64 {
    let r = start - start % size + index;
    // Above the last room means start's block is the last, and holds
    // start above index: the block below has the room.
    if r > ROOM_MAX { r - size } else { r }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A well-mixed u64 from a counter (splitmix64's finaliser): a VM draws
/// rooms from one random seed without a random source per request.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The bootstrap host of a worker whose endpoint is `ip:port` (as the
/// catalog normalises it): the IP, without an IPv6 address's brackets, as
/// SGLang's router takes the host of the prefill worker's URL.
pub fn bootstrap_host(endpoint: &str) -> &str {
    let host = endpoint.rsplit_once(':').map_or(endpoint, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// The body both legs get: the client's own bytes with `bootstrap_host`,
/// `bootstrap_port` and `bootstrap_room` added before the closing brace.
/// A client that sent any of them has them dropped (its other values kept
/// verbatim) and kvgate's added after its other fields.
pub fn body(client: &[u8], host: &str, port: u16, room: u64) -> Result<Vec<u8>, BodyError> {
    let fields = Fields::parse(client)?;
    let host = serde_json::to_string(host)?;
    let port = port.to_string();
    let room = room.to_string();
    let ours = [host.as_str(), port.as_str(), room.as_str()];
    let mut out = Vec::with_capacity(client.len() + 96);
    let rest = if FIELDS.iter().any(|f| fields.get(f).is_some()) {
        // Re-written field by field: each raw value as it came.
        out.push(b'{');
        for (k, v) in fields
            .0
            .iter()
            .filter(|(k, _)| !FIELDS.contains(&k.as_ref()))
        {
            if out.len() > 1 {
                out.push(b',');
            }
            push_key(&mut out, k);
            out.extend_from_slice(v.get().as_bytes());
        }
        &b"}"[..]
    } else {
        // The object ends with its closing brace (trailing white space
        // aside): the parse above saw all of it.
        let end = client
            .iter()
            .rposition(|b| *b == b'}')
            .ok_or(BodyError::NotAnObject)?;
        out.extend_from_slice(&client[..end]);
        &client[end..]
    };
    let mut comma = !fields.0.iter().all(|(k, _)| FIELDS.contains(&k.as_ref()));
    for (k, v) in FIELDS.iter().zip(ours) {
        if comma {
            out.push(b',');
        }
        comma = true;
        push_key(&mut out, k);
        out.extend_from_slice(v.as_bytes());
    }
    out.extend_from_slice(rest);
    Ok(out)
}

#[cfg(test)]
mod tests;
