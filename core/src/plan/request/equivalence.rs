//! The body reader against the serde_json reader it replaced, kept here as
//! the reference: on any body both accept, the same [`Parsed`]; on any
//! other, an error from both, of the same kind.

use super::*;
use proptest::prelude::*;
use serde_json::value::RawValue;

/// The fields routing reads, each left as raw JSON by serde_json, the
/// prompt read by its visitor.
#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    cache_salt: Option<&'a RawValue>,
    prompt: Option<Prompt>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow)]
    add_generation_prompt: Option<&'a RawValue>,
}

pub(super) fn parse_reference(endpoint: Endpoint, body: &[u8]) -> Result<Parsed, BadRequest> {
    let f: Fields = match serde_json::from_slice(body) {
        Ok(f) => f,
        Err(e) if e.is_data() => {
            return match serde_json::from_slice::<Value>(body) {
                Ok(Value::Object(_)) => bad(format!("request body is ambiguous: {e}")),
                _ => bad("request body must be a JSON object"),
            };
        }
        Err(e) => return bad(format!("request body is not valid JSON: {e}")),
    };
    fn raw(r: Option<&RawValue>) -> Option<&str> {
        r.map(RawValue::get)
    }
    read(
        endpoint,
        scan::Fields {
            model: raw(f.model),
            stream: raw(f.stream),
            max_tokens: raw(f.max_tokens),
            max_completion_tokens: raw(f.max_completion_tokens),
            cache_salt: raw(f.cache_salt),
            prompt: f.prompt,
            messages: f.messages.map(|m| joined_from_tree(body, m.get())),
            tools: raw(f.tools),
            chat_template_kwargs: raw(f.chat_template_kwargs),
            add_generation_prompt: raw(f.add_generation_prompt),
        },
    )
}

/// The messages as serde_json builds them, joined from the tree: what
/// the body reader's own join replaced.
fn joined_from_tree(body: &[u8], json: &str) -> scan::Messages {
    // Where serde_json found them in the body.
    let at = json.as_ptr() as usize - body.as_ptr() as usize;
    let refused = |why: String| scan::Messages::Refused(why);
    let Ok(Value::Array(items)) = serde_json::from_str::<Value>(json) else {
        return refused(scan::NOT_A_LIST.into());
    };
    if items.is_empty() {
        return refused("'messages' must not be empty".into());
    }
    let mut joined = String::new();
    let mut turns = Some(Vec::new());
    for (i, msg) in items.iter().enumerate() {
        let Some(obj) = msg.as_object() else {
            return refused(format!("messages[{i}] must be an object"));
        };
        let Some(role) = obj.get("role").and_then(Value::as_str) else {
            return refused(format!("messages[{i}].role is required"));
        };
        let role_at = joined.len();
        joined.push_str(role);
        joined.push('\n');
        let content_at = joined.len();
        let plain = obj.len() == 2 && obj.get("content").is_some_and(Value::is_string);
        match obj.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => joined.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        joined.push_str(t);
                    }
                }
            }
            Some(_) => {
                return refused(format!(
                    "messages[{i}].content must be a string or a list of parts"
                ));
            }
        }
        let turn = Turn {
            role: role_at..content_at - 1,
            content: content_at..joined.len(),
        };
        match turns.as_mut() {
            Some(all) if plain => all.push(turn),
            _ => turns = None,
        }
        joined.push('\n');
    }
    scan::Messages::Read {
        json: at..at + json.len(),
        joined,
        turns,
    }
}

/// What an error is about: the body as a whole (its messages carry the
/// parser's own position, which differs), or the field it names.
fn kind(r: &Result<Parsed, BadRequest>) -> Option<String> {
    match r {
        Ok(_) => None,
        Err(BadRequest(m)) if m.starts_with("request body") => Some("body".into()),
        Err(BadRequest(m)) => Some(m.clone()),
    }
}

fn same(body: &str) {
    for e in [Endpoint::Completions, Endpoint::Chat] {
        let old = parse_reference(e, body.as_bytes());
        let new = parse(e, body.as_bytes());
        match (&old, &new) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{e:?} {body:?}"),
            _ => assert_eq!(kind(&old), kind(&new), "{e:?} {body:?}\n{old:?}\n{new:?}"),
        }
    }
}

fn ws() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec!["", "", " ", "\n\t ", "\r\n  "])
}

