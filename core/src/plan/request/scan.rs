//! The request body's top level, read in one strict pass.
//!
//! A long prompt sent as token ids is the largest body kvgate routes, and
//! serde_json spent some 630 fuel units a token reading it (its numbers go
//! through a visitor a byte at a time). This reader takes the ids straight
//! into `u32`s, eight bytes at a time, joins a chat's messages into its
//! text where they stand (`messages`), and leaves every other field as
//! its raw JSON text, so the small ones can still be checked by
//! serde_json as before and the rest cost one byte walk. Only
//! strings can hold non-ASCII bytes, so only they are checked to be UTF-8:
//! a token list is not walked a second time. It accepts exactly the JSON
//! serde_json accepts (RFC 8259), except that it is stricter in two places
//! an engine would refuse anyway: invalid UTF-8 anywhere, and nesting
//! deeper than serde_json's own bound inside fields routing skips.

mod messages;

use super::estimate_tokens;
use super::prompt::{NOT_TOKENS, Prompt, WRONG_TYPE};
pub(super) use messages::{Messages, NOT_A_LIST};
use std::borrow::Cow;
use thiserror::Error;

/// Nested arrays and objects, the body's own included: serde_json's bound
/// for what it parses, so a prompt it read is read here.
const MAX_DEPTH: u32 = 127;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub(super) enum ScanError {
    #[error("{what} at byte {at}")]
    Syntax { what: &'static str, at: usize },
    #[error("request body must be a JSON object")]
    NotObject,
    #[error("duplicate field `{0}`")]
    Duplicate(&'static str),
}

/// The top-level fields routing reads, as their raw JSON text, except the
/// prompt and the messages, read in the same pass.
#[derive(Debug, Default)]
pub(super) struct Fields<'a> {
    pub model: Option<&'a str>,
    pub stream: Option<&'a str>,
    pub max_tokens: Option<&'a str>,
    pub max_completion_tokens: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    /// `None` when absent or `null`.
    pub prompt: Option<Prompt>,
    /// A chat's messages, read where they stand.
    pub messages: Option<Messages>,
    pub tools: Option<&'a str>,
    pub chat_template_kwargs: Option<&'a str>,
    pub add_generation_prompt: Option<&'a str>,
}

/// The names [`Fields`] reads; a key's place here is its bit in the set
/// of keys seen.
const NAMES: [&str; 10] = [
    "model",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "cache_salt",
    "prompt",
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
];
const PROMPT: usize = 5;
const MESSAGES: usize = 6;

pub(super) fn fields(body: &[u8]) -> Result<Fields<'_>, ScanError> {
    let mut r = Reader { b: body, i: 0 };
    r.ws();
    match r.peek() {
        None => return Err(r.err("EOF while parsing a value")),
        Some(b'{') => r.i += 1,
        Some(_) => return Err(ScanError::NotObject),
    }
    let mut f = Fields::default();
    let mut seen = 0u16;
    r.ws();
    if r.peek() == Some(b'}') {
        r.i += 1;
    } else {
        loop {
            r.ws();
            if r.peek() != Some(b'"') {
                return Err(r.err("key must be a string"));
            }
            let key = r.string()?;
            let known = NAMES.iter().position(|n| *n == key);
            r.ws();
            r.expect(b':')?;
            r.ws();
            match known {
                // A key given twice is read differently by different
                // parsers: refused, as serde_json refused it.
                Some(k) if seen & (1 << k) != 0 => {
                    return Err(ScanError::Duplicate(NAMES.get(k).copied().unwrap_or("?")));
                }
                Some(PROMPT) => {
                    seen |= 1 << PROMPT;
                    f.prompt = r.prompt()?;
                }
                Some(MESSAGES) => {
                    seen |= 1 << MESSAGES;
                    f.messages = Some(r.messages(1)?);
                }
                Some(k) => {
                    seen |= 1 << k;
                    let raw = r.raw(1)?;
                    let slot = match k {
                        0 => &mut f.model,
                        1 => &mut f.stream,
                        2 => &mut f.max_tokens,
                        3 => &mut f.max_completion_tokens,
                        4 => &mut f.cache_salt,
                        7 => &mut f.tools,
                        8 => &mut f.chat_template_kwargs,
                        _ => &mut f.add_generation_prompt,
                    };
                    *slot = Some(raw);
                }
                None => r.skip_checked(1)?,
            }
            r.ws();
            match r.next() {
                Some(b',') => {}
                Some(b'}') => break,
                Some(_) => return Err(r.err_before("expected `,` or `}`")),
                None => return Err(r.err("EOF while parsing an object")),
            }
        }
    }
    r.ws();
    if r.i < r.b.len() {
        return Err(r.err("trailing characters"));
    }
    Ok(f)
}

