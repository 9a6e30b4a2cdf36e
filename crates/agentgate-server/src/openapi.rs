//! The route table and the OpenAPI 3.1 document generated from it.
//!
//! `v1_routes` and `ops_routes` are the only lists of routes: the router
//! is built from them ([`crate::router`]) and so is the document
//! ([`document`]), each handler registered once with its `#[utoipa::path]`
//! (method, path, parameters, every response and error code). A route cannot
//! exist without being documented, nor be documented without existing.
//!
//! Deliberately absent: the reference app's pages and endpoints
//! (`agentgate-app`, mounted through [`crate::mount`]), which the router
//! serves beside these when one is mounted. They are the chat page's own
//! API, not the v1 contract.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::OpenApi as Document;
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{ErrorBody, ErrorCode, ErrorDetail};
use crate::routes::{events, ops, orphans, tools, turns, views};
use crate::schema::{Id, JsonValue, LeaseTokenText};
use crate::AppState;

/// The document's fixed parts; paths come from the routes.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "agentgate",
        description = "Concurrency control for AI-agent backends: one turn per conversation, \
            N turns per user, request replay, exactly-once tool executions, fenced takeover. \
            Every error is `{\"error\": {\"code\", \"message\", \"retry_after_ms\"?, \"active_turn_id\"?, \"execution_id\"?, \"attempt\"?}}` \
            with a meaningful status; 409 and 429 conflicts and every 503 carry `Retry-After` (seconds). \
            JSON bodies must be sent as `Content-Type: application/json` (else 415). A request whose \
            `Origin` or `Host` names neither this server nor an allowed origin or host is refused 403.",
    ),
    // The parameter schemas are named here: utoipa collects only the ones
    // request and response bodies reach.
    components(schemas(ErrorBody, ErrorDetail, ErrorCode, Id, LeaseTokenText, JsonValue)),
    modifiers(&BearerAuth),
    tags(
        (name = "turns", description = "Begin, heartbeat and end a turn"),
        (name = "tools", description = "Claim, complete and fail tool executions inside a turn"),
        (name = "views", description = "Read-only state; never a lease token"),
        (name = "recovery", description = "Claim an orphaned turn (its worker died) to resume it"),
        (name = "ops", description = "Health, readiness, metrics and this document; never behind an API key"),
    )
)]
struct ApiDoc;

/// Declares the `bearer` scheme the `/v1` operations name.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut Document) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "Required on every /v1 call when the server is started with --api-key",
                    ))
                    .build(),
            ),
        );
    }
}

/// The `/v1` routes: the turn protocol. These sit behind the API key check.
pub(crate) fn v1_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(turns::begin))
        .routes(routes!(turns::heartbeat))
        .routes(routes!(turns::complete))
        .routes(routes!(turns::fail))
        .routes(routes!(turns::await_confirmation))
        .routes(routes!(turns::cancel))
        .routes(routes!(events::append_events, events::follow_events))
        .routes(routes!(turns::end_cancelled))
        .routes(routes!(tools::claim))
        .routes(routes!(tools::complete))
        .routes(routes!(tools::fail))
        .routes(routes!(views::turn))
        .routes(routes!(views::turn_executions))
        .routes(routes!(views::session))
        .routes(routes!(views::release))
        .routes(routes!(views::set_session_policy))
        .routes(routes!(views::user))
        .routes(routes!(orphans::claim))
}

/// The operations routes, always open.
pub(crate) fn ops_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::metrics))
        .routes(routes!(ops::openapi))
}

/// The operations whose handler's name is not unique in the document, named
/// in full (all are POSTs). An `operationId` must be unique (OpenAPI 3.1,
/// 4.8.10.1), and it is the name a generated client gives the operation's
/// function; utoipa takes the handler's name, which `tools`, `turns` and
/// `orphans` share (`claim`, `complete`, `fail`), and which for `release`
/// would not say what is released.
const POST_OPERATION_IDS: [(&str, &str); 7] = [
    ("/v1/orphans/claim", "claim_orphan"),
    ("/v1/sessions/{session_id}/release", "release_session"),
    ("/v1/turns/{turn_id}/tools", "claim_tool"),
    (
        "/v1/turns/{turn_id}/tools/{execution_id}/complete",
        "complete_tool",
    ),
    ("/v1/turns/{turn_id}/tools/{execution_id}/fail", "fail_tool"),
    ("/v1/turns/{turn_id}/complete", "complete_turn"),
    ("/v1/turns/{turn_id}/fail", "fail_turn"),
];

