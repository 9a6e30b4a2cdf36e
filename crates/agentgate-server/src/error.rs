//! HTTP errors: the error body of docs/protocol.md §5.1 and the one mapping from error
//! code to HTTP status ([`status_of`]).
//!
//! Every refusal leaves the server through [`ApiError`]: engine errors
//! (converted by kind), bad input caught by the extractors, authentication,
//! unknown routes and timeouts. Nothing answers 200 with an error inside, and
//! bad input is never a 500. What this module does not own: deciding whether
//! something is an error — the engine and the extractors do that.

use std::time::Duration;

use agentgate::{Error, ErrorKind};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::{IntoResponses, ToSchema};

use crate::limits::{MAX_ERROR_MESSAGE_BYTES, UNAVAILABLE_RETRY_AFTER};

/// Every error code the server sends, in `error.code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: malformed JSON, a missing, unknown or oversized field, a missing
    /// `Lease-Token` header.
    InvalidRequest,
    /// 401: an API key is configured and the call lacks it or has a wrong one.
    Unauthorized,
    /// 403: the request's `Origin` is not this server nor an allowed origin
    /// (a web page elsewhere driving the user's browser).
    OriginNotAllowed,
    /// 403: the request's `Host` is not this server's listen address nor an
    /// allowed host (DNS rebinding).
    HostNotAllowed,
    /// 403: a trusted user header is configured and the body's `user_id`
    /// is not the header's.
    UserMismatch,
    /// 404: no such turn, session, tool execution, pending confirmation or
    /// route (also: a session or turn of another user).
    NotFound,
    /// 405: the route exists but not with this method.
    MethodNotAllowed,
    /// 408: the client did not send its request body in time.
    RequestTimeout,
    /// 413: the body is over the server's limit.
    PayloadTooLarge,
    /// 415: a JSON endpoint was sent a body without
    /// `Content-Type: application/json`.
    UnsupportedMediaType,
    /// 409 + `Retry-After`: the session is held by another live turn.
    SessionBusy,
    /// 409 + `Retry-After`: this very request is running under a live lease.
    RequestInFlight,
    /// 409 + `Retry-After`: the session waits for a person's confirmation.
    AwaitingConfirmation,
    /// 409: the confirmation names a turn whose pending confirmation
    /// expired; nothing was confirmed.
    ConfirmationExpired,
    /// 409 + `Retry-After`: this tool call is running under the caller's lease.
    ToolInFlight,
    /// 409: wrong lease token, taken over, expired, or turn already ended.
    /// Stop the turn: nothing more can be changed under this lease.
    LeaseLost,
    /// 409: a tool's previous attempt has an unknown outcome and a person
    /// must decide (library callers only).
    UnknownToolOutcome,
    /// 409: the turn was asked to stop (`POST /v1/turns/{id}/cancel`): it
    /// claims no more tools; its holder ends it with `end-cancelled`.
    TurnCancelled,
    /// 422: the `client_request_id` was used with a different payload.
    PayloadMismatch,
    /// 422: a tool execution used all its attempts; it will not run again.
    AttemptsExhausted,
    /// 429 + `Retry-After`: the user holds all of their permits.
    UserAtCapacity,
    /// 429 + `Retry-After`: the session's queue holds its limit of waiting
    /// turns (100); nothing was queued.
    QueueFull,
    /// 500: a caller-supplied side effect failed (library callers only).
    EffectFailed,
    /// 500: a bug in the server; reported, never expected.
    Internal,
    /// 503 + `Retry-After`: the store (or the Redis lease layer) could not
    /// be reached or did not answer in time.
    StoreUnavailable,
    /// 503 + `Retry-After`: the server is at its connection limit.
    Overloaded,
}

