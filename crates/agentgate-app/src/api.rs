//! The chat page's reads: a user's sessions, a session's transcript (with
//! its pending confirmation, whether a turn is still running and the
//! messages queued behind it), a user's ledger entries and totals, and the
//! app's settings; and the Stop button (which also cancels a queued
//! message).
//!
//! Ids are checked with the engine's constructors, so a bad one is a 400 like
//! on `/v1`. Another user's session reads as empty, never as an error that
//! would tell it exists.

use agentgate::model::QueueEntry;
use agentgate::{SessionId, TurnState, UserId};
use agentgate_ledger::{Entry, Reply, SessionSummary, Totals, TranscriptTurn};
use agentgate_server::{ApiError, ApiQuery, AppState, CallerUser};
use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::error::api_error;

/// `?user_id=`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UserQuery {
    user_id: String,
}

/// `?user_id=&session_id=`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SessionQuery {
    user_id: String,
    session_id: String,
}

/// A user's sessions.
#[derive(Debug, Serialize)]
pub(crate) struct SessionsResponse {
    sessions: Vec<SessionSummary>,
}

/// A pending confirmation: the turn to name when answering, and what waits.
#[derive(Debug, Serialize)]
pub(crate) struct PendingDto {
    turn_id: String,
    reply: Reply,
    /// Time left before it expires, on the store's clock (the page shows
    /// the deadline on the card).
    expires_in_ms: i64,
}

/// A session's transcript.
#[derive(Debug, Serialize)]
pub(crate) struct TranscriptResponse {
    session_id: String,
    /// Oldest first.
    turns: Vec<TranscriptTurn>,
    /// Whether a turn of this session is still running: the session has a
    /// live lease, or a turn's record says so (the page polls until it is
    /// not, then shows the reply).
    running: bool,
    /// The live pending confirmation, if any.
    pending: Option<PendingDto>,
    /// The messages waiting in the session's queue, head first, with their
    /// positions (their turns are in `turns`, in state `queued`).
    queue: Vec<QueueEntry>,
}

/// A user's ledger.
#[derive(Debug, Serialize)]
pub(crate) struct LedgerResponse {
    /// Newest first.
    entries: Vec<Entry>,
    totals: Totals,
}

/// What the page shows about the server's setup.
#[derive(Debug, Serialize)]
pub(crate) struct SettingsResponse {
    model: String,
    on_disconnect: &'static str,
    confirmation_threshold_cents: i64,
    lease_ttl_ms: u64,
    /// How long a pending confirmation waits for an answer.
    confirmation_ttl_ms: u64,
    max_turns_per_user: u32,
}

/// A user's sessions, most recent first.
pub(crate) async fn sessions(
    State(state): State<AppState>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<UserQuery>,
) -> Result<Json<SessionsResponse>, ApiError> {
    caller.check(&query.user_id)?;
    let mount = crate::ledger(&state)?;
    let user_id = UserId::new(query.user_id)?;
    let sessions = mount
        .app
        .sessions(user_id.as_str())
        .await
        .map_err(api_error)?;
    Ok(Json(SessionsResponse { sessions }))
}

/// A session's turns, its pending confirmation and whether a turn runs;
/// `not_found` for another user's session.
pub(crate) async fn transcript(
    State(state): State<AppState>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<SessionQuery>,
) -> Result<Json<TranscriptResponse>, ApiError> {
    caller.check(&query.user_id)?;
    let mount = crate::ledger(&state)?;
    let user_id = UserId::new(query.user_id)?;
    let session_id = SessionId::new(query.session_id)?;
    let turns = mount
        .app
        .transcript(user_id.as_str(), session_id.as_str())
        .await
        .map_err(api_error)?;
    // Read after the transcript: a turn that ended in between shows as
    // ended with its lease gone, never as running with no row.
    let session = state.gate().store().session(&session_id).await?;
    if session.as_ref().is_some_and(|view| view.user_id != user_id) {
        // Another user's session does not exist as far as this user can
        // tell, as on the engine's API: a link naming it is refused here,
        // not shown empty and then refused on every send.
        return Err(ApiError::new(
            agentgate_server::ErrorCode::NotFound,
            "session not found",
        ));
    }
    let pending = mount
        .app
        .pending_confirmation(user_id.as_str(), session_id.as_str())
        .await
        .map_err(api_error)?
        .and_then(|(turn_id, reply)| {
            // The pending turn's deadline; absent when it expired between
            // the two reads, and then it is no longer pending.
            let expires_in_ms = session
                .as_ref()
                .and_then(|view| view.pending_confirmation.as_ref())
                .filter(|pending| pending.turn_id.as_str() == turn_id)?
                .expires_in_ms;
            Some(PendingDto {
                turn_id,
                reply,
                expires_in_ms,
            })
        });
    // The session's live lease says a turn runs even before that turn's
    // first transcript row is written (or when a /v1 caller holds it).
    let held = session.as_ref().is_some_and(|view| view.holder.is_some());
    let running = held
        || turns
            .iter()
            .any(|turn| turn.state == Some(TurnState::Running));
    let queue = session.map(|view| view.queue).unwrap_or_default();
    Ok(Json(TranscriptResponse {
        session_id: session_id.as_str().to_owned(),
        turns,
        running,
        pending,
        queue,
    }))
}

