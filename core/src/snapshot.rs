//! The snapshot: everything the filter needs to decide, in one versioned,
//! little-endian, length-checked byte string.
//!
//! The sidecar encodes a [`Snapshot`]; Envoy's singleton service stores the
//! bytes in shared data; each filter VM decodes them once per version. The
//! format is built for that path:
//!
//! * a fixed header (magic, major/minor, payload length, version, build time)
//!   so a reader can reject foreign or truncated input before parsing;
//! * every model, worker and rank record is prefixed with its own length, so
//!   a newer minor version can append fields and an older reader skips them;
//! * an unknown *major* version is refused outright with
//!   [`SnapshotError::UnsupportedMajor`].
//!
//! Decoding never panics and never trusts a count: each count is checked
//! against the bytes that remain before anything is allocated.

use crate::disagg::Conditional;
use crate::disagg::pull::{Links, Pull};
use crate::fit::{Fit, WorkerFits};
use crate::state::{
    Applied, DEFAULT_BOOTSTRAP_PORT, DEFAULT_TENANT, Disaggregation, ModelPlan, ModelState,
    OnPrefillFailure, Policy, Protocol, RankLoad, Role, Slo, Snapshot, TenantLoad, Thermal,
    ThermalState, Thresholds, Topology, WorkerState,
};
use crate::wire::{Reader, WireError};
use thiserror::Error;

/// Leading bytes of every snapshot.
pub const MAGIC: [u8; 4] = *b"KVGS";
/// Major version this build reads and writes.
pub const MAJOR: u16 = 1;
/// Minor version this build writes. Readers accept any minor of [`MAJOR`].
pub const MINOR: u16 = 11;
/// Header: magic, major, minor, payload length, version, build time.
pub const HEADER_LEN: usize = 4 + 2 + 2 + 4 + 8 + 8;