/// A byte repeated across a word: `ONES * b`.
const ONES: u64 = 0x0101_0101_0101_0101;

/// The eight bytes from `i`, the first one lowest.
fn word(b: &[u8], i: usize) -> Option<u64> {
    let mut w = [0u8; 8];
    w.copy_from_slice(b.get(i..i + 8)?);
    Some(u64::from_le_bytes(w))
}

/// Where the run of a string's plain bytes from `i` ends: at a quote, a
/// backslash, a control character or the end. Eight bytes a step, as
/// serde_json does: a long prompt's text is most of its body.
fn plain_end(b: &[u8], mut i: usize) -> usize {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // A byte of `x` below `n` sets its high bit in `less(x, n)`; bits above
    // the lowest may be false, the lowest is exact.
    let less = |x: u64, n: u8| x.wrapping_sub(ONES * u64::from(n)) & !x & HIGH;
    while let Some(w) = word(b, i) {
        let hit = less(w ^ (ONES * u64::from(b'"')), 1)
            | less(w ^ (ONES * u64::from(b'\\')), 1)
            | less(w, 0x20);
        if hit != 0 {
            return i + (hit.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while let Some(&c) = b.get(i) {
        if c == b'"' || c == b'\\' || c < 0x20 {
            break;
        }
        i += 1;
    }
    i
}

/// The token id whose first eight bytes from `i` are the word whose
/// [`digits`] are `t`, `n` of them digits: its value and its length, when
/// the bytes hold an integer of one to ten digits that fits a `u32`, then
/// a byte that ends it. Anything else (a float, a leading zero, a larger
/// number) is `None`, left to [`Reader::number`], which also says what is
/// wrong with it. Read a byte at a time, a token list cost some 50 fuel
/// units a byte, five times a string. Inlined into both copies of the
/// id loop: called from them, it cost a list of eight-digit ids 16 % more
/// fuel.
#[inline(always)]
fn id8(b: &[u8], i: usize, t: u64, n: usize) -> Option<(u32, usize)> {
    if n == 0 || leading_zero(t, n) {
        return None;
    }
    let mut v = value(t, n);
    let mut end = i + n;
    if n == 8 {
        // u32's ids run to ten digits; an eleventh is too many.
        for _ in 0..3 {
            match b.get(end) {
                Some(c @ b'0'..=b'9') => {
                    v = v * 10 + u64::from(c - b'0');
                    end += 1;
                }
                _ => break,
            }
        }
    }
    match b.get(end) {
        None | Some(b'.' | b'e' | b'E' | b'0'..=b'9') => None,
        Some(_) => Some((u32::try_from(v).ok()?, end - i)),
    }
}

/// A word's digits as their values, 0 to 9; every other byte 10 or more
/// (its high bit set when it is not ASCII).
fn digits(w: u64) -> u64 {
    w ^ (ONES * u64::from(b'0'))
}

/// How many of [`digits`]'s bytes, from the lowest, are digits: 0 to 8.
fn digit_count(t: u64) -> usize {
    // Each byte of 10 or more to its high bit. Only a byte of 0x8A or
    // more carries into the next, which comes after it and is not read.
    let other = (t.wrapping_add(ONES * 0x76) | t) & (ONES * 0x80);
    (other.trailing_zeros() / 8) as usize
}

/// Whether [`digits`]'s first `n` bytes are a number JSON refuses: more
/// than one digit, the first a zero.
fn leading_zero(t: u64, n: usize) -> bool {
    n > 1 && t & 0xFF == 0
}

/// The value of [`digits`]'s first `n` bytes (1 to 8).
fn value(t: u64, n: usize) -> u64 {
    // Little-endian, the first digit is the lowest byte: shifted up, the
    // digits have zeros below them, an eight-digit number's leading
    // zeros, and its pairs, quads and halves are summed in place.
    let d = t << (8 * (8 - n));
    let d = (d.wrapping_mul(10) + (d >> 8)) & 0x00FF_00FF_00FF_00FF;
    let d = (d.wrapping_mul(100) + (d >> 16)) & 0x0000_FFFF_0000_FFFF;
    (d.wrapping_mul(10_000) + (d >> 32)) & 0xFFFF_FFFF
}

/// Each byte's value as a hex digit, 16 or more when it is none: what
/// [`bmp_escape`] and [`Reader::hex4`] read escapes with.
const HEX: [u8; 256] = {
    let mut t = [0xFF; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = match c as u8 {
            d @ b'0'..=b'9' => d - b'0',
            d @ b'a'..=b'f' => d - b'a' + 10,
            d @ b'A'..=b'F' => d - b'A' + 10,
            _ => 0xFF,
        };
        c += 1;
    }
    t
};

/// The character of a `\uXXXX` escape at `i` (its backslash), when it
/// stands alone: not half of a surrogate pair. Anything else, pairs and
/// errors included, is left to [`Reader::escape`].
fn bmp_escape(b: &[u8], i: usize) -> Option<char> {
    let [b'\\', b'u', h @ ..] = b.get(i..i + 6)? else {
        return None;
    };
    let mut code = 0u32;
    for &c in h {
        let d = HEX[usize::from(c)];
        if d > 15 {
            return None;
        }
        code = code << 4 | u32::from(d);
    }
    // None for a surrogate.
    char::from_u32(code)
}

/// Bytes kept free in front of a text prompt's copy: a template's
/// completion prefix (`<|begin_of_text|>`) goes in without a new buffer.
const PREFIX_ROOM: usize = 32;

/// A text prompt, owned, with [`PREFIX_ROOM`] to spare.
fn with_room(s: Cow<'_, str>) -> String {
    match s {
        Cow::Borrowed(b) => {
            let mut owned = String::with_capacity(b.len() + PREFIX_ROOM);
            owned.push_str(b);
            owned
        }
        Cow::Owned(o) => o,
    }
}

/// Where the whitespace from `i` ends.
fn ws_end(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\t' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

/// The hot loop of a token list, from an element at `i`: ids with the
/// comma after them and the whitespace after that, eight bytes at a time
/// and in locals rather than the reader's fields. Returns where it
/// stopped, and whether just after an id (which no comma follows):
/// otherwise at an element it cannot read (or one in the body's last
/// eight bytes), for the general reader to judge.
fn id_run(b: &[u8], i: usize, ids: &mut Vec<u32>) -> (usize, bool) {
    // Python's `json.dumps` writes ", " between ids, serde_json ",". The
    // first id says which this list uses, so that neither pays a turn of
    // the loop, or a test in it, for the other's space.
    let spaced = word(b, i).is_some_and(|w| {
        let n = digit_count(digits(w));
        n < 7 && (w >> (8 * n)) as u16 == u16::from_le_bytes([b',', b' '])
    });
    if spaced {
        ids_separated::<true>(b, i, ids)
    } else {
        ids_separated::<false>(b, i, ids)
    }
}

/// [`id_run`] for a list whose fast path takes ids followed by ", "
/// (`SPACED`) or ",". Any other layout takes the general path, so the two
/// give the same ids.
fn ids_separated<const SPACED: bool>(b: &[u8], mut i: usize, ids: &mut Vec<u32>) -> (usize, bool) {
    let (sep_len, sep_mask, sep) = if SPACED {
        (2, 0xFFFF, u64::from(u16::from_le_bytes([b',', b' '])))
    } else {
        (1, 0xFF, u64::from(b','))
    };
    loop {
        let Some(w) = word(b, i) else {
            return (ws_end(b, i), false);
        };
        let t = digits(w);
        let n = digit_count(t);
        if n == 0 {
            let next = ws_end(b, i);
            if next == i {
                return (i, false);
            }
            i = next;
            continue;
        }
        // Most ids are one to seven digits with their separator in the
        // same word: no byte is read apart, and seven digits always fit.
        if n + sep_len <= 8 && (w >> (8 * n)) & sep_mask == sep && !leading_zero(t, n) {
            ids.push(value(t, n) as u32);
            i += n + sep_len;
            continue;
        }
        let Some((id, len)) = id8(b, i, t, n) else {
            return (i, false);
        };
        ids.push(id);
        i += len;
        if b.get(i) != Some(&b',') {
            return (i, true);
        }
        i += 1;
        if SPACED && b.get(i) == Some(&b' ') {
            i += 1;
        }
    }
}

/// One element of a prompt list.
enum Item {
    Token(u32),
    Text(String),
    /// A token list of a batch, or why it is refused.
    List(Result<Vec<u32>, &'static str>),
    Other,
}

/// Reads the body once. Outside strings JSON is ASCII, which the grammar
/// checks; a string's bytes are checked to be UTF-8 where it is taken
/// ([`Reader::slice`]) or skipped ([`Reader::skip_checked`]), once each.
/// A token list, the largest body, has no string to check.
struct Reader<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Reader<'a> {
    fn err(&self, what: &'static str) -> ScanError {
        ScanError::Syntax { what, at: self.i }
    }

    /// An error at the byte just consumed.
    fn err_before(&self, what: &'static str) -> ScanError {
        ScanError::Syntax {
            what,
            at: self.i.saturating_sub(1),
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn ws(&mut self) {
        self.i = ws_end(self.b, self.i);
    }

    fn expect(&mut self, c: u8) -> Result<(), ScanError> {
        match self.next() {
            Some(x) if x == c => Ok(()),
            Some(_) => Err(self.err_before(match c {
                b':' => "expected `:`",
                _ => "expected a delimiter",
            })),
            None => Err(self.err("EOF while parsing a value")),
        }
    }

    /// The bytes from `from` to here, checked to be UTF-8.
    fn slice(&self, from: usize) -> Result<&'a str, ScanError> {
        let bytes = self.b.get(from..self.i).unwrap_or_default();
        std::str::from_utf8(bytes).map_err(|e| ScanError::Syntax {
            what: "invalid UTF-8",
            at: from + e.valid_up_to(),
        })
    }

    /// Skips a value that nothing takes as text, its strings checked to
    /// be UTF-8 all the same: an engine would refuse the body.
    fn skip_checked(&mut self, depth: u32) -> Result<(), ScanError> {
        self.raw(depth).map(|_| ())
    }

    /// Skips a value and returns its JSON text.
    fn raw(&mut self, depth: u32) -> Result<&'a str, ScanError> {
        let from = self.i;
        self.skip(depth)?;
        self.slice(from)
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), ScanError> {
        let end = self.i + word.len();
        if self.b.get(self.i..end) == Some(word) {
            self.i = end;
            Ok(())
        } else {
            Err(self.err("expected value"))
        }
    }

    /// A string, decoded; borrowed from the body when it has no escapes.
    fn string(&mut self) -> Result<Cow<'a, str>, ScanError> {
        self.i += 1;
        let from = self.i;
        self.i = plain_end(self.b, self.i);
        match self.peek() {
            Some(b'"') => {
                let s = self.slice(from)?;
                self.i += 1;
                return Ok(Cow::Borrowed(s));
            }
            Some(b'\\') => {}
            Some(_) => return Err(self.err("control character in string")),
            None => return Err(self.err("EOF while parsing a string")),
        }
        let mut out = String::from(self.slice(from)?);
        loop {
            let run = self.i;
            self.i = plain_end(self.b, self.i);
            out.push_str(self.slice(run)?);
            // Python's `json.dumps` escapes every character past ASCII: a
            // prompt in Chinese is one `\uXXXX` after another.
            let escapes = self.i;
            while let Some(c) = bmp_escape(self.b, self.i) {
                out.push(c);
                self.i += 6;
            }
            if self.i != escapes {
                continue;
            }
            match self.next() {
                Some(b'"') => return Ok(Cow::Owned(out)),
                Some(b'\\') => out.push(self.escape()?),
                Some(_) => return Err(self.err_before("control character in string")),
                None => return Err(self.err("EOF while parsing a string")),
            }
        }
    }

    /// The character an escape stands for, its backslash consumed.
    fn escape(&mut self) -> Result<char, ScanError> {
        Ok(match self.next() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                let n = self.hex4()?;
                let code = match n {
                    0xDC00..=0xDFFF => return Err(self.err("lone surrogate in hex escape")),
                    0xD800..=0xDBFF => {
                        // A decoded string must be valid UTF-8: the low
                        // half must follow at once.
                        if self.next() != Some(b'\\') || self.next() != Some(b'u') {
                            return Err(self.err_before("lone surrogate in hex escape"));
                        }
                        let lo = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&lo) {
                            return Err(self.err("lone surrogate in hex escape"));
                        }
                        0x1_0000 + ((u32::from(n) - 0xD800) << 10) + (u32::from(lo) - 0xDC00)
                    }
                    n => u32::from(n),
                };
                char::from_u32(code).ok_or(self.err("invalid escape"))?
            }
            Some(_) => return Err(self.err_before("invalid escape")),
            None => return Err(self.err("EOF while parsing a string")),
        })
    }

    fn hex4(&mut self) -> Result<u16, ScanError> {
        let mut n = 0u16;
        for _ in 0..4 {
            let Some(c) = self.next() else {
                return Err(self.err("EOF while parsing a string"));
            };
            let d = HEX[usize::from(c)];
            if d > 15 {
                return Err(self.err_before("invalid escape"));
            }
            n = (n << 4) | u16::from(d);
        }
        Ok(n)
    }

    /// Skips a string, checking its escapes' syntax but not what they
    /// decode to, as serde_json skips one.
    fn skip_string(&mut self) -> Result<(), ScanError> {
        self.i += 1;
        loop {
            self.i = plain_end(self.b, self.i);
            match self.next() {
                Some(b'"') => return Ok(()),
                Some(b'\\') => match self.next() {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {}
                    Some(b'u') => {
                        self.hex4()?;
                    }
                    Some(_) => return Err(self.err_before("invalid escape")),
                    None => return Err(self.err("EOF while parsing a string")),
                },
                Some(c) if c < 0x20 => return Err(self.err_before("control character in string")),
                Some(_) => {}
                None => return Err(self.err("EOF while parsing a string")),
            }
        }
    }

    fn digits(&mut self) -> Result<(), ScanError> {
        if !matches!(self.peek(), Some(b'0'..=b'9')) {
            return Err(self.err("invalid number"));
        }
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        Ok(())
    }

    /// A number, checked against JSON's grammar; its value when it is a
    /// token id. serde_json gave a `u64` only for a non-negative integer
    /// without fraction or exponent (`-0` and `1.0` are floats to it), and
    /// the old reader took those up to `u32::MAX`: exactly these are ids.
    fn number(&mut self) -> Result<Option<u32>, ScanError> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.i += 1;
        }
        let mut v: u64 = 0;
        match self.next() {
            Some(b'0') => {
                if let Some(b'0'..=b'9') = self.peek() {
                    return Err(self.err("invalid number"));
                }
            }
            Some(c @ b'1'..=b'9') => {
                v = u64::from(c - b'0');
                // In locals: the reader's fields live in memory, and this
                // loop runs once a digit of every id.
                let mut i = self.i;
                while let Some(c @ b'0'..=b'9') = self.b.get(i).copied() {
                    i += 1;
                    // Past u32::MAX the value no longer matters, only
                    // that it is too large; this keeps the u64 from
                    // overflowing however long the digits run.
                    if v <= u64::from(u32::MAX) {
                        v = v * 10 + u64::from(c - b'0');
                    }
                }
                self.i = i;
            }
            Some(_) => return Err(self.err_before("invalid number")),
            None => return Err(self.err("EOF while parsing a value")),
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.digits()?;
            integer = false;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            self.digits()?;
            integer = false;
        }
        Ok(match u32::try_from(v) {
            Ok(id) if integer && !negative => Some(id),
            _ => None,
        })
    }

    /// Skips one value of any kind, checking its syntax, without
    /// recursion: `depth` containers are open around it.
    fn skip(&mut self, depth: u32) -> Result<(), ScanError> {
        self.walk::<false>(depth)
    }

    /// [`Reader::skip`], or with `DECODE`, refusing what serde_json would
    /// not build a value from, as well: a string or key that does not
    /// decode (a lone surrogate) and a number past f64's range.
    fn walk<const DECODE: bool>(&mut self, depth: u32) -> Result<(), ScanError> {
        // Which open container is an object, one bit each, innermost
        // lowest; MAX_DEPTH keeps them within the u128.
        let mut objects: u128 = 0;
        let mut open: u32 = 0;
        loop {
            self.ws();
            match self.peek() {
                Some(c @ (b'{' | b'[')) => {
                    if depth + open >= MAX_DEPTH {
                        return Err(self.err("recursion limit exceeded"));
                    }
                    self.i += 1;
                    open += 1;
                    objects = (objects << 1) | u128::from(c == b'{');
                    self.ws();
                    let close = if c == b'{' { b'}' } else { b']' };
                    if self.peek() != Some(close) {
                        if c == b'{' {
                            self.key::<DECODE>()?;
                        }
                        continue;
                    }
                    self.i += 1;
                    open -= 1;
                    objects >>= 1;
                }
                Some(b'"') if DECODE => {
                    self.string()?;
                }
                Some(b'"') => self.skip_string()?,
                Some(b'-' | b'0'..=b'9') if DECODE => self.number_in_range()?,
                Some(b'-' | b'0'..=b'9') => {
                    self.number()?;
                }
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'n') => self.literal(b"null")?,
                Some(_) => return Err(self.err("expected value")),
                None => return Err(self.err("EOF while parsing a value")),
            }
            // A value ended: close what it ended, or go on to the next.
            loop {
                if open == 0 {
                    return Ok(());
                }
                self.ws();
                let object = objects & 1 == 1;
                match self.next() {
                    Some(b',') => {
                        if object {
                            self.ws();
                            self.key::<DECODE>()?;
                        }
                        break;
                    }
                    Some(b'}') if object => {}
                    Some(b']') if !object => {}
                    Some(_) => return Err(self.err_before("expected `,` or a closing bracket")),
                    None => return Err(self.err("EOF while parsing a value")),
                }
                open -= 1;
                objects >>= 1;
            }
        }
    }

    /// Skips an object's key, decoded with `DECODE`, and its colon.
    fn key<const DECODE: bool>(&mut self) -> Result<(), ScanError> {
        if self.peek() != Some(b'"') {
            return Err(self.err("key must be a string"));
        }
        if DECODE {
            self.string()?;
        } else {
            self.skip_string()?;
        }
        self.ws();
        self.expect(b':')
    }

    /// A number, checked against JSON's grammar and, as serde_json builds
    /// a value, against f64's range. Its own reader judges the rare one
    /// that could be out of range, so the bound is exactly serde_json's.
    fn number_in_range(&mut self) -> Result<(), ScanError> {
        let from = self.i;
        self.number()?;
        let text = self.b.get(from..self.i).unwrap_or_default();
        // Eighteen characters without an exponent are below 1e18.
        if text.len() > 18 || text.iter().any(|c| matches!(c, b'e' | b'E')) {
            serde_json::from_slice::<f64>(text).map_err(|_| ScanError::Syntax {
                what: "number out of range",
                at: from,
            })?;
        }
        Ok(())
    }

    /// Skips an object in a prompt, decoding its keys (so refusing one
    /// that is no string, like a lone surrogate) but not its values, as
    /// serde_json's visitor did.
    fn object_keys_decoded(&mut self, depth: u32) -> Result<(), ScanError> {
        if depth >= MAX_DEPTH {
            return Err(self.err("recursion limit exceeded"));
        }
        self.i += 1;
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(());
        }
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return Err(self.err("key must be a string"));
            }
            self.string()?;
            self.ws();
            self.expect(b':')?;
            self.skip_checked(depth + 1)?;
            self.ws();
            match self.next() {
                Some(b',') => {}
                Some(b'}') => return Ok(()),
                Some(_) => return Err(self.err_before("expected `,` or `}`")),
                None => return Err(self.err("EOF while parsing an object")),
            }
        }
    }

    /// After a list element: whether another follows.
    fn more(&mut self) -> Result<bool, ScanError> {
        self.ws();
        match self.next() {
            Some(b',') => {
                self.ws();
                Ok(true)
            }
            Some(b']') => Ok(false),
            Some(_) => Err(self.err_before("expected `,` or `]`")),
            None => Err(self.err("EOF while parsing a list")),
        }
    }

    /// `/v1/completions`' `prompt`, its shape checked as it is read (see
    /// [`Prompt`]); `None` for `null`.
    fn prompt(&mut self) -> Result<Option<Prompt>, ScanError> {
        Ok(Some(match self.peek() {
            Some(b'n') => {
                self.literal(b"null")?;
                return Ok(None);
            }
            Some(b'"') => {
                let s = self.string()?;
                Prompt::Text {
                    isl_tokens: estimate_tokens(&s),
                    first: with_room(s),
                }
            }
            Some(b'[') => self.prompt_list()?,
            Some(b'{') => {
                self.object_keys_decoded(1)?;
                Prompt::Invalid(WRONG_TYPE)
            }
            _ => {
                self.skip_checked(1)?;
                Prompt::Invalid(WRONG_TYPE)
            }
        }))
    }

    fn prompt_list(&mut self) -> Result<Prompt, ScanError> {
        // The body's object and this list.
        const DEPTH: u32 = 2;
        self.i += 1;
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(Prompt::Invalid("'prompt' must not be empty"));
        }
        let refused = match self.item(DEPTH)? {
            Item::Token(t) => {
                // Ids are some six bytes of JSON each.
                let mut ids = Vec::with_capacity(self.b.len().saturating_sub(self.i) / 6 + 1);
                ids.push(t);
                let mut more = self.more()?;
                loop {
                    if !more {
                        let isl_tokens = ids.len() as u64;
                        return Ok(Prompt::Tokens {
                            first: ids,
                            isl_tokens,
                        });
                    }
                    let (end, after_id) = id_run(self.b, self.i, &mut ids);
                    self.i = end;
                    if !after_id {
                        match self.peek() {
                            Some(b'0'..=b'9') => match self.number()? {
                                Some(t) => ids.push(t),
                                None => break NOT_TOKENS,
                            },
                            _ => {
                                self.item(DEPTH)?;
                                break NOT_TOKENS;
                            }
                        }
                    }
                    more = self.more()?;
                }
            }
            Item::Text(first) => {
                let mut isl_tokens = estimate_tokens(&first);
                loop {
                    if !self.more()? {
                        return Ok(Prompt::Text { first, isl_tokens });
                    }
                    match self.item(DEPTH)? {
                        Item::Text(s) => isl_tokens += estimate_tokens(&s),
                        _ => break "'prompt' must not mix strings and other values",
                    }
                }
            }
            Item::List(Ok(first)) => {
                let mut isl_tokens = first.len() as u64;
                loop {
                    if !self.more()? {
                        return Ok(Prompt::Tokens { first, isl_tokens });
                    }
                    match self.item(DEPTH)? {
                        Item::List(Ok(l)) => isl_tokens += l.len() as u64,
                        Item::List(Err(why)) => break why,
                        _ => break "'prompt' must not mix token lists and other values",
                    }
                }
            }
            Item::List(Err(why)) => why,
            Item::Other => NOT_TOKENS,
        };
        // The rest of the list is skipped, still checked to be JSON.
        while self.more()? {
            self.skip_checked(DEPTH)?;
        }
        Ok(Prompt::Invalid(refused))
    }

    /// An element of a list that `depth` containers hold.
    fn item(&mut self, depth: u32) -> Result<Item, ScanError> {
        Ok(match self.peek() {
            Some(b'-' | b'0'..=b'9') => self.number()?.map_or(Item::Other, Item::Token),
            Some(b'"') => Item::Text(self.string()?.into_owned()),
            Some(b'[') => {
                if depth >= MAX_DEPTH {
                    return Err(self.err("recursion limit exceeded"));
                }
                self.i += 1;
                self.ws();
                if self.peek() == Some(b']') {
                    self.i += 1;
                    return Ok(Item::List(Err(
                        "'prompt' must not contain an empty token list",
                    )));
                }
                let mut ids = Vec::new();
                let mut refused = None;
                loop {
                    match self.peek() {
                        Some(b'0'..=b'9') => match self.number()? {
                            Some(t) => ids.push(t),
                            None => refused = Some(NOT_TOKENS),
                        },
                        // Read as an item, as serde_json's visitor read
                        // it: its strings are decoded, so checked.
                        _ => {
                            self.item(depth + 1)?;
                            refused = Some(NOT_TOKENS);
                        }
                    }
                    if !self.more()? {
                        break;
                    }
                }
                Item::List(refused.map_or(Ok(ids), Err))
            }
            Some(b'{') => {
                self.object_keys_decoded(depth)?;
                Item::Other
            }
            _ => {
                self.skip_checked(depth)?;
                Item::Other
            }
        })
    }
}

/// Reads one prompt value on its own, as the body's `prompt` field.
#[cfg(test)]
pub(super) fn prompt_value(json: &str) -> Result<Option<Prompt>, ScanError> {
    let mut r = Reader {
        b: json.as_bytes(),
        i: 0,
    };
    r.ws();
    let p = r.prompt()?;
    r.ws();
    if r.i < r.b.len() {
        return Err(r.err("trailing characters"));
    }
    Ok(p)
}
