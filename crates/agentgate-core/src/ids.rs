//! Validated identifiers and the secret lease token.
//!
//! Caller-chosen ids ([`UserId`], [`SessionId`], [`ClientRequestId`],
//! [`ToolName`]) are 1–[`MAX_ID_CHARS`] characters (Unicode scalar values,
//! as JSON Schema's `maxLength` counts them), none of them a control
//! character (Unicode category Cc: U+0000–U+001F, U+007F–U+009F). Engine-minted
//! ids ([`TurnId`], [`ExecutionId`]) are random. A [`LeaseToken`] is 1–128
//! printable ASCII characters without spaces, never shows in `Debug` or
//! `Display`, and stores keep only its SHA-256 ([`LeaseToken::digest_hex`]).

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::limits::MAX_ID_CHARS;

fn check_id(what: &'static str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(format!("{what} must not be empty")));
    }
    // Bytes bound characters from above: count only when it can matter.
    if value.len() > MAX_ID_CHARS {
        let chars = value.chars().count();
        if chars > MAX_ID_CHARS {
            return Err(Error::invalid(format!(
                "{what} is {chars} characters, the limit is {MAX_ID_CHARS}"
            )));
        }
    }
    if value.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "{what} must not contain control characters"
        )));
    }
    Ok(())
}

macro_rules! caller_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Validates and wraps an id.
            ///
            /// # Errors
            /// `invalid_request` when empty, over the character limit, or
            /// holding control characters.
            pub fn new(value: impl Into<String>) -> Result<Self> {
                let value = value.into();
                check_id($what, &value)?;
                Ok(Self(value))
            }

            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let raw = String::deserialize(d)?;
                Self::new(raw).map_err(serde::de::Error::custom)
            }
        }
    };
}

caller_id!(
    /// The account a turn runs for.
    UserId,
    "user_id"
);
caller_id!(
    /// One conversation; bound to its first user.
    SessionId,
    "session_id"
);
caller_id!(
    /// The client's id for one message; with the session it keys a turn.
    ClientRequestId,
    "client_request_id"
);
caller_id!(
    /// The name of a tool; with the turn and the args hash it keys a tool execution.
    ToolName,
    "tool"
);
caller_id!(
    /// A turn id as received from a caller (engine-minted, but validated like any input).
    TurnId,
    "turn_id"
);
caller_id!(
    /// A tool execution id as received from a caller.
    ExecutionId,
    "execution_id"
);

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).expect("the operating system's random source is available");
    bytes
}

impl TurnId {
    /// Mints a fresh random turn id (128 random bits).
    pub fn generate() -> Self {
        Self(format!("turn_{}", hex::encode(random_bytes::<16>())))
    }
}

impl ExecutionId {
    /// Mints a fresh random execution id (128 random bits).
    pub fn generate() -> Self {
        Self(format!("exec_{}", hex::encode(random_bytes::<16>())))
    }
}

/// The secret that proves a lease. 256 random bits, shown only to the holder.
///
/// `Debug` prints `LeaseToken(<redacted>)`; there is no `Display`. Stores keep
/// [`LeaseToken::digest_hex`], so a leaked database does not leak live leases.
#[derive(Clone, PartialEq, Eq)]
pub struct LeaseToken(String);

impl LeaseToken {
    /// Mints a fresh token.
    pub fn generate() -> Self {
        Self(format!("lt_{}", hex::encode(random_bytes::<32>())))
    }

