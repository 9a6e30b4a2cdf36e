//! The store URL turned into connect options, TLS included.
//!
//! Owns the URL's query parameters: `ssl-mode` (`DISABLED`, `PREFERRED`,
//! `REQUIRED`, `VERIFY_CA`, `VERIFY_IDENTITY`, as in the MySQL client, any
//! case; also spelt `sslmode`), `ssl-ca` (a PEM file of the CA to verify the
//! server against), `ssl-cert` and `ssl-key` (a client certificate and its
//! key, together), and the parameters sqlx itself reads, passed on untouched.
//! Every other parameter is refused: sqlx would ignore it, and a misspelt
//! `ssl-mode` must not quietly mean plaintext.
//!
//! A CA file means the server is checked against it: with no `ssl-mode` the
//! mode is `VERIFY_IDENTITY`; with `REQUIRED` it is `VERIFY_CA`; with a mode
//! that does not insist on TLS the URL is refused. (The same rules as the
//! PostgreSQL store's `sslrootcert`.) Files are checked when the store opens,
//! so a wrong path is an `invalid_request` naming the option, not a failed
//! handshake later.
//!
//! Deliberately absent: the handshake itself (sqlx's rustls, behind this
//! crate's `tls` feature) and the URL in any message, since it may hold a
//! password. Messages name the option, its value or its file path only.

use std::str::FromStr;

use agentgate_core::error::{Error, Result};
use agentgate_store_sql::tls::SslModes;
use sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};

/// The MySQL client's `--ssl-mode`, ours so it can be compared and named in
/// messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disabled,
    Preferred,
    Required,
    VerifyCa,
    VerifyIdentity,
}

impl SslMode {
    fn to_sqlx(self) -> MySqlSslMode {
        match self {
            Self::Disabled => MySqlSslMode::Disabled,
            Self::Preferred => MySqlSslMode::Preferred,
            Self::Required => MySqlSslMode::Required,
            Self::VerifyCa => MySqlSslMode::VerifyCa,
            Self::VerifyIdentity => MySqlSslMode::VerifyIdentity,
        }
    }
}

impl SslModes for SslMode {
    const STORE: &'static str = "mysql";
    /// The MySQL client's spelling.
    const MODES: &'static [(&'static str, Self)] = &[
        ("DISABLED", Self::Disabled),
        ("PREFERRED", Self::Preferred),
        ("REQUIRED", Self::Required),
        ("VERIFY_CA", Self::VerifyCa),
        ("VERIFY_IDENTITY", Self::VerifyIdentity),
    ];
    const MODE_OPTION: &'static str = "ssl-mode";
    const CA_OPTION: &'static str = "ssl-ca";
    const CERT_OPTION: &'static str = "ssl-cert";
    const KEY_OPTION: &'static str = "ssl-key";
    const MODE_KEYS: &'static [&'static str] = &["ssl-mode", "sslmode"];
    const CA_KEYS: &'static [&'static str] = &["ssl-ca", "sslca"];
    const CERT_KEYS: &'static [&'static str] = &["ssl-cert", "sslcert"];
    const KEY_KEYS: &'static [&'static str] = &["ssl-key", "sslkey"];
    const DRIVER_PARAMETERS: &'static [&'static str] = &[
        "charset",
        "collation",
        "statement-cache-capacity",
        "socket",
        "timezone",
        "time-zone",
    ];
    const DISABLED: Self = Self::Disabled;
    const REQUIRED: Self = Self::Required;
    const VERIFY_CA: Self = Self::VerifyCa;
    const VERIFY_FULL: Self = Self::VerifyIdentity;
}

/// The TLS parameters of one URL.
pub(crate) type Tls = agentgate_store_sql::tls::Tls<SslMode>;

