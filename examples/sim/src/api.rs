//! The simulator's HTTP surface: OpenAI-compatible completions (streaming
//! and not), vLLM's `/metrics`, and a few admin endpoints for tests.

use crate::cache::Scope;
use crate::engine::{AdmitError, Admitted, Rank, TimeModel, admit};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub struct Sim {
    /// The model's tokenizer and chat template.
    pub text: crate::tokenizer::RealText,
    pub worker_id: u64,
    pub model: String,
    /// LoRA adapters served besides the base model.
    pub lora_modules: Vec<String>,
    pub default_max_tokens: usize,
    pub time: TimeModel,
    pub ranks: Vec<Arc<Rank>>,
    pub requests: AtomicU64,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_batched_tokens: usize,
    pub metrics_flavor: MetricsFlavor,
    /// The worker's GPUs.
    pub plant: crate::thermal::Plant,
    /// `/v1/admin/batch` requires `Authorization: Bearer <this>` when set.
    pub admin_token: Option<String>,
    /// The worker's part in prefill/decode disaggregation, if any.
    pub disagg: crate::disagg::Disagg,
}

impl Sim {
    /// Sequences running on every rank.
    pub fn running(&self) -> u32 {
        self.ranks
            .iter()
            .map(|r| r.running.load(Ordering::Relaxed))
            .sum()
    }

    /// A decode step's time with `running` on the rank, slowed by the
    /// GPUs' clocks.
    async fn decode_step(&self, admitted: &mut Admitted) {
        admitted.checkpoint().await;
        let step = admitted.rank().decode_step(&self.time);
        if step.is_zero() {
            // Even an instant worker hands each token over on its own: a
            // stream leaves as many writes, as an engine's does, not one.
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(step.div_f64(self.plant.clock_factor())).await;
        }
    }
}

pub fn router(sim: Arc<Sim>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/state", get(state))
        .route("/sim/disagg", get(crate::disagg::legs::introspect))
        .route("/sim/restart", post(restart))
        .route(
            "/sim/thermal",
            get(crate::admin::thermal_state).post(crate::admin::thermal_change),
        )
        .route("/dcgm/metrics", get(crate::admin::dcgm))
        .route("/v1/admin/batch", post(crate::admin::batch))
        .with_state(sim)
}

pub(crate) fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}});
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

pub(crate) fn bad(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// A parsed request, whichever endpoint it came from.
pub(crate) struct Job {
    pub(crate) chat: bool,
    /// The adapter the request names and its salt.
    pub(crate) scope: Scope,
    pub(crate) tokens: Vec<u32>,
    pub(crate) max_tokens: usize,
    pub(crate) stream: bool,
    /// `stream_options.include_usage`: as in vLLM, a stream carries usage
    /// only when asked, in a final chunk of its own.
    include_usage: bool,
}

fn parse_prompt(text: &crate::tokenizer::RealText, v: &Value) -> Result<Vec<u32>, String> {
    match v {
        Value::String(s) => text.prompt(s),
        Value::Array(items) if items.is_empty() => Err("prompt is empty".into()),
        Value::Array(items) => match &items[0] {
            // A list of strings or of token lists is a batch; the simulator
            // serves its first element, which is what routing looks at.
            Value::String(_) | Value::Array(_) => parse_prompt(text, &items[0]),
            _ => items
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or("token ids must be u32".to_string())
                })
                .collect(),
        },
        _ => Err("prompt must be a string, a list of strings or a list of token ids".into()),
    }
}

fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Refuses what vLLM refuses before rendering: messages that are not a
/// list of objects with a role and string or list-of-parts content.
fn check_messages(v: &Value) -> Result<(), String> {
    let items = v.as_array().ok_or("messages must be a list")?;
    for m in items {
        m["role"].as_str().ok_or("each message needs a role")?;
        if !matches!(
            &m["content"],
            Value::String(_) | Value::Array(_) | Value::Null
        ) {
            return Err("message content must be a string or a list of parts".into());
        }
    }
    Ok(())
}

