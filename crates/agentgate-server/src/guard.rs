//! Who may call: the `Host` and `Origin` checks that keep web pages
//! elsewhere from driving a server through the user's browser, and the
//! optional trusted user header that binds a caller to one user.
//!
//! The default configuration has no API key and listens on loopback, so
//! without these checks any web page the user opens could POST to
//! `http://127.0.0.1:7700` (cross-site request forgery), or rebind its own
//! name to 127.0.0.1 and read the answers too (DNS rebinding).
//!
//! - `Host` must name an IP address (a rebinding attack needs a name it
//!   controls), `localhost`, the name the server listens on, or an allowed
//!   host (`--allowed-host`). A request without `Host` (not a browser) passes.
//! - `Origin`, when a browser sends it, must be this server itself (its
//!   authority equals the `Host` just checked), or an allowed origin
//!   (`--allowed-origin`). `Origin: null` (sandboxed frames, files) is refused.
//! - JSON bodies must be `application/json` (see `extract::ApiJson`), which a
//!   page elsewhere cannot send without the browser asking first (CORS), and
//!   this server never says yes.
//!
//! What this module does not do: authenticate. The API key
//! ([`crate::auth`]) says which service calls; the user header says which
//! user a trusted front end acts for.

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderName};
use axum::middleware::Next;
use axum::response::Response;

use crate::error::{ApiError, ErrorCode};
use crate::limits::{MAX_ALLOWED_HOSTS, MAX_ALLOWED_ORIGINS};
use crate::AppState;

/// The hosts and origins a server answers besides IP addresses, loopback
/// names and itself.
#[derive(Clone, Debug, Default)]
pub struct OriginPolicy {
    /// Lowercase host names (`agentgate.internal`), or `name:port` to allow
    /// only that port.
    hosts: Vec<String>,
    /// Lowercase origins, `scheme://host[:port]`.
    origins: Vec<String>,
}

/// Why an allow-list entry was refused.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PolicyError(String);

fn lowercase_trimmed(value: &str) -> String {
    value.trim().trim_end_matches('/').to_ascii_lowercase()
}

impl OriginPolicy {
    /// A policy allowing `hosts` (names, or `name:port`) and `origins`
    /// (`http://name[:port]`, `https://…`), plus the host of `listen` (the
    /// listen address, `host:port`).
    ///
    /// # Errors
    /// More than [`MAX_ALLOWED_HOSTS`] hosts or [`MAX_ALLOWED_ORIGINS`]
    /// origins, an empty host, or an origin that is not `http(s)://authority`
    /// without a path.
    pub fn new(listen: &str, hosts: &[String], origins: &[String]) -> Result<Self, PolicyError> {
        if hosts.len() > MAX_ALLOWED_HOSTS || origins.len() > MAX_ALLOWED_ORIGINS {
            return Err(PolicyError(format!(
                "at most {MAX_ALLOWED_HOSTS} allowed hosts and {MAX_ALLOWED_ORIGINS} allowed origins"
            )));
        }
        let mut allowed_hosts = Vec::with_capacity(hosts.len() + 1);
        for host in hosts {
            let host = lowercase_trimmed(host);
            if host.is_empty() || host.contains('/') || host.chars().any(char::is_whitespace) {
                return Err(PolicyError(format!(
                    "allowed host {host:?} is not a host name"
                )));
            }
            allowed_hosts.push(host);
        }
        let (listen_name, _) = split_authority(listen);
        if !listen_name.is_empty() {
            allowed_hosts.push(listen_name.to_ascii_lowercase());
        }
        let mut allowed_origins = Vec::with_capacity(origins.len());
        for origin in origins {
            let origin = lowercase_trimmed(origin);
            let authority = origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"));
            match authority {
                Some(authority) if !authority.is_empty() && !authority.contains('/') => {
                    allowed_origins.push(origin);
                }
                _ => {
                    return Err(PolicyError(format!(
                        "allowed origin {origin:?} must be http(s)://host[:port] without a path"
                    )))
                }
            }
        }
        Ok(Self {
            hosts: allowed_hosts,
            origins: allowed_origins,
        })
    }

