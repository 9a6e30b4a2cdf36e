//! The store URL turned into connect options, TLS included.
//!
//! Owns the URL's query parameters: `sslmode` (`disable`, `allow`, `prefer`,
//! `require`, `verify-ca`, `verify-full`, as in libpq), `sslrootcert` (a PEM
//! file of the CA to verify the server against), `sslcert` and `sslkey` (a
//! client certificate and its key, together), and the parameters sqlx itself
//! reads, passed on untouched. Every other parameter is refused: sqlx would
//! ignore it, and a misspelt `sslmode` must not quietly mean plaintext.
//!
//! A CA file means the server is checked against it: with no `sslmode` the
//! mode is `verify-full`; with `require` it is `verify-ca` (libpq's rule);
//! with a mode that does not insist on TLS the URL is refused. Files are
//! checked when the store opens, so a wrong path is an `invalid_request`
//! naming the option, not a failed handshake later.
//!
//! Deliberately absent: the handshake itself (sqlx's rustls, behind this
//! crate's `tls` feature) and the URL in any message, since it may hold a
//! password. Messages name the option, its value or its file path only.

use std::str::FromStr;

use agentgate_core::error::{Error, Result};
use agentgate_store_sql::tls::SslModes;
use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// libpq's `sslmode`, ours so it can be compared and named in messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn to_sqlx(self) -> PgSslMode {
        match self {
            Self::Disable => PgSslMode::Disable,
            Self::Allow => PgSslMode::Allow,
            Self::Prefer => PgSslMode::Prefer,
            Self::Require => PgSslMode::Require,
            Self::VerifyCa => PgSslMode::VerifyCa,
            Self::VerifyFull => PgSslMode::VerifyFull,
        }
    }
}

impl SslModes for SslMode {
    const STORE: &'static str = "postgres";
    /// libpq's spelling.
    const MODES: &'static [(&'static str, Self)] = &[
        ("disable", Self::Disable),
        ("allow", Self::Allow),
        ("prefer", Self::Prefer),
        ("require", Self::Require),
        ("verify-ca", Self::VerifyCa),
        ("verify-full", Self::VerifyFull),
    ];
    const MODE_OPTION: &'static str = "sslmode";
    const CA_OPTION: &'static str = "sslrootcert";
    const CERT_OPTION: &'static str = "sslcert";
    const KEY_OPTION: &'static str = "sslkey";
    const MODE_KEYS: &'static [&'static str] = &["sslmode", "ssl-mode"];
    const CA_KEYS: &'static [&'static str] = &["sslrootcert", "ssl-root-cert", "ssl-ca"];
    const CERT_KEYS: &'static [&'static str] = &["sslcert", "ssl-cert"];
    const KEY_KEYS: &'static [&'static str] = &["sslkey", "ssl-key"];
    const DRIVER_PARAMETERS: &'static [&'static str] = &[
        "statement-cache-capacity",
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "application_name",
        "options",
    ];
    const DISABLED: Self = Self::Disable;
    const REQUIRED: Self = Self::Require;
    const VERIFY_CA: Self = Self::VerifyCa;
    const VERIFY_FULL: Self = Self::VerifyFull;

    /// `options[...]` too, matched by prefix.
    fn driver_reads(key: &str) -> bool {
        Self::DRIVER_PARAMETERS.contains(&key) || key.starts_with("options[")
    }
}

/// The TLS parameters of one URL.
pub(crate) type Tls = agentgate_store_sql::tls::Tls<SslMode>;

