//! RFC 8785 (JCS) canonical JSON, and the digests built on it.
//!
//! A payload fingerprint and a tool's args hash are SHA-256 of the canonical
//! form, so key order, whitespace and number spelling (`1e2` vs `100`, `4.50`
//! vs `4.5`) never make two equal requests differ. Canonicalisation is done by
//! the `serde_json_canonicalizer` crate (ECMAScript number formatting via
//! `ryu-js`); this module adds the size and depth limits.

use serde_json::Value;
use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};
use crate::limits::{MAX_JSON_BYTES, MAX_JSON_DEPTH};

/// A SHA-256 digest of canonical JSON, kept as lowercase hex.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Digest(String);

impl Digest {
    /// Wraps a hex digest read back from a store.
    pub fn from_hex(hex: impl Into<String>) -> Self {
        Self(hex.into())
    }

    /// The digest as 64 lowercase hex characters.
    pub fn as_hex(&self) -> &str {
        &self.0
    }
}

/// How deeply `value` nests arrays and objects ([`MAX_JSON_DEPTH`] counts
/// the same way): a scalar is 0, `[]` and `{}` are 1, `[[1]]` is 2. Stops
/// counting once past the limit.
fn depth(value: &Value) -> usize {
    // Iterative so a hostile value cannot overflow the stack measuring itself.
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((node, above)) = stack.pop() {
        if !(node.is_array() || node.is_object()) {
            continue;
        }
        let level = above + 1;
        deepest = deepest.max(level);
        if level > MAX_JSON_DEPTH {
            break;
        }
        match node {
            Value::Array(items) => stack.extend(items.iter().map(|v| (v, level))),
            Value::Object(map) => stack.extend(map.values().map(|v| (v, level))),
            _ => {}
        }
    }
    deepest
}

/// A JSON value in canonical form, within the limits: what stores keep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CanonicalJson(String);

impl CanonicalJson {
    /// Canonicalises `value`; `what` names the field in errors.
    ///
    /// # Errors
    /// As [`canonicalize`].
    pub fn new(what: &str, value: &Value) -> Result<Self> {
        canonicalize(what, value).map(Self)
    }

    /// Wraps canonical text a store kept: it was canonical and within the
    /// limits when written, so it is not checked again.
    pub fn from_stored(text: impl Into<String>) -> Self {
        Self(text.into())
    }

    /// The canonical text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// SHA-256 of the canonical text.
    pub fn digest(&self) -> Digest {
        Digest(hex::encode(Sha256::digest(self.0.as_bytes())))
    }

    /// The value back, as a step returns it; `what` names it in the error.
    ///
    /// # Errors
    /// `corrupt` when the text is not JSON: stored canonical text always is.
    pub fn to_value(&self, what: &str) -> Result<Value> {
        serde_json::from_str(&self.0).map_err(|e| Error::corrupt(format!("{what}: {e}")))
    }
}

/// The RFC 8785 canonical form of `value`, checked against the JSON limits.
///
/// # Errors
/// `invalid_request` when `value` nests deeper than [`MAX_JSON_DEPTH`] or its
/// canonical form exceeds [`MAX_JSON_BYTES`]; `what` names the field.
pub fn canonicalize(what: &str, value: &Value) -> Result<String> {
    if depth(value) > MAX_JSON_DEPTH {
        return Err(Error::invalid(format!(
            "{what} nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
        )));
    }
    let text = serde_json_canonicalizer::to_string(value)
        .map_err(|e| Error::invalid(format!("{what} cannot be canonicalised: {e}")))?;
    if text.len() > MAX_JSON_BYTES {
        return Err(Error::invalid(format!(
            "{what} is {} bytes, the limit is {MAX_JSON_BYTES}",
            text.len()
        )));
    }
    Ok(text)
}

/// SHA-256 of the canonical form of `value`.
///
/// # Errors
/// As [`canonicalize`].
pub fn digest(what: &str, value: &Value) -> Result<Digest> {
    CanonicalJson::new(what, value).map(|json| json.digest())
}

/// SHA-256 of the canonical form of `value`, with no limit checked: for a
/// value built in memory around a part whose limits were checked already
/// (a begin's fingerprint wraps its payload in an object), so the wrapping
/// does not count against the part's own depth and size.
///
/// # Errors
/// `invalid_request` when `value` cannot be canonicalised.
pub(crate) fn digest_unchecked(value: &Value) -> Result<Digest> {
    let text = serde_json_canonicalizer::to_string(value)
        .map_err(|e| Error::invalid(format!("cannot be canonicalised: {e}")))?;
    Ok(Digest(hex::encode(Sha256::digest(text.as_bytes()))))
}