/// Why a byte string is not a snapshot this build can use.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SnapshotError {
    #[error("snapshot {0}")]
    Wire(#[from] WireError),
    #[error("not a kvgate snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot major version {found} is not supported (this build reads {supported})")]
    UnsupportedMajor { found: u16, supported: u16 },
    #[error("snapshot payload length {declared} does not match the {actual} bytes present")]
    LengthMismatch { declared: usize, actual: usize },
    #[error("snapshot record at offset {offset} declares length {len}, shorter than its fields")]
    RecordTooShort { offset: usize, len: usize },
    #[error("snapshot field {field} is too large to encode")]
    TooLarge { field: &'static str },
}

// Fixed part of each record, after its own length prefix. A record's length
// must cover at least this much; extra bytes are fields from a newer minor.
const MODEL_FIXED: usize = 2 + 1 + 8 + 8 + 8 + 4 + 4; // name len, threshold flags, 3 thresholds, shard count, worker count
const WORKER_FIXED: usize = 8 + 2 + 4 + 4; // id, endpoint len, block size, rank count
const RANK_FIXED: usize = 4 + 2 + 8 * 5 + 4 + 4 + 1;

/// The cost weights, in their wire order.
const POLICY_LEN: usize = 6 * 8;
/// A worker's thermal record (minor 6): state, cap, in flight, heat; then
/// its flags (draining).
const THERMAL_LEN: usize = 1 + 4 + 4 + 8 + 1;
const WORKER_DRAINING: u8 = 1;
/// A model's plan (minor 6): desired, ready, scale-up ETA.
const PLAN_LEN: usize = 3 * 4;
/// A worker's role (minor 8).
const ROLE_LEN: usize = 1;
/// A worker's SGLang bootstrap port (minor 8, after the role).
const BOOTSTRAP_PORT_LEN: usize = 2;
/// A model's disaggregation (minor 8), written whole even when the model
/// has none so its length is fixed: flags (present), protocol, on prefill
/// failure, max uncached tokens, max uncached ratio, prefill timeout (ms),
/// decode affinity.
const DISAGG_LEN: usize = 1 + 1 + 1 + 8 + 8 + 8 + 8;
const DISAGG_PRESENT: u8 = 1;
/// A model's Retry-After per pool (minor 9): prefill, decode.
const POOL_RETRY_LEN: usize = 2 * 4;
/// A model's bound on requests in flight per decode worker (minor 10): 0
/// is none.
const DECODE_REQUESTS_LEN: usize = 8;
/// A model's SLO (minor 10, after the request bound): TTFT, ITL (ms).
const SLO_LEN: usize = 2 * 4;
/// The least a model's tenants take (minor 10, after the SLO): their u16
/// count; then per tenant its name (str16), its booked prefill tokens
/// and decode blocks (u64 each).
const TENANTS_LEN: usize = 2;
const TENANT_MIN: usize = 2 + 8 + 8;
/// A worker's latency fits (minor 10, after the bootstrap port), written
/// whole even when it has none so its length is fixed: flags (present),
/// then TTFT's and ITL's intercept, slope, samples and age.
const FITS_LEN: usize = 1 + 2 * FIT_LEN;
const FIT_LEN: usize = 4 + 4 + 4 + 4;
const FITS_PRESENT: u8 = 1;
/// A worker's topology (minor 11, after the fits): its node and rack
/// (str16 each; empty is unknown).
const TOPOLOGY_MIN: usize = 2 + 2;
/// A model's pull settings (minor 11, after the tenants), written whole
/// even when it has none so its length is fixed: flags (present), the
/// floor in blocks (u32), KV bytes per token (u64), prefill tokens per
/// second, then the same-node, same-rack and elsewhere links (Gbit/s).
const PULL_LEN: usize = 1 + 4 + 8 + 8 + 3 * 8;
const PULL_PRESENT: u8 = 1;
const FAIL_LOCAL: u8 = 0;
const FAIL_FAIL: u8 = 1;

const FLAG_BUSY: u8 = 1;
const TH_DECODE: u8 = 1;
const TH_PREFILL: u8 = 2;
const TH_FRAC: u8 = 4;

impl Snapshot {
    /// Encodes into a fresh buffer.
    pub fn encode(&self) -> Result<Vec<u8>, SnapshotError> {
        let mut out = Vec::with_capacity(self.encoded_len_hint());
        self.encode_into(&mut out)?;
        Ok(out)
    }

    fn encoded_len_hint(&self) -> usize {
        HEADER_LEN
            + 4
            + self
                .models
                .iter()
                .map(|m| {
                    4 + MODEL_FIXED
                        + m.name.len()
                        + 8
                        + POLICY_LEN
                        + 8
                        + 8
                        + PLAN_LEN
                        + DISAGG_LEN
                        + POOL_RETRY_LEN
                        + DECODE_REQUESTS_LEN
                        + SLO_LEN
                        + TENANTS_LEN
                        + PULL_LEN
                        + m.tenants
                            .iter()
                            .map(|t| TENANT_MIN + t.tenant.len())
                            .sum::<usize>()
                        + m.workers
                            .iter()
                            .map(|w| {
                                4 + WORKER_FIXED
                                    + w.endpoint.len()
                                    + w.ranks.len() * (2 + RANK_FIXED)
                                    + 2
                                    + w.tenant.len()
                                    + THERMAL_LEN
                                    + ROLE_LEN
                                    + BOOTSTRAP_PORT_LEN
                                    + FITS_LEN
                                    + TOPOLOGY_MIN
                                    + w.topology.node.len()
                                    + w.topology.rack.len()
                            })
                            .sum::<usize>()
                })
                .sum::<usize>()
    }

    /// Appends the encoding to `out` (which may already hold other bytes).
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), SnapshotError> {
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&MAJOR.to_le_bytes());
        out.extend_from_slice(&MINOR.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // payload length, patched below
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.built_at_ms.to_le_bytes());
        put_count(out, self.models.len(), "models")?;
        for m in &self.models {
            let rec = begin_record(out);
            put_str(out, &m.name, "model name")?;
            let t = &m.thresholds;
            let mut flags = 0u8;
            if t.active_decode_blocks.is_some() {
                flags |= TH_DECODE;
            }
            if t.active_prefill_tokens.is_some() {
                flags |= TH_PREFILL;
            }
            if t.active_prefill_tokens_frac.is_some() {
                flags |= TH_FRAC;
            }
            out.push(flags);
            out.extend_from_slice(&t.active_decode_blocks.unwrap_or(0.0).to_le_bytes());
            out.extend_from_slice(&t.active_prefill_tokens.unwrap_or(0).to_le_bytes());
            out.extend_from_slice(&t.active_prefill_tokens_frac.unwrap_or(0.0).to_le_bytes());
            out.extend_from_slice(&m.shard_count.to_le_bytes());
            put_count(out, m.workers.len(), "workers")?;
            for w in &m.workers {
                let wrec = begin_record(out);
                out.extend_from_slice(&w.id.to_le_bytes());
                put_str(out, &w.endpoint, "worker endpoint")?;
                out.extend_from_slice(&w.block_size.to_le_bytes());
                put_count(out, w.ranks.len(), "ranks")?;
                for r in &w.ranks {
                    // Rank records are small and numerous: a u16 length suffices.
                    let at = out.len();
                    out.extend_from_slice(&0u16.to_le_bytes());
                    out.extend_from_slice(&r.rank.to_le_bytes());
                    out.extend_from_slice(&r.slot.to_le_bytes());
                    for v in [
                        r.active_prefill_tokens,
                        r.active_decode_blocks,
                        r.kv_used_blocks,
                        r.kv_total_blocks,
                        r.max_num_batched_tokens,
                    ] {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                    out.extend_from_slice(&r.running.to_le_bytes());
                    out.extend_from_slice(&r.waiting.to_le_bytes());
                    out.push(if r.busy { FLAG_BUSY } else { 0 });
                    let len = (out.len() - at - 2) as u16;
                    out[at..at + 2].copy_from_slice(&len.to_le_bytes());
                }
                // Minor 2 fields follow the ranks; older readers skip them.
                put_str(out, &w.tenant, "worker tenant")?;
                // Minor 6: the thermal record.
                let t = &w.thermal;
                out.push(t.state.code());
                out.extend_from_slice(&t.cap.to_le_bytes());
                out.extend_from_slice(&t.in_flight.to_le_bytes());
                out.extend_from_slice(&t.heat.to_le_bytes());
                out.push(if w.draining { WORKER_DRAINING } else { 0 });
                // Minor 8: the role.
                out.push(w.role.code());
                out.extend_from_slice(&w.bootstrap_port.to_le_bytes());
                // Minor 10: the latency fits.
                put_fits(out, w.fits.as_ref());
                // Minor 11: where it runs.
                put_str(out, &w.topology.node, "worker node")?;
                put_str(out, &w.topology.rack, "worker rack")?;
                end_record(out, wrec, "worker record")?;
            }
            // Minor 1 fields follow the workers; older readers skip them.
            out.extend_from_slice(&m.retry_after_s.to_le_bytes());
            // Minor 3: the adapters, a count and strings.
            put_count(out, m.lora_adapters.len(), "lora adapters")?;
            for a in &m.lora_adapters {
                put_str(out, a, "lora adapter")?;
            }
            // Minor 4: the cost weights.
            for w in policy_weights(&m.policy) {
                out.extend_from_slice(&w.to_le_bytes());
            }
            // Minor 5: the service rate.
            out.extend_from_slice(&m.service_rate_per_s.to_le_bytes());
            // Minor 6: the heat weight and the plan.
            out.extend_from_slice(&m.policy.thermal_weight.to_le_bytes());
            for v in [m.plan.desired, m.plan.ready, m.plan.scale_up_eta_s] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            // Minor 7: the prompt template's version.
            out.extend_from_slice(&m.prompt_template.to_le_bytes());
            // Minor 8: the disaggregation.
            put_disaggregation(out, m.disaggregation.as_ref());
            // Minor 9: Retry-After per pool.
            for v in m.retry_after_by_pool_s {
                out.extend_from_slice(&v.to_le_bytes());
            }
            // Minor 10: the bound on a decode worker's requests.
            out.extend_from_slice(&t.active_decode_requests.unwrap_or(0).to_le_bytes());
            // Minor 10, after it: the SLO.
            out.extend_from_slice(&m.slo.ttft_ms.to_le_bytes());
            out.extend_from_slice(&m.slo.itl_ms.to_le_bytes());
            // Minor 10, after the SLO: each tenant's booked load.
            let n = u16::try_from(m.tenants.len())
                .map_err(|_| SnapshotError::TooLarge { field: "tenants" })?;
            out.extend_from_slice(&n.to_le_bytes());
            for t in &m.tenants {
                put_str(out, &t.tenant, "tenant")?;
                out.extend_from_slice(&t.prefill_tokens.to_le_bytes());
                out.extend_from_slice(&t.decode_blocks.to_le_bytes());
            }
            // Minor 11: the pull settings.
            put_pull(out, m.disaggregation.as_ref().and_then(|d| d.pull.as_ref()));
            end_record(out, rec, "model record")?;
        }
        put_count(out, self.applied.len(), "applied bookings")?;
        for a in &self.applied {
            out.extend_from_slice(&a.vm.to_le_bytes());
            out.extend_from_slice(&a.seq.to_le_bytes());
        }
        let payload = out.len() - start - HEADER_LEN;
        let payload =
            u32::try_from(payload).map_err(|_| SnapshotError::TooLarge { field: "payload" })?;
        out[start + 8..start + 12].copy_from_slice(&payload.to_le_bytes());
        Ok(())
    }

    /// Decodes a snapshot, validating every length against the input.
    pub fn decode(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        let mut snap = Snapshot::default();
        snap.decode_into(bytes)?;
        Ok(snap)
    }

    /// [`Snapshot::decode`] into `self`, reusing its allocations: its
    /// models', workers' and ranks' vectors and their strings. A router
    /// VM under load finds a new snapshot on most requests (the sidecar
    /// republishes as loads move), and allocating and freeing every
    /// worker's strings was most of decoding one. Every field is written;
    /// on an error `self` holds a mix of old and new and must be decoded
    /// into again before it is read.
    pub fn decode_into(&mut self, bytes: &[u8]) -> Result<(), SnapshotError> {
        let header = Header::parse(bytes)?;
        let mut r = Reader::at(bytes, HEADER_LEN);
        let model_count = r.u32()?;
        r.plausible(model_count, 4 + MODEL_FIXED, "models")?;
        reuse_each(&mut self.models, model_count as usize, |old| {
            decode_model(&mut record32(&mut r, MODEL_FIXED)?, old)
        })?;
        // Minor 0 ends after the models.
        self.applied.clear();
        if r.remaining() > 0 {
            let count = r.u32()?;
            r.plausible(count, 16, "applied bookings")?;
            self.applied.reserve(count as usize);
            for _ in 0..count {
                self.applied.push(Applied {
                    vm: r.u64()?,
                    seq: r.u64()?,
                });
            }
        }
        self.version = header.version;
        self.built_at_ms = header.built_at_ms;
        Ok(())
    }
}

/// `count` items decoded into `items`, each given the one it replaces (or
/// a default past the old end) to reuse its allocations; items past
/// `count` are dropped.
fn reuse_each<T: Default>(
    items: &mut Vec<T>,
    count: usize,
    mut decode: impl FnMut(T) -> Result<T, SnapshotError>,
) -> Result<(), SnapshotError> {
    items.truncate(count);
    for i in 0..count {
        let old = items.get_mut(i).map(std::mem::take).unwrap_or_default();
        let new = decode(old)?;
        match items.get_mut(i) {
            Some(slot) => *slot = new,
            None => items.push(new),
        }
    }
    Ok(())
}

/// `s`, copied into `buf`'s allocation.
fn refill(mut buf: String, s: &str) -> String {
    buf.clear();
    buf.push_str(s);
    buf
}

