//! Gateway bookings: the load a routed request puts on its rank, known to
//! the gateway before any engine metric shows it.
//!
//! Engines report load on a scrape interval, and a burst arrives faster than
//! that. So every routed request *books* its load at once: its uncached
//! prompt tokens as prefill until the first response byte, then its blocks
//! as decode load until the response ends. Router VMs write [`Event`]s into
//! a shared queue; the snapshot service forwards them in batches to the
//! sidecar, which merges them with engine metrics and echoes, per VM, the
//! highest booking it has applied (so a VM knows which of its own bookings
//! the snapshot already counts).
//!
//! A booking is named by [`Key`]: the VM's random tag and a sequence number
//! that only grows within that VM. Events of one VM reach the sidecar in
//! order (one queue, one batch in flight), so the sidecar never sees a
//! request finish before it was booked.
//!
//! The wire form is a concatenation of records, each a tag byte and fixed
//! little-endian fields, with strings as a u16 length and UTF-8 bytes.
//! A local reply's reason travels as its [`Reason`] code (tag 6); tag 4,
//! the reason as its name, is still read so that filters of the previous
//! release keep reporting during a rolling upgrade (sidecars first).
//! Likewise a booking carries its tenant (tag 9), and tag 1, without one,
//! is still read as the default tenant's.

use crate::plan::Leg;
use crate::reply::Reason;
use crate::state::DEFAULT_TENANT;
use crate::wire::{Reader, WireError};
use thiserror::Error;

/// Names one booking: unique per gateway VM, ordered within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Random per router VM, drawn when it starts.
    pub vm: u64,
    /// 1, 2, 3... per VM.
    pub seq: u64,
}

/// One thing that happened to a request at the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Routed: `prefill_tokens` and `decode_blocks` now load `slot`, on
    /// behalf of `tenant` (at most [`MAX_TENANT_LEN`] bytes), whose share
    /// of the model's booked load the sidecar tallies.
    Book {
        key: Key,
        model: String,
        slot: u16,
        prefill_tokens: u32,
        decode_blocks: u32,
        tenant: String,
    },
    /// The first response byte: prefill is over.
    FirstByte { key: Key },
    /// The response ended, in any way: the booking is released. Filters
    /// that time their requests say how it went (the planner's
    /// observations); older ones send no timing.
    Done { key: Key, timing: Option<Timing> },
    /// Answered locally, for `reason`.
    Rejected { model: String, reason: Reason },
    /// The VM is alive, sent about once a second while its root ticks:
    /// a VM that goes silent (it trapped and was reloaded, or its Envoy
    /// went away) has its bookings ended long before their expiry.
    Alive { vm: u64 },
}

/// A booking without its tenant: read as [`DEFAULT_TENANT`]'s, no longer
/// written. Drop it once no filter of a release before
/// [`TAG_BOOK_TENANT`] can be running.
const TAG_BOOK: u8 = 1;
const TAG_FIRST_BYTE: u8 = 2;
const TAG_DONE: u8 = 3;
/// The reason as its `x-kvgate-reason` name: read, no longer written.
/// Drop it in the release after the one that introduced
/// [`TAG_REJECTED_CODE`], once no filter of the release before can be
/// running.
const TAG_REJECTED_NAME: u8 = 4;
const TAG_DONE_TIMED: u8 = 5;
const TAG_REJECTED_CODE: u8 = 6;
/// Read by sidecars since the release that added it; a filter that
/// sends it needs such a sidecar (upgrade sidecars first): an older one
/// refuses the whole batch for the unknown tag.
const TAG_ALIVE: u8 = 7;
/// A timed end with its leg, the leg's status and the client's own time
/// to first byte. Written for every timed end since the release that
/// added it (upgrade sidecars first, as for [`TAG_ALIVE`]); tag 5 is
/// still read, as a request served whole with no status.
const TAG_DONE_LEG: u8 = 8;
/// A booking with its request's tenant after the model. Written for every
/// booking since the release that added it (upgrade sidecars first, as
/// for [`TAG_ALIVE`]).
const TAG_BOOK_TENANT: u8 = 9;

