//! `/v1/completions`' `prompt`: the shapes routing accepts, and why it
//! refuses the others.
//!
//! The body reader ([`super::scan`]) checks the prompt's shape as it reads
//! it. A shape it refuses is a value, not a parse error, so that the
//! client hears which rule the prompt broke. The serde_json visitor it
//! replaced stays here, in tests, as the reference it must agree with.

#[cfg(test)]
use super::estimate_tokens;
#[cfg(test)]
use serde::Deserializer;
#[cfg(test)]
use serde::de::{self, IgnoredAny, SeqAccess, Visitor};
#[cfg(test)]
use std::fmt;

/// The prompt as routing reads it: the first prompt of a batch and the
/// batch's length in tokens (estimated for text).
#[derive(Debug, PartialEq)]
pub(super) enum Prompt {
    Text {
        first: String,
        isl_tokens: u64,
    },
    Tokens {
        first: Vec<u32>,
        isl_tokens: u64,
    },
    /// Why the prompt is refused.
    Invalid(&'static str),
}

#[cfg(test)]
impl<'de> de::Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Prompt, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

pub(super) const NOT_TOKENS: &str =
    "'prompt' must contain token ids (integers from 0 to 4294967295)";
pub(super) const WRONG_TYPE: &str = "'prompt' must be a string, a list of strings, or token ids";

#[cfg(test)]
struct PromptVisitor;

#[cfg(test)]
impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text {
            first: s.to_owned(),
            isl_tokens: estimate_tokens(s),
        })
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Prompt, E> {
        let isl_tokens = estimate_tokens(&s);
        Ok(Prompt::Text {
            first: s,
            isl_tokens,
        })
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Prompt, E> {
        Ok(Prompt::Invalid(WRONG_TYPE))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Prompt, E> {
        Ok(Prompt::Invalid(WRONG_TYPE))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Prompt, E> {
        Ok(Prompt::Invalid(WRONG_TYPE))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Prompt, E> {
        Ok(Prompt::Invalid(WRONG_TYPE))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Prompt, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Prompt::Invalid(WRONG_TYPE))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let Some(first) = seq.next_element::<Item>()? else {
            return Ok(Prompt::Invalid("'prompt' must not be empty"));
        };
        let refused = match first {
            Item::Token(t) => {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(1024).min(1 << 20));
                ids.push(t);
                loop {
                    match seq.next_element::<Item>()? {
                        None => {
                            let isl_tokens = ids.len() as u64;
                            return Ok(Prompt::Tokens {
                                first: ids,
                                isl_tokens,
                            });
                        }
                        Some(Item::Token(t)) => ids.push(t),
                        Some(_) => break NOT_TOKENS,
                    }
                }
            }
            Item::Text(first) => {
                let mut isl_tokens = estimate_tokens(&first);
                loop {
                    match seq.next_element::<Item>()? {
                        None => return Ok(Prompt::Text { first, isl_tokens }),
                        Some(Item::Text(s)) => isl_tokens += estimate_tokens(&s),
                        Some(_) => break "'prompt' must not mix strings and other values",
                    }
                }
            }
            Item::List(Ok(first)) => {
                let mut isl_tokens = first.len() as u64;
                loop {
                    match seq.next_element::<Item>()? {
                        None => return Ok(Prompt::Tokens { first, isl_tokens }),
                        Some(Item::List(Ok(l))) => isl_tokens += l.len() as u64,
                        Some(Item::List(Err(why))) => break why,
                        Some(_) => break "'prompt' must not mix token lists and other values",
                    }
                }
            }
            Item::List(Err(why)) => why,
            Item::Other => NOT_TOKENS,
        };
        // The body must still be read to its end to be valid JSON.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Prompt::Invalid(refused))
    }
}

#[cfg(test)]
/// One element of a prompt list.
enum Item {
    Token(u32),
    Text(String),
    /// A token list of a batch, or why it is refused.
    List(Result<Vec<u32>, &'static str>),
    Other,
}

#[cfg(test)]
impl<'de> de::Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Item, D::Error> {
        d.deserialize_any(ItemVisitor)
    }
}

#[cfg(test)]
struct ItemVisitor;

