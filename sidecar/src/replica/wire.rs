//! The replica-sync message: a batch of lifecycle events from one sidecar.
//!
//! ```text
//! message   = magic "KVGR" | version u8 | origin u64 | seq u64 | sent_at_ms u64
//!             | count u16 | event*count | mac?
//! event     = tag u8 | holder | body
//! holder    = 1 vm u64 seq u64            (a request an Envoy VM routed)
//!           | 2 id str16                  (a selection API reservation)
//! admit     = tag 1 | holder | rank | prefill_tokens u64 | decode_blocks u64
//! admit_for = tag 4 | holder | rank | prefill_tokens u64 | decode_blocks u64
//!             | request_tenant str16
//! rank      = model str16 | tenant str16 | block_size u32 | worker_id u64 | dp_rank u32
//! prefill   = tag 2 | holder              (prefill complete)
//! free      = tag 3 | holder
//! mac       = HMAC-SHA256(control token, everything before it), 32 bytes
//! ```
//!
//! Little-endian; `str16` is a u16 length and UTF-8 bytes. An admission
//! names the worker and rank, never a slot: slot numbers are local to each
//! sidecar. The MAC is present exactly when the sender has a control token;
//! a receiver with a token refuses messages without a valid one, so a
//! process that is not a peer cannot book load into the fleet.
//!
//! An admission's load counts towards the tenant whose request booked it
//! (tenant fairness adds every gateway's up). The rank's `tenant` names
//! the worker; a request is placed on its own tenant's workers, so that is
//! the request's tenant too, and tag 1 says so. Tag 4 carries the request's
//! tenant after the load, and is written only for one that is not the
//! rank's (a booking from a filter of the release before tenants, which
//! reads as the default tenant's, on another tenant's worker): peers of
//! the release before it refuse the message for the unknown tag, so in a
//! mixed fleet tag 1 is what they meet. A request's tenant is at most
//! `booking::MAX_TENANT_LEN` bytes; a longer one is refused.
//!
//! Version 2 stamps each message, under the MAC, so that a signed message
//! recorded off the wire cannot book its load again (`replay`): `origin`
//! is drawn at random when the sender starts (it is the sender's epoch:
//! a restarted sidecar is a new origin), `seq` counts the origin's
//! messages from 1, and `sent_at_ms` is the sender's Unix time. Version 1
//! had none of the three and is refused.

use hmac::{Hmac, Mac};
use kvgate_core::booking::{Key, MAX_TENANT_LEN};
use kvgate_core::wire::{Reader, WireError};
use sha2::Sha256;
use std::sync::Arc;
use thiserror::Error;

const MAGIC: &[u8; 4] = b"KVGR";
const VERSION: u8 = 2;
const MAC_LEN: usize = 32;
/// Events per message at most; a sender splits longer batches.
pub const MAX_EVENTS: usize = 512;

/// Which message of which sender, and when it was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The sender's id, random at each start.
    pub origin: u64,
    /// The message's number among the origin's, from 1.
    pub seq: u64,
    /// The sender's Unix time in milliseconds.
    pub sent_at_ms: u64,
}

impl Stamp {
    /// Message `seq` of `origin`, sent now.
    pub fn now(origin: u64, seq: u64) -> Stamp {
        Stamp {
            origin,
            seq,
            sent_at_ms: crate::clock::now_ms(),
        }
    }
}

/// Who an event is about, as the sending sidecar names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SyncId {
    Gateway(Key),
    Reservation(Arc<str>),
}

/// Where an admission booked its load, by names every sidecar shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub model: String,
    /// The worker's tenant: part of the rank's name.
    pub tenant: String,
    /// The tenant whose request booked the load.
    pub request_tenant: String,
    pub block_size: u32,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncEvent {
    Admit(SyncId, Placed),
    PrefillComplete(SyncId),
    Free(SyncId),
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SyncError {
    #[error("replica-sync message {0}")]
    Wire(#[from] WireError),
    #[error("not a replica-sync message (magic {0:02x?})")]
    Magic([u8; 4]),
    #[error(
        "replica-sync version {0} from a peer running another kvgate: this sidecar speaks version {VERSION} (sequenced messages), so every peer must run a release that does"
    )]
    Version(u8),
    #[error("unknown replica-sync tag {tag} at byte {at}")]
    Tag { tag: u8, at: usize },
    #[error("replica-sync message without a valid MAC for this sidecar's control token")]
    Unauthenticated,
    #[error("{0} bytes after the last event")]
    Trailing(usize),
    #[error(
        "replica-sync admission at byte {at} for a tenant of {len} bytes, more than the {MAX_TENANT_LEN} a booking may carry"
    )]
    TenantTooLong { len: usize, at: usize },
}

