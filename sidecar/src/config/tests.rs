use super::worker::offset_port;
use super::*;
use std::time::Duration;

const GOOD: &str = r#"
[server]
listen = "127.0.0.1:9999"

[[models]]
name = "m"
active_decode_blocks_threshold = 0.85

[[workers]]
worker_id = 1
model_name = "m"
endpoint = "http://127.0.0.1:8001/"
data_parallel_size = 2
kv_events_endpoints = { "0" = "tcp://127.0.0.1:5557" }
replay_endpoint = "tcp://127.0.0.1:5567"
"#;

#[test]
fn parses_with_defaults_and_normalises() {
    let c = Config::parse(GOOD).unwrap();
    assert_eq!(c.server.listen.port(), 9999);
    assert_eq!(c.scrape.down_after, Duration::from_millis(2000));
    let w = &c.workers[0];
    assert_eq!(w.endpoint, "127.0.0.1:8001");
    assert_eq!(w.metrics_url(), "http://127.0.0.1:8001/metrics");
    assert_eq!(w.tenant_id, "default");
    assert_eq!(w.block_size, 16);
    assert_eq!(
        w.events_endpoint(1).as_deref(),
        Some("tcp://127.0.0.1:5558")
    );
    assert_eq!(
        w.replay_endpoint_of(1).as_deref(),
        Some("tcp://127.0.0.1:5568")
    );
    assert_eq!(c.models[0].thresholds.active_decode_blocks, Some(0.85));
    assert_eq!(
        (
            c.kv.max_message_bytes,
            c.kv.queue_messages,
            c.kv.max_replay_bytes
        ),
        (8 << 20, 1000, 256 << 20)
    );
}

#[test]
fn kv_socket_bounds_are_checked() {
    let c = Config::parse("[kv]\nmax_message_bytes = 65536\nqueue_messages = 10").unwrap();
    assert_eq!((c.kv.max_message_bytes, c.kv.queue_messages), (65536, 10));
    assert!(err("[kv]\nmax_message_bytes = 0").contains("kv.max_message_bytes"));
    assert!(err("[kv]\nqueue_messages = 0").contains("kv.queue_messages"));
    assert!(err("[kv]\nqueue_messages = 2147483648").contains("kv.queue_messages"));
    let c = Config::parse("[kv]\nmax_message_bytes = 65536\nmax_replay_bytes = 65536").unwrap();
    assert_eq!(c.kv.max_replay_bytes, 65536);
    assert!(
        err("[kv]\nmax_replay_bytes = 65535\nmax_message_bytes = 65536")
            .contains("kv.max_replay_bytes")
    );
    assert!(err("[kv]\nmax_replay_bytes = 0").contains("kv.max_replay_bytes"));
}

#[test]
fn overlapping_derived_dp_ports_are_rejected() {
    let worker = |events: &str, replay: &str, dp: u32| {
        format!(
            "[[models]]\nname = \"m\"\n[[workers]]\nworker_id = 7\nmodel_name = \"m\"\n\
                 endpoint = \"127.0.0.1:8001\"\ndata_parallel_size = {dp}\n\
                 kv_events_endpoints = {{ \"0\" = \"{events}\" }}\nreplay_endpoint = \"{replay}\"\n"
        )
    };
    // The README's old layout: rank 1 publishes on 5558, rank 0 replays there.
    let e = err(&worker("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", 2));
    assert!(e.contains("worker 7"), "{e}");
    assert!(e.contains("5557-5558") && e.contains("5558-5559"), "{e}");
    assert!(e.contains("tcp://10.0.0.5:5559"), "{e}");
    assert!(err(&worker("tcp://h:5557", "tcp://h:5557", 1)).contains("overlap"));
    // Working layouts: replay base at events base + DP size, another
    // host, or one rank with adjacent ports.
    for (ev, rp, dp) in [
        ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5559", 2),
        ("tcp://10.0.0.5:5557", "tcp://10.0.0.6:5558", 2),
        ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", 1),
        ("tcp://10.0.0.5:5560", "tcp://10.0.0.5:5557", 2),
    ] {
        Config::parse(&worker(ev, rp, dp)).unwrap_or_else(|e| panic!("{ev} {rp} {dp}: {e}"));
    }
}

