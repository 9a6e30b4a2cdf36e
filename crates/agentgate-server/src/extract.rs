//! Extractors that turn every malformed request into our JSON error (400
//! `invalid_request`, 408 `request_timeout`, 413 `payload_too_large`, 415
//! `unsupported_media_type`) instead of axum's plain-text rejections.
//!
//! Ids are validated by the engine's constructors after extraction; this
//! module only gets bytes, JSON and headers into shape.

use agentgate::model::LeaseRef;
use agentgate::TurnId;
use agentgate_core::canonical::parse_i_json;
use agentgate_core::error::Error;
use agentgate_core::ids::LeaseToken;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header;
use axum::http::request::Parts;
use http_body_util::BodyExt as _;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, ErrorCode};
use crate::limits::{BODY_READ_TIMEOUT, MAX_DRAINED_BYTES};
use crate::AppState;

/// The name of the header that carries a lease token.
pub const LEASE_TOKEN_HEADER: &str = "lease-token";

/// A JSON body of at most the server's body limit, sent as
/// `Content-Type: application/json` (parameters such as `charset` allowed),
/// read within [`BODY_READ_TIMEOUT`]; the bytes must be I-JSON (RFC 7493: no
/// duplicate member names, numbers exact in a double) of the expected shape.
///
/// The content type is required, not guessed: a web page on another site
/// may make the user's browser POST `text/plain` (or a form) to a loopback
/// server without asking it first, but not `application/json`. Refusing the
/// rest closes that door even when no API key is configured.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// 415 unless the request declares a JSON body.
fn require_json(request: &Request) -> Result<(), ApiError> {
    let declared = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    let essence = declared.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    let sent = if declared.is_empty() {
        "no Content-Type".to_owned()
    } else {
        format!("Content-Type {declared:?}")
    };
    Err(ApiError::new(
        ErrorCode::UnsupportedMediaType,
        format!(
            "this endpoint takes a JSON body sent as Content-Type: application/json; got {sent}"
        ),
    ))
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        ErrorCode::PayloadTooLarge,
        format!("request body is over the server's limit of {limit} bytes"),
    )
}

/// Reads a body of at most `limit` bytes. A larger one is read on and
/// discarded up to [`MAX_DRAINED_BYTES`] more before the 413 is sent: a
/// client still sending when the server answers and closes would otherwise
/// get a connection reset instead of our answer.
async fn read_body(request: Request, limit: usize) -> Result<Vec<u8>, ApiError> {
    tokio::time::timeout(BODY_READ_TIMEOUT, read_body_unbounded(request, limit))
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorCode::RequestTimeout,
                format!(
                    "the request body did not arrive within {} s",
                    BODY_READ_TIMEOUT.as_secs()
                ),
            )
        })?
}

/// [`read_body`] without its deadline.
async fn read_body_unbounded(request: Request, limit: usize) -> Result<Vec<u8>, ApiError> {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|length| length > limit.saturating_add(MAX_DRAINED_BYTES)) {
        return Err(too_large(limit));
    }
    let mut body = request.into_body();
    let mut buffer = Vec::with_capacity(declared.unwrap_or(0).min(limit));
    let mut seen: usize = 0;
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| ApiError::invalid(format!("cannot read request body: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers carry nothing we read
        };
        seen = seen.saturating_add(data.len());
        if seen > limit.saturating_add(MAX_DRAINED_BYTES) {
            break;
        }
        if seen <= limit {
            buffer.extend_from_slice(&data);
        }
    }
    if seen > limit {
        return Err(too_large(limit));
    }
    Ok(buffer)
}

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        require_json(&request)?;
        let bytes = read_body(request, state.max_body_bytes()).await?;
        // I-JSON first: once serde_json has built a value, a repeated member
        // name and a rounded number can no longer be seen.
        let value = parse_i_json(&bytes).map_err(|error| match error {
            Error::InvalidRequest { message } => {
                ApiError::invalid(format!("request body: {message}"))
            }
            other => ApiError::from(other),
        })?;
        serde_json::from_value(value)
            .map(ApiJson)
            .map_err(|error| ApiError::invalid(format!("request body: {error}")))
    }
}

/// A raw body of any content type (an uploaded file) with the same bounds
/// and errors as [`ApiJson`]'s: at most the server's body limit (413
/// `payload_too_large`), read within [`BODY_READ_TIMEOUT`] (408
/// `request_timeout`), in the JSON error shape.
#[derive(Debug)]
pub struct ApiBytes(pub Vec<u8>);

impl FromRequest<AppState> for ApiBytes {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        read_body(request, state.max_body_bytes())
            .await
            .map(ApiBytes)
    }
}

/// Path parameters.
#[derive(Debug)]
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| ApiPath(value))
            .map_err(|rejection| ApiError::invalid(format!("path: {}", rejection.body_text())))
    }
}

