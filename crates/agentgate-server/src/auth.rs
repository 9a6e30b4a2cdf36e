//! API keys: parsing them from flags and files, and the middleware that
//! requires `Authorization: Bearer <key>` on every `/v1` call when any key is
//! configured.
//!
//! Keys are kept only as SHA-256 digests and compared in constant time
//! (digest against digest, so neither the key's content nor its length leaks
//! through timing). A key never shows in `Debug` output or in logs.

use std::fmt;
use std::path::Path;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::{ApiError, ErrorCode};
use crate::limits::{MAX_API_KEYS, MAX_API_KEY_BYTES, MAX_API_KEY_FILE_BYTES, MIN_API_KEY_BYTES};
use crate::AppState;

/// A configured API key. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Validates a key.
    ///
    /// # Errors
    /// When the key is shorter than [`MIN_API_KEY_BYTES`], longer than
    /// [`MAX_API_KEY_BYTES`], or holds whitespace or control characters
    /// (which a `Bearer` header cannot carry).
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        if key.len() < MIN_API_KEY_BYTES || key.len() > MAX_API_KEY_BYTES {
            return Err(KeyError(format!(
                "an API key must be {MIN_API_KEY_BYTES}..={MAX_API_KEY_BYTES} bytes, one is {}",
                key.len()
            )));
        }
        if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(KeyError(
                "an API key must not contain whitespace or control characters".to_owned(),
            ));
        }
        Ok(Self(key))
    }

    fn digest(&self) -> [u8; 32] {
        Sha256::digest(self.0.as_bytes()).into()
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// A bad API key or key file; the message never contains a key.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct KeyError(String);

/// Reads API keys from a file: one per line; blank lines and lines starting
/// with `#` are skipped, surrounding whitespace is trimmed.
///
/// # Errors
/// When the file cannot be read, is over [`MAX_API_KEY_FILE_BYTES`], or holds
/// an invalid key.
pub fn read_key_file(path: &Path) -> Result<Vec<ApiKey>, KeyError> {
    let shown = path.display();
    let size = std::fs::metadata(path)
        .map_err(|e| KeyError(format!("cannot read API key file {shown}: {e}")))?
        .len();
    if size > MAX_API_KEY_FILE_BYTES {
        return Err(KeyError(format!(
            "API key file {shown} is {size} bytes, the limit is {MAX_API_KEY_FILE_BYTES}"
        )));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| KeyError(format!("cannot read API key file {shown}: {e}")))?;
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| ApiKey::new(line).map_err(|e| KeyError(format!("API key file {shown}: {e}"))))
        .collect()
}

/// The configured keys, as digests. Empty means authentication is off.
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ApiKeys({} configured)", self.digests.len())
    }
}

impl ApiKeys {
    /// Keeps the digests of `keys`.
    ///
    /// # Errors
    /// When more than [`MAX_API_KEYS`] keys are given.
    pub fn new(keys: &[ApiKey]) -> Result<Self, KeyError> {
        if keys.len() > MAX_API_KEYS {
            return Err(KeyError(format!(
                "{} API keys configured, the limit is {MAX_API_KEYS}",
                keys.len()
            )));
        }
        Ok(Self {
            digests: keys.iter().map(ApiKey::digest).collect(),
        })
    }

    /// Whether any key is configured.
    pub fn enabled(&self) -> bool {
        !self.digests.is_empty()
    }

    /// Whether `presented` is one of the keys. Compares against every key
    /// without stopping early, so timing does not tell which one matched.
    pub fn accepts(&self, presented: &str) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        self.digests
            .iter()
            .fold(subtle::Choice::from(0), |found, key| {
                found | key.ct_eq(&digest)
            })
            .into()
    }
}

/// The bearer credential of a request, if it has one.
fn bearer(request: &Request) -> Option<&str> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, key) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// The mark a request carries when its bearer is a recovery key
/// (`--recovery-key`): a recovery worker's, which may claim any user's
/// orphan even where callers are bound to users (`--user-header`).
#[derive(Clone, Copy, Debug)]
pub struct RecoveryRole;

/// Middleware on the `/v1` routes: 401 `unauthorized` unless the request
/// carries a configured key (or none is configured). A recovery key is
/// accepted as an API key too, and marks the request [`RecoveryRole`].
pub async fn require_api_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let keys = state.api_keys();
    let presented = bearer(&request);
    let recovery = presented.is_some_and(|key| state.recovery_keys().accepts(key));
    if keys.enabled() && !recovery && !presented.is_some_and(|key| keys.accepts(key)) {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "this server requires an API key: send Authorization: Bearer <key>",
        ));
    }
    if recovery {
        request.extensions_mut().insert(RecoveryRole);
    }
    Ok(next.run(request).await)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn accepts_only_configured_keys() {
        let a = ApiKey::new("key-aaaaaaaaaaaaaaaa").unwrap();
        let b = ApiKey::new("key-bbbbbbbbbbbbbbbb").unwrap();
        let keys = ApiKeys::new(&[a, b]).unwrap();
        assert!(keys.enabled());
        assert!(keys.accepts("key-aaaaaaaaaaaaaaaa"));
        assert!(keys.accepts("key-bbbbbbbbbbbbbbbb"));
        assert!(!keys.accepts("key-cccccccccccccccc"));
        assert!(!keys.accepts(""));
        assert!(!keys.accepts("key-aaaaaaaaaaaaaaa"));
        assert!(!ApiKeys::default().enabled());
    }

    #[test]
    fn keys_are_never_printed() {
        let key = ApiKey::new("super-secret-key-123").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
        let keys = ApiKeys::new(&[key]).unwrap();
        assert!(!format!("{keys:?}").contains("secret"));
    }

    #[test]
    fn bad_keys_are_refused_without_echoing_them() {
        let short = ApiKey::new("short").unwrap_err();
        assert!(!short.to_string().contains("short"));
        assert!(ApiKey::new("has a space in the key").is_err());
        assert!(ApiKey::new("x".repeat(MAX_API_KEY_BYTES + 1)).is_err());
        assert!(ApiKey::new("x".repeat(MAX_API_KEY_BYTES)).is_ok());
    }

    #[test]
    fn key_files_skip_comments_and_blanks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(
            &path,
            "# rotated 2024\n\n  key-aaaaaaaaaaaaaaaa  \nkey-bbbbbbbbbbbbbbbb\n",
        )
        .unwrap();
        let keys = read_key_file(&path).unwrap();
        assert_eq!(keys.len(), 2);
        std::fs::write(&path, "tiny\n").unwrap();
        assert!(read_key_file(&path).is_err());
        assert!(read_key_file(&dir.path().join("missing")).is_err());
    }
}