/// The longest tenant a booking carries, in bytes. Sidecars keep every
/// live booking's tenant and tally load per tenant, so a name from a
/// request header must not cost them more than this; a longer one is
/// refused, and the encoder cuts one to it.
pub const MAX_TENANT_LEN: usize = 256;

/// How one leg of a routed request went, as its gateway saw it. A
/// request served whole has one leg; a disaggregated one a prefill leg
/// and a decode leg, each booked and timed on its own worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timing {
    /// Which leg this is: what the worker was asked to compute.
    pub leg: Leg,
    /// From the leg's dispatch to its first response byte (0: none came).
    /// A decode leg's clock starts when it is sent, after the prefill
    /// leg answered: it is the decode worker's own time to first token.
    pub first_byte_us: u32,
    /// From the leg's dispatch to the end of its response.
    pub total_us: u32,
    /// The prompt's length in tokens (estimated for text).
    pub isl_tokens: u32,
    /// Tokens the response carried, as far as the gateway can tell: its
    /// streamed events, else the request's `max_tokens` (0: unknown).
    pub output_tokens: u32,
    /// The leg's HTTP status; 0 when unknown (a reset, or a filter of a
    /// release before the leg's tag).
    pub status: u16,
    /// From the decision to the client's first response byte (0: none
    /// came): on a split request it spans both legs and the transfer,
    /// on one served whole it is `first_byte_us` plus the time from the
    /// decision to the dispatch.
    pub client_first_byte_us: u32,
}
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BookingError {
    #[error("booking record {0}")]
    Wire(#[from] WireError),
    #[error("unknown booking record tag {tag} at byte {at}")]
    UnknownTag { tag: u8, at: usize },
    /// A rejection whose reason this build does not know: a code from a
    /// newer filter, or a name no filter sends.
    #[error("unknown rejection reason in the record at byte {at}")]
    UnknownReason { at: usize },
    /// A timed end whose leg this build does not know.
    #[error("unknown leg in the record at byte {at}")]
    UnknownLeg { at: usize },
    #[error(
        "booking record at byte {at}: a tenant of {len} bytes, more than the {MAX_TENANT_LEN} a booking may carry"
    )]
    TenantTooLong { len: usize, at: usize },
}

impl Event {
    /// Appends the record to `out`. Strings longer than 64 KiB are cut at a
    /// character boundary (model names are far shorter), and a tenant
    /// longer than [`MAX_TENANT_LEN`] at the last one within it: callers
    /// refuse such a tenant first, or it books as a shorter one.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Event::Book {
                key,
                model,
                slot,
                prefill_tokens,
                decode_blocks,
                tenant,
            } => {
                out.push(TAG_BOOK_TENANT);
                put_key(out, key);
                out.extend_from_slice(&slot.to_le_bytes());
                out.extend_from_slice(&prefill_tokens.to_le_bytes());
                out.extend_from_slice(&decode_blocks.to_le_bytes());
                put_str(out, model);
                put_str(out, cut(tenant, MAX_TENANT_LEN));
            }
            Event::FirstByte { key } => {
                out.push(TAG_FIRST_BYTE);
                put_key(out, key);
            }
            Event::Done { key, timing: None } => {
                out.push(TAG_DONE);
                put_key(out, key);
            }
            Event::Done {
                key,
                timing: Some(t),
            } => {
                out.push(TAG_DONE_LEG);
                put_key(out, key);
                out.push(t.leg.code());
                out.extend_from_slice(&t.status.to_le_bytes());
                for v in [
                    t.first_byte_us,
                    t.total_us,
                    t.isl_tokens,
                    t.output_tokens,
                    t.client_first_byte_us,
                ] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Event::Rejected { model, reason } => {
                out.push(TAG_REJECTED_CODE);
                put_str(out, model);
                out.push(reason.code());
            }
            Event::Alive { vm } => {
                out.push(TAG_ALIVE);
                out.extend_from_slice(&vm.to_le_bytes());
            }
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(48);
        self.encode_into(&mut out);
        out
    }
}

