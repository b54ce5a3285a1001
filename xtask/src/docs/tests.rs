use super::*;

fn bin_dir() -> PathBuf {
    match kvgate_stack::Paths::discover() {
        Ok(p) => p.bin_dir,
        Err(e) => panic!("no binary folder: {e:#}"),
    }
}

#[test]
fn the_projects_docs_have_no_broken_links_commands_or_figures() {
    let mut problems = check(&crate::repo(), &bin_dir());
    problems.extend(
        crate::figures::check(&crate::repo())
            .into_iter()
            .map(|f| Problem {
                file: f.file.into(),
                line: f.line,
                what: f.what,
            }),
    );
    let list: Vec<String> = problems.iter().map(Problem::to_string).collect();
    assert!(
        list.is_empty(),
        "the docs have problems:\n{}",
        list.join("\n")
    );
}

/// A folder of seeded docs, removed when dropped.
struct Seeded(PathBuf);

impl Seeded {
    fn new(files: &[(&str, &str)]) -> Seeded {
        let root = std::env::temp_dir().join(format!("kvgate-docs-check-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        Seeded(root)
    }
}

impl Drop for Seeded {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const SEEDED: &str = "\
# Seeded
## A heading (`with code`)
[fine](#a-heading-with-code) [fine](sub/other.md#other-heading) [fine](sub/)
[missing](nowhere.md) [bad anchor](#no-such-heading) [bad anchor](sub/other.md#nope)
[elsewhere](https://example.invalid/nowhere.md) `[in code](nowhere.md)`
`cargo xtask bench --quick` and `cargo xtask bench --only everything`
```sh
cargo xtask fuzz --seconds 5 --target kv_batch   # fine
cargo xtask demo --fast
kvgate-sidecar --config kvgate.toml \\
  --active-decode-blocks-threshold 0.85 && kvgate-sidecar --no-such-flag
```
```toml
cargo xtask this is not a shell block
```
`kvgate-sidecar status --url http://127.0.0.1:9190`, `kvgate-sim --frobnicate`
`cargo xtask bench --help` `cargo xtask --help` `kvgate-sidecar agent --listen not-an-address`
";

#[test]
fn seeded_broken_links_and_commands_are_caught_and_only_they() {
    let seeded = Seeded::new(&[
        ("README.md", SEEDED),
        (
            "sub/other.md",
            "# Other heading\n[up](../README.md#seeded)\n",
        ),
        (".hidden/skipped.md", "[missing](nowhere.md)\n"),
    ]);
    let problems = check(&seeded.0, &bin_dir());
    let mut found: Vec<(String, usize, String)> = problems
        .iter()
        .map(|p| (p.file.display().to_string(), p.line, p.what.clone()))
        .collect();
    found.sort();
    let expected = [
        (4, "#no-such-heading"),
        (4, "\"nowhere.md\": no such file"),
        (4, "#nope"),
        (6, "`cargo xtask bench --only everything`"),
        (9, "`cargo xtask demo --fast`"),
        (10, "`kvgate-sidecar --no-such-flag`"),
        (16, "`kvgate-sim --frobnicate`"),
        (17, "`kvgate-sidecar agent --listen not-an-address`"),
    ];
    assert_eq!(
        found.len(),
        expected.len(),
        "caught: {:#?}",
        problems.iter().map(Problem::to_string).collect::<Vec<_>>()
    );
    for ((file, line, what), (want_line, want)) in found.iter().zip(expected) {
        assert_eq!(file, "README.md");
        assert_eq!(*line, want_line, "{what}");
        assert!(what.contains(want), "line {line}: {what:?} lacks {want:?}");
    }
}

#[test]
fn shell_lines_split_into_the_projects_commands() {
    let got = project_commands(
        "FOO=1 make && cargo xtask test -- e2e | tee log; kvgate-sim --port '8 1' # kvgate-load",
    );
    assert_eq!(
        got,
        [
            vec!["cargo", "xtask", "test", "--", "e2e"],
            vec!["kvgate-sim", "--port", "8 1"]
        ]
    );
}