/// The OpenAPI 3.1 document of every route.
pub fn document() -> Document {
    let mut document = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(v1_routes())
        .merge(ops_routes())
        .into_openapi();
    for (path, id) in POST_OPERATION_IDS {
        let operation = document
            .paths
            .paths
            .get_mut(path)
            .and_then(|item| item.post.as_mut())
            .unwrap_or_else(|| panic!("POST {path} is a route"));
        operation.operation_id = Some(id.to_owned());
    }
    wait_ms_needs_a_waiting_policy(&mut document);
    event_stream_items(&mut document);
    document
}

/// The path and media type of the one streamed answer.
const EVENT_STREAM: (&str, &str) = ("/v1/turns/{turn_id}/events", "text/event-stream");

/// Describes what an event stream carries, item by item. OpenAPI 3.1 can
/// only call a `text/event-stream` body a string; the events in it are
/// described by the component `TurnStreamEvent` (one object per SSE
/// event: its `id`, `event` and `data` lines, `data` parsed as JSON),
/// which the body names in the `x-sse-item-schema` extension (the role
/// OpenAPI 3.2 gives `itemSchema`) and its description, so a generated
/// client knows each event's shape and that the body is a stream, not one
/// string to wait for.
fn event_stream_items(document: &mut Document) {
    use utoipa::openapi::extensions::ExtensionsBuilder;
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Schema, Type};
    use utoipa::openapi::{Ref, RefOr, Response};

    let string = |description: &str| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(description.to_owned()))
    };
    let integer = || {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(0))
    };
    let named = |names: &[&'static str]| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(names.to_vec()))
    };
    // Every object is a component of its own, referenced by name: inline
    // objects inside a `oneOf` make generators (openapi-python-client)
    // derive clashing model names.
    let data = |name: &str| RefOr::Ref(Ref::from_schema_name(name));
    let parts: [(&str, Schema); 7] = [
        (
            "TurnStreamAppendedData",
            ObjectBuilder::new()
                .property("attempt", integer())
                .property(
                    "data",
                    ObjectBuilder::new().description(Some("The JSON appended")),
                )
                .required("attempt")
                .required("data")
                .into(),
        ),
        (
            "TurnStreamAppended",
            ObjectBuilder::new()
                .description(Some("An event the holder appended, in id order"))
                .property(
                    "id",
                    string("The event id (digits): resume after it with `Last-Event-ID`")
                        .pattern(Some("^[0-9]+$")),
                )
                .property(
                    "event",
                    string("The name it was appended with (never `end` or `error`)"),
                )
                .property("data", data("TurnStreamAppendedData"))
                .required("id")
                .required("event")
                .required("data")
                .into(),
        ),
        (
            "TurnStreamEndData",
            ObjectBuilder::new()
                .property("state", string("The turn's ending"))
                .property("attempt", integer())
                .required("state")
                .required("attempt")
                .into(),
        ),
        (
            "TurnStreamEnd",
            ObjectBuilder::new()
                .description(Some(
                    "The turn ended and every event was sent; the stream closes after it. No id",
                ))
                .property("event", named(&["end"]))
                .property("data", data("TurnStreamEndData"))
                .required("event")
                .required("data")
                .into(),
        ),
        (
            "TurnStreamErrorData",
            ObjectBuilder::new()
                .property("code", string("An error code"))
                .property("message", string("What happened"))
                .required("code")
                .required("message")
                .into(),
        ),
        (
            "TurnStreamError",
            ObjectBuilder::new()
                .description(Some(
                    "A read failed; the stream closes after it. Resume with `Last-Event-ID`",
                ))
                .property("event", named(&["error"]))
                .property("data", data("TurnStreamErrorData"))
                .required("event")
                .required("data")
                .into(),
        ),
        (
            "TurnStreamEvent",
            OneOfBuilder::new()
                .description(Some(
                    "One Server-Sent Event of a turn's stream: its `id`, `event` and `data` lines, `data` as parsed JSON. A stream that closes without `end` was cut (a stall, its lifetime): resume with `Last-Event-ID`",
                ))
                .item(data("TurnStreamAppended"))
                .item(data("TurnStreamEnd"))
                .item(data("TurnStreamError"))
                .into(),
        ),
    ];
    let schemas = &mut document
        .components
        .as_mut()
        .expect("the document names its components")
        .schemas;
    for (name, schema) in parts {
        schemas.insert(name.to_owned(), RefOr::T(schema));
    }

    let (path, media) = EVENT_STREAM;
    let response = document
        .paths
        .paths
        .get_mut(path)
        .and_then(|item| item.get.as_mut())
        .and_then(|operation| operation.responses.responses.get_mut("200"))
        .unwrap_or_else(|| panic!("GET {path} answers 200"));
    let RefOr::T(Response { content, .. }) = response else {
        panic!("GET {path}'s 200 is inline");
    };
    let content = content
        .get_mut(media)
        .unwrap_or_else(|| panic!("GET {path}'s 200 is {media}"));
    content.extensions = Some(
        ExtensionsBuilder::new()
            .add(
                "x-sse-item-schema",
                serde_json::json!({"$ref": "#/components/schemas/TurnStreamEvent"}),
            )
            .build(),
    );
}