/// Decodes a batch of concatenated records. A bad record fails the whole
/// batch: its length is unknown, so nothing after it can be trusted.
pub fn decode_batch(bytes: &[u8]) -> Result<Vec<Event>, BookingError> {
    let mut r = Reader::new(bytes);
    let mut out = Vec::new();
    while !r.is_empty() {
        let at = r.pos();
        let tag = r.u8()?;
        let ev = match tag {
            TAG_BOOK | TAG_BOOK_TENANT => {
                let key = key(&mut r)?;
                let slot = r.u16()?;
                let prefill_tokens = r.u32()?;
                let decode_blocks = r.u32()?;
                let model = r.string16()?;
                let tenant = match tag {
                    TAG_BOOK => DEFAULT_TENANT,
                    _ => r.str16()?,
                };
                if tenant.len() > MAX_TENANT_LEN {
                    return Err(BookingError::TenantTooLong {
                        len: tenant.len(),
                        at,
                    });
                }
                Event::Book {
                    key,
                    model,
                    slot,
                    prefill_tokens,
                    decode_blocks,
                    tenant: tenant.to_string(),
                }
            }
            TAG_FIRST_BYTE => Event::FirstByte { key: key(&mut r)? },
            TAG_DONE => Event::Done {
                key: key(&mut r)?,
                timing: None,
            },
            TAG_DONE_TIMED => {
                let key = key(&mut r)?;
                let first_byte_us = r.u32()?;
                Event::Done {
                    key,
                    timing: Some(Timing {
                        leg: Leg::Whole,
                        first_byte_us,
                        total_us: r.u32()?,
                        isl_tokens: r.u32()?,
                        output_tokens: r.u32()?,
                        status: 0,
                        client_first_byte_us: first_byte_us,
                    }),
                }
            }
            TAG_DONE_LEG => {
                let key = key(&mut r)?;
                let leg = Leg::from_code(r.u8()?).ok_or(BookingError::UnknownLeg { at })?;
                Event::Done {
                    key,
                    timing: Some(Timing {
                        leg,
                        status: r.u16()?,
                        first_byte_us: r.u32()?,
                        total_us: r.u32()?,
                        isl_tokens: r.u32()?,
                        output_tokens: r.u32()?,
                        client_first_byte_us: r.u32()?,
                    }),
                }
            }
            TAG_REJECTED_CODE => {
                let model = r.string16()?;
                let reason = Reason::from_code(r.u8()?);
                Event::Rejected {
                    model,
                    reason: reason.ok_or(BookingError::UnknownReason { at })?,
                }
            }
            TAG_REJECTED_NAME => {
                let model = r.string16()?;
                let reason = Reason::from_name(&r.string16()?);
                Event::Rejected {
                    model,
                    reason: reason.ok_or(BookingError::UnknownReason { at })?,
                }
            }
            TAG_ALIVE => Event::Alive { vm: r.u64()? },
            tag => return Err(BookingError::UnknownTag { tag, at }),
        };
        out.push(ev);
    }
    Ok(out)
}