    /// Whether a `Host` header value is one this server answers.
    fn host_allowed(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        let (name, _port) = split_authority(&host);
        is_ip_literal(name)
            || name == "localhost"
            || self
                .hosts
                .iter()
                .any(|allowed| *allowed == host || allowed == name)
    }

    /// Whether an `Origin` header value may call this server, whose request
    /// named `host`.
    fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
        let origin = origin.to_ascii_lowercase();
        if self.origins.contains(&origin) {
            return true;
        }
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        match (authority, host) {
            (Some(authority), Some(host)) => authority == host.to_ascii_lowercase(),
            _ => false,
        }
    }
}

/// Splits `name:port`, `[v6]:port`, `name` or `[v6]` into name and port.
fn split_authority(authority: &str) -> (&str, Option<&str>) {
    if let Some(rest) = authority.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((name, tail)) => (name, tail.strip_prefix(':')),
            None => (authority, None),
        };
    }
    match authority.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => (name, Some(port)),
        _ => (authority, None),
    }
}

fn is_ip_literal(name: &str) -> bool {
    name.parse::<std::net::IpAddr>().is_ok()
}

/// Middleware on every route: 403 `host_not_allowed` or
/// `origin_not_allowed` for a request a browser sent on behalf of a page
/// elsewhere. The authority of an absolute-form request target
/// (`POST http://name/v1/turns`, which HTTP/1.1 says to prefer over
/// `Host`) must be allowed as a `Host` would; a request with two `Host`
/// headers is 400 `invalid_request` (which one a proxy before us checked
/// is anyone's guess).
pub(crate) async fn check_origin(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let policy = state.origin_policy();
    let headers = request.headers();
    if headers.get_all(header::HOST).iter().nth(1).is_some() {
        return Err(ApiError::invalid(
            "a request carries one Host header, not several",
        ));
    }
    if let Some(authority) = request.uri().authority() {
        if !policy.host_allowed(authority.as_str()) {
            return Err(ApiError::new(
                ErrorCode::HostNotAllowed,
                "this server does not answer to that request target's authority; allow it with --allowed-host",
            ));
        }
    }
    let host = match headers.get(header::HOST) {
        Some(value) => Some(
            value
                .to_str()
                .map_err(|_| ApiError::invalid("Host header is not visible ASCII"))?,
        ),
        None => None,
    };
    if let Some(host) = host {
        if !policy.host_allowed(host) {
            return Err(ApiError::new(
                ErrorCode::HostNotAllowed,
                "this server does not answer to that Host; allow it with --allowed-host",
            ));
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let allowed = origin
            .to_str()
            .is_ok_and(|origin| policy.origin_allowed(origin, host));
        if !allowed {
            return Err(ApiError::new(
                ErrorCode::OriginNotAllowed,
                "requests from that Origin are refused; allow it with --allowed-origin",
            ));
        }
    }
    Ok(next.run(request).await)
}

/// The user a trusted front end says it acts for, from the configured user
/// header (`--user-header`); `None` when no header is configured.
#[derive(Debug)]
pub struct CallerUser(Option<String>);

impl FromRequestParts<AppState> for CallerUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        Self::from_headers(&parts.headers, state)
    }
}

impl CallerUser {
    /// The caller's user from `headers`, as the extractor reads it.
    ///
    /// # Errors
    /// `invalid_request` when a user header is configured and absent or
    /// not visible ASCII.
    pub fn from_headers(headers: &HeaderMap, state: &AppState) -> Result<Self, ApiError> {
        let Some(name) = state.user_header() else {
            return Ok(Self(None));
        };
        let value = headers.get(name).ok_or_else(|| {
            ApiError::invalid(format!(
                "this server binds callers to users: send the {name} header"
            ))
        })?;
        let user = value
            .to_str()
            .map_err(|_| ApiError::invalid(format!("{name} header is not visible ASCII")))?;
        Ok(Self(Some(user.to_owned())))
    }