impl ErrorCode {
    /// The wire spelling, as in `error.code`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::Unauthorized => "unauthorized",
            Self::OriginNotAllowed => "origin_not_allowed",
            Self::HostNotAllowed => "host_not_allowed",
            Self::UserMismatch => "user_mismatch",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::RequestTimeout => "request_timeout",
            Self::PayloadTooLarge => "payload_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::SessionBusy => "session_busy",
            Self::RequestInFlight => "request_in_flight",
            Self::AwaitingConfirmation => "awaiting_confirmation",
            Self::ConfirmationExpired => "confirmation_expired",
            Self::ToolInFlight => "tool_in_flight",
            Self::LeaseLost => "lease_lost",
            Self::UnknownToolOutcome => "unknown_tool_outcome",
            Self::TurnCancelled => "turn_cancelled",
            Self::PayloadMismatch => "payload_mismatch",
            Self::AttemptsExhausted => "attempts_exhausted",
            Self::UserAtCapacity => "user_at_capacity",
            Self::QueueFull => "queue_full",
            Self::EffectFailed => "effect_failed",
            Self::Internal => "internal",
            Self::StoreUnavailable => "store_unavailable",
            Self::Overloaded => "overloaded",
        }
    }

    /// The code of an engine error kind; the spellings are the engine's.
    fn of_kind(kind: ErrorKind) -> Self {
        match kind {
            ErrorKind::InvalidRequest => Self::InvalidRequest,
            ErrorKind::NotFound => Self::NotFound,
            ErrorKind::SessionBusy => Self::SessionBusy,
            ErrorKind::RequestInFlight => Self::RequestInFlight,
            ErrorKind::AwaitingConfirmation => Self::AwaitingConfirmation,
            ErrorKind::ConfirmationExpired => Self::ConfirmationExpired,
            ErrorKind::ToolInFlight => Self::ToolInFlight,
            ErrorKind::LeaseLost => Self::LeaseLost,
            ErrorKind::TurnCancelled => Self::TurnCancelled,
            ErrorKind::PayloadMismatch => Self::PayloadMismatch,
            ErrorKind::UserAtCapacity => Self::UserAtCapacity,
            ErrorKind::QueueFull => Self::QueueFull,
            ErrorKind::UnknownToolOutcome => Self::UnknownToolOutcome,
            ErrorKind::AttemptsExhausted => Self::AttemptsExhausted,
            ErrorKind::Effect => Self::EffectFailed,
            ErrorKind::StoreUnavailable => Self::StoreUnavailable,
            // A kind added to the engine after this server was written: a
            // 500 says "update the server", which is the truth.
            _ => Self::Internal,
        }
    }

    /// Whether this is a protocol conflict a caller resolves by waiting or by
    /// changing its request (counted in `agentgate_conflicts_total`).
    pub fn is_conflict(self) -> bool {
        matches!(
            status_of(self),
            StatusCode::CONFLICT | StatusCode::UNPROCESSABLE_ENTITY | StatusCode::TOO_MANY_REQUESTS
        )
    }
}

/// The HTTP status of each error code: the one place it is decided.
pub fn status_of(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::InvalidRequest => StatusCode::BAD_REQUEST,
        ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
        ErrorCode::OriginNotAllowed | ErrorCode::HostNotAllowed | ErrorCode::UserMismatch => {
            StatusCode::FORBIDDEN
        }
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
        ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ErrorCode::SessionBusy
        | ErrorCode::RequestInFlight
        | ErrorCode::AwaitingConfirmation
        | ErrorCode::ConfirmationExpired
        | ErrorCode::ToolInFlight
        | ErrorCode::LeaseLost
        | ErrorCode::UnknownToolOutcome
        | ErrorCode::TurnCancelled => StatusCode::CONFLICT,
        ErrorCode::PayloadMismatch | ErrorCode::AttemptsExhausted => {
            StatusCode::UNPROCESSABLE_ENTITY
        }
        ErrorCode::UserAtCapacity | ErrorCode::QueueFull => StatusCode::TOO_MANY_REQUESTS,
        // effect_failed needs a caller-supplied SQL effect, which only library
        // callers can pass; over HTTP it would be a server bug, hence 500.
        ErrorCode::EffectFailed | ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        ErrorCode::StoreUnavailable | ErrorCode::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The body of every error response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// What went wrong, with what a caller needs to act on it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// The stable code to match on.
    pub code: ErrorCode,
    /// For a person; do not match on it.
    pub message: String,
    /// For `session_busy`, `request_in_flight`, `awaiting_confirmation`,
    /// `tool_in_flight`, `user_at_capacity` and `queue_full`: how long until the blocking
    /// lease (or confirmation) runs out if not renewed, from the store's clock.
    /// On every 503: when to try again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// For `session_busy` and `request_in_flight`: the turn holding the
    /// session; for `awaiting_confirmation`: the turn awaiting it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_turn_id: Option<String>,
    /// For `tool_in_flight`: the execution running under the caller's own
    /// lease. A holder that sent the claim again after losing its answer
    /// finds here the execution its lost claim started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub execution_id: Option<String>,
    /// For `tool_in_flight`: that execution's running attempt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
}

