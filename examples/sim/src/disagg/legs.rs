//! The HTTP side of the PD legs: what a prefill or decode leg does between
//! parsing and answering, and `/sim/disagg`.

use super::frame::BlockIdentity;
use super::record::Record;
use super::{Leg, LoadFailurePolicy, bootstrap, side_channel};
use crate::api::{
    Job, Sim, Start, bad, completion_body, error, local, pick_rank, respond, sim_headers, word,
};
use crate::engine::{AdmitError, Rank, admit, admit_publishing};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What a leg reports for the record besides its status.
#[derive(Default)]
struct Outcome {
    pulled_blocks: usize,
    recomputed: bool,
    error: Option<String>,
}

impl Outcome {
    fn failed(why: impl Into<String>) -> Outcome {
        Outcome {
            error: Some(why.into()),
            ..Outcome::default()
        }
    }
}

fn request_id(sim: &Sim, headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(str::to_string)
        .unwrap_or_else(|| sim.disagg.new_request_id())
}

fn endpoint(chat: bool) -> &'static str {
    if chat { "chat" } else { "completions" }
}

fn load_failed(why: &str) -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "InternalServerError",
        format!("KV load failed (kv_load_failure_policy=fail): {why}"),
    )
}

/// A 400 for PD fields this worker cannot serve, recorded.
pub(crate) fn rejected(
    sim: &Sim,
    headers: &HeaderMap,
    body: &Value,
    chat: bool,
    why: String,
) -> Response {
    sim.disagg.counters.rejected.fetch_add(1, Ordering::Relaxed);
    sim.disagg.record.push(Record {
        request_id: request_id(sim, headers),
        endpoint: endpoint(chat),
        leg: "rejected",
        rank: None,
        kv_transfer_params: body["kv_transfer_params"].clone(),
        bootstrap_room: body["bootstrap_room"].as_u64(),
        status: 400,
        pulled_blocks: 0,
        recomputed: false,
        error: Some(why.clone()),
        body_keys: Record::keys_of(body),
        vllm_xargs: body["vllm_xargs"].clone(),
        took_us: 0,
    });
    bad(why)
}

/// Serves a request as its leg asks, and records it.
pub(crate) async fn serve(
    sim: Arc<Sim>,
    headers: HeaderMap,
    job: Job,
    body: &Value,
    leg: Leg,
) -> Response {
    let id = request_id(&sim, &headers);
    let rank = match &leg {
        // SGLang picks the rank by room on both sides, so the pair agree.
        Leg::SglangPrefill { room } | Leg::SglangDecode { room, .. } => {
            let n = sim.ranks.len().max(1) as u64;
            sim.ranks[(*room % n) as usize].clone()
        }
        _ => match pick_rank(&sim, &headers) {
            Ok(r) => r,
            Err(r) => return *r,
        },
    };
    let chat = job.chat;
    if sim.disagg.config.stall_after_headers
        && matches!(leg, Leg::NixlPrefill | Leg::SglangPrefill { .. })
    {
        return stalled(&sim, id, chat, body, &leg, rank.index);
    }
    let started = std::time::Instant::now();
    let (resp, outcome) = match &leg {
        Leg::Local => (
            local(sim.clone(), job, rank.clone(), Start::Prefill).await,
            Outcome::default(),
        ),
        Leg::NixlPrefill => nixl_prefill(&sim, job, rank.clone(), &id).await,
        Leg::NixlDecode(remote) => nixl_decode(&sim, job, rank.clone(), remote).await,
        Leg::SglangPrefill { room } => sglang_prefill(&sim, job, rank.clone(), *room).await,
        Leg::SglangDecode { room, host, port } => {
            sglang_decode(&sim, job, rank.clone(), *room, host, *port).await
        }
    };
    sim.disagg.record.push(Record {
        request_id: id,
        endpoint: endpoint(chat),
        leg: leg.name(),
        rank: Some(rank.index),
        kv_transfer_params: body["kv_transfer_params"].clone(),
        bootstrap_room: body["bootstrap_room"].as_u64(),
        status: resp.status().as_u16(),
        pulled_blocks: outcome.pulled_blocks,
        recomputed: outcome.recomputed,
        error: outcome.error,
        body_keys: Record::keys_of(body),
        vllm_xargs: body["vllm_xargs"].clone(),
        took_us: u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
    });
    resp
}