/// The largest integer magnitude a double holds exactly together with its
/// neighbours, 2^53 − 1 (RFC 7493 §2.2). Not a tunable limit but a property
/// of the format, so it lives here rather than in `limits`: beyond it two
/// different integers can round to the same double and share a digest.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// [`MAX_SAFE_INTEGER`] as a double (exact: it is below 2^53).
const MAX_SAFE_FLOAT: f64 = 9_007_199_254_740_991.0;

/// Longest JSON Pointer an I-JSON error names; longer ones are cut, so a
/// hostile key cannot fill the (capped) error message.
const MAX_POINTER_CHARS: usize = 120;

/// Parses `bytes` as I-JSON (RFC 7493): well-formed JSON with no duplicate
/// member names and every number exact in an IEEE 754 double. The one parser
/// for every request body the server reads, so that two different requests
/// can never share a fingerprint or an args hash.
///
/// `serde_json` keeps the last of two equal member names and rounds numbers
/// silently; both are detected here on the raw text, before the value is built.
///
/// # Errors
/// `invalid_request` for malformed JSON, a duplicate member name or a number
/// that is not I-JSON, naming the member by its JSON Pointer.
pub fn parse_i_json(bytes: &[u8]) -> Result<Value> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| Error::invalid(format!("malformed JSON: {e}")))?;
    // The text is now known to be well-formed, so the scan below can be a
    // plain tokenizer.
    scan_raw(bytes)?;
    Ok(value)
}

/// Checks a value built in memory against I-JSON's number rules (a `Value`
/// cannot hold duplicate member names): no integer beyond ±[`MAX_SAFE_INTEGER`].
/// `what` names the field in errors.
///
/// A value that `serde_json` parsed from text has already lost what the text
/// said (`9007199254740993` reads as `…992`); parse untrusted text with
/// [`parse_i_json`] instead.
///
/// # Errors
/// `invalid_request` naming the offending member by its JSON Pointer.
pub fn check_i_json(what: &str, value: &Value) -> Result<()> {
    // Iterative, with parent links to name the path only on failure, so a
    // deep value neither overflows the stack nor pays for paths it never shows.
    let mut nodes: Vec<(usize, Segment<'_>)> = vec![(0, Segment::Root)];
    let mut stack = vec![(value, 0usize)];
    while let Some((node, index)) = stack.pop() {
        match node {
            Value::Number(number) => {
                if let Some(problem) = value_number_problem(number) {
                    let segments = path_to(&nodes, index);
                    return Err(Error::invalid(format!(
                        "{what}: number at {} {problem}",
                        pointer(&segments)
                    )));
                }
            }
            Value::Array(items) => {
                for (position, item) in items.iter().enumerate() {
                    nodes.push((index, Segment::Index(position)));
                    stack.push((item, nodes.len() - 1));
                }
            }
            Value::Object(map) => {
                for (key, item) in map {
                    nodes.push((index, Segment::Key(key)));
                    stack.push((item, nodes.len() - 1));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug)]
enum Segment<'a> {
    Root,
    Key(&'a str),
    Index(usize),
}

fn path_to<'a>(nodes: &[(usize, Segment<'a>)], mut index: usize) -> Vec<Segment<'a>> {
    let mut segments = Vec::new();
    while index != 0 {
        let (parent, segment) = nodes[index];
        segments.push(segment);
        index = parent;
    }
    segments.reverse();
    segments
}

/// The RFC 6901 JSON Pointer of `segments` (`/a/0/b`; `/` alone is never
/// produced, the root is the empty pointer, shown as `(root)`), cut at
/// [`MAX_POINTER_CHARS`].
fn pointer(segments: &[Segment<'_>]) -> String {
    let mut text = String::new();
    for segment in segments {
        text.push('/');
        match segment {
            Segment::Root => {}
            Segment::Key(key) => text.push_str(&key.replace('~', "~0").replace('/', "~1")),
            Segment::Index(position) => text.push_str(&position.to_string()),
        }
    }
    if text.is_empty() {
        return "(root)".to_owned();
    }
    if text.chars().count() > MAX_POINTER_CHARS {
        text = text.chars().take(MAX_POINTER_CHARS).collect();
        text.push('…');
    }
    text
}

fn value_number_problem(number: &serde_json::Number) -> Option<&'static str> {
    let beyond = if let Some(unsigned) = number.as_u64() {
        unsigned > MAX_SAFE_INTEGER
    } else if let Some(signed) = number.as_i64() {
        signed.unsigned_abs() > MAX_SAFE_INTEGER
    } else {
        // A double: exact by construction, but an integral one beyond the
        // safe range stands for many integers at once.
        number
            .as_f64()
            .is_some_and(|float| float.abs() > MAX_SAFE_FLOAT)
    };
    beyond.then_some(OUTSIDE_SAFE_RANGE)
}

