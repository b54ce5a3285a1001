//! The simulated engine's tokenizer: a real one, used as vLLM uses it.
//!
//! A chat is rendered with the model's chat template (the same renderer
//! kvgate's filter uses, checked against `transformers`) and tokenized
//! without added special tokens; a text completion is tokenized with them.
//! So the token ids in the simulator's KV events are those an engine
//! serving the model would publish. Without `--tokenizer` the simulator
//! serves the Llama-3-style byte-level BPE of kvgate's test fixtures
//! (`tests/fixtures/chat`, trained on the project's docs: about four bytes
//! a token on English, as a real vocabulary).
//!
//! A text it has tokenized before is answered from a memo. The simulated
//! workers share the gateway's cores in the benches, which real engines
//! never do, and a 2k-token prompt costs the tokenizer milliseconds of
//! CPU, against tens of microseconds for the decision being measured;
//! the benches send the same prompts again in turns, so the memo keeps
//! the stand-in's own work from crowding what it stands beside. The ids
//! are the tokenizer's either way.

use anyhow::Context;
use kvgate_core::text::template::{PromptTemplate, Renderer};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use xxhash_rust::xxh3::xxh3_128_with_seed;

const BUILTIN_TOKENIZER: &str =
    include_str!("../../../tests/fixtures/chat/llama3-style.tokenizer.json");
const BUILTIN_CONFIG: &str =
    include_str!("../../../tests/fixtures/chat/llama3-style.tokenizer_config.json");

/// A model's own tokenizer and chat template: the token ids the
/// simulator caches and reports are those a vLLM serving the model would.
pub struct RealText {
    tokenizer: tokenizers::Tokenizer,
    chat: Option<Renderer>,
    memo: Mutex<Memo>,
}

/// Token ids the memo holds at most, over all its texts (16 MiB).
const MEMO_TOKENS: usize = 4 << 20;

/// Texts tokenized before, by a 128-bit hash of the text and whether
/// special tokens were added; the oldest go first.
#[derive(Default)]
struct Memo {
    ids: HashMap<u128, Arc<[u32]>>,
    order: VecDeque<u128>,
    tokens: usize,
}

impl Memo {
    fn key(text: &str, special: bool) -> u128 {
        xxh3_128_with_seed(text.as_bytes(), u64::from(special))
    }

    fn get(&self, key: u128) -> Option<Arc<[u32]>> {
        self.ids.get(&key).cloned()
    }

    fn put(&mut self, key: u128, ids: Arc<[u32]>) {
        if ids.len() > MEMO_TOKENS || self.ids.contains_key(&key) {
            return;
        }
        while self.tokens + ids.len() > MEMO_TOKENS {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(gone) = self.ids.remove(&old) {
                self.tokens -= gone.len();
            }
        }
        self.tokens += ids.len();
        self.order.push_back(key);
        self.ids.insert(key, ids);
    }
}

impl RealText {
    /// The fixtures' Llama-3-style model, built into the simulator.
    pub fn builtin() -> anyhow::Result<RealText> {
        let tok: tokenizers::Tokenizer = BUILTIN_TOKENIZER
            .parse()
            .map_err(|e| anyhow::anyhow!("the built-in tokenizer: {e}"))?;
        RealText::with(tok, serde_json::from_str(BUILTIN_CONFIG)?, None)
    }

    pub fn load(
        tokenizer: &Path,
        config: Option<&Path>,
        chat_template: Option<&Path>,
    ) -> anyhow::Result<RealText> {
        let tok = tokenizers::Tokenizer::from_file(tokenizer)
            .map_err(|e| anyhow::anyhow!("loading {}: {e}", tokenizer.display()))?;
        let config: Value = match config {
            Some(p) => serde_json::from_slice(
                &std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
            )
            .with_context(|| format!("parsing {}", p.display()))?,
            None => Value::Null,
        };
        let template = match chat_template {
            Some(p) => Some(
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            ),
            None => None,
        };
        RealText::with(tok, config, template)
    }