/// A prefill leg of a worker that stalls (`--prefill-stall-after-headers`):
/// 200 and its headers, then a body that never comes. The connection is
/// held until the client goes away (hyper drops the body then).
fn stalled(sim: &Sim, id: String, chat: bool, body: &Value, leg: &Leg, rank: u32) -> Response {
    sim.disagg
        .counters
        .prefill_legs
        .fetch_add(1, Ordering::Relaxed);
    let why = "stalled after its headers (--prefill-stall-after-headers)";
    sim.disagg.record.push(Record {
        request_id: id,
        endpoint: endpoint(chat),
        leg: leg.name(),
        rank: Some(rank),
        kv_transfer_params: body["kv_transfer_params"].clone(),
        bootstrap_room: body["bootstrap_room"].as_u64(),
        status: 200,
        pulled_blocks: 0,
        recomputed: false,
        error: Some(why.into()),
        body_keys: Record::keys_of(body),
        vllm_xargs: body["vllm_xargs"].clone(),
        took_us: 0,
    });
    tracing::info!("a prefill leg stalls after its headers");
    let never = futures::stream::pending::<Result<axum::body::Bytes, std::io::Error>>();
    let mut resp = (
        [("content-type", "application/json")],
        axum::body::Body::from_stream(never),
    )
        .into_response();
    sim_headers(&mut resp, sim, rank, 0);
    resp
}

/// Whether a prompt ends in a partial block. A transfer names the prompt's
/// full blocks and then that one: its KV moves too (the decode leg does no
/// prefill compute at all), though it is never cached.
fn partial_tail(rank: &Rank, tokens: usize) -> bool {
    !tokens.is_multiple_of(rank.cache().block_size())
}

/// vLLM's prefill leg: prefill, hold the blocks, answer one token and the
/// `kv_transfer_params` the decode leg pulls with.
async fn nixl_prefill(
    sim: &Arc<Sim>,
    mut job: Job,
    rank: Arc<Rank>,
    id: &str,
) -> (Response, Outcome) {
    let d = &sim.disagg;
    d.counters.prefill_legs.fetch_add(1, Ordering::Relaxed);
    if job.stream {
        let why = "a prefill leg (do_remote_decode) must set stream to false: \
                   its kv_transfer_params come back in a non-streaming response";
        return (bad(why), Outcome::failed(why));
    }
    let Some(channel) = d.side_channels.get(rank.index as usize) else {
        let why = "this worker has no KV side channel";
        return (
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                why,
            ),
            Outcome::failed(why),
        );
    };
    // The answer's one token comes out of the prefill itself.
    job.max_tokens = 1;
    let admitted = match admit(rank.clone(), &job.tokens, &job.scope, 1).await {
        Ok(a) => a,
        Err(e @ AdmitError::TooLong { .. }) => {
            return (bad(e.to_string()), Outcome::failed(e.to_string()));
        }
    };
    let cached = admitted.cached_tokens;
    rank.prefill(&sim.time, job.tokens.len() - cached).await;
    let block_ids = channel.leases.grant(
        id,
        admitted.blocks(),
        partial_tail(&rank, job.tokens.len()),
        d.config.lease,
    );
    drop(admitted);
    let n = sim.requests.fetch_add(1, Ordering::Relaxed);
    let mut body = completion_body(sim, &job, word(0), n, cached);
    body["kv_transfer_params"] = super::nixl::answer(
        &channel.engine_id,
        id,
        &block_ids,
        &d.config.advertise_host,
        channel.port,
    );
    let mut resp = ([("content-type", "application/json")], body.to_string()).into_response();
    sim_headers(&mut resp, sim, rank.index, cached);
    (resp, Outcome::default())
}

/// Checks that received blocks are the prompt's own, from `from` on: a
/// prefill engine that hashes differently (another seed, block size or
/// tokenizer) would hand over KV for other tokens.
fn check_identities(chain: &[u64], from: usize, got: &[BlockIdentity]) -> Result<(), String> {
    for (i, b) in got.iter().enumerate() {
        let pos = from + i;
        if b.hash != chain.get(pos).copied() {
            return Err(format!(
                "block {pos} differs between the prefill engine and this worker (hash seed, block size or tokenizer)"
            ));
        }
    }
    Ok(())
}