/// A model record, in `old`'s allocations.
fn decode_model(m: &mut Reader<'_>, old: ModelState) -> Result<ModelState, SnapshotError> {
    let ModelState {
        name,
        mut workers,
        mut lora_adapters,
        mut tenants,
        ..
    } = old;
    let name = refill(name, m.str16()?);
    let flags = m.u8()?;
    let decode_th = m.f64()?;
    let prefill_th = m.u64()?;
    let frac_th = m.f64()?;
    let shard_count = m.u32()?;
    let mut thresholds = Thresholds {
        active_decode_blocks: (flags & TH_DECODE != 0).then_some(decode_th),
        active_prefill_tokens: (flags & TH_PREFILL != 0).then_some(prefill_th),
        active_prefill_tokens_frac: (flags & TH_FRAC != 0).then_some(frac_th),
        active_decode_requests: None,
    };
    let worker_count = m.u32()?;
    m.plausible(worker_count, 4 + WORKER_FIXED, "workers")?;
    reuse_each(&mut workers, worker_count as usize, |old| {
        decode_worker(&mut record32(m, WORKER_FIXED)?, old)
    })?;
    let retry_after_s = if m.remaining() >= 4 { m.u32()? } else { 0 };
    lora_adapters.clear();
    if m.remaining() >= 4 {
        let count = m.u32()?;
        m.plausible(count, 2, "lora adapters")?;
        lora_adapters.reserve(count as usize);
        for _ in 0..count {
            lora_adapters.push(m.string16()?);
        }
    }
    let mut policy = Policy::default();
    if m.remaining() >= POLICY_LEN {
        for w in policy_weights_mut(&mut policy) {
            *w = m.f64()?;
        }
    }
    let service_rate_per_s = if m.remaining() >= 8 {
        Some(m.f64()?)
            .filter(|r| r.is_finite() && *r >= 0.0)
            .unwrap_or(0.0)
    } else {
        0.0
    };
    if m.remaining() >= 8 {
        policy.thermal_weight = Some(m.f64()?)
            .filter(|w| w.is_finite() && *w >= 0.0)
            .unwrap_or(0.0);
    }
    let mut plan = ModelPlan::default();
    if m.remaining() >= PLAN_LEN {
        plan = ModelPlan {
            desired: m.u32()?,
            ready: m.u32()?,
            scale_up_eta_s: m.u32()?,
        };
    }
    let prompt_template = if m.remaining() >= 8 { m.u64()? } else { 0 };
    let disaggregation = if m.remaining() >= DISAGG_LEN {
        read_disaggregation(m)?
    } else {
        None
    };
    let mut retry_after_by_pool_s = [0; 2];
    if m.remaining() >= POOL_RETRY_LEN {
        retry_after_by_pool_s = [m.u32()?, m.u32()?];
    }
    if m.remaining() >= DECODE_REQUESTS_LEN {
        thresholds.active_decode_requests = Some(m.u64()?).filter(|&n| n > 0);
    }
    let mut slo = Slo::default();
    if m.remaining() >= SLO_LEN {
        slo = Slo {
            ttft_ms: m.u32()?,
            itl_ms: m.u32()?,
        };
    }
    let count = if m.remaining() >= TENANTS_LEN {
        m.u16()?
    } else {
        0
    };
    m.plausible(u32::from(count), TENANT_MIN, "tenants")?;
    reuse_each(&mut tenants, usize::from(count), |old| {
        Ok(TenantLoad {
            tenant: refill(old.tenant, m.str16()?),
            prefill_tokens: m.u64()?,
            decode_blocks: m.u64()?,
        })
    })?;
    let mut disaggregation = disaggregation;
    if m.remaining() >= PULL_LEN {
        let pull = read_pull(m)?;
        if let Some(d) = &mut disaggregation {
            d.pull = pull;
        }
    }
    Ok(ModelState {
        name,
        thresholds,
        shard_count,
        workers,
        retry_after_s,
        lora_adapters,
        policy,
        service_rate_per_s,
        plan,
        prompt_template,
        disaggregation,
        retry_after_by_pool_s,
        slo,
        tenants,
    })
}

/// A worker record, in `old`'s allocations.
fn decode_worker(w: &mut Reader<'_>, old: WorkerState) -> Result<WorkerState, SnapshotError> {
    let WorkerState {
        endpoint,
        mut ranks,
        tenant,
        topology,
        ..
    } = old;
    let id = w.u64()?;
    let endpoint = refill(endpoint, w.str16()?);
    let block_size = w.u32()?;
    let rank_count = w.u32()?;
    w.plausible(rank_count, 2 + RANK_FIXED, "ranks")?;
    ranks.clear();
    ranks.reserve(rank_count as usize);
    for _ in 0..rank_count {
        let mut k = record16(w, RANK_FIXED)?;
        ranks.push(RankLoad {
            rank: k.u32()?,
            slot: k.u16()?,
            active_prefill_tokens: k.u64()?,
            active_decode_blocks: k.u64()?,
            kv_used_blocks: k.u64()?,
            kv_total_blocks: k.u64()?,
            max_num_batched_tokens: k.u64()?,
            running: k.u32()?,
            waiting: k.u32()?,
            busy: k.u8()? & FLAG_BUSY != 0,
        });
    }
    let tenant = refill(
        tenant,
        if w.remaining() >= 2 {
            w.str16()?
        } else {
            DEFAULT_TENANT
        },
    );
    let (thermal, draining) = if w.remaining() >= THERMAL_LEN {
        let t = Thermal {
            state: ThermalState::from_code(w.u8()?),
            cap: w.u32()?,
            in_flight: w.u32()?,
            heat: unit(w.f64()?),
        };
        (t, w.u8()? & WORKER_DRAINING != 0)
    } else {
        (Thermal::default(), false)
    };
    let role = if w.remaining() >= ROLE_LEN {
        Role::from_code(w.u8()?)
    } else {
        Role::Both
    };
    let bootstrap_port = if w.remaining() >= BOOTSTRAP_PORT_LEN {
        w.u16()?
    } else {
        DEFAULT_BOOTSTRAP_PORT
    };
    let fits = if w.remaining() >= FITS_LEN {
        read_fits(w)?
    } else {
        None
    };
    let Topology { node, rack } = topology;
    let topology = if w.remaining() >= TOPOLOGY_MIN {
        Topology {
            node: refill(node, w.str16()?),
            rack: refill(rack, w.str16()?),
        }
    } else {
        Topology {
            node: refill(node, ""),
            rack: refill(rack, ""),
        }
    };
    Ok(WorkerState {
        id,
        endpoint,
        block_size,
        ranks,
        tenant,
        thermal,
        draining,
        role,
        bootstrap_port,
        fits,
        topology,
    })
}

fn put_fits(out: &mut Vec<u8>, fits: Option<&WorkerFits>) {
    let Some(f) = fits else {
        out.extend_from_slice(&[0; FITS_LEN]);
        return;
    };
    out.push(FITS_PRESENT);
    for fit in [&f.ttft, &f.itl] {
        out.extend_from_slice(&fit.intercept_ms.to_le_bytes());
        out.extend_from_slice(&fit.slope_ms_per_ktok.to_le_bytes());
        out.extend_from_slice(&fit.samples.to_le_bytes());
        out.extend_from_slice(&fit.age_s.to_le_bytes());
    }
}

/// A worker's fits from the wire. A fit whose coefficients are not
/// numbers reads as one that has learned nothing: it predicts nothing,
/// and says so wherever it is shown.
fn read_fits(w: &mut Reader<'_>) -> Result<Option<WorkerFits>, WireError> {
    let flags = w.u8()?;
    let mut fit = || -> Result<Fit, WireError> {
        let f = Fit {
            intercept_ms: w.f32()?,
            slope_ms_per_ktok: w.f32()?,
            samples: w.u32()?,
            age_s: w.u32()?,
        };
        Ok(if f.is_finite() { f } else { Fit::default() })
    };
    let ttft = fit()?;
    let itl = fit()?;
    Ok((flags & FITS_PRESENT != 0).then_some(WorkerFits { ttft, itl }))
}

fn put_disaggregation(out: &mut Vec<u8>, d: Option<&Disaggregation>) {
    let Some(d) = d else {
        out.extend_from_slice(&[0; DISAGG_LEN]);
        return;
    };
    out.push(DISAGG_PRESENT);
    out.push(d.protocol.code());
    out.push(match d.on_prefill_failure {
        OnPrefillFailure::Local => FAIL_LOCAL,
        OnPrefillFailure::Fail => FAIL_FAIL,
    });
    out.extend_from_slice(&d.conditional.max_uncached_tokens.to_le_bytes());
    out.extend_from_slice(&d.conditional.max_uncached_ratio.to_le_bytes());
    out.extend_from_slice(&d.prefill_timeout_ms.to_le_bytes());
    out.extend_from_slice(&d.decode_affinity.to_le_bytes());
}

