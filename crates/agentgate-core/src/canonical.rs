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

fn depth(value: &Value) -> usize {
    // Iterative so a hostile value cannot overflow the stack measuring itself.
    let mut deepest = 0;
    let mut stack = vec![(value, 1usize)];
    while let Some((node, level)) = stack.pop() {
        deepest = deepest.max(level);
        if level > MAX_JSON_DEPTH {
            break;
        }
        match node {
            Value::Array(items) => stack.extend(items.iter().map(|v| (v, level + 1))),
            Value::Object(map) => stack.extend(map.values().map(|v| (v, level + 1))),
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
}

/// The RFC 8785 canonical form of `value`, checked against the JSON limits.
///
/// # Errors
/// `invalid_request` when `value` nests deeper than [`MAX_JSON_DEPTH`] or its
/// canonical form exceeds [`MAX_JSON_BYTES`]; `what` names the field.
pub fn canonicalize(what: &str, value: &Value) -> Result<String> {
    if depth(value) > MAX_JSON_DEPTH {
        return Err(Error::invalid(format!(
            "{what} nests deeper than {MAX_JSON_DEPTH} levels"
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
        let mut at_limit = json!(1);
        for _ in 1..MAX_JSON_DEPTH {
            at_limit = json!([at_limit]);
        }
        assert!(canonicalize("x", &at_limit).is_ok());
        let over = json!([at_limit]);
        assert!(canonicalize("x", &over).is_err());
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