/// An error on its way to becoming a response.
#[derive(Debug)]
pub struct ApiError {
    code: ErrorCode,
    message: String,
    retry_after: Option<Duration>,
    active_turn_id: Option<String>,
    running: Option<(String, u32)>,
}

impl ApiError {
    /// An error with a code and a message for a person.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_ERROR_MESSAGE_BYTES {
            let mut cut = MAX_ERROR_MESSAGE_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
        Self {
            code,
            message,
            retry_after: None,
            active_turn_id: None,
            running: None,
        }
    }

    /// A 400 `invalid_request`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    /// This error's code.
    pub fn code(&self) -> ErrorCode {
        self.code
    }

    /// The message for a person (bounded).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// This error's HTTP status.
    pub fn status(&self) -> StatusCode {
        status_of(self.code)
    }

    /// This error, telling the caller to retry after `retry_after`.
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = Some(retry_after);
        self
    }
}

impl From<Error> for ApiError {
    fn from(error: Error) -> Self {
        let code = ErrorCode::of_kind(error.kind());
        let message = if status_of(code).is_server_error() {
            // Driver and side-effect details stay in the server's log.
            tracing::error!(code = code.as_str(), %error, "request failed");
            match code {
                ErrorCode::StoreUnavailable => "the store is unavailable; retry later".to_owned(),
                _ => "internal error".to_owned(),
            }
        } else {
            error.to_string()
        };
        Self {
            retry_after: error.retry_after(),
            active_turn_id: error.active_turn_id().map(str::to_owned),
            running: error
                .running_execution()
                .map(|(execution_id, attempt)| (execution_id.to_owned(), attempt)),
            ..Self::new(code, message)
        }
    }
}

/// Whole seconds for a `Retry-After` header: rounded up, at least 1, so a
/// client never retries before the lease can have run out, nor hot-loops.
pub(crate) fn retry_after_secs(retry_after: Duration) -> u64 {
    let millis = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
    millis.div_ceil(1000).max(1)
}

impl ApiError {
    /// The `Retry-After` this error is sent with: its own, or for any 503
    /// without one [`UNAVAILABLE_RETRY_AFTER`]. Every 503 says when to come
    /// back: a client that hot-loops on an outage makes it worse, one that
    /// gives up never recovers.
    fn effective_retry_after(&self) -> Option<Duration> {
        self.retry_after.or_else(|| {
            (status_of(self.code) == StatusCode::SERVICE_UNAVAILABLE)
                .then_some(UNAVAILABLE_RETRY_AFTER)
        })
    }

    /// The body's `error` member.
    pub fn detail(self) -> ErrorDetail {
        let retry_after_ms = self
            .effective_retry_after()
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
        ErrorDetail {
            code: self.code,
            message: self.message,
            retry_after_ms,
            active_turn_id: self.active_turn_id,
            execution_id: self.running.as_ref().map(|(id, _)| id.clone()),
            attempt: self.running.map(|(_, attempt)| attempt),
        }
    }
}

