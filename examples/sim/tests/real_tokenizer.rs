//! The simulator tokenizes text as the engine it stands in for: the token
//! ids in its KV events are those `transformers` computes for the same
//! request (`tests/fixtures/chat/reference.json`).

use kvgate_sim::tokenizer::RealText;
use serde_json::{Value, json};
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat")
}

#[test]
fn chat_and_completion_ids_equal_the_engines() {
    let v: Value =
        serde_json::from_slice(&std::fs::read(dir().join("reference.json")).unwrap()).unwrap();
    let mut checked = 0;
    for case in v["cases"].as_array().unwrap() {
        let text = RealText::load(
            &dir().join(case["tokenizer"].as_str().unwrap()),
            Some(&dir().join(case["tokenizer_config"].as_str().unwrap())),
            None,
        )
        .unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        let got = match case["prompt"].as_str() {
            Some(p) => text.prompt(p).unwrap(),
            None => {
                let body = json!({
                    "messages": case["messages"],
                    "tools": case["tools"],
                    "chat_template_kwargs": case["chat_template_kwargs"],
                });
                text.chat(&body, 0).unwrap()
            }
        };
        assert_eq!(got, want, "{}", case["name"]);
        checked += 1;
    }
    assert!(checked >= 20);
}
