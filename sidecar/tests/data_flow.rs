//! The sidecar's data flows one way through its modules (see "Data flow
//! inside the sidecar" in docs/architecture.md): this test reads every
//! source file, follows each `crate::` and `super::` path to the top-level
//! module it names, and checks that the importing module's layer may read
//! that layer. The layer table below is the rule's only statement in code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One layer: its top-level modules, and the layers it may import from
/// besides its own.
struct Layer {
    name: &'static str,
    modules: &'static [&'static str],
    reads: &'static [&'static str],
}

/// In the order data flows. `lib` is the crate root (`lib.rs`).
const LAYERS: &[Layer] = &[
    Layer {
        // Importable by all: configuration, the metric families, the
        // clock, and a model's prompt files (the sources' KV index reads
        // a prompt's vocabulary).
        name: "ground",
        modules: &["config", "metrics", "clock", "prompt"],
        reads: &[],
    },
    Layer {
        // What comes in: KV events and the index they feed, scrapes,
        // bookings, routing decisions, GPU readings, replica sync, and a
        // peer's index dump at start-up.
        name: "sources",
        modules: &["sources", "replica", "recovery"],
        reads: &["ground"],
    },
    Layer {
        // The state kept from the sources, the thermal loop that steps
        // its controllers, and the planner's decision math that runs on
        // the fleet's observations.
        name: "fleet",
        modules: &["fleet", "thermal", "planner"],
        reads: &["ground", "sources"],
    },
    Layer {
        // What goes out to gateways: built from the fleet, never from a
        // source directly.
        name: "publish",
        modules: &["publish"],
        reads: &["ground", "fleet"],
    },
    Layer {
        name: "api",
        modules: &["api"],
        reads: &["ground", "sources", "fleet", "publish"],
    },
    Layer {
        // The planner's profile step before deployment: a client of one
        // worker that writes configuration rows; it reads configuration
        // only, and nothing of the running sidecar reads it.
        name: "profile",
        modules: &["profile"],
        reads: &["ground"],
    },
    Layer {
        // Starts, connects and runs the rest: may import everything.
        name: "wiring",
        modules: &["lib", "sidecar", "tick", "lifecycle"],
        reads: &["ground", "sources", "fleet", "publish", "api"],
    },
];

fn layer_of(module: &str) -> Option<&'static Layer> {
    LAYERS.iter().find(|l| l.modules.contains(&module))
}

/// Whether `from` may import `to`.
fn may_import(from: &str, to: &str) -> Result<bool, String> {
    let f = layer_of(from).ok_or_else(|| format!("module {from} is in no layer"))?;
    let t = layer_of(to).ok_or_else(|| format!("module {to} is in no layer"))?;
    Ok(f.name == t.name || f.reads.contains(&t.name))
}

/// The source with comments, string and character literals blanked (their
/// length kept), so that a path in a doc comment or a message is no import.
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, s: &[u8]| {
        out.extend(s.iter().map(|c| if *c == b'\n' { b'\n' } else { b' ' }));
    };
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            let end = rest.iter().position(|c| *c == b'\n').unwrap_or(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, 0);
            while j < rest.len() {
                if rest[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &rest[..j]);
            i += j;
        } else if let Some(len) = raw_string(rest) {
            blank(&mut out, &rest[..len]);
            i += len;
        } else if rest[0] == b'"' || rest.starts_with(b"b\"") {
            let mut j = if rest[0] == b'"' { 1 } else { 2 };
            while j < rest.len() && rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'\'' {
            // A character literal ('x', '\n', '\u{..}'), not a lifetime.
            let len = match rest.get(1) {
                Some(b'\\') => rest[2..].iter().position(|c| *c == b'\'').map(|p| p + 3),
                Some(first) => {
                    let ch = match first {
                        0xF0.. => 4,
                        0xE0.. => 3,
                        0x80.. => 2,
                        _ => 1,
                    };
                    (rest.get(1 + ch) == Some(&b'\'')).then_some(ch + 2)
                }
                None => None,
            };
            let len = len.unwrap_or(1);
            if len > 1 {
                blank(&mut out, &rest[..len]);
            } else {
                out.push(b'\'');
            }
            i += len;
        } else {
            out.push(rest[0]);
            i += 1;
        }
    }
    String::from_utf8(out).expect("blanking keeps UTF-8: only ASCII is replaced")
}

/// The length of a raw string literal (`r"…"`, `r#"…"#`, `br"…"`) at the
/// start of `s`.
fn raw_string(s: &[u8]) -> Option<usize> {
    let start = if s.starts_with(b"br") {
        2
    } else if s.starts_with(b"r") {
        1
    } else {
        return None;
    };
    let hashes = s[start..].iter().take_while(|c| **c == b'#').count();
    if s.get(start + hashes) != Some(&b'"') {
        return None;
    }
    let mut close = vec![b'"'];
    close.extend(std::iter::repeat_n(b'#', hashes));
    let body = start + hashes + 1;
    let end = s[body..]
        .windows(close.len())
        .position(|w| w == close.as_slice())?;
    Some(body + end + close.len())
}