const OUTSIDE_SAFE_RANGE: &str = "is outside ±(2^53-1)";

/// Why the number literal `text` is not I-JSON, if it is not: its value must
/// be exactly the decimal value of the shortest spelling of the double nearest
/// to it, and within ±(2^53−1) when it is that large (every double beyond is
/// an integer, spaced more than 1 apart).
fn literal_problem(text: &str) -> Option<&'static str> {
    let Ok(float) = text.parse::<f64>() else {
        return Some("is not a number");
    };
    if !float.is_finite() {
        return Some("overflows a double");
    }
    if float.abs() > MAX_SAFE_FLOAT {
        return Some(OUTSIDE_SAFE_RANGE);
    }
    if Decimal::parse(text) != Decimal::parse(&format!("{float:e}")) {
        return Some(if float == 0.0 {
            "underflows to zero"
        } else {
            "has more precision than a double"
        });
    }
    None
}

/// A decimal number's exact value: sign, significant digits without leading
/// or trailing zeros, and a power of ten. Zero is one value whatever its sign.
#[derive(Debug, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    digits: String,
    exponent: i64,
}

/// Exponents are clamped to this magnitude so arithmetic on them cannot
/// overflow; a literal that large has already overflowed or underflowed a
/// double and is refused for that.
const MAX_EXPONENT_MAGNITUDE: i64 = 1 << 40;

impl Decimal {
    /// Reads a JSON number literal (or Rust's `{:e}` spelling of a double).
    fn parse(text: &str) -> Self {
        let (negative, unsigned) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exponent_text) = match unsigned.find(['e', 'E']) {
            Some(at) => (&unsigned[..at], &unsigned[at + 1..]),
            None => (unsigned, "0"),
        };
        let exponent = exponent_text.parse::<i64>().unwrap_or_else(|_| {
            if exponent_text.starts_with('-') {
                -MAX_EXPONENT_MAGNITUDE
            } else {
                MAX_EXPONENT_MAGNITUDE
            }
        });
        let exponent = exponent.clamp(-MAX_EXPONENT_MAGNITUDE, MAX_EXPONENT_MAGNITUDE);
        let (integer, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let all = format!("{integer}{fraction}");
        let significant = all.trim_start_matches('0');
        let digits = significant.trim_end_matches('0');
        if digits.is_empty() {
            return Self {
                negative: false,
                digits: String::new(),
                exponent: 0,
            };
        }
        // Lengths are bounded by the body limit, far below i64::MAX.
        let length = |text: &str| i64::try_from(text.len()).unwrap_or(MAX_EXPONENT_MAGNITUDE);
        let trailing = length(significant) - length(digits);
        Self {
            negative,
            digits: digits.to_owned(),
            exponent: exponent - length(fraction) + trailing,
        }
    }
}

/// One open container while scanning raw JSON.
enum Frame {
    Object {
        names: std::collections::HashSet<String>,
        member: Option<String>,
        expect_name: bool,
    },
    Array {
        position: usize,
    },
}

fn frames_pointer(frames: &[Frame]) -> String {
    let segments: Vec<Segment<'_>> = frames
        .iter()
        .map(|frame| match frame {
            Frame::Object { member, .. } => Segment::Key(member.as_deref().unwrap_or("")),
            Frame::Array { position } => Segment::Index(*position),
        })
        .collect();
    pointer(&segments)
}

