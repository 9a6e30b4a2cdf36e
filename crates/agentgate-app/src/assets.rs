//! The pages' files (`crates/agentgate-app/assets/`), embedded in the
//! binary with `include_str!`: plain HTML, CSS and JS, no build step, nothing
//! read from disk at run time.
//!
//! Every file is sent with a strict content security policy (scripts and
//! styles from this server only, no inline script) and `no-cache`, so a new
//! binary's files are picked up on the next load.

use agentgate_server::{ApiError, ApiPath, ErrorCode};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

/// What the pages may load: only this origin; `connect-src 'self'` covers
/// the JSON and SSE calls.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
    form-action 'self'; frame-ancestors 'none'";

/// One embedded file.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const INDEX: Asset = Asset {
    name: "index.html",
    content_type: "text/html; charset=utf-8",
    body: include_str!("../assets/index.html"),
};

const DASHBOARD: Asset = Asset {
    name: "dashboard.html",
    content_type: "text/html; charset=utf-8",
    body: include_str!("../assets/dashboard.html"),
};

/// The files under `/assets/`.
const FILES: &[Asset] = &[
    Asset {
        name: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../assets/style.css"),
    },
    Asset {
        name: "common.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../assets/common.js"),
    },
    Asset {
        name: "i18n.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../assets/i18n.js"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../assets/app.js"),
    },
    Asset {
        name: "dashboard.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../assets/dashboard.js"),
    },
    Asset {
        name: "favicon.svg",
        content_type: "image/svg+xml",
        body: include_str!("../assets/favicon.svg"),
    },
];

fn send(asset: &Asset) -> Response {
    let mut response = asset.body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// `GET /`: the chat page.
pub(crate) async fn index() -> Response {
    send(&INDEX)
}

/// `GET /dashboard`: the dashboard page.
pub(crate) async fn dashboard() -> Response {
    send(&DASHBOARD)
}

/// `GET /assets/{file}`: a CSS, JS or image file.
pub(crate) async fn file(ApiPath(name): ApiPath<String>) -> Result<Response, ApiError> {
    FILES
        .iter()
        .find(|asset| asset.name == name)
        .map(send)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no asset {name:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_reference_only_embedded_files() {
        for page in [&INDEX, &DASHBOARD] {
            for (index, _) in page.body.match_indices("/assets/") {
                let rest = &page.body[index + "/assets/".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-')
                    .collect();
                assert!(
                    FILES.iter().any(|f| f.name == name),
                    "{} references /assets/{name}, which is not embedded",
                    page.name
                );
            }
            assert!(
                !page.body.contains("<script>"),
                "{}: no inline script (the CSP forbids it)",
                page.name
            );
        }
    }
}
