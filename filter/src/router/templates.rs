//! This VM's compiled prompt templates, one per model, recompiled only
//! when the snapshot names a new version.

use crate::host::Host;
use kvgate_core::text::template::Renderer;
use kvgate_core::text::template_key;
use kvgate_core::update::shard_key;
use std::collections::HashMap;

#[derive(Debug, Default)]
pub(crate) struct Templates {
    /// model → (version, renderer; `None` when that version does not
    /// compile, so a broken template is not recompiled per request).
    by_model: HashMap<String, (u64, Option<Renderer>)>,
}

impl Templates {
    /// The renderer of `model`'s template `version`; `None` while the blob
    /// the snapshot names has not reached shared data, or when it does not
    /// compile (logged once per version).
    pub fn get(&mut self, h: &impl Host, model: &str, version: u64) -> Option<&mut Renderer> {
        let fresh = matches!(self.by_model.get(model), Some((v, _)) if *v == version);
        if !fresh {
            let bytes = h.get_shared(&shard_key(&template_key(model), 0))?;
            let compiled = Renderer::from_blob(&bytes, version);
            match compiled {
                // Shared data still holds the previous blob.
                Ok(None) => return None,
                Ok(Some(r)) => {
                    self.by_model.insert(model.to_string(), (version, Some(r)));
                }
                Err(e) => {
                    h.log(
                        proxy_wasm::types::LogLevel::Error,
                        &format!("kvgate: prompt template of {model} is unusable: {e}"),
                    );
                    self.by_model.insert(model.to_string(), (version, None));
                }
            }
        }
        self.by_model.get_mut(model).and_then(|(_, r)| r.as_mut())
    }
}
