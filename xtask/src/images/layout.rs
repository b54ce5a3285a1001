//! OCI image layout (image-spec v1.1) written as one tar, the
//! `oci-archive` that skopeo, podman and buildah read: `oci-layout`,
//! `index.json` and the blobs (config, manifest, layers) under
//! `blobs/sha256/`. Every JSON document is built in a fixed key order and
//! carries no time, so the same files and config give the same digest.

use super::layer::{self, Tree};
use crate::dist::sha256_hex;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

pub const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// The tag an archive's single image is stored under in `index.json`.
const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// An image to write: its runtime configuration (`config` of the image
/// config: user, entrypoint, labels...) and its layers, bottom first.
pub struct Image {
    pub config: Value,
    pub layers: Vec<Tree>,
}

/// A written archive.
#[derive(Debug, Clone)]
pub struct Written {
    /// `sha256:...` of the manifest: what a registry and the manifests pin.
    pub digest: String,
    pub archive: Vec<u8>,
    /// The compressed layers' bytes, what a pull downloads.
    pub layer_bytes: u64,
    /// The files' bytes once unpacked.
    pub file_bytes: u64,
}

pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(bytes))
}

fn descriptor(media_type: &str, bytes: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": digest(bytes), "size": bytes.len()})
}

/// The architecture name OCI uses for this machine's.
pub fn oci_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Builds the layout of `image`, tagged `tag`, as one tar.
pub fn write(image: &Image, tag: &str) -> Result<Written> {
    let mut blobs = Tree::default();
    let mut diff_ids = Vec::new();
    let mut layers = Vec::new();
    let mut layer_bytes = 0;
    let mut file_bytes = 0;
    for tree in &image.layers {
        let tar = tree.tar()?;
        diff_ids.push(digest(&tar));
        let gz = layer::gzip(&tar)?;
        layer_bytes += gz.len() as u64;
        file_bytes += tree.file_bytes();
        layers.push(descriptor(LAYER_GZIP, &gz));
        add_blob(&mut blobs, gz)?;
    }
    let config = json!({
        "architecture": oci_arch(),
        "os": "linux",
        "config": image.config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let config = serde_json::to_vec(&config)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": descriptor(CONFIG, &config),
        "layers": layers,
    });
    let manifest = serde_json::to_vec(&manifest)?;
    let mut pointer = descriptor(MANIFEST, &manifest);
    pointer["annotations"] = json!({ REF_NAME: tag });
    let index = json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": [pointer]});
    let digest = digest(&manifest);
    add_blob(&mut blobs, config)?;
    add_blob(&mut blobs, manifest)?;
    blobs.file("index.json", false, serde_json::to_vec(&index)?)?;
    blobs.file(
        "oci-layout",
        false,
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    )?;
    Ok(Written {
        digest,
        archive: blobs.tar()?,
        layer_bytes,
        file_bytes,
    })
}

fn add_blob(blobs: &mut Tree, bytes: Vec<u8>) -> Result<()> {
    let path = format!("blobs/sha256/{}", sha256_hex(&bytes));
    // Two layers with the same bytes are one blob.
    if blobs.get(&path).is_some() {
        return Ok(());
    }
    blobs.file(&path, false, bytes)
}

/// An archive read back: its manifest digest, image config and layers
/// (uncompressed), each blob checked against its digest on the way.
pub struct Read {
    pub digest: String,
    pub config: Value,
    pub layers: Vec<Vec<u8>>,
}

