//! Tool calls: claim an execution, then complete or fail it.

use agentgate::canonical::CanonicalJson;
use agentgate::model::{ToolCall, ToolClaim};
use agentgate::store::Completion;
use agentgate::{ExecutionId, PreviousOutcome, ToolName};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::dto::{
    ClaimToolRequest, CompleteToolRequest, ExecuteDto, ExecuteResponse, ExecutionResultDto,
    ExecutionResultResponse, FailToolRequest, ToolStateDto,
};
use crate::error::{ApiError, ClaimErrors, LeaseErrors};
use crate::extract::{ApiJson, ApiPath, LeaseHeader};
use crate::AppState;

/// Claim a tool execution before running a side-effecting tool.
///
/// The execution is keyed by turn, tool and the SHA-256 of the args' RFC 8785
/// canonical form. 201 `execute: true`: run the tool, then complete or fail
/// the execution; `previous_outcome: "unknown"` means an earlier holder died
/// mid-call and the effect may have happened — check downstream with the
/// `idempotency_key` first. 200 `execute: false`: it already succeeded; use
/// the stored `result` and do not run the tool.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/tools",
    tag = "tools",
    request_body = ClaimToolRequest,
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 201, description = "Claimed: run the tool", body = ExecuteResponse),
        (status = 200, description = "Already succeeded: the stored result; do not run the tool", body = ExecutionResultResponse),
        ClaimErrors,
    )
)]
pub(crate) async fn claim(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    lease: LeaseHeader,
    ApiJson(request): ApiJson<ClaimToolRequest>,
) -> Result<Response, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let call = ToolCall::new(ToolName::new(request.tool)?, &request.args)?;
    let claim = state.gate().store().claim_tool(&lease, &call).await?;
    Ok(match claim {
        ToolClaim::Execute {
            execution_id,
            idempotency_key,
            attempt,
            previous_outcome,
        } => {
            let unknown = previous_outcome == Some(PreviousOutcome::Unknown);
            state.metrics().tool_claim(true, unknown);
            if unknown {
                tracing::warn!(turn_id = %lease.turn_id, %execution_id, tool = %call.tool, attempt, "tool handed out again with an unknown previous outcome");
            } else {
                tracing::debug!(turn_id = %lease.turn_id, %execution_id, tool = %call.tool, attempt, "tool claimed");
            }
            let body = ExecuteResponse {
                execute: true,
                execution: ExecuteDto {
                    execution_id: execution_id.to_string(),
                    idempotency_key,
                    attempt,
                    previous_outcome: previous_outcome.map(Into::into),
                },
            };
            (StatusCode::CREATED, Json(body)).into_response()
        }
        ToolClaim::Cached {
            execution_id,
            result,
        } => {
            state.metrics().tool_claim(false, false);
            let body = ExecutionResultResponse {
                execute: Some(false),
                execution: ExecutionResultDto {
                    execution_id: execution_id.to_string(),
                    state: ToolStateDto::Succeeded,
                    result: Some(result),
                },
            };
            (StatusCode::OK, Json(body)).into_response()
        }
    })
}

/// Mark a claimed execution succeeded with its result.
///
/// Later claims of the same call get this result instead of running the tool.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/tools/{execution_id}/complete",
    tag = "tools",
    request_body = CompleteToolRequest,
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn"),
        ("execution_id" = crate::schema::Id, Path, description = "The execution, as returned by the claim"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Recorded: the stored result", body = ExecutionResultResponse),
        LeaseErrors,
    )
)]
pub(crate) async fn complete(
    State(state): State<AppState>,
    ApiPath((turn_id, execution_id)): ApiPath<(String, String)>,
    lease: LeaseHeader,
    ApiJson(request): ApiJson<CompleteToolRequest>,
) -> Result<Json<ExecutionResultResponse>, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let execution_id = ExecutionId::new(execution_id)?;
    let result = CanonicalJson::new("result", &request.result)?;
    let stored = state
        .gate()
        .store()
        .complete_tool(&lease, &execution_id, Completion::Result(result))
        .await?;
    tracing::debug!(turn_id = %lease.turn_id, %execution_id, "tool succeeded");
    Ok(Json(ExecutionResultResponse {
        execute: None,
        execution: ExecutionResultDto {
            execution_id: execution_id.to_string(),
            state: ToolStateDto::Succeeded,
            result: Some(stored),
        },
    }))
}

/// Mark a claimed execution failed; the next claim of the same call runs it
/// again with `previous_outcome: "failed"`.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/tools/{execution_id}/fail",
    tag = "tools",
    request_body = FailToolRequest,
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn"),
        ("execution_id" = crate::schema::Id, Path, description = "The execution, as returned by the claim"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Recorded", body = ExecutionResultResponse),
        LeaseErrors,
    )
)]
pub(crate) async fn fail(
    State(state): State<AppState>,
    ApiPath((turn_id, execution_id)): ApiPath<(String, String)>,
    lease: LeaseHeader,
    ApiJson(request): ApiJson<FailToolRequest>,
) -> Result<Json<ExecutionResultResponse>, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let execution_id = ExecutionId::new(execution_id)?;
    let error = CanonicalJson::new("error", &request.error)?;
    state
        .gate()
        .store()
        .fail_tool(&lease, &execution_id, &error)
        .await?;
    tracing::debug!(turn_id = %lease.turn_id, %execution_id, "tool failed");
    Ok(Json(ExecutionResultResponse {
        execute: None,
        execution: ExecutionResultDto {
            execution_id: execution_id.to_string(),
            state: ToolStateDto::Failed,
            result: None,
        },
    }))
}