/// Query parameters.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(value)| ApiQuery(value))
            .map_err(|rejection| ApiError::invalid(format!("query: {}", rejection.body_text())))
    }
}

/// The `Lease-Token` header every call after begin carries.
pub struct LeaseHeader(pub LeaseToken);

impl std::fmt::Debug for LeaseHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseHeader(<redacted>)")
    }
}

impl<S: Send + Sync> FromRequestParts<S> for LeaseHeader {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let value = parts
            .headers
            .get(LEASE_TOKEN_HEADER)
            .ok_or_else(|| ApiError::invalid("missing Lease-Token header"))?;
        // Exactly the document's `LeaseToken` schema: 1-128 characters from
        // `!` to `~` (LeaseToken::parse); bytes outside ASCII are refused
        // the same way.
        let text = value.to_str().map_err(|_| {
            ApiError::invalid("Lease-Token header: a lease token is printable ASCII without spaces")
        })?;
        LeaseToken::parse(text)
            .map(LeaseHeader)
            .map_err(|error| ApiError::invalid(format!("Lease-Token header: {error}")))
    }
}

impl LeaseHeader {
    /// The lease reference for `turn_id`.
    ///
    /// # Errors
    /// `invalid_request` for a malformed turn id.
    pub fn for_turn(self, turn_id: String) -> Result<LeaseRef, ApiError> {
        Ok(LeaseRef {
            turn_id: TurnId::new(turn_id)?,
            token: self.0,
        })
    }
}

#[cfg(test)]
mod tests {
    //! docs/protocol.md §4.11 over HTTP: a body that is not I-JSON is a 400
    //! naming the member, never a replay of another request's result.
    #![allow(clippy::unwrap_used)]
    use agentgate::{Config, Gate};
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use serde_json::{json, Value};
    use tower::ServiceExt as _;

    use crate::{router, AppState, ServerOptions};

    async fn call(
        app: &axum::Router,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> (StatusCode, Value) {
        let mut request = Request::post(path).header("content-type", "application/json");
        if let Some(token) = token {
            request = request.header("lease-token", token);
        }
        let response = app
            .clone()
            .oneshot(request.body(Body::from(body.to_owned())).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    fn assert_invalid(status: StatusCode, body: &Value, path: &str) {
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["error"]["code"], "invalid_request", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(path), "{message} does not name {path}");
    }

    #[tokio::test]
    async fn bodies_that_are_not_i_json_are_refused_naming_the_member() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("gate.db").display());
        let gate = Gate::open(&url, Config::default()).await.unwrap();
        let app = router(AppState::new(gate, ServerOptions::default()).unwrap());
        let begin = |order: &str| {
            format!(
                r#"{{"user_id":"u","session_id":"s","client_request_id":"r","payload":{{"order":{order}}}}}"#
            )
        };

        let (status, body) = call(&app, "/v1/turns", None, &begin("9007199254740991")).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        let turn_id = body["turn"]["turn_id"].as_str().unwrap().to_owned();
        let token = body["turn"]["lease_token"].as_str().unwrap().to_owned();

        // Tool args: a duplicate member name, and an inexact number.
        let tools = format!("/v1/turns/{turn_id}/tools");
        let (status, body) = call(
            &app,
            &tools,
            Some(&token),
            r#"{"tool":"book","args":{"amount":{"a":1,"a":2}}}"#,
        )
        .await;
        assert_invalid(status, &body, "/args/amount/a");
        let (status, body) = call(
            &app,
            &tools,
            Some(&token),
            r#"{"tool":"book","args":{"amount":1e-400}}"#,
        )
        .await;
        assert_invalid(status, &body, "/args/amount");
        let (status, body) = call(
            &app,
            &tools,
            Some(&token),
            r#"{"tool":"book","args":{"amount":0}}"#,
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");

        let complete = format!("/v1/turns/{turn_id}/complete");
        let (status, body) = call(&app, &complete, Some(&token), r#"{"response":"first"}"#).await;
        assert_eq!(status, StatusCode::OK, "{body}");

        // The reported collision: 2^53 + 1 used to replay the first call's
        // result. Now it is refused, and so are its neighbours.
        for order in [
            "9007199254740993",
            "9007199254740992",
            "18446744073709551616",
            "18446744073709551615",
        ] {
            let (status, body) = call(&app, "/v1/turns", None, &begin(order)).await;
            assert_invalid(status, &body, "/payload/order");
        }
        let duplicate = r#"{"user_id":"u","session_id":"s","client_request_id":"r","payload":{"order":9007199254740991,"order":2}}"#;
        let (status, body) = call(&app, "/v1/turns", None, duplicate).await;
        assert_invalid(status, &body, "/payload/order");

        // The same request, spelled exactly, still replays.
        let (status, body) = call(&app, "/v1/turns", None, &begin("9007199254740991")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["turn"]["response"], json!("first"));
    }
}