/// vLLM's decode leg: pull the blocks this worker lacks, cache them, then
/// decode with no prefill compute. The pull's answer comes once the bytes
/// are through the holder's link, so the transfer is already paid here.
async fn nixl_decode(
    sim: &Arc<Sim>,
    job: Job,
    rank: Arc<Rank>,
    remote: &super::nixl::RemotePrefill,
) -> (Response, Outcome) {
    let d = &sim.disagg;
    d.counters.decode_legs.fetch_add(1, Ordering::Relaxed);
    let (chain, held) = {
        let c = rank.cache();
        let chain = c.chain(&job.tokens, &job.scope);
        let held = c.matched(&chain);
        (chain, held)
    };
    let expected = chain.len() + usize::from(partial_tail(&rank, job.tokens.len()));
    let loaded = async {
        if remote.block_ids.len() != expected {
            return Err(format!(
                "the prefill names {} blocks but this prompt has {expected}",
                remote.block_ids.len()
            ));
        }
        // Even with every block held locally the pull is made: it is what
        // tells the prefill engine to free its copy.
        let want = &remote.block_ids[held..];
        let got = side_channel::pull(
            &remote.host,
            remote.port,
            &remote.engine_id,
            &remote.request_id,
            want,
            d.config.pull_timeout,
        )
        .await
        .map_err(|e| e.to_string())?;
        check_identities(&chain, held, &got)?;
        Ok(Loaded {
            blocks: got.len(),
            transfer_left: Duration::ZERO,
        })
    }
    .await;
    received(sim, job, rank, loaded).await
}

/// The blocks a decode leg received, and how much of their transfer it has
/// yet to wait for before its first token.
struct Loaded {
    blocks: usize,
    transfer_left: Duration,
}

/// A decode leg once its load is known: decode what arrived, or fail, or
/// recompute, by the failure policy.
async fn received(
    sim: &Arc<Sim>,
    job: Job,
    rank: Arc<Rank>,
    loaded: Result<Loaded, String>,
) -> (Response, Outcome) {
    let d = &sim.disagg;
    match loaded {
        Ok(Loaded {
            blocks,
            transfer_left,
        }) => {
            d.counters.pulls.fetch_add(1, Ordering::Relaxed);
            d.counters
                .blocks_pulled
                .fetch_add(blocks as u64, Ordering::Relaxed);
            let admitted = match admit_publishing(
                rank,
                &job.tokens,
                &job.scope,
                job.max_tokens,
                d.config.publish_received,
            )
            .await
            {
                Ok(a) => a,
                Err(e @ AdmitError::TooLong { .. }) => {
                    return (bad(e.to_string()), Outcome::failed(e.to_string()));
                }
            };
            let resp = respond(sim.clone(), job, admitted, Start::Transfer(transfer_left)).await;
            (
                resp,
                Outcome {
                    pulled_blocks: blocks,
                    ..Outcome::default()
                },
            )
        }
        Err(why) => {
            d.counters.failed_pulls.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %why, "KV load failed");
            match d.config.failure_policy {
                LoadFailurePolicy::Fail => (load_failed(&why), Outcome::failed(why)),
                LoadFailurePolicy::Recompute => {
                    d.counters.recomputes.fetch_add(1, Ordering::Relaxed);
                    let resp = local(sim.clone(), job, rank, Start::Prefill).await;
                    (
                        resp,
                        Outcome {
                            recomputed: true,
                            error: Some(why),
                            ..Outcome::default()
                        },
                    )
                }
            }
        }
    }
}

