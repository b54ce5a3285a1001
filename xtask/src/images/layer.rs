//! Reproducible tar archives: the images' layers and the OCI archives that
//! hold them. The same files give the same bytes on any machine: entries
//! sorted by path, every parent folder listed, mtime 0, owner 0:0 with no
//! names, and modes fixed by kind (0755 for folders and executables, 0644
//! otherwise), never the build machine's.

use anyhow::{Result, bail};
use flate2::Compression;
use std::collections::BTreeMap;
use std::io::Write;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Dir,
    File { executable: bool, bytes: Vec<u8> },
}

/// The files of one archive, by path relative to its root.
#[derive(Debug, Default, Clone)]
pub struct Tree {
    entries: BTreeMap<String, Entry>,
}

impl Tree {
    /// Adds a file at `path` (a leading `/` is dropped: layer paths are
    /// relative to the root) with its parent folders.
    pub fn file(&mut self, path: &str, executable: bool, bytes: Vec<u8>) -> Result<()> {
        let path = path.trim_start_matches('/');
        if path.is_empty()
            || path.ends_with('/')
            || path
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == "..")
        {
            bail!("{path:?} is not a plain relative file path");
        }
        let mut at = 0;
        while let Some(i) = path[at..].find('/') {
            let dir = &path[..at + i];
            if let Some(Entry::File { .. }) = self.entries.get(dir) {
                bail!("{dir} is a file and a folder");
            }
            self.entries.insert(dir.to_string(), Entry::Dir);
            at += i + 1;
        }
        if self.entries.contains_key(path) {
            bail!("{path} added twice");
        }
        self.entries
            .insert(path.to_string(), Entry::File { executable, bytes });
        Ok(())
    }

    /// The files (not folders), as absolute paths, sorted.
    pub fn files(&self) -> Vec<String> {
        self.entries
            .iter()
            .filter(|(_, e)| matches!(e, Entry::File { .. }))
            .map(|(p, _)| format!("/{p}"))
            .collect()
    }

    /// The file bytes the tree holds (what the image's filesystem weighs).
    pub fn file_bytes(&self) -> u64 {
        self.entries
            .values()
            .map(|e| match e {
                Entry::File { bytes, .. } => bytes.len() as u64,
                Entry::Dir => 0,
            })
            .sum()
    }

    /// The tree as a POSIX (ustar) tar.
    pub fn tar(&self) -> Result<Vec<u8>> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, entry) in &self.entries {
            let mut h = tar::Header::new_ustar();
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            match entry {
                Entry::Dir => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(0o755);
                    h.set_size(0);
                    h.set_path(format!("{path}/"))?;
                    h.set_cksum();
                    b.append(&h, std::io::empty())?;
                }
                Entry::File { executable, bytes } => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_mode(if *executable { 0o755 } else { 0o644 });
                    h.set_size(bytes.len() as u64);
                    h.set_path(path)?;
                    h.set_cksum();
                    b.append(&h, bytes.as_slice())?;
                }
            }
        }
        Ok(b.into_inner()?)
    }
}

/// gzip with no name and mtime 0 in its header, so equal input gives
/// equal output. Layers ship compressed because a registry push compresses
/// an uncompressed layer itself, and that would change the digest the
/// manifests pin.
pub fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut z = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), Compression::best());
    z.write_all(bytes)?;
    Ok(z.finish()?)
}

/// Reads a tar (a layer or an archive) back into a tree, refusing what
/// the images never hold: links, devices, absolute or `..` paths.
pub fn untar(bytes: &[u8]) -> Result<Tree> {
    let mut tree = Tree::default();
    let mut a = tar::Archive::new(bytes);
    for e in a.entries()? {
        let mut e = e?;
        let path = e.path()?.to_string_lossy().into_owned();
        match e.header().entry_type() {
            tar::EntryType::Directory => {
                let dir = path.trim_end_matches('/').to_string();
                if !dir.is_empty() {
                    tree.entries.entry(dir).or_insert(Entry::Dir);
                }
            }
            tar::EntryType::Regular => {
                let executable = e.header().mode()? & 0o111 != 0;
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut e, &mut bytes)?;
                if path.starts_with('/') {
                    bail!("absolute path {path} in a tar");
                }
                tree.file(&path, executable, bytes)?;
            }
            other => bail!("{path}: a {other:?} entry; the images hold only files and folders"),
        }
    }
    Ok(tree)
}

impl Tree {
    pub fn get(&self, path: &str) -> Option<&Entry> {
        self.entries.get(path.trim_start_matches('/'))
    }

    /// Writes the tree under `root` (which must not exist yet).
    pub fn unpack(&self, root: &std::path::Path) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(root)?;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755))?;
        for (path, entry) in &self.entries {
            let at = root.join(path);
            match entry {
                Entry::Dir => {
                    std::fs::create_dir_all(&at)?;
                    std::fs::set_permissions(&at, std::fs::Permissions::from_mode(0o755))?;
                }
                Entry::File { executable, bytes } => {
                    std::fs::write(&at, bytes)?;
                    let mode = if *executable { 0o755 } else { 0o644 };
                    std::fs::set_permissions(&at, std::fs::Permissions::from_mode(mode))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(order: &[(&str, &[u8])]) -> Tree {
        let mut t = Tree::default();
        for (p, b) in order {
            t.file(p, p.ends_with("bin/x"), b.to_vec()).unwrap();
        }
        t
    }

    #[test]
    fn the_same_files_in_any_order_give_the_same_bytes() {
        let a = sample(&[
            ("/usr/bin/x", b"exe"),
            ("/etc/passwd", b"p"),
            ("/etc/group", b"g"),
        ]);
        let b = sample(&[
            ("/etc/group", b"g"),
            ("/usr/bin/x", b"exe"),
            ("/etc/passwd", b"p"),
        ]);
        assert_eq!(a.tar().unwrap(), b.tar().unwrap());
        assert_eq!(
            gzip(&a.tar().unwrap()).unwrap(),
            gzip(&b.tar().unwrap()).unwrap()
        );
    }

    #[test]
    fn entries_are_sorted_with_their_folders_and_fixed_metadata() {
        let t = sample(&[("/usr/bin/x", b"exe"), ("/etc/passwd", b"p")]);
        let tar = t.tar().unwrap();
        let mut a = tar::Archive::new(tar.as_slice());
        let seen: Vec<(String, u32, u64, u64)> = a
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let h = e.header();
                assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (0, 0));
                assert_eq!(h.username().unwrap(), Some(""));
                (
                    e.path().unwrap().display().to_string(),
                    h.mode().unwrap(),
                    h.mtime().unwrap(),
                    h.size().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                ("etc/".to_string(), 0o755, 0, 0),
                ("etc/passwd".to_string(), 0o644, 0, 1),
                ("usr/".to_string(), 0o755, 0, 0),
                ("usr/bin/".to_string(), 0o755, 0, 0),
                ("usr/bin/x".to_string(), 0o755, 0, 3),
            ]
        );
        let back = untar(&tar).unwrap();
        assert_eq!(back.files(), ["/etc/passwd", "/usr/bin/x"]);
        assert_eq!(back.tar().unwrap(), tar);
    }

    #[test]
    fn odd_paths_are_refused() {
        let mut t = Tree::default();
        for p in ["", "/", "a/../b", "a//b", "a/"] {
            assert!(t.file(p, false, vec![]).is_err(), "{p:?}");
        }
        t.file("a/b", false, vec![]).unwrap();
        assert!(t.file("a/b/c", false, vec![]).is_err());
        assert!(t.file("a/b", false, vec![]).is_err());
    }
}