/// A JSON string, quoted, from characters written plainly or escaped in
/// every way JSON allows, lone surrogates included.
fn string() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        4 => prop::sample::select(vec!["a", "b", "model", "prompt", " ", "é", "日", "😀"])
            .prop_map(str::to_owned),
        1 => prop::sample::select(vec![
            "\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "\\u0041", "\\u00e9",
            "\\u65e5", "\\ud83d\\ude00", "\\uD83D\\uDE00", "\\ud800", "\\udc00", "\\ud800x",
            "\\ud800\\n", "\\ud800\\u0041",
        ])
        .prop_map(str::to_owned),
        // Runs of escapes, as Python's `json.dumps` writes text past ASCII,
        // and broken off.
        1 => prop::sample::select(vec![
            "\\u4f60\\u597D\\u0000\\uFFFF\\u0022",
            "\\u4f60\\ud83d\\ude00\\u597d",
            "\\u4f6", "\\u4f", "\\u", "\\u4f6g", "\\u4f60\\", "\\u4f60\\u",
        ])
        .prop_map(str::to_owned),
    ];
    prop::collection::vec(piece, 0..6).prop_map(|p| format!("\"{}\"", p.concat()))
}

/// Numbers in every form, token ids' edges among them; none past f64's
/// range (see `out_of_range_numbers`).
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => any::<u32>().prop_map(|n| n.to_string()),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        2 => prop::sample::select(vec![
            "0", "-0", "1", "4294967295", "4294967296", "18446744073709551616",
            "99999999999999999999999", "1.5", "1.0", "1e3", "1E+2", "2e-1", "-7", "0.0",
        ])
        .prop_map(str::to_owned),
    ]
}

fn value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        number(),
        string(),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            (prop::collection::vec((ws(), inner.clone(), ws()), 0..4)).prop_map(|v| {
                let items: Vec<String> = v
                    .into_iter()
                    .map(|(a, x, b)| a.to_owned() + &x + b)
                    .collect();
                format!("[{}]", items.join(","))
            }),
            (prop::collection::vec((string(), ws(), inner), 0..4)).prop_map(|v| {
                let items: Vec<String> = v
                    .into_iter()
                    .map(|(k, w, x)| format!("{k}{w}:{w}{x}"))
                    .collect();
                format!("{{{}}}", items.join(","))
            }),
        ]
    })
}

fn list(items: Vec<String>, w: &str) -> String {
    format!("[{w}{}{w}]", items.join(&format!("{w},{w}")))
}

/// Prompts of every shape routing accepts or refuses.
fn prompt() -> impl Strategy<Value = String> {
    let id = prop_oneof![8 => any::<u32>().prop_map(|n| n.to_string()), 1 => number()];
    let ids = (prop::collection::vec(id, 0..8), ws())
        .prop_map(|(v, w)| list(v, w))
        .boxed();
    prop_oneof![
        3 => ids.clone(),
        2 => string(),
        1 => (prop::collection::vec(string(), 0..4), ws()).prop_map(|(v, w)| list(v, w)),
        1 => (prop::collection::vec(ids, 0..4), ws()).prop_map(|(v, w)| list(v, w)),
        1 => (prop::collection::vec(value(), 0..4), ws()).prop_map(|(v, w)| list(v, w)),
        1 => value(),
    ]
}