/// Parses a `postgres://` URL into sqlx's connect options.
///
/// # Errors
/// `invalid_request` naming the option for an unknown parameter, a bad
/// `sslmode`, a CA file with a mode that does not use it, a client
/// certificate without its key (or the reverse), an unreadable or non-PEM
/// file, TLS asked of a build without the `tls` feature, or a malformed URL.
pub(crate) fn connect_options(url: &str) -> Result<PgConnectOptions> {
    let tls = Tls::from_url(url)?;
    tls.check(SslMode::Prefer, cfg!(feature = "tls"))?;
    let mut options = PgConnectOptions::from_str(url)
        .map_err(|e| Error::invalid(format!("bad postgres url: {e}")))?;
    if let Some(mode) = tls.mode {
        options = options.ssl_mode(mode.to_sqlx());
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use agentgate_core::error::ErrorKind;

    use super::*;

    const BASE: &str = "postgres://agent:hunter2@db.example:5432/app";

    fn pem_file(dir: &tempfile::TempDir, name: &str, body: &str) -> String {
        let path = dir.path().join(name);
        std::fs::write(&path, body).expect("write a test file");
        path.to_str().expect("utf-8 temp path").to_owned()
    }

    fn refusal(url: &str) -> String {
        let error = connect_options(url).expect_err("refused");
        assert_eq!(error.kind(), ErrorKind::InvalidRequest, "{error}");
        let message = error.to_string();
        assert!(!message.contains("hunter2"), "password in {message:?}");
        message
    }

    #[test]
    fn every_libpq_sslmode_is_read() {
        for (text, mode) in [
            ("disable", SslMode::Disable),
            ("allow", SslMode::Allow),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
            ("verify-ca", SslMode::VerifyCa),
            ("VERIFY-FULL", SslMode::VerifyFull),
        ] {
            let tls = Tls::from_url(&format!("{BASE}?sslmode={text}")).expect("valid");
            assert_eq!(tls.mode, Some(mode), "{text}");
        }
        assert_eq!(Tls::from_url(BASE).expect("valid").mode, None);
    }

    #[test]
    fn a_bad_sslmode_is_refused_by_name() {
        let message = refusal(&format!("{BASE}?sslmode=required"));
        assert!(
            message.contains("sslmode") && message.contains("required"),
            "{message}"
        );
        refusal(&format!("{BASE}?sslmode="));
    }

    #[test]
    fn an_unknown_parameter_is_refused_not_ignored() {
        let message = refusal(&format!("{BASE}?sslmod=require"));
        assert!(message.contains("\"sslmod\""), "{message}");
        // sqlx's own parameters still pass.
        let url = format!("{BASE}?application_name=x&options[search_path]=s&sslmode=disable");
        connect_options(&url).expect("sqlx parameters pass");
    }

    #[test]
    fn a_ca_file_means_verification() {
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = pem_file(&dir, "ca.pem", "-----BEGIN CERTIFICATE-----\nx\n");
        let mode = |query: &str| Tls::from_url(&format!("{BASE}?{query}")).map(|t| t.mode);
        assert_eq!(
            mode(&format!("sslrootcert={ca}")).expect("valid"),
            Some(SslMode::VerifyFull)
        );
        assert_eq!(
            mode(&format!("sslmode=require&sslrootcert={ca}")).expect("valid"),
            Some(SslMode::VerifyCa)
        );
        assert_eq!(
            mode(&format!("sslmode=verify-ca&sslrootcert={ca}")).expect("valid"),
            Some(SslMode::VerifyCa)
        );
        for weak in ["disable", "allow", "prefer"] {
            let message = refusal(&format!("{BASE}?sslmode={weak}&sslrootcert={ca}"));
            assert!(message.contains("sslrootcert"), "{message}");
        }
    }

    #[test]
    fn tls_files_are_checked_when_opening() {
        let dir = tempfile::tempdir().expect("temp dir");
        let not_pem = pem_file(&dir, "ca.txt", "hello");
        let key = pem_file(&dir, "key.pem", "-----BEGIN PRIVATE KEY-----\nx\n");
        let message = refusal(&format!(
            "{BASE}?sslmode=verify-full&sslrootcert=/nonexistent/ca"
        ));
        assert!(message.contains("sslrootcert") && message.contains("/nonexistent/ca"));
        let message = refusal(&format!("{BASE}?sslmode=verify-full&sslrootcert={not_pem}"));
        assert!(message.contains("no PEM certificate"), "{message}");
        let message = refusal(&format!("{BASE}?sslmode=require&sslkey={key}"));
        assert!(message.contains("sslcert and sslkey"), "{message}");
        let message = refusal(&format!(
            "{BASE}?sslmode=require&sslcert={key}&sslkey={key}"
        ));
        assert!(message.contains("sslcert") && message.contains("no PEM certificate"));
    }

    #[cfg(feature = "tls")]
    #[test]
    fn a_checked_url_sets_the_resolved_mode() {
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = pem_file(&dir, "ca.pem", "-----BEGIN CERTIFICATE-----\nx\n");
        let options =
            connect_options(&format!("{BASE}?sslmode=require&sslrootcert={ca}")).expect("valid");
        assert!(matches!(options.get_ssl_mode(), PgSslMode::VerifyCa));
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn tls_without_the_feature_is_refused() {
        let message = refusal(&format!("{BASE}?sslmode=require"));
        assert!(message.contains("feature `tls`"), "{message}");
        connect_options(&format!("{BASE}?sslmode=prefer")).expect("plaintext fallback");
    }
}
