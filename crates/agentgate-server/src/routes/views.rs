//! Read-only state: a turn with its tool executions, a session, a user.
//! Never a lease token.
//!
//! With `?user_id=`, a record of another user answers 404 exactly like a
//! missing one, so a caller acting for one user cannot probe another's.
//! With a trusted user header configured, the header's user is that filter,
//! and a query or path naming another user is refused 403 `user_mismatch`.

use agentgate::page::{ExecutionCursor, ExecutionPage, ExecutionPageRequest};
use agentgate::{SessionId, TurnId, UserId};
use axum::extract::State;
use axum::Json;

use crate::dto::{
    ExecutionDto, ExecutionPageQuery, ExecutionPageResponse, OwnerQuery, ReleaseResponse,
    SessionDto, SessionPolicyRequest, SessionResponse, TurnDto, TurnStateResponse, UserDto,
    UserResponse,
};
use crate::error::{ApiError, ErrorCode, PolicyErrors, ReadErrors};
use crate::extract::{ApiJson, ApiPath, ApiQuery};
use crate::guard::CallerUser;
use crate::AppState;

/// Checks the optional owner filter; a mismatch is reported as `not_found`.
/// The owner filter in force: the query's, or with a trusted user header
/// the header's user (a query naming another user is then refused).
pub(crate) fn owner_filter(query: OwnerQuery, caller: &CallerUser) -> Result<OwnerQuery, ApiError> {
    let Some(bound) = caller.bound() else {
        return Ok(query);
    };
    if let Some(asked) = &query.user_id {
        caller.check(asked)?;
    }
    Ok(OwnerQuery {
        user_id: Some(bound.to_owned()),
    })
}

fn check_owner(query: &OwnerQuery, owner: &UserId, what: &str) -> Result<(), ApiError> {
    match &query.user_id {
        Some(asked) if asked != owner.as_str() => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("{what} not found"),
        )),
        _ => Ok(()),
    }
}

/// A turn's state and its tool executions.
#[utoipa::path(
    get,
    path = "/v1/turns/{turn_id}",
    tag = "views",
    params(("turn_id" = crate::schema::Id, Path, description = "The turn"), OwnerQuery),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "The turn", body = TurnStateResponse),
        ReadErrors,
    )
)]
pub(crate) async fn turn(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<TurnStateResponse>, ApiError> {
    let query = owner_filter(query, &caller)?;
    let turn_id = TurnId::new(turn_id)?;
    let store = state.gate().store();
    let view = owned_turn(store.as_ref(), &turn_id, &query).await?;
    let orphaned = match view.state {
        agentgate::TurnState::Running => store
            .session(&view.session_id)
            .await?
            .and_then(|session| session.holder)
            .is_none_or(|holder| holder.turn_id != view.turn_id),
        _ => false,
    };
    // Awaiting still, but no longer its session's live pending
    // confirmation: the TTL ran out, and an approval is refused
    // `confirmation_expired`.
    let confirmation_expired = match view.state {
        agentgate::TurnState::AwaitingConfirmation => store
            .session(&view.session_id)
            .await?
            .and_then(|session| session.pending_confirmation)
            .is_none_or(|pending| pending.turn_id != view.turn_id),
        _ => false,
    };
    let page = store
        .executions(&turn_id, &ExecutionPageRequest::default())
        .await?;
    let (executions, executions_next) = page_parts(page);
    Ok(Json(TurnStateResponse {
        orphaned,
        confirmation_expired,
        turn: TurnDto::from(view),
        executions,
        executions_next,
    }))
}

/// A further page of a turn's tool executions, oldest first, after the
/// `executions_next` cursor of the turn or of the previous page.
#[utoipa::path(
    get,
    path = "/v1/turns/{turn_id}/executions",
    tag = "views",
    params(("turn_id" = crate::schema::Id, Path, description = "The turn"), ExecutionPageQuery),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "A page of the turn's executions", body = ExecutionPageResponse),
        ReadErrors,
    )
)]
pub(crate) async fn turn_executions(
    State(state): State<AppState>,
    ApiPath(turn_id): ApiPath<String>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<ExecutionPageQuery>,
) -> Result<Json<ExecutionPageResponse>, ApiError> {
    let owner = owner_filter(
        OwnerQuery {
            user_id: query.user_id,
        },
        &caller,
    )?;
    let turn_id = TurnId::new(turn_id)?;
    let after = query
        .after
        .as_deref()
        .map(ExecutionCursor::parse)
        .transpose()?;
    let request = ExecutionPageRequest::new(after, query.limit)?;
    let store = state.gate().store();
    owned_turn(store.as_ref(), &turn_id, &owner).await?;
    let page = store.executions(&turn_id, &request).await?;
    let (executions, executions_next) = page_parts(page);
    Ok(Json(ExecutionPageResponse {
        executions,
        executions_next,
    }))
}

/// The turn, if it exists and the owner filter admits it; else `not_found`.
pub(crate) async fn owned_turn(
    store: &dyn agentgate::store::Store,
    turn_id: &TurnId,
    owner: &OwnerQuery,
) -> Result<agentgate::TurnView, ApiError> {
    let view = store
        .turn(turn_id)
        .await?
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "turn not found"))?;
    check_owner(owner, &view.user_id, "turn")?;
    Ok(view)
}