/// Sets the headers every error response of `code` carries: `Retry-After`
/// when there is one, `WWW-Authenticate` on a 401, and the code itself in
/// the extensions, from where the metrics layer counts errors.
pub(crate) fn decorate(response: &mut Response, code: ErrorCode, retry_after_ms: Option<u64>) {
    let headers = response.headers_mut();
    if let Some(millis) = retry_after_ms {
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(Duration::from_millis(millis))),
        );
    }
    if code == ErrorCode::Unauthorized {
        headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response.extensions_mut().insert(code);
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = status_of(self.code);
        let detail = self.detail();
        let (code, retry_after_ms) = (detail.code, detail.retry_after_ms);
        let mut response = (status, Json(ErrorBody { error: detail })).into_response();
        decorate(&mut response, code, retry_after_ms);
        response
    }
}

// ------------------------------------------------- OpenAPI response sets
//
// These enums are never constructed: they exist so each operation's
// `responses(...)` lists every status and error code it can answer with,
// generated by utoipa from the same `ErrorBody` the server sends.

/// The errors of `POST /v1/turns`.
#[derive(IntoResponses)]
#[allow(dead_code)] // documentation only, see above
pub(crate) enum BeginErrors {
    /// `invalid_request`: malformed JSON or not I-JSON, a missing, unknown or
    /// oversized field (ids are 1–128 characters, no control characters;
    /// payload at most 1 MiB canonical, 64 arrays and objects deep).
    #[response(status = 400)]
    InvalidRequest(ErrorBody),
    /// `unauthorized`: API keys are configured and the bearer key is missing
    /// or wrong.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `origin_not_allowed`, `host_not_allowed` (a page elsewhere, or a
    /// foreign `Host`), or `user_mismatch` (a trusted user header is
    /// configured and names another user).
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `not_found`: the session belongs to another user, or the confirmed
    /// turn awaits no live confirmation.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// `session_busy` (another turn holds the session; `active_turn_id` names
    /// it), `request_in_flight` (this request runs under a live lease) or
    /// `awaiting_confirmation` (the session waits for a person): retry after
    /// `Retry-After` seconds. `confirmation_expired` (no `Retry-After`): the
    /// confirmation names a turn whose pending confirmation expired, and
    /// nothing was confirmed.
    #[response(
        status = 409,
        headers(("Retry-After" = u64, description = "Seconds until the blocking lease or confirmation runs out, rounded up, at least 1"))
    )]
    Conflict(ErrorBody),
    /// `request_timeout`: the body did not arrive within 10 s.
    #[response(status = 408)]
    RequestTimeout(ErrorBody),
    /// `payload_too_large`: the body is over the server's limit (1 MiB by default).
    #[response(status = 413)]
    PayloadTooLarge(ErrorBody),
    /// `unsupported_media_type`: the body was not sent as
    /// `Content-Type: application/json`.
    #[response(status = 415)]
    UnsupportedMediaType(ErrorBody),
    /// `payload_mismatch`: this `client_request_id` was used with another payload.
    #[response(status = 422)]
    PayloadMismatch(ErrorBody),
    /// `user_at_capacity` (the user holds all of their permits) or
    /// `queue_full` (with `on_busy: enqueue` or `supersede`: the session's
    /// queue holds 100 waiting turns, or the user's queues 200 across their
    /// sessions; nothing was queued).
    #[response(
        status = 429,
        headers(("Retry-After" = u64, description = "Seconds until the user's soonest lease (or the session holder's) runs out, rounded up, at least 1"))
    )]
    UserAtCapacity(ErrorBody),
    /// `store_unavailable`: the store (or the Redis lease layer) is down
    /// or the request took longer than the server's timeout.
    #[response(
        status = 503,
        headers(("Retry-After" = u64, description = "Seconds before trying again, at least 1"))
    )]
    StoreUnavailable(ErrorBody),
}

