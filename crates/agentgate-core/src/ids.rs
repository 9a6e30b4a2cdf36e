//! Validated identifiers and the secret lease token.
//!
//! Caller-chosen ids ([`UserId`], [`SessionId`], [`ClientRequestId`],
//! [`ToolName`]) are 1–[`MAX_ID_BYTES`] bytes with no control characters.
//! Engine-minted ids ([`TurnId`], [`ExecutionId`]) are random. A
//! [`LeaseToken`] never shows in `Debug` or `Display`: stores keep only its
//! SHA-256 ([`LeaseToken::digest_hex`]).

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::limits::MAX_ID_BYTES;

fn check_id(what: &'static str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(format!("{what} must not be empty")));
    }
    if value.len() > MAX_ID_BYTES {
        return Err(Error::invalid(format!(
            "{what} is {} bytes, the limit is {MAX_ID_BYTES}",
            value.len()
        )));
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
            /// `invalid_request` when empty, over the byte limit, or holding
            /// control characters.
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
    /// # Errors
    /// `invalid_request` when empty or over the id byte limit.
    pub fn parse(value: impl Into<String>) -> Result<Self> {
        let value = value.into();
        check_id("lease token", &value)?;
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
    fn ids_enforce_byte_limits_and_reject_control_characters() {
        assert!(UserId::new("u").is_ok());
        assert!(UserId::new("x".repeat(MAX_ID_BYTES)).is_ok());
        let over = UserId::new("x".repeat(MAX_ID_BYTES + 1)).unwrap_err();
        assert_eq!(over.kind(), crate::ErrorKind::InvalidRequest);
        assert!(SessionId::new("").is_err());
        assert!(SessionId::new("a\nb").is_err());
        // 43 three-byte characters = 129 bytes: the limit is bytes, not chars.
        assert!(ClientRequestId::new("中".repeat(43)).is_err());
        assert!(ClientRequestId::new("中".repeat(42)).is_ok());
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