#[test]
fn kv_events_topic_defaults_to_every_topic() {
    let c = Config::parse(GOOD).unwrap();
    assert_eq!(c.workers[0].kv_events_topic, "");
    let c = Config::parse(&format!("{GOOD}kv_events_topic = \"kv-events\"\n")).unwrap();
    assert_eq!(c.workers[0].kv_events_topic, "kv-events");
}

fn err(text: &str) -> String {
    Config::parse(text).unwrap_err().to_string()
}

#[test]
fn lora_adapters_are_unique_and_not_models() {
    let c = Config::parse(
        "[[models]]\nname = \"m\"\nlora_adapters = [\"a\", \"b\"]\n[[models]]\nname = \"n\"",
    )
    .unwrap();
    assert_eq!(c.models[0].lora_adapters, ["a", "b"]);
    assert!(c.models[1].lora_adapters.is_empty());
    for bad in [
        "[[models]]\nname = \"m\"\nlora_adapters = [\"a\", \"a\"]",
        "[[models]]\nname = \"m\"\nlora_adapters = [\"\"]",
        "[[models]]\nname = \"m\"\nlora_adapters = [\"n\"]\n[[models]]\nname = \"n\"",
        "[[models]]\nname = \"m\"\nlora_adapters = [\"a\"]\n[[models]]\nname = \"n\"\nlora_adapters = [\"a\"]",
    ] {
        assert!(err(bad).contains("lora adapter"), "{bad}");
    }
}

#[test]
fn each_mistake_is_named() {
    assert!(err("[server]\nlisten = 5").contains("listen"));
    assert!(err("bogus = 1").contains("bogus"));
    let worker = |extra: &str| {
        format!(
            "[[models]]\nname = \"m\"\n[[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:1\"\n{extra}"
        )
    };
    assert!(err(&worker("block_size = 0")).contains("block_size"));
    assert!(err(&worker("data_parallel_size = 0")).contains("data_parallel_size"));
    assert!(err(&worker("kv_events_endpoints = { \"3\" = \"tcp://x:1\" }")).contains("rank 3"));
    assert!(
        err(&format!(
            "{}\n[[workers]]\nworker_id = 1\nmodel_name = \"m\"\nendpoint = \"127.0.0.1:2\"",
            worker("")
        ))
        .contains("listed twice")
    );
    assert!(
        err("[[workers]]\nworker_id = 1\nmodel_name = \"x\"\nendpoint = \"127.0.0.1:1\"")
            .contains("not in [[models]]")
    );
    assert!(err(&worker("").replace("127.0.0.1:1", "worker-a:8000")).contains("ip:port"));
    assert!(
        err("[[models]]\nname = \"m\"\nactive_decode_blocks_threshold = 1.5").contains("[0, 1]")
    );
    assert!(
        err("[[models]]\nname = \"m\"\nactive_prefill_tokens_threshold_frac = 0")
            .contains("above 0")
    );
    assert!(err("[[models]]\nname = \"m\"\n[[models]]\nname = \"m\"").contains("twice"));
    assert!(
        err("[[models]]\nname = \"m\"\nactive_decode_block_threshold = 0.5")
            .contains("active_decode_block_threshold"),
        "a misspelt threshold is an error, not a disabled condition"
    );
    assert!(
        err("[[models]]\nname = \"m\"\n[models.policy]\nhost_weight = -1").contains("host_weight")
    );
    assert!(
        err("[[models]]\nname = \"m\"\n[models.policy]\nhost_wieght = 1").contains("host_wieght")
    );
}

#[test]
fn models_carry_their_policy() {
    let c = Config::parse(
            "[[models]]\nname = \"m\"\nactive_decode_blocks_threshold = 0.7\n[models.policy]\noverlap_credit = 2.0\ntemperature = 0.1",
        )
        .unwrap();
    let m = &c.models[0];
    assert_eq!(m.thresholds.active_decode_blocks, Some(0.7));
    assert_eq!(m.policy.overlap_credit, 2.0);
    assert_eq!(m.policy.temperature, 0.1);
    assert_eq!(
        m.policy.host_weight,
        kvgate_core::Policy::default().host_weight
    );
}

