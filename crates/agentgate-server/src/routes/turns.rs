//! Turn calls: begin (and confirmation), heartbeat, the endings, and the
//! cancel request.

use agentgate::canonical::CanonicalJson;
use agentgate::model::{BeginCommand, BeginOutcome, Ending, LeaseRef};
use agentgate::{ClientRequestId, SessionId, UserId};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::dto::{
    AwaitConfirmationRequest, BeginRequest, BeginResponse, CompleteTurnRequest,
    EndCancelledRequest, FailTurnRequest, GrantDto, HeartbeatResponse, NextTurnDto, OwnerQuery,
    QueuedDto, QueuedResponse, ReplayResponse, TurnDto, TurnResponse,
};
use crate::error::{ApiError, BeginErrors, ErrorCode, HeartbeatErrors, LeaseErrors, ReadErrors};
use crate::extract::{ApiJson, ApiPath, ApiQuery, LeaseHeader};
use crate::guard::CallerUser;
use crate::metrics::{busy_outcome, BeginLabel};
use crate::AppState;

fn command(request: &BeginRequest) -> Result<BeginCommand, ApiError> {
    let confirmation = request
        .confirmation
        .as_ref()
        .map(|c| c.to_engine())
        .transpose()?;
    Ok(BeginCommand::new(
        UserId::new(request.user_id.clone())?,
        SessionId::new(request.session_id.clone())?,
        ClientRequestId::new(request.client_request_id.clone())?,
        &request.payload,
        confirmation,
    )?)
}

/// Begin a turn, or answer a pending confirmation.
///
/// One atomic step in the store (docs/protocol.md §3.1): a new request takes the session
/// lease and one of the user's permits together and answers 201 with the
/// lease token; a repeat of a finished request replays its stored outcome
/// (200); a repeat of a running one whose lease expired takes it over (201,
/// `takeover: true`, higher fence). With `confirmation`, the new turn is the
/// continuation of the pending one and carries its `pending` and the decision.
#[utoipa::path(
    post,
    path = "/v1/turns",
    tag = "turns",
    request_body = BeginRequest,
    security((), ("bearer" = [])),
    responses(
        (status = 201, description = "Lease granted: run the turn, heartbeat, end it", body = BeginResponse),
        (status = 200, description = "The request already ended: its stored outcome; no lease taken", body = ReplayResponse),
        (status = 202, description = "With `on_busy: enqueue` or `supersede` (or a repeat of a queued request): the request waits in the session's queue; no lease taken", body = QueuedResponse,
            headers(("Retry-After" = u64, description = "Seconds until the session's holder's lease runs out, rounded up, at least 1"))),
        BeginErrors,
    )
)]
pub(crate) async fn begin(
    State(state): State<AppState>,
    caller: CallerUser,
    ApiJson(request): ApiJson<BeginRequest>,
) -> Result<Response, ApiError> {
    caller.check(&request.user_id)?;
    let on_busy = request.on_busy()?;
    let outcome = match command(&request) {
        Ok(command) => {
            let gate = state.gate();
            let begun = match on_busy {
                Some(on_busy) => gate.begin_outcome_on_busy(&command, on_busy).await,
                None => gate.begin_outcome_by_session(&command).await,
            };
            begun
                .map(|(outcome, report)| {
                    if report.attempts > 1 {
                        tracing::debug!(
                            attempts = report.attempts,
                            woken = report.woken,
                            waited_ms = report.waited.as_millis() as u64,
                            session_default = report.session_default.is_some(),
                            "begin under its busy policy"
                        );
                    }
                    let queued = matches!(outcome, BeginOutcome::Queued(_));
                    let policy = on_busy
                        .or(report.session_default)
                        .unwrap_or_default()
                        .policy;
                    (outcome, policy, busy_outcome(queued, &report))
                })
                .map_err(ApiError::from)
        }
        Err(error) => Err(error),
    };
    let metrics = state.metrics();
    // A refusal's policy: the one named, else `reject` (a default that
    // applied and still refused is counted under `reject` too).
    let named = on_busy.unwrap_or_default().policy;
    match &outcome {
        Ok((_, policy, label)) => metrics.busy_begin(*policy, label),
        Err(error) if error.code() == ErrorCode::SessionBusy => {
            metrics.busy_begin(named, "timed_out");
        }
        Err(_) => metrics.busy_begin(named, "refused"),
    }
    let outcome = outcome.map(|(outcome, _, _)| outcome);
    match outcome {
        Ok(BeginOutcome::Started(grant)) => {
            metrics.begin(match (grant.takeover, grant.attempt) {
                (true, _) => BeginLabel::Takeover,
                (false, 1) => BeginLabel::Started,
                (false, _) => BeginLabel::Restart,
            });
            tracing::info!(
                turn_id = %grant.turn_id,
                session_id = %grant.session_id,
                fence = %grant.fence,
                attempt = grant.attempt,
                takeover = grant.takeover,
                "turn started"
            );
            let body = BeginResponse {
                turn: GrantDto::from(grant),
            };
            Ok((StatusCode::CREATED, Json(body)).into_response())
        }
        Ok(BeginOutcome::Queued(queued)) => {
            metrics.begin(BeginLabel::Queued);
            tracing::info!(
                turn_id = %queued.turn_id,
                session_id = %queued.session_id,
                position = queued.position,
                "turn queued"
            );
            let retry_after = crate::error::retry_after_secs(queued.retry_after);
            let body = QueuedResponse {
                queued: true,
                turn: QueuedDto::from(queued),
            };
            let headers = [(axum::http::header::RETRY_AFTER, retry_after.to_string())];
            Ok((StatusCode::ACCEPTED, headers, Json(body)).into_response())
        }
        Ok(BeginOutcome::Replay(view)) => {
            metrics.begin(BeginLabel::Replay);
            tracing::info!(turn_id = %view.turn_id, fence = %view.fence, state = view.state.as_str(), "turn replayed");
            let body = ReplayResponse {
                replay: true,
                turn: TurnDto::from(view),
            };
            Ok((StatusCode::OK, Json(body)).into_response())
        }
        Err(error) => {
            metrics.begin(BeginLabel::Refused(error.code()));
            tracing::debug!(
                session_id = %request.session_id,
                code = error.code().as_str(),
                "begin refused"
            );
            Err(error)
        }
    }
}