/// A page as the wire carries it: the executions and the next cursor.
fn page_parts(page: ExecutionPage) -> (Vec<ExecutionDto>, Option<String>) {
    let executions = page
        .executions
        .into_iter()
        .map(ExecutionDto::from)
        .collect();
    (executions, page.next.map(|cursor| cursor.to_string()))
}

/// A session: its user, live holder, pending confirmation and latest fence.
#[utoipa::path(
    get,
    path = "/v1/sessions/{session_id}",
    tag = "views",
    params(("session_id" = crate::schema::Id, Path, description = "The session"), OwnerQuery),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "The session", body = SessionResponse),
        ReadErrors,
    )
)]
pub(crate) async fn session(
    State(state): State<AppState>,
    ApiPath(session_id): ApiPath<String>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<SessionResponse>, ApiError> {
    let query = owner_filter(query, &caller)?;
    let session_id = SessionId::new(session_id)?;
    let view = state
        .gate()
        .store()
        .session(&session_id)
        .await?
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "session not found"))?;
    check_owner(&query, &view.user_id, "session")?;
    Ok(Json(SessionResponse {
        session: SessionDto::from(view),
    }))
}

/// Force-release a session (an operator's call, for a conversation stuck
/// behind a holder that does not answer its cancel request).
///
/// In one atomic step the turn the session names as holder, live or
/// expired, ends `abandoned` (error code `released`), the session and the
/// permit are freed, and the session's fence is bumped, so every later
/// write of the old holder is refused with 409 `lease_lost`; with a Redis
/// lease layer its lease is then revoked there. A repeat of the released
/// turn's request restarts it. `released` is `null` when the session had no
/// holder: nothing was written.
#[utoipa::path(
    post,
    path = "/v1/sessions/{session_id}/release",
    tag = "views",
    params(("session_id" = crate::schema::Id, Path, description = "The session"), OwnerQuery),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "The released turn (`state: abandoned`), or `null`", body = ReleaseResponse),
        ReadErrors,
    )
)]
pub(crate) async fn release(
    State(state): State<AppState>,
    ApiPath(session_id): ApiPath<String>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    let query = owner_filter(query, &caller)?;
    let session_id = SessionId::new(session_id)?;
    let store = state.gate().store();
    let view = store
        .session(&session_id)
        .await?
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "session not found"))?;
    check_owner(&query, &view.user_id, "session")?;
    let released = store.force_release(&session_id, None).await?;
    if let Some(turn) = &released {
        state.metrics().force_released();
        tracing::warn!(session_id = %session_id, turn_id = %turn.turn_id, "session force-released");
    }
    Ok(Json(ReleaseResponse {
        released: released.map(TurnDto::from),
    }))
}

/// Set a session's default busy policy: what a begin on it that names no
/// `on_busy` does when the session is busy. A begin that names one
/// overrides it. A session not used yet is created, bound to `user_id`;
/// setting it keeps the session at least a result retention, as a begin
/// does. The default is read only when such a begin finds the session
/// busy, so it costs a free session nothing.
#[utoipa::path(
    put,
    path = "/v1/sessions/{session_id}/policy",
    tag = "views",
    params(("session_id" = crate::schema::Id, Path, description = "The session")),
    request_body = SessionPolicyRequest,
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "The session, with its new default", body = SessionResponse),
        PolicyErrors,
    )
)]
pub(crate) async fn set_session_policy(
    State(state): State<AppState>,
    ApiPath(session_id): ApiPath<String>,
    caller: CallerUser,
    ApiJson(request): ApiJson<SessionPolicyRequest>,
) -> Result<Json<SessionResponse>, ApiError> {
    caller.check(&request.user_id)?;
    let on_busy = request.on_busy()?;
    let view = state
        .gate()
        .set_session_policy(&request.user_id, &session_id, on_busy)
        .await?;
    tracing::info!(%session_id, policy = on_busy.policy.as_str(), "session policy set");
    Ok(Json(SessionResponse {
        session: SessionDto::from(view),
    }))
}

/// A user: the cap in force and the live holders (permits in use).
///
/// Users are not records: an unknown user is answered with no live turns.
#[utoipa::path(
    get,
    path = "/v1/users/{user_id}",
    tag = "views",
    params(("user_id" = crate::schema::Id, Path, description = "The user"), OwnerQuery),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "The user", body = UserResponse),
        ReadErrors,
    )
)]
pub(crate) async fn user(
    State(state): State<AppState>,
    ApiPath(user_id): ApiPath<String>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<OwnerQuery>,
) -> Result<Json<UserResponse>, ApiError> {
    let user_id = UserId::new(user_id)?;
    caller.check(user_id.as_str())?;
    check_owner(&query, &user_id, "user")?;
    let view = state.gate().store().user(&user_id).await?;
    Ok(Json(UserResponse {
        user: UserDto::from(view),
    }))
}