impl SyncError {
    /// The refusal's reason, as metrics label it.
    pub fn reason(&self) -> &'static str {
        match self {
            SyncError::Version(_) => "version",
            SyncError::Unauthenticated => "unauthenticated",
            SyncError::Wire(_)
            | SyncError::Magic(_)
            | SyncError::Tag { .. }
            | SyncError::Trailing(_)
            | SyncError::TenantTooLong { .. } => "malformed",
        }
    }
}

type HmacSha256 = Hmac<Sha256>;

fn mac(key: &[u8], bytes: &[u8]) -> Option<[u8; MAC_LEN]> {
    let mut m = HmacSha256::new_from_slice(key).ok()?;
    m.update(bytes);
    Some(m.finalize().into_bytes().into())
}

/// Encodes `events` (at most [`MAX_EVENTS`]) as the message `stamp` names,
/// signed with `token` when there is one.
pub fn encode(stamp: &Stamp, events: &[SyncEvent], token: Option<&str>) -> Vec<u8> {
    let events = &events[..events.len().min(MAX_EVENTS)];
    let mut out = Vec::with_capacity(HEADER + events.len() * 64);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&stamp.origin.to_le_bytes());
    out.extend_from_slice(&stamp.seq.to_le_bytes());
    out.extend_from_slice(&stamp.sent_at_ms.to_le_bytes());
    out.extend_from_slice(&(events.len() as u16).to_le_bytes());
    for e in events {
        match e {
            SyncEvent::Admit(id, p) => {
                let own = p.request_tenant == p.tenant;
                out.push(if own { 1 } else { 4 });
                put_id(&mut out, id);
                put_str(&mut out, &p.model);
                put_str(&mut out, &p.tenant);
                out.extend_from_slice(&p.block_size.to_le_bytes());
                out.extend_from_slice(&p.worker_id.to_le_bytes());
                out.extend_from_slice(&p.dp_rank.to_le_bytes());
                out.extend_from_slice(&p.prefill_tokens.to_le_bytes());
                out.extend_from_slice(&p.decode_blocks.to_le_bytes());
                if !own {
                    put_str(&mut out, &p.request_tenant);
                }
            }
            SyncEvent::PrefillComplete(id) => {
                out.push(2);
                put_id(&mut out, id);
            }
            SyncEvent::Free(id) => {
                out.push(3);
                put_id(&mut out, id);
            }
        }
    }
    if let Some(sig) = token.and_then(|t| mac(t.as_bytes(), &out)) {
        out.extend_from_slice(&sig);
    }
    out
}

/// magic, version, origin, seq, sent_at_ms, count.
const HEADER: usize = 4 + 1 + 8 + 8 + 8 + 2;

/// Bytes of a message besides its events: the header, and the MAC when
/// signed.
fn overhead(signed: bool) -> usize {
    HEADER + if signed { MAC_LEN } else { 0 }
}

/// The most bytes `encode` writes for one event (strings may be cut
/// shorter at a character boundary, never longer).
pub fn encoded_len(e: &SyncEvent) -> usize {
    let s = |s: &str| 2 + s.len().min(usize::from(u16::MAX));
    let id = |id: &SyncId| match id {
        SyncId::Gateway(_) => 1 + 8 + 8,
        SyncId::Reservation(r) => 1 + s(r),
    };
    match e {
        SyncEvent::Admit(i, p) => {
            let request_tenant = if p.request_tenant == p.tenant {
                0
            } else {
                s(&p.request_tenant)
            };
            1 + id(i) + s(&p.model) + s(&p.tenant) + 4 + 8 + 4 + 8 + 8 + request_tenant
        }
        SyncEvent::PrefillComplete(i) | SyncEvent::Free(i) => 1 + id(i),
    }
}

/// Cuts `events` into runs that each encode to at most `max_bytes` and
/// [`MAX_EVENTS`] events, in order, so that no receiver's frame-size cap
/// is ever hit by this sender. An event too large on its own is a run by
/// itself, which the caller must not send. The format is untouched: each
/// run is an ordinary message.
pub fn split(events: &[SyncEvent], max_bytes: usize, signed: bool) -> Vec<&[SyncEvent]> {
    let mut runs = Vec::new();
    let mut start = 0;
    let mut bytes = overhead(signed);
    for (i, e) in events.iter().enumerate() {
        let len = encoded_len(e);
        if i > start && (bytes + len > max_bytes || i - start == MAX_EVENTS) {
            runs.push(&events[start..i]);
            start = i;
            bytes = overhead(signed);
        }
        bytes += len;
    }
    if start < events.len() {
        runs.push(&events[start..]);
    }
    runs
}