/// States in the schemas of `BeginRequest` and `SessionPolicyRequest` what
/// the server refuses with 400 `invalid_request` ([`agentgate::OnBusy::new`],
/// [`agentgate::OnBusy::interrupting`]): a `wait_ms` beside a policy that
/// does not wait, named or not, and `interrupt_running` beside one other
/// than `supersede`, are contradictions. A derived schema cannot relate two
/// fields, so each is wrapped: `allOf` the derived object, `anyOf` "no
/// `wait_ms`" (absent or `null`) or "a waiting `on_busy`", and `anyOf` "no
/// `interrupt_running`" (absent or `false`) or "`on_busy: supersede`".
fn wait_ms_needs_a_waiting_policy(document: &mut Document) {
    use utoipa::openapi::schema::{AllOfBuilder, AnyOfBuilder, ObjectBuilder, Schema, Type};
    use utoipa::openapi::RefOr;

    let schemas = &mut document
        .components
        .as_mut()
        .expect("the document names its components")
        .schemas;
    let policy_is = |policies: &[&'static str]| {
        ObjectBuilder::new().required("on_busy").property(
            "on_busy",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(policies.to_vec())),
        )
    };
    for name in ["BeginRequest", "SessionPolicyRequest"] {
        let derived = schemas
            .remove(name)
            .unwrap_or_else(|| panic!("{name} is a request body"));
        let no_wait =
            ObjectBuilder::new().property("wait_ms", ObjectBuilder::new().schema_type(Type::Null));
        let waits = AnyOfBuilder::new()
            .description(Some(
                "`wait_ms` only with `on_busy` `wait` or `interrupt`, never with another policy or none",
            ))
            .item(no_wait)
            .item(policy_is(&["wait", "interrupt"]));
        let no_interrupt = ObjectBuilder::new().property(
            "interrupt_running",
            ObjectBuilder::new()
                .schema_type(Type::Boolean)
                .enum_values(Some([false])),
        );
        let interrupts = AnyOfBuilder::new()
            .description(Some(
                "`interrupt_running: true` only with `on_busy: supersede`",
            ))
            .item(no_interrupt)
            .item(policy_is(&["supersede"]));
        let description = match &derived {
            RefOr::T(Schema::Object(object)) => object.description.clone(),
            _ => panic!("{name} derives an object schema"),
        };
        let constrained = AllOfBuilder::new()
            .description(description)
            .item(derived)
            .item(waits)
            .item(interrupts)
            .build();
        schemas.insert(name.to_owned(), RefOr::T(Schema::AllOf(constrained)));
    }
}

/// [`document`] as JSON text.
pub fn document_json() -> String {
    document()
        .to_pretty_json()
        .expect("an OpenAPI document built from static types serialises")
}
