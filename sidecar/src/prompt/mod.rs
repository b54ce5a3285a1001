//! A model's prompt files: the chat template the filter renders with, and
//! the vocabulary the text index decodes engine blocks with
//! (`kvgate_core::text`, `docs/text-routing.md`).
//!
//! Read from what a model repository ships: `tokenizer.json` (or a
//! `*.tiktoken` file) and `tokenizer_config.json` (`chat_template`,
//! `bos_token`, `eos_token`), with vLLM's `--chat-template` override.

pub mod vocab;

use kvgate_core::text::template::{PromptTemplate, Renderer};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;
pub use vocab::{Vocab, VocabError};

/// `[models.prompt]`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PromptConfig {
    /// `tokenizer.json`, or a `*.tiktoken` vocabulary.
    pub tokenizer: PathBuf,
    /// `tokenizer_config.json`: the chat template and special tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_config: Option<PathBuf>,
    /// A Jinja file used instead of the config's template, as vLLM's
    /// `--chat-template` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
}

#[derive(Debug, Error)]
pub enum PromptError {
    #[error(transparent)]
    Vocab(#[from] VocabError),
    #[error("{path}: {why}")]
    Config { path: String, why: String },
    #[error("model {model} has no chat template: set tokenizer_config or chat_template")]
    NoTemplate { model: String },
    #[error("chat template of {model}: {source}")]
    Template {
        model: String,
        source: kvgate_core::text::template::TemplateError,
    },
}

/// What the sidecar holds for a model with prompt files.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub template: PromptTemplate,
    pub vocab: Arc<Vocab>,
}

impl Prompt {
    pub fn load(model: &str, c: &PromptConfig) -> Result<Prompt, PromptError> {
        let config = match &c.tokenizer_config {
            Some(p) => Some((p, read_json(p)?)),
            None => None,
        };
        let cfg = config.as_ref().map(|(_, v)| v);
        let specials = added_tokens_decoder(cfg);
        let vocab = Vocab::load(&c.tokenizer, &specials)?;
        let token = |key: &str| -> String {
            match cfg.and_then(|v| v.get(key)) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Object(o)) => o
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                _ => String::new(),
            }
        };
        let bos_token = token("bos_token");
        let chat_template = match &c.chat_template {
            Some(p) => {
                String::from_utf8(vocab::read_bounded(p)?).map_err(|_| PromptError::Config {
                    path: p.display().to_string(),
                    why: "not UTF-8".into(),
                })?
            }
            None => config
                .as_ref()
                .and_then(|(_, v)| template_of(v))
                .ok_or_else(|| PromptError::NoTemplate {
                    model: model.into(),
                })?,
        };
        let completion_prefix = if c.tokenizer.extension().is_some_and(|e| e == "tiktoken") {
            let add_bos = cfg
                .and_then(|v| v.get("add_bos_token"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            if add_bos {
                bos_token.clone()
            } else {
                String::new()
            }
        } else {
            completion_prefix(&c.tokenizer)?
        };
        let template = PromptTemplate {
            chat_template,
            bos_token,
            eos_token: token("eos_token"),
            completion_prefix,
        };
        // Refuse here what every router would refuse: a template that does
        // not compile.
        Renderer::new(template.clone()).map_err(|source| PromptError::Template {
            model: model.into(),
            source,
        })?;
        Ok(Prompt {
            template,
            vocab: Arc::new(vocab),
        })
    }
}

fn read_json(p: &Path) -> Result<Value, PromptError> {
    let bytes = vocab::read_bounded(p)?;
    serde_json::from_slice(&bytes).map_err(|e| PromptError::Config {
        path: p.display().to_string(),
        why: e.to_string(),
    })
}

/// `chat_template` is a string, or a list of named templates of which
/// vLLM uses `default`.
fn template_of(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// Special tokens `tokenizer_config.json` declares by id (what a tiktoken
/// vocabulary lacks).
fn added_tokens_decoder(config: Option<&Value>) -> Vec<(u32, String)> {
    config
        .and_then(|v| v.get("added_tokens_decoder"))
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter_map(|(id, t)| Some((id.parse().ok()?, t.get("content")?.as_str()?.to_string())))
        .collect()
}

/// What `encode(prompt, add_special_tokens=True)` puts in front: the
/// special tokens before `$A` in the post-processor's single template.
fn completion_prefix(tokenizer: &Path) -> Result<String, PromptError> {
    let v = read_json(tokenizer)?;
    let mut prefix = String::new();
    let Some(pp) = v.get("post_processor") else {
        return Ok(prefix);
    };
    let processors: Vec<&Value> = match pp.get("type").and_then(Value::as_str) {
        Some("Sequence") => pp
            .get("processors")
            .and_then(Value::as_array)
            .map(|a| a.iter().collect())
            .unwrap_or_default(),
        _ => vec![pp],
    };
    for p in processors {
        if p.get("type").and_then(Value::as_str) != Some("TemplateProcessing") {
            continue;
        }
        for item in p
            .get("single")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if item.get("Sequence").is_some() {
                break;
            }
            if let Some(id) = item
                .get("SpecialToken")
                .and_then(|s| s.get("id"))
                .and_then(Value::as_str)
            {
                prefix.push_str(id);
            }
        }
    }
    Ok(prefix)
}