    fn with(
        tok: tokenizers::Tokenizer,
        config: Value,
        template: Option<String>,
    ) -> anyhow::Result<RealText> {
        let token = |k: &str| match &config[k] {
            Value::String(s) => s.clone(),
            v => v["content"].as_str().unwrap_or_default().to_string(),
        };
        let source = template.or_else(|| config["chat_template"].as_str().map(str::to_owned));
        let chat = source
            .map(|chat_template| {
                Renderer::new(PromptTemplate {
                    chat_template,
                    bos_token: token("bos_token"),
                    eos_token: token("eos_token"),
                    completion_prefix: String::new(),
                })
            })
            .transpose()?;
        Ok(RealText {
            tokenizer: tok,
            chat,
            memo: Mutex::default(),
        })
    }

    /// A completion prompt's ids, with the special tokens the tokenizer
    /// adds (vLLM's `/v1/completions`).
    pub fn prompt(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode(text, true)
    }

    /// A chat request's ids: rendered with the template, then tokenized
    /// without added special tokens (the template wrote them).
    pub fn chat(&self, body: &Value, unix_s: u64) -> Result<Vec<u32>, String> {
        let r = self
            .chat
            .as_ref()
            .ok_or("this model has no chat template")?;
        let mut kwargs = body["chat_template_kwargs"].as_object().cloned();
        if let Some(b) = body["add_generation_prompt"].as_bool() {
            kwargs
                .get_or_insert_default()
                .insert("add_generation_prompt".into(), Value::Bool(b));
        }
        let tools = Some(&body["tools"]).filter(|t| !t.is_null());
        let text = r
            .chat(&body["messages"], tools, kwargs.as_ref(), unix_s)
            .map_err(|e| e.to_string())?;
        self.encode(&text, false)
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        let key = Memo::key(text, special);
        // A poisoned memo is only a slower tokenizer.
        if let Some(ids) = self.memo.lock().ok().and_then(|m| m.get(key)) {
            return Ok(ids.to_vec());
        }
        let ids: Arc<[u32]> = self
            .tokenizer
            .encode(text, special)
            .map_err(|e| e.to_string())?
            .get_ids()
            .into();
        if let Ok(mut m) = self.memo.lock() {
            m.put(key, ids.clone());
        }
        Ok(ids.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn about_four_bytes_a_token_like_a_real_vocabulary() {
        let t = RealText::builtin().unwrap();
        let text = "Routing each request to the worker that already caches its prompt \
            prefix saves the prefill, weighed against the load of every worker.";
        let ids = t.prompt(text).unwrap();
        let per_token = text.len() as f64 / (ids.len() - 1) as f64;
        assert!((3.0..6.0).contains(&per_token), "{per_token} bytes a token");
        assert_eq!(ids[0], 3000, "<|begin_of_text|> first, as Llama 3 adds it");
        let again = t.prompt(&format!("{text} And more.")).unwrap();
        assert_eq!(
            again[..ids.len() - 1],
            ids[..ids.len() - 1],
            "shared prefix"
        );
    }

    #[test]
    fn the_memo_answers_as_the_tokenizer_and_stays_bounded() {
        let t = RealText::builtin().unwrap();
        let text = "Routing each request to the worker that already caches its prefix.";
        let first = t.prompt(text).unwrap();
        assert_eq!(t.prompt(text).unwrap(), first, "from the memo");
        let plain = t.encode(text, false).unwrap();
        assert_eq!(plain, first[1..], "special tokens are part of the key");
        let mut m = Memo::default();
        let big: Arc<[u32]> = vec![7; MEMO_TOKENS / 2].into();
        m.put(1, big.clone());
        m.put(2, big.clone());
        m.put(3, big);
        assert!(m.get(1).is_none(), "the oldest went");
        assert!(m.get(2).is_some() && m.get(3).is_some());
        assert_eq!(m.tokens, MEMO_TOKENS);
        m.put(4, vec![0; MEMO_TOKENS + 1].into());
        assert!(m.get(4).is_none(), "larger than the memo: not kept");
    }

    #[test]
    fn chats_are_rendered_with_the_template() {
        let t = RealText::builtin().unwrap();
        let body = json!({"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"date_string": "1 Jan 2026"}});
        let ids = t.chat(&body, 0).unwrap();
        let no_prompt = json!({"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"date_string": "1 Jan 2026"}, "add_generation_prompt": false});
        let shorter = t.chat(&no_prompt, 0).unwrap();
        assert!(ids.starts_with(&shorter) && ids.len() > shorter.len());
        let bad = json!({"messages": [{"role": "robot", "content": "hi"}]});
        assert!(t.chat(&bad, 0).unwrap_err().contains("not supported"));
    }
}
