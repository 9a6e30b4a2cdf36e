//! The TLS rules of a SQL store's URL, written once: what a CA file without
//! a mode means, which modes a CA file or a client certificate needs, and
//! that every named file is a readable PEM file of the right kind.
//!
//! A store names its vocabulary through [`SslModes`] (its modes and their
//! spellings, its options' names and aliases, the parameters its driver
//! reads itself); [`Tls::from_url`] reads a URL's parameters by it, refusing
//! any other, and [`Tls::resolve`] applies the rules the same way for every
//! store:
//!
//! - a CA file with no mode verifies the server fully (libpq's and the
//!   MySQL client's rule); with the plain "require TLS" mode it verifies the
//!   CA only; with a mode that does not insist on TLS the URL is refused,
//!   since the server would never be checked against it;
//! - a client certificate and its key go together, and need TLS on.
//!
//! Messages name the option, its value or its file path, never the URL (it
//! may hold a password).

use agentgate_core::error::{Error, Result};
use agentgate_core::limits::MAX_TLS_FILE_BYTES;

/// A store's TLS modes and the names of its TLS options.
pub trait SslModes: Copy + PartialEq + std::fmt::Debug + 'static {
    /// The store, as messages name it (`postgres`, `mysql`).
    const STORE: &'static str;
    /// Every mode with its spelling in the store's own clients, in the
    /// order messages list them. A URL's mode is read in any case.
    const MODES: &'static [(&'static str, Self)];
    /// The mode option's name (`sslmode`, `ssl-mode`).
    const MODE_OPTION: &'static str;
    /// The CA file option's name.
    const CA_OPTION: &'static str;
    /// The client certificate option's name.
    const CERT_OPTION: &'static str;
    /// The client key option's name.
    const KEY_OPTION: &'static str;
    /// The URL parameters read as each option: its name first, then the
    /// other store's spellings a user may bring along.
    const MODE_KEYS: &'static [&'static str];
    /// See [`SslModes::MODE_KEYS`].
    const CA_KEYS: &'static [&'static str];
    /// See [`SslModes::MODE_KEYS`].
    const CERT_KEYS: &'static [&'static str];
    /// See [`SslModes::MODE_KEYS`].
    const KEY_KEYS: &'static [&'static str];
    /// The URL parameters the driver reads itself, passed on untouched.
    const DRIVER_PARAMETERS: &'static [&'static str];
    /// TLS off.
    const DISABLED: Self;
    /// TLS required, the server not verified.
    const REQUIRED: Self;
    /// TLS required, the server's certificate verified against the CA.
    const VERIFY_CA: Self;
    /// TLS required, the CA and the server's name verified.
    const VERIFY_FULL: Self;

    /// Whether the driver reads `key` itself (beyond
    /// [`SslModes::DRIVER_PARAMETERS`], a store may match prefixes).
    fn driver_reads(key: &str) -> bool {
        Self::DRIVER_PARAMETERS.contains(&key)
    }

    /// The mode as the store's own clients spell it.
    fn name(self) -> &'static str {
        Self::MODES
            .iter()
            .find(|(_, mode)| *mode == self)
            .map_or("?", |(name, _)| name)
    }

    /// Whether the connection fails rather than run without TLS.
    fn insists_on_tls(self) -> bool {
        self == Self::REQUIRED || self == Self::VERIFY_CA || self == Self::VERIFY_FULL
    }

    /// Reads a mode in any case.
    ///
    /// # Errors
    /// `invalid_request` naming the option, the value and every mode.
    fn parse(value: &str) -> Result<Self> {
        Self::MODES
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(value))
            .map(|(_, mode)| *mode)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "invalid {} {} {value:?}: expected {}",
                    Self::STORE,
                    Self::MODE_OPTION,
                    either(Self::MODES.iter().map(|(name, _)| *name))
                ))
            })
    }

    /// The modes that insist on TLS, for messages.
    fn insisting() -> String {
        format!(
            "{}={}, {} or {}",
            Self::MODE_OPTION,
            Self::REQUIRED.name(),
            Self::VERIFY_CA.name(),
            Self::VERIFY_FULL.name()
        )
    }
}

/// `a, b or c`.
fn either<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// The TLS parameters of one URL. Paths only, never file contents, so the
/// derived `Debug` holds no secret.
#[derive(Debug, PartialEq, Eq)]
pub struct Tls<M> {
    /// The mode; `None` leaves the driver's default.
    pub mode: Option<M>,
    /// The CA file to verify the server against.
    pub ca: Option<String>,
    /// The client certificate file.
    pub client_cert: Option<String>,
    /// The client certificate's key file.
    pub client_key: Option<String>,
}

impl<M> Default for Tls<M> {
    fn default() -> Self {
        Self {
            mode: None,
            ca: None,
            client_cert: None,
            client_key: None,
        }
    }
}

/// What a TLS file must hold.
#[derive(Clone, Copy, Debug)]
enum Pem {
    Certificate,
    PrivateKey,
}

