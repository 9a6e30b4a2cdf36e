//! The OpenAPI document says what the server enforces, at every boundary:
//! a request valid by the document at a limit is accepted, one past it is
//! refused 400 `invalid_request`. Each case below is a mismatch schema
//! fuzzing found (issue 10) or one found looking for more: empty and
//! over-long `Lease-Token`s, control characters in ids, `maxLength` counted
//! in characters while the server counted bytes, the nesting limit off by
//! one, an unchecked `user_id` query, the orphan filter's bounds.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentgate::canonical::MAX_SAFE_INTEGER;
use agentgate::limits::{MAX_ID_CHARS, MAX_JSON_DEPTH, MAX_ORPHAN_FILTER_IDS, MAX_RETENTION};
use agentgate::{Config, Gate};
use agentgate_server::{router, AppState, ServerOptions};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use tower::ServiceExt as _;

struct App {
    _dir: tempfile::TempDir,
    router: axum::Router,
}

async fn app() -> App {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let gate = Gate::open(&url, Config::default()).await.unwrap();
    let state = AppState::new(gate, ServerOptions::default()).unwrap();
    App {
        _dir: dir,
        router: router(state),
    }
}

impl App {
    async fn send(&self, request: Request<Body>) -> (StatusCode, Value) {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    async fn post(&self, uri: &str, token: Option<&str>, body: &Value) -> (StatusCode, Value) {
        let mut request = Request::post(uri).header("content-type", "application/json");
        if let Some(token) = token {
            request = request.header("lease-token", token);
        }
        self.send(request.body(Body::from(body.to_string())).unwrap())
            .await
    }

    async fn get(&self, uri: &str) -> (StatusCode, Value) {
        self.send(Request::get(uri).body(Body::empty()).unwrap())
            .await
    }

    /// Begins a turn; returns its id and lease token.
    async fn begin(&self, session: &str) -> (String, String) {
        let (status, body) = self
            .post(
                "/v1/turns",
                None,
                &json!({"user_id": "u", "session_id": session, "client_request_id": "r"}),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        (
            body["turn"]["turn_id"].as_str().unwrap().to_owned(),
            body["turn"]["lease_token"].as_str().unwrap().to_owned(),
        )
    }
}

#[track_caller]
fn assert_invalid(status: StatusCode, body: &Value, names: &str) {
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "invalid_request", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(names), "{message:?} does not name {names}");
}

/// Percent-encodes every byte of `text` for a path segment or a query value.
fn encode(text: &str) -> String {
    text.bytes().map(|b| format!("%{b:02X}")).collect()
}

/// `levels` arrays around a scalar: nesting `levels` as the limit counts it.
fn nested(levels: usize) -> Value {
    (0..levels).fold(json!("leaf"), |inner, _| json!([inner]))
}

/// Mismatch: `maxLength: 128` counts characters, the server counted bytes,
/// so 43 × "中" (129 bytes) was refused. Now both count characters.
#[tokio::test]
async fn body_ids_are_limited_in_characters_as_max_length_counts() {
    let app = app().await;
    for (i, unit) in ["x", "中", "😀"].into_iter().enumerate() {
        let at_limit = unit.repeat(MAX_ID_CHARS);
        let begin = json!({
            "user_id": at_limit,
            "session_id": format!("{i}{}", unit.repeat(MAX_ID_CHARS - 1)),
            "client_request_id": at_limit,
        });
        let (status, body) = app.post("/v1/turns", None, &begin).await;
        assert_eq!(status, StatusCode::CREATED, "{unit}: {body}");
        assert_eq!(body["turn"]["user_id"], json!(at_limit), "stored exactly");
        let (turn, token) = (
            body["turn"]["turn_id"].as_str().unwrap(),
            body["turn"]["lease_token"].as_str().unwrap(),
        );
        let tools = format!("/v1/turns/{turn}/tools");
        let claim = json!({"tool": at_limit, "args": {}});
        let (status, body) = app.post(&tools, Some(token), &claim).await;
        assert_eq!(status, StatusCode::CREATED, "{unit}: {body}");

        let over = unit.repeat(MAX_ID_CHARS + 1);
        for field in ["user_id", "session_id", "client_request_id"] {
            let mut begin =
                json!({"user_id": "u", "session_id": "s-over", "client_request_id": "r"});
            begin[field] = json!(over);
            let (status, body) = app.post("/v1/turns", None, &begin).await;
            assert_invalid(status, &body, "129 characters");
        }
        let claim = json!({"tool": over, "args": {}});
        let (status, body) = app.post(&tools, Some(token), &claim).await;
        assert_invalid(status, &body, "129 characters");
    }
    // The reported case.
    let begin = json!({"user_id": "中".repeat(43), "session_id": "s43", "client_request_id": "r"});
    let (status, body) = app.post("/v1/turns", None, &begin).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
}

/// Mismatch: the id schema allowed control characters, the server refused
/// them. The schema now has a `pattern` for exactly the refused ones.
#[tokio::test]
async fn control_characters_are_refused_in_ids_and_their_neighbours_accepted() {
    let app = app().await;
    for (i, refused) in ['\u{0}', '\u{1f}', '\u{7f}', '\u{85}', '\u{9f}']
        .into_iter()
        .enumerate()
    {
        let session = format!("c{i}{refused}");
        let begin = json!({"user_id": "u", "session_id": session, "client_request_id": "r"});
        let (status, body) = app.post("/v1/turns", None, &begin).await;
        assert_invalid(status, &body, "control characters");
        let (status, body) = app.get(&format!("/v1/sessions/{}", encode(&session))).await;
        assert_invalid(status, &body, "control characters");
    }
    for (i, accepted) in [' ', '\u{a0}', '\u{2028}', '\u{fffd}', '\u{10ffff}']
        .into_iter()
        .enumerate()
    {
        let session = format!("n{i}{accepted}");
        let begin = json!({"user_id": "u", "session_id": session, "client_request_id": "r"});
        let (status, body) = app.post("/v1/turns", None, &begin).await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "U+{:04X}: {body}",
            u32::from(accepted)
        );
        let (status, body) = app.get(&format!("/v1/sessions/{}", encode(&session))).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
}

/// Path and query ids follow the same schema: at the limit an unknown one
/// is 404, past it (or empty, or with a control character) 400. The
/// `user_id` query used to be compared unchecked, so a malformed one was
/// a silent `not_found`.
#[tokio::test]
async fn path_and_query_ids_are_checked_like_body_ids() {
    let app = app().await;
    let at_limit = encode(&"中".repeat(MAX_ID_CHARS));
    let over = encode(&"中".repeat(MAX_ID_CHARS + 1));
    for template in ["/v1/sessions/{}", "/v1/turns/{}"] {
        let (status, body) = app.get(&template.replace("{}", &at_limit)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{template}: {body}");
        let (status, body) = app.get(&template.replace("{}", &over)).await;
        assert_invalid(status, &body, "129 characters");
    }
    let (status, body) = app.get(&format!("/v1/users/{at_limit}")).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "an unknown user has no turns: {body}"
    );
    let (status, body) = app.get(&format!("/v1/users/{over}")).await;
    assert_invalid(status, &body, "129 characters");

    app.begin("s").await;
    let (status, body) = app.get("/v1/sessions/s?user_id=u").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = app.get(&format!("/v1/sessions/s?user_id={at_limit}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "another user's: {body}");
    for (query, names) in [
        (String::new(), "must not be empty"),
        (over, "129 characters"),
        ("%0A".to_owned(), "control characters"),
    ] {
        let (status, body) = app.get(&format!("/v1/sessions/s?user_id={query}")).await;
        assert_invalid(status, &body, names);
    }
}

/// Mismatch: the `Lease-Token` header was a plain string in the document;
/// the server refused empty and over-128 ones. The schema now says 1–128
/// printable ASCII characters without spaces, which is exactly what passes
/// to the store (and a wrong one there is `lease_lost`).
#[tokio::test]
async fn lease_tokens_are_checked_exactly_as_documented() {
    let app = app().await;
    let (turn, token) = app.begin("s").await;
    let heartbeat = format!("/v1/turns/{turn}/heartbeat");
    let beat = |value: &[u8]| {
        Request::post(heartbeat.as_str())
            .header("lease-token", value)
            .body(Body::empty())
            .unwrap()
    };
    for wrong in ["!".to_owned(), "~".repeat(MAX_ID_CHARS)] {
        let (status, body) = app.send(beat(wrong.as_bytes())).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert_eq!(body["error"]["code"], "lease_lost");
    }
    for refused in [
        b"".to_vec(),
        "x".repeat(MAX_ID_CHARS + 1).into_bytes(),
        b"a b".to_vec(),
        b"a\tb".to_vec(),
        "é".as_bytes().to_vec(),
    ] {
        let (status, body) = app.send(beat(&refused)).await;
        assert_invalid(status, &body, "Lease-Token");
    }
    let (status, body) = app.send(beat(token.as_bytes())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// Mismatch: "64 levels" was documented and 63 arrays around a scalar were
/// the most accepted. Depth now counts arrays and objects only, 64 of them
/// accepted and 65 refused, in every JSON field.
#[tokio::test]
async fn json_nests_exactly_the_documented_depth_in_every_field() {
    let app = app().await;
    let begin = |request: &str, payload: Value| json!({"user_id": "u", "session_id": format!("s-{request}"), "client_request_id": request, "payload": payload});
    let (status, body) = app
        .post("/v1/turns", None, &begin("at", nested(MAX_JSON_DEPTH)))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = app
        .post(
            "/v1/turns",
            None,
            &begin("over", nested(MAX_JSON_DEPTH + 1)),
        )
        .await;
    assert_invalid(status, &body, "nests deeper than 64");

    let (turn, token) = app.begin("s").await;
    let tools = format!("/v1/turns/{turn}/tools");
    let (status, body) = app
        .post(
            &tools,
            Some(&token),
            &json!({"tool": "t", "args": nested(MAX_JSON_DEPTH + 1)}),
        )
        .await;
    assert_invalid(status, &body, "nests deeper than 64");
    let (status, body) = app
        .post(
            &tools,
            Some(&token),
            &json!({"tool": "t", "args": nested(MAX_JSON_DEPTH)}),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let execution = body["execution"]["execution_id"].as_str().unwrap();
    let complete = format!("/v1/turns/{turn}/tools/{execution}/complete");
    let (status, body) = app
        .post(
            &complete,
            Some(&token),
            &json!({"result": nested(MAX_JSON_DEPTH + 1)}),
        )
        .await;
    assert_invalid(status, &body, "nests deeper than 64");
    let (status, body) = app
        .post(
            &complete,
            Some(&token),
            &json!({"result": nested(MAX_JSON_DEPTH)}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let end = format!("/v1/turns/{turn}/complete");
    let (status, body) = app
        .post(
            &end,
            Some(&token),
            &json!({"response": nested(MAX_JSON_DEPTH + 1)}),
        )
        .await;
    assert_invalid(status, &body, "nests deeper than 64");
    let (status, body) = app
        .post(
            &end,
            Some(&token),
            &json!({"response": nested(MAX_JSON_DEPTH)}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// The `JsonValue` schema bounds every number to ±(2^53−1), as I-JSON and
/// the server do: the edges are accepted, one past them refused.
#[tokio::test]
async fn numbers_are_bounded_exactly_as_the_json_value_schema_says() {
    let app = app().await;
    let safe = MAX_SAFE_INTEGER;
    let begin = |request: &str, n: &str| {
        format!(
            r#"{{"user_id":"u","session_id":"s-{request}","client_request_id":"r","payload":{{"a":[{n}]}}}}"#
        )
    };
    for (request, number) in [("max", format!("{safe}")), ("min", format!("-{safe}"))] {
        let request = Request::post("/v1/turns")
            .header("content-type", "application/json")
            .body(Body::from(begin(request, &number)))
            .unwrap();
        let (status, body) = app.send(request).await;
        assert_eq!(status, StatusCode::CREATED, "{number}: {body}");
    }
    for number in [
        format!("{}", safe + 1),
        format!("-{}", safe + 1),
        "1e300".into(),
    ] {
        let request = Request::post("/v1/turns")
            .header("content-type", "application/json")
            .body(Body::from(begin("over", &number)))
            .unwrap();
        let (status, body) = app.send(request).await;
        assert_invalid(status, &body, "/payload/a/0");
    }
}

/// The orphan filter's documented bounds (`maximum` of `min_orphaned_ms`,
/// `maxItems` of the id lists, each item an `Id`) are the server's.
#[tokio::test]
async fn orphan_filters_are_bounded_exactly_as_documented() {
    let app = app().await;
    let retention = u64::try_from(MAX_RETENTION.as_millis()).unwrap();
    let ids = |n: usize| (0..n).map(|i| format!("id{i}")).collect::<Vec<_>>();
    let accepted = [
        json!({}),
        json!({"min_orphaned_ms": retention}),
        // Schema fuzzing found `17088.0` refused: JSON Schema's `integer`
        // is any number without a fractional part.
        json!({"min_orphaned_ms": 17088.0}),
        json!({"min_orphaned_ms": retention as f64}),
        json!({"user_ids": ids(MAX_ORPHAN_FILTER_IDS), "turn_ids": ids(MAX_ORPHAN_FILTER_IDS)}),
        json!({"user_ids": ["中".repeat(MAX_ID_CHARS)]}),
    ];
    for body in accepted {
        let (status, answer) = app.post("/v1/orphans/claim", None, &body).await;
        assert_eq!(status, StatusCode::NO_CONTENT, "{body}: {answer}");
    }
    let refused = [
        (json!({"min_orphaned_ms": retention + 1}), "min_orphaned_ms"),
        (json!({"min_orphaned_ms": -1}), "min_orphaned_ms"),
        (json!({"min_orphaned_ms": 1.5}), "min_orphaned_ms"),
        (
            json!({"min_orphaned_ms": (retention + 1) as f64}),
            "min_orphaned_ms",
        ),
        (
            json!({"user_ids": ids(MAX_ORPHAN_FILTER_IDS + 1)}),
            "101 users",
        ),
        (
            json!({"turn_ids": ids(MAX_ORPHAN_FILTER_IDS + 1)}),
            "101 turns",
        ),
        (json!({"user_ids": [""]}), "must not be empty"),
        (json!({"turn_ids": ["a\u{7f}"]}), "control characters"),
        (
            json!({"user_ids": ["中".repeat(MAX_ID_CHARS + 1)]}),
            "129 characters",
        ),
        (json!({"extra": 1}), "unknown field"),
    ];
    for (body, names) in refused {
        let (status, answer) = app.post("/v1/orphans/claim", None, &body).await;
        assert_invalid(status, &answer, names);
    }
}

/// The document states the limits from the same constants the engine
/// enforces, and every id, header and JSON field uses those schemas.
#[test]
fn the_document_states_the_engines_limits() {
    let doc: Value = serde_json::from_str(&agentgate_server::openapi::document_json()).unwrap();
    let schemas = &doc["components"]["schemas"];
    let id = &schemas["Id"];
    assert_eq!(id["type"], "string");
    assert_eq!(id["minLength"], 1);
    assert_eq!(id["maxLength"], json!(MAX_ID_CHARS));
    assert_eq!(id["pattern"], agentgate_server::schema::ID_PATTERN);
    let token = &schemas["LeaseToken"];
    assert_eq!(token["minLength"], 1);
    assert_eq!(token["maxLength"], json!(MAX_ID_CHARS));
    assert_eq!(
        token["pattern"],
        agentgate_server::schema::LEASE_TOKEN_PATTERN
    );
    // JsonValue bounds numbers at every depth: its bounds, `items` and
    // (for objects) `additionalProperties` all apply to the value and to
    // each nested one through the reference to itself.
    let json_value = &schemas["JsonValue"];
    let itself = json!({ "$ref": "#/components/schemas/JsonValue" });
    assert_eq!(json_value["maximum"], json!(MAX_SAFE_INTEGER));
    assert_eq!(
        json_value["minimum"],
        json!(-i64::try_from(MAX_SAFE_INTEGER).unwrap())
    );
    assert_eq!(json_value["items"], itself);
    assert_eq!(json_value["if"], json!({ "type": "object" }));
    assert_eq!(json_value["then"]["additionalProperties"], itself);

    let orphans = &schemas["ClaimOrphanRequest"]["properties"];
    assert_eq!(
        orphans["min_orphaned_ms"]["maximum"],
        json!(u64::try_from(MAX_RETENTION.as_millis()).unwrap())
    );
    for list in ["user_ids", "turn_ids"] {
        assert_eq!(
            orphans[list]["maxItems"],
            json!(MAX_ORPHAN_FILTER_IDS),
            "{list}"
        );
        assert_eq!(
            orphans[list]["items"]["$ref"], "#/components/schemas/Id",
            "{list}"
        );
    }

    // Every id parameter (each path parameter, the user_id query) is `Id`,
    // every Lease-Token header `LeaseToken`. (Other query parameters, such
    // as paging, have schemas of their own.)
    let mut parameters = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            for parameter in operation["parameters"].as_array().into_iter().flatten() {
                let name = parameter["name"].as_str().unwrap();
                if parameter["in"] != "path" && name != "user_id" && name != "Lease-Token" {
                    continue;
                }
                parameters += 1;
                let schema = &parameter["schema"];
                let target = schema["$ref"]
                    .as_str()
                    .or_else(|| {
                        // An optional query parameter: `Id` or null.
                        schema["oneOf"]
                            .as_array()?
                            .iter()
                            .find_map(|s| s["$ref"].as_str())
                    })
                    .unwrap_or_else(|| panic!("{method} {path} {parameter}: not a named schema"));
                let expected = if parameter["name"] == "Lease-Token" {
                    "#/components/schemas/LeaseToken"
                } else {
                    "#/components/schemas/Id"
                };
                assert_eq!(target, expected, "{method} {path} {}", parameter["name"]);
            }
        }
    }
    assert!(parameters >= 22, "{parameters} parameters checked");

    // Every request body's id and JSON fields.
    for (schema, field, expected) in [
        ("BeginRequest", "user_id", "Id"),
        ("BeginRequest", "session_id", "Id"),
        ("BeginRequest", "client_request_id", "Id"),
        ("BeginRequest", "payload", "JsonValue"),
        ("ConfirmationRequest", "turn_id", "Id"),
        ("ClaimToolRequest", "tool", "Id"),
        ("ClaimToolRequest", "args", "JsonValue"),
        ("CompleteToolRequest", "result", "JsonValue"),
        ("FailToolRequest", "error", "JsonValue"),
        ("CompleteTurnRequest", "response", "JsonValue"),
        ("FailTurnRequest", "error", "JsonValue"),
        ("AwaitConfirmationRequest", "pending", "JsonValue"),
    ] {
        let object = body_object(&schemas[schema]);
        let property = &object["properties"][field];
        let target = property["$ref"]
            .as_str()
            .or_else(|| property["allOf"][0]["$ref"].as_str())
            .unwrap_or_else(|| panic!("{schema}.{field}: {property}"));
        assert_eq!(
            target,
            format!("#/components/schemas/{expected}"),
            "{schema}.{field}"
        );
        assert_eq!(
            object["additionalProperties"],
            json!(false),
            "{schema}: unknown fields are refused, and documented so"
        );
    }
}

/// A request body's derived object: the schema itself, or the first part
/// of an `allOf` that adds a constraint across its fields.
fn body_object(schema: &Value) -> &Value {
    schema["allOf"].get(0).unwrap_or(schema)
}

/// Mismatch: `{"on_busy": "reject", "wait_ms": 0}` was valid by the
/// document and refused 400 by the server (schema fuzzing, CI of 2 Dec).
/// Now the document says it: each body below is accepted exactly when the
/// document's `anyOf` on `BeginRequest` holds, read from the served
/// document rather than restated here.
#[tokio::test]
async fn wait_ms_is_accepted_exactly_where_the_document_allows_it() {
    let document: Value =
        serde_json::from_str(&agentgate_server::openapi::document_json()).unwrap();
    let begin = &document["components"]["schemas"]["BeginRequest"];
    let branches = begin["allOf"][1]["anyOf"].as_array().unwrap();
    assert_eq!(branches.len(), 2, "{begin}");
    assert_eq!(
        branches[0]["properties"]["wait_ms"]["type"], "null",
        "{begin}"
    );
    assert_eq!(branches[1]["required"], json!(["on_busy"]), "{begin}");
    let waiting = branches[1]["properties"]["on_busy"]["enum"]
        .as_array()
        .unwrap();
    let documented = |body: &Value| {
        body.get("wait_ms").is_none_or(Value::is_null)
            || body.get("on_busy").is_some_and(|p| waiting.contains(p))
    };

    let app = app().await;
    let cases = [
        json!({"on_busy": "reject", "wait_ms": 0}),
        json!({"on_busy": "reject", "wait_ms": 5}),
        json!({"wait_ms": 0}),
        json!({"on_busy": "reject", "wait_ms": null}),
        json!({"on_busy": "reject"}),
        json!({"wait_ms": null}),
        json!({}),
        json!({"on_busy": "wait", "wait_ms": 0}),
        // JSON Schema's `integer` includes a whole float (schema fuzzing).
        json!({"on_busy": "wait", "wait_ms": 2929.0}),
        json!({"on_busy": "interrupt", "wait_ms": 20000}),
        json!({"on_busy": "wait"}),
    ];
    let mut refused = 0;
    for (i, mut body) in cases.into_iter().enumerate() {
        // One user per case: the per-user limit is not under test.
        body["user_id"] = json!(format!("u{i}"));
        body["session_id"] = json!(format!("s{i}"));
        body["client_request_id"] = json!("r");
        let (status, answer) = app.post("/v1/turns", None, &body).await;
        if documented(&body) {
            assert_eq!(status, StatusCode::CREATED, "{body}: {answer}");
        } else {
            assert_invalid(status, &answer, "wait_ms");
            refused += 1;
        }
    }
    assert_eq!(refused, 3, "the three contradictions are refused");
}
