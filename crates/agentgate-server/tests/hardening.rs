//! The router's defences against hostile or careless callers, without a
//! socket: bounded metric labels, JSON-only bodies, the `Host` and `Origin`
//! checks, the trusted user header, and the health reports. Each test
//! asserts the refusal and that the ordinary request still passes.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentgate::{Config, Gate};
use agentgate_server::{router, AppState, ServerOptions};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use tower::ServiceExt as _;

async fn app(options: ServerOptions) -> (tempfile::TempDir, axum::Router) {
    app_with(options, Config::default()).await
}

async fn app_with(options: ServerOptions, config: Config) -> (tempfile::TempDir, axum::Router) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let gate = Gate::open(&url, config).await.unwrap();
    let state = AppState::new(gate, options).unwrap();
    (dir, router(state))
}

struct Answer {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
    text: String,
}

impl Answer {
    fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }
}

async fn send(app: &axum::Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    Answer {
        status,
        headers,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
        text,
    }
}

fn begin_body(user: &str, request: &str) -> String {
    json!({"user_id": user, "session_id": format!("s-{user}-{request}"), "client_request_id": request})
        .to_string()
}

fn post(uri: &str, headers: &[(&str, &str)], body: String) -> Request<Body> {
    let mut builder = Request::builder().method("POST").uri(uri);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(Body::from(body)).unwrap()
}

