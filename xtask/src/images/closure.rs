//! The sidecar's run-time closure: the shared libraries its `DT_NEEDED`
//! entries name, theirs in turn, and the loader its `PT_INTERP` names.
//!
//! Two independent readings, so that the check is not the build read
//! twice: the build asks the machine's loader (`ldd`) which files it
//! would map; the check reads the ELF dynamic sections of the files in the
//! unpacked image and resolves each name inside the image alone.

use anyhow::{Context, Result, bail};
use object::read::elf::{ElfFile64, ProgramHeader};
use object::{Endianness, elf};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The files the loader maps for `binary` on this machine, as `ldd`
/// reports them (the vDSO, which has no file, aside).
pub fn ldd(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd (glibc's; Debian package libc-bin)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "ldd {} failed: {}{}",
        binary.display(),
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    parse_ldd(&text)
}

fn parse_ldd(text: &str) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)", or the
        // loader alone: "/lib64/ld-linux-x86-64.so.2 (0x...)".
        let target = match line.split_once(" => ") {
            Some((name, rest)) => {
                if rest.starts_with("not found") {
                    bail!("ldd: {name} is not found on this machine");
                }
                rest
            }
            None => line,
        };
        let path = target.split(" (").next().unwrap_or("").trim();
        if path.starts_with('/') {
            found.push(PathBuf::from(path));
        } else if !line.starts_with("linux-vdso") && !line.starts_with("linux-gate") {
            bail!("ldd: cannot read {line:?}");
        }
    }
    found.sort();
    found.dedup();
    Ok(found)
}

/// What one ELF file asks of the loader.
#[derive(Debug, PartialEq, Eq)]
pub struct Needs {
    pub interpreter: Option<String>,
    pub needed: Vec<String>,
    pub runpath: bool,
}

pub fn needs(bytes: &[u8]) -> Result<Needs> {
    let file = ElfFile64::<Endianness>::parse(bytes).context("not a 64-bit ELF file")?;
    let endian = file.endian();
    let mut interpreter = None;
    for ph in file.elf_program_headers() {
        if let Some(i) = ph.interpreter(endian, bytes)? {
            interpreter = Some(String::from_utf8_lossy(i).into_owned());
        }
    }
    let table = file.elf_section_table().dynamic_table(endian, bytes)?;
    let mut needed = Vec::new();
    let mut runpath = false;
    for d in table.iter() {
        match d.tag {
            elf::DT_NEEDED => needed.push(String::from_utf8_lossy(table.string(d)?).into_owned()),
            elf::DT_RPATH | elf::DT_RUNPATH => runpath = true,
            _ => {}
        }
    }
    Ok(Needs {
        interpreter,
        needed,
        runpath,
    })
}

/// The folders glibc's loader searches with no `ld.so.cache` and no
/// `RUNPATH`: Debian's multiarch folders, then the plain ones.
pub fn search_dirs() -> Vec<String> {
    let triple = format!("{}-linux-gnu", std::env::consts::ARCH);
    vec![
        format!("/lib/{triple}"),
        format!("/usr/lib/{triple}"),
        "/lib64".into(),
        "/usr/lib64".into(),
        "/lib".into(),
        "/usr/lib".into(),
    ]
}

/// The closure of `root` among `files` (absolute path → bytes): every file
/// the loader would map, resolved in `files` alone. A name it cannot find
/// there is an error: the image would not start.
pub fn closure_in(files: &BTreeMap<String, &[u8]>, root: &str) -> Result<BTreeSet<String>> {
    let dirs = search_dirs();
    let mut seen = BTreeSet::new();
    let mut todo = vec![root.to_string()];
    while let Some(path) = todo.pop() {
        let bytes = files
            .get(&path)
            .with_context(|| format!("{path} is not in the image"))?;
        let n = needs(bytes).with_context(|| format!("reading {path}"))?;
        anyhow::ensure!(
            !n.runpath,
            "{path} has an RPATH or RUNPATH: this check resolves the default folders only"
        );
        let mut next: Vec<String> = n.interpreter.into_iter().collect();
        for name in &n.needed {
            let found = dirs
                .iter()
                .map(|d| format!("{d}/{name}"))
                .find(|p| files.contains_key(p))
                .with_context(|| format!("{path} needs {name}, which the image lacks"))?;
            next.push(found);
        }
        for p in next {
            if seen.insert(p.clone()) {
                todo.push(p);
            }
        }
    }
    seen.remove(root);
    Ok(seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_the_mapped_files() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
            \tlibstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007f)\n\
            \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
            \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib/x86_64-linux-gnu/libstdc++.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        assert!(parse_ldd("\tlibfoo.so.1 => not found\n").is_err());
    }

    /// This test binary is itself a dynamically linked glibc program: its
    /// closure read from its ELF files, resolved among the files ldd names,
    /// is exactly what ldd names.
    #[test]
    fn the_elf_reading_agrees_with_the_loader_on_this_binary() {
        let me = std::env::current_exe().unwrap();
        let libs = ldd(&me).unwrap();
        let mut bytes = BTreeMap::new();
        bytes.insert("/bin/me".to_string(), std::fs::read(&me).unwrap());
        for l in &libs {
            bytes.insert(l.display().to_string(), std::fs::read(l).unwrap());
        }
        let files: BTreeMap<String, &[u8]> = bytes
            .iter()
            .map(|(k, v)| (k.clone(), v.as_slice()))
            .collect();
        let closure = closure_in(&files, "/bin/me").unwrap();
        let expected: BTreeSet<String> = libs.iter().map(|l| l.display().to_string()).collect();
        assert_eq!(closure, expected);
        let n = needs(files["/bin/me"]).unwrap();
        assert!(n.needed.iter().any(|l| l == "libc.so.6"), "{n:?}");
        assert!(n.interpreter.is_some());

        // Without libc the image could not start.
        let mut without = files.clone();
        without.retain(|k, _| !k.ends_with("/libc.so.6"));
        let e = closure_in(&without, "/bin/me").unwrap_err();
        assert!(format!("{e:#}").contains("libc.so.6"), "{e:#}");
    }
}