/// The errors of the calls made under a lease (heartbeat, endings, tool
/// completion and failure).
#[derive(IntoResponses)]
#[allow(dead_code)] // documentation only, see above
pub(crate) enum LeaseErrors {
    /// `invalid_request`: missing or malformed `Lease-Token` header,
    /// malformed JSON, a missing, unknown or oversized field.
    #[response(status = 400)]
    InvalidRequest(ErrorBody),
    /// `unauthorized`: API keys are configured and the bearer key is missing
    /// or wrong.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `origin_not_allowed` or `host_not_allowed`: a browser sent this for
    /// a page that is neither this server nor an allowed origin, or under a
    /// `Host` this server does not answer to.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `not_found`: no such turn or tool execution.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// `lease_lost`: wrong token, taken over, expired, or the turn (or tool
    /// execution) already ended. Stop: this lease can change nothing.
    #[response(status = 409)]
    LeaseLost(ErrorBody),
    /// `request_timeout`: the body did not arrive within 10 s.
    #[response(status = 408)]
    RequestTimeout(ErrorBody),
    /// `payload_too_large`: the body is over the server's limit.
    #[response(status = 413)]
    PayloadTooLarge(ErrorBody),
    /// `unsupported_media_type`: the body was not sent as
    /// `Content-Type: application/json`.
    #[response(status = 415)]
    UnsupportedMediaType(ErrorBody),
    /// `store_unavailable`: the store (or the Redis lease layer) is down
    /// or the request took longer than the server's timeout.
    #[response(
        status = 503,
        headers(("Retry-After" = u64, description = "Seconds before trying again, at least 1"))
    )]
    StoreUnavailable(ErrorBody),
}

/// The errors of a heartbeat, which carries no body.
#[derive(IntoResponses)]
#[allow(dead_code)] // documentation only, see above
pub(crate) enum HeartbeatErrors {
    /// `invalid_request`: missing or malformed `Lease-Token` header.
    #[response(status = 400)]
    InvalidRequest(ErrorBody),
    /// `unauthorized`: API keys are configured and the bearer key is missing
    /// or wrong.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `origin_not_allowed` or `host_not_allowed`: a browser sent this for
    /// a page that is neither this server nor an allowed origin, or under a
    /// `Host` this server does not answer to.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `not_found`: no such turn.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// `lease_lost`: wrong token, taken over, expired, or the turn already
    /// ended. Stop: this lease can change nothing.
    #[response(status = 409)]
    LeaseLost(ErrorBody),
    /// `store_unavailable`: the store (or the Redis lease layer) is down
    /// or the request took longer than the server's timeout.
    #[response(
        status = 503,
        headers(("Retry-After" = u64, description = "Seconds before trying again, at least 1"))
    )]
    StoreUnavailable(ErrorBody),
}

/// The errors of a tool claim.
#[derive(IntoResponses)]
#[allow(dead_code)] // documentation only, see above
pub(crate) enum ClaimErrors {
    /// `invalid_request`: missing `Lease-Token` header, malformed JSON, a
    /// missing, unknown or oversized field, or the turn's tool execution
    /// limit reached.
    #[response(status = 400)]
    InvalidRequest(ErrorBody),
    /// `unauthorized`: API keys are configured and the bearer key is missing
    /// or wrong.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `origin_not_allowed` or `host_not_allowed`: a browser sent this for
    /// a page that is neither this server nor an allowed origin, or under a
    /// `Host` this server does not answer to.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `not_found`: no such turn.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// `tool_in_flight` (this tool call is running under the caller's own
    /// lease; retry after `Retry-After` seconds), `turn_cancelled` (the turn
    /// was asked to stop: end it with `end-cancelled`) or `lease_lost`
    /// (stop).
    #[response(
        status = 409,
        headers(("Retry-After" = u64, description = "tool_in_flight only: seconds until the turn's lease runs out, rounded up, at least 1"))
    )]
    Conflict(ErrorBody),
    /// `request_timeout`: the body did not arrive within 10 s.
    #[response(status = 408)]
    RequestTimeout(ErrorBody),
    /// `payload_too_large`: the body is over the server's limit.
    #[response(status = 413)]
    PayloadTooLarge(ErrorBody),
    /// `unsupported_media_type`: the body was not sent as
    /// `Content-Type: application/json`.
    #[response(status = 415)]
    UnsupportedMediaType(ErrorBody),
    /// `attempts_exhausted`: the tool execution used all its attempts.
    #[response(status = 422)]
    AttemptsExhausted(ErrorBody),
    /// `store_unavailable`: the store (or the Redis lease layer) is down
    /// or the request took longer than the server's timeout.
    #[response(
        status = 503,
        headers(("Retry-After" = u64, description = "Seconds before trying again, at least 1"))
    )]
    StoreUnavailable(ErrorBody),
}

