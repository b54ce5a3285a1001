//! kvgate against what the engines' own libraries compute, for the chat
//! templates and tokenizers in `tests/fixtures/chat` (generated with
//! HuggingFace `transformers` and `tokenizers`; see its README):
//!
//! * the filter's renderer produces the engine's prompt text, byte for byte;
//! * the sidecar's vocabulary decodes the engine's token ids back to that
//!   text, so the text index keys what the filter keys;
//! * a completion prompt gets the special tokens the tokenizer adds.

use kvgate_core::hash::CacheScope;
use kvgate_core::text::{Cursor, prefix_keys};
use kvgate_sidecar::prompt::{Prompt, PromptConfig};
use serde_json::Value;
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat")
}

fn cases() -> Vec<Value> {
    let bytes = std::fs::read(dir().join("reference.json")).unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let cases = v["cases"].as_array().unwrap().clone();
    assert!(cases.len() >= 20, "the reference lost its cases");
    cases
}

fn prompt(case: &Value) -> Prompt {
    let config = PromptConfig {
        tokenizer: dir().join(case["tokenizer"].as_str().unwrap()),
        tokenizer_config: Some(dir().join(case["tokenizer_config"].as_str().unwrap())),
        chat_template: None,
    };
    Prompt::load("m", &config).unwrap()
}

fn ids(case: &Value) -> Vec<u32> {
    case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn rendered_chats_equal_transformers_text() {
    let mut chats = 0;
    for case in cases() {
        if case["messages"].is_null() {
            continue;
        }
        let p = prompt(&case);
        let r = kvgate_core::text::template::Renderer::new(p.template.clone()).unwrap();
        let tools = Some(&case["tools"]).filter(|t| !t.is_null());
        let text = r
            .chat(
                &case["messages"],
                tools,
                case["chat_template_kwargs"].as_object(),
                0,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", case["name"]));
        assert_eq!(text, case["text"].as_str().unwrap(), "{}", case["name"]);
        chats += 1;
    }
    assert!(chats >= 16);
}

/// The filter assembles most chats from their shape's skeleton instead of
/// running the template: every case, rendered through one cache per
/// template as a router VM does (so later cases reuse earlier shapes, and
/// each case is rendered a second time from its own), is still the text
/// `transformers` rendered.
#[test]
fn chats_assembled_from_skeletons_equal_transformers_text() {
    let mut renderers: std::collections::HashMap<String, kvgate_core::text::template::Renderer> =
        Default::default();
    let mut assembled = 0;
    for case in cases() {
        if case["messages"].is_null() {
            continue;
        }
        let r = renderers
            .entry(case["tokenizer_config"].as_str().unwrap().to_string())
            .or_insert_with(|| {
                kvgate_core::text::template::Renderer::new(prompt(&case).template).unwrap()
            });
        let tools = Some(&case["tools"]).filter(|t| !t.is_null());
        let kwargs = case["chat_template_kwargs"].as_object();
        for _ in 0..2 {
            let (text, path) = r
                .chat_cached(&case["messages"], tools, kwargs, 0)
                .unwrap_or_else(|e| panic!("{}: {e}", case["name"]));
            assert_eq!(text, case["text"].as_str().unwrap(), "{}", case["name"]);
            if path == kvgate_core::text::skeleton::Path::Skeleton {
                assembled += 1;
            }
        }
    }
    // Plain chats of both templates take the skeleton; tools, content
    // parts of the Llama-style template and padded contents do not.
    assert!(assembled >= 10, "{assembled}");
}

#[test]
fn completion_prompts_get_the_tokenizers_special_tokens() {
    for case in cases() {
        let Some(prompt_text) = case["prompt"].as_str() else {
            continue;
        };
        let p = prompt(&case);
        let r = kvgate_core::text::template::Renderer::new(p.template.clone()).unwrap();
        assert_eq!(
            r.completion(prompt_text),
            case["text"].as_str().unwrap(),
            "{}",
            case["name"]
        );
    }
}

#[test]
fn engine_tokens_decode_to_the_rendered_text_in_blocks_of_any_size() {
    for case in cases() {
        let p = prompt(&case);
        let (text, ids) = (case["text"].as_str().unwrap(), ids(&case));
        let mut bytes = Vec::new();
        assert!(p.vocab.decode_into(&ids, &mut bytes), "{}", case["name"]);
        assert_eq!(String::from_utf8(bytes).unwrap(), text, "{}", case["name"]);
        // What the sidecar keys from the engine's blocks is what the
        // filter keys from the text, wherever the blocks end.
        let want = prefix_keys(text, CacheScope::default());
        for block in [1, 16, 64] {
            let mut cursor = Cursor::root(CacheScope::default());
            let mut keys = Vec::new();
            let mut buf = Vec::new();
            for chunk in ids.chunks(block) {
                buf.clear();
                assert!(p.vocab.decode_into(chunk, &mut buf));
                cursor.feed(&buf, &mut keys);
            }
            assert_eq!(keys, want, "{} in blocks of {block}", case["name"]);
        }
    }
}

#[test]
fn model_files_are_checked_at_load() {
    let bad = |config: PromptConfig| match Prompt::load("m", &config) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    };
    let tok = dir().join("llama3-style.tokenizer.json");
    let e = bad(PromptConfig {
        tokenizer: tok.clone(),
        tokenizer_config: None,
        chat_template: None,
    });
    assert!(e.contains("no chat template"), "{e}");
    let e = bad(PromptConfig {
        tokenizer: dir().join("missing.json"),
        tokenizer_config: None,
        chat_template: Some(dir().join("llama3-style.jinja")),
    });
    assert!(e.contains("missing.json"), "{e}");
    let broken = std::env::temp_dir().join(format!("kvgate-broken-{}.jinja", std::process::id()));
    std::fs::write(&broken, "{% for m in messages %}{{ m.content }}").unwrap();
    let e = bad(PromptConfig {
        tokenizer: tok,
        tokenizer_config: None,
        chat_template: Some(broken.clone()),
    });
    let _ = std::fs::remove_file(&broken);
    assert!(e.contains("does not compile"), "{e}");
}