fn put_key(out: &mut Vec<u8>, key: &Key) {
    out.extend_from_slice(&key.vm.to_le_bytes());
    out.extend_from_slice(&key.seq.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let s = cut(s, u16::MAX as usize);
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// `s` up to the last character boundary within `max` bytes.
fn cut(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn key(r: &mut Reader<'_>) -> Result<Key, WireError> {
    Ok(Key {
        vm: r.u64()?,
        seq: r.u64()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(seq: u64) -> Key {
        Key { vm: 0xfeed, seq }
    }

    #[test]
    fn a_batch_round_trips() {
        let events = vec![
            Event::Book {
                key: key(1),
                model: "Qwen/Qwen3-0.6B".into(),
                slot: 7,
                prefill_tokens: 1200,
                decode_blocks: 80,
                tenant: "team-a".into(),
            },
            Event::FirstByte { key: key(1) },
            Event::Rejected {
                model: "m".into(),
                reason: Reason::AllWorkersBusy,
            },
            Event::Done {
                key: key(1),
                timing: None,
            },
            Event::Done {
                key: key(2),
                timing: Some(Timing {
                    leg: Leg::Whole,
                    first_byte_us: 120_000,
                    total_us: 900_000,
                    isl_tokens: 2048,
                    output_tokens: 64,
                    status: 200,
                    client_first_byte_us: 121_000,
                }),
            },
            Event::Done {
                key: key(3),
                timing: Some(Timing {
                    leg: Leg::Prefill,
                    first_byte_us: 40_000,
                    total_us: 40_000,
                    isl_tokens: 2048,
                    output_tokens: 1,
                    status: 503,
                    client_first_byte_us: 0,
                }),
            },
            Event::Alive { vm: 0xfeed },
        ];
        let mut bytes = Vec::new();
        for e in &events {
            e.encode_into(&mut bytes);
        }
        assert_eq!(decode_batch(&bytes).unwrap(), events);
        assert_eq!(decode_batch(&[]).unwrap(), vec![]);
    }

    /// A timed end as filters of the release before tag 8 write it is a
    /// request served whole, with no status, whose client waited as long
    /// as its one leg.
    #[test]
    fn an_older_timed_end_reads_as_a_whole_leg() {
        let mut old = vec![TAG_DONE_TIMED];
        put_key(&mut old, &key(4));
        for v in [7u32, 9, 100, 3] {
            old.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(
            decode_batch(&old).unwrap(),
            vec![Event::Done {
                key: key(4),
                timing: Some(Timing {
                    leg: Leg::Whole,
                    first_byte_us: 7,
                    total_us: 9,
                    isl_tokens: 100,
                    output_tokens: 3,
                    status: 0,
                    client_first_byte_us: 7,
                }),
            }]
        );
        let mut bad = Event::Done {
            key: key(5),
            timing: Some(Timing::default()),
        }
        .encode();
        bad[17] = 3;
        assert_eq!(decode_batch(&bad), Err(BookingError::UnknownLeg { at: 0 }));
    }

    /// A booking as filters of a release before tag 9 write it: no
    /// tenant, so the default one's.
    #[test]
    fn a_booking_without_a_tenant_is_the_default_tenants() {
        let mut old = vec![TAG_BOOK];
        put_key(&mut old, &key(6));
        old.extend_from_slice(&3u16.to_le_bytes());
        old.extend_from_slice(&100u32.to_le_bytes());
        old.extend_from_slice(&7u32.to_le_bytes());
        put_str(&mut old, "m");
        let new = Event::Book {
            key: key(6),
            model: "m".into(),
            slot: 3,
            prefill_tokens: 100,
            decode_blocks: 7,
            tenant: DEFAULT_TENANT.into(),
        };
        assert_eq!(decode_batch(&old).unwrap(), vec![new.clone()]);
        // The same record, with the tenant after the model.
        let mut with = new.encode();
        assert_eq!(with[0], TAG_BOOK_TENANT);
        with[0] = TAG_BOOK;
        with.truncate(old.len());
        assert_eq!(with, old);
    }

    #[test]
    fn an_over_long_tenant_is_refused_and_never_written() {
        let book = |tenant: String| Event::Book {
            key: key(1),
            model: "m".into(),
            slot: 0,
            prefill_tokens: 1,
            decode_blocks: 1,
            tenant,
        };
        let longest = "é".repeat(MAX_TENANT_LEN / 2);
        let e = book(longest.clone());
        assert_eq!(decode_batch(&e.encode()).unwrap(), vec![e]);
        // The encoder cuts at the last character within the bound.
        let over = format!("x{longest}");
        assert_eq!(
            decode_batch(&book(over).encode()).unwrap(),
            vec![book(format!("x{}", "é".repeat(MAX_TENANT_LEN / 2 - 1)))]
        );
        // A hostile writer's longer one fails the batch, wherever it is.
        let mut batch = Event::FirstByte { key: key(1) }.encode();
        let at = batch.len();
        batch.extend_from_slice(&book(String::new()).encode());
        batch.truncate(batch.len() - 2);
        put_str(&mut batch, &"t".repeat(MAX_TENANT_LEN + 1));
        let err = decode_batch(&batch).unwrap_err();
        assert_eq!(
            err,
            BookingError::TenantTooLong {
                len: MAX_TENANT_LEN + 1,
                at
            }
        );
        assert!(err.to_string().contains("257 bytes"), "{err}");
        // And one that claims more bytes than are present is truncated.
        batch.truncate(batch.len() - MAX_TENANT_LEN - 3);
        batch.extend_from_slice(&u16::MAX.to_le_bytes());
        batch.extend_from_slice(b"tt");
        assert!(matches!(
            decode_batch(&batch),
            Err(BookingError::Wire(WireError::Truncated { .. }))
        ));
    }

    #[test]
    fn bad_input_is_an_error_naming_the_byte() {
        let mut bytes = Event::Done {
            key: key(3),
            timing: None,
        }
        .encode();
        bytes.pop();
        assert!(matches!(
            decode_batch(&bytes),
            Err(BookingError::Wire(WireError::Truncated { offset: 9, .. }))
        ));
        assert_eq!(
            decode_batch(&[10, 0, 0]),
            Err(BookingError::UnknownTag { tag: 10, at: 0 })
        );
        let mut bad = Event::Rejected {
            model: "ab".into(),
            reason: Reason::BadRequest,
        }
        .encode();
        bad[3] = 0xff;
        assert_eq!(
            decode_batch(&bad),
            Err(BookingError::Wire(WireError::BadUtf8 { offset: 3 }))
        );
    }

    /// A rejection as filters of the previous release write it: tag 4,
    /// the model, then the reason's name.
    fn by_name(model: &str, reason: &str) -> Vec<u8> {
        let mut out = vec![TAG_REJECTED_NAME];
        put_str(&mut out, model);
        put_str(&mut out, reason);
        out
    }

    #[test]
    fn a_reason_by_name_or_by_code_is_the_same_rejection() {
        for reason in Reason::ALL {
            let by_code = Event::Rejected {
                model: "m".into(),
                reason,
            }
            .encode();
            assert_eq!(by_code[0], TAG_REJECTED_CODE);
            assert_eq!(
                decode_batch(&by_name("m", reason.as_str())).unwrap(),
                decode_batch(&by_code).unwrap()
            );
        }
    }

    #[test]
    fn unknown_reasons_are_refused() {
        let mut batch = Event::FirstByte { key: key(1) }.encode();
        let at = batch.len();
        let mut hostile = Event::Rejected {
            model: "m".into(),
            reason: Reason::Thermal,
        }
        .encode();
        *hostile.last_mut().unwrap() = Reason::ALL.len() as u8;
        batch.extend_from_slice(&hostile);
        assert_eq!(
            decode_batch(&batch),
            Err(BookingError::UnknownReason { at })
        );
        *batch.last_mut().unwrap() = u8::MAX;
        assert_eq!(
            decode_batch(&batch),
            Err(BookingError::UnknownReason { at })
        );
        for name in ["busy", "", "ALL_WORKERS_BUSY", "thermal ", "x\u{0}"] {
            assert_eq!(
                decode_batch(&by_name("m", name)),
                Err(BookingError::UnknownReason { at: 0 }),
                "{name:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_batch(&bytes);
        }

        #[test]
        fn books_round_trip(
            vm: u64,
            seq: u64,
            slot: u16,
            p: u32,
            d: u32,
            model in "\\PC{0,40}",
            tenant in "\\PC{0,64}",
        ) {
            let e = Event::Book { key: Key { vm, seq }, model, slot, prefill_tokens: p, decode_blocks: d, tenant };
            prop_assert_eq!(decode_batch(&e.encode()).unwrap(), vec![e]);
        }
    }
}
