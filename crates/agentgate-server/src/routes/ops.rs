//! Operations endpoints (`/healthz`, `/readyz`, `/metrics`, `/openapi.json`, open even
//! when API keys are configured) and the JSON answers for unknown routes and
//! wrong methods.

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::dto::HealthResponse;
use crate::error::{decorate, status_of, ApiError, ErrorCode};
use crate::AppState;

/// A health report as a response: 200, or 503 with the error's
/// `Retry-After` when a dependency is down.
fn health_response(report: HealthResponse) -> Response {
    let error = report.error.as_ref().map(|e| (e.code, e.retry_after_ms));
    let status = error.map_or(StatusCode::OK, |(code, _)| status_of(code));
    let mut response = (status, Json(report)).into_response();
    if let Some((code, retry_after_ms)) = error {
        decorate(&mut response, code, retry_after_ms);
    }
    response
}

/// Liveness and each dependency's state, probed now: one read from the
/// store and, when configured, one from the Redis lease layer, each bounded
/// by the probe timeout (1 s).
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "ops",
    responses(
        (status = 200, description = "Serving, and every dependency answers", body = HealthResponse),
        (status = 503, description = "A dependency (`store` or `redis`) does not answer: `status: unavailable`, \
            each dependency's state, and `error.code: store_unavailable`",
            body = HealthResponse,
            headers(("Retry-After" = u64, description = "Seconds until the next probe, at least 1"))),
    )
)]
pub(crate) async fn healthz(State(state): State<AppState>) -> Response {
    health_response(state.health().check_now().await)
}

/// Readiness for a load balancer: whether this server can serve requests
/// now, from the background probe's last view (no store I/O per call). 503
/// exactly when `/v1` calls are being refused with `store_unavailable`.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "ops",
    responses(
        (status = 200, description = "Ready: every dependency answered the last probe", body = HealthResponse),
        (status = 503, description = "Not ready: a dependency is down; `/v1` calls are refused until it is back",
            body = HealthResponse,
            headers(("Retry-After" = u64, description = "Seconds until the next probe, at least 1"))),
    )
)]
pub(crate) async fn readyz(State(state): State<AppState>) -> Response {
    health_response(state.health().last_seen())
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
    // One bounded store read; metrics still render when the store is down
    // (the gauge then keeps its last value).
    let gate = state.gate();
    let listed = gate
        .store()
        .orphans(
            &agentgate::OrphanFilter::default(),
            agentgate::limits::MAX_ORPHAN_SCAN,
        )
        .await;
    if let Ok(orphans) = listed {
        state
            .metrics()
            .set_orphans(orphans.len(), gate.abandoned_total(), gate.released_total());
    }
    state.metrics().set_waiting_begins(gate.waiting_begins());
    state.metrics().set_store_steps(
        gate.steps_in_flight(),
        agentgate::gate::dropped_transactions(),
    );
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
