//! Just enough URL handling for the bench: swap a store URL's database,
//! point it at the counting proxy, add or drop a query parameter, and show
//! it without credentials. Values are kept as written (no percent-decoding):
//! the drivers parse the result, the bench only moves parts around.

use crate::error::{BenchError, Result};

/// A `scheme://[userinfo@]host[:port][/path][?query]` URL, split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Url {
    scheme: String,
    userinfo: Option<String>,
    host_port: String,
    path: String,
    query: Vec<(String, String)>,
}

impl Url {
    /// Splits `text`.
    ///
    /// # Errors
    /// `Options` when it has no `scheme://`.
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let (scheme, rest) = text
            .split_once("://")
            .ok_or_else(|| BenchError::Options(format!("{:?} is not a URL", redact(text))))?;
        let (before_query, query) = match rest.split_once('?') {
            Some((before, query)) => (before, query),
            None => (rest, ""),
        };
        let (authority, path) = match before_query.find('/') {
            Some(slash) => (&before_query[..slash], &before_query[slash..]),
            None => (before_query, ""),
        };
        let (userinfo, host_port) = match authority.rfind('@') {
            Some(at) => (Some(authority[..at].to_owned()), &authority[at + 1..]),
            None => (None, authority),
        };
        let query = query
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| match pair.split_once('=') {
                Some((key, value)) => (key.to_owned(), value.to_owned()),
                None => (pair.to_owned(), String::new()),
            })
            .collect();
        Ok(Self {
            scheme: scheme.to_owned(),
            userinfo,
            host_port: host_port.to_owned(),
            path: path.to_owned(),
            query,
        })
    }

    /// `host:port`, with `default_port` when the URL names none; `None` for
    /// a URL without a host (a Unix socket given as a parameter).
    pub(crate) fn host_port(&self, default_port: u16) -> Option<String> {
        if self.host_port.is_empty() {
            return None;
        }
        let has_port = match self.host_port.rfind(']') {
            // `[::1]:5432`: a port follows the bracket.
            Some(bracket) => self.host_port[bracket..].contains(':'),
            None => self.host_port.contains(':'),
        };
        Some(if has_port {
            self.host_port.clone()
        } else {
            format!("{}:{default_port}", self.host_port)
        })
    }

    /// This URL with another database.
    pub(crate) fn with_database(&self, name: &str) -> Self {
        Self {
            path: format!("/{name}"),
            ..self.clone()
        }
    }

    /// This URL with another `host:port`.
    pub(crate) fn with_host_port(&self, host_port: &str) -> Self {
        Self {
            host_port: host_port.to_owned(),
            ..self.clone()
        }
    }

    /// This URL with `key` set to `value` (replacing any earlier value).
    pub(crate) fn with_param(&self, key: &str, value: &str) -> Self {
        let mut url = self.without_param(key);
        url.query.push((key.to_owned(), value.to_owned()));
        url
    }

    /// This URL without `key`.
    pub(crate) fn without_param(&self, key: &str) -> Self {
        let mut url = self.clone();
        url.query.retain(|(k, _)| k != key);
        url
    }

    /// This URL with another scheme.
    pub(crate) fn with_scheme(&self, scheme: &str) -> Self {
        Self {
            scheme: scheme.to_owned(),
            ..self.clone()
        }
    }

    /// The URL as text, credentials included: for drivers only.
    pub(crate) fn to_url_string(&self) -> String {
        self.render(false)
    }

    /// The URL as text with the credentials replaced: for output.
    pub(crate) fn redacted(&self) -> String {
        self.render(true)
    }

    fn render(&self, hide_credentials: bool) -> String {
        let mut text = format!("{}://", self.scheme);
        if let Some(userinfo) = &self.userinfo {
            if hide_credentials {
                text.push('…');
            } else {
                text.push_str(userinfo);
            }
            text.push('@');
        }
        text.push_str(&self.host_port);
        text.push_str(&self.path);
        let mut separator = '?';
        for (key, value) in &self.query {
            text.push(separator);
            text.push_str(key);
            if !value.is_empty() {
                text.push('=');
                text.push_str(value);
            }
            separator = '&';
        }
        text
    }
}

/// `text` without credentials, also when it does not parse.
pub(crate) fn redact(text: &str) -> String {
    match (text.find("://"), text.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}://…{}", &text[..scheme_end], &text[at..])
        }
        _ => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_swapped_and_rendered() {
        let url = Url::parse("postgres://user:p@ss@db.local/app?sslmode=prefer&x").unwrap();
        assert_eq!(url.host_port(5432).as_deref(), Some("db.local:5432"));
        let moved = url
            .with_database("agentgate_bench_1")
            .with_host_port("127.0.0.1:4000")
            .with_param("sslmode", "disable");
        assert_eq!(
            moved.to_url_string(),
            "postgres://user:p@ss@127.0.0.1:4000/agentgate_bench_1?x&sslmode=disable"
        );
        assert_eq!(
            moved.redacted(),
            "postgres://…@127.0.0.1:4000/agentgate_bench_1?x&sslmode=disable"
        );
    }

    #[test]
    fn ports_and_missing_parts() {
        let url = Url::parse("redis://[::1]:6380").unwrap();
        assert_eq!(url.host_port(6379).as_deref(), Some("[::1]:6380"));
        let url = Url::parse("redis://[::1]/2?key_prefix=a:").unwrap();
        assert_eq!(url.host_port(6379).as_deref(), Some("[::1]:6379"));
        assert_eq!(
            url.without_param("key_prefix").to_url_string(),
            "redis://[::1]/2"
        );
        assert!(Url::parse("not a url").is_err());
        assert_eq!(redact("mysql://root:pw@h/db"), "mysql://…@h/db");
    }
}
