//! A model's prompt template, rendered as the engine renders it.
//!
//! vLLM renders chat requests with HuggingFace `transformers`: Jinja2 with
//! `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` filter that
//! is Python's `json.dumps(ensure_ascii=False)`, and the globals
//! `raise_exception` and `strftime_now`. [`Renderer`] runs minijinja set
//! up the same way (`jinja`), so the bytes it renders are the bytes the
//! engine tokenizes. The tests check it against text rendered by
//! `transformers` itself.
//!
//! The sidecar reads the template from the model's files and publishes it
//! as a [`PromptTemplate`] blob; every router VM compiles it once per
//! version.

use super::jinja::Compiled;
pub use super::jinja::TemplateError;
use super::skeleton::{Path, Skeletons};
use crate::wire::Reader;
use serde_json::{Map, Value};
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: [u8; 4] = *b"KVGT";
/// The largest template blob read: real templates are a few KB, the
/// largest (with tool-call grammars) tens of KB.
pub const MAX_BYTES: usize = 1 << 20;

/// What the filter needs to render prompts as the engine does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptTemplate {
    /// The Jinja source (`tokenizer_config.json`'s `chat_template`).
    pub chat_template: String,
    pub bos_token: String,
    pub eos_token: String,
    /// What the tokenizer puts before a completion prompt when it adds
    /// special tokens (`<|begin_of_text|>` for Llama 3, nothing for Qwen).
    pub completion_prefix: String,
}

impl PromptTemplate {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.chat_template.len());
        out.extend_from_slice(&MAGIC);
        for s in self.parts() {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<PromptTemplate, TemplateError> {
        let mut r = Reader::new(bytes);
        if r.array::<4>()? != MAGIC {
            return Err(TemplateError::BadMagic);
        }
        let mut next = || -> Result<String, TemplateError> {
            let n = r.u32()? as usize;
            let b = r.take(n)?;
            String::from_utf8(b.to_vec()).map_err(|_| TemplateError::Utf8)
        };
        let t = PromptTemplate {
            chat_template: next()?,
            bos_token: next()?,
            eos_token: next()?,
            completion_prefix: next()?,
        };
        match r.remaining() {
            0 => Ok(t),
            n => Err(TemplateError::Trailing(n)),
        }
    }

    /// What the snapshot names the template by; never 0 (0: no template).
    pub fn version(&self) -> u64 {
        xxh3_64(&self.encode()).max(1)
    }

    fn parts(&self) -> [&str; 4] {
        [
            &self.chat_template,
            &self.bos_token,
            &self.eos_token,
            &self.completion_prefix,
        ]
    }
}

/// A compiled template, with its cache of conversation skeletons
/// ([`super::skeleton`]).
pub struct Renderer {
    template: PromptTemplate,
    compiled: Compiled,
    skeletons: Skeletons,
}

impl std::fmt::Debug for Renderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renderer")
            .field("version", &self.template.version())
            .finish()
    }
}