#[cfg(test)]
impl<'de> Visitor<'de> for ItemVisitor {
    type Value = Item;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id, a string or a token list")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
        Ok(u32::try_from(v).map_or(Item::Other, Item::Token))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
        Ok(u32::try_from(v).map_or(Item::Other, Item::Token))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Item, E> {
        Ok(Item::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Item, E> {
        Ok(Item::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Item, E> {
        Ok(Item::Other)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Item, E> {
        Ok(Item::Text(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Item, E> {
        Ok(Item::Text(s))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Item::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        let mut ids = Vec::new();
        let mut refused = None;
        while let Some(t) = seq.next_element::<Item>()? {
            match t {
                Item::Token(t) if refused.is_none() => ids.push(t),
                Item::Token(_) => {}
                _ => refused = Some(NOT_TOKENS),
            }
        }
        Ok(Item::List(match refused {
            Some(why) => Err(why),
            None if ids.is_empty() => Err("'prompt' must not contain an empty token list"),
            None => Ok(ids),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt as the body reader reads it, checked against the
    /// serde_json visitor it replaced.
    fn read(json: &str) -> Prompt {
        let p = super::super::scan::prompt_value(json).unwrap().unwrap();
        assert_eq!(p, serde_json::from_str::<Prompt>(json).unwrap(), "{json}");
        p
    }

    #[test]
    fn every_shape_in_one_pass() {
        assert_eq!(
            read("[1, 2 ,3]"),
            Prompt::Tokens {
                first: vec![1, 2, 3],
                isl_tokens: 3
            }
        );
        assert_eq!(
            read("[[1],[2,3]]"),
            Prompt::Tokens {
                first: vec![1],
                isl_tokens: 3
            }
        );
        assert_eq!(
            read(r#"["abcd","efgh"]"#),
            Prompt::Text {
                first: "abcd".into(),
                isl_tokens: 2
            }
        );
        assert_eq!(
            read(r#""a\"b""#),
            Prompt::Text {
                first: "a\"b".into(),
                isl_tokens: 1
            }
        );
    }

    #[test]
    fn refused_shapes_say_why_and_read_to_the_end() {
        for (json, why) in [
            ("[]", "must not be empty"),
            ("[1,2.5]", "token ids"),
            ("[1,-2]", "token ids"),
            ("[4294967296]", "token ids"),
            ("[1,\"a\"]", "token ids"),
            ("[[1],[[2]]]", "token ids"),
            ("[[1],[]]", "empty token list"),
            ("[[1],2]", "mix token lists"),
            (r#"["a",[1]]"#, "mix strings"),
            (r#"[{"a":[1,2]},1]"#, "token ids"),
            (r#"{"a":1}"#, "a string, a list of strings, or token ids"),
            ("true", "a string, a list of strings, or token ids"),
            ("7", "a string, a list of strings, or token ids"),
        ] {
            // Followed by another field: the refusal must not stop the
            // read of the body mid-value.
            let body = format!(r#"{{"p":{json},"q":1}}"#);
            #[derive(serde::Deserialize)]
            struct B {
                p: Prompt,
                q: u32,
            }
            let b: B = serde_json::from_str(&body).unwrap();
            assert_eq!(b.q, 1, "{json}");
            assert_eq!(Some(&b.p), read_in_body(json).as_ref(), "{json}");
            match b.p {
                Prompt::Invalid(m) => assert!(m.contains(why), "{json}: {m}"),
                other => panic!("{json} read as {other:?}"),
            }
        }
    }

    /// The prompt of a body with a field after it, read to its end.
    fn read_in_body(json: &str) -> Option<Prompt> {
        let body = format!(r#"{{"prompt":{json},"q":1}}"#);
        super::super::scan::fields(body.as_bytes()).unwrap().prompt
    }

    #[test]
    fn bad_json_is_still_a_syntax_error() {
        for json in [
            "[1,2",
            "[1,,2]",
            "[1 2]",
            "[01]",
            "[1.]",
            "[-]",
            r#"["\x"]"#,
        ] {
            assert!(serde_json::from_str::<Prompt>(json).is_err(), "{json}");
            assert!(super::super::scan::prompt_value(json).is_err(), "{json}");
        }
    }
}