#[test]
fn durations_are_read_in_milliseconds_under_their_ms_keys() {
    let c = Config::parse(
        "[server]\npublish_interval_ms = 20\n[scrape]\ninterval_ms = 50\ntimeout_ms = 40\n\
         down_after_ms = 300\n[kv]\npublish_interval_ms = 2\nreplay_timeout_ms = 7\n\
         approx_ttl_ms = 1000\ninflight_ttl_ms = 9\n[load]\nbooking_ttl_ms = 60000",
    )
    .unwrap();
    let ms = Duration::from_millis;
    assert_eq!(c.server.publish_interval, ms(20));
    assert_eq!(
        (c.scrape.interval, c.scrape.timeout, c.scrape.down_after),
        (ms(50), ms(40), ms(300))
    );
    assert_eq!(
        (
            c.kv.publish_interval,
            c.kv.replay_timeout,
            c.kv.approx_ttl,
            c.kv.inflight_ttl
        ),
        (ms(2), ms(7), ms(1000), ms(9))
    );
    assert_eq!(c.load.booking_ttl, ms(60_000));
    let d = Config::parse("").unwrap();
    assert_eq!(
        (
            d.server.publish_interval,
            d.kv.approx_ttl,
            d.load.booking_ttl
        ),
        (ms(50), ms(120_000), ms(300_000))
    );
    assert!(err("[scrape]\ninterval_ms = 0").contains("scrape.interval_ms"));
    assert!(err("[load]\nbooking_ttl_ms = 0").contains("load.booking_ttl_ms"));
    assert!(err("[scrape]\ntimeout_ms = -1").contains("timeout_ms"));
    assert!(err("[scrape]\ntimeout_ms = \"1s\"").contains("timeout_ms"));
    assert!(err("[scrape]\ntimeout = 1").contains("timeout"));
}

#[test]
fn listener_limits_have_safe_defaults_and_are_checked() {
    let ms = Duration::from_millis;
    let d = Config::parse("").unwrap();
    for l in [d.server.limits(), d.selection.limits()] {
        assert_eq!(l.header_read_timeout, ms(10_000));
        assert_eq!(l.idle_timeout, ms(60_000));
        assert_eq!(l.max_connections, 1024);
        assert_eq!(l.reserved_connections, 64);
        assert_eq!(l.body_budget_bytes, 64 << 20);
        assert_eq!(l.body_timeout, ms(10_000));
        assert!(l.idle_timeout > LONGEST_LONG_POLL);
    }
    let c = Config::parse(
        "[server]\nheader_read_timeout_ms = 2000\nidle_timeout_ms = 45000\nmax_connections = 64\n\
         reserved_connections = 8\nbody_budget_bytes = 65536\nbody_timeout_ms = 500\n\
         [selection]\nlisten = \"127.0.0.1:9192\"\nmax_connections = 16",
    )
    .unwrap();
    assert_eq!(
        c.server.limits(),
        ListenerLimits {
            header_read_timeout: ms(2000),
            idle_timeout: ms(45_000),
            max_connections: 64,
            reserved_connections: 8,
            body_budget_bytes: 65536,
            body_timeout: ms(500),
        }
    );
    assert_eq!(c.selection.limits().max_connections, 16);
    assert!(err("[server]\nheader_read_timeout_ms = 0").contains("server.header_read_timeout_ms"));
    // An idle timeout under the longest long poll would cut Envoy's polls.
    assert!(err("[server]\nidle_timeout_ms = 30000").contains("server.idle_timeout_ms"));
    assert!(err("[selection]\nidle_timeout_ms = 1000").contains("selection.idle_timeout_ms"));
    assert!(err("[selection]\nmax_connections = 0").contains("selection.max_connections"));
    assert!(err("[server]\nmax_connections = -1").contains("max_connections"));
    assert!(err("[server]\nbody_budget_bytes = 0").contains("server.body_budget_bytes"));
    assert!(err("[selection]\nbody_timeout_ms = 0").contains("selection.body_timeout_ms"));
}

#[test]
fn whole_index_reads_are_capped_and_reused_by_default() {
    let d = Config::parse("").unwrap();
    assert_eq!(d.server.max_full_reads, 4);
    assert_eq!(d.server.max_full_read_copies, 1);
    assert_eq!(d.server.full_read_reuse, Duration::from_millis(1000));
    let c = Config::parse("[server]\nmax_full_reads = 1\nfull_read_reuse_ms = 0").unwrap();
    assert_eq!(
        (c.server.max_full_reads, c.server.full_read_reuse),
        (1, Duration::ZERO)
    );
    assert!(err("[server]\nmax_full_reads = 0").contains("server.max_full_reads"));
    assert!(err("[server]\nmax_full_reads = 1025").contains("server.max_full_reads"));
    assert!(err("[server]\nfull_read_reuse_ms = 60001").contains("server.full_read_reuse_ms"));
    assert!(err("[server]\nmax_full_read_copies = 0").contains("server.max_full_read_copies"));
}