pub fn read(archive: &[u8]) -> Result<Read> {
    let tree = layer::untar(archive)?;
    let blob = |d: &str| -> Result<Vec<u8>> {
        let hex = d
            .strip_prefix("sha256:")
            .with_context(|| format!("digest {d} is not sha256"))?;
        let Some(layer::Entry::File { bytes, .. }) = tree.get(&format!("blobs/sha256/{hex}"))
        else {
            bail!("blob {d} is missing");
        };
        anyhow::ensure!(digest(bytes) == d, "blob {d} does not match its digest");
        Ok(bytes.clone())
    };
    let Some(layer::Entry::File { bytes: index, .. }) = tree.get("index.json") else {
        bail!("no index.json");
    };
    let index: Value = serde_json::from_slice(index)?;
    let manifests = index["manifests"]
        .as_array()
        .context("index.json lists no manifests")?;
    anyhow::ensure!(
        manifests.len() == 1,
        "{} manifests, not one",
        manifests.len()
    );
    let digest = manifests[0]["digest"]
        .as_str()
        .context("no manifest digest")?
        .to_string();
    let manifest: Value = serde_json::from_slice(&blob(&digest)?)?;
    anyhow::ensure!(
        manifest["mediaType"] == MANIFEST,
        "manifest type {}",
        manifest["mediaType"]
    );
    let config: Value = serde_json::from_slice(&blob(
        manifest["config"]["digest"]
            .as_str()
            .context("no config digest")?,
    )?)?;
    let mut layers = Vec::new();
    for (i, l) in manifest["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        anyhow::ensure!(
            l["mediaType"] == LAYER_GZIP,
            "layer {i} type {}",
            l["mediaType"]
        );
        let gz = blob(l["digest"].as_str().context("no layer digest")?)?;
        let mut tar = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gz.as_slice()), &mut tar)?;
        let diff_id = &config["rootfs"]["diff_ids"][i];
        anyhow::ensure!(
            diff_id.as_str() == Some(self::digest(&tar).as_str()),
            "layer {i}: its uncompressed digest is not the config's diff_id {diff_id}"
        );
        layers.push(tar);
    }
    Ok(Read {
        digest,
        config,
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(label: &str) -> Image {
        let mut t = Tree::default();
        t.file("/plugin.wasm", false, b"\0asm".to_vec()).unwrap();
        Image {
            config: json!({"Labels": {"x": label}}),
            layers: vec![t],
        }
    }

    #[test]
    fn an_archive_reads_back_with_its_digest_config_and_layer() {
        let w = write(&image("a"), "0.1.0").unwrap();
        let r = read(&w.archive).unwrap();
        assert_eq!(r.digest, w.digest);
        assert_eq!(r.config["config"]["Labels"]["x"], "a");
        assert_eq!(r.config["os"], "linux");
        let files = layer::untar(&r.layers[0]).unwrap();
        assert_eq!(files.files(), ["/plugin.wasm"]);
        assert_eq!(w.file_bytes, 4);
    }

    #[test]
    fn the_digest_follows_the_content_and_nothing_else() {
        let a = write(&image("a"), "0.1.0").unwrap();
        assert_eq!(a.digest, write(&image("a"), "0.1.0").unwrap().digest);
        assert_eq!(a.archive, write(&image("a"), "0.1.0").unwrap().archive);
        assert_ne!(a.digest, write(&image("b"), "0.1.0").unwrap().digest);
        // The tag names the image in the archive's index, not in the image.
        assert_eq!(a.digest, write(&image("a"), "other").unwrap().digest);
    }

    #[test]
    fn a_tampered_blob_is_caught() {
        let w = write(&image("a"), "0.1.0").unwrap();
        let mut tree = layer::untar(&w.archive).unwrap();
        let path = tree
            .files()
            .into_iter()
            .find(|p| p.starts_with("/blobs/"))
            .unwrap();
        let mut t2 = Tree::default();
        for f in tree.files() {
            let Some(layer::Entry::File { executable, bytes }) = tree.get(&f).cloned() else {
                unreachable!()
            };
            let bytes = if f == path {
                b"tampered".to_vec()
            } else {
                bytes
            };
            t2.file(&f, executable, bytes).unwrap();
        }
        tree = t2;
        assert!(read(&tree.tar().unwrap()).is_err());
    }
}
