use super::*;

fn results() -> Results {
    match Results::load(&crate::repo().join(RESULTS_DIR)) {
        Ok(r) => r,
        Err(e) => panic!("the project's results do not load: {e:#}"),
    }
}

fn rendered() -> Vec<Block> {
    match render(&results()) {
        Ok(b) => b,
        Err(e) => panic!("the project's results do not render: {e:#}"),
    }
}

fn read(file: &str) -> String {
    std::fs::read_to_string(crate::repo().join(file)).unwrap()
}

#[test]
fn a_made_up_figure_in_any_block_is_caught_by_name() {
    for b in rendered() {
        let text = read(b.file);
        assert!(
            check_text(&b, &text).is_empty(),
            "{} is not current",
            b.file
        );
        let (_, end, first) = locate(&text, b.name).unwrap();
        // A sentence typed in at the end of the block.
        let seeded = format!(
            "{}It routes in 4321 µs at ×9.87 the plain route's rate.\n{}",
            &text[..end],
            &text[end..]
        );
        let found = check_text(&b, &seeded);
        let line = first + b.text.lines().count();
        for figure in ["`4321 µs`", "`9.87 ×`"] {
            assert!(
                found.iter().any(|f| f.line == line
                    && f.what.contains(figure)
                    && f.what.contains("in no results file")),
                "{}: {figure} not caught at line {line}: {found:#?}",
                b.file
            );
        }
        assert!(
            found
                .iter()
                .any(|f| f.line == line && f.what.contains("not what bench/results render")),
            "{}: {found:#?}",
            b.file
        );
    }
}

#[test]
fn a_figure_edited_in_place_is_caught() {
    let b = rendered()
        .into_iter()
        .find(|b| b.name == "headline")
        .unwrap();
    let text = read(b.file);
    let (from, to, first) = locate(&text, b.name).unwrap();
    // The first row's figure, one higher: the results hold some other
    // figure with that number perhaps, but not this block.
    let row = text[from..to]
        .lines()
        .position(|l| l.starts_with("| filter decision time"))
        .unwrap();
    let line = text[from..to].lines().nth(row).unwrap();
    let (_, number, _) = figures_in(line)[0].clone();
    let bumped = (number.parse::<u64>().unwrap() + 1000).to_string();
    let edited = line.replacen(&format!("| {number} /"), &format!("| {bumped} /"), 1);
    assert_ne!(edited, line);
    let seeded = text.replacen(line, &edited, 1);
    let found = check_text(&b, &seeded);
    assert!(
        found
            .iter()
            .any(|f| f.line == first + row && f.what.contains(&format!("`{bumped} µs`"))),
        "{found:#?}"
    );
}

#[test]
fn a_missing_block_is_named() {
    let b = rendered().into_iter().next().unwrap();
    let found = check_text(&b, "# no figures here\n");
    assert_eq!(found.len(), 1);
    assert!(found[0].what.contains("no block `figures:"), "{found:#?}");
}

#[test]
fn every_figure_the_templates_write_is_one_they_took() {
    for b in rendered() {
        for (line, number, unit) in figures_in(&b.text) {
            assert!(
                b.quoted.contains_key(&number),
                "{} block line {line}: `{number} {unit}` comes from no results file",
                b.name
            );
        }
        assert!(!b.quoted.is_empty(), "{} quotes nothing", b.name);
    }
}

#[test]
fn results_that_lack_a_figure_are_named() {
    let mut r = results();
    r.insert("overhead", json!({"name": "overhead"}));
    let e = render(&r).err().expect("an empty overhead result renders");
    let e = format!("{e:#}");
    assert!(e.contains("overhead.json: filter_decision_us/P50"), "{e}");
    assert!(e.contains("overhead.json: measured"), "{e}");
}

#[test]
fn figures_are_read_with_their_units() {
    let read = |s: &str| -> Vec<(String, &str)> {
        figures_in(s).into_iter().map(|(_, n, u)| (n, u)).collect()
    };
    let pairs = |v: &[(&str, &'static str)]| -> Vec<(String, &'static str)> {
        v.iter().map(|(n, u)| (n.to_string(), *u)).collect()
    };
    assert_eq!(read("10 / 118 µs"), pairs(&[("10", "µs"), ("118", "µs")]));
    assert_eq!(
        read("43 [4] / 98 µs; 90–99 %"),
        pairs(&[
            ("43", "µs"),
            ("4", "µs"),
            ("98", "µs"),
            ("90", "%"),
            ("99", "%")
        ])
    );
    assert_eq!(
        read("×0.70 the plain route's, 252× less, 1.79M blocks/s, 82.4 °C, 13 s"),
        pairs(&[
            ("0.70", "×"),
            ("252", "×"),
            ("1.79", "M"),
            ("82.4", "°C"),
            ("13", "s")
        ])
    );
    assert_eq!(
        read("6536 req/s, 8038 tok/s, 40.1 MiB, 25.7 MB, 66 bytes, 0.16 cores"),
        pairs(&[
            ("6536", "req/s"),
            ("8038", "tok/s"),
            ("40.1", "MiB"),
            ("25.7", "MB"),
            ("66", "bytes"),
            ("0.16", "cores")
        ])
    );
    // Numbers that are no figure: inside words and versions, dates,
    // counts, and a unit that is the start of a longer word.
    assert_eq!(
        read(
            "p50 P99 2P+2D `6f733e4` 2026-11-28, 1,000 requests, 5 seconds, 2 msgpack, 400 of 400"
        ),
        []
    );
    let lines: Vec<usize> = figures_in("a\n1 ms\n\n2 ms").iter().map(|f| f.0).collect();
    assert_eq!(lines, [2, 4]);
}

#[test]
fn a_block_is_replaced_between_its_markers_only() {
    let text = format!("before\n{}after\n", block("x", "old\n"));
    let new = splice(&text, "x", "new\n").unwrap();
    assert_eq!(new, format!("before\n{}after\n", block("x", "new\n")));
    assert_eq!(splice(&new, "x", "new\n").unwrap(), new);
    assert!(splice("before\nafter\n", "x", "new\n").is_none());
    // A marker quoted inside a line is not the block's.
    assert!(splice(&format!("say `{}`\n", closing("x")), "x", "").is_none());
}

#[test]
fn lookup_walks_keys_indices_and_named_elements() {
    let v = json!({"w": [{"name": "a", "r": [{"rate": 8.0, "x": 1}, {"rate": 16.0, "x": 2}]}]});
    assert_eq!(lookup(&v, "w/name=a/r/rate=16/x"), Some(&json!(2)));
    assert_eq!(lookup(&v, "w/0/r/1/x"), Some(&json!(2)));
    assert_eq!(lookup(&v, "w/name=b/r"), None);
    assert_eq!(fixed(-0.2, 0), "0");
    assert_eq!(fixed(-1.6, 0), "-2");
}