impl Renderer {
    /// Compiles a published template blob if it is `version`; `None` when
    /// the blob is another version (its store still holds the previous
    /// one, or already a newer one).
    pub fn from_blob(bytes: &[u8], version: u64) -> Result<Option<Renderer>, TemplateError> {
        let t = PromptTemplate::decode(bytes)?;
        if t.version() == version {
            Renderer::new(t).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn new(template: PromptTemplate) -> Result<Renderer, TemplateError> {
        Ok(Renderer {
            compiled: Compiled::new(
                &template.chat_template,
                &template.bos_token,
                &template.eos_token,
            )?,
            skeletons: Skeletons::new(&template.chat_template),
            template,
        })
    }

    pub fn template(&self) -> &PromptTemplate {
        &self.template
    }

    /// Renders a chat request's `messages` (with `tools` and the body's
    /// `chat_template_kwargs`) as vLLM does for `add_generation_prompt`.
    /// `unix_s` is the time `strftime_now` formats, in UTC.
    pub fn chat(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: Option<&Map<String, Value>>,
        unix_s: u64,
    ) -> Result<String, TemplateError> {
        let messages = self.compiled.joined(messages);
        self.compiled.chat_joined(&messages, tools, kwargs, unix_s)
    }

    /// [`Renderer::chat`], assembled from the conversation shape's skeleton
    /// where the chat allows (the same text, without running the template).
    pub fn chat_cached(
        &mut self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: Option<&Map<String, Value>>,
        unix_s: u64,
    ) -> Result<(String, Path), TemplateError> {
        self.skeletons
            .chat(&self.compiled, messages, tools, kwargs, unix_s)
    }

    /// [`Renderer::chat_cached`] for a chat given as its plain `turns`
    /// (role, content) where every message is one: assembled without a
    /// tree of the messages once its shape's skeleton is built. The tree
    /// comes from `messages` when the template must run.
    pub fn chat_turns(
        &mut self,
        turns: Option<&[(&str, &str)]>,
        messages: impl FnOnce() -> Result<Value, TemplateError>,
        tools: Option<&Value>,
        kwargs: Option<&Map<String, Value>>,
        unix_s: u64,
    ) -> Result<(String, Path), TemplateError> {
        if let Some(text) =
            turns.and_then(|t| self.skeletons.assemble_turns(t, tools, kwargs, unix_s))
        {
            return Ok((text, Path::Skeleton));
        }
        self.chat_cached(&messages()?, tools, kwargs, unix_s)
    }

    /// Skeletons built and chats assembled from one, so far.
    pub fn skeleton_counts(&self) -> (u64, u64) {
        self.skeletons.counts()
    }

    /// A completion prompt as the engine tokenizes it: with the tokens its
    /// tokenizer adds in front.
    pub fn completion(&self, prompt: &str) -> String {
        let prefix = &self.template.completion_prefix;
        let mut s = String::with_capacity(prefix.len() + prompt.len());
        s.push_str(prefix);
        s.push_str(prompt);
        s
    }

    /// [`Renderer::completion`] in place: no second buffer of the
    /// prompt's size when `prompt` has room for the prefix.
    pub fn complete_in_place(&self, prompt: &mut String) {
        prompt.insert_str(0, &self.template.completion_prefix);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use serde_json::json;

    /// A renderer of `src` with `<s>` and `</s>` as its special tokens.
    pub(in crate::text) fn renderer(src: &str) -> Renderer {
        Renderer::new(PromptTemplate {
            chat_template: src.into(),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
            completion_prefix: "<s>".into(),
        })
        .unwrap()
    }

    #[test]
    fn blob_round_trip_and_hostile_bytes() {
        let t = PromptTemplate {
            chat_template: "{{ messages[0].content }}".into(),
            bos_token: "<s>".into(),
            eos_token: String::new(),
            completion_prefix: "<s>".into(),
        };
        let b = t.encode();
        assert_eq!(PromptTemplate::decode(&b).unwrap(), t);
        assert_ne!(t.version(), 0);
        for cut in 0..b.len() {
            assert!(PromptTemplate::decode(&b[..cut]).is_err(), "{cut}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(matches!(
            PromptTemplate::decode(&longer),
            Err(TemplateError::Trailing(1))
        ));
        let mut huge = b.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(PromptTemplate::decode(&huge).is_err());
        assert!(matches!(
            PromptTemplate::decode(b"XXXX"),
            Err(TemplateError::BadMagic)
        ));
    }

    #[test]
    fn jinja_as_transformers_sets_it_up() {
        let r = renderer(
            "{%- for m in messages %}\n  {{- m.role|upper }}: {{ m.content.strip() }}\n{% endfor %}\
             {% if add_generation_prompt %}A:{% endif %}",
        );
        let msgs = json!([{"role": "user", "content": "  hi  "}]);
        assert_eq!(r.chat(&msgs, None, None, 0).unwrap(), "USER: hi\nA:");
        let kw = json!({"add_generation_prompt": false});
        assert_eq!(
            r.chat(&msgs, None, kw.as_object(), 0).unwrap(),
            "USER: hi\n"
        );
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let r = renderer("{{ tools[0]|tojson }}|{{ tools[0]|tojson(indent=2) }}");
        let tools = json!([{"b": [1, 2.0, "é\n"], "a": {}, "c": null}]);
        assert_eq!(
            r.chat(&json!([]), Some(&tools), None, 0).unwrap(),
            "{\"b\": [1, 2.0, \"é\\n\"], \"a\": {}, \"c\": null}|{\n  \"b\": [\n    1,\n    2.0,\n    \"é\\n\"\n  ],\n  \"a\": {},\n  \"c\": null\n}"
        );
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let r = renderer("{{ raise_exception('no tools here') }}");
        let e = r.chat(&json!([]), None, None, 0).unwrap_err();
        assert!(e.to_string().contains("no tools here"), "{e}");
    }

    #[test]
    fn strftime_now_in_utc() {
        let r = renderer("{{ strftime_now('%d %b %Y, %A %H:%M:%S') }}");
        // 2024-07-26T13:05:09Z
        assert_eq!(
            r.chat(&json!([]), None, None, 1_721_999_109).unwrap(),
            "26 Jul 2024, Friday 13:05:09"
        );
    }

    #[test]
    fn content_parts_join_unless_the_template_walks_them() {
        let msgs = json!([{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
        let flat = renderer("{{ messages[0].content }}");
        assert_eq!(flat.chat(&msgs, None, None, 0).unwrap(), "a\nb");
        let walks = renderer("{% for p in messages[0]['content'] %}[{{ p.text }}]{% endfor %}");
        assert_eq!(walks.chat(&msgs, None, None, 0).unwrap(), "[a][b]");
    }

    #[test]
    fn compile_errors_are_reported() {
        let e = Renderer::new(PromptTemplate {
            chat_template: "{% for %}".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert!(matches!(e, TemplateError::Compile(_)));
    }
}
