//! `disagg::nixl` against vLLM's reference proxy, recorded
//! (`fixtures/README.md`): for each client body, the prefill body, the
//! transfer taken from the prefill answer, and the decode body must be
//! what the proxy sent, as JSON (the proxy re-serialises numbers; kvgate
//! keeps the client's bytes).

use kvgate_core::disagg::nixl::{
    AnswerError, answer_params, decode_body, local_body, prefill_body,
};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
struct Case {
    name: String,
    client_body: String,
    prefill_answer_status: Option<u16>,
    prefill_answer: Option<String>,
    prefill_body: Option<String>,
    decode_body: Option<String>,
    same_request_id: Option<bool>,
}

fn cases() -> Vec<Case> {
    let text = include_str!("fixtures/vllm-nixl-proxy.json");
    serde_json::from_str(text).expect("the fixture file is JSON")
}

fn json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).expect("JSON")
}

/// JSON equality with numbers compared by value: Python writes the
/// integer `-0` as `0`, which serde_json reads as a different number.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x == y || x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

fn assert_same(ours: &Value, expected: &Value, name: &str) {
    assert!(
        same(ours, expected),
        "{name}:\n  ours: {ours}\n  proxy: {expected}"
    );
}

/// The client sent `kv_transfer_params` of its own: kvgate never passes
/// them on, where the proxy does when the prefill hands over nothing.
fn client_sent_params(c: &Case) -> bool {
    serde_json::from_str::<Value>(&c.client_body)
        .is_ok_and(|v| v.get("kv_transfer_params").is_some())
}

#[test]
fn the_fixture_covers_the_protocol() {
    let cases = cases();
    assert_eq!(cases.len(), 24);
    assert!(cases.iter().filter(|c| c.decode_body.is_some()).count() >= 20);
    assert!(
        cases
            .iter()
            .filter(|c| c.decode_body.is_some())
            .all(|c| c.same_request_id == Some(true)),
        "both legs carry one request id"
    );
}

#[test]
fn prefill_bodies_match_the_reference_proxy() {
    for c in cases() {
        let Some(expected) = &c.prefill_body else {
            // The proxy refused the body (NaN, 1e400) before either leg.
            continue;
        };
        let ours =
            prefill_body(c.client_body.as_bytes()).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        assert_same(&json(&ours), &json(expected.as_bytes()), &c.name);
    }
}

#[test]
fn decode_bodies_match_the_reference_proxy() {
    let mut checked = 0;
    for c in cases() {
        let (Some(expected), Some(answer)) = (&c.decode_body, &c.prefill_answer) else {
            continue;
        };
        assert_eq!(c.prefill_answer_status, Some(200), "{}", c.name);
        let client = c.client_body.as_bytes();
        let ours = match answer_params(answer.as_bytes()) {
            Ok(params) => decode_body(client, params).unwrap(),
            // No field, `null` or `{}`: nothing to hand over, and the
            // decode worker prefills.
            Err(AnswerError::Absent) => local_body(client).unwrap().into_owned(),
            Err(e) => panic!("{}: {e}", c.name),
        };
        let mut expected = json(expected.as_bytes());
        let no_transfer = answer_params(answer.as_bytes()).is_err();
        if no_transfer && client_sent_params(&c) {
            // The proxy lets the client's own transfer through; kvgate
            // does not.
            let obj = expected.as_object_mut().unwrap();
            assert!(obj.remove("kv_transfer_params").is_some(), "{}", c.name);
        }
        assert_same(&json(&ours), &expected, &c.name);
        checked += 1;
    }
    assert!(checked >= 20, "{checked}");
}

#[test]
fn a_failed_prefill_calls_no_decode() {
    let cases = cases();
    let failed = cases
        .iter()
        .find(|c| c.prefill_answer_status == Some(500))
        .expect("a case where the prefill answers 500");
    assert!(failed.decode_body.is_none());
}