/// Chat messages: members in any order, given twice or not at all, their
/// names sometimes escaped; contents as strings, part lists or anything.
fn messages() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        3 => prop::collection::vec(
            (prop::sample::select(vec![r#""text""#, r#""t\u0065xt""#, r#""type""#]),
             prop_oneof![3 => string(), 1 => value()]),
            0..3,
        )
        .prop_map(|m| {
            let m: Vec<String> = m.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
            format!("{{{}}}", m.join(","))
        }),
        1 => value(),
    ];
    let content = prop_oneof![
        3 => string(),
        2 => prop::collection::vec(part, 0..3).prop_map(|p| format!("[{}]", p.join(","))),
        1 => Just("null".to_owned()),
        1 => value(),
    ];
    let member = prop_oneof![
        3 => string().prop_map(|r| format!(r#""role":{r}"#)),
        1 => value().prop_map(|r| format!(r#""r\u006fle":{r}"#)),
        3 => content.prop_map(|c| format!(r#""content":{c}"#)),
        1 => (string(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
    ];
    let message = prop_oneof![
        6 => (prop::collection::vec(member, 0..4), ws())
            .prop_map(|(m, w)| format!("{{{w}{}{w}}}", m.join(&format!("{w},{w}")))),
        1 => value(),
    ];
    prop_oneof![
        3 => (prop::collection::vec(message, 0..4), ws()).prop_map(|(v, w)| list(v, w)),
        1 => value(),
    ]
}

/// One member: a field routing reads, its name sometimes escaped, with a
/// value of the type it wants or of any; or some other field.
fn member() -> impl Strategy<Value = String> {
    let known = prop_oneof![
        4 => Just(r#""model""#.to_owned()),
        1 => Just(r#""mod\u0065l""#.to_owned()),
        1 => Just(r#""stream""#.to_owned()),
        1 => Just(r#""max_tokens""#.to_owned()),
        1 => Just(r#""max_completion_tokens""#.to_owned()),
        1 => Just(r#""cache_salt""#.to_owned()),
        1 => Just(r#""tools""#.to_owned()),
        1 => Just(r#""chat_template_kwargs""#.to_owned()),
        1 => Just(r#""add_generation_prompt""#.to_owned()),
    ];
    prop_oneof![
        3 => (known, prop_oneof![
            Just(r#""m""#.to_owned()), Just("true".to_owned()), Just("7".to_owned()),
            Just("{}".to_owned()), value()
        ]),
        4 => (prop_oneof![Just(r#""prompt""#.to_owned()), Just(r#""pr\u006fmpt""#.to_owned())], prompt()),
        3 => (Just(r#""messages""#.to_owned()), messages()),
        2 => (string(), value()),
    ]
    .prop_map(|(k, v)| format!("{k}:{v}"))
}

/// A body, then maybe damaged: cut short, a byte changed, or something
/// after its end.
fn body() -> impl Strategy<Value = String> {
    let whole = (
        Just(r#""model":"m""#.to_owned()),
        prop::collection::vec(member(), 0..6),
        ws(),
        any::<bool>(),
    )
        .prop_map(|(model, mut m, w, lead)| {
            if lead {
                m.insert(0, model);
            }
            format!("{w}{{{w}{}{w}}}{w}", m.join(&format!("{w},{w}")))
        });
    (
        whole,
        0..12u8,
        any::<prop::sample::Index>(),
        prop::sample::select(vec![",", "}", "]", "\"", "x", "1", " ", "-", "\\", "{}"]),
    )
        .prop_map(|(b, damage, at, junk)| {
            let cut = at.index(b.len() + 1);
            let cut = (0..=cut)
                .rev()
                .find(|&i| b.is_char_boundary(i))
                .unwrap_or(0);
            match damage {
                0 => b[..cut].to_owned(),
                1 => format!("{}{junk}{}", &b[..cut], &b[cut..]),
                2 => format!("{b}{junk}"),
                _ => b,
            }
        })
}

/// Long token lists, so that most ids are read eight bytes at a time:
/// ids of every length up to u32's and past it, with the endings and
/// the damage that must leave the fast path (a leading zero, a
/// fraction, an exponent, a sign), any spacing, and the list's end at
/// every distance from the body's end.
fn token_list() -> impl Strategy<Value = String> {
    let id = prop_oneof![
        8 => (0u32..10, any::<u32>()).prop_map(|(digits, n)| {
            u64::from(n).min(10u64.pow(digits) - 1).to_string()
        }),
        1 => prop::sample::select(vec![
            "0", "00", "01", "0000001", "12.5", "3e4", "3E+4", "7.", "-5", "-0",
            "4294967295", "4294967296", "12345678", "99999999", "1234567890123",
        ])
        .prop_map(str::to_owned),
    ];
    (
        prop::collection::vec((ws(), id, ws()), 1..40),
        ws(),
        prop::sample::select(vec!["}", ",\"stream\":true}", ",\"n\":[1, 2]}"]),
    )
        .prop_map(|(ids, w, tail)| {
            let items: Vec<String> = ids
                .into_iter()
                .map(|(before, id, after)| format!("{before}{id}{after}"))
                .collect();
            format!(
                "{{\"model\":\"m\",\"prompt\":[{w}{}]{tail}",
                items.join(",")
            )
        })
}

/// Token lists laid out as serde_json (",") or Python's `json.dumps`
/// (", ") writes them, each read by a loop of its own: mostly ids of one
/// to seven digits, some that leave the fast path, and now and then a gap
/// laid out otherwise, the first one included.
fn separated_token_list() -> impl Strategy<Value = String> {
    let id = prop_oneof![
        8 => (1u32..8, any::<u32>()).prop_map(|(digits, n)| {
            u64::from(n).min(10u64.pow(digits) - 1).to_string()
        }),
        1 => prop::sample::select(vec![
            "0", "01", "12.5", "3e4", "-5", "4294967295", "4294967296", "12345678",
        ])
        .prop_map(str::to_owned),
    ];
    let gap = prop_oneof![
        12 => Just(None),
        1 => prop::sample::select(vec![",", ", ", ",  ", " , ", ",\n", ", \t", ",,"]).prop_map(Some),
    ];
    (
        prop::sample::select(vec![",", ", "]),
        prop::collection::vec((id, gap), 1..60),
        prop::sample::select(vec!["]}", " ]}", ", ]}", "],\"stream\":true}"]),
    )
        .prop_map(|(sep, ids, tail)| {
            let mut list = String::new();
            for (k, (id, gap)) in ids.iter().enumerate() {
                if k > 0 {
                    list.push_str(gap.unwrap_or(sep));
                }
                list.push_str(id);
            }
            format!("{{\"model\":\"m\",\"prompt\":[{list}{tail}")
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn the_reader_agrees_with_serde_json(b in body()) {
        same(&b);
    }

    #[test]
    fn token_lists_read_eight_bytes_at_a_time_agree(b in token_list()) {
        same(&b);
    }

    #[test]
    fn token_lists_with_either_separator_agree(b in separated_token_list()) {
        same(&b);
    }

    /// Each string is checked where it is read or skipped, not the body
    /// up front: a byte that is not UTF-8 is refused wherever it lands.
    #[test]
    fn a_body_that_is_not_utf8_is_refused_wherever(
        b in prop_oneof![body(), token_list()],
        at in any::<prop::sample::Index>(),
        bad in prop::sample::select(vec![
            &[0xff][..], &[0xc3], &[0x80], &[0xed, 0xa0, 0x80], &[0xc0, 0xaf],
            &[0xf4, 0x90, 0x80, 0x80], &[0xe6, 0x97],
        ]),
    ) {
        // At a character's boundary the bytes are invalid whatever
        // stands beside them.
        let mut at = at.index(b.len() + 1);
        while !b.is_char_boundary(at) {
            at -= 1;
        }
        let mut bytes = b.into_bytes();
        bytes.splice(at..at, bad.iter().copied());
        for e in [Endpoint::Completions, Endpoint::Chat] {
            let got = parse(e, &bytes);
            prop_assert_eq!(kind(&got), Some("body".to_owned()), "{:?}", bytes);
        }
    }
}

#[test]
fn agree_on_chosen_bodies() {
    for b in [
        r#"{"model":"m","prompt":[0,4294967295]}"#,
        r#"{"model":"m","prompt":[1,4294967296]}"#,
        r#"{"model":"m","prompt":[1,-0]}"#,
        r#"{"model":"m","prompt":[1,1.0]}"#,
        r#"{"model":"m","prompt":[1,1e2]}"#,
        r#"{"model":"m","prompt":[1,01]}"#,
        r#"{"model":"m","prompt":[1,]}"#,
        r#"{"model":"m","prompt":[1 2]}"#,
        r#"{"model":"m","prompt":[[1],[["\ud800"]]]}"#,
        r#"{"model":"m","prompt":[[1],[{"a":"\ud800"}]]}"#,
        r#"{"model":"m","prompt":"\ud83d\ude00","x":"\udc00"}"#,
        r#"{"model":"m","prompt":"a\u0000b"}"#,
        "{\"model\":\"m\",\"prompt\":\"a\tb\"}",
        r#"{"model":"m","prompt":[1],"model":"n"}"#,
        r#"{"model":"m","prompt":null,"prompt":[1]}"#,
        r#"{"model":"m","x":1,"x":2,"prompt":[1]}"#,
        r#"{"model":"m","prompt":[1]} x"#,
        r#"{"model":"m","prompt":[1]}   "#,
        r#"{"model":"m","prompt":[1]"#,
        r#"{"model":"m","prompt":[1],}"#,
        r#"{"model":"m" "prompt":[1]}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"\u00e9"}],"tools":"\ud800"}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"hi"}],"prompt":[[1],[]]}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"\ud800"}]}"#,
        r#"{"messages":[{"role":"u","content":"hi"}] ,"model":"m"}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"hi"}]x}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"hi"}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"hi"},]}"#,
        r#"{"model":"m","messages":nul}"#,
        r#"{"model":"m","messages":null}"#,
        r#"{"model":"m","messages":[],"messages":[]}"#,
        r#"{"model":"m","messages":[{"role":"a","content":"x","role":"b","content":null}]}"#,
        r#"{"model":"m","messages":[{"content":"x","role":"a","role":7}]}"#,
        r#"{"model":"m","messages":[{"content":[{"text":"a","text":"b"},{"text":1},"c",{"x":{"text":"d"}},{"text":"e","text":null}],"role":"u"}]}"#,
        r#"{"model":"m","messages":[{"r\u006fle":"u","c\u006fntent":"\u00e9\ud83d\ude00"}]}"#,
        r#"{"model":"m","messages":[3,{"role":"u","content":"\udc00"}]}"#,
        r#"{"model":"m","messages":[3,{"role":"u","content":"x","n":1e400}]}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"x","n":[1e308,-1e-400,123456789012345678901234567890]}]}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"x","\ud800":1}]}"#,
        r#"{"model":"m","messages":[{"role":"u","content":{"text":"x"}}]}"#,
        r#"{"model":"m","messages":[{"role":"u"},{"content":"x"}]}"#,
        r#"{"model":"m","messages":[ { "role" : "u" , "content" : [ ] } ] }"#,
        r#"{"model":"m","messages":"\ud800"}"#,
        r#"{"model":"m","messages":[{"role":"u","content":"x"},nul]}"#,
        "",
        "  ",
        "[]",
        "3",
        "nul",
        "{}",
        r#"{"model":"m","prompt":[1],"n":{"a":[{"b":[]}],"c":[[],{}]}}"#,
    ] {
        same(b);
    }
}

#[test]
fn nesting_past_serde_jsons_bound_is_refused_where_it_was() {
    let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
    // The body's object is one level: a prompt nested 126 deep is 127.
    for n in [120, 125, 126, 127, 200] {
        same(&format!(r#"{{"model":"m","prompt":{}}}"#, deep(n)));
        same(&format!(r#"{{"model":"m","prompt":[[1],{}]}}"#, deep(n)));
    }
}

/// Where the reader is stricter than serde_json was, on purpose: bytes
/// that are not UTF-8 in a field routing skips, and nesting past
/// serde_json's bound there (it skipped without a bound, so a body of
/// brackets cost a pass at most, but nothing routes such a request).
#[test]
fn stricter_where_no_engine_would_accept() {
    let mut b = br#"{"model":"m","prompt":[1],"user":"x"}"#.to_vec();
    let at = b.len() - 3;
    b[at] = 0xff;
    assert!(parse_reference(Endpoint::Completions, &b).is_ok());
    let e = parse(Endpoint::Completions, &b).unwrap_err().0;
    assert!(e.contains("not valid JSON") && e.contains("UTF-8"), "{e}");

    let bomb = format!(
        r#"{{"model":"m","prompt":[1],"user":{}}}"#,
        "[".repeat(100_000) + &"]".repeat(100_000)
    );
    assert!(parse_reference(Endpoint::Completions, bomb.as_bytes()).is_ok());
    let e = parse(Endpoint::Completions, bomb.as_bytes()).unwrap_err().0;
    assert!(e.contains("recursion limit"), "{e}");

    // A chat's messages, which serde_json parses in place, keep the
    // bound the skipped fields have: 126 containers inside the body's.
    let deep = |n: usize| {
        format!(
            r#"{{"model":"m","messages":{}1{}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        )
    };
    let e = parse(Endpoint::Chat, deep(126).as_bytes()).unwrap_err().0;
    assert!(e.contains("messages[0] must be an object"), "{e}");
    for n in [127, 129, 100_000] {
        let e = parse(Endpoint::Chat, deep(n).as_bytes()).unwrap_err().0;
        assert!(e.contains("recursion limit"), "{n}: {e}");
    }
}

/// serde_json turned every number of a prompt item into a value, and
/// refused one past f64's range; the reader only checks its grammar. A
/// completion's prompt holding one is refused all the same (it is no
/// token id); a chat, which never reads `prompt`, is no longer refused
/// for it.
#[test]
fn out_of_range_numbers() {
    let b = r#"{"model":"m","prompt":[1e400],"messages":[{"role":"u","content":"x"}]}"#;
    assert!(
        parse(Endpoint::Completions, b.as_bytes())
            .unwrap_err()
            .0
            .contains("token ids")
    );
    assert!(parse_reference(Endpoint::Chat, b.as_bytes()).is_err());
    assert!(parse(Endpoint::Chat, b.as_bytes()).is_ok());
}
