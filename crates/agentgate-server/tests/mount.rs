//! The mounting seam (`agentgate_server::mount`), without a socket and
//! without any app: routes passed to `router_with` are served beside `/v1`
//! with their shared state from the extension slot, behind the same
//! `Host`/`Origin` guard, JSON fallbacks and request metrics as `/v1`, and
//! `mount::protect` puts them behind the API key check.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentgate::{Config, Gate};
use agentgate_server::mount::protect;
use agentgate_server::{
    router_with, ApiError, ApiKey, ApiQuery, AppState, ErrorCode, Extensions, ServerOptions,
};
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use axum::Router;
use serde::Deserialize;
use tower::ServiceExt as _;

const KEY: &str = "mount-test-key-0123456789";

/// A mount's shared state, found by type.
struct Greeting(&'static str);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Name {
    name: String,
}

async fn greet(
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<Name>,
) -> Result<String, ApiError> {
    let greeting = state
        .extension::<Greeting>()
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "not mounted"))?;
    Ok(format!("{} {}", greeting.0, query.name))
}

async fn open_page() -> &'static str {
    "page"
}

async fn mounted() -> (tempfile::TempDir, Router) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let gate = Gate::open(&url, Config::default()).await.unwrap();
    let mut extensions = Extensions::new();
    extensions.insert(Greeting("hello"));
    let options = ServerOptions {
        api_keys: vec![ApiKey::new(KEY).unwrap()],
        extensions,
        listen: "127.0.0.1:7700".to_owned(),
        ..ServerOptions::default()
    };
    let state = AppState::new(gate, options).unwrap();
    let api = Router::new().route("/x/greet", get(greet));
    let extra = Router::new()
        .route("/x/page", get(open_page))
        .merge(protect(&state, api));
    (dir, router_with(state, extra))
}

async fn get_text(app: &Router, uri: &str, headers: &[(&str, &str)]) -> (StatusCode, String) {
    let mut request = Request::get(uri);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

fn code(body: &str) -> String {
    let value: serde_json::Value = serde_json::from_str(body).unwrap();
    value["error"]["code"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn mounted_routes_get_their_state_and_the_v1_checks() {
    let (_dir, app) = mounted().await;
    let bearer = format!("Bearer {KEY}");
    let auth = [("authorization", bearer.as_str())];

    // An unprotected route is open; a protected one needs the key, like /v1.
    let (status, body) = get_text(&app, "/x/page", &[]).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "page"));
    let (status, body) = get_text(&app, "/x/greet?name=ann", &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(code(&body), "unauthorized");
    let (status, body) = get_text(&app, "/x/greet?name=ann", &auth).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "hello ann"));

    // The server's extractors answer bad input with its JSON error body.
    let (status, body) = get_text(&app, "/x/greet?nom=ann", &auth).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(code(&body), "invalid_request");

    // The Origin and Host guard covers mounted routes too.
    let foreign = [("origin", "https://evil.example")];
    let (status, body) = get_text(&app, "/x/page", &foreign).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(code(&body), "origin_not_allowed");
    let (status, body) = get_text(&app, "/x/page", &[("host", "rebind.example")]).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(code(&body), "host_not_allowed");

    // Unknown paths and methods beside a mount keep the JSON fallbacks.
    let (status, body) = get_text(&app, "/x/nope", &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(code(&body), "not_found");

    // The request metrics label mounted routes by their template.
    let (status, metrics) = get_text(&app, "/metrics", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        metrics.contains(r#"route="/x/greet""#),
        "mounted route missing from metrics:\n{metrics}"
    );
}

#[tokio::test]
async fn without_the_extension_a_mounted_handler_sees_none() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let gate = Gate::open(&url, Config::default()).await.unwrap();
    let state = AppState::new(gate, ServerOptions::default()).unwrap();
    assert!(state.extension::<Greeting>().is_none());
    let app = router_with(state, Router::new().route("/x/greet", get(greet)));
    let (status, body) = get_text(&app, "/x/greet?name=ann", &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(code(&body), "not_found");
}
