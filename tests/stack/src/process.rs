//! Child processes with their output in log files, killed on drop.

use anyhow::{Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Proc {
    pub fn spawn(name: &str, program: &Path, args: &[String], run_dir: &Path) -> Result<Proc> {
        let log = run_dir.join(format!("{name}.log"));
        let out = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .env(
                "RUST_LOG",
                std::env::var("KVGATE_LOG").unwrap_or_else(|_| "info".into()),
            )
            .spawn()
            .with_context(|| format!("starting {} ({})", name, program.display()))?;
        Ok(Proc {
            name: name.to_string(),
            log,
            child,
        })
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `lines` lines of every `*.log` in `dir`.
pub fn tails(dir: &Path, lines: usize) -> String {
    let mut out = String::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut logs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    logs.sort();
    for p in logs {
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        let from = all.len().saturating_sub(lines);
        out.push_str(&format!(
            "--- {} ---\n{}\n",
            p.file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default(),
            all[from..].join("\n")
        ));
    }
    out
}