/// Renew the turn's lease (session lease and permit together).
///
/// Call every third of the lease TTL. A 409 `lease_lost` means the turn was
/// taken over, expired or ended: stop working on it.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/heartbeat",
    tag = "turns",
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn, as returned by begin"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Renewed", body = HeartbeatResponse),
        HeartbeatErrors,
    )
)]
pub(crate) async fn heartbeat(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    lease: LeaseHeader,
) -> Result<Json<HeartbeatResponse>, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let status = state.gate().store().heartbeat(&lease).await?;
    tracing::debug!(turn_id = %lease.turn_id, "heartbeat");
    Ok(Json(HeartbeatResponse {
        lease_expires_in_ms: status.lease_expires_in_ms,
        cancel_requested: status.cancel_requested,
    }))
}

/// Ends the turn; with `take_next`, then starts the head of its session's
/// queue for the same caller (the handoff, `take_next_timed`): a new
/// request never jumps a waiting queue, so only the head's own start can
/// come between the two.
async fn end(
    state: &AppState,
    lease: &LeaseRef,
    ending: Ending,
    take_next: bool,
) -> Result<Json<TurnResponse>, ApiError> {
    let store = state.gate().store();
    let view = store.end_turn(lease, &ending).await?;
    state.metrics().turn_ended(view.state.as_str());
    tracing::info!(turn_id = %view.turn_id, fence = %view.fence, state = view.state.as_str(), "turn ended");
    // The ending is committed: a failed handoff must not hide it. The head
    // stays queued, for a later handoff or a recovery worker's claim.
    let taken = match take_next {
        false => None,
        true => agentgate_core::store::take_next_timed(store.as_ref(), &view.session_id, || ())
            .await
            .unwrap_or_else(|error| {
                tracing::warn!(%error, session_id = %view.session_id, "handoff failed after the ending");
                None
            }),
    };
    let next = taken.map(|(claimed, ())| {
        state.metrics().begin(BeginLabel::Handoff);
        tracing::info!(
            turn_id = %claimed.grant.turn_id,
            fence = %claimed.grant.fence,
            "queued turn handed off"
        );
        NextTurnDto {
            turn: GrantDto::from(claimed.grant),
            payload: claimed.payload,
        }
    });
    Ok(Json(TurnResponse {
        turn: TurnDto::from(view),
        next,
    }))
}

/// End the turn with its response, releasing the session and the permit.
///
/// Repeats of the turn's request replay this response.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/complete",
    tag = "turns",
    request_body = CompleteTurnRequest,
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Ended: the turn, `state: succeeded`", body = TurnResponse),
        LeaseErrors,
    )
)]
pub(crate) async fn complete(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    lease: LeaseHeader,
    ApiJson(request): ApiJson<CompleteTurnRequest>,
) -> Result<Json<TurnResponse>, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let response = CanonicalJson::new("response", &request.response)?;
    end(
        &state,
        &lease,
        Ending::Succeed { response },
        request.take_next,
    )
    .await
}