/// Decodes a message; with a `token`, only one it signed. Returns its
/// stamp and its events. A bad message is refused whole.
pub fn decode(bytes: &[u8], token: Option<&str>) -> Result<(Stamp, Vec<SyncEvent>), SyncError> {
    let body = match token {
        None => bytes,
        Some(t) => {
            let split = bytes
                .len()
                .checked_sub(MAC_LEN)
                .ok_or(SyncError::Unauthenticated)?;
            let (body, sig) = bytes.split_at(split);
            let mut m =
                HmacSha256::new_from_slice(t.as_bytes()).map_err(|_| SyncError::Unauthenticated)?;
            m.update(body);
            // `verify_slice` compares in constant time.
            m.verify_slice(sig)
                .map_err(|_| SyncError::Unauthenticated)?;
            body
        }
    };
    let mut r = Reader::new(body);
    let magic = r.array::<4>()?;
    if &magic != MAGIC {
        return Err(SyncError::Magic(magic));
    }
    let version = r.u8()?;
    if version != VERSION {
        return Err(SyncError::Version(version));
    }
    let stamp = Stamp {
        origin: r.u64()?,
        seq: r.u64()?,
        sent_at_ms: r.u64()?,
    };
    let count = r.u16()?;
    // The smallest event is a tag, a holder kind and an empty id.
    r.plausible(u32::from(count), 4, "replica-sync events")?;
    let mut events = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let at = r.pos();
        let tag = r.u8()?;
        let id = id(&mut r)?;
        events.push(match tag {
            1 | 4 => {
                let model = r.string16()?;
                let tenant = r.string16()?;
                let (block_size, worker_id, dp_rank) = (r.u32()?, r.u64()?, r.u32()?);
                let (prefill_tokens, decode_blocks) = (r.u64()?, r.u64()?);
                let request_tenant = match tag {
                    4 => {
                        let t = r.str16()?;
                        if t.len() > MAX_TENANT_LEN {
                            return Err(SyncError::TenantTooLong { len: t.len(), at });
                        }
                        t.to_string()
                    }
                    _ => tenant.clone(),
                };
                SyncEvent::Admit(
                    id,
                    Placed {
                        model,
                        tenant,
                        request_tenant,
                        block_size,
                        worker_id,
                        dp_rank,
                        prefill_tokens,
                        decode_blocks,
                    },
                )
            }
            2 => SyncEvent::PrefillComplete(id),
            3 => SyncEvent::Free(id),
            tag => return Err(SyncError::Tag { tag, at }),
        });
    }
    if !r.is_empty() {
        // Without a token this is also where a signed message lands: the
        // sender has a token and this sidecar has none.
        return Err(SyncError::Trailing(r.remaining()));
    }
    Ok((stamp, events))
}

fn put_id(out: &mut Vec<u8>, id: &SyncId) {
    match id {
        SyncId::Gateway(k) => {
            out.push(1);
            out.extend_from_slice(&k.vm.to_le_bytes());
            out.extend_from_slice(&k.seq.to_le_bytes());
        }
        SyncId::Reservation(s) => {
            out.push(2);
            put_str(out, s);
        }
    }
}

fn id(r: &mut Reader<'_>) -> Result<SyncId, SyncError> {
    let at = r.pos();
    match r.u8()? {
        1 => Ok(SyncId::Gateway(Key {
            vm: r.u64()?,
            seq: r.u64()?,
        })),
        2 => Ok(SyncId::Reservation(r.str16()?.into())),
        tag => Err(SyncError::Tag { tag, at }),
    }
}