/// `code` without its `#[cfg(test)] mod … { … }` blocks: tests assemble
/// whatever they check, as the wiring does.
fn without_test_modules(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let item = after.trim_start();
        let inline_mod = item.strip_prefix("mod ").is_some_and(|m| {
            m.trim_start()
                .trim_start_matches(is_ident)
                .trim_start()
                .starts_with('{')
        });
        if !inline_mod {
            out.push_str("#[cfg(test)]");
            rest = after;
            continue;
        }
        let open = after.find('{').expect("an inline module has a body");
        let mut depth = 0usize;
        let mut end = after.len();
        for (j, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The first segment of each path a `{ … }` use group lists.
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut item = String::new();
    for c in group.chars() {
        match c {
            '{' => {
                depth += 1;
                item.push(c);
            }
            '}' => {
                depth -= 1;
                item.push(c);
            }
            ',' if depth == 0 => heads.push(std::mem::take(&mut item)),
            _ => item.push(c),
        }
    }
    heads.push(item);
    heads
        .iter()
        .map(|i| {
            i.trim()
                .chars()
                .take_while(|c| is_ident(*c))
                .collect::<String>()
        })
        .filter(|h| !h.is_empty() && h != "self")
        .collect()
}

/// The names each path in `code` starts with at the crate root: what
/// follows `crate::`, or the `super::` that climbs out of `module` (the
/// file's module path, `["api", "select"]`). Use trees and expression
/// paths alike; a group (`crate::{a, b::c}`) gives each of its heads.
fn root_paths(code: &str, module: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    let chars: Vec<(usize, char)> = code.char_indices().collect();
    let mut k = 0;
    while k < chars.len() {
        let (at, _) = chars[k];
        let word_start = k == 0 || !(is_ident(chars[k - 1].1) || chars[k - 1].1 == '$');
        let tail = &code[at..];
        if !word_start || !(tail.starts_with("crate") || tail.starts_with("super")) {
            k += 1;
            continue;
        }
        // Climb: `crate` is the root; each `super` one module up.
        let mut depth = module.len();
        let mut pos = at;
        let mut from_root = false;
        loop {
            let t = &code[pos..];
            let word: String = t.chars().take_while(|c| is_ident(*c)).collect();
            let after = t[word.len()..].trim_start();
            if !after.starts_with("::") || !(word == "crate" || word == "super") {
                break;
            }
            if word == "crate" {
                depth = 0;
                from_root = true;
            } else if depth == 0 {
                panic!("a super:: path climbs above the crate root in {module:?}");
            } else {
                depth -= 1;
                from_root = depth == 0;
            }
            pos = code.len() - after.len() + 2;
            pos += code[pos..].len() - code[pos..].trim_start().len();
            if word == "crate" {
                break;
            }
        }
        if from_root {
            let t = &code[pos..];
            if let Some(group) = t.strip_prefix('{') {
                let mut d = 1usize;
                let end = group
                    .char_indices()
                    .find(|(_, c)| {
                        match c {
                            '{' => d += 1,
                            '}' => d -= 1,
                            _ => {}
                        }
                        d == 0
                    })
                    .map_or(group.len(), |(j, _)| j);
                found.extend(group_heads(&group[..end]));
            } else {
                let head: String = t.chars().take_while(|c| is_ident(*c)).collect();
                if !head.is_empty() {
                    found.push(head);
                }
            }
        }
        while k < chars.len() && chars[k].0 < pos.max(at + 1) {
            k += 1;
        }
    }
    found
}

/// The module path of a file under `src`: `api/select/route.rs` is
/// `["api", "select", "route"]`, `api/mod.rs` and `lib.rs` drop their
/// file name (`["api"]`, `[]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let file = parts.pop().expect("a file has a name");
    let stem = file.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// What the crate root's `pub use m::Name` re-exports, by name: a path
/// through the re-export goes to `m`.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for line in code_only(lib).lines() {
        let Some(path) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let path = path.trim_end_matches(';');
        if let Some((module, name)) = path.split_once("::") {
            let name = name.rsplit("::").next().unwrap_or(name);
            names.insert(name.to_string(), module.to_string());
        }
    }
    names
}

/// The modules `lib.rs` declares.
fn declared_modules(lib: &str) -> BTreeSet<String> {
    code_only(lib)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("pub ").unwrap_or(l);
            let rest = rest.strip_prefix("pub(crate) ").unwrap_or(rest);
            rest.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(str::to_string)
        })
        .collect()
}

