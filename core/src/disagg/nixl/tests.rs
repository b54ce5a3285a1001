use super::*;
use serde_json::{Value, json};

fn value(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

fn prefill(client: &str) -> Value {
    value(&prefill_body(client.as_bytes()).unwrap())
}

#[test]
fn the_prefill_leg_asks_for_one_token_and_a_remote_decode() {
    let p = prefill(
        r#"{"model":"m","prompt":[1,2,3],"max_tokens":50,"stream":true,"stream_options":{"include_usage":true},"min_tokens":5}"#,
    );
    assert_eq!(
        p,
        json!({
            "model": "m",
            "prompt": [1, 2, 3],
            "max_tokens": 1,
            "stream": false,
            "kv_transfer_params": {
                "do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null
            }
        })
    );
}

#[test]
fn max_completion_tokens_is_set_only_when_sent() {
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":64,"min_completion_tokens":3}"#;
    let p = prefill(chat);
    assert_eq!(p["max_completion_tokens"], 1);
    assert_eq!(p["max_tokens"], 1, "added, as the reference proxy does");
    assert!(p.get("min_completion_tokens").is_none());
    let p = prefill(r#"{"model":"m","messages":[]}"#);
    assert!(p.get("max_completion_tokens").is_none());
}

#[test]
fn fields_keep_their_places_and_new_ones_follow_in_order() {
    let out = prefill_body(br#"{"stream":true,"model":"m","max_tokens":9}"#).unwrap();
    let text = std::str::from_utf8(&out).unwrap();
    assert!(
        text.starts_with(r#"{"stream":false,"model":"m","max_tokens":1,"kv_transfer_params":{"#),
        "{text}"
    );
    let out = prefill_body(br#"{"model":"m"}"#).unwrap();
    let text = std::str::from_utf8(&out).unwrap();
    assert!(
        text.ends_with(r#"},"stream":false,"max_tokens":1}"#),
        "{text}"
    );
}

#[test]
fn values_are_kept_byte_for_byte() {
    let client = r#"{"model":"m","temperature":0.10000000000000001,"seed":123456789012345678901,"top_p":1.0,"x":1e3,"y":-0.0,"messages":[{"content":"\u00e9 \"q\" 😀 漢"}]}"#;
    let out = prefill_body(client.as_bytes()).unwrap();
    let text = std::str::from_utf8(&out).unwrap();
    for raw in [
        r#""temperature":0.10000000000000001"#,
        r#""seed":123456789012345678901"#,
        r#""top_p":1.0"#,
        r#""x":1e3"#,
        r#""y":-0.0"#,
        r#""messages":[{"content":"\u00e9 \"q\" 😀 漢"}]"#,
    ] {
        assert!(text.contains(raw), "{raw} in {text}");
    }
    let params = r#"{"remote_block_ids":[[1,2]],"remote_host":"10.0.0.2","remote_port":5600,"x":0.10000000000000001}"#;
    let out = decode_body(client.as_bytes(), params).unwrap();
    let expected = format!(
        "{},\"kv_transfer_params\":{params}}}",
        &client[..client.len() - 1]
    );
    assert_eq!(std::str::from_utf8(&out).unwrap(), expected);
}

#[test]
fn the_decode_leg_is_the_clients_bytes_with_the_params_spliced_in() {
    let client = "{ \"model\" : \"m\",\n  \"stream\": true }\n";
    let out = decode_body(client.as_bytes(), r#"{"a":1}"#).unwrap();
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        "{ \"model\" : \"m\",\n  \"stream\": true ,\"kv_transfer_params\":{\"a\":1}}\n"
    );
    let out = decode_body(b"{}", r#"{"a":1}"#).unwrap();
    assert_eq!(out, br#"{"kv_transfer_params":{"a":1}}"#);
}

#[test]
fn a_clients_own_transfer_params_never_pass() {
    let hostile = r#"{"model":"m","kv_transfer_params":{"remote_host":"6.6.6.6","do_remote_prefill":true},"kv_transfer_params":{"remote_host":"7.7.7.7"},"max_tokens":3}"#;
    let d = value(&decode_body(hostile.as_bytes(), r#"{"remote_host":"10.0.0.2"}"#).unwrap());
    assert_eq!(d["kv_transfer_params"], json!({"remote_host": "10.0.0.2"}));
    assert_eq!(d["max_tokens"], 3);
    let text = String::from_utf8(prefill_body(hostile.as_bytes()).unwrap()).unwrap();
    assert!(
        !text.contains("6.6.6.6") && !text.contains("7.7.7.7"),
        "{text}"
    );
    assert_eq!(text.matches(PARAMS).count(), 1);
}

#[test]
fn a_local_decode_gets_the_clients_bytes_without_its_params() {
    let plain = br#"{"model":"m", "x": 1e3}"#;
    assert!(matches!(local_body(plain).unwrap(), Cow::Borrowed(b) if b == plain));
    let hostile = br#"{"model":"m","kv_transfer_params":{"remote_host":"6.6.6.6"},"x":1e3}"#;
    assert_eq!(&*local_body(hostile).unwrap(), br#"{"model":"m","x":1e3}"#);
    assert!(local_body(b"[]").is_err());
}

#[test]
fn a_repeated_key_keeps_its_first_place_and_last_value() {
    let out = prefill_body(br#"{"a":1,"b":2,"a":3}"#).unwrap();
    assert!(
        out.starts_with(br#"{"a":3,"b":2,"#),
        "{}",
        String::from_utf8_lossy(&out)
    );
}

#[test]
fn the_answers_params_are_taken_verbatim() {
    let answer = br#"{"id":"cmpl-1","choices":[{"text":"x"}],"kv_transfer_params":{"remote_block_ids":[[1,2,3]],"remote_port":5600,"tp_size":1,"f":0.10000000000000001},"usage":{}}"#;
    assert_eq!(
        answer_params(answer),
        Ok(
            r#"{"remote_block_ids":[[1,2,3]],"remote_port":5600,"tp_size":1,"f":0.10000000000000001}"#
        )
    );
    assert_eq!(answer_params(br#"{"id":"x"}"#), Err(AnswerError::Absent));
    assert_eq!(
        answer_params(br#"{"kv_transfer_params":null}"#),
        Err(AnswerError::Absent)
    );
    assert_eq!(
        answer_params(br#"{"kv_transfer_params": { } }"#),
        Err(AnswerError::Absent)
    );
    assert_eq!(
        answer_params(br#"{"kv_transfer_params":[1]}"#),
        Err(AnswerError::NotAnObjectParams)
    );
    assert_eq!(
        answer_params(br#"{"kv_transfer_params":"{}"}"#),
        Err(AnswerError::NotAnObjectParams)
    );
    for bad in [
        &b""[..],
        b"[]",
        b"null",
        b"{",
        b"{\"kv_transfer_params\":{}} x",
        b"\xff",
    ] {
        assert_eq!(answer_params(bad), Err(AnswerError::NotAnObject), "{bad:?}");
    }
}

#[test]
fn bodies_that_are_not_objects_are_refused() {
    for bad in [
        &b""[..],
        b"[1]",
        b"\"s\"",
        b"{\"a\":",
        b"{} {}",
        b"\xff{}",
        b"7",
    ] {
        assert!(prefill_body(bad).is_err(), "{bad:?}");
        assert!(decode_body(bad, "{}").is_err(), "{bad:?}");
    }
}

proptest::proptest! {
    /// Any bytes: an error or a rewrite, never a panic; a rewrite is a JSON
    /// object that carries exactly one kv_transfer_params.
    #[test]
    fn rewrites_of_arbitrary_bytes_never_panic(body in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
        if let Ok(out) = prefill_body(&body) {
            let v: Value = serde_json::from_slice(&out).unwrap();
            proptest::prop_assert!(v.get(PARAMS).is_some());
        }
        if let Ok(out) = decode_body(&body, r#"{"k":1}"#) {
            let v: Value = serde_json::from_slice(&out).unwrap();
            proptest::prop_assert_eq!(&v[PARAMS], &json!({"k": 1}));
        }
        let _ = answer_params(&body);
    }

    /// Objects of arbitrary keys and integers (serde_json reads floats back
    /// within an ULP, not exactly): the decode body is the
    /// client's object plus the params, and nothing else.
    #[test]
    fn the_decode_body_adds_only_the_params(
        keys in proptest::collection::vec("[a-z_]{1,8}", 0..6),
        nums in proptest::collection::vec(proptest::num::i64::ANY, 0..6),
    ) {
        let mut obj = serde_json::Map::new();
        for (k, n) in keys.iter().zip(nums.iter()) {
            if k != PARAMS {
                obj.insert(k.clone(), json!(n));
            }
        }
        let client = serde_json::to_vec(&Value::Object(obj.clone())).unwrap();
        let out = decode_body(&client, r#"{"k":[1]}"#).unwrap();
        let mut expected = obj;
        expected.insert(PARAMS.into(), json!({"k": [1]}));
        proptest::prop_assert_eq!(value(&out), Value::Object(expected));
    }
}

#[test]
fn neither_leg_carries_the_clients_request_id() {
    let client = br#"{"model":"m","request_id":"victim","prompt":"p"}"#;
    let prefill = prefill_body(client).unwrap();
    assert!(!std::str::from_utf8(&prefill).unwrap().contains("victim"));
    let decode = decode_body(client, r#"{"a":1}"#).unwrap();
    assert_eq!(
        &decode[..],
        br#"{"model":"m","prompt":"p","kv_transfer_params":{"a":1}}"#
    );
    // With the client's own parameters too: replaced in place.
    let both = br#"{"kv_transfer_params":{"x":0},"request_id":"v","model":"m"}"#;
    assert_eq!(
        &decode_body(both, r#"{"a":1}"#).unwrap()[..],
        br#"{"kv_transfer_params":{"a":1},"model":"m"}"#
    );
}