/// Strings longer than 64 KiB are cut at a character boundary; the API
/// refuses ids and names that long before they get here.
fn put_str(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(usize::from(u16::MAX));
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stamp(origin: u64) -> Stamp {
        Stamp {
            origin,
            seq: 3,
            sent_at_ms: 1_700_000_000_000,
        }
    }

    fn events() -> Vec<SyncEvent> {
        let gw = SyncId::Gateway(Key { vm: 9, seq: 4 });
        let res = SyncId::Reservation("request-123".into());
        vec![
            SyncEvent::Admit(
                gw.clone(),
                Placed {
                    model: "Qwen/Qwen3-0.6B".into(),
                    tenant: "default".into(),
                    request_tenant: "default".into(),
                    block_size: 16,
                    worker_id: 3,
                    dp_rank: 1,
                    prefill_tokens: 1200,
                    decode_blocks: 80,
                },
            ),
            SyncEvent::PrefillComplete(gw.clone()),
            SyncEvent::Free(gw),
            SyncEvent::Admit(
                res.clone(),
                Placed {
                    model: "m".into(),
                    tenant: "team-a".into(),
                    request_tenant: "default".into(),
                    block_size: 16,
                    worker_id: 4,
                    dp_rank: 0,
                    prefill_tokens: 10,
                    decode_blocks: 2,
                },
            ),
            SyncEvent::Free(res),
        ]
    }

    /// An admission for the rank's own tenant is tag 1, as peers of the
    /// release before request tenants write and read it; one for another
    /// tenant is tag 4, with the request's tenant last.
    #[test]
    fn an_admission_names_its_requests_tenant_only_when_not_the_ranks() {
        let e = events();
        let msg = encode(&stamp(1), &e[..1], None);
        assert_eq!(msg[HEADER], 1);
        // As the release before wrote it: the same bytes, read as the
        // rank's tenant's.
        let (_, back) = decode(&msg, None).unwrap();
        let SyncEvent::Admit(_, p) = &back[0] else {
            panic!("{back:?}")
        };
        assert_eq!(
            (p.tenant.as_str(), p.request_tenant.as_str()),
            ("default", "default")
        );
        let other = encode(&stamp(1), &e[3..4], None);
        assert_eq!(other[HEADER], 4);
        assert_eq!(&other[other.len() - 9..], b"\x07\0default");
        assert_eq!(decode(&other, None).unwrap().1, e[3..4]);
    }

    #[test]
    fn an_over_long_request_tenant_is_refused() {
        let admit = |len: usize| {
            let mut e = events().swap_remove(3);
            if let SyncEvent::Admit(_, p) = &mut e {
                p.request_tenant = "t".repeat(len);
            }
            vec![e]
        };
        let longest = admit(MAX_TENANT_LEN);
        let msg = encode(&stamp(1), &longest, None);
        assert_eq!(decode(&msg, None).unwrap().1, longest);
        let msg = encode(&stamp(1), &admit(MAX_TENANT_LEN + 1), None);
        let err = decode(&msg, None).unwrap_err();
        assert_eq!(
            err,
            SyncError::TenantTooLong {
                len: MAX_TENANT_LEN + 1,
                at: HEADER
            }
        );
        assert_eq!(err.reason(), "malformed");
    }

    #[test]
    fn a_message_round_trips_signed_and_unsigned() {
        let e = events();
        assert_eq!(
            decode(&encode(&stamp(77), &e, None), None),
            Ok((stamp(77), e.clone()))
        );
        let signed = encode(&stamp(77), &e, Some("s3cret"));
        assert_eq!(decode(&signed, Some("s3cret")), Ok((stamp(77), e)));
    }

    #[test]
    fn a_receiver_with_a_token_refuses_what_that_token_did_not_sign() {
        let e = events();
        let unsigned = encode(&stamp(1), &e, None);
        assert_eq!(
            decode(&unsigned, Some("s3cret")),
            Err(SyncError::Unauthenticated)
        );
        let other = encode(&stamp(1), &e, Some("other"));
        assert_eq!(
            decode(&other, Some("s3cret")),
            Err(SyncError::Unauthenticated)
        );
        let mut forged = encode(&stamp(1), &e, Some("s3cret"));
        forged[20] ^= 1;
        assert_eq!(
            decode(&forged, Some("s3cret")),
            Err(SyncError::Unauthenticated)
        );
        assert_eq!(decode(&[], Some("s3cret")), Err(SyncError::Unauthenticated));
        // And one without a token cannot read a signed one as events.
        assert!(matches!(
            decode(&encode(&stamp(1), &e, Some("s3cret")), None),
            Err(SyncError::Trailing(32))
        ));
    }

    #[test]
    fn bad_messages_are_errors() {
        assert!(matches!(decode(b"KV", None), Err(SyncError::Wire(_))));
        assert!(matches!(decode(b"nope", None), Err(SyncError::Magic(_))));
        assert!(matches!(
            decode(b"XXXX\x01\0\0\0\0\0\0\0\0\0\0", None),
            Err(SyncError::Magic(_))
        ));
        let mut v = encode(&stamp(1), &[], None);
        v[4] = 9;
        assert_eq!(decode(&v, None), Err(SyncError::Version(9)));
        // A count the bytes cannot hold is refused before allocating.
        let mut huge = encode(&stamp(1), &[], None);
        huge[HEADER - 2..HEADER].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(
            decode(&huge, None),
            Err(SyncError::Wire(WireError::ImplausibleCount { .. }))
        ));
        let mut bad_tag = encode(&stamp(1), &events()[2..3], None);
        bad_tag[HEADER] = 7;
        assert!(matches!(
            decode(&bad_tag, None),
            Err(SyncError::Tag { tag: 7, .. })
        ));
    }

    /// A version-1 message, as a peer on an older release sends it: no
    /// sequence number or time.
    fn version_one(token: Option<&str>) -> Vec<u8> {
        let mut v = b"KVGR\x01".to_vec();
        v.extend_from_slice(&9u64.to_le_bytes());
        v.extend_from_slice(&1u16.to_le_bytes());
        v.extend_from_slice(&[3, 2, 1, 0, b'r']);
        if let Some(sig) = token.and_then(|t| mac(t.as_bytes(), &v)) {
            v.extend_from_slice(&sig);
        }
        v
    }

    #[test]
    fn a_version_one_message_is_refused_saying_why() {
        for token in [None, Some("s3cret")] {
            let e = decode(&version_one(token), token).unwrap_err();
            assert_eq!(e, SyncError::Version(1));
            assert_eq!(e.reason(), "version");
            let why = e.to_string();
            assert!(
                why.contains("version 1") && why.contains("version 2"),
                "{why}"
            );
        }
    }

    #[test]
    fn the_stamp_is_under_the_mac() {
        let mut m = encode(&stamp(5), &events(), Some("s3cret"));
        // The sequence number's low byte: a replayer cannot renumber.
        m[13] ^= 1;
        assert_eq!(decode(&m, Some("s3cret")), Err(SyncError::Unauthenticated));
        let (s, _) = decode(&encode(&stamp(5), &[], None), None).unwrap();
        assert_eq!(s, stamp(5));
    }

    fn admit(id: &str, model_len: usize) -> SyncEvent {
        SyncEvent::Admit(
            SyncId::Reservation(id.into()),
            Placed {
                model: "m".repeat(model_len),
                tenant: "t".into(),
                request_tenant: "t".into(),
                block_size: 16,
                worker_id: 1,
                dp_rank: 0,
                prefill_tokens: 10,
                decode_blocks: 1,
            },
        )
    }

    #[test]
    fn batches_split_under_the_byte_cap_in_order() {
        const CAP: usize = 1 << 20;
        // 64 KiB names: sixteen of these are over a MiB, far under the
        // event count limit.
        let big: Vec<SyncEvent> = (0..40)
            .map(|i| admit(&format!("r{i}"), 60_000))
            .chain(events())
            .collect();
        for signed in [false, true] {
            let token = signed.then_some("s3cret");
            let runs = split(&big, CAP, signed);
            assert!(runs.len() >= 3, "{} runs", runs.len());
            let mut back = Vec::new();
            for run in &runs {
                let msg = encode(&stamp(7), run, token);
                assert!(msg.len() <= CAP, "{} bytes", msg.len());
                // Packed: the next event would not have fitted.
                back.extend(decode(&msg, token).unwrap().1);
            }
            assert_eq!(back, big);
            for w in runs.windows(2) {
                let next = &w[1][0];
                assert!(encode(&stamp(7), w[0], token).len() + encoded_len(next) > CAP);
            }
        }
    }

    #[test]
    fn batches_split_at_the_event_count_too() {
        let many: Vec<SyncEvent> = (0..MAX_EVENTS * 2 + 1)
            .map(|i| SyncEvent::Free(SyncId::Reservation(i.to_string().into())))
            .collect();
        let runs = split(&many, 1 << 20, false);
        assert_eq!(
            runs.iter().map(|r| r.len()).collect::<Vec<_>>(),
            [MAX_EVENTS, MAX_EVENTS, 1]
        );
        assert!(split(&[], 1 << 20, false).is_empty());
    }

    #[test]
    fn encoded_len_is_exact_for_ordinary_events() {
        for e in events().into_iter().chain([admit("x", 300)]) {
            let alone = encode(&stamp(1), std::slice::from_ref(&e), None).len();
            assert_eq!(alone, overhead(false) + encoded_len(&e));
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes, None);
            let _ = decode(&bytes, Some("t"));
        }

        #[test]
        fn every_prefix_of_a_message_is_refused(cut in 0usize..200) {
            let full = encode(&stamp(5), &events(), None);
            prop_assume!(cut < full.len());
            prop_assert!(decode(&full[..cut], None).is_err());
        }
    }
}