const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test]
async fn invented_methods_and_paths_do_not_grow_the_metrics() {
    let (_dir, app) = app(ServerOptions::default()).await;
    for i in 0..2_000 {
        let request = Request::builder()
            .method(format!("M{i}").as_str())
            .uri(format!("/v1/turns/t-{i}/nowhere-{i}"))
            .body(Body::empty())
            .unwrap();
        let answer = send(&app, request).await;
        assert!(answer.status.is_client_error(), "{}", answer.text);
    }
    let metrics = send(
        &app,
        Request::builder()
            .uri("/metrics")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    let series: Vec<&str> = metrics
        .text
        .lines()
        .filter(|line| line.starts_with("agentgate_http_request_duration_seconds_count"))
        .collect();
    assert!(
        series.len() <= 3,
        "2,000 invented methods and paths make at most a few series: {series:#?}"
    );
    assert!(series
        .iter()
        .any(|line| line.contains(r#"method="other",route="unmatched""#)));
    assert!(
        !metrics.text.contains("M1999"),
        "no method is copied as sent"
    );
    assert!(
        !metrics.text.contains("nowhere"),
        "no path is copied as sent"
    );
}

#[tokio::test]
async fn json_endpoints_refuse_other_content_types_with_415() {
    let (_dir, app) = app(ServerOptions::default()).await;
    for content_type in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
    ] {
        let headers: Vec<(&str, &str)> = content_type
            .map(|c| ("content-type", c))
            .into_iter()
            .collect();
        let answer = send(&app, post("/v1/turns", &headers, begin_body("ann", "r1"))).await;
        assert_eq!(
            answer.status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{content_type:?}"
        );
        assert_eq!(answer.code(), "unsupported_media_type");
        assert!(answer.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("application/json"));
    }
    let answer = send(
        &app,
        post(
            "/v1/turns",
            &[("content-type", "Application/JSON; charset=utf-8")],
            begin_body("ann", "r1"),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text);
    // A heartbeat carries no body, so no content type either: it passes the
    // media check and fails only on its (missing) lease.
    let answer = send(&app, post("/v1/turns/t/heartbeat", &[], String::new())).await;
    assert_eq!(answer.code(), "invalid_request", "{}", answer.text);
}

#[tokio::test]
async fn foreign_origins_and_hosts_are_refused_loopback_passes() {
    let options = ServerOptions {
        listen: "127.0.0.1:7700".to_owned(),
        allowed_origins: vec!["https://console.example".to_owned()],
        allowed_hosts: vec!["agentgate.internal".to_owned()],
        ..ServerOptions::default()
    };
    let (_dir, app) = app(options).await;
    let refused = [
        (
            ("host", "127.0.0.1:7700"),
            ("origin", "http://evil.example"),
            "origin_not_allowed",
        ),
        (
            ("host", "127.0.0.1:7700"),
            ("origin", "null"),
            "origin_not_allowed",
        ),
        (
            ("host", "evil.example:7700"),
            ("origin", "http://evil.example:7700"),
            "host_not_allowed",
        ),
        (
            ("host", "evil.example:7700"),
            ("x-none", "-"),
            "host_not_allowed",
        ),
    ];
    for (i, (host, origin, code)) in refused.into_iter().enumerate() {
        let request = post(
            "/v1/turns",
            &[JSON, host, origin],
            begin_body("bo", &format!("x{i}")),
        );
        let answer = send(&app, request).await;
        assert_eq!(answer.status, StatusCode::FORBIDDEN, "{host:?} {origin:?}");
        assert_eq!(answer.code(), code);
    }
    // Reads are refused too: a rebinding page must not read state.
    let answer = send(
        &app,
        Request::builder()
            .uri("/v1/users/bo")
            .header("host", "evil.example")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(answer.code(), "host_not_allowed");

    let allowed = [
        (
            ("host", "127.0.0.1:7700"),
            ("origin", "http://127.0.0.1:7700"),
        ),
        (
            ("host", "localhost:7700"),
            ("origin", "http://localhost:7700"),
        ),
        (("host", "[::1]:7700"), ("origin", "http://[::1]:7700")),
        (
            ("host", "127.0.0.1:7700"),
            ("origin", "https://console.example"),
        ),
        (("host", "agentgate.internal"), ("x-none", "-")),
        (("host", "10.1.2.3:7700"), ("x-none", "-")),
    ];
    for (i, (host, origin)) in allowed.into_iter().enumerate() {
        let request = post(
            "/v1/turns",
            &[JSON, host, origin],
            begin_body(&format!("cy{i}"), "y"),
        );
        let answer = send(&app, request).await;
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{host:?} {origin:?}: {}",
            answer.text
        );
    }
}

#[tokio::test]
async fn a_trusted_user_header_binds_the_caller_to_its_user() {
    let options = ServerOptions {
        user_header: Some("X-Agentgate-User".to_owned()),
        ..ServerOptions::default()
    };
    let (_dir, app) = app(options).await;
    let as_dee = ("x-agentgate-user", "dee");
    let answer = send(
        &app,
        post("/v1/turns", &[JSON, as_dee], begin_body("eve", "r1")),
    )
    .await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert_eq!(answer.code(), "user_mismatch");
    let answer = send(&app, post("/v1/turns", &[JSON], begin_body("dee", "r1"))).await;
    assert_eq!(answer.code(), "invalid_request", "the header is required");
    let answer = send(
        &app,
        post("/v1/turns", &[JSON, as_dee], begin_body("dee", "r1")),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text);
    let session = answer.body["turn"]["session_id"]
        .as_str()
        .unwrap()
        .to_owned();

    let read = |uri: String, user: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::builder()
                .uri(uri)
                .header("x-agentgate-user", user)
                .body(Body::empty())
                .unwrap();
            send(&app, request).await
        }
    };
    assert_eq!(
        read(format!("/v1/sessions/{session}"), "dee").await.status,
        StatusCode::OK
    );
    assert_eq!(
        read(format!("/v1/sessions/{session}"), "eve").await.code(),
        "not_found",
        "another user's session reads as missing"
    );
    assert_eq!(
        read(format!("/v1/sessions/{session}?user_id=dee"), "eve")
            .await
            .code(),
        "user_mismatch"
    );
    assert_eq!(
        read("/v1/users/eve".to_owned(), "dee").await.code(),
        "user_mismatch"
    );
    assert_eq!(
        read("/v1/users/dee".to_owned(), "dee").await.status,
        StatusCode::OK
    );
}

/// Under `--user-header`, `POST /v1/orphans/claim` takes only the caller's
/// own user's orphans: another user's orphan is neither claimed with an
/// empty filter nor by naming its user (403 `user_mismatch`), so the
/// caller never reads its payload and journal nor writes an answer its
/// owner's retry would replay. A recovery key claims any user's.
#[tokio::test]
async fn an_orphan_claim_takes_only_the_callers_own_users_orphans() {
    let options = ServerOptions {
        user_header: Some("X-Agentgate-User".to_owned()),
        recovery_keys: vec![agentgate_server::ApiKey::new("recovery-key-0123456789").unwrap()],
        ..ServerOptions::default()
    };
    let config = Config {
        lease_ttl: std::time::Duration::from_millis(200),
        ..Config::default()
    };
    let (_dir, app) = app_with(options, config).await;
    let as_ann = ("x-agentgate-user", "ann");
    let as_bob = ("x-agentgate-user", "bob");
    let begun = send(
        &app,
        post("/v1/turns", &[JSON, as_ann], begin_body("ann", "r1")),
    )
    .await;
    assert_eq!(begun.status, StatusCode::CREATED, "{}", begun.text);
    let turn = begun.body["turn"]["turn_id"].as_str().unwrap().to_owned();
    // Past the lease's TTL (200 ms) the turn is an orphan.
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;

    let claim = |headers: Vec<(&'static str, &'static str)>, body: Value| {
        let app = app.clone();
        async move {
            let mut all = vec![JSON];
            all.extend(headers);
            send(&app, post("/v1/orphans/claim", &all, body.to_string())).await
        }
    };
    let answer = claim(vec![as_bob], json!({})).await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT, "{}", answer.text);
    let answer = claim(vec![as_bob], json!({"user_ids": ["ann"]})).await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN, "{}", answer.text);
    assert_eq!(answer.code(), "user_mismatch");
    let answer = claim(vec![as_bob], json!({"turn_ids": [turn]})).await;
    assert_eq!(
        answer.status,
        StatusCode::NO_CONTENT,
        "naming the turn does not widen the caller's users: {}",
        answer.text
    );
    let answer = claim(vec![], json!({})).await;
    assert_eq!(answer.code(), "invalid_request", "the header is required");

    // The recovery worker's key claims it, with no user header at all.
    let answer = claim(
        vec![("authorization", "Bearer recovery-key-0123456789")],
        json!({}),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text);
    assert_eq!(answer.body["turn"]["turn_id"], json!(turn));
}

