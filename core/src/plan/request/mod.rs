//! OpenAI request bodies, as far as routing needs them.

#[cfg(test)]
mod equivalence;
mod prompt;
mod scan;

use crate::text::skeleton::Path;
use crate::text::template::{Renderer, TemplateError};
use prompt::Prompt;
use scan::{Messages, NOT_A_LIST, ScanError};
use serde::Deserialize;
use serde_json::{Map, Value};
use std::ops::Range;

/// The two inference endpoints kvgate routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// Matches a `:path`, ignoring the query string.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path.split('?').next().unwrap_or_default() {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::Chat),
            _ => None,
        }
    }
}

/// What routing needs from a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub model: String,
    /// The (first) prompt's token ids when the client sent tokens.
    pub tokens: Option<Vec<u32>>,
    /// The prompt text when it sent text: the chat messages concatenated,
    /// or once [`Parsed::render`] ran, the prompt exactly as the engine
    /// tokenizes it.
    pub text: Option<String>,
    /// `text` is the engine's prompt, rendered with the model's template:
    /// the engines' own KV events can be matched against it.
    pub rendered: bool,
    /// What a chat request's template renders, kept for [`Parsed::render`].
    pub chat: Option<ChatInput>,
    /// Sequence hashes the client computed itself (Dynamo's, at the
    /// workers' block size), as the selection API accepts; OpenAI bodies
    /// never carry them.
    pub sequence_hashes: Option<Vec<u64>>,
    /// Prompt length in tokens: exact for tokens, estimated for text.
    pub isl_tokens: u64,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    /// vLLM's `cache_salt`: the request may reuse only blocks cached
    /// under the same salt.
    pub cache_salt: Option<String>,
}

/// The parts of a chat body its template reads.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatInput {
    /// Where the messages' JSON stands in the body, checked to build: a
    /// tree of them is made only when the template must run, and nothing
    /// of them is copied before.
    pub messages: Range<usize>,
    /// Where each message's role and content stand in the joined text,
    /// when every message is a plain `{role, content}` of strings: what a
    /// chat assembled from its shape's skeleton reads.
    pub turns: Option<Vec<Turn>>,
    pub tools: Option<Value>,
    /// vLLM's `chat_template_kwargs` (`enable_thinking` and the like).
    pub kwargs: Option<Map<String, Value>>,
}

/// A plain message's role and content, as byte ranges of a chat's joined
/// text ([`Parsed::text`] before rendering).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub role: Range<usize>,
    pub content: Range<usize>,
}

impl Parsed {
    /// Replaces the approximate text with the prompt the engine will
    /// tokenize: the chat rendered with the model's template (from `body`,
    /// the one parsed, when the template must run), or a text
    /// completion behind the tokens its tokenizer adds. On an error the
    /// request keeps its approximate text (the engine will likely refuse
    /// it, but that is for the engine to say).
    /// Returns how a chat was rendered (`None` for a completion prompt).
    pub fn render(
        &mut self,
        r: &mut Renderer,
        body: &[u8],
        unix_s: u64,
    ) -> Result<Option<Path>, TemplateError> {
        let (text, path) = match (&self.chat, &self.text) {
            (Some(c), joined) => {
                let joined = joined.as_deref().unwrap_or_default();
                // Once rendered, the text is no longer what the turns index.
                let turns = c.turns.as_ref().filter(|_| !self.rendered);
                let turns: Option<Vec<(&str, &str)>> = turns.and_then(|turns| {
                    turns
                        .iter()
                        .map(|t| {
                            Some((joined.get(t.role.clone())?, joined.get(t.content.clone())?))
                        })
                        .collect()
                });
                let messages = || {
                    serde_json::from_slice(body.get(c.messages.clone()).unwrap_or_default())
                        .map_err(|e| TemplateError::Render(format!("messages: {e}")))
                };
                let (text, path) = r.chat_turns(
                    turns.as_deref(),
                    messages,
                    c.tools.as_ref(),
                    c.kwargs.as_ref(),
                    unix_s,
                )?;
                (text, Some(path))
            }
            (None, Some(_)) => {
                // In place: the prompt was read with room for the prefix,
                // so no second buffer of its size is touched.
                let mut text = self.text.take().unwrap_or_default();
                r.complete_in_place(&mut text);
                (text, None)
            }
            (None, None) => return Ok(None),
        };
        self.isl_tokens = estimate_tokens(&text);
        self.text = Some(text);
        self.rendered = true;
        Ok(path)
    }
}

/// Why a body is refused with 400; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest(pub String);

fn bad<T>(m: impl Into<String>) -> Result<T, BadRequest> {
    Err(BadRequest(m.into()))
}