/// Every import in `src` (the crate's source folder) as (from module, to
/// module, file): each file's own top-level module, and the top-level
/// module of each path it takes from the crate root. Files named
/// `tests.rs` and `main.rs` (the binary, another crate) are left out.
fn imports(src: &Path) -> Vec<(String, String, PathBuf)> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let modules = declared_modules(&lib);
    let reexported = reexports(&lib);
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("a source folder") {
            let p = e.expect("a folder entry").path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut found = Vec::new();
    for file in files {
        let rel = file.strip_prefix(src).expect("under src").to_path_buf();
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == "tests.rs" || rel == Path::new("main.rs") {
            continue;
        }
        let module = module_path(&rel);
        let from = module.first().cloned().unwrap_or_else(|| "lib".into());
        let text = std::fs::read_to_string(&file).expect("a readable source file");
        let code = without_test_modules(&code_only(&text));
        for head in root_paths(&code, &module) {
            let to = if modules.contains(&head) {
                head
            } else if let Some(m) = reexported.get(&head) {
                m.clone()
            } else {
                // An item of lib.rs itself, or a crate outside (`crate`
                // is only this one): the root.
                "lib".to_string()
            };
            if to != from {
                found.push((from.clone(), to, rel.clone()));
            }
        }
    }
    found
}

/// Every import that runs against the flow, as "from -> to (file)".
fn against_the_flow(found: &[(String, String, PathBuf)]) -> Vec<String> {
    found
        .iter()
        .filter(|(from, to, _)| !may_import(from, to).unwrap_or_else(|e| panic!("{e}")))
        .map(|(from, to, file)| format!("{from} -> {to} ({})", file.display()))
        .collect()
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn every_module_is_in_one_layer() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let declared = declared_modules(&lib);
    let mut placed = BTreeSet::new();
    for l in LAYERS {
        for m in l.modules {
            assert!(placed.insert(m.to_string()), "{m} is in two layers");
            assert!(
                *m == "lib" || declared.contains(*m),
                "{m} is in a layer but lib.rs declares no such module"
            );
        }
    }
    for m in &declared {
        assert!(
            placed.contains(m),
            "lib.rs declares {m}: place it in a layer"
        );
    }
}

#[test]
fn no_import_runs_against_the_data_flow() {
    let against = against_the_flow(&imports(&src()));
    assert!(
        against.is_empty(),
        "imports against the data flow (see docs/architecture.md):\n{}",
        against.join("\n")
    );
}

#[test]
fn sources_and_publish_never_import_each_other() {
    let found = imports(&src());
    let between: Vec<_> = found
        .iter()
        .filter(|(f, t, _)| {
            let (f, t) = (layer_of(f).map(|l| l.name), layer_of(t).map(|l| l.name));
            matches!(
                (f, t),
                (Some("sources"), Some("publish")) | (Some("publish"), Some("sources"))
            )
        })
        .collect();
    assert!(between.is_empty(), "{between:?}");
}

/// The rule's own check: a tree seeded with violations in each form a
/// path takes must have each one found, and nothing in comments, strings
/// or test modules.
#[test]
fn a_seeded_violation_is_caught() {
    let dir = std::env::temp_dir().join(format!("kvgate-data-flow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let write = |rel: &str, text: &str| {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write(
        "lib.rs",
        "pub mod config;\nmod fleet;\npub mod publish;\npub mod sources;\nmod sidecar;\n\
         pub use sidecar::Sidecar;\n",
    );
    write("sidecar.rs", "pub struct Sidecar;\n");
    write(
        "fleet/mod.rs",
        "use crate::config::Config;\nuse crate::sources::kv;\n",
    );
    write(
        "config/mod.rs",
        "//! See crate::fleet::Fleet, which this must not import.\n\
         const HELP: &str = \"crate::publish is named in a string\";\n\
         const RAW: &str = r#\"crate::publish \"quoted\" too\"#;\n\
         const Q: char = '\"';\n\
         fn f<'a>(x: &'a str) -> &'a str { x }\n\
         #[cfg(test)]\nmod tests { use crate::sidecar::Sidecar; }\n",
    );
    // A grouped use tree, reaching the wiring through a re-export.
    write(
        "sources/mod.rs",
        "pub mod kv;\nuse crate::{config::Config, Sidecar};\n",
    );
    // An inline expression path, against the flow.
    write(
        "sources/kv/mod.rs",
        "pub fn f() -> usize { crate::fleet::count() }\n",
    );
    // A nested group, and a `super` path out of a two-deep module.
    write(
        "publish/frame/mod.rs",
        "use crate::{config::{self, Config}, fleet::Fleet};\nuse super::super::sources::kv;\n",
    );
    let found = imports(&dir);
    let mut got = against_the_flow(&found);
    got.sort();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        got,
        [
            "publish -> sources (publish/frame/mod.rs)",
            "sources -> fleet (sources/kv/mod.rs)",
            "sources -> sidecar (sources/mod.rs)",
        ]
    );
    assert!(
        found.iter().any(|(f, t, _)| f == "publish" && t == "fleet"),
        "a nested group's heads are each followed: {found:?}"
    );
}