/// Ann's own orphan is hers to claim, with an empty filter or naming her.
#[tokio::test]
async fn a_bound_caller_claims_its_own_users_orphan() {
    let options = ServerOptions {
        user_header: Some("X-Agentgate-User".to_owned()),
        ..ServerOptions::default()
    };
    let config = Config {
        lease_ttl: std::time::Duration::from_millis(200),
        ..Config::default()
    };
    let (_dir, app) = app_with(options, config).await;
    let as_ann = ("x-agentgate-user", "ann");
    let begun = send(
        &app,
        post("/v1/turns", &[JSON, as_ann], begin_body("ann", "r1")),
    )
    .await;
    assert_eq!(begun.status, StatusCode::CREATED, "{}", begun.text);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let answer = send(
        &app,
        post(
            "/v1/orphans/claim",
            &[JSON, as_ann],
            json!({"user_ids": ["ann"]}).to_string(),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text);
    assert_eq!(answer.body["turn"]["user_id"], json!("ann"));
}

/// `end` and `error` are the event stream's own names: an append naming
/// either is refused whole (400 `invalid_request`) and writes nothing, so
/// the next append's first event is still id 1.
#[tokio::test]
async fn an_append_naming_a_reserved_event_is_refused_and_writes_nothing() {
    let (_dir, app) = app(ServerOptions::default()).await;
    let begun = send(&app, post("/v1/turns", &[JSON], begin_body("eli", "r1"))).await;
    assert_eq!(begun.status, StatusCode::CREATED, "{}", begun.text);
    let turn = begun.body["turn"]["turn_id"].as_str().unwrap().to_owned();
    let token = begun.body["turn"]["lease_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/v1/turns/{turn}/events");
    for reserved in ["end", "error"] {
        let body =
            json!({"events": [{"event": "token", "data": "a"}, {"event": reserved, "data": {}}]});
        let answer = send(
            &app,
            post(&path, &[JSON, ("lease-token", &token)], body.to_string()),
        )
        .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.text);
        assert_eq!(answer.code(), "invalid_request");
    }
    let body = json!({"events": [{"event": "token", "data": "a"}]});
    let answer = send(
        &app,
        post(&path, &[JSON, ("lease-token", &token)], body.to_string()),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    assert_eq!(answer.body["last_event_id"], json!(1));
}

/// An absolute-form request target names the host the request is for
/// (HTTP/1.1 prefers it to `Host`): a foreign one is refused like a foreign
/// `Host` (403 `host_not_allowed`), a loopback one passes; two `Host`
/// headers are 400 `invalid_request`. Nothing is begun by a refused one.
#[tokio::test]
async fn request_targets_and_hosts_are_checked() {
    let (_dir, app) = app(ServerOptions::default()).await;
    let foreign = send(
        &app,
        post(
            "http://evil.example/v1/turns",
            &[JSON],
            begin_body("fay", "r1"),
        ),
    )
    .await;
    assert_eq!(foreign.status, StatusCode::FORBIDDEN, "{}", foreign.text);
    assert_eq!(foreign.code(), "host_not_allowed");
    let mut twice = post("/v1/turns", &[JSON], begin_body("fay", "r1"));
    twice
        .headers_mut()
        .append("host", "127.0.0.1".parse().unwrap());
    twice
        .headers_mut()
        .append("host", "evil.example".parse().unwrap());
    let twice = send(&app, twice).await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST, "{}", twice.text);
    assert_eq!(twice.code(), "invalid_request");
    let user = send(
        &app,
        Request::builder()
            .uri("/v1/users/fay")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(user.body["user"]["live_turns"], json!(0), "{}", user.text);
    let loopback = send(
        &app,
        post(
            "http://127.0.0.1:7700/v1/turns",
            &[JSON],
            begin_body("fay", "r1"),
        ),
    )
    .await;
    assert_eq!(loopback.status, StatusCode::CREATED, "{}", loopback.text);
}

/// An event id past a turn's most events (`MAX_TURN_EVENTS`, the
/// document's `maximum` for `after`) is refused 400, in the query and in
/// `Last-Event-ID`, before any stream opens.
#[tokio::test]
async fn an_event_id_past_the_most_a_turn_holds_is_refused() {
    let (_dir, app) = app(ServerOptions::default()).await;
    let begun = send(&app, post("/v1/turns", &[JSON], begin_body("ida", "r1"))).await;
    let turn = begun.body["turn"]["turn_id"].as_str().unwrap().to_owned();
    let most = agentgate::limits::MAX_TURN_EVENTS;
    for (query, header) in [
        (format!("?after={}", most + 1), None),
        (format!("?after={}", u64::MAX), None),
        (String::new(), Some((most + 1).to_string())),
    ] {
        let mut request = Request::builder().uri(format!("/v1/turns/{turn}/events{query}"));
        if let Some(id) = &header {
            request = request.header("last-event-id", id.as_str());
        }
        let answer = send(&app, request.body(Body::empty()).unwrap()).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{query} {header:?}: {}",
            answer.text
        );
        assert_eq!(answer.code(), "invalid_request");
    }
}

#[tokio::test]
async fn health_reports_each_dependency_and_readiness() {
    let (_dir, app) = app(ServerOptions::default()).await;
    for path in ["/healthz", "/readyz"] {
        let answer = send(
            &app,
            Request::builder().uri(path).body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK, "{path}: {}", answer.text);
        assert_eq!(answer.body["status"], "ok");
        assert_eq!(answer.body["dependencies"]["store"]["status"], "up");
        assert!(
            answer.body["dependencies"].get("redis").is_none(),
            "not configured"
        );
        assert!(answer.headers.get("retry-after").is_none());
    }
}
