//! Operations endpoints (`/healthz`, `/metrics`, `/openapi.json`, open even
//! when API keys are configured) and the JSON answers for unknown routes and
//! wrong methods.

use agentgate::SessionId;
use axum::extract::State;
use axum::http::{header, Uri};
use axum::response::IntoResponse;
use axum::Json;

use crate::dto::HealthResponse;
use crate::error::{ApiError, ErrorBody, ErrorCode};
use crate::AppState;

/// The session id the health check reads. The read neither creates nor
/// changes a session, so any valid id serves.
const HEALTH_PROBE_SESSION: &str = "agentgate-healthz";

/// Liveness and store reachability: one read from the store.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "ops",
    responses(
        (status = 200, description = "Serving, and the store answers", body = HealthResponse),
        (status = 503, description = "`store_unavailable`: the store does not answer", body = ErrorBody),
    )
)]
pub(crate) async fn healthz(
    State(state): State<AppState>,
) -> Result<Json<HealthResponse>, ApiError> {
    let probe = SessionId::new(HEALTH_PROBE_SESSION)?;
    state.gate().store().session(&probe).await?;
    Ok(Json(HealthResponse {
        status: "ok".to_owned(),
    }))
}

/// Prometheus metrics, text exposition format; every name starts `agentgate_`.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "ops",
    responses(
        (status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
    )
)]
pub(crate) async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        state.metrics().render(),
    )
}

/// This document: OpenAPI 3.1, generated from the handlers and their types.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "ops",
    responses(
        (status = 200, description = "The OpenAPI 3.1 document", body = Object, content_type = "application/json"),
    )
)]
pub(crate) async fn openapi(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        state.openapi_json(),
    )
}

/// Any path no route matches.
pub(crate) async fn no_route(uri: Uri) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("no route for {}", uri.path()))
}

/// A route that exists, called with a method it does not take.
pub(crate) async fn wrong_method(uri: Uri) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!(
            "{} does not take this method; see /openapi.json",
            uri.path()
        ),
    )
}
