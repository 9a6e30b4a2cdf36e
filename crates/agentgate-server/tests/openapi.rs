//! The OpenAPI document against a real OpenAPI 3.1 parser, and against the
//! router: every route of docs/protocol.md §10 is documented, every documented route is
//! served, and each operation documents its statuses and error codes.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use agentgate::{Config, Gate};
use agentgate_server::{router, AppState, ServerOptions};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::Value;
use tower::ServiceExt as _;

/// The routes of docs/protocol.md §10, written out by hand: the contract the router and the
/// document must both match exactly.
const SPEC_ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/turns"),
    ("post", "/v1/turns/{turn_id}/heartbeat"),
    ("post", "/v1/turns/{turn_id}/tools"),
    ("post", "/v1/turns/{turn_id}/tools/{execution_id}/complete"),
    ("post", "/v1/turns/{turn_id}/tools/{execution_id}/fail"),
    ("post", "/v1/turns/{turn_id}/complete"),
    ("post", "/v1/turns/{turn_id}/fail"),
    ("post", "/v1/turns/{turn_id}/await-confirmation"),
    ("post", "/v1/turns/{turn_id}/cancel"),
    ("post", "/v1/turns/{turn_id}/end-cancelled"),
    ("get", "/v1/turns/{turn_id}"),
    ("get", "/v1/turns/{turn_id}/executions"),
    ("get", "/v1/sessions/{session_id}"),
    ("post", "/v1/sessions/{session_id}/release"),
    ("put", "/v1/sessions/{session_id}/policy"),
    ("post", "/v1/turns/{turn_id}/events"),
    ("get", "/v1/turns/{turn_id}/events"),
    ("get", "/v1/users/{user_id}"),
    ("post", "/v1/orphans/claim"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
];

fn document() -> Value {
    serde_json::from_str(&agentgate_server::openapi::document_json()).unwrap()
}

fn documented_routes(doc: &Value) -> BTreeSet<(String, String)> {
    let mut routes = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            routes.insert((method.clone(), path.clone()));
        }
    }
    routes
}

/// Every `$ref` anywhere in `value` (JSON pointers into the document).
fn refs(value: &Value, found: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, inner) in map {
                match (key.as_str(), inner) {
                    ("$ref", Value::String(target)) => found.push(target.clone()),
                    _ => refs(inner, found),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, found)),
        _ => {}
    }
}

#[test]
fn the_document_is_valid_openapi_3_1() {
    let text = agentgate_server::openapi::document_json();
    let spec = oas3::from_json(&text).expect("parses as an OpenAPI 3.1 document");
    let version = spec.validate_version().expect("declares a 3.1.x version");
    assert_eq!((version.major, version.minor), (3, 1));
    assert_eq!(spec.info.title, "agentgate");

    let mut operations = 0;
    for (path, method, operation) in spec.operations() {
        operations += 1;
        // Resolving bodies and parameters fails on a dangling reference.
        operation
            .request_body(&spec)
            .unwrap_or_else(|e| panic!("{method} {path}: request body: {e}"));
        let parameters = operation
            .parameters(&spec)
            .unwrap_or_else(|e| panic!("{method} {path}: parameters: {e}"));
        // Every `{name}` in the path is a documented path parameter.
        for segment in path.split('/').filter(|s| s.starts_with('{')) {
            let name = segment.trim_matches(|c| c == '{' || c == '}');
            assert!(
                parameters.iter().any(|p| p.name == name),
                "{method} {path}: path parameter {name} undocumented"
            );
        }
        assert!(
            !operation.responses(&spec).is_empty(),
            "{method} {path}: no responses"
        );
        assert!(operation.summary.is_some(), "{method} {path}: no summary");
    }
    assert_eq!(operations, SPEC_ROUTES.len());

    // No reference points nowhere.
    let doc = document();
    let mut targets = Vec::new();
    refs(&doc, &mut targets);
    assert!(!targets.is_empty());
    for target in targets {
        let pointer = target.strip_prefix('#').expect("local reference");
        assert!(doc.pointer(pointer).is_some(), "dangling $ref {target}");
    }
}

/// An operation id is the name a generated client gives the operation's
/// function; OpenAPI requires each to be unique.
#[test]
fn operation_ids_are_unique() {
    let doc = document();
    let mut seen = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let id = operation["operationId"]
                .as_str()
                .unwrap_or_else(|| panic!("{method} {path}: no operationId"));
            assert!(
                seen.insert(id.to_owned()),
                "{method} {path}: operationId {id} repeated"
            );
        }
    }
    assert_eq!(seen.len(), SPEC_ROUTES.len());
}

