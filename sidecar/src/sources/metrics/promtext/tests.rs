use super::*;

#[test]
fn parses_samples_labels_escapes_and_specials() {
    let p = parse(
        "# HELP x help\n# TYPE x gauge\nx 1\ny{a=\"1\",b=\"q\\\"uote\\\\n\"} 2.5 1700000000\nz{} NaN\nw +Inf\nv -Inf\n",
    );
    assert_eq!(p.malformed_lines, 0);
    assert_eq!(p.samples.len(), 5);
    assert_eq!(
        p.samples[1].labels,
        vec![("a".into(), "1".into()), ("b".into(), "q\"uote\\n".into())]
    );
    assert_eq!(p.samples[1].value, 2.5);
    assert!(p.samples[2].value.is_nan());
    assert_eq!(p.samples[3].value, f64::INFINITY);
    assert_eq!(p.samples[4].value, f64::NEG_INFINITY);
}

#[test]
fn garbage_lines_are_counted_not_fatal() {
    let p = parse("ok 1\nno value\nbad{a=\"1\" 2\n{x} 3\nnum 1 2 3\nfine 2\n");
    assert_eq!(p.samples.len(), 2);
    assert_eq!(p.malformed_lines, 4);
}

const VLLM_DP2: &str = r#"
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
"#;

#[test]
fn vllm_ranks_by_engine_label() {
    let r = extract(&parse(VLLM_DP2), 2, 0, 16);
    assert_eq!(
        (
            r[0].running,
            r[0].waiting,
            r[0].kv_used_blocks(),
            r[0].kv_total_blocks
        ),
        (3, 2, 500, 1000)
    );
    assert_eq!((r[1].running, r[1].kv_used_blocks()), (1, 250));
}

#[test]
fn deprecated_name_and_global_rank_numbers() {
    let text = "vllm:gpu_cache_usage_perc{engine=\"4\"} 0.75\nvllm:cache_config_info{engine=\"4\",num_gpu_blocks=\"100\"} 1\nvllm:num_requests_running{engine=\"5\"} 2\n";
    let r = extract(&parse(text), 2, 4, 16);
    assert_eq!(r[0].kv_used_blocks(), 75);
    assert_eq!(r[1].running, 2);
    // Current name wins over the deprecated one.
    let r = extract(
        &parse("vllm:kv_cache_usage_perc 0.1\nvllm:gpu_cache_usage_perc 0.9\n"),
        1,
        0,
        16,
    );
    assert_eq!(r[0].kv_usage, 0.1);
}

#[test]
fn only_pages_with_an_engine_load_signal_are_engine_pages() {
    let node_exporter = "# HELP process_cpu_seconds_total CPU time.\n\
            # TYPE process_cpu_seconds_total counter\n\
            process_cpu_seconds_total 1\n\
            node_load1 0.5\n\
            vllm_num_requests_running 3\n";
    assert!(!is_engine_page(&parse(node_exporter)));
    // Config alone carries no load.
    assert!(!is_engine_page(&parse(
        "vllm:cache_config_info{num_gpu_blocks=\"10\"} 1\n"
    )));
    assert!(is_engine_page(&parse(VLLM_DP2)));
    assert!(is_engine_page(&parse("sglang:num_queue_reqs 0\n")));
    // Every listed name is one `extract` reads: each alone moves a field.
    for name in LOAD_METRICS {
        let r = extract(&parse(&format!("{name} 0.5\n")), 1, 0, 16);
        assert_ne!(r[0], RankMetrics::default(), "{name} is not read");
    }
}

#[test]
fn sglang_names() {
    let r = extract(
        &parse("sglang:num_running_reqs 4\nsglang:num_queue_reqs 7\nsglang:token_usage 0.3\n"),
        1,
        0,
        16,
    );
    assert_eq!((r[0].running, r[0].waiting, r[0].kv_usage), (4, 7, 0.3));
}

/// SGLang 0.5.x as a scheduler exports it with DP attention: capacity
/// in tokens, ranks by `dp_rank`, beside `tp_rank` and friends.
const SGLANG_DP2: &str = r#"
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.95
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 0.1
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 16000.0
sglang:max_total_num_tokens{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 16000.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 2.0
"#;

#[test]
fn sglang_capacity_in_configured_blocks() {
    let r = extract(&parse(SGLANG_DP2), 2, 0, 16);
    // 16000 tokens at kvgate's 16 per block, 95 % used: the decode
    // threshold has something to compare with.
    assert_eq!((r[0].kv_total_blocks, r[0].kv_used_blocks()), (1000, 950));
    assert_eq!(
        (r[1].kv_total_blocks, r[1].kv_used_blocks(), r[1].running),
        (1000, 100, 2)
    );
    // Pages (newer SGLang) win over the token gauge, as gauges or as
    // `cache_config_info` labels, and name the engine's page size.
    for pages in [
        "sglang:num_pages 100\nsglang:page_size 64\n",
        "sglang:cache_config_info{num_pages=\"100\",page_size=\"64\"} 1\n",
    ] {
        let text = format!("sglang:token_usage 0.5\nsglang:max_total_num_tokens 7\n{pages}");
        let r = extract(&parse(&text), 1, 0, 16);
        assert_eq!(
            (r[0].kv_total_blocks, r[0].kv_used_blocks()),
            (400, 200),
            "{pages}"
        );
        assert_eq!(r[0].block_size, 64);
    }
    // A global `dp_rank` is taken relative to the worker's start rank.
    let r = extract(
        &parse("sglang:max_total_num_tokens{dp_rank=\"5\"} 320\n"),
        2,
        4,
        16,
    );
    assert_eq!((r[0].kv_total_blocks, r[1].kv_total_blocks), (0, 20));
}
