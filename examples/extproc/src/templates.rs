//! Compiled prompt templates, one per model, recompiled only when the
//! snapshot names a new version: the filter renders a chat with its
//! model's template before it plans, so this server does too.

use kvgate_core::text::template::Renderer;
use kvgate_core::text::template_key;
use kvgate_core::update::shard_key;
use kvgate_sidecar::Sidecar;
use kvgate_sidecar::api::route;
use parking_lot::Mutex;
use std::collections::HashMap;

#[derive(Debug, Default)]
pub struct Templates {
    /// model → (version, renderer; `None` when that version does not
    /// compile, so that a broken template is not recompiled per request).
    by_model: Mutex<HashMap<String, (u64, Option<Renderer>)>>,
}

/// How a render went, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rendered {
    Yes,
    /// The blob is not published yet, or does not compile.
    Unusable,
    Failed,
}

impl Templates {
    /// Renders `req`, parsed from `body`, with `model`'s template
    /// `version`, as the filter does (a request keeps its approximate text
    /// when rendering fails).
    pub fn render(
        &self,
        sc: &Sidecar,
        version: u64,
        req: &mut kvgate_core::plan::request::Parsed,
        body: &[u8],
        unix_s: u64,
    ) -> Rendered {
        let model = req.model.clone();
        let model = model.as_str();
        // One lock for all models: the skeleton cache inside a renderer
        // is mutable, and contention only matters with templates set.
        let mut by_model = self.by_model.lock();
        let fresh = matches!(by_model.get(model), Some((v, _)) if *v == version);
        if !fresh {
            let Some(bytes) = route::published(sc.selection(), &shard_key(&template_key(model), 0))
            else {
                return Rendered::Unusable;
            };
            let compiled = Renderer::from_blob(&bytes, version);
            match compiled {
                // The store still holds the previous blob.
                Ok(None) => return Rendered::Unusable,
                Ok(Some(r)) => {
                    by_model.insert(model.to_string(), (version, Some(r)));
                }
                Err(e) => {
                    tracing::error!(model, error = %e, "prompt template is unusable");
                    by_model.insert(model.to_string(), (version, None));
                }
            }
        }
        match by_model.get_mut(model).and_then(|(_, r)| r.as_mut()) {
            Some(r) => match req.render(r, body, unix_s) {
                Ok(_) => Rendered::Yes,
                Err(_) => Rendered::Failed,
            },
            None => Rendered::Unusable,
        }
    }
}