/// SGLang's prefill leg: wait for the decode worker to join the room,
/// prefill, hand the blocks over, answer (the router drains the answer).
async fn sglang_prefill(
    sim: &Arc<Sim>,
    mut job: Job,
    rank: Arc<Rank>,
    room: u64,
) -> (Response, Outcome) {
    let d = &sim.disagg;
    d.counters.prefill_legs.fetch_add(1, Ordering::Relaxed);
    let mut seat = match d.rooms.claim_prefill(room) {
        Ok(s) => s,
        Err(why) => return (bad(why.clone()), Outcome::failed(why)),
    };
    if let Err(why) = seat.wait_for_decoder(d.config.bootstrap_timeout).await {
        d.counters
            .bootstrap_timeouts
            .fetch_add(1, Ordering::Relaxed);
        let resp = error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            why.clone(),
        );
        return (resp, Outcome::failed(why));
    }
    job.max_tokens = 1;
    let admitted = match admit(rank.clone(), &job.tokens, &job.scope, 1).await {
        Ok(a) => a,
        Err(e @ AdmitError::TooLong { .. }) => {
            seat.hand_off(Err(format!("the prefill worker refused the prompt: {e}")));
            return (bad(e.to_string()), Outcome::failed(e.to_string()));
        }
    };
    let cached = admitted.cached_tokens;
    rank.prefill(&sim.time, job.tokens.len() - cached).await;
    let mut blocks: Vec<BlockIdentity> = admitted
        .blocks()
        .iter()
        .enumerate()
        .map(|(i, h)| BlockIdentity {
            id: i as u32,
            hash: Some(*h),
        })
        .collect();
    if partial_tail(&rank, job.tokens.len()) {
        blocks.push(BlockIdentity {
            id: blocks.len() as u32,
            hash: None,
        });
    }
    seat.hand_off(Ok(blocks));
    // The first token came out of the prefill: answer it with no step.
    let resp = respond(sim.clone(), job, admitted, Start::Transfer(Duration::ZERO)).await;
    (resp, Outcome::default())
}

/// SGLang's decode leg: join the prefill's bootstrap room, wait for the
/// blocks, decode. Unlike a NIXL pull it receives every block, held or
/// not: SGLang's decode worker hands the prefill a destination for the
/// whole prompt.
async fn sglang_decode(
    sim: &Arc<Sim>,
    job: Job,
    rank: Arc<Rank>,
    room: u64,
    host: &str,
    port: u16,
) -> (Response, Outcome) {
    let d = &sim.disagg;
    d.counters.decode_legs.fetch_add(1, Ordering::Relaxed);
    let chain = rank.cache().chain(&job.tokens, &job.scope);
    let expected = chain.len() + usize::from(partial_tail(&rank, job.tokens.len()));
    // The server answers its own timeout first, with the clearer reason.
    let wait = d.config.bootstrap_timeout + Duration::from_secs(1);
    let loaded = match bootstrap::join(host, port, room, wait).await {
        Ok(got) if got.len() != expected => Err(format!(
            "the prefill sent {} blocks but this prompt has {expected}",
            got.len()
        )),
        // The prefill hands the blocks over without a link of its own to
        // share, so the decode side charges their transfer as before.
        Ok(got) => check_identities(&chain, 0, &got).map(|()| Loaded {
            blocks: got.len(),
            transfer_left: d.transfer_time(got.len()),
        }),
        Err(why) => {
            if why.contains("timeout") {
                d.counters
                    .bootstrap_timeouts
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(why)
        }
    };
    received(sim, job, rank, loaded).await
}

/// `GET /sim/disagg`: the worker's PD state and its last requests.
pub async fn introspect(State(sim): State<Arc<Sim>>) -> Response {
    let d = &sim.disagg;
    let c = &d.counters;
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let body = json!({
        "kv_role": d.config.role.map(super::KvRole::name),
        "pd_protocol": match d.config.protocol {
            super::PdProtocol::Nixl => "nixl",
            super::PdProtocol::Sglang => "sglang",
        },
        "engine_ids": d.side_channels.iter().map(|s| s.engine_id.clone()).collect::<Vec<_>>(),
        "side_channel_host": d.config.advertise_host,
        "side_channel_ports": d.side_channels.iter().map(|s| s.port).collect::<Vec<_>>(),
        "bootstrap_port": d.bootstrap_port,
        "open_rooms": d.rooms.open(),
        "counters": {
            "prefill_legs": n(&c.prefill_legs),
            "decode_legs": n(&c.decode_legs),
            "pulls_served": n(&c.pulls_served),
            "pulls": n(&c.pulls),
            "failed_pulls": n(&c.failed_pulls),
            "blocks_pulled": n(&c.blocks_pulled),
            "recomputes": n(&c.recomputes),
            "lease_expiries": n(&c.lease_expiries),
            "bootstrap_pairs": n(&c.bootstrap_pairs),
            "bootstrap_timeouts": n(&c.bootstrap_timeouts),
            "rejected": n(&c.rejected),
            "held_blocks": d.held_blocks(),
            "link_bytes": d.link.bytes(),
            "link_max_concurrent": d.link.max_concurrent(),
        },
        "recent": d.record.json(),
    });
    ([("content-type", "application/json")], body.to_string()).into_response()
}