    /// Refuses (403 `user_mismatch`) a request about `user_id` from a caller
    /// bound to another user; passes when no user header is configured.
    ///
    /// # Errors
    /// `user_mismatch` when the header names another user.
    pub fn check(&self, user_id: &str) -> Result<(), ApiError> {
        match &self.0 {
            Some(bound) if bound != user_id => Err(ApiError::new(
                ErrorCode::UserMismatch,
                "the request's user_id is not the user this caller is bound to",
            )),
            _ => Ok(()),
        }
    }

    /// The users an orphan claim may take turns of: `asked` (the body's
    /// `user_ids`) when this caller is not bound to a user; else only the
    /// bound user, so an empty `asked` means that user's orphans. (A
    /// recovery worker's claim does not ask: it takes `asked` as is.)
    ///
    /// # Errors
    /// `user_mismatch` when a bound caller names another user.
    pub fn orphan_users(&self, asked: Vec<String>) -> Result<Vec<String>, ApiError> {
        match &self.0 {
            Some(bound) => {
                if asked.iter().any(|user| user != bound) {
                    return Err(ApiError::new(
                        ErrorCode::UserMismatch,
                        "a caller bound to a user claims only that user's orphans \
                         (a recovery key claims any)",
                    ));
                }
                Ok(vec![bound.clone()])
            }
            _ => Ok(asked),
        }
    }

    /// The bound user, if a user header is configured.
    pub fn bound(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

/// Validates a configured user header name.
///
/// # Errors
/// When `name` is not a valid HTTP header name.
pub fn parse_user_header(name: &str) -> Result<HeaderName, PolicyError> {
    HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| PolicyError(format!("user header {name:?} is not a header name")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn policy() -> OriginPolicy {
        OriginPolicy::new(
            "127.0.0.1:7700",
            &[
                "agentgate.internal".to_owned(),
                "gw.example:8443".to_owned(),
            ],
            &["https://console.example".to_owned()],
        )
        .unwrap()
    }

    #[test]
    fn hosts_ip_loopback_and_allowed_names_pass_others_are_refused() {
        let policy = policy();
        for host in [
            "127.0.0.1:7700",
            "localhost:7700",
            "LOCALHOST",
            "[::1]:7700",
            "10.0.0.5:7700",
            "agentgate.internal",
            "agentgate.internal:7700",
            "gw.example:8443",
        ] {
            assert!(policy.host_allowed(host), "{host}");
        }
        for host in [
            "evil.example:7700",
            "gw.example:80",
            "localhost.evil.example",
            "",
        ] {
            assert!(!policy.host_allowed(host), "{host}");
        }
    }

    #[test]
    fn origins_must_be_the_server_itself_or_allowed() {
        let policy = policy();
        let host = Some("127.0.0.1:7700");
        assert!(policy.origin_allowed("http://127.0.0.1:7700", host));
        assert!(policy.origin_allowed("https://console.example", host));
        assert!(!policy.origin_allowed("http://evil.example", host));
        assert!(!policy.origin_allowed("http://127.0.0.1:7701", host));
        assert!(!policy.origin_allowed("null", host));
        assert!(!policy.origin_allowed("http://127.0.0.1:7700", None));
    }

    #[test]
    fn bad_allow_list_entries_are_refused() {
        assert!(OriginPolicy::new("127.0.0.1:0", &[], &["console.example".to_owned()]).is_err());
        assert!(
            OriginPolicy::new("127.0.0.1:0", &[], &["https://a.example/x".to_owned()]).is_err()
        );
        assert!(OriginPolicy::new("127.0.0.1:0", &["a b".to_owned()], &[]).is_err());
        assert!(parse_user_header("X-Agentgate-User").is_ok());
        assert!(parse_user_header("bad header").is_err());
    }
}
