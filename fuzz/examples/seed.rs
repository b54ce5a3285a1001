//! Writes the `seed-*` files of `fuzz/corpus/`: small valid inputs for
//! every target, made with the real encoders where there are some, and by
//! hand (following `docs/kv-events.md`) for the engines' msgpack.
//!
//! `cargo run -p kvgate-fuzz --example seed`. Rewrites seeds in place and
//! leaves every other corpus file (hostile inputs, crashes) alone.

use kvgate_core::approx::{ChunkKind, Routed};
use kvgate_core::booking::{Event, Key};
use kvgate_core::shard::{self, Holder, TIER_DEVICE, TIER_DISK, TIER_HOST};
use kvgate_core::{Applied, ModelState, Policy, RankLoad, Snapshot, WorkerState};
use kvgate_core::{Thresholds, update};
use kvgate_fuzz::join_frames;
use kvgate_sidecar::sources::kv::dump::{self, Block, Dump, Group};
use std::path::Path;

/// Just enough msgpack to write the engines' shapes.
enum V {
    Nil,
    U(u64),
    I(i64),
    F(f64),
    S(&'static str),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(&'static str, V)>),
}

fn enc(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::U(u) => match *u {
            0..=0x7f => out.push(*u as u8),
            0x80..=0xff => out.extend([0xcc, *u as u8]),
            0x100..=0xffff => {
                out.push(0xcd);
                out.extend((*u as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(0xce);
                out.extend((*u as u32).to_be_bytes());
            }
            _ => {
                out.push(0xcf);
                out.extend(u.to_be_bytes());
            }
        },
        V::I(i) => {
            out.push(0xd3);
            out.extend(i.to_be_bytes());
        }
        V::F(f) => {
            out.push(0xcb);
            out.extend(f.to_be_bytes());
        }
        V::S(s) => {
            assert!(s.len() < 32);
            out.push(0xa0 | s.len() as u8);
            out.extend(s.as_bytes());
        }
        V::B(b) => {
            out.extend([0xc4, b.len() as u8]);
            out.extend(b);
        }
        V::A(items) => {
            if items.len() < 16 {
                out.push(0x90 | items.len() as u8);
            } else {
                out.push(0xdc);
                out.extend((items.len() as u16).to_be_bytes());
            }
            for i in items {
                enc(i, out);
            }
        }
        V::M(kvs) => {
            assert!(kvs.len() < 16);
            out.push(0x80 | kvs.len() as u8);
            for (k, v) in kvs {
                enc(&V::S(k), out);
                enc(v, out);
            }
        }
    }
}

fn mp(v: V) -> Vec<u8> {
    let mut out = Vec::new();
    enc(&v, &mut out);
    out
}

fn toks(from: u64, n: u64) -> V {
    V::A((from..from + n).map(V::U).collect())
}

const BIG: u64 = 18_446_744_073_709_551_000;

/// KV-event batches: each batch shape, each event shape, each hash kind.
fn kv_batches() -> Vec<(&'static str, Vec<u8>)> {
    use V::*;
    let positional = mp(A(vec![
        F(1_700_000_000.5),
        A(vec![
            A(vec![
                S("BlockStored"),
                A(vec![U(BIG), U(2)]),
                Nil,
                toks(1, 8),
                U(4),
                Nil,
                S("GPU"),
                Nil,
            ]),
            A(vec![
                S("BlockStored"),
                A(vec![U(3)]),
                U(2),
                toks(9, 4),
                U(4),
                U(7),
                S("CPU"),
                S("adapter-a"),
                Nil,
                U(0),
                S("full_attention"),
            ]),
            A(vec![S("BlockRemoved"), A(vec![U(BIG)]), S("GPU")]),
            A(vec![S("AllBlocksCleared")]),
        ]),
        U(0),
    ]));
    let tagged = mp(A(vec![
        F(2.0),
        A(vec![
            M(vec![
                ("type", S("BlockStored")),
                ("block_hashes", A(vec![U(BIG), U(5)])),
                ("parent_block_hash", Nil),
                ("token_ids", toks(300, 32)),
                ("block_size", U(16)),
                ("lora_id", Nil),
                ("medium", S("GPU")),
                ("lora_name", Nil),
                ("group_idx", U(0)),
                ("kv_cache_spec_kind", S("full_attention")),
            ]),
            M(vec![
                ("type", S("BlockStored")),
                ("block_hashes", A(vec![U(6)])),
                ("parent_block_hash", U(5)),
                ("token_ids", toks(332, 16)),
                ("block_size", U(16)),
                ("medium", S("CPU_TIER2")),
                ("locality", S("REMOTE")),
                ("session_id", S("s-1")),
            ]),
            M(vec![
                ("type", S("BlockRemoved")),
                ("block_hashes", A(vec![U(5)])),
                ("medium", S("DISK")),
            ]),
            M(vec![("type", S("BlockPromoted")), ("x", U(1))]),
            M(vec![("type", S("AllBlocksCleared"))]),
        ]),
        U(1),
    ]));
    let map_batch = mp(M(vec![
        ("ts", F(3.0)),
        (
            "events",
            A(vec![M(vec![
                ("type", S("BlockRemoved")),
                ("block_hashes", A(vec![I(-5)])),
                ("medium", Nil),
            ])]),
        ),
        ("data_parallel_rank", U(3)),
    ]));
    let sglang_salted = mp(A(vec![
        F(4.0),
        A(vec![
            A(vec![
                S("BlockStored"),
                A(vec![I(-5), U(2)]),
                Nil,
                toks(1, 8),
                U(4),
                Nil,
                Nil,
            ]),
            A(vec![
                S("BlockStored"),
                A(vec![I(-7)]),
                I(-5),
                toks(9, 4),
                U(4),
                Nil,
                S("CPU"),
                M(vec![("cache_salt", S("tenant-x"))]),
            ]),
            A(vec![S("BlockRemoved"), A(vec![I(-5)]), S("DISK")]),
        ]),
    ]));
    let byte_hashes = mp(A(vec![
        F(5.0),
        A(vec![
            M(vec![
                ("type", S("BlockStored")),
                ("block_hashes", A(vec![B(vec![1; 32]), B(vec![2; 32])])),
                ("parent_block_hash", B(vec![0; 32])),
                ("token_ids", toks(1, 8)),
                ("block_size", U(4)),
            ]),
            M(vec![
                ("type", S("BlockRemoved")),
                ("block_hashes", A(vec![B(vec![2; 32])])),
            ]),
        ]),
    ]));
    vec![
        ("seed-vllm-positional", positional),
        ("seed-vllm-tagged", tagged),
        ("seed-map-batch", map_batch),
        ("seed-sglang-salted", sglang_salted),
        ("seed-byte-hashes", byte_hashes),
    ]
}

/// The input of the security issue: 47 bytes whose `block_hashes` array32
/// header claims 2³²−1 hashes.
fn hostile_array32() -> Vec<u8> {
    let mut b = vec![0x92, 0xcb];
    b.extend(1.0f64.to_be_bytes());
    b.extend([0x91, 0x82, 0xa4]);
    b.extend(b"type");
    b.push(0xab);
    b.extend(b"BlockStored");
    b.push(0xac);
    b.extend(b"block_hashes");
    b.extend([0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert_eq!(b.len(), 47);
    b
}

fn snapshots() -> Vec<(&'static str, Snapshot)> {
    let rank = |rank, slot, busy| RankLoad {
        rank,
        slot,
        active_prefill_tokens: 1200,
        active_decode_blocks: 40,
        kv_used_blocks: 900,
        kv_total_blocks: 4096,
        max_num_batched_tokens: 8192,
        running: 3,
        waiting: u32::from(busy),
        busy,
    };
    let full = Snapshot {
        version: 42,
        built_at_ms: 1_700_000_000_000,
        models: vec![
            ModelState {
                name: "llama-3-8b".into(),
                thresholds: Thresholds {
                    active_decode_requests: None,
                    active_decode_blocks: Some(0.9),
                    active_prefill_tokens: Some(16384),
                    active_prefill_tokens_frac: None,
                },
                shard_count: 16384,
                workers: vec![
                    WorkerState {
                        id: 1,
                        endpoint: "10.0.0.1:8000".into(),
                        block_size: 16,
                        ranks: vec![rank(0, 0, false), rank(1, 1, true)],
                        tenant: "default".into(),
                        thermal: Default::default(),
                        draining: false,
                        role: kvgate_core::Role::Prefill,
                        bootstrap_port: 8998,
                        fits: Some(kvgate_core::WorkerFits {
                            ttft: kvgate_core::Fit {
                                intercept_ms: 30.0,
                                slope_ms_per_ktok: 15.5,
                                samples: 120,
                                age_s: 2,
                            },
                            itl: kvgate_core::Fit::default(),
                        }),
                        topology: kvgate_core::Topology {
                            node: "node-a".into(),
                            rack: "rack-1".into(),
                        },
                    },
                    WorkerState {
                        id: 2,
                        endpoint: "[fd00::2]:8000".into(),
                        block_size: 32,
                        ranks: vec![rank(0, 2, false)],
                        tenant: "team-b".into(),
                        thermal: kvgate_core::Thermal {
                            state: kvgate_core::ThermalState::Throttling,
                            heat: 1.0,
                            cap: 3,
                            in_flight: 2,
                        },
                        draining: true,
                        role: kvgate_core::Role::Decode,
                        bootstrap_port: 0,
                        fits: None,
                        topology: Default::default(),
                    },
                ],
                retry_after_s: 3,
                lora_adapters: vec!["sql-lora".into()],
                policy: Policy {
                    decode_active_request_weight: 0.5,
                    ..Policy::default()
                },
                service_rate_per_s: 45.0,
                plan: kvgate_core::ModelPlan {
                    desired: 3,
                    ready: 2,
                    scale_up_eta_s: 40,
                },
                prompt_template: 0x5EED,
                disaggregation: Some(kvgate_core::Disaggregation {
                    pull: Some(kvgate_core::disagg::pull::Pull::default()),
                    ..kvgate_core::Disaggregation::default()
                }),
                retry_after_by_pool_s: [12, 3],
                slo: kvgate_core::Slo {
                    ttft_ms: 400,
                    itl_ms: 40,
                },
                tenants: vec![
                    kvgate_core::TenantLoad {
                        tenant: "default".into(),
                        prefill_tokens: 2400,
                        decode_blocks: 80,
                    },
                    kvgate_core::TenantLoad {
                        tenant: "team-b".into(),
                        prefill_tokens: 1200,
                        decode_blocks: 40,
                    },
                ],
            },
            ModelState {
                name: "no-workers".into(),
                thresholds: Thresholds {
                    active_decode_requests: None,
                    active_decode_blocks: None,
                    active_prefill_tokens: None,
                    active_prefill_tokens_frac: Some(0.5),
                },
                shard_count: 0,
                workers: vec![],
                retry_after_s: 0,
                lora_adapters: Vec::new(),
                policy: Policy::default(),
                service_rate_per_s: 0.0,
                plan: Default::default(),
                prompt_template: 0,
                disaggregation: None,
                retry_after_by_pool_s: [0; 2],
                slo: Default::default(),
                tenants: Vec::new(),
            },
        ],
        applied: vec![
            Applied { vm: 7, seq: 100 },
            Applied {
                vm: u64::MAX,
                seq: 1,
            },
        ],
    };
    vec![
        ("seed-empty", Snapshot::default()),
        ("seed-two-models", full),
    ]
}

fn shards() -> Vec<(&'static str, Vec<u8>)> {
    let h = |slot, tiers| Holder { slot, tiers };
    let mut entries = vec![
        (
            0x0123_4567_89ab_cdef,
            vec![h(0, TIER_DEVICE), h(3, TIER_HOST)],
        ),
        (
            0xfedc_ba98_7654_3210,
            vec![h(1, TIER_DEVICE | TIER_HOST | TIER_DISK)],
        ),
        (5, vec![h(2, TIER_DISK)]),
        (6, vec![]),
    ];
    let mut one = vec![(u64::MAX, vec![h(u16::MAX, TIER_DEVICE)])];
    vec![
        ("seed-four-entries", shard::encode(&mut entries)),
        ("seed-one-entry", shard::encode(&mut one)),
        ("seed-no-entries", shard::encode(&mut [])),
    ]
}

fn bookings() -> Vec<(&'static str, Vec<u8>)> {
    let key = Key { vm: 0xabcd, seq: 1 };
    let all = [
        Event::Book {
            key,
            model: "llama-3-8b".into(),
            slot: 2,
            prefill_tokens: 1500,
            decode_blocks: 12,
            tenant: "team-a".into(),
        },
        Event::FirstByte { key },
        Event::Done { key, timing: None },
        Event::Done {
            key,
            timing: Some(kvgate_core::booking::Timing {
                first_byte_us: 80_000,
                total_us: 1_200_000,
                isl_tokens: 1500,
                output_tokens: 128,
                status: 200,
                client_first_byte_us: 80_000,
                ..Default::default()
            }),
        },
        Event::Rejected {
            model: "llama-3-8b".into(),
            reason: kvgate_core::reply::Reason::AllWorkersBusy,
        },
        Event::Alive { vm: 0xabcd },
    ];
    let mut batch = Vec::new();
    for e in &all {
        e.encode_into(&mut batch);
    }
    // A rejection as the release before the reason codes wrote it (tag 4,
    // the reason by name), which sidecars still read.
    let mut by_name = vec![4u8];
    for s in ["llama-3-8b", "thermal"] {
        by_name.extend_from_slice(&(s.len() as u16).to_le_bytes());
        by_name.extend_from_slice(s.as_bytes());
    }
    // A booking as the release before tenants wrote it (tag 1, no
    // tenant), which sidecars still read as the default tenant's.
    let mut untenanted = vec![1u8];
    for v in [0xabcdu64, 2] {
        untenanted.extend_from_slice(&v.to_le_bytes());
    }
    untenanted.extend_from_slice(&2u16.to_le_bytes());
    for v in [1500u32, 12] {
        untenanted.extend_from_slice(&v.to_le_bytes());
    }
    untenanted.extend_from_slice(&10u16.to_le_bytes());
    untenanted.extend_from_slice(b"llama-3-8b");
    vec![
        ("seed-every-kind", batch),
        ("seed-rejected-by-name", by_name),
        ("seed-book-without-tenant", untenanted),
        (
            "seed-done",
            Event::Done {
                key: Key { vm: 1, seq: 9 },
                timing: None,
            }
            .encode(),
        ),
    ]
}

fn routed() -> Vec<(&'static str, Vec<u8>)> {
    let rs = [
        Routed {
            model: "m".into(),
            slot: 3,
            kind: ChunkKind::Tokens,
            hashes: vec![1, u64::MAX],
        },
        Routed {
            model: "llama-3-8b".into(),
            slot: 0,
            kind: ChunkKind::Text,
            hashes: vec![],
        },
    ];
    let mut b = Vec::new();
    for r in &rs {
        r.encode_into(&mut b);
    }
    vec![("seed-two-records", b)]
}

fn requests() -> Vec<(&'static str, Vec<u8>)> {
    [
        (
            "seed-completions-text",
            r#"{"model":"m","prompt":"hello world!","stream":true,"max_tokens":5}"#,
        ),
        (
            "seed-completions-batch",
            r#"{"model":"m","prompt":["abcd","efgh"],"stream":null}"#,
        ),
        (
            "seed-completions-tokens",
            r#"{"model":"m","prompt":[1,2,3,4294967295],"max_tokens":null}"#,
        ),
        (
            "seed-completions-token-lists",
            r#"{"model":"m","prompt":[[1,2],[3,4,5]]}"#,
        ),
        (
            "seed-chat",
            r#"{"model":"llama-3-8b","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi \u00e9\ud83d\ude00"}]},{"role":"assistant","content":null}],"max_completion_tokens":7,"stream":false}"#,
        ),
    ]
    .into_iter()
    .map(|(n, b)| (n, b.as_bytes().to_vec()))
    .collect()
}

fn promtext() -> Vec<(&'static str, Vec<u8>)> {
    let vllm = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25
vllm:gpu_cache_usage_perc{engine=\"1\"} NaN
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"4096\",max_num_batched_tokens=\"8192\"} 1.0
vllm:prompt_tokens_total{engine=\"0\",path=\"a\\\\b\\\"c\\nd\"} +Inf 1700000000000
process_cpu_seconds_total 12.5
";
    let sglang = "\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank=\"4\"} 2
sglang:num_queue_reqs{dp_rank=\"5\"} 7
sglang:token_usage{dp_rank=\"4\"} 0.5
sglang:token_usage{dp_rank=\"5\"} -Inf
";
    vec![
        ("seed-vllm", vllm.as_bytes().to_vec()),
        ("seed-sglang", sglang.as_bytes().to_vec()),
    ]
}

fn dumps() -> Vec<(&'static str, Vec<u8>)> {
    let block = |engine, seq, tiers, unmatchable| Block {
        engine,
        seq,
        tiers,
        unmatchable,
    };
    let two_ranks = Dump {
        created_at_ms: 1_700_000_000_000,
        groups: vec![
            Group {
                model: "m".into(),
                worker_id: 1,
                dp_rank: 0,
                block_size: 16,
                blocks: vec![
                    block(10, 100, TIER_DEVICE, false),
                    block(11, 101, TIER_DEVICE | TIER_HOST, false),
                    block(12, 102, TIER_DEVICE, true),
                ],
            },
            Group {
                model: "m".into(),
                worker_id: 2,
                dp_rank: 1,
                block_size: 16,
                blocks: vec![block(u64::MAX, 7, TIER_DISK, false)],
            },
        ],
    };
    vec![
        ("seed-empty", dump::encode(Dump::default())),
        ("seed-two-ranks", dump::encode(two_ranks)),
    ]
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = kvgate_fuzz::run::corpus_root().join(target);
    std::fs::create_dir_all(&dir).expect("corpus folder");
    std::fs::write(dir.join(name), bytes).expect("corpus file");
}

fn main() {
    let fixtures =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../sidecar/tests/fixtures/kv_events");
    let mut batches = kv_batches();
    let mut fixture_files: Vec<_> = std::fs::read_dir(&fixtures)
        .expect("sidecar KV-event fixtures")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "msgpack"))
        .collect();
    fixture_files.sort();
    for (name, b) in &batches {
        write("kv_batch", name, b);
    }
    for p in fixture_files {
        let stem = p.file_stem().expect("name").to_string_lossy().into_owned();
        let bytes = std::fs::read(&p).expect("fixture");
        write("kv_batch", &format!("seed-fixture-{stem}"), &bytes);
    }
    write("kv_batch", "hostile-array32-hashes", &hostile_array32());

    // The reader on its own: the batches, and loose values of every kind.
    batches.truncate(2);
    for (name, b) in &batches {
        write("msgpack", name, b);
    }
    let mut loose = mp(V::M(vec![
        ("a", V::A(vec![V::U(1), V::Nil, V::F(2.5), V::I(-129)])),
        ("b", V::B(vec![1, 2, 3])),
        ("c", V::U(u64::MAX)),
    ]));
    loose.extend([0xd4, 0x05, 0x09, 0xc7, 0x02, 0x05, 0xaa, 0xbb, 0xc2, 0xc3]);
    loose.extend([0xca, 0x3f, 0x80, 0x00, 0x00, 0xd9, 0x02, b'h', b'i']);
    write("msgpack", "seed-every-kind", &loose);
    write("msgpack", "hostile-array32-hashes", &hostile_array32());

    // Replay replies: legacy and topic shapes, and both end markers.
    let payload = &kv_batches()[1].1;
    let seq = 7u64.to_be_bytes();
    let end = [0xffu8; 8];
    for (name, frames) in [
        ("seed-legacy", vec![&b""[..], &seq, payload]),
        ("seed-topic", vec![&b""[..], b"kv-events", &seq, payload]),
        ("seed-end-legacy", vec![&b""[..], &end, &b""[..]]),
        ("seed-end-topic", vec![&b""[..], b"", &end, &b""[..]]),
        ("seed-no-delimiter", vec![&seq[..], payload]),
    ] {
        write("kv_replay", name, &join_frames(&frames));
    }
    write(
        "kv_replay",
        "hostile-array32-hashes",
        &join_frames(&[b"", &seq, &hostile_array32()]),
    );

    let snaps = snapshots();
    for (name, s) in &snaps {
        write("snapshot", name, &s.encode().expect("snapshot encodes"));
    }
    let snap = snaps[1].1.encode().expect("snapshot encodes");
    let shard_seeds = shards();
    let update_full = update::encode(
        43,
        0x5eed,
        true,
        Some(&snap),
        [
            ("llama-3-8b", 3u32, &shard_seeds[0].1[..]),
            ("~approx~llama-3-8b", 4095, &shard_seeds[1].1[..]),
            ("llama-3-8b", 9, &b""[..]),
        ],
    );
    write("update", "seed-reset-full", &update_full);
    write(
        "update",
        "seed-unchanged",
        &update::encode(44, 0x5eed, false, None, []),
    );
    for (name, b) in &shard_seeds {
        write("shard", name, b);
    }
    for (name, b) in bookings() {
        write("booking", name, &b);
    }
    for (name, b) in routed() {
        write("routed", name, &b);
    }
    for (name, b) in requests() {
        write("request", name, &b);
    }
    for (name, b) in promtext() {
        write("promtext", name, &b);
    }
    for (name, b) in dumps() {
        write("dump", name, &b);
    }
    println!(
        "seeds written under {}",
        kvgate_fuzz::run::corpus_root().display()
    );
    let chat_template = kvgate_core::text::template::PromptTemplate {
        chat_template: "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}".into(),
        bos_token: "<s>".into(),
        eos_token: "</s>".into(),
        completion_prefix: "<s>".into(),
    };
    write("template", "seed-chat", &chat_template.encode());
}