/// End the turn with an error, releasing the session and the permit.
///
/// With `retryable: true` a repeat of the request restarts the turn;
/// otherwise repeats replay this failure.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/fail",
    tag = "turns",
    request_body = FailTurnRequest,
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Ended: the turn, `state: failed`", body = TurnResponse),
        LeaseErrors,
    )
)]
pub(crate) async fn fail(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    lease: LeaseHeader,
    ApiJson(request): ApiJson<FailTurnRequest>,
) -> Result<Json<TurnResponse>, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let error = CanonicalJson::new("error", &request.error)?;
    let ending = Ending::Fail {
        error,
        retryable: request.retryable,
    };
    end(&state, &lease, ending, request.take_next).await
}

/// End the turn waiting for a person to approve `pending`, releasing the
/// lease and the permit.
///
/// Until the confirmation arrives (a begin with `confirmation`) or expires,
/// the session answers new messages with 409 `awaiting_confirmation`.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/await-confirmation",
    tag = "turns",
    request_body = AwaitConfirmationRequest,
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Ended: the turn, `state: awaiting_confirmation`", body = TurnResponse),
        LeaseErrors,
    )
)]
pub(crate) async fn await_confirmation(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    lease: LeaseHeader,
    ApiJson(request): ApiJson<AwaitConfirmationRequest>,
) -> Result<Json<TurnResponse>, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let pending = CanonicalJson::new("pending", &request.pending)?;
    // The queue waits behind a pending confirmation: nothing to take.
    end(&state, &lease, Ending::AwaitConfirmation { pending }, false).await
}

/// Ask a running turn to stop. Needs no lease token; idempotent.
///
/// Cooperative: the request is recorded on the turn, and its holder learns
/// it on its next heartbeat (`cancel_requested: true`, at most a third of
/// the lease TTL away) and tool claim (409 `turn_cancelled`); it then ends
/// the turn `cancelled` with what it had produced
/// (`POST /v1/turns/{turn_id}/end-cancelled`). A turn that already ended is
/// left as it is: the answer shows its state.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/cancel",
    tag = "turns",
    params(("turn_id" = crate::schema::Id, Path, description = "The turn"), OwnerQuery),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "The turn after the request: `cancel_requested_at_ms` set while it runs", body = TurnResponse),
        ReadErrors,
    )
)]
pub(crate) async fn cancel(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<TurnResponse>, ApiError> {
    let query = super::views::owner_filter(query, &caller)?;
    let turn_id = agentgate::TurnId::new(turn_id)?;
    let store = state.gate().store();
    // With an owner filter, the owner is checked before anything is written
    // (a turn of another user is not found); without one, the request's own
    // read says whether the turn exists.
    if query.user_id.is_some() {
        super::views::owned_turn(store.as_ref(), &turn_id, &query).await?;
    }
    let view = store
        .request_cancel(&turn_id)
        .await?
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "turn not found"))?;
    tracing::info!(turn_id = %view.turn_id, state = view.state.as_str(), "cancel requested");
    state.metrics().cancel_requested();
    Ok(Json(TurnResponse {
        turn: TurnDto::from(view),
        next: None,
    }))
}

/// End the turn `cancelled`, releasing the session and the permit.
///
/// The holder's answer to a cancel request (or its own decision to stop):
/// `partial` is stored as the turn's response, and repeats of the request
/// replay it rather than run it again. The tools that ran are in
/// `GET /v1/turns/{turn_id}`.
#[utoipa::path(
    post,
    path = "/v1/turns/{turn_id}/end-cancelled",
    tag = "turns",
    request_body = EndCancelledRequest,
    params(
        ("turn_id" = crate::schema::Id, Path, description = "The turn"),
        ("Lease-Token" = crate::schema::LeaseTokenText, Header, description = "The lease token returned by begin"),
    ),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Ended: the turn, `state: cancelled`", body = TurnResponse),
        LeaseErrors,
    )
)]
pub(crate) async fn end_cancelled(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    lease: LeaseHeader,
    ApiJson(request): ApiJson<EndCancelledRequest>,
) -> Result<Json<TurnResponse>, ApiError> {
    let lease = lease.for_turn(turn_id)?;
    let partial = CanonicalJson::new("partial", &request.partial)?;
    end(
        &state,
        &lease,
        Ending::Cancel { partial },
        request.take_next,
    )
    .await
}