/// A model's disaggregation from the wire. A protocol this build cannot
/// speak leaves the model served whole rather than split wrongly; an
/// unknown failure policy fails (a local prefill the writer did not ask
/// for would load its decode pool); out-of-range numbers are bounded.
fn read_disaggregation(m: &mut Reader<'_>) -> Result<Option<Disaggregation>, WireError> {
    let flags = m.u8()?;
    let protocol = Protocol::from_code(m.u8()?);
    let on_prefill_failure = match m.u8()? {
        FAIL_LOCAL => OnPrefillFailure::Local,
        _ => OnPrefillFailure::Fail,
    };
    let max_uncached_tokens = m.u64()?;
    let ratio = m.f64()?;
    let prefill_timeout_ms = m.u64()?;
    let affinity = m.f64()?;
    let (true, Some(protocol)) = (flags & DISAGG_PRESENT != 0, protocol) else {
        return Ok(None);
    };
    Ok(Some(Disaggregation {
        protocol,
        conditional: Conditional {
            max_uncached_tokens,
            // NaN compares false: never local.
            max_uncached_ratio: if ratio.is_nan() {
                0.0
            } else {
                ratio.clamp(0.0, 1.0)
            },
        },
        on_prefill_failure,
        prefill_timeout_ms: prefill_timeout_ms.max(1),
        decode_affinity: Some(affinity)
            .filter(|a| a.is_finite() && *a >= 0.0)
            .unwrap_or(0.0),
        pull: None,
    }))
}

fn put_pull(out: &mut Vec<u8>, pull: Option<&Pull>) {
    let Some(p) = pull else {
        out.extend_from_slice(&[0; PULL_LEN]);
        return;
    };
    out.push(PULL_PRESENT);
    out.extend_from_slice(&p.min_blocks.to_le_bytes());
    out.extend_from_slice(&p.kv_bytes_per_token.to_le_bytes());
    for v in [
        p.prefill_tokens_per_s,
        p.link.same_node_gbps,
        p.link.same_rack_gbps,
        p.link.elsewhere_gbps,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// A model's pull settings from the wire. Settings a writer could not
/// have validated (a rate or size not above 0, not a number) leave the
/// model without pulls: a pull priced on them could cost more than it
/// saves.
fn read_pull(m: &mut Reader<'_>) -> Result<Option<Pull>, WireError> {
    let flags = m.u8()?;
    let pull = Pull {
        min_blocks: m.u32()?,
        kv_bytes_per_token: m.u64()?,
        prefill_tokens_per_s: m.f64()?,
        link: Links {
            same_node_gbps: m.f64()?,
            same_rack_gbps: m.f64()?,
            elsewhere_gbps: m.f64()?,
        },
    };
    Ok((flags & PULL_PRESENT != 0 && pull.validate().is_ok()).then_some(pull))
}

/// A heat from the wire, within [0, 1]; what is not a number is as hot as
/// it gets, never cool.
fn unit(v: f64) -> f64 {
    if v.is_nan() { 1.0 } else { v.clamp(0.0, 1.0) }
}

fn policy_weights(p: &Policy) -> [f64; POLICY_LEN / 8] {
    [
        p.overlap_credit,
        p.host_weight,
        p.disk_weight,
        p.prefill_load_scale,
        p.decode_active_request_weight,
        p.temperature,
    ]
}

fn policy_weights_mut(p: &mut Policy) -> [&mut f64; POLICY_LEN / 8] {
    [
        &mut p.overlap_credit,
        &mut p.host_weight,
        &mut p.disk_weight,
        &mut p.prefill_load_scale,
        &mut p.decode_active_request_weight,
        &mut p.temperature,
    ]
}

/// The fixed header, readable on its own: the filter peeks at it to learn a
/// snapshot's version without decoding the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub major: u16,
    pub minor: u16,
    pub payload_len: usize,
    pub version: u64,
    pub built_at_ms: u64,
}

impl Header {
    pub fn parse(bytes: &[u8]) -> Result<Header, SnapshotError> {
        if bytes.len() < 8 {
            return Err(SnapshotError::Wire(WireError::Truncated {
                offset: 0,
                needed: HEADER_LEN,
                available: bytes.len(),
            }));
        }
        if bytes[..4] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let mut r = Reader::at(bytes, 4);
        let major = r.u16()?;
        if major != MAJOR {
            return Err(SnapshotError::UnsupportedMajor {
                found: major,
                supported: MAJOR,
            });
        }
        let minor = r.u16()?;
        let payload_len = r.u32()? as usize;
        let version = r.u64()?;
        let built_at_ms = r.u64()?;
        let actual = bytes.len() - HEADER_LEN;
        if payload_len != actual {
            return Err(SnapshotError::LengthMismatch {
                declared: payload_len,
                actual,
            });
        }
        Ok(Header {
            major,
            minor,
            payload_len,
            version,
            built_at_ms,
        })
    }
}

fn put_count(out: &mut Vec<u8>, n: usize, what: &'static str) -> Result<(), SnapshotError> {
    let n = u32::try_from(n).map_err(|_| SnapshotError::TooLarge { field: what })?;
    out.extend_from_slice(&n.to_le_bytes());
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str, field: &'static str) -> Result<(), SnapshotError> {
    let n = u16::try_from(s.len()).map_err(|_| SnapshotError::TooLarge { field })?;
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn begin_record(out: &mut Vec<u8>) -> usize {
    let at = out.len();
    out.extend_from_slice(&0u32.to_le_bytes());
    at
}

fn end_record(out: &mut [u8], at: usize, field: &'static str) -> Result<(), SnapshotError> {
    let len = u32::try_from(out.len() - at - 4).map_err(|_| SnapshotError::TooLarge { field })?;
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    Ok(())
}

/// A record with a u32 length prefix that covers at least `fixed` bytes.
fn record32<'a>(r: &mut Reader<'a>, fixed: usize) -> Result<Reader<'a>, SnapshotError> {
    let offset = r.pos();
    let len = r.u32()? as usize;
    record(r, offset, len, fixed)
}

/// A record with a u16 length prefix (rank records: small and numerous).
fn record16<'a>(r: &mut Reader<'a>, fixed: usize) -> Result<Reader<'a>, SnapshotError> {
    let offset = r.pos();
    let len = r.u16()? as usize;
    record(r, offset, len, fixed)
}

