//! The Redis URL turned into a client, TLS included.
//!
//! Owns the URL's query parameters: `key_prefix` (where the layer's keys
//! live), and for a `rediss://` URL `ca_file` (a PEM file of the CA to verify
//! the server against, instead of Mozilla's roots) and `cert_file` with
//! `key_file` (a client certificate and its key, together). redis-rs's own
//! `protocol` and `db` pass on untouched; every other parameter is refused,
//! so a misspelt option is an error rather than silently ignored.
//!
//! A `rediss://` connection always verifies the server's certificate and
//! host name (redis-rs's `#insecure` fragment is not built in). Files are
//! read when the layer opens, so a wrong path is an `invalid_request` naming
//! the option, not a failed handshake later.
//!
//! Deliberately absent: the handshake itself (redis-rs's rustls, behind this
//! crate's `tls` feature) and the URL in any message, since it may hold a
//! password. Messages name the option and its file path only.

use agentgate_core::error::{Error, Result};
#[cfg(feature = "tls")]
use agentgate_core::limits::MAX_TLS_FILE_BYTES;
use agentgate_core::limits::{
    REDIS_KEEPALIVE_IDLE, REDIS_KEEPALIVE_INTERVAL, REDIS_KEEPALIVE_PROBES,
};
use redis::IntoConnectionInfo as _;

/// Key prefix unless the URL's `key_prefix` parameter says otherwise.
pub const DEFAULT_KEY_PREFIX: &str = "agentgate:";

/// Longest key prefix accepted: keys stay short and indexable.
const MAX_KEY_PREFIX_BYTES: usize = 64;

/// Query parameters redis-rs reads itself; passed on untouched.
const REDIS_PARAMETERS: &[&str] = &["protocol", "db"];

/// A Redis URL with this crate's parameters taken out.
#[derive(PartialEq, Eq)]
pub(crate) struct Parsed {
    /// The URL for redis-rs, without `key_prefix` and the TLS files.
    pub(crate) url: String,
    pub(crate) prefix: String,
    pub(crate) tls: bool,
    pub(crate) ca_file: Option<String>,
    pub(crate) cert_file: Option<String>,
    pub(crate) key_file: Option<String>,
}

impl std::fmt::Debug for Parsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: it may hold a password.
        f.debug_struct("Parsed")
            .field("prefix", &self.prefix)
            .field("tls", &self.tls)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

/// Splits this crate's parameters off a Redis URL and checks them.
///
/// # Errors
/// `invalid_request` naming the option for an unknown parameter, a bad
/// `key_prefix`, TLS files on a plain `redis://` URL, a client certificate
/// without its key (or the reverse), or a malformed URL.
pub(crate) fn parse(url: &str) -> Result<Parsed> {
    let mut parsed =
        url::Url::parse(url).map_err(|e| Error::invalid(format!("bad redis url: {e}")))?;
    let mut out = Parsed {
        url: String::new(),
        prefix: DEFAULT_KEY_PREFIX.to_owned(),
        tls: parsed.scheme() == "rediss",
        ca_file: None,
        cert_file: None,
        key_file: None,
    };
    let mut kept = Vec::new();
    for (key, value) in parsed.query_pairs() {
        let value = value.into_owned();
        match key.as_ref() {
            "key_prefix" => out.prefix = value,
            "ca_file" => out.ca_file = Some(value),
            "cert_file" => out.cert_file = Some(value),
            "key_file" => out.key_file = Some(value),
            known if REDIS_PARAMETERS.contains(&known) => kept.push((key.into_owned(), value)),
            unknown => {
                return Err(Error::invalid(format!(
                    "unknown redis url parameter {unknown:?}: expected key_prefix, ca_file, \
                     cert_file, key_file, protocol or db"
                )))
            }
        }
    }
    check_prefix(&out.prefix)?;
    let any_file = out.ca_file.is_some() || out.cert_file.is_some() || out.key_file.is_some();
    if any_file && !out.tls {
        return Err(Error::invalid(
            "redis ca_file, cert_file and key_file need a rediss:// (TLS) url",
        ));
    }
    if out.cert_file.is_some() != out.key_file.is_some() {
        return Err(Error::invalid(
            "redis cert_file and key_file go together: give both or neither",
        ));
    }
    if kept.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(kept);
    }
    out.url = parsed.into();
    Ok(out)
}

fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty()
        || prefix.len() > MAX_KEY_PREFIX_BYTES
        || prefix.chars().any(char::is_control)
    {
        return Err(Error::invalid(format!(
            "redis key_prefix must be 1-{MAX_KEY_PREFIX_BYTES} bytes without control characters"
        )));
    }
    Ok(())
}

/// Builds the client for a parsed URL, reading its TLS files.
///
/// # Errors
/// `invalid_request` for an unreadable or non-PEM file, a `rediss://` URL in
/// a build without the `tls` feature, or a URL redis-rs refuses.
pub(crate) fn client(parsed: &Parsed) -> Result<redis::Client> {
    let bad_url = |e: redis::RedisError| Error::invalid(format!("bad redis url: {e}"));
    if !parsed.tls {
        return redis::Client::open(connection_info(parsed).map_err(bad_url)?).map_err(bad_url);
    }
    tls_client(parsed)
}

/// The URL's connection, with TCP keepalive probes
/// ([`REDIS_KEEPALIVE_IDLE`], [`REDIS_KEEPALIVE_INTERVAL`],
/// [`REDIS_KEEPALIVE_PROBES`]) and `TCP_NODELAY` on every socket.
fn connection_info(parsed: &Parsed) -> redis::RedisResult<redis::ConnectionInfo> {
    use redis::io::tcp::{socket2::TcpKeepalive, TcpSettings};
    let keepalive = TcpKeepalive::new().with_time(REDIS_KEEPALIVE_IDLE);
    #[cfg(target_os = "linux")]
    let keepalive = keepalive
        .with_interval(REDIS_KEEPALIVE_INTERVAL)
        .with_retries(REDIS_KEEPALIVE_PROBES);
    #[cfg(not(target_os = "linux"))]
    let _ = (REDIS_KEEPALIVE_INTERVAL, REDIS_KEEPALIVE_PROBES);
    let settings = TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    Ok(parsed
        .url
        .as_str()
        .into_connection_info()?
        .set_tcp_settings(settings))
}

#[cfg(feature = "tls")]
fn tls_client(parsed: &Parsed) -> Result<redis::Client> {
    // redis-rs asks rustls for the process's default crypto provider, which
    // rustls can only pick by itself when exactly one is compiled in. Ring is
    // installed unless the process already chose one; then that one stays.
    let _already_chosen = rustls::crypto::ring::default_provider().install_default();
    let read = |option: &str, path: &Option<String>, pem: Pem| {
        path.as_deref()
            .map(|path| read_pem_file(option, path, pem))
            .transpose()
    };
    let root_cert = read("ca_file", &parsed.ca_file, Pem::Certificate)?;
    let client_cert = read("cert_file", &parsed.cert_file, Pem::Certificate)?;
    let client_key = read("key_file", &parsed.key_file, Pem::PrivateKey)?;
    let client_tls = match (client_cert, client_key) {
        (Some(client_cert), Some(client_key)) => Some(redis::ClientTlsConfig {
            client_cert,
            client_key,
        }),
        _ => None,
    };
    let certificates = redis::TlsCertificates {
        client_tls,
        root_cert,
    };
    let info =
        connection_info(parsed).map_err(|e| Error::invalid(format!("bad redis url: {e}")))?;
    redis::Client::build_with_tls(info, certificates)
        .map_err(|e| Error::invalid(format!("bad redis url or tls file: {e}")))
}

#[cfg(not(feature = "tls"))]
fn tls_client(_parsed: &Parsed) -> Result<redis::Client> {
    Err(Error::invalid(
        "rediss:// needs TLS, which this build leaves out (cargo feature `tls`)",
    ))
}

/// What a TLS file must hold.
#[cfg(feature = "tls")]
#[derive(Clone, Copy)]
enum Pem {
    Certificate,
    PrivateKey,
}