/// Text length in tokens, estimated: about four bytes per token for
/// English under common BPE vocabularies. Only load accounting uses it.
pub fn estimate_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4).max(1)
}

/// A field's value as `T`; absent and `null` are `None`.
fn field<'a, T: Deserialize<'a>>(
    raw: Option<&'a str>,
    msg: impl FnOnce() -> String,
) -> Result<Option<T>, BadRequest> {
    match raw {
        None | Some("null") => Ok(None),
        Some(json) => serde_json::from_str(json)
            .map(Some)
            .map_err(|_| BadRequest(msg())),
    }
}

pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Parsed, BadRequest> {
    match scan::fields(body) {
        Ok(f) => read(endpoint, f),
        // An engine would read a repeated key differently, so it does
        // not route.
        Err(e @ ScanError::Duplicate(_)) => bad(format!("request body is ambiguous: {e}")),
        Err(ScanError::NotObject) => bad("request body must be a JSON object"),
        Err(e) => bad(format!("request body is not valid JSON: {e}")),
    }
}

/// Checks the fields routing reads and builds what it needs of them.
fn read(endpoint: Endpoint, f: scan::Fields) -> Result<Parsed, BadRequest> {
    let model: String = match field(f.model, || "'model' must be a non-empty string".into())? {
        Some(m) if !String::is_empty(&m) => m,
        Some(_) => return bad("'model' must be a non-empty string"),
        None => return bad("'model' is required"),
    };
    let stream = field(f.stream, || "'stream' must be a boolean".into())?.unwrap_or(false);
    let mut max_tokens = None;
    for (key, raw) in [
        ("max_tokens", f.max_tokens),
        ("max_completion_tokens", f.max_completion_tokens),
    ] {
        if let Some(n) = field(raw, || format!("'{key}' must be a non-negative integer"))? {
            max_tokens = Some(n);
        }
    }
    // vLLM refuses an empty or non-string salt; so does kvgate, rather
    // than route a request the engine will reject.
    let cache_salt = match field::<String>(f.cache_salt, || {
        "'cache_salt' must be a non-empty string".into()
    })? {
        Some(s) if s.is_empty() => return bad("'cache_salt' must be a non-empty string"),
        s => s,
    };
    let (tokens, text, isl_tokens, chat) = match endpoint {
        Endpoint::Completions => match f.prompt {
            None => return bad("'prompt' is required for /v1/completions"),
            Some(Prompt::Invalid(why)) => return bad(why),
            Some(Prompt::Text { first, isl_tokens }) => (None, Some(first), isl_tokens, None),
            Some(Prompt::Tokens { first, isl_tokens }) => {
                (Some(first), None, isl_tokens.max(1), None)
            }
        },
        Endpoint::Chat => {
            let (messages, text, turns) = match f.messages {
                Some(Messages::Read {
                    json,
                    joined,
                    turns,
                }) => (json, joined, turns),
                Some(Messages::Refused(why)) => return bad(why),
                None => return bad(NOT_A_LIST),
            };
            let n = estimate_tokens(&text);
            let tools: Option<Value> = field(f.tools, String::new).ok().flatten();
            let mut kwargs = match field::<Value>(f.chat_template_kwargs, || {
                "'chat_template_kwargs' must be an object".into()
            })? {
                None => None,
                Some(Value::Object(m)) => Some(m),
                Some(_) => return bad("'chat_template_kwargs' must be an object"),
            };
            // vLLM's own request field, handed to the template.
            if let Ok(Some(b)) = field::<bool>(f.add_generation_prompt, String::new) {
                kwargs
                    .get_or_insert_default()
                    .insert("add_generation_prompt".into(), Value::Bool(b));
            }
            let chat = ChatInput {
                messages,
                turns,
                tools,
                kwargs,
            };
            (None, Some(text), n, Some(chat))
        }
    };
    Ok(Parsed {
        model,
        tokens,
        text,
        rendered: false,
        chat,
        sequence_hashes: None,
        isl_tokens,
        stream,
        max_tokens,
        cache_salt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(e: Endpoint, body: &str) -> Parsed {
        parse(e, body.as_bytes()).unwrap()
    }

    fn err(e: Endpoint, body: &str) -> String {
        parse(e, body.as_bytes()).unwrap_err().0
    }

    #[test]
    fn paths() {
        assert_eq!(
            Endpoint::from_path("/v1/completions?x=1"),
            Some(Endpoint::Completions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions"),
            Some(Endpoint::Chat)
        );
        assert_eq!(Endpoint::from_path("/v1/models"), None);
        assert_eq!(Endpoint::from_path("/v1/completions/x"), None);
    }

    #[test]
    fn every_prompt_shape() {
        let p = ok(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"hello world!","stream":true,"max_tokens":5}"#,
        );
        assert_eq!(
            (p.text.as_deref(), p.isl_tokens, p.stream, p.max_tokens),
            (Some("hello world!"), 3, true, Some(5))
        );
        let p = ok(
            Endpoint::Completions,
            r#"{"model":"m","prompt":["abcd","efgh"]}"#,
        );
        assert_eq!((p.text.as_deref(), p.isl_tokens), (Some("abcd"), 2));
        let p = ok(Endpoint::Completions, r#"{"model":"m","prompt":[1,2,3]}"#);
        assert_eq!((p.tokens, p.isl_tokens), (Some(vec![1, 2, 3]), 3));
        let p = ok(
            Endpoint::Completions,
            r#"{"model":"m","prompt":[[1,2],[3,4,5]]}"#,
        );
        assert_eq!((p.tokens, p.isl_tokens), (Some(vec![1, 2]), 5));
        let p = ok(
            Endpoint::Chat,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":7}"#,
        );
        assert_eq!(p.text.as_deref(), Some("system\nbe brief\nuser\nhi\n"));
        assert_eq!(p.max_tokens, Some(7));
    }

    #[test]
    fn chat_keeps_what_its_template_reads() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}],
                "chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":false}"#;
        let p = ok(Endpoint::Chat, body);
        let c = p.chat.clone().unwrap();
        let messages: Value = serde_json::from_str(&body[c.messages]).unwrap();
        assert_eq!(messages[0]["content"], "hi");
        assert_eq!(c.tools.unwrap()[0]["type"], "function");
        let kw = c.kwargs.unwrap();
        assert_eq!(kw["enable_thinking"], false);
        assert_eq!(kw["add_generation_prompt"], false);
        assert!(!p.rendered);
        assert!(
            err(Endpoint::Chat, r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":3}"#)
                .contains("chat_template_kwargs")
        );
        assert!(
            ok(Endpoint::Completions, r#"{"model":"m","prompt":"x"}"#)
                .chat
                .is_none()
        );
    }

    #[test]
    fn render_replaces_the_approximate_text() {
        use crate::text::template::PromptTemplate;
        let mut r = Renderer::new(PromptTemplate {
            chat_template: "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                .into(),
            completion_prefix: "<s>".into(),
            ..Default::default()
        })
        .unwrap();
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let mut p = ok(Endpoint::Chat, body);
        p.render(&mut r, body.as_bytes(), 0).unwrap();
        assert_eq!((p.text.as_deref(), p.rendered), (Some("[user]hi"), true));
        let body = r#"{"model":"m","prompt":"abc"}"#;
        let mut p = ok(Endpoint::Completions, body);
        p.render(&mut r, body.as_bytes(), 0).unwrap();
        assert_eq!(p.text.as_deref(), Some("<s>abc"));
        let body = r#"{"model":"m","prompt":[1,2]}"#;
        let mut p = ok(Endpoint::Completions, body);
        p.render(&mut r, body.as_bytes(), 0).unwrap();
        assert!(!p.rendered, "token prompts are left alone");
    }

    /// A chat of plain messages is assembled from its turns once its
    /// shape's skeleton is built, without a tree of its messages: the same
    /// text the template gives. Any other chat runs the template.
    #[test]
    fn plain_chats_are_assembled_from_their_turns() {
        use crate::text::skeleton::Path;
        use crate::text::template::PromptTemplate;
        let mut r = Renderer::new(PromptTemplate {
            chat_template: "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                .into(),
            ..Default::default()
        })
        .unwrap();
        // The messages' JSON spoiled: a render that needs their tree fails.
        let render = |r: &mut Renderer, body: &str, spoil: bool| {
            let mut p = ok(Endpoint::Chat, body);
            let chat = p.chat.as_mut().unwrap();
            if spoil {
                chat.messages = 0..1;
            }
            let turns = chat.turns.as_ref().map(Vec::len);
            let path = p.render(r, body.as_bytes(), 0).map_err(|e| e.to_string())?;
            Ok::<_, String>((p.text.unwrap(), turns, path))
        };
        let plain = |q: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"be brief"}},{{"content":"{q}","role":"user"}}]}}"#
            )
        };
        // The first of a shape builds its skeleton from the tree.
        assert!(
            render(&mut r, &plain("hi"), true)
                .unwrap_err()
                .contains("messages")
        );
        let (text, turns, _) = render(&mut r, &plain("hi"), false).unwrap();
        assert_eq!(
            (text.as_str(), turns),
            ("<system>be brief\n<user>hi\n", Some(2))
        );
        // A key given twice is one member: still plain.
        let (text, _, path) = render(
            &mut r,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"x","role":"user","content":"why \"so\"?"}]}"#,
            true,
        )
        .unwrap();
        assert_eq!(text, "<system>be brief\n<user>why \"so\"?\n");
        assert_eq!(path, Some(Path::Skeleton));
        // Another member, or parts (which this template reads joined, so
        // its skeleton takes them): the tree is read.
        for (body, want, by) in [
            (
                r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi","name":"x"}]}"#,
                "<system>be brief\n<user>hi\n",
                Path::Template,
            ),
            (
                r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"text":"b"}]}]}"#,
                "<system>be brief\n<user>a\nb\n",
                Path::Skeleton,
            ),
        ] {
            assert!(render(&mut r, body, true).is_err(), "{body}");
            let (text, turns, path) = render(&mut r, body, false).unwrap();
            assert_eq!(
                (text.as_str(), turns, path),
                (want, None, Some(by)),
                "{body}"
            );
        }
        assert_eq!(r.skeleton_counts(), (1, 3));
        // Rendered again, a chat gives the same text: its turns indexed
        // the joined text, which rendering replaced.
        let again = plain("again");
        let mut p = ok(Endpoint::Chat, &again);
        p.render(&mut r, again.as_bytes(), 0).unwrap();
        let once = p.text.clone();
        p.render(&mut r, again.as_bytes(), 0).unwrap();
        assert_eq!(p.text, once);
    }

    #[test]
    fn reads_only_what_routing_needs() {
        // Fields routing does not read are skipped, however nested.
        let p = ok(
            Endpoint::Completions,
            r#"{"user":{"a":[1,{"b":null}]},"model":"m","logprobs":3,"prompt":[7,8,9],"n":2}"#,
        );
        assert_eq!((p.model.as_str(), p.tokens), ("m", Some(vec![7, 8, 9])));
        // A key given twice is read differently by different parsers: the
        // engine must not run a prompt or model other than the one routed.
        for body in [
            r#"{"model":"m","prompt":[1],"prompt":[2]}"#,
            r#"{"model":"a","model":"b","prompt":[1]}"#,
        ] {
            assert!(
                err(Endpoint::Completions, body).contains("ambiguous"),
                "{body}"
            );
        }
        let p = ok(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"x","stream":null}"#,
        );
        assert!(!p.stream, "null is absent");
    }

    #[test]
    fn cache_salt() {
        let p = ok(
            Endpoint::Completions,
            r#"{"model":"m","prompt":[1],"cache_salt":"s1"}"#,
        );
        assert_eq!(p.cache_salt.as_deref(), Some("s1"));
        let p = ok(Endpoint::Completions, r#"{"model":"m","prompt":[1]}"#);
        assert_eq!(p.cache_salt, None);
        for bad in ["\"\"", "3"] {
            let body = format!(r#"{{"model":"m","prompt":[1],"cache_salt":{bad}}}"#);
            assert!(err(Endpoint::Completions, &body).contains("'cache_salt'"));
        }
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(Endpoint::Chat, "{").contains("not valid JSON"));
        assert!(err(Endpoint::Chat, "[]").contains("JSON object"));
        assert!(err(Endpoint::Chat, r#"{"messages":[]}"#).contains("'model'"));
        assert!(err(Endpoint::Chat, r#"{"model":3}"#).contains("'model'"));
        assert!(err(Endpoint::Chat, r#"{"model":"m"}"#).contains("'messages'"));
        assert!(
            err(
                Endpoint::Chat,
                r#"{"model":"m","messages":[{"content":"x"}]}"#
            )
            .contains("role")
        );
        assert!(err(Endpoint::Completions, r#"{"model":"m"}"#).contains("'prompt'"));
        for empty in ["[[]]", "[[], [1]]", "[[1], []]"] {
            let body = format!(r#"{{"model":"m","prompt":{empty}}}"#);
            assert!(
                err(Endpoint::Completions, &body).contains("empty token list"),
                "{empty}"
            );
        }
        assert!(
            err(Endpoint::Completions, r#"{"model":"m","prompt":[1,-2]}"#).contains("token ids")
        );
        assert!(
            err(
                Endpoint::Completions,
                r#"{"model":"m","prompt":[4294967296]}"#
            )
            .contains("token ids")
        );
        assert!(
            err(
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","stream":"yes"}"#
            )
            .contains("'stream'")
        );
        assert!(
            err(
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","max_tokens":-1}"#
            )
            .contains("'max_tokens'")
        );
        assert!(err(Endpoint::Completions, r#"{"model":"m","prompt":["a",1]}"#).contains("mix"));
    }
}
