//! A chat's messages, read where they stand in one pass: checked as
//! serde_json would build them, their roles and contents joined into the
//! text the approximate index routes on, and nothing else built. A tree
//! of the messages (a map per message, a string per content) is memory
//! every decision would touch in Envoy's VM, where a decision's cost
//! follows what it touches, and only a template that runs reads one: it
//! is built from the messages' JSON then ([`super::super::Parsed::render`]).

use super::{MAX_DEPTH, Reader, ScanError};
use crate::plan::request::Turn;
use std::borrow::Cow;
use std::ops::Range;

pub(in crate::plan::request) const NOT_A_LIST: &str =
    "'messages' is required for /v1/chat/completions and must be a list";

/// A chat's messages as routing reads them.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::plan::request) enum Messages {
    Read {
        /// Where the messages' JSON stands in the body.
        json: Range<usize>,
        /// Each message's role and content, a newline after each.
        joined: String,
        /// Where each message's role and content stand in `joined`, when
        /// every message is plain: a string role and a string content,
        /// and no other member.
        turns: Option<Vec<Turn>>,
    },
    /// What a 400 says about them.
    Refused(String),
}

/// A message's `content`, the last one given.
enum Content<'a> {
    Absent,
    Text(Cow<'a, str>),
    /// The text of each part that has some.
    Parts(Vec<Cow<'a, str>>),
    Other,
}

/// The first thing wrong with the messages: kept while the rest is read,
/// since what serde_json would not build anywhere in them wins over it.
type Wrong = Option<String>;

impl<'a> Reader<'a> {
    /// The messages from here, `depth` containers open around them. What
    /// serde_json would not build (a lone surrogate, a number past f64's
    /// range, nesting past [`MAX_DEPTH`]) is skipped as any other field:
    /// refused where the skip refuses it, else not a list, as `null` is.
    pub(super) fn messages(&mut self, depth: u32) -> Result<Messages, ScanError> {
        let at = self.i;
        if self.peek() != Some(b'[') {
            self.skip_checked(depth)?;
            return Ok(Messages::Refused(NOT_A_LIST.into()));
        }
        match self.message_list(depth) {
            Ok(m) => Ok(m),
            Err(_) => {
                self.i = at;
                self.skip_checked(depth)?;
                Ok(Messages::Refused(NOT_A_LIST.into()))
            }
        }
    }

    /// Steps into the container here, `depth` containers open around it.
    fn open(&mut self, depth: u32) -> Result<(), ScanError> {
        if depth >= MAX_DEPTH {
            return Err(self.err("recursion limit exceeded"));
        }
        self.i += 1;
        self.ws();
        Ok(())
    }

    /// After a container's element: whether another follows.
    fn next_element(&mut self, close: u8) -> Result<bool, ScanError> {
        self.ws();
        match self.next() {
            Some(b',') => {
                self.ws();
                Ok(true)
            }
            Some(c) if c == close => Ok(false),
            Some(_) => Err(self.err_before("expected `,` or a closing bracket")),
            None => Err(self.err("EOF while parsing a value")),
        }
    }

    /// An object's members from its `{`: each key decoded, its value read
    /// by `value`.
    fn members(
        &mut self,
        depth: u32,
        mut value: impl FnMut(&mut Self, &str) -> Result<(), ScanError>,
    ) -> Result<(), ScanError> {
        self.open(depth)?;
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(());
        }
        loop {
            if self.peek() != Some(b'"') {
                return Err(self.err("key must be a string"));
            }
            let key = self.string()?;
            self.ws();
            self.expect(b':')?;
            self.ws();
            value(self, &key)?;
            if !self.next_element(b'}')? {
                return Ok(());
            }
        }
    }

    fn message_list(&mut self, depth: u32) -> Result<Messages, ScanError> {
        let at = self.i;
        self.open(depth)?;
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(Messages::Refused("'messages' must not be empty".into()));
        }
        // The joined text is shorter than the JSON it comes from.
        let mut joined = String::with_capacity(self.b.len().saturating_sub(at));
        let mut wrong = None;
        let mut turns = Some(Vec::new());
        let mut n = 0;
        loop {
            let turn = self.message(depth + 1, n, &mut joined, &mut wrong)?;
            if let (Some(t), Some(all)) = (turn, turns.as_mut()) {
                all.push(t);
            } else {
                turns = None;
            }
            n += 1;
            if !self.next_element(b']')? {
                break;
            }
        }
        let json = at..self.i;
        Ok(match wrong {
            Some(why) => Messages::Refused(why),
            None => Messages::Read {
                json,
                joined,
                turns,
            },
        })
    }

    /// Message `n`: its role and content onto `joined`, or what is wrong
    /// with it into `wrong` if nothing before it was. Where they went in
    /// `joined` when the message is plain.
    fn message(
        &mut self,
        depth: u32,
        n: usize,
        joined: &mut String,
        wrong: &mut Wrong,
    ) -> Result<Option<Turn>, ScanError> {
        if self.peek() != Some(b'{') {
            self.walk::<true>(depth)?;
            wrong.get_or_insert_with(|| format!("messages[{n}] must be an object"));
            return Ok(None);
        }
        // A key given twice counts once, its last value, as in a map.
        let mut role = None;
        let mut content = Content::Absent;
        let mut others = false;
        self.members(depth, |r, key| {
            match key {
                "role" => role = r.string_member(depth + 1)?,
                "content" => content = r.content(depth + 1)?,
                _ => {
                    others = true;
                    r.walk::<true>(depth + 1)?;
                }
            }
            Ok(())
        })?;
        if wrong.is_some() {
            return Ok(None);
        }
        let Some(role) = role else {
            *wrong = Some(format!("messages[{n}].role is required"));
            return Ok(None);
        };
        let role_at = joined.len();
        joined.push_str(&role);
        joined.push('\n');
        let content_at = joined.len();
        let plain = match content {
            Content::Absent => false,
            Content::Text(t) => {
                joined.push_str(&t);
                !others
            }
            Content::Parts(parts) => {
                parts.iter().for_each(|t| joined.push_str(t));
                false
            }
            Content::Other => {
                *wrong = Some(format!(
                    "messages[{n}].content must be a string or a list of parts"
                ));
                return Ok(None);
            }
        };
        let turn = plain.then(|| Turn {
            role: role_at..content_at - 1,
            content: content_at..joined.len(),
        });
        joined.push('\n');
        Ok(turn)
    }

    /// A member's value, `depth` containers open around it: the string it
    /// is, or `None` for a value of another kind (walked all the same).
    fn string_member(&mut self, depth: u32) -> Result<Option<Cow<'a, str>>, ScanError> {
        if self.peek() == Some(b'"') {
            return self.string().map(Some);
        }
        self.walk::<true>(depth)?;
        Ok(None)
    }

    fn content(&mut self, depth: u32) -> Result<Content<'a>, ScanError> {
        Ok(match self.peek() {
            Some(b'"') => Content::Text(self.string()?),
            Some(b'n') => {
                self.literal(b"null")?;
                Content::Absent
            }
            Some(b'[') => {
                self.open(depth)?;
                let mut parts = Vec::new();
                if self.peek() == Some(b']') {
                    self.i += 1;
                } else {
                    loop {
                        if let Some(t) = self.part(depth + 1)? {
                            parts.push(t);
                        }
                        if !self.next_element(b']')? {
                            break;
                        }
                    }
                }
                Content::Parts(parts)
            }
            _ => {
                self.walk::<true>(depth)?;
                Content::Other
            }
        })
    }

    /// A content part's text: its last `text` member, when a string.
    fn part(&mut self, depth: u32) -> Result<Option<Cow<'a, str>>, ScanError> {
        if self.peek() != Some(b'{') {
            self.walk::<true>(depth)?;
            return Ok(None);
        }
        let mut text = None;
        self.members(depth, |r, key| {
            match key {
                "text" => text = r.string_member(depth + 1)?,
                _ => r.walk::<true>(depth + 1)?,
            }
            Ok(())
        })?;
        Ok(text)
    }
}