/// The errors of an orphan claim.
#[derive(IntoResponses)]
#[allow(dead_code)] // documentation only, see above
pub(crate) enum OrphanErrors {
    /// `invalid_request`: malformed JSON, an unknown field, a malformed id,
    /// more than 100 users or turns, or an age over 30 days.
    #[response(status = 400)]
    InvalidRequest(ErrorBody),
    /// `unauthorized`: API keys are configured and the bearer key is missing
    /// or wrong.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `origin_not_allowed` or `host_not_allowed`: a browser sent this for
    /// a page that is neither this server nor an allowed origin, or under a
    /// `Host` this server does not answer to.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `request_timeout`: the body did not arrive within 10 s.
    #[response(status = 408)]
    RequestTimeout(ErrorBody),
    /// `payload_too_large`: the body is over the server's limit.
    #[response(status = 413)]
    PayloadTooLarge(ErrorBody),
    /// `unsupported_media_type`: the body was not sent as
    /// `Content-Type: application/json`.
    #[response(status = 415)]
    UnsupportedMediaType(ErrorBody),
    /// `store_unavailable`: the store could not be reached or the request
    /// took longer than the server's timeout.
    #[response(
        status = 503,
        headers(("Retry-After" = u64, description = "Seconds before trying again, at least 1"))
    )]
    StoreUnavailable(ErrorBody),
}

/// The errors of an event append.
#[derive(IntoResponses)]
#[allow(dead_code)] // documentation only, see above
pub(crate) enum EventErrors {
    /// `invalid_request`: missing `Lease-Token` header, malformed JSON, a
    /// bad event name, data that is not I-JSON or over 64 KiB, more than
    /// 500 events, or a turn whose log is full (20,000 events, 16 MiB).
    #[response(status = 400)]
    InvalidRequest(ErrorBody),
    /// `unauthorized`: API keys are configured and the bearer key is missing
    /// or wrong.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `origin_not_allowed` or `host_not_allowed`: a browser sent this for
    /// a page that is neither this server nor an allowed origin, or under a
    /// `Host` this server does not answer to.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `not_found`: no such turn.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// `lease_lost`: wrong token, taken over, expired, or the turn already
    /// ended. None of the events will ever be seen.
    #[response(status = 409)]
    LeaseLost(ErrorBody),
    /// `request_timeout`: the body did not arrive within 10 s.
    #[response(status = 408)]
    RequestTimeout(ErrorBody),
    /// `payload_too_large`: the body is over the server's limit.
    #[response(status = 413)]
    PayloadTooLarge(ErrorBody),
    /// `unsupported_media_type`: the body was not sent as
    /// `Content-Type: application/json`.
    #[response(status = 415)]
    UnsupportedMediaType(ErrorBody),
    /// `store_unavailable`: the store (or the Redis lease layer) is down
    /// or the request took longer than the server's timeout.
    #[response(
        status = 503,
        headers(("Retry-After" = u64, description = "Seconds before trying again, at least 1"))
    )]
    StoreUnavailable(ErrorBody),
}