#[test]
fn every_spec_route_is_documented_and_nothing_else() {
    let documented = documented_routes(&document());
    let expected: BTreeSet<(String, String)> = SPEC_ROUTES
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    assert_eq!(documented, expected);
}

#[test]
fn operations_document_their_statuses_and_error_codes() {
    let doc = document();
    let statuses = |method: &str, path: &str| -> BTreeSet<String> {
        doc["paths"][path][method]["responses"]
            .as_object()
            .unwrap_or_else(|| panic!("{method} {path} has responses"))
            .keys()
            .cloned()
            .collect()
    };
    let set = |list: &[&str]| {
        list.iter()
            .map(|s| (*s).to_owned())
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(
        statuses("post", "/v1/turns"),
        set(&[
            "200", "201", "202", "400", "401", "403", "404", "408", "409", "413", "415", "422",
            "429", "503"
        ])
    );
    assert_eq!(
        statuses("post", "/v1/turns/{turn_id}/tools"),
        set(&["200", "201", "400", "401", "403", "404", "408", "409", "413", "415", "422", "503"])
    );
    assert_eq!(
        statuses("post", "/v1/turns/{turn_id}/heartbeat"),
        set(&["200", "400", "401", "403", "404", "409", "503"]),
        "a heartbeat reads no body"
    );
    // A claim names no record, so it has no 404; 204 is "no orphan". Its
    // body is read like any other (408, 413, 415).
    assert_eq!(
        statuses("post", "/v1/orphans/claim"),
        set(&["201", "204", "400", "401", "403", "408", "413", "415", "503"])
    );
    for (method, path) in SPEC_ROUTES
        .iter()
        .filter(|(_, p)| p.starts_with("/v1/") && *p != "/v1/orphans/claim")
    {
        let got = statuses(method, path);
        for status in ["400", "401", "403", "404", "503"] {
            assert!(got.contains(status), "{method} {path} documents {status}");
        }
        let unavailable = &doc["paths"][path][method]["responses"]["503"];
        assert!(
            unavailable["headers"]["Retry-After"].is_object(),
            "{method} {path}: every 503 documents Retry-After"
        );
    }
    for path in ["/healthz", "/readyz"] {
        let unavailable = &doc["paths"][path]["get"]["responses"]["503"];
        assert!(unavailable["headers"]["Retry-After"].is_object(), "{path}");
    }
    // Conflicts document Retry-After.
    let conflict = &doc["paths"]["/v1/turns"]["post"]["responses"]["409"];
    assert!(conflict["headers"]["Retry-After"].is_object());
    let capacity = &doc["paths"]["/v1/turns"]["post"]["responses"]["429"];
    assert!(capacity["headers"]["Retry-After"].is_object());
    // Every wire error code is in the schema.
    let codes: BTreeSet<String> = doc["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .expect("ErrorCode is a string enum")
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect();
    for code in [
        "invalid_request",
        "unauthorized",
        "not_found",
        "payload_too_large",
        "session_busy",
        "request_in_flight",
        "awaiting_confirmation",
        "tool_in_flight",
        "lease_lost",
        "payload_mismatch",
        "user_at_capacity",
        "store_unavailable",
        "request_timeout",
        "unsupported_media_type",
        "origin_not_allowed",
        "host_not_allowed",
        "user_mismatch",
        "overloaded",
    ] {
        assert!(codes.contains(code), "ErrorCode documents {code}");
    }
    // Post-begin calls document the Lease-Token header.
    let params = doc["paths"]["/v1/turns/{turn_id}/heartbeat"]["post"]["parameters"]
        .as_array()
        .unwrap();
    assert!(params
        .iter()
        .any(|p| p["name"] == "Lease-Token" && p["in"] == "header"));
}

async fn app() -> (tempfile::TempDir, axum::Router) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let gate = Gate::open(&url, Config::default()).await.unwrap();
    let state = AppState::new(gate, ServerOptions::default()).unwrap();
    (dir, router(state))
}

async fn call(app: &axum::Router, method: &str, uri: &str, body: &str) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .header("lease-token", "lt_not_a_real_token")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, json)
}

#[tokio::test]
async fn every_documented_route_is_served() {
    let (_dir, app) = app().await;
    for (method, path) in documented_routes(&document()) {
        let uri = path
            .replace("{turn_id}", "turn_x")
            .replace("{execution_id}", "exec_x")
            .replace("{session_id}", "s")
            .replace("{user_id}", "u");
        let (status, body) = call(&app, &method.to_uppercase(), &uri, "{}").await;
        assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            !message.starts_with("no route"),
            "{method} {path} reached the fallback"
        );
    }
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_json() {
    let (_dir, app) = app().await;
    let (status, body) = call(&app, "GET", "/v1/nope", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["code"], "not_found");
    let (status, body) = call(&app, "DELETE", "/v1/turns", "").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(body["error"]["code"], "method_not_allowed");
}