fn record<'a>(
    r: &mut Reader<'a>,
    offset: usize,
    len: usize,
    fixed: usize,
) -> Result<Reader<'a>, SnapshotError> {
    if len < fixed {
        return Err(SnapshotError::RecordTooShort { offset, len });
    }
    Ok(r.window(len)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What minor 10 and later appended to a model record (with no
    /// tenants): the request bound, the SLO, the tenants' count, then
    /// minor 11's pull settings.
    const SINCE_MINOR_10_LEN: usize = DECODE_REQUESTS_LEN + SLO_LEN + TENANTS_LEN + PULL_LEN;
    /// What minor 11 appended to the sample's worker record: its place.
    const SAMPLE_TOPOLOGY_LEN: usize = TOPOLOGY_MIN + "gpu-node-3".len() + "rack-b".len();
    use proptest::prelude::*;

    fn sample() -> Snapshot {
        Snapshot {
            version: 42,
            built_at_ms: 1_700_000_000_123,
            models: vec![
                ModelState {
                    name: "llama".into(),
                    thresholds: Thresholds {
                        active_decode_blocks: Some(0.85),
                        active_prefill_tokens: None,
                        active_prefill_tokens_frac: Some(1.5),
                        active_decode_requests: Some(24),
                    },
                    shard_count: 64,
                    workers: vec![WorkerState {
                        id: 7,
                        tenant: "team-a".into(),
                        endpoint: "127.0.0.1:8001".into(),
                        block_size: 16,
                        ranks: vec![
                            RankLoad {
                                rank: 0,
                                slot: 3,
                                active_prefill_tokens: 100,
                                active_decode_blocks: 3,
                                kv_used_blocks: 10,
                                kv_total_blocks: 1000,
                                max_num_batched_tokens: 8192,
                                running: 2,
                                waiting: 1,
                                busy: false,
                            },
                            RankLoad {
                                rank: 1,
                                busy: true,
                                ..Default::default()
                            },
                        ],
                        thermal: Thermal {
                            state: ThermalState::Throttling,
                            heat: 1.0,
                            cap: 6,
                            in_flight: 9,
                        },
                        draining: true,
                        role: Role::Decode,
                        bootstrap_port: 9001,
                        fits: Some(WorkerFits {
                            ttft: Fit {
                                intercept_ms: 35.5,
                                slope_ms_per_ktok: 12.25,
                                samples: 40,
                                age_s: 3,
                            },
                            itl: Fit {
                                intercept_ms: 8.0,
                                slope_ms_per_ktok: 0.5,
                                samples: 12,
                                age_s: 1,
                            },
                        }),
                        topology: Topology {
                            node: "gpu-node-3".into(),
                            rack: "rack-b".into(),
                        },
                    }],
                    retry_after_s: 4,
                    lora_adapters: vec!["sql-lora".into(), "chat-lora".into()],
                    policy: Policy {
                        host_weight: 0.5,
                        temperature: 0.2,
                        thermal_weight: 2.5,
                        ..Policy::default()
                    },
                    service_rate_per_s: 42.5,
                    plan: ModelPlan {
                        desired: 5,
                        ready: 4,
                        scale_up_eta_s: 12,
                    },
                    prompt_template: 0xFEED,
                    disaggregation: Some(Disaggregation {
                        protocol: Protocol::Sglang,
                        conditional: Conditional {
                            max_uncached_tokens: 512,
                            max_uncached_ratio: 0.5,
                        },
                        on_prefill_failure: OnPrefillFailure::Fail,
                        prefill_timeout_ms: 2500,
                        decode_affinity: 0.0,
                        pull: Some(crate::disagg::pull::Pull {
                            min_blocks: 6,
                            kv_bytes_per_token: 65_536,
                            prefill_tokens_per_s: 12_500.0,
                            link: Links {
                                same_node_gbps: 900.0,
                                same_rack_gbps: 400.0,
                                elsewhere_gbps: 50.0,
                            },
                        }),
                    }),
                    retry_after_by_pool_s: [9, 3],
                    slo: Slo {
                        ttft_ms: 500,
                        itl_ms: 50,
                    },
                    tenants: vec![
                        TenantLoad {
                            tenant: "team-a".into(),
                            prefill_tokens: 100,
                            decode_blocks: 3,
                        },
                        TenantLoad {
                            tenant: "batch".into(),
                            prefill_tokens: 0,
                            decode_blocks: 1 << 40,
                        },
                    ],
                },
                ModelState {
                    name: "empty".into(),
                    ..Default::default()
                },
            ],
            applied: vec![Applied { vm: 9, seq: 1234 }],
        }
    }

    /// What a minor-0 writer produced: no retry hint, no applied list.
    fn minor0(s: &Snapshot) -> Vec<u8> {
        strip_model_tail(
            s,
            8 + POLICY_LEN + 16 + PLAN_LEN + 8 + DISAGG_LEN + POOL_RETRY_LEN + SINCE_MINOR_10_LEN,
        )
    }

    /// Cuts the last `by` bytes (the minor-1 and later fields, with no
    /// adapters and no tenants, so the same length in every model) off
    /// every model record, and the applied list.
    fn strip_model_tail(s: &Snapshot, by: usize) -> Vec<u8> {
        let mut s = s.clone();
        s.applied.clear();
        for m in &mut s.models {
            m.lora_adapters.clear();
            m.tenants.clear();
        }
        let mut bytes = s.encode().unwrap();
        bytes.truncate(bytes.len() - 4); // the applied count
        let mut at = HEADER_LEN + 4;
        for _ in &s.models {
            let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
            let end = at + 4 + len;
            bytes.drain(end - by..end);
            bytes[at..at + 4].copy_from_slice(&((len - by) as u32).to_le_bytes());
            at = end - by;
        }
        let payload = (bytes.len() - HEADER_LEN) as u32;
        bytes[8..12].copy_from_slice(&payload.to_le_bytes());
        bytes[6..8].copy_from_slice(&0u16.to_le_bytes());
        bytes
    }

    #[test]
    fn minor_zero_snapshots_still_decode() {
        let s = sample();
        let old = Snapshot::decode(&minor0(&s)).unwrap();
        assert!(old.applied.is_empty());
        assert_eq!(old.models[0].retry_after_s, 0);
        assert_eq!(old.models[0].workers, s.models[0].workers);
    }

    #[test]
    fn minor_two_snapshots_have_no_adapters() {
        let s = sample();
        let old = Snapshot::decode(&strip_model_tail(
            &s,
            4 + POLICY_LEN + 16 + PLAN_LEN + 8 + DISAGG_LEN + POOL_RETRY_LEN + SINCE_MINOR_10_LEN,
        ))
        .unwrap();
        assert_eq!(old.models[0].retry_after_s, 4);
        assert!(old.models[0].lora_adapters.is_empty());
    }

    #[test]
    fn minor_three_snapshots_carry_the_default_policy() {
        let s = sample();
        assert_ne!(s.models[0].policy, Policy::default());
        let old = Snapshot::decode(&strip_model_tail(
            &s,
            POLICY_LEN + 16 + PLAN_LEN + 8 + DISAGG_LEN + POOL_RETRY_LEN + SINCE_MINOR_10_LEN,
        ))
        .unwrap();
        assert_eq!(old.models[0].retry_after_s, 4);
        assert_eq!(old.models[0].policy, Policy::default());
        assert_eq!(old.models[0].workers, s.models[0].workers);
    }

    #[test]
    fn minor_four_snapshots_know_no_service_rate() {
        let s = sample();
        assert!(s.models[0].service_rate_per_s > 0.0);
        let old = Snapshot::decode(&strip_model_tail(
            &s,
            16 + PLAN_LEN + 8 + DISAGG_LEN + POOL_RETRY_LEN + SINCE_MINOR_10_LEN,
        ))
        .unwrap();
        assert_eq!(old.models[0].service_rate_per_s, 0.0);
        assert_eq!(
            old.models[0].policy.host_weight,
            s.models[0].policy.host_weight
        );
    }

    #[test]
    fn minor_five_snapshots_weigh_heat_by_default() {
        let s = sample();
        let old = Snapshot::decode(&strip_model_tail(
            &s,
            8 + PLAN_LEN + 8 + DISAGG_LEN + POOL_RETRY_LEN + SINCE_MINOR_10_LEN,
        ))
        .unwrap();
        assert_eq!(old.models[0].service_rate_per_s, 42.5);
        assert_eq!(old.models[0].policy.thermal_weight, 1.0);
        assert_eq!(old.models[0].plan, ModelPlan::default());
    }

    #[test]
    fn minor_nine_snapshots_have_no_slo_and_their_workers_no_fits() {
        let s = sample();
        assert_ne!(s.models[0].slo, Slo::default());
        let old =
            Snapshot::decode(&strip_model_tail(&s, SLO_LEN + TENANTS_LEN + PULL_LEN)).unwrap();
        assert_eq!(old.models[0].slo, Slo::default(), "no target");
        assert_eq!(
            old.models[0].thresholds.active_decode_requests,
            Some(24),
            "the request bound before it is still read"
        );
        let (bytes, cut) = strip_worker_tail(&s, FITS_LEN + SAMPLE_TOPOLOGY_LEN);
        assert_eq!(cut[0], FITS_PRESENT);
        let old = Snapshot::decode(&bytes).unwrap();
        let w = &old.models[0].workers[0];
        assert_eq!(w.fits, None);
        assert_eq!(w.bootstrap_port, 9001, "the port before them is still read");
        assert_eq!(old.models[0].slo, s.models[0].slo);
    }

    #[test]
    fn minor_ten_snapshots_pull_nothing_and_place_no_worker() {
        let s = sample();
        let pulls = |s: &Snapshot| s.models[0].disaggregation.and_then(|d| d.pull);
        assert!(pulls(&s).is_some());
        let old = Snapshot::decode(&strip_model_tail(&s, PULL_LEN)).unwrap();
        assert_eq!(pulls(&old), None, "no pull settings");
        assert_eq!(old.models[0].slo, s.models[0].slo, "minor 10 is still read");
        let (bytes, cut) = strip_worker_tail(&s, SAMPLE_TOPOLOGY_LEN);
        assert_eq!(&cut[2..12], b"gpu-node-3");
        let old = Snapshot::decode(&bytes).unwrap();
        let w = &old.models[0].workers[0];
        assert_eq!(w.topology, Topology::default());
        assert_eq!(w.fits, s.models[0].workers[0].fits, "the fits before it");
        // Settings no writer could have validated leave the model without
        // pulls rather than priced on them.
        let mut bad = s.clone();
        if let Some(d) = &mut bad.models[0].disaggregation {
            d.pull = d.pull.map(|p| crate::disagg::pull::Pull {
                prefill_tokens_per_s: f64::NAN,
                ..p
            });
        }
        assert_eq!(
            pulls(&Snapshot::decode(&bad.encode().unwrap()).unwrap()),
            None
        );
    }

    #[test]
    fn snapshots_before_tenants_have_none() {
        let s = sample();
        assert_eq!(s.models[0].tenants.len(), 2);
        assert_eq!(Snapshot::decode(&s.encode().unwrap()).unwrap(), s);
        // A writer of minor 9 (or of minor 10 before tenants) ends the
        // model record at the SLO.
        let old = Snapshot::decode(&strip_model_tail(&s, TENANTS_LEN + PULL_LEN)).unwrap();
        assert!(old.models.iter().all(|m| m.tenants.is_empty()));
        assert_eq!(old.models[0].slo, s.models[0].slo, "the SLO is still read");
        // Decoded into a snapshot that had tenants, none are left.
        let mut into = sample();
        into.decode_into(&strip_model_tail(&s, TENANTS_LEN + PULL_LEN))
            .unwrap();
        assert_eq!(into, old);
    }

    #[test]
    fn a_tenant_count_the_record_cannot_hold_is_refused() {
        let mut s = sample();
        s.models.truncate(1);
        s.applied.clear();
        s.models[0].tenants.truncate(1);
        let mut bytes = s.encode().unwrap();
        // The record ends with the count, one tenant and the pull
        // settings; the snapshot, with the applied count.
        let at = bytes.len() - 4 - PULL_LEN - (TENANT_MIN + "team-a".len()) - TENANTS_LEN;
        assert_eq!(bytes[at..at + 2], [1, 0]);
        // Five need more than the one tenant and the pull settings left.
        for count in [5u16, u16::MAX] {
            bytes[at..at + 2].copy_from_slice(&count.to_le_bytes());
            assert!(matches!(
                Snapshot::decode(&bytes),
                Err(SnapshotError::Wire(WireError::ImplausibleCount {
                    what: "tenants",
                    ..
                }))
            ));
        }
    }

    #[test]
    fn fits_that_are_not_numbers_read_as_unknown() {
        let mut s = sample();
        let f = s.models[0].workers[0].fits.as_mut().unwrap();
        f.ttft.intercept_ms = f32::NAN;
        f.itl.slope_ms_per_ktok = f32::INFINITY;
        let w = &Snapshot::decode(&s.encode().unwrap()).unwrap().models[0].workers[0];
        assert_eq!(
            w.fits,
            Some(WorkerFits::default()),
            "each reads as a fit of no samples"
        );
        // A worker without fits writes zeros, whatever a reader makes of
        // the flag.
        s.models[0].workers[0].fits = None;
        let w = &Snapshot::decode(&s.encode().unwrap()).unwrap().models[0].workers[0];
        assert_eq!(w.fits, None);
        // Its other fit, a number, is kept.
        let mut s = sample();
        s.models[0].workers[0]
            .fits
            .as_mut()
            .unwrap()
            .itl
            .intercept_ms = f32::NEG_INFINITY;
        let w = &Snapshot::decode(&s.encode().unwrap()).unwrap().models[0].workers[0];
        let f = w.fits.unwrap();
        assert_eq!(f.ttft, sample().models[0].workers[0].fits.unwrap().ttft);
        assert_eq!(f.itl, Fit::default());
    }

    #[test]
    fn minor_nine_snapshots_bound_no_decode_worker_by_its_requests() {
        let s = sample();
        let old = Snapshot::decode(&strip_model_tail(&s, SINCE_MINOR_10_LEN)).unwrap();
        assert_eq!(old.models[0].thresholds.active_decode_requests, None);
        assert_eq!(old.models[0].slo, Slo::default());
        assert_eq!(
            old.models[0].thresholds.active_decode_blocks,
            s.models[0].thresholds.active_decode_blocks
        );
        assert_eq!(
            old.models[0].retry_after_by_pool_s,
            s.models[0].retry_after_by_pool_s
        );
    }

    #[test]
    fn minor_eight_snapshots_take_the_models_retry_after_for_every_pool() {
        let s = sample();
        assert_eq!(Snapshot::decode(&s.encode().unwrap()).unwrap(), s);
        let old =
            Snapshot::decode(&strip_model_tail(&s, POOL_RETRY_LEN + SINCE_MINOR_10_LEN)).unwrap();
        assert_eq!(old.models[0].retry_after_by_pool_s, [0, 0]);
        assert!(old.models[0].disaggregation.is_some());
    }

    #[test]
    fn minor_seven_snapshots_serve_every_model_whole() {
        let s = sample();
        let old = Snapshot::decode(&strip_model_tail(
            &s,
            DISAGG_LEN + POOL_RETRY_LEN + SINCE_MINOR_10_LEN,
        ))
        .unwrap();
        assert_eq!(old.models[0].disaggregation, None);
        assert_eq!(old.models[0].prompt_template, 0xFEED);
        // And their workers, cut of their role byte, take either leg.
        let (bytes, cut) = strip_worker_tail(
            &s,
            ROLE_LEN + BOOTSTRAP_PORT_LEN + FITS_LEN + SAMPLE_TOPOLOGY_LEN,
        );
        assert_eq!(
            cut[..3],
            [Role::Decode.code(), 0x29, 0x23],
            "role, port 9001"
        );
        let old = Snapshot::decode(&bytes).unwrap();
        let w = &old.models[0].workers[0];
        assert_eq!(w.role, Role::Both);
        assert!(w.draining, "the minor-6 flags are still read");
        assert_eq!(w.thermal, s.models[0].workers[0].thermal);
        assert_eq!(old.models[0].disaggregation, s.models[0].disaggregation);
    }

    #[test]
    fn workers_without_a_bootstrap_port_use_sglangs_default() {
        let s = sample();
        assert_eq!(s.models[0].workers[0].bootstrap_port, 9001);
        let (bytes, cut) =
            strip_worker_tail(&s, BOOTSTRAP_PORT_LEN + FITS_LEN + SAMPLE_TOPOLOGY_LEN);
        assert_eq!(cut[..2], 9001u16.to_le_bytes());
        let old = Snapshot::decode(&bytes).unwrap();
        let w = &old.models[0].workers[0];
        assert_eq!(w.bootstrap_port, DEFAULT_BOOTSTRAP_PORT);
        assert_eq!(w.role, Role::Decode, "the role before it is still read");
        // An unset port (0) is written as it is and means the default.
        let mut unset = s.clone();
        unset.models[0].workers[0].bootstrap_port = 0;
        let w = &Snapshot::decode(&unset.encode().unwrap()).unwrap().models[0].workers[0];
        assert_eq!(w.bootstrap_port, 0);
        assert_eq!(w.bootstrap_port(), DEFAULT_BOOTSTRAP_PORT);
    }

    #[test]
    fn disaggregation_from_the_wire_is_bounded() {
        let mut s = sample();
        s.models.truncate(1);
        let d = s.models[0].disaggregation.as_mut().unwrap();
        d.conditional.max_uncached_ratio = f64::NAN;
        d.decode_affinity = -3.0;
        d.prefill_timeout_ms = 0;
        let mut bytes = s.encode().unwrap();
        let old = Snapshot::decode(&bytes).unwrap();
        let d = old.models[0].disaggregation.unwrap();
        assert_eq!(d.conditional.max_uncached_ratio, 0.0, "NaN: never local");
        assert_eq!(d.decode_affinity, 0.0);
        assert_eq!(d.prefill_timeout_ms, 1);
        // The model's record ends with the disaggregation, the pools'
        // Retry-After, the request bound, the SLO and the tenants, then the
        // applied list (a count and one entry) closes the payload.
        let tenants: usize = s.models[0]
            .tenants
            .iter()
            .map(|t| TENANT_MIN + t.tenant.len())
            .sum();
        let at = bytes.len() - 4 - 16 - DISAGG_LEN - POOL_RETRY_LEN - SINCE_MINOR_10_LEN - tenants;
        assert_eq!(bytes[at], DISAGG_PRESENT);
        bytes[at + 1] = 9; // a protocol of a newer writer
        assert_eq!(
            Snapshot::decode(&bytes).unwrap().models[0].disaggregation,
            None,
            "an unknown protocol is served whole"
        );
        bytes[at + 1] = Protocol::VllmNixl.code();
        bytes[at + 2] = 7; // an unknown failure policy
        let d = Snapshot::decode(&bytes).unwrap().models[0].disaggregation;
        assert_eq!(
            d.map(|d| d.on_prefill_failure),
            Some(OnPrefillFailure::Fail)
        );
        assert_eq!(d.map(|d| d.protocol), Some(Protocol::VllmNixl));
    }

    #[test]
    fn unknown_roles_read_as_both() {
        for code in 0..=u8::MAX {
            let role = Role::from_code(code);
            if usize::from(code) < Role::ALL.len() {
                assert_eq!(role.code(), code);
            } else {
                assert_eq!(role, Role::Both);
            }
        }
    }

    #[test]
    fn minor_six_snapshots_have_no_prompt_template() {
        let s = sample();
        let old = Snapshot::decode(&strip_model_tail(
            &s,
            8 + DISAGG_LEN + POOL_RETRY_LEN + SINCE_MINOR_10_LEN,
        ))
        .unwrap();
        assert_eq!(old.models[0].prompt_template, 0);
        assert_eq!(old.models[0].plan, s.models[0].plan);
        assert_eq!(Snapshot::decode(&s.encode().unwrap()).unwrap(), s);
    }

    /// `s` with the last `by` bytes cut off its first worker's record.
    fn strip_worker_tail(s: &Snapshot, by: usize) -> (Vec<u8>, Vec<u8>) {
        let mut bytes = s.encode().unwrap();
        let model_at = HEADER_LEN + 4;
        let worker_at = model_at + 4 + 2 + s.models[0].name.len() + 1 + 24 + 4 + 4;
        let patch = |b: &mut Vec<u8>, at: usize, by: usize| {
            let v = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
            b[at..at + 4].copy_from_slice(&((v - by) as u32).to_le_bytes());
            v
        };
        let wlen = patch(&mut bytes, worker_at, by);
        let wend = worker_at + 4 + wlen;
        let cut: Vec<u8> = bytes.drain(wend - by..wend).collect();
        patch(&mut bytes, model_at, by);
        patch(&mut bytes, 8, by);
        (bytes, cut)
    }

    #[test]
    fn workers_from_minor_five_writers_are_unmonitored() {
        let s = sample();
        let (bytes, _) = strip_worker_tail(
            &s,
            THERMAL_LEN + ROLE_LEN + BOOTSTRAP_PORT_LEN + FITS_LEN + SAMPLE_TOPOLOGY_LEN,
        );
        let old = Snapshot::decode(&bytes).unwrap();
        let w = &old.models[0].workers[0];
        assert_eq!(w.thermal, Thermal::default());
        assert_eq!(w.thermal.state, ThermalState::Unmonitored);
        assert!(!w.draining);
        assert_eq!(w.tenant, "team-a");
    }

    #[test]
    fn thermal_values_from_the_wire_are_bounded() {
        let mut s = sample();
        s.models[0].workers[0].thermal.heat = f64::NAN;
        let mut bytes = s.encode().unwrap();
        // The state byte of a newer writer reads as unknown, never as cool.
        let (_, cut) = strip_worker_tail(
            &s,
            THERMAL_LEN + ROLE_LEN + BOOTSTRAP_PORT_LEN + FITS_LEN + SAMPLE_TOPOLOGY_LEN,
        );
        let at = bytes
            .windows(cut.len())
            .position(|w| w == cut.as_slice())
            .unwrap();
        bytes[at] = 200;
        let w = &Snapshot::decode(&bytes).unwrap().models[0].workers[0];
        assert_eq!(w.thermal.state, ThermalState::Unknown);
        assert_eq!(w.thermal.heat, 1.0, "NaN heat is as hot as it gets");
        assert_eq!(w.thermal.cap, 6);
    }

    #[test]
    fn a_string_that_is_not_utf8_is_refused_whatever_it_replaces() {
        let s = sample();
        let mut bytes = s.encode().unwrap();
        let endpoint = s.models[0].workers[0].endpoint.as_bytes();
        let at = bytes
            .windows(endpoint.len())
            .position(|w| w == endpoint)
            .unwrap();
        bytes[at] = 0xff;
        assert!(matches!(
            Snapshot::decode(&bytes),
            Err(SnapshotError::Wire(WireError::BadUtf8 { .. }))
        ));
        // Into a snapshot that held the valid endpoint, and into itself.
        for mut into in [s.clone(), Snapshot::default()] {
            assert!(matches!(
                into.decode_into(&bytes),
                Err(SnapshotError::Wire(WireError::BadUtf8 { .. }))
            ));
        }
    }

    #[test]
    fn workers_from_older_writers_are_in_the_default_tenant() {
        let mut s = sample();
        s.models.truncate(1);
        s.models[0].workers.truncate(1);
        s.models[0].workers[0].tenant.clear();
        // Cut the (empty) tenant and the thermal record off the worker
        // record, as a minor-1 writer never wrote them.
        let (bytes, cut) = strip_worker_tail(
            &s,
            2 + THERMAL_LEN + ROLE_LEN + BOOTSTRAP_PORT_LEN + FITS_LEN + SAMPLE_TOPOLOGY_LEN,
        );
        assert_eq!(&cut[..2], &[0, 0], "the empty tenant");
        let old = Snapshot::decode(&bytes).unwrap();
        assert_eq!(old.models[0].workers[0].tenant, DEFAULT_TENANT);
        assert_eq!(old.models[0].workers[0].ranks, s.models[0].workers[0].ranks);
        // Decoded into a newer writer's snapshot, the fields the old
        // writer left out take their defaults, not the newer values.
        let mut into = sample();
        into.models[0].workers[0].tenant = "acme".into();
        into.models[0].workers[0].thermal.cap = 9;
        into.models[0].workers[0].draining = true;
        into.decode_into(&bytes).unwrap();
        assert_eq!(into, old);
    }

    #[test]
    fn round_trip() {
        let s = sample();
        let bytes = s.encode().unwrap();
        assert_eq!(Snapshot::decode(&bytes).unwrap(), s);
        let h = Header::parse(&bytes).unwrap();
        assert_eq!(
            (h.version, h.built_at_ms, h.major),
            (42, 1_700_000_000_123, MAJOR)
        );
    }

    #[test]
    fn rejects_unknown_major() {
        let mut bytes = sample().encode().unwrap();
        bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
        assert_eq!(
            Snapshot::decode(&bytes),
            Err(SnapshotError::UnsupportedMajor {
                found: 2,
                supported: 1
            })
        );
    }

    #[test]
    fn rejects_bad_magic_and_length() {
        let mut bytes = sample().encode().unwrap();
        bytes.push(0);
        assert!(matches!(
            Snapshot::decode(&bytes),
            Err(SnapshotError::LengthMismatch { .. })
        ));
        bytes[0] = b'X';
        assert_eq!(Snapshot::decode(&bytes), Err(SnapshotError::BadMagic));
    }

    #[test]
    fn newer_minor_fields_are_skipped() {
        // A minor-1 writer may append fields to any record; an old reader
        // must skip them and still decode what it knows.
        let s = sample();
        let mut patched = s.encode().unwrap();
        let model_rec_at = HEADER_LEN + 4;
        let len = u32::from_le_bytes(patched[model_rec_at..model_rec_at + 4].try_into().unwrap());
        let end = model_rec_at + 4 + len as usize;
        patched.splice(end..end, [9u8, 9, 9, 9]);
        patched[model_rec_at..model_rec_at + 4].copy_from_slice(&(len + 4).to_le_bytes());
        let payload = (patched.len() - HEADER_LEN) as u32;
        patched[8..12].copy_from_slice(&payload.to_le_bytes());
        assert_eq!(Snapshot::decode(&patched).unwrap(), s);
    }

    #[test]
    fn huge_counts_are_refused_without_allocating() {
        let mut bytes = Snapshot::default().encode().unwrap();
        bytes[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Snapshot::decode(&bytes),
            Err(SnapshotError::Wire(WireError::ImplausibleCount {
                what: "models",
                ..
            }))
        ));
    }

    fn arb_rank() -> impl Strategy<Value = RankLoad> {
        (
            (any::<u32>(), any::<u16>()),
            any::<[u64; 5]>(),
            (any::<u32>(), any::<u32>(), any::<bool>()),
        )
            .prop_map(|((rank, slot), v, (running, waiting, busy))| RankLoad {
                rank,
                slot,
                active_prefill_tokens: v[0],
                active_decode_blocks: v[1],
                kv_used_blocks: v[2],
                kv_total_blocks: v[3],
                max_num_batched_tokens: v[4],
                running,
                waiting,
                busy,
            })
    }

    fn arb_fit() -> impl Strategy<Value = Fit> {
        (-1e6f32..1e6, -1e6f32..1e6, any::<u32>(), any::<u32>()).prop_map(
            |(intercept_ms, slope_ms_per_ktok, samples, age_s)| Fit {
                intercept_ms,
                slope_ms_per_ktok,
                samples,
                age_s,
            },
        )
    }

    fn arb_snapshot() -> impl Strategy<Value = Snapshot> {
        let worker = (
            any::<u64>(),
            "[a-z0-9.:]{0,24}",
            any::<u32>(),
            prop::collection::vec(arb_rank(), 0..4),
            "[a-z0-9-]{0,12}",
            (0u8..5, 0.0f64..=1.0, any::<u32>(), any::<u32>()),
            0u8..3,
            prop::option::of((arb_fit(), arb_fit())),
        )
            .prop_map(
                |(
                    id,
                    endpoint,
                    block_size,
                    ranks,
                    tenant,
                    (state, heat, cap, in_flight),
                    role,
                    fits,
                )| {
                    WorkerState {
                        id,
                        endpoint,
                        block_size,
                        ranks,
                        tenant,
                        thermal: Thermal {
                            state: ThermalState::from_code(state),
                            heat,
                            cap,
                            in_flight,
                        },
                        draining: cap % 2 == 0,
                        role: Role::from_code(role),
                        topology: Topology {
                            node: format!("n{}", cap % 3),
                            rack: format!("r{}", cap % 2),
                        },
                        bootstrap_port: cap as u16,
                        fits: fits.map(|(ttft, itl)| WorkerFits { ttft, itl }),
                    }
                },
            );
        let thresholds = (
            prop::option::of(0.0f64..1.0),
            prop::option::of(any::<u64>()),
            prop::option::of(0.0f64..100.0),
        )
            .prop_map(|(a, b, c)| Thresholds {
                active_decode_requests: None,
                active_decode_blocks: a,
                active_prefill_tokens: b,
                active_prefill_tokens_frac: c,
            });
        let model = (
            "\\PC{0,16}",
            thresholds,
            any::<u32>(),
            prop::collection::vec(worker, 0..5),
            prop::collection::vec("[a-z0-9-]{0,12}", 0..3),
            (0.0f64..4.0, 0.0f64..1.0),
            prop::option::of((
                0u8..2,
                any::<u64>(),
                0.0f64..=1.0,
                1u64..100_000,
                any::<bool>(),
            )),
            (any::<u32>(), any::<u32>()),
            prop::collection::vec(("\\PC{0,12}", any::<u64>(), any::<u64>()), 0..4),
        )
            .prop_map(
                |(
                    name,
                    thresholds,
                    shard_count,
                    workers,
                    lora_adapters,
                    (credit, temperature),
                    disagg,
                    (ttft_ms, itl_ms),
                    tenants,
                )| {
                    ModelState {
                        name,
                        thresholds,
                        shard_count,
                        workers,
                        retry_after_s: shard_count % 61,
                        lora_adapters,
                        policy: Policy {
                            overlap_credit: credit,
                            temperature,
                            thermal_weight: temperature * 3.0,
                            ..Policy::default()
                        },
                        service_rate_per_s: credit * 10.0,
                        plan: ModelPlan {
                            desired: shard_count % 7,
                            ready: shard_count % 5,
                            scale_up_eta_s: shard_count % 3,
                        },
                        prompt_template: u64::from(shard_count).wrapping_mul(0x9E37),
                        disaggregation: disagg.map(|(protocol, tokens, ratio, timeout, fail)| {
                            Disaggregation {
                                protocol: Protocol::ALL[usize::from(protocol)],
                                conditional: Conditional {
                                    max_uncached_tokens: tokens,
                                    max_uncached_ratio: ratio,
                                },
                                on_prefill_failure: if fail {
                                    OnPrefillFailure::Fail
                                } else {
                                    OnPrefillFailure::Local
                                },
                                prefill_timeout_ms: timeout,
                                decode_affinity: credit,
                                pull: (tokens % 2 == 0).then(|| Pull {
                                    min_blocks: (tokens % 64) as u32,
                                    ..Pull::default()
                                }),
                            }
                        }),
                        retry_after_by_pool_s: [shard_count % 11, shard_count % 13],
                        slo: Slo { ttft_ms, itl_ms },
                        tenants: tenants
                            .into_iter()
                            .map(|(tenant, prefill_tokens, decode_blocks)| TenantLoad {
                                tenant,
                                prefill_tokens,
                                decode_blocks,
                            })
                            .collect(),
                    }
                },
            );
        let applied = (any::<u64>(), any::<u64>()).prop_map(|(vm, seq)| Applied { vm, seq });
        (
            any::<u64>(),
            any::<u64>(),
            prop::collection::vec(model, 0..4),
            prop::collection::vec(applied, 0..3),
        )
            .prop_map(|(version, built_at_ms, models, applied)| Snapshot {
                version,
                built_at_ms,
                models,
                applied,
            })
    }

    proptest! {
        #[test]
        fn prop_round_trip(s in arb_snapshot()) {
            let bytes = s.encode().unwrap();
            prop_assert_eq!(Snapshot::decode(&bytes).unwrap(), s);
        }

        #[test]
        fn prop_truncation_is_an_error_not_a_panic(s in arb_snapshot(), cut in 0usize..4096) {
            let bytes = s.encode().unwrap();
            let cut = cut.min(bytes.len().saturating_sub(1));
            prop_assert!(Snapshot::decode(&bytes[..cut]).is_err());
        }

        #[test]
        fn prop_decoding_into_an_old_snapshot_is_decoding_afresh(old in arb_snapshot(), new in arb_snapshot()) {
            let bytes = new.encode().unwrap();
            let mut into = old.clone();
            into.decode_into(&bytes).unwrap();
            prop_assert_eq!(into, new);
        }

        #[test]
        fn prop_after_a_failed_decode_the_next_one_is_whole(
            old in arb_snapshot(),
            bad in arb_snapshot(),
            cut in 0usize..4096,
            new in arb_snapshot(),
        ) {
            let bad = bad.encode().unwrap();
            let mut into = old;
            prop_assert!(into.decode_into(&bad[..cut.min(bad.len() - 1)]).is_err());
            into.decode_into(&new.encode().unwrap()).unwrap();
            prop_assert_eq!(into, new);
        }

        #[test]
        fn prop_random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = Snapshot::decode(&bytes);
        }

        #[test]
        fn prop_corrupted_snapshots_never_panic(s in arb_snapshot(), at in any::<usize>(), val in any::<u8>()) {
            let mut bytes = s.encode().unwrap();
            if !bytes.is_empty() {
                let i = at % bytes.len();
                bytes[i] = val;
            }
            let _ = Snapshot::decode(&bytes);
        }
    }
}