/// A user's entries and totals per category.
pub(crate) async fn ledger(
    State(state): State<AppState>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<UserQuery>,
) -> Result<Json<LedgerResponse>, ApiError> {
    caller.check(&query.user_id)?;
    let mount = crate::ledger(&state)?;
    let user_id = UserId::new(query.user_id)?;
    let entries = mount
        .app
        .entries(user_id.as_str())
        .await
        .map_err(api_error)?;
    let totals = mount
        .app
        .totals(user_id.as_str())
        .await
        .map_err(api_error)?;
    Ok(Json(LedgerResponse { entries, totals }))
}

/// The model, disconnect policy, threshold and engine limits in force.
pub(crate) async fn settings(
    State(state): State<AppState>,
) -> Result<Json<SettingsResponse>, ApiError> {
    let mount = crate::ledger(&state)?;
    let engine = state.gate().config();
    Ok(Json(SettingsResponse {
        model: mount.app.model_name().to_owned(),
        on_disconnect: mount.on_disconnect.as_str(),
        confirmation_threshold_cents: mount.app.config().confirmation_threshold_cents,
        lease_ttl_ms: u64::try_from(engine.lease_ttl.as_millis()).unwrap_or(u64::MAX),
        confirmation_ttl_ms: u64::try_from(engine.confirmation_ttl.as_millis()).unwrap_or(u64::MAX),
        max_turns_per_user: engine.max_turns_per_user,
    }))
}

/// `?user_id=&turn_id=`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StopQuery {
    user_id: String,
    turn_id: String,
}

/// What a stop request found.
#[derive(Debug, Serialize)]
pub(crate) struct StopResponse {
    /// The turn's state after the request (`running` until its holder ends
    /// it `cancelled`; a queued turn is `cancelled` at once; an ended turn
    /// is left as it was).
    state: TurnState,
    /// Whether the request is recorded on the running turn.
    cancel_requested: bool,
    /// The turn's attempts: 0 when it never started, so a `cancelled`
    /// turn with 0 was cancelled before it ran.
    attempt: u32,
}

/// `POST /app/stop`: the Stop button, and the Cancel button of a queued
/// message. The engine's cancel request for one of the user's turns: a
/// holder on this node is signalled at once, one on another node at its
/// next heartbeat; it ends the turn `cancelled`, which a repeat of the
/// message replays. A queued turn is removed from its queue and ended
/// `cancelled` at once, never having run.
pub(crate) async fn stop(
    State(state): State<AppState>,
    caller: CallerUser,
    ApiQuery(query): ApiQuery<StopQuery>,
) -> Result<Json<StopResponse>, ApiError> {
    caller.check(&query.user_id)?;
    let user_id = UserId::new(query.user_id)?;
    let turn_id = agentgate::TurnId::new(query.turn_id)?;
    let gate = state.gate();
    let not_found = || ApiError::new(agentgate_server::ErrorCode::NotFound, "turn not found");
    // Another user's turn is not found, and nothing is written.
    gate.store()
        .turn(&turn_id)
        .await?
        .filter(|view| view.user_id == user_id)
        .ok_or_else(not_found)?;
    let view = gate.request_cancel(&turn_id).await?.ok_or_else(not_found)?;
    state.metrics().cancel_requested();
    Ok(Json(StopResponse {
        state: view.state,
        cancel_requested: view.cancel_requested_at_ms.is_some(),
        attempt: view.attempt,
    }))
}