    /// Wraps a token received from a caller.
    ///
    /// Minted tokens are `lt_` and 64 hex digits; any token a store could
    /// know fits in an HTTP header as sent, so the check is exactly that:
    /// 1–[`MAX_ID_CHARS`] printable ASCII characters, no space (`!` to `~`).
    ///
    /// # Errors
    /// `invalid_request` when empty, over the limit, or holding any other
    /// character.
    pub fn parse(value: impl Into<String>) -> Result<Self> {
        let value = value.into();
        if value.is_empty() || value.len() > MAX_ID_CHARS {
            return Err(Error::invalid(format!(
                "a lease token is 1 to {MAX_ID_CHARS} characters, this one {}",
                value.chars().count()
            )));
        }
        if !value.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::invalid(
                "a lease token is printable ASCII without spaces (`!` to `~`)",
            ));
        }
        Ok(Self(value))
    }

    /// The secret itself; hand it only to the holder.
    pub fn expose_secret(&self) -> &str {
        &self.0
    }

    /// SHA-256 of the token, hex: what stores keep and compare.
    pub fn digest_hex(&self) -> String {
        hex::encode(Sha256::digest(self.0.as_bytes()))
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseToken(<redacted>)")
    }
}

/// A fencing token: from one store-wide counter, strictly increasing on every
/// grant, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fence(pub i64);

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_limited_in_characters_and_reject_control_characters() {
        assert!(UserId::new("u").is_ok());
        assert!(UserId::new("x".repeat(MAX_ID_CHARS)).is_ok());
        let over = UserId::new("x".repeat(MAX_ID_CHARS + 1)).unwrap_err();
        assert_eq!(over.kind(), crate::ErrorKind::InvalidRequest);
        assert!(over.to_string().contains("129 characters"), "{over}");
        assert!(SessionId::new("").is_err());
        // Characters, not bytes, as JSON Schema's maxLength counts: 128
        // three-byte and four-byte characters (384 and 512 bytes) fit.
        assert!(ClientRequestId::new("中".repeat(43)).is_ok());
        assert!(ClientRequestId::new("中".repeat(MAX_ID_CHARS)).is_ok());
        assert!(ClientRequestId::new("中".repeat(MAX_ID_CHARS + 1)).is_err());
        assert!(ToolName::new("😀".repeat(MAX_ID_CHARS)).is_ok());
        assert!(ToolName::new("😀".repeat(MAX_ID_CHARS + 1)).is_err());
        // Control characters (Unicode Cc) anywhere are refused, each edge
        // of both ranges; their neighbours are not control characters.
        for control in ['\u{0}', '\t', '\n', '\u{1f}', '\u{7f}', '\u{80}', '\u{9f}'] {
            assert!(
                SessionId::new(format!("a{control}b")).is_err(),
                "{control:?}"
            );
        }
        for fine in [' ', '~', '\u{a0}', '\u{2028}', '\u{feff}', '\u{10ffff}'] {
            assert!(SessionId::new(format!("a{fine}b")).is_ok(), "{fine:?}");
        }
    }

    #[test]
    fn lease_tokens_parse_as_printable_ascii_without_spaces() {
        assert!(LeaseToken::parse("!").is_ok());
        assert!(LeaseToken::parse("~".repeat(MAX_ID_CHARS)).is_ok());
        let minted = LeaseToken::generate();
        assert!(LeaseToken::parse(minted.expose_secret()).is_ok());
        for bad in [
            String::new(),
            "x".repeat(MAX_ID_CHARS + 1),
            "a b".into(),
            "a\tb".into(),
            "a\u{7f}".into(),
            "é".into(),
        ] {
            let error = LeaseToken::parse(bad.clone()).unwrap_err();
            assert_eq!(error.kind(), crate::ErrorKind::InvalidRequest, "{bad:?}");
        }
    }

    #[test]
    fn deserialising_an_id_validates_it() {
        assert!(serde_json::from_str::<UserId>("\"\"").is_err());
        assert_eq!(
            serde_json::from_str::<UserId>("\"alice\"")
                .unwrap()
                .as_str(),
            "alice"
        );
    }

    #[test]
    fn lease_tokens_are_random_and_never_printed() {
        let a = LeaseToken::generate();
        let b = LeaseToken::generate();
        assert_ne!(a, b);
        assert!(a.expose_secret().len() >= 32);
        let shown = format!("{a:?}");
        assert!(!shown.contains(a.expose_secret()));
        assert!(!shown.contains(&a.expose_secret()[3..11]));
        assert_eq!(a.digest_hex().len(), 64);
        assert_ne!(a.digest_hex(), b.digest_hex());
    }
}