/// Whether `value` has what `schema` (in `doc`) demands: its `required`
/// keys, its `enum`, its string `pattern` and, recursively, its
/// `properties`; a `$ref` is followed, and a `oneOf` is met by exactly one
/// branch.
fn conforms(value: &Value, schema: &Value, doc: &Value) -> bool {
    if let Some(name) = schema["$ref"].as_str() {
        let name = name.strip_prefix("#/components/schemas/").unwrap();
        return conforms(value, &doc["components"]["schemas"][name], doc);
    }
    if let Some(branches) = schema["oneOf"].as_array() {
        return branches.iter().filter(|b| conforms(value, b, doc)).count() == 1;
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            return false;
        }
    }
    if let (Some(pattern), Some(text)) = (schema["pattern"].as_str(), value.as_str()) {
        if !regex::Regex::new(pattern).unwrap().is_match(text) {
            return false;
        }
    }
    let required = schema["required"].as_array().cloned().unwrap_or_default();
    if required
        .iter()
        .any(|key| value.get(key.as_str().unwrap()).is_none())
    {
        return false;
    }
    schema["properties"].as_object().is_none_or(|properties| {
        properties
            .iter()
            .all(|(key, sub)| value.get(key).is_none_or(|v| conforms(v, sub, doc)))
    })
}

/// The event stream's body is documented item by item: the 200 names the
/// component `TurnStreamEvent` (`x-sse-item-schema`), and every event a
/// real stream sends (appended events, then `end`) meets exactly one of
/// its branches, while an event with a reserved name's shape but an id, or
/// a made-up shape, meets none.
#[tokio::test]
async fn every_event_a_stream_sends_is_a_documented_item() {
    let doc = document();
    let content = &doc["paths"]["/v1/turns/{turn_id}/events"]["get"]["responses"]["200"]["content"]
        ["text/event-stream"];
    assert_eq!(
        content["x-sse-item-schema"]["$ref"],
        "#/components/schemas/TurnStreamEvent"
    );
    let item = &doc["components"]["schemas"]["TurnStreamEvent"];
    assert_eq!(item["oneOf"].as_array().unwrap().len(), 3);

    let (_dir, app) = app().await;
    let begin = r#"{"user_id":"u","session_id":"s","client_request_id":"r","payload":{}}"#;
    let (status, begun) = call(&app, "POST", "/v1/turns", begin).await;
    assert_eq!(status, StatusCode::CREATED, "{begun}");
    let turn = begun["turn"]["turn_id"].as_str().unwrap();
    let token = begun["turn"]["lease_token"].as_str().unwrap();
    let leased = |uri: String, body: &'static str| {
        Request::builder()
            .method("POST")
            .uri(uri)
            .header("content-type", "application/json")
            .header("lease-token", token)
            .body(Body::from(body))
            .unwrap()
    };
    let appended = app
        .clone()
        .oneshot(leased(
            format!("/v1/turns/{turn}/events"),
            r#"{"events":[{"event":"token","data":"Hel"},{"event":"token","data":{"n":[1,2]}}]}"#,
        ))
        .await
        .unwrap();
    assert_eq!(appended.status(), StatusCode::OK);
    let completed = app
        .clone()
        .oneshot(leased(
            format!("/v1/turns/{turn}/complete"),
            r#"{"response":{"done":true}}"#,
        ))
        .await
        .unwrap();
    assert_eq!(completed.status(), StatusCode::OK);

    let response = app
        .clone()
        .oneshot(
            Request::builder()
                .uri(format!("/v1/turns/{turn}/events"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let mut events = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut event = serde_json::Map::new();
        for line in block.lines() {
            let (field, value) = line.split_once(": ").unwrap();
            let value = match field {
                "data" => serde_json::from_str(value).unwrap(),
                _ => Value::String(value.to_owned()),
            };
            event.insert(field.to_owned(), value);
        }
        events.push(Value::Object(event));
    }
    let names: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["token", "token", "end"], "{text}");
    for event in &events {
        assert!(
            conforms(event, item, &doc),
            "{event} is not a documented item"
        );
    }
    let forged = serde_json::json!({"event": "mystery", "data": {"x": 1}});
    assert!(
        !conforms(&forged, item, &doc),
        "an id-less, attempt-less event"
    );
}