/// The errors of setting a session's default policy.
#[derive(IntoResponses)]
#[allow(dead_code)] // documentation only, see above
pub(crate) enum PolicyErrors {
    /// `invalid_request`: malformed JSON, an unknown field, a malformed
    /// id, a `wait_ms` beside a policy that does not wait, or
    /// `interrupt_running` beside one other than `supersede`.
    #[response(status = 400)]
    InvalidRequest(ErrorBody),
    /// `unauthorized`: API keys are configured and the bearer key is missing
    /// or wrong.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `origin_not_allowed`, `host_not_allowed` (a page elsewhere, or a
    /// foreign `Host`), or `user_mismatch` (a trusted user header is
    /// configured and names another user).
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `not_found`: the session is bound to another user.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// `request_timeout`: the body did not arrive within 10 s.
    #[response(status = 408)]
    RequestTimeout(ErrorBody),
    /// `payload_too_large`: the body is over the server's limit.
    #[response(status = 413)]
    PayloadTooLarge(ErrorBody),
    /// `unsupported_media_type`: the body was not sent as
    /// `Content-Type: application/json`.
    #[response(status = 415)]
    UnsupportedMediaType(ErrorBody),
    /// `store_unavailable`: the store (or the Redis lease layer) is down
    /// or the request took longer than the server's timeout.
    #[response(
        status = 503,
        headers(("Retry-After" = u64, description = "Seconds before trying again, at least 1"))
    )]
    StoreUnavailable(ErrorBody),
}

/// The errors of the read endpoints.
#[derive(IntoResponses)]
#[allow(dead_code)] // documentation only, see above
pub(crate) enum ReadErrors {
    /// `invalid_request`: an id (path or `user_id` query) that is empty,
    /// over 128 characters or holds a control character.
    #[response(status = 400)]
    InvalidRequest(ErrorBody),
    /// `unauthorized`: API keys are configured and the bearer key is missing
    /// or wrong.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// `origin_not_allowed`, `host_not_allowed` (a page elsewhere, or a
    /// foreign `Host`), or `user_mismatch` (a trusted user header is
    /// configured and names another user).
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// `not_found`: no such record, or it belongs to a user other than the
    /// `user_id` query parameter.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// `store_unavailable`: the store (or the Redis lease layer) is down
    /// or the request took longer than the server's timeout.
    #[response(
        status = 503,
        headers(("Retry-After" = u64, description = "Seconds before trying again, at least 1"))
    )]
    StoreUnavailable(ErrorBody),
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn spec_statuses() {
        let expect = [
            (ErrorKind::InvalidRequest, 400),
            (ErrorKind::NotFound, 404),
            (ErrorKind::SessionBusy, 409),
            (ErrorKind::RequestInFlight, 409),
            (ErrorKind::AwaitingConfirmation, 409),
            (ErrorKind::ConfirmationExpired, 409),
            (ErrorKind::ToolInFlight, 409),
            (ErrorKind::LeaseLost, 409),
            (ErrorKind::TurnCancelled, 409),
            (ErrorKind::PayloadMismatch, 422),
            (ErrorKind::UserAtCapacity, 429),
            (ErrorKind::QueueFull, 429),
            (ErrorKind::StoreUnavailable, 503),
            (ErrorKind::UnknownToolOutcome, 409),
            (ErrorKind::AttemptsExhausted, 422),
            (ErrorKind::Effect, 500),
        ];
        for (kind, status) in expect {
            let code = ErrorCode::of_kind(kind);
            assert_eq!(code.as_str(), kind.code(), "wire code of {kind:?}");
            assert_eq!(status_of(code).as_u16(), status, "status of {kind:?}");
        }
        assert_eq!(status_of(ErrorCode::Unauthorized).as_u16(), 401);
        assert_eq!(status_of(ErrorCode::PayloadTooLarge).as_u16(), 413);
    }

    #[test]
    fn wire_spelling_matches_serde() {
        for code in [ErrorCode::InvalidRequest, ErrorCode::UserAtCapacity] {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, code.as_str());
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one_second() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }

    #[test]
    fn conflicts_carry_headers_and_fields() {
        let error = Error::SessionBusy {
            active_turn_id: "turn_a".into(),
            retry_after: Duration::from_millis(1200),
        };
        let response = ApiError::from(error).into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        assert_eq!(
            response.extensions().get::<ErrorCode>(),
            Some(&ErrorCode::SessionBusy)
        );
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        let error = ApiError::invalid("中".repeat(MAX_ERROR_MESSAGE_BYTES));
        assert!(error.message.len() <= MAX_ERROR_MESSAGE_BYTES + '…'.len_utf8());
        assert!(error.message.ends_with('…'));
    }
}