/// Scans well-formed JSON text for duplicate member names and numbers that
/// are not I-JSON. Iterative: nesting costs heap, not stack.
fn scan_raw(bytes: &[u8]) -> Result<()> {
    let mut frames: Vec<Frame> = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        match bytes[at] {
            b'{' => {
                frames.push(Frame::Object {
                    names: std::collections::HashSet::new(),
                    member: None,
                    expect_name: true,
                });
                at += 1;
            }
            b'[' => {
                frames.push(Frame::Array { position: 0 });
                at += 1;
            }
            b'}' | b']' => {
                frames.pop();
                at += 1;
            }
            b',' => {
                match frames.last_mut() {
                    Some(Frame::Object { expect_name, .. }) => *expect_name = true,
                    Some(Frame::Array { position }) => *position += 1,
                    None => {}
                }
                at += 1;
            }
            b'"' => {
                let end = string_end(bytes, at);
                let mut duplicate = false;
                if let Some(Frame::Object {
                    names,
                    member,
                    expect_name,
                }) = frames.last_mut()
                {
                    if *expect_name {
                        let name: String = serde_json::from_slice(&bytes[at..end])
                            .map_err(|e| Error::invalid(format!("malformed JSON: {e}")))?;
                        *expect_name = false;
                        duplicate = !names.insert(name.clone());
                        *member = Some(name);
                    }
                }
                if duplicate {
                    return Err(Error::invalid(format!(
                        "duplicate member name at {}",
                        frames_pointer(&frames)
                    )));
                }
                at = end;
            }
            b'-' | b'0'..=b'9' => {
                let end = bytes[at..]
                    .iter()
                    .position(|b| !matches!(b, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
                    .map_or(bytes.len(), |length| at + length);
                let text = std::str::from_utf8(&bytes[at..end]).expect("a number literal is ASCII");
                if let Some(problem) = literal_problem(text) {
                    return Err(Error::invalid(format!(
                        "number at {} {problem}",
                        frames_pointer(&frames)
                    )));
                }
                at = end;
            }
            // Whitespace, `:` and the literals true, false and null.
            _ => at += 1,
        }
    }
    Ok(())
}

/// The index just past the closing quote of the string opening at `start`.
fn string_end(bytes: &[u8], start: usize) -> usize {
    let mut at = start + 1;
    while at < bytes.len() {
        match bytes[at] {
            b'\\' => at += 2,
            b'"' => return at + 1,
            _ => at += 1,
        }
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_whitespace_and_number_spelling_do_not_matter() {
        let a: Value = serde_json::from_str(r#"{"b": 4.50, "a": [1e2, -0]}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"a":[100,0],"b":4.5}"#).unwrap();
        assert_eq!(digest("x", &a).unwrap(), digest("x", &b).unwrap());
        assert_eq!(canonicalize("x", &a).unwrap(), r#"{"a":[100,0],"b":4.5}"#);
    }

    #[test]
    fn different_values_differ() {
        assert_ne!(
            digest("x", &json!({"a": 1})).unwrap(),
            digest("x", &json!({"a": 2})).unwrap()
        );
    }

    #[test]
    fn depth_limit_is_enforced_at_the_limit_plus_one() {
        /// `levels` arrays, one inside the other, around a scalar.
        fn nested(levels: usize) -> Value {
            (0..levels).fold(json!(1), |inner, _| json!([inner]))
        }
        assert_eq!(depth(&json!(1)), 0);
        assert_eq!(depth(&json!([])), 1);
        assert_eq!(depth(&json!({"a": {"b": [1, []]}})), 4);
        assert_eq!(depth(&nested(MAX_JSON_DEPTH)), MAX_JSON_DEPTH);
        // Exactly the limit, with a scalar innermost, is accepted; one more
        // array or object is refused.
        assert!(canonicalize("x", &nested(MAX_JSON_DEPTH)).is_ok());
        let message = canonicalize("x", &nested(MAX_JSON_DEPTH + 1))
            .unwrap_err()
            .to_string();
        assert!(message.contains("nests deeper than 64"), "{message}");
        let mut objects = json!({});
        for _ in 1..MAX_JSON_DEPTH {
            objects = json!({ "k": objects });
        }
        assert!(canonicalize("x", &objects).is_ok());
        assert!(canonicalize("x", &json!({ "k": objects })).is_err());
    }

    #[test]
    fn size_limit_is_enforced() {
        // A string of n bytes canonicalises to n + 2 bytes (the quotes).
        let fits = Value::String("a".repeat(MAX_JSON_BYTES - 2));
        assert!(canonicalize("x", &fits).is_ok());
        let over = Value::String("a".repeat(MAX_JSON_BYTES - 1));
        let err = canonicalize("x", &over).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidRequest);
    }
}

#[cfg(test)]
mod i_json_tests {
    use super::*;
    use serde_json::json;

    fn refusal(text: &str) -> String {
        match parse_i_json(text.as_bytes()) {
            Ok(value) => panic!("{text} was accepted as {value}"),
            Err(error) => {
                assert_eq!(error.kind(), crate::ErrorKind::InvalidRequest, "{text}");
                error.to_string()
            }
        }
    }

    #[test]
    fn integers_beyond_the_safe_range_are_refused_with_their_path() {
        // The reported collision: 2^53 + 1 read back as 2^53.
        let message = refusal(r#"{"order":9007199254740993}"#);
        assert!(message.contains("/order"), "{message}");
        assert!(message.contains("2^53"), "{message}");
        refusal(r#"{"order":9007199254740992}"#);
        refusal("18446744073709551616"); // 2^64
        refusal("18446744073709551615"); // 2^64 - 1
        refusal("-9007199254740992");
        refusal("1e300");
        refusal("9007199254740993.0");
        // The edges of the range are exact and accepted.
        assert_eq!(
            parse_i_json(b"[9007199254740991,-9007199254740991]").unwrap(),
            json!([9_007_199_254_740_991_i64, -9_007_199_254_740_991_i64])
        );
    }

    #[test]
    fn numbers_a_double_cannot_hold_are_refused() {
        let message = refusal(r#"{"a":[0,{"b":1e-400}]}"#);
        assert!(message.contains("/a/1/b"), "{message}");
        assert!(message.contains("underflows"), "{message}");
        refusal("1e400");
        refusal("-1e400");
        refusal("3.141592653589793238462643383279");
        refusal("0.10000000000000000001");
    }

    #[test]
    fn exact_numbers_in_any_spelling_are_accepted() {
        for text in [
            "0",
            "-0",
            "0.0",
            "1e2",
            "100",
            "4.50",
            "0.1",
            "-2.5e-3",
            "1E+2",
            "5e-324",
            "1.5e-300",
            "0.30000000000000004",
            "123456789.125",
            "9007199254740991.0",
        ] {
            assert!(parse_i_json(text.as_bytes()).is_ok(), "{text}");
        }
        // Accepted spellings still share a digest when they share a value.
        let a = parse_i_json(br#"{"b": 4.50, "a": [1e2, -0]}"#).unwrap();
        let b = parse_i_json(br#"{"a":[100,0],"b":4.5}"#).unwrap();
        assert_eq!(digest("x", &a).unwrap(), digest("x", &b).unwrap());
    }

    #[test]
    fn duplicate_member_names_are_refused_with_their_path() {
        let message = refusal(r#"{"payload":{"a":1,"a":2}}"#);
        assert!(message.contains("duplicate"), "{message}");
        assert!(message.contains("/payload/a"), "{message}");
        // An escape spells the same name.
        let message = refusal(r#"[{"x":[{"a":1,"\u0061":2}]}]"#);
        assert!(message.contains("/0/x/0/a"), "{message}");
        // Pointer escaping of `~` and `/` (RFC 6901).
        let message = refusal(r#"{"a/b~":{"k":1,"k":1}}"#);
        assert!(message.contains("/a~1b~0/k"), "{message}");
        // The same name in sibling objects, or as a string value, is fine.
        assert!(parse_i_json(br#"{"a":{"a":"a"},"b":{"a":["a","a"]},"c":"a"}"#).is_ok());
    }

    #[test]
    fn the_safe_float_is_the_safe_integer() {
        assert_eq!(MAX_SAFE_FLOAT, (MAX_SAFE_INTEGER as f64));
        assert_eq!(MAX_SAFE_FLOAT as u64, MAX_SAFE_INTEGER);
    }

    #[test]
    fn malformed_json_is_refused() {
        refusal(r#"{"a":1"#);
        refusal(r#"{"a":01}"#);
        refusal("");
    }

    #[test]
    fn long_paths_are_cut_so_the_message_stays_short() {
        let key = "k".repeat(10_000);
        let message = refusal(&format!(r#"{{"{key}":1,"{key}":2}}"#));
        assert!(message.len() < 300, "{} bytes", message.len());
    }

    #[test]
    fn values_built_in_memory_are_checked_for_integer_range() {
        assert!(check_i_json("payload", &json!({"n": 9_007_199_254_740_991_u64})).is_ok());
        assert!(check_i_json("payload", &json!({"n": 1.5, "s": "x"})).is_ok());
        for bad in [
            json!({"n": [1, {"m": 9_007_199_254_740_992_u64}]}),
            json!({"n": [1, {"m": u64::MAX}]}),
            json!({"n": [1, {"m": i64::MIN}]}),
            json!({"n": [1, {"m": 1.0e300}]}),
        ] {
            let message = check_i_json("payload", &bad).unwrap_err().to_string();
            assert!(message.contains("payload: number at /n/1/m"), "{message}");
        }
        let call = crate::model::ToolCall::new(
            crate::ids::ToolName::new("t").unwrap(),
            &json!({"order": 9_007_199_254_740_993_u64}),
        );
        assert_eq!(call.unwrap_err().kind(), crate::ErrorKind::InvalidRequest);
    }
}