fn parse(sim: &Sim, body: &[u8], chat: bool) -> Result<(Job, Value), Box<Response>> {
    let v: Value = serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let model = v["model"]
        .as_str()
        .ok_or_else(|| bad("model is required"))?;
    let adapter = sim.lora_modules.iter().any(|a| a == model);
    if model != sim.model && !adapter {
        return Err(Box::new(error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{model}` does not exist."),
        )));
    }
    let tokens = if chat {
        check_messages(&v["messages"]).map_err(|e| Box::new(bad(e)))?;
        sim.text.chat(&v, unix_s()).map_err(|e| Box::new(bad(e)))?
    } else {
        parse_prompt(&sim.text, &v["prompt"]).map_err(|e| Box::new(bad(e)))?
    };
    let max_tokens = v["max_tokens"]
        .as_u64()
        .or_else(|| v["max_completion_tokens"].as_u64())
        .map_or(sim.default_max_tokens, |m| m as usize)
        .max(1);
    let cache_salt = match &v["cache_salt"] {
        Value::Null => None,
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        _ => return Err(Box::new(bad("cache_salt must be a non-empty string"))),
    };
    let job = Job {
        chat,
        scope: Scope {
            lora_name: adapter.then(|| model.to_string()),
            cache_salt,
        },
        tokens,
        max_tokens,
        stream: v["stream"].as_bool().unwrap_or(false),
        include_usage: v["stream_options"]["include_usage"]
            .as_bool()
            .unwrap_or(false),
    };
    Ok((job, v))
}

pub(crate) fn pick_rank(sim: &Sim, headers: &HeaderMap) -> Result<Arc<Rank>, Box<Response>> {
    if let Some(v) = headers.get("x-data-parallel-rank") {
        let r: usize = v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| bad("X-Data-Parallel-Rank must be an integer"))?;
        let n = sim.ranks.len();
        let rank = sim.ranks.get(r).cloned();
        return rank.ok_or_else(|| {
            Box::new(bad(format!(
                "X-Data-Parallel-Rank {r} is out of range (data parallel size {n})"
            )))
        });
    }
    let least = sim.ranks.iter().min_by_key(|r| r.load()).cloned();
    least.ok_or_else(|| Box::new(bad("no ranks")))
}

async fn completions(State(sim): State<Arc<Sim>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(sim, headers, body, false).await
}

async fn chat(State(sim): State<Arc<Sim>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(sim, headers, body, true).await
}

pub(crate) fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The i-th output word: deterministic filler text.
pub(crate) fn word(i: usize) -> &'static str {
    const WORDS: [&str; 8] = [
        "the ", "cache ", "is ", "warm ", "and ", "tokens ", "flow ", "fast ",
    ];
    WORDS[i % WORDS.len()]
}

async fn serve(sim: Arc<Sim>, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    let (job, v) = match parse(&sim, &body, chat) {
        Ok(j) => j,
        Err(r) => return *r,
    };
    let leg = match sim.disagg.leg(&v) {
        Ok(l) => l,
        Err(why) => return crate::disagg::legs::rejected(&sim, &headers, &v, chat, why),
    };
    crate::disagg::legs::serve(sim, headers, job, &v, leg).await
}

/// What a request does before its first token.
pub(crate) enum Start {
    /// Computes its uncached prompt tokens.
    Prefill,
    /// Receives its prompt's KV blocks: the transfer's time.
    Transfer(std::time::Duration),
}

impl Start {
    async fn run(&self, sim: &Sim, admitted: &Admitted, prompt: usize) {
        match self {
            Start::Prefill => {
                admitted
                    .rank()
                    .prefill(&sim.time, prompt - admitted.cached_tokens)
                    .await
            }
            Start::Transfer(d) if d.is_zero() => {}
            Start::Transfer(d) => tokio::time::sleep(*d).await,
        }
    }
}

/// Admits and answers a request on `rank`, streaming or not.
pub(crate) async fn local(sim: Arc<Sim>, job: Job, rank: Arc<Rank>, start: Start) -> Response {
    let admitted = match admit(rank, &job.tokens, &job.scope, job.max_tokens).await {
        Ok(a) => a,
        Err(e @ AdmitError::TooLong { .. }) => return bad(e.to_string()),
    };
    respond(sim, job, admitted, start).await
}

/// Answers an admitted request, streaming or not.
pub(crate) async fn respond(sim: Arc<Sim>, job: Job, admitted: Admitted, start: Start) -> Response {
    let id = sim.requests.fetch_add(1, Ordering::Relaxed);
    if job.stream {
        stream(sim.clone(), job, admitted, id, start)
    } else {
        whole(sim.clone(), job, admitted, id, start).await
    }
}

pub(crate) fn sim_headers(resp: &mut Response, sim: &Sim, rank: u32, cached: usize) {
    let h = resp.headers_mut();
    let mut put = |k: &'static str, v: String| {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(k, v);
        }
    };
    put("x-kvgate-sim-worker", sim.worker_id.to_string());
    put("x-kvgate-sim-rank", rank.to_string());
    put("x-kvgate-sim-cached-tokens", cached.to_string());
}

fn usage(job: &Job, cached: usize) -> Value {
    json!({
        "prompt_tokens": job.tokens.len(),
        "completion_tokens": job.max_tokens,
        "total_tokens": job.tokens.len() + job.max_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

async fn whole(sim: Arc<Sim>, job: Job, mut admitted: Admitted, id: u64, start: Start) -> Response {
    let cached = admitted.cached_tokens;
    let rank = admitted.rank().index;
    start.run(&sim, &admitted, job.tokens.len()).await;
    let mut text = String::new();
    for i in 0..job.max_tokens {
        sim.decode_step(&mut admitted).await;
        text.push_str(word(i));
    }
    drop(admitted);
    let body = completion_body(&sim, &job, &text, id, cached);
    let mut resp = ([("content-type", "application/json")], body.to_string()).into_response();
    sim_headers(&mut resp, &sim, rank, cached);
    resp
}

/// A non-streaming answer's body.
pub(crate) fn completion_body(sim: &Sim, job: &Job, text: &str, id: u64, cached: usize) -> Value {
    if job.chat {
        json!({"id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": now_s(), "model": sim.model,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
               "usage": usage(job, cached)})
    } else {
        json!({"id": format!("cmpl-{id}"), "object": "text_completion", "created": now_s(), "model": sim.model,
               "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
               "usage": usage(job, cached)})
    }
}

fn stream(sim: Arc<Sim>, job: Job, mut admitted: Admitted, id: u64, start: Start) -> Response {
    let cached = admitted.cached_tokens;
    let rank = admitted.rank().index;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let s2 = sim.clone();
    tokio::spawn(async move {
        // `admitted` lives in this task: when the client goes away the send
        // fails, the task ends and the request's blocks are released.
        let sim = s2;
        start.run(&sim, &admitted, job.tokens.len()).await;
        let (object, idp) = if job.chat {
            ("chat.completion.chunk", "chatcmpl")
        } else {
            ("text_completion", "cmpl")
        };
        for i in 0..job.max_tokens {
            if i > 0 {
                sim.decode_step(&mut admitted).await;
            }
            let last = i + 1 == job.max_tokens;
            let finish = if last { json!("length") } else { Value::Null };
            let choice = if job.chat {
                let delta = if i == 0 {
                    json!({"role": "assistant", "content": word(i)})
                } else {
                    json!({"content": word(i)})
                };
                json!({"index": 0, "delta": delta, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": word(i), "logprobs": null, "finish_reason": finish})
            };
            let chunk = json!({"id": format!("{idp}-{id}"), "object": object, "created": now_s(), "model": sim.model, "choices": [choice]});
            if tx
                .send(Ok(Bytes::from(format!("data: {chunk}\n\n"))))
                .await
                .is_err()
            {
                return;
            }
        }
        if job.include_usage {
            let chunk = json!({"id": format!("{idp}-{id}"), "object": object, "created": now_s(), "model": sim.model, "choices": [], "usage": usage(&job, cached)});
            if tx
                .send(Ok(Bytes::from(format!("data: {chunk}\n\n"))))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        drop(admitted);
    });
    let body = Body::from_stream(tokio_stream_from(rx));
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    resp.headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    sim_headers(&mut resp, &sim, rank, cached);
    resp
}

/// Adapts an mpsc receiver into a stream without pulling in tokio-stream.
fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn models(State(sim): State<Arc<Sim>>) -> Response {
    let body = json!({"object": "list", "data": [{"id": sim.model, "object": "model", "created": now_s(), "owned_by": "kvgate-sim"}]});
    ([("content-type", "application/json")], body.to_string()).into_response()
}

async fn reset_prefix_cache(State(sim): State<Arc<Sim>>) -> Response {
    let all = sim.ranks.iter().all(|r| r.reset_prefix_cache());
    if all {
        StatusCode::OK.into_response()
    } else {
        error(
            StatusCode::CONFLICT,
            "conflict",
            "requests are running; prefix cache not reset on every rank",
        )
    }
}

async fn restart(State(sim): State<Arc<Sim>>) -> Response {
    for r in &sim.ranks {
        r.restart();
    }
    StatusCode::OK.into_response()
}

async fn state(State(sim): State<Arc<Sim>>) -> Response {
    let ranks: Vec<Value> = sim
        .ranks
        .iter()
        .map(|r| {
            let c = r.cache();
            json!({
                "rank": r.index,
                "cached_blocks": c.cached_blocks(),
                "used_blocks": c.used_blocks(),
                "running": r.running.load(Ordering::Relaxed),
                "waiting": r.waiting.load(Ordering::Relaxed),
                "prefix_cache_queries": r.prefix_queries.load(Ordering::Relaxed),
                "prefix_cache_hits": r.prefix_hits.load(Ordering::Relaxed),
                "finished": r.finished.load(Ordering::Relaxed),
            })
        })
        .collect();
    let body = json!({"worker_id": sim.worker_id, "model": sim.model, "requests_total": sim.requests.load(Ordering::Relaxed), "ranks": ranks});
    ([("content-type", "application/json")], body.to_string()).into_response()
}

/// The engine whose `/metrics` the simulator imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricsFlavor {
    Vllm,
    Sglang,
}

/// SGLang 0.5.x's scheduler gauges as `prometheus_client` writes them: one
/// series per scheduler, ranked by `dp_rank` only under data parallelism,
/// capacity in tokens and pages, usage as a fraction of tokens.
fn sglang_metrics(sim: &Sim) -> String {
    let mut out = String::new();
    let m = &sim.model;
    let dp = sim.ranks.len() > 1;
    let family = |out: &mut String, name: &str, help: &str, value: &dyn Fn(&Rank) -> f64| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for r in &sim.ranks {
            let dp_rank = if dp {
                format!("dp_rank=\"{}\",", r.index)
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "{name}{{{dp_rank}engine_type=\"unified\",model_name=\"{m}\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"}} {:?}",
                value(r)
            );
        }
    };
    let tokens = (sim.num_gpu_blocks * sim.block_size) as f64;
    family(
        &mut out,
        "sglang:num_running_reqs",
        "The number of running requests.",
        &|r| r.running.load(Ordering::Relaxed) as f64,
    );
    family(
        &mut out,
        "sglang:num_used_tokens",
        "The number of used tokens.",
        &|r| (r.cache().usage() * tokens).round(),
    );
    family(&mut out, "sglang:token_usage", "The token usage.", &|r| {
        r.cache().usage()
    });
    family(
        &mut out,
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        &|r| r.waiting.load(Ordering::Relaxed) as f64,
    );
    family(
        &mut out,
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
        &|_| tokens,
    );
    family(
        &mut out,
        "sglang:page_size",
        "KV cache page size in tokens.",
        &|_| sim.block_size as f64,
    );
    family(
        &mut out,
        "sglang:num_pages",
        "Number of KV cache pages.",
        &|_| sim.num_gpu_blocks as f64,
    );
    out
}

async fn metrics(State(sim): State<Arc<Sim>>) -> Response {
    if sim.metrics_flavor == MetricsFlavor::Sglang {
        return (
            [("content-type", "text/plain; version=0.0.4")],
            sglang_metrics(&sim),
        )
            .into_response();
    }
    let mut out = String::new();
    let m = &sim.model;
    let family =
        |out: &mut String, name: &str, kind: &str, help: &str, value: &dyn Fn(&Rank) -> String| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for r in &sim.ranks {
                let _ = writeln!(
                    out,
                    "{name}{{engine=\"{}\",model_name=\"{m}\"}} {}",
                    r.index,
                    value(r)
                );
            }
        };
    family(
        &mut out,
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &|r| format!("{:.1}", r.running.load(Ordering::Relaxed) as f64),
    );
    family(
        &mut out,
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &|r| format!("{:.1}", r.waiting.load(Ordering::Relaxed) as f64),
    );
    family(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &|r| format!("{}", r.cache().usage()),
    );
    family(
        &mut out,
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage (deprecated name).",
        &|r| format!("{}", r.cache().usage()),
    );
    family(
        &mut out,
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in tokens.",
        &|r| format!("{:.1}", r.prefix_queries.load(Ordering::Relaxed) as f64),
    );
    family(
        &mut out,
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in tokens.",
        &|r| format!("{:.1}", r.prefix_hits.load(Ordering::Relaxed) as f64),
    );
    family(
        &mut out,
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemptions.",
        &|_| "0.0".into(),
    );
    family(
        &mut out,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        &|r| format!("{:.1}", r.finished.load(Ordering::Relaxed) as f64),
    );
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig"
    );
    let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
    for r in &sim.ranks {
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"{}\",max_num_batched_tokens=\"{}\",model_name=\"{m}\",num_gpu_blocks=\"{}\"}} 1.0",
            sim.block_size, r.index, sim.max_num_batched_tokens, sim.num_gpu_blocks
        );
    }
    ([("content-type", "text/plain; version=0.0.4")], out).into_response()
}
