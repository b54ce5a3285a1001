//! A request body's admission fields: the client's `do_not_queue` and
//! `kvgate_class`, read (where the operator lets them count) and always
//! stripped before a worker sees the body, and vLLM's `priority`, set from
//! the class when configured.

use serde_json::Value;

/// Asks not to be held.
pub const DO_NOT_QUEUE: &str = "do_not_queue";
/// Names a class.
pub const CLASS: &str = "kvgate_class";
/// vLLM's request priority (lower is served first).
pub const PRIORITY: &str = "priority";

/// What a body said, and the body a worker gets instead, when it differs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Fields {
    pub do_not_queue: bool,
    pub class: Option<String>,
    pub rewritten: Option<Vec<u8>>,
}

/// Reads and strips the admission fields of `body`, and sets vLLM's
/// `priority` to `priority` when given. A body that names neither field
/// (found without parsing) and needs no priority is left as it is; one
/// that is not a JSON object is left for the worker to refuse.
pub fn take(body: &[u8], priority: Option<i64>) -> Fields {
    let names_one = contains(body, DO_NOT_QUEUE.as_bytes()) || contains(body, CLASS.as_bytes());
    if !names_one && priority.is_none() {
        return Fields::default();
    }
    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(body) else {
        return Fields::default();
    };
    let do_not_queue = matches!(map.remove(DO_NOT_QUEUE), Some(Value::Bool(true)));
    let class = match map.remove(CLASS) {
        Some(Value::String(s)) => Some(s),
        _ => None,
    };
    if let Some(p) = priority {
        map.insert(PRIORITY.into(), Value::from(p));
    }
    Fields {
        do_not_queue,
        class,
        rewritten: serde_json::to_vec(&Value::Object(map)).ok(),
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn fields_are_read_and_stripped() {
        let f = take(
            br#"{"model":"m","do_not_queue":true,"kvgate_class":"critical","prompt":"x"}"#,
            None,
        );
        assert!(f.do_not_queue);
        assert_eq!(f.class.as_deref(), Some("critical"));
        assert_eq!(
            json(&f.rewritten.unwrap()),
            json(br#"{"model":"m","prompt":"x"}"#)
        );
        // Neither field, no priority: untouched, unparsed.
        assert_eq!(take(br#"{"model":"m"}"#, None), Fields::default());
        // Not an object: left for the worker.
        assert_eq!(take(b"[\"do_not_queue\"]", None), Fields::default());
        // A field of the wrong type counts for nothing but still goes.
        let f = take(br#"{"do_not_queue":"yes","kvgate_class":7}"#, None);
        assert_eq!((f.do_not_queue, f.class), (false, None));
        assert_eq!(json(&f.rewritten.unwrap()), json(b"{}"));
    }

    #[test]
    fn the_class_priority_replaces_the_clients() {
        let f = take(br#"{"model":"m","priority":-100}"#, Some(2));
        assert_eq!(
            json(&f.rewritten.unwrap()),
            json(br#"{"model":"m","priority":2}"#)
        );
    }
}
