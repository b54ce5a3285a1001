use super::*;

#[test]
fn all_metrics_register_with_help() {
    let m = Metrics::new().unwrap();
    m.snapshot.scrape(1).scrapes.inc();
    m.snapshot.polls.with_label_values(&["changed"]).inc();
    let text = m.render();
    assert!(text.contains("# HELP kvgate_sidecar_scrapes_total"));
    assert!(text.contains("kvgate_sidecar_snapshot_polls_total{result=\"changed\"} 1"));
    assert_eq!(
        m.sample("kvgate_sidecar_scrapes_total", &[("worker_id", "1")]),
        Some(1.0)
    );
}

#[test]
fn a_bad_metric_is_an_error_naming_it() {
    let r = Registry::new();
    counter(&r, "kvgate_x_total", "x", &["a"]).unwrap();
    let dup = counter(&r, "kvgate_x_total", "x", &["a"]).unwrap_err();
    assert!(dup.to_string().contains("kvgate_x_total"), "{dup}");
    assert!(gauge(&r, "not a name", "x").is_err());
}

#[test]
fn every_subscriber_counter_is_its_own_series_per_rank() {
    let m = Metrics::new().unwrap();
    let (a, b) = (m.kv.subscribers.of(7, 0), m.kv.subscribers.of(7, 1));
    let mut names: Vec<&str> = a.each().iter().map(|(n, _)| *n).collect();
    for (i, (_, c)) in a.each().into_iter().enumerate() {
        c.inc_by(i as u64 + 1);
    }
    b.each()[0].1.inc();
    for (i, (name, _)) in a.each().into_iter().enumerate() {
        let rank0 = [("worker_id", "7"), ("dp_rank", "0")];
        assert_eq!(m.sample(name, &rank0), Some(i as f64 + 1.0), "{name}");
        assert!(m.render().contains(&format!("# HELP {name} ")), "{name}");
    }
    let first = names[0];
    assert_eq!(
        m.sample(first, &[("worker_id", "7"), ("dp_rank", "1")]),
        Some(1.0)
    );
    names.sort();
    names.dedup();
    assert_eq!(names.len(), a.each().len(), "one series name per counter");
}

#[test]
fn a_mirrored_total_only_moves_forward() {
    let m = Metrics::new().unwrap();
    let c = &m.kv.text_skipped_blocks;
    mirror_total(c, &["m", "orphan"], 5);
    mirror_total(c, &["m", "orphan"], 3);
    mirror_total(c, &["m", "orphan"], 8);
    let l = [("model", "m"), ("reason", "orphan")];
    assert_eq!(
        m.sample("kvgate_sidecar_text_skipped_blocks_total", &l),
        Some(8.0)
    );
}