/// Parses a `mysql://` or `mariadb://` URL into sqlx's connect options, with
/// the session settings every connection needs (utf8mb4, UTC).
///
/// # Errors
/// `invalid_request` naming the option for an unknown parameter, a bad
/// `ssl-mode`, a CA file with a mode that does not use it, a client
/// certificate without its key (or the reverse), an unreadable or non-PEM
/// file, TLS asked of a build without the `tls` feature, or a malformed URL.
pub(crate) fn connect_options(url: &str) -> Result<MySqlConnectOptions> {
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_owned(),
    };
    let tls = Tls::from_url(&url)?;
    tls.check(SslMode::Preferred, cfg!(feature = "tls"))?;
    let mut options = MySqlConnectOptions::from_str(&url)
        .map_err(|e| Error::invalid(format!("bad mysql url: {e}")))?
        .charset("utf8mb4")
        .timezone(Some(String::from("+00:00")));
    if let Some(mode) = tls.mode {
        options = options.ssl_mode(mode.to_sqlx());
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use agentgate_core::error::ErrorKind;

    use super::*;

    const BASE: &str = "mysql://agent:hunter2@db.example:3306/app";

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
    fn every_client_ssl_mode_is_read_in_either_spelling() {
        for (text, mode) in [
            ("DISABLED", SslMode::Disabled),
            ("preferred", SslMode::Preferred),
            ("REQUIRED", SslMode::Required),
            ("VERIFY_CA", SslMode::VerifyCa),
            ("verify_identity", SslMode::VerifyIdentity),
        ] {
            for key in ["ssl-mode", "sslmode"] {
                let tls = Tls::from_url(&format!("{BASE}?{key}={text}")).expect("valid");
                assert_eq!(tls.mode, Some(mode), "{key}={text}");
            }
        }
        assert_eq!(Tls::from_url(BASE).expect("valid").mode, None);
        let mariadb = connect_options("mariadb://agent:hunter2@db/app?ssl-mode=DISABLED");
        assert!(matches!(
            mariadb.expect("valid").get_ssl_mode(),
            MySqlSslMode::Disabled
        ));
    }

    #[test]
    fn a_bad_ssl_mode_is_refused_by_name() {
        // libpq's spelling is not the MySQL client's.
        let message = refusal(&format!("{BASE}?ssl-mode=verify-full"));
        assert!(
            message.contains("ssl-mode") && message.contains("verify-full"),
            "{message}"
        );
        refusal(&format!("{BASE}?ssl-mode="));
        refusal(&format!("{BASE}?sslmode=ON"));
    }

    #[test]
    fn an_unknown_parameter_is_refused_not_ignored() {
        let message = refusal(&format!("{BASE}?ssl_mode=REQUIRED"));
        assert!(message.contains("\"ssl_mode\""), "{message}");
        connect_options(&format!(
            "{BASE}?statement-cache-capacity=10&ssl-mode=DISABLED"
        ))
        .expect("sqlx parameters pass");
    }

    #[test]
    fn a_ca_file_means_verification() {
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = pem_file(&dir, "ca.pem", "-----BEGIN CERTIFICATE-----\nx\n");
        let mode = |query: &str| Tls::from_url(&format!("{BASE}?{query}")).map(|t| t.mode);
        assert_eq!(
            mode(&format!("ssl-ca={ca}")).expect("valid"),
            Some(SslMode::VerifyIdentity)
        );
        assert_eq!(
            mode(&format!("ssl-mode=REQUIRED&ssl-ca={ca}")).expect("valid"),
            Some(SslMode::VerifyCa)
        );
        assert_eq!(
            mode(&format!("ssl-mode=VERIFY_IDENTITY&sslca={ca}")).expect("valid"),
            Some(SslMode::VerifyIdentity)
        );
        for weak in ["DISABLED", "PREFERRED"] {
            let message = refusal(&format!("{BASE}?ssl-mode={weak}&ssl-ca={ca}"));
            assert!(
                message.contains("ssl-ca") && message.contains(weak),
                "{message}"
            );
        }
    }

    #[test]
    fn tls_files_are_checked_when_opening() {
        let dir = tempfile::tempdir().expect("temp dir");
        let not_pem = pem_file(&dir, "ca.txt", "hello");
        let cert = pem_file(&dir, "cert.pem", "-----BEGIN CERTIFICATE-----\nx\n");
        let key = pem_file(&dir, "key.pem", "-----BEGIN EC PRIVATE KEY-----\nx\n");
        let message = refusal(&format!("{BASE}?ssl-mode=VERIFY_CA&ssl-ca=/nonexistent/ca"));
        assert!(message.contains("ssl-ca") && message.contains("/nonexistent/ca"));
        let message = refusal(&format!("{BASE}?ssl-mode=VERIFY_CA&ssl-ca={not_pem}"));
        assert!(message.contains("no PEM certificate"), "{message}");
        let message = refusal(&format!("{BASE}?ssl-mode=REQUIRED&ssl-cert={cert}"));
        assert!(message.contains("ssl-cert and ssl-key"), "{message}");
        let message = refusal(&format!(
            "{BASE}?ssl-mode=REQUIRED&ssl-cert={cert}&ssl-key={cert}"
        ));
        assert!(message.contains("ssl-key") && message.contains("no PEM private key"));
        let message = refusal(&format!(
            "{BASE}?ssl-mode=DISABLED&ssl-cert={cert}&ssl-key={key}"
        ));
        assert!(message.contains("DISABLED"), "{message}");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn a_checked_url_sets_the_resolved_mode() {
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = pem_file(&dir, "ca.pem", "-----BEGIN CERTIFICATE-----\nx\n");
        let options =
            connect_options(&format!("{BASE}?ssl-mode=REQUIRED&ssl-ca={ca}")).expect("valid");
        assert!(matches!(options.get_ssl_mode(), MySqlSslMode::VerifyCa));
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn tls_without_the_feature_is_refused() {
        let message = refusal(&format!("{BASE}?ssl-mode=REQUIRED"));
        assert!(message.contains("feature `tls`"), "{message}");
        connect_options(&format!("{BASE}?ssl-mode=PREFERRED")).expect("plaintext fallback");
    }
}