/// Reads `path`, a PEM file of the expected kind.
///
/// Synchronous: it runs once, when the layer opens, on a file of at most
/// [`MAX_TLS_FILE_BYTES`].
#[cfg(feature = "tls")]
fn read_pem_file(option: &str, path: &str, pem: Pem) -> Result<Vec<u8>> {
    let bad = |why: String| Error::invalid(format!("redis {option} {path:?}: {why}"));
    let bytes = std::fs::metadata(path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if bytes > MAX_TLS_FILE_BYTES {
        return Err(bad(format!("larger than {MAX_TLS_FILE_BYTES} bytes")));
    }
    let contents = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let (marker, what) = match pem {
        Pem::Certificate => ("-----BEGIN CERTIFICATE-----", "certificate"),
        Pem::PrivateKey => ("PRIVATE KEY-----", "private key"),
    };
    if !String::from_utf8_lossy(&contents).contains(marker) {
        return Err(bad(format!("no PEM {what} in the file")));
    }
    Ok(contents)
}

#[cfg(test)]
mod tests {
    use agentgate_core::error::ErrorKind;

    use super::*;

    fn refusal(url: &str) -> String {
        let error = parse(url).and_then(|p| client(&p)).expect_err("refused");
        assert_eq!(error.kind(), ErrorKind::InvalidRequest, "{error}");
        let message = error.to_string();
        assert!(!message.contains("hunter2"), "password in {message:?}");
        message
    }

    #[test]
    fn key_prefix_is_split_off_the_url() {
        let plain = parse("redis://127.0.0.1:6379/0").expect("valid");
        assert_eq!(plain.url, "redis://127.0.0.1:6379/0");
        assert_eq!(plain.prefix, DEFAULT_KEY_PREFIX);
        assert!(!plain.tls);
        let prefixed = parse("redis://h/0?key_prefix=t1:&protocol=resp3").expect("valid");
        assert_eq!(prefixed.url, "redis://h/0?protocol=resp3");
        assert_eq!(prefixed.prefix, "t1:");
        assert!(parse("redis://h/0?key_prefix=").is_err());
    }

    #[test]
    fn tls_files_are_split_off_a_rediss_url() {
        let parsed = parse("rediss://:hunter2@h:6380/0?ca_file=/etc/ca%20dir/ca.pem&key_prefix=p:")
            .expect("valid");
        assert_eq!(parsed.url, "rediss://:hunter2@h:6380/0");
        assert!(parsed.tls);
        assert_eq!(parsed.ca_file.as_deref(), Some("/etc/ca dir/ca.pem"));
        assert_eq!(parsed.prefix, "p:");
        let shown = format!("{parsed:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn misplaced_or_unknown_options_are_refused_by_name() {
        let message = refusal("redis://:hunter2@h/0?ca_file=/ca.pem");
        assert!(
            message.contains("ca_file") && message.contains("rediss://"),
            "{message}"
        );
        let message = refusal("rediss://:hunter2@h/0?cafile=/ca.pem");
        assert!(message.contains("\"cafile\""), "{message}");
        let message = refusal("rediss://:hunter2@h/0?cert_file=/c.pem");
        assert!(message.contains("cert_file and key_file"), "{message}");
    }

    #[cfg(feature = "tls")]
    #[test]
    fn tls_files_are_read_when_opening() {
        let dir = tempfile::tempdir().expect("temp dir");
        let not_pem = dir.path().join("ca.txt");
        std::fs::write(&not_pem, "hello").expect("write a test file");
        let message = refusal("rediss://:hunter2@h/0?ca_file=/nonexistent/ca.pem");
        assert!(message.contains("ca_file") && message.contains("/nonexistent/ca.pem"));
        let url = format!("rediss://:hunter2@h/0?ca_file={}", not_pem.display());
        let message = refusal(&url);
        assert!(message.contains("no PEM certificate"), "{message}");
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn rediss_without_the_feature_is_refused() {
        let message = refusal("rediss://:hunter2@h/0");
        assert!(message.contains("feature `tls`"), "{message}");
    }
}