#[test]
fn the_selection_listener_is_off_unless_given() {
    assert_eq!(Config::parse("").unwrap().selection.listen, None);
    let c = Config::parse("[selection]\nlisten = \"127.0.0.1:9192\"").unwrap();
    assert_eq!(c.selection.listen, Some("127.0.0.1:9192".parse().unwrap()));
    assert!(Config::parse("[selection]\nlisten = \"nowhere\"").is_err());
    assert!(Config::parse("[selection]\nport = 1").is_err());
}

#[test]
fn indexer_peers_are_http_urls_and_the_flag_replaces_them() {
    let c = Config::parse("").unwrap();
    assert!(c.indexer.peers.is_empty());
    assert_eq!(
        (c.indexer.timeout, c.indexer.max_dump_bytes),
        (Duration::from_millis(10_000), 1 << 30)
    );
    let mut c = Config::parse(
        "[indexer]\npeers = [\"http://10.0.0.2:9190\", \"http://sidecar-b:9190/\"]\n\
         timeout_ms = 500\nmax_dump_bytes = 4096",
    )
    .unwrap();
    assert_eq!(c.indexer.peers.len(), 2);
    assert_eq!(c.indexer.timeout, Duration::from_millis(500));
    c.set_indexer_peers(vec![" http://a:1".into(), "".into(), "http://b:2".into()])
        .unwrap();
    assert_eq!(c.indexer.peers, ["http://a:1", "http://b:2"]);
    for bad in [
        "https://a:1",
        "a:1",
        "http://a:1/v1",
        "http://a:1/?x=1",
        "http://",
    ] {
        let e = c
            .set_indexer_peers(vec![bad.into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("indexer.peers"), "{bad}: {e}");
        let e = err(&format!("[indexer]\npeers = [\"{bad}\"]"));
        assert!(e.contains("indexer.peers"), "{bad}: {e}");
    }
    assert!(err("[indexer]\ntimeout_ms = 0").contains("indexer.timeout_ms"));
    assert!(err("[indexer]\nmax_dump_bytes = 0").contains("indexer.max_dump_bytes"));
    assert!(err("[indexer]\npeer = []").contains("unknown field"));
}

#[test]
fn rank_endpoints_follow_the_engines_port_offsets() {
    assert_eq!(
        offset_port("tcp://10.0.0.1:5557", 0).as_deref(),
        Some("tcp://10.0.0.1:5557")
    );
    assert_eq!(
        offset_port("tcp://10.0.0.1:5557", 3).as_deref(),
        Some("tcp://10.0.0.1:5560")
    );
    assert_eq!(
        offset_port("tcp://*:5557", 1).as_deref(),
        Some("tcp://*:5558")
    );
    assert_eq!(
        offset_port("inproc://kv", 2).as_deref(),
        Some("inproc://kv_dp2")
    );
    assert_eq!(offset_port("ipc:///tmp/kv", 1), None);
}

const SPLIT: &str = r#"
[[models]]
name = "pd"
[models.policy]
overlap_credit = 2.0
[models.disaggregation]
protocol = "sglang"
max_uncached_tokens = 512
on_prefill_failure = "fail"
prefill_timeout_ms = 1500

[[workers]]
worker_id = 1
model_name = "pd"
endpoint = "127.0.0.1:8001"
role = "prefill"
bootstrap_port = 9100
[[workers]]
worker_id = 2
model_name = "pd"
endpoint = "127.0.0.1:8002"
"#;

#[test]
fn disaggregation_and_roles_parse_with_defaults() {
    use kvgate_core::{OnPrefillFailure, Protocol, Role};
    let c = Config::parse(SPLIT).unwrap();
    assert_eq!(c.workers[0].role, Role::Prefill);
    assert_eq!(c.workers[1].role, Role::Both, "the default");
    assert_eq!(c.workers[0].bootstrap_port, Some(9100));
    assert_eq!(c.workers[1].bootstrap_port, None, "SGLang's default");
    let m = &c.models[0];
    let d = m.disaggregation.as_ref().unwrap();
    assert_eq!(d.prefill_timeout, Duration::from_millis(1500));
    let r = d.resolve(&m.policy);
    assert_eq!(r.protocol, Protocol::Sglang);
    assert_eq!(r.on_prefill_failure, OnPrefillFailure::Fail);
    assert_eq!(r.prefill_timeout_ms, 1500);
    assert_eq!(
        (
            r.conditional.max_uncached_tokens,
            r.conditional.max_uncached_ratio
        ),
        (512, 0.7)
    );
    assert_eq!(r.decode_affinity, 2.0, "the model's overlap credit");
    let c = Config::parse(&SPLIT.replace("prefill_timeout_ms = 1500", "decode_affinity = 0.0"))
        .unwrap();
    let d = c.models[0].disaggregation.as_ref().unwrap();
    assert_eq!(d.resolve(&c.models[0].policy).decode_affinity, 0.0);
    assert_eq!(d.prefill_timeout, Duration::from_secs(30));
    let bare = Config::parse(
        "[[models]]\nname = \"m\"\n[models.disaggregation]\nprotocol = \"vllm-nixl\"",
    )
    .unwrap();
    let r = bare.models[0]
        .disaggregation
        .as_ref()
        .unwrap()
        .resolve(&Default::default());
    assert_eq!(r, kvgate_core::Disaggregation::default());
    assert!(
        Config::parse("[[models]]\nname = \"m\"").unwrap().models[0]
            .disaggregation
            .is_none()
    );
}

#[test]
fn bad_disaggregation_settings_say_what_is_wrong() {
    let with = |from: &str, to: &str| {
        assert!(SPLIT.contains(from), "{from}");
        err(&SPLIT.replace(from, to))
    };
    let e = with("protocol = \"sglang\"", "protocol = \"nixl\"");
    assert!(e.contains("unknown variant `nixl`"), "{e}");
    assert!(e.contains("vllm-nixl"), "names the choices: {e}");
    let e = with("protocol = \"sglang\"\n", "");
    assert!(e.contains("missing field `protocol`"), "{e}");
    let e = with("max_uncached_tokens = 512", "max_uncached_ratio = 1.5");
    assert!(
        e.contains(
            "model \"pd\": disaggregation: max_uncached_ratio must be within [0, 1], got 1.5"
        ),
        "{e}"
    );
    let e = with("prefill_timeout_ms = 1500", "prefill_timeout_ms = 0");
    assert!(e.contains("prefill_timeout_ms must be above 0"), "{e}");
    let e = with("prefill_timeout_ms = 1500", "decode_affinity = -1.0");
    assert!(
        e.contains("decode_affinity must be finite and not negative"),
        "{e}"
    );
    let e = with(
        "on_prefill_failure = \"fail\"",
        "on_prefill_failure = \"retry\"",
    );
    assert!(e.contains("unknown variant `retry`"), "{e}");
    let e = with("prefill_timeout_ms = 1500", "prefill_timeout = \"1s\"");
    assert!(e.contains("unknown field `prefill_timeout`"), "{e}");
    let e = with("role = \"prefill\"", "role = \"encode\"");
    assert!(e.contains("unknown variant `encode`"), "{e}");
}

/// A model of `both` workers that pulls, each key of its pull table given.
const PULLS: &str = r#"
[[models]]
name = "m"
active_decode_blocks_threshold = 0.05
[models.disaggregation]
protocol = "vllm-nixl"
[models.disaggregation.pull]
min_blocks = 8
kv_bytes_per_token = 65536
prefill_tokens_per_s = 20000.0
[models.disaggregation.pull.link]
same_node_gbps = 800.0
same_rack_gbps = 400.0
elsewhere_gbps = 50.0

[[workers]]
worker_id = 1
model_name = "m"
endpoint = "127.0.0.1:8001"
topology = { node = "gpu-node-1", rack = "rack-a" }
[[workers]]
worker_id = 2
model_name = "m"
endpoint = "127.0.0.1:8002"
"#;

fn pull_of(c: &Config) -> Option<kvgate_core::disagg::pull::Pull> {
    let m = &c.models[0];
    m.disaggregation
        .as_ref()
        .and_then(|d| d.resolve(&m.policy).pull)
}

#[test]
fn the_pull_table_parses_and_its_keys_default() {
    use kvgate_core::disagg::pull::{Links, Pull};
    let c = Config::parse(PULLS).unwrap();
    assert_eq!(
        pull_of(&c),
        Some(Pull {
            min_blocks: 8,
            kv_bytes_per_token: 65536,
            prefill_tokens_per_s: 20000.0,
            link: Links {
                same_node_gbps: 800.0,
                same_rack_gbps: 400.0,
                elsewhere_gbps: 50.0,
            },
        })
    );
    // The table's presence turns pulls on; each key left out is its
    // default, the link's too.
    let bare = "[[models]]\nname = \"m\"\n[models.disaggregation]\nprotocol = \"vllm-nixl\"\n";
    let c = Config::parse(&format!("{bare}[models.disaggregation.pull]\n")).unwrap();
    assert_eq!(pull_of(&c), Some(Pull::default()));
    let c = Config::parse(&format!(
        "{bare}[models.disaggregation.pull]\nmin_blocks = 2\n[models.disaggregation.pull.link]\nelsewhere_gbps = 25.0\n"
    ))
    .unwrap();
    assert_eq!(
        pull_of(&c),
        Some(Pull {
            min_blocks: 2,
            link: Links {
                elsewhere_gbps: 25.0,
                ..Links::default()
            },
            ..Pull::default()
        })
    );
    assert_eq!(
        pull_of(&Config::parse(bare).unwrap()),
        None,
        "off without the table"
    );
}

#[test]
fn bad_pull_settings_say_what_is_wrong() {
    let with = |from: &str, to: &str| {
        assert!(PULLS.contains(from), "{from}");
        err(&PULLS.replace(from, to))
    };
    // SGLang's decode worker pulls nothing named in its body.
    let e = with("protocol = \"vllm-nixl\"", "protocol = \"sglang\"");
    assert!(
        e.contains("model \"m\"") && e.contains("disaggregation.pull needs protocol \"vllm-nixl\""),
        "{e}"
    );
    let e = with(
        "prefill_tokens_per_s = 20000.0",
        "prefill_tokens_per_s = 0.0",
    );
    assert!(
        e.contains("pull.prefill_tokens_per_s must be finite and above 0"),
        "{e}"
    );
    let e = with("kv_bytes_per_token = 65536", "kv_bytes_per_token = 0");
    assert!(e.contains("pull.kv_bytes_per_token"), "{e}");
    let e = with("elsewhere_gbps = 50.0", "elsewhere_gbps = nan");
    assert!(e.contains("pull.link.elsewhere_gbps"), "{e}");
    let e = with("min_blocks = 8", "min_block = 8");
    assert!(e.contains("unknown field `min_block`"), "{e}");
    let e = with("same_rack_gbps = 400.0", "same_switch_gbps = 400.0");
    assert!(e.contains("unknown field `same_switch_gbps`"), "{e}");
}

#[test]
fn a_workers_topology_parses_and_bad_names_are_refused() {
    use kvgate_core::Topology;
    let c = Config::parse(PULLS).unwrap();
    assert_eq!(
        c.workers[0].topology,
        Topology {
            node: "gpu-node-1".into(),
            rack: "rack-a".into(),
        }
    );
    assert_eq!(
        c.workers[1].topology,
        Topology::default(),
        "unknown: elsewhere"
    );
    let c = Config::parse(&PULLS.replace(", rack = \"rack-a\"", "")).unwrap();
    assert_eq!(
        c.workers[0].topology.rack, "",
        "either part may be left out"
    );
    let named = |node: &str| PULLS.replace("\"gpu-node-1\"", node);
    // The longest Kubernetes node name is taken; one byte more is not.
    let longest = "n".repeat(253);
    let c = Config::parse(&named(&format!("{longest:?}"))).unwrap();
    assert_eq!(c.workers[0].topology.node, longest);
    for bad in [
        format!("\"{}\"", "n".repeat(254)),
        r#""gpu-node-1\n""#.to_string(),
        r#""gpu\u0000node""#.to_string(),
    ] {
        let e = err(&named(&bad));
        assert!(
            e.contains(
                "worker 1: topology.node must be at most 253 bytes without control characters"
            ),
            "{bad}: {e}"
        );
    }
    let e = err(&PULLS.replace("\"rack-a\"", r#""rack\ta""#));
    assert!(e.contains("topology.rack"), "{e}");
    let e = err(&PULLS.replace("rack = ", "zone = "));
    assert!(e.contains("unknown field `zone`"), "{e}");
}

#[test]
fn max_prompt_tokens_defaults_and_is_bounded() {
    let c = Config::parse(
        "[[models]]\nname = \"m\"\n[[models]]\nname = \"n\"\nmax_prompt_tokens = 4096",
    )
    .unwrap();
    assert_eq!(c.models[0].max_prompt_tokens, DEFAULT_MAX_PROMPT_TOKENS);
    assert_eq!(c.models[1].max_prompt_tokens, 4096);
    for bad in ["0", &(MAX_PROMPT_TOKENS_CEILING + 1).to_string()] {
        assert!(
            err(&format!(
                "[[models]]\nname = \"m\"\nmax_prompt_tokens = {bad}"
            ))
            .contains("max_prompt_tokens"),
            "{bad}"
        );
    }
}

#[test]
fn replica_sync_messages_have_a_bounded_age() {
    let d = Config::parse("").unwrap();
    assert_eq!(
        d.replica_sync.max_message_age,
        Duration::from_millis(30_000)
    );
    let c = Config::parse("[replica_sync]\nmax_message_age_ms = 5000").unwrap();
    assert_eq!(c.replica_sync.max_message_age, Duration::from_millis(5000));
    for bad in ["999", "3600001"] {
        let e = err(&format!("[replica_sync]\nmax_message_age_ms = {bad}"));
        assert!(e.contains("replica_sync.max_message_age_ms"), "{e}");
    }
}

#[test]
fn the_ledgers_caps_default_and_are_bounded() {
    let d = Config::parse("").unwrap().load.caps;
    assert_eq!(d, LedgerCaps::default());
    // Each kind's flood leaves the others their room within the total.
    assert!(d.gateway_holders + d.peer_holders + d.holders_per_origin <= d.holders);
    let c = Config::parse("[load.caps]\nholders = 100\nholders_per_origin = 5\ngateway_vms = 2")
        .unwrap()
        .load
        .caps;
    assert_eq!(
        (
            c.holders,
            c.holders_per_origin,
            c.gateway_vms,
            c.peer_holders
        ),
        (100, 5, 2, d.peer_holders)
    );
    for bad in [
        "holders = 0",
        "peer_holders = 0",
        "gateway_vms = 0",
        "holders_per_origin = 1073741825",
    ] {
        let key = bad.split(' ').next().unwrap();
        assert!(
            err(&format!("[load.caps]\n{bad}")).contains(&format!("load.caps.{key}")),
            "{bad}"
        );
    }
    assert!(err("[load.caps]\nholder = 1").contains("holder"));
}

#[test]
fn a_models_slo_is_its_own_else_its_planners() {
    use kvgate_core::Slo;
    let c = Config::parse(
        "[[models]]\nname = \"m\"\n[models.slo]\nttft_ms = 300\nitl_ms = 25\n\
         [[models]]\nname = \"p\"\n[models.planner]\nttft_ms = 199.2\nitl_ms = 20\n\
         [[models]]\nname = \"n\"",
    )
    .unwrap();
    let slo = |i: usize| c.models[i].slo();
    assert_eq!(
        slo(0),
        Some(Slo {
            ttft_ms: 300,
            itl_ms: 25
        })
    );
    assert_eq!(
        slo(1),
        Some(Slo {
            ttft_ms: 200,
            itl_ms: 20
        }),
        "the planner's SLA, never stricter"
    );
    assert_eq!(slo(2), None);
    for bad in [
        "ttft_ms = 0\nitl_ms = 20",
        "ttft_ms = 200",
        "ttft_ms = 200\nitl_ms = 20\nbogus = 1",
        "ttft_ms = -1\nitl_ms = 20",
    ] {
        let e = err(&format!("[[models]]\nname = \"m\"\n[models.slo]\n{bad}"));
        assert!(
            e.contains("slo") || e.contains("bogus") || e.contains("ttft_ms"),
            "{bad}: {e}"
        );
    }
}
