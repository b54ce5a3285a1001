//! `deploy/` holds the manifests as templates: where an image reference or
//! digest belongs they name a variable (`${KVGATE_SIDECAR_IMAGE}`), never a
//! made-up value. This fills them in from the images just built and writes
//! ready manifests to `target/dist/deploy/`, in the same folders.

use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::Path;

/// The variables a template may name, and what each becomes.
pub const VARIABLES: [(&str, &str); 4] = [
    (
        "KVGATE_SIDECAR_IMAGE",
        "the sidecar image, by tag and digest (REGISTRY/kvgate-sidecar:VERSION@sha256:...)",
    ),
    (
        "KVGATE_FILTER_IMAGE",
        "the filter image, by tag and digest, for Kubernetes image volumes",
    ),
    (
        "KVGATE_FILTER_BY_TAG",
        "the filter image by tag (REGISTRY/kvgate-filter:VERSION), for Envoy Gateway's and Istio's url",
    ),
    (
        "KVGATE_FILTER_DIGEST",
        "the filter image's manifest digest, hex only: the sha256 pin of Envoy Gateway and Istio",
    ),
];

/// Shell variables that a pod's own command expands at run time (the init
/// container's `sed`): text to keep, not template variables.
const RUN_TIME: [&str; 1] = ["KVGATE_CONTROL_TOKEN"];

/// `text` with every template variable replaced by its value in `values`.
/// A `${NAME}` that is neither a template variable nor a run-time one is an
/// error, so a misspelt variable cannot ship.
pub fn render(text: &str, values: &BTreeMap<&str, String>) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let end = after
            .find('}')
            .with_context(|| format!("unclosed ${{ at {:?}", &rest[at..]))?;
        let name = &after[..end];
        if let Some(v) = values.get(name) {
            out.push_str(v);
        } else if RUN_TIME.contains(&name) {
            out.push_str(&rest[at..at + 3 + end]);
        } else {
            bail!("unknown template variable ${{{name}}}");
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Renders every `.yaml` under `from`'s `dirs` into the same folders
/// under `to`; returns how many files.
pub fn render_tree(
    from: &Path,
    dirs: &[&str],
    to: &Path,
    values: &BTreeMap<&str, String>,
) -> Result<usize> {
    for (name, _) in VARIABLES {
        anyhow::ensure!(values.contains_key(name), "no value for ${{{name}}}");
    }
    if to.exists() {
        std::fs::remove_dir_all(to).with_context(|| format!("clearing {}", to.display()))?;
    }
    let mut n = 0;
    for dir in dirs {
        let out_dir = to.join(dir.trim_start_matches("deploy/"));
        std::fs::create_dir_all(&out_dir)?;
        let mut files: Vec<_> = std::fs::read_dir(from.join(dir))
            .with_context(|| format!("listing {dir}"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f)?;
            let done =
                render(&text, values).with_context(|| format!("rendering {}", f.display()))?;
            let name = f.file_name().context("a file without a name")?;
            std::fs::write(out_dir.join(name), done)?;
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> BTreeMap<&'static str, String> {
        VARIABLES
            .iter()
            .map(|(k, _)| (*k, format!("<{k}>")))
            .collect()
    }

    #[test]
    fn variables_are_filled_and_run_time_ones_kept() {
        let t = "image: ${KVGATE_SIDECAR_IMAGE}\nsha256: ${KVGATE_FILTER_DIGEST}\nsed s/x/${KVGATE_CONTROL_TOKEN}/\n";
        assert_eq!(
            render(t, &values()).unwrap(),
            "image: <KVGATE_SIDECAR_IMAGE>\nsha256: <KVGATE_FILTER_DIGEST>\nsed s/x/${KVGATE_CONTROL_TOKEN}/\n"
        );
    }

    #[test]
    fn unknown_or_unclosed_variables_fail() {
        assert!(render("${KVGATE_SIDECAR_IMAGES}", &values()).is_err());
        assert!(render("${KVGATE_SIDECAR_IMAGE", &values()).is_err());
        assert_eq!(
            render("no variables $HOME", &values()).unwrap(),
            "no variables $HOME"
        );
    }

    /// The templates in deploy/ render with the variables above and
    /// nothing else, and no placeholder survives into them.
    #[test]
    fn the_deploy_templates_render_and_name_no_placeholder() {
        let repo = crate::repo();
        let to = std::env::temp_dir().join(format!("kvgate-render-{}", std::process::id()));
        let n = render_tree(&repo, &crate::MANIFEST_DIRS, &to, &values()).unwrap();
        assert!(n >= 6, "{n} files");
        let mut used = std::collections::BTreeSet::new();
        for dir in crate::MANIFEST_DIRS {
            for e in std::fs::read_dir(repo.join(dir)).unwrap() {
                let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
                for (k, _) in VARIABLES {
                    if text.contains(&format!("${{{k}}}")) {
                        used.insert(k);
                    }
                }
                assert!(!text.contains("example.com"), "a made-up host in {dir}");
                assert!(!text.contains(&"0".repeat(64)), "a zero digest in {dir}");
            }
        }
        let all: std::collections::BTreeSet<&str> = VARIABLES.iter().map(|(k, _)| *k).collect();
        assert_eq!(used, all, "every variable is used somewhere");
        std::fs::remove_dir_all(&to).unwrap();
    }
}