impl<M: SslModes> Tls<M> {
    /// Reads a URL's TLS parameters ([`SslModes`] names them) and applies
    /// the rules ([`Tls::resolve`]); the driver's own parameters pass, any
    /// other is refused, since the driver would ignore it and a misspelt
    /// mode must not quietly mean plaintext.
    ///
    /// # Errors
    /// `invalid_request` naming the parameter or the option: a malformed
    /// URL (never quoted: it may hold a password), an unknown parameter, a
    /// bad mode, or a combination [`Tls::resolve`] refuses.
    pub fn from_url(url: &str) -> Result<Self> {
        let parsed = url::Url::parse(url)
            .map_err(|e| Error::invalid(format!("bad {} url: {e}", M::STORE)))?;
        let mut tls = Self::default();
        for (key, value) in parsed.query_pairs() {
            let (key, value) = (key.as_ref(), value.into_owned());
            if M::MODE_KEYS.contains(&key) {
                tls.mode = Some(M::parse(&value)?);
            } else if M::CA_KEYS.contains(&key) {
                tls.ca = Some(value);
            } else if M::CERT_KEYS.contains(&key) {
                tls.client_cert = Some(value);
            } else if M::KEY_KEYS.contains(&key) {
                tls.client_key = Some(value);
            } else if !M::driver_reads(key) {
                return Err(Error::invalid(format!(
                    "unknown {} url parameter {key:?}: expected {}, {}, {}, {} or one of {:?}",
                    M::STORE,
                    M::MODE_OPTION,
                    M::CA_OPTION,
                    M::CERT_OPTION,
                    M::KEY_OPTION,
                    M::DRIVER_PARAMETERS
                )));
            }
        }
        tls.resolve()
    }

    /// Applies the rules to the parameters as parsed: the mode a CA file
    /// implies, and the combinations that are refused.
    ///
    /// # Errors
    /// `invalid_request` naming the options.
    pub fn resolve(mut self) -> Result<Self> {
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err(Error::invalid(format!(
                "{} {} and {} go together: give both or neither",
                M::STORE,
                M::CERT_OPTION,
                M::KEY_OPTION
            )));
        }
        self.mode = match (self.mode, self.ca.is_some()) {
            (None, true) => Some(M::VERIFY_FULL),
            (Some(mode), true) if mode == M::REQUIRED => Some(M::VERIFY_CA),
            (Some(mode), true) if !mode.insists_on_tls() => {
                return Err(Error::invalid(format!(
                    "{} {} needs {}: with {}={} the server is never checked against it",
                    M::STORE,
                    M::CA_OPTION,
                    M::insisting(),
                    M::MODE_OPTION,
                    mode.name()
                )))
            }
            (mode, _) => mode,
        };
        if self.client_cert.is_some() && self.mode == Some(M::DISABLED) {
            return Err(Error::invalid(format!(
                "{} {} needs TLS, but {}={} turns it off",
                M::STORE,
                M::CERT_OPTION,
                M::MODE_OPTION,
                M::DISABLED.name()
            )));
        }
        Ok(self)
    }

    /// Checks that every named file is a readable PEM file of its kind, and
    /// that a build without TLS is not asked for it. Synchronous: it runs
    /// once, when the store opens, on files of at most
    /// [`MAX_TLS_FILE_BYTES`].
    ///
    /// # Errors
    /// `invalid_request` naming the option and the path.
    pub fn check(&self, default_mode: M, built_with_tls: bool) -> Result<()> {
        for (option, path, pem) in [
            (M::CA_OPTION, &self.ca, Pem::Certificate),
            (M::CERT_OPTION, &self.client_cert, Pem::Certificate),
            (M::KEY_OPTION, &self.client_key, Pem::PrivateKey),
        ] {
            if let Some(path) = path {
                check_pem_file::<M>(option, path, pem)?;
            }
        }
        let mode = self.mode.unwrap_or(default_mode);
        if !built_with_tls && (mode.insists_on_tls() || self.ca.is_some()) {
            return Err(Error::invalid(format!(
                "{} {} needs TLS, which this build leaves out (cargo feature `tls`)",
                M::STORE,
                M::MODE_OPTION
            )));
        }
        Ok(())
    }
}

fn check_pem_file<M: SslModes>(option: &str, path: &str, pem: Pem) -> Result<()> {
    let bad = |why: String| Error::invalid(format!("{} {option} {path:?}: {why}", M::STORE));
    let bytes = std::fs::metadata(path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if bytes > MAX_TLS_FILE_BYTES {
        return Err(bad(format!("larger than {MAX_TLS_FILE_BYTES} bytes")));
    }
    let text = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let text = String::from_utf8_lossy(&text);
    let (marker, what) = match pem {
        Pem::Certificate => ("-----BEGIN CERTIFICATE-----", "certificate"),
        Pem::PrivateKey => ("PRIVATE KEY-----", "private key"),
    };
    if !text.contains(marker) {
        return Err(bad(format!("no PEM {what} in the file")));
    }
    Ok(())
}
