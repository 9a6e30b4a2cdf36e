//! The dashboard's data: the store's overview (live holders with fence and
//! remaining lease, recent turns and tool executions), each session's queue
//! (the messages waiting behind its holder, in order), permits in use per
//! user against their cap, and this server's counters (conflicts by code,
//! replays, takeovers, unknown tool outcomes).
//!
//! The page polls this about once a second. Every figure but the counters
//! is the store's truth, read on the store's clock, so it covers turns run by
//! other servers and `/v1` callers too; the counters are this process's.
//! Results, responses and payloads are left out: the dashboard shows who
//! holds what, not what users wrote.

use std::collections::BTreeSet;

use agentgate::model::{ExecutionView, LiveTurn, QueueEntry, TurnView};
use agentgate::{SessionId, TurnState, UserId};
use agentgate_ingest::IngestionView;
use agentgate_server::metrics::Counters;
use agentgate_server::{ApiError, AppState};
use axum::extract::State;
use axum::Json;
use serde::Serialize;

use crate::limits::{DASHBOARD_MAX_QUEUES, DASHBOARD_MAX_USERS, DASHBOARD_ROWS};

/// A live lease.
#[derive(Debug, Serialize)]
pub(crate) struct HolderRow {
    user_id: String,
    session_id: String,
    turn_id: String,
    fence: i64,
    lease_expires_in_ms: i64,
    /// Asked to stop, not ended yet.
    cancel_requested: bool,
}

impl From<LiveTurn> for HolderRow {
    fn from(live: LiveTurn) -> Self {
        Self {
            user_id: live.user_id.as_str().to_owned(),
            session_id: live.holder.session_id.as_str().to_owned(),
            turn_id: live.holder.turn_id.as_str().to_owned(),
            fence: live.holder.fence.0,
            lease_expires_in_ms: live.holder.lease_expires_in_ms,
            cancel_requested: live.holder.cancel_requested,
        }
    }
}

/// A user's permits: live leases against the cap in force.
#[derive(Debug, Serialize)]
pub(crate) struct PermitRow {
    user_id: String,
    live_turns: u32,
    max_turns_per_user: u32,
}

/// A recent turn, without its payload or response.
#[derive(Debug, Serialize)]
pub(crate) struct TurnRow {
    turn_id: String,
    user_id: String,
    session_id: String,
    client_request_id: String,
    state: &'static str,
    /// A `running` turn with no live lease: its holder died or vanished,
    /// and the turn waits for a takeover, the recovery worker, or its end
    /// as `abandoned` (an orphan, docs/protocol.md §8.1).
    orphaned: bool,
    attempt: u32,
    fence: i64,
    /// A running turn asked to stop (a Stop, an interrupting message, a
    /// cancel request) that has not ended yet.
    cancel_requested: bool,
    /// Set on a confirmation turn: the decision it took.
    #[serde(skip_serializing_if = "Option::is_none")]
    decision: Option<&'static str>,
    updated_at_ms: i64,
}

impl TurnRow {
    /// The row of `view`; `orphaned` is for the caller to judge.
    fn new(view: TurnView, orphaned: bool) -> Self {
        Self {
            turn_id: view.turn_id.as_str().to_owned(),
            user_id: view.user_id.as_str().to_owned(),
            session_id: view.session_id.as_str().to_owned(),
            client_request_id: view.client_request_id.as_str().to_owned(),
            state: view.state.as_str(),
            orphaned,
            attempt: view.attempt,
            fence: view.fence.0,
            cancel_requested: view.state == agentgate::TurnState::Running
                && view.cancel_requested_at_ms.is_some(),
            decision: view.confirmation.as_ref().map(|c| c.decision.as_str()),
            updated_at_ms: view.updated_at_ms,
        }
    }
}

/// A session's queue: the turns waiting behind its holder.
#[derive(Debug, Serialize)]
pub(crate) struct QueueRow {
    user_id: String,
    session_id: String,
    /// The turn holding the session; `None` between an ending and the
    /// handoff, or when the queue waits for a recovery worker's claim (its
    /// worker died) or behind a pending confirmation.
    holder_turn_id: Option<String>,
    /// Whether the holder was asked to stop and has not ended yet.
    cancel_requested: bool,
    /// The queued turns, head first (position 1).
    queue: Vec<QueueEntry>,
}

/// A recent tool execution, without its result.
#[derive(Debug, Serialize)]
pub(crate) struct ExecutionRow {
    execution_id: String,
    turn_id: String,
    tool: String,
    state: &'static str,
    attempt: u32,
    fence: i64,
}

impl From<ExecutionView> for ExecutionRow {
    fn from(view: ExecutionView) -> Self {
        Self {
            execution_id: view.execution_id.as_str().to_owned(),
            turn_id: view.turn_id.as_str().to_owned(),
            tool: view.tool.as_str().to_owned(),
            state: view.state.as_str(),
            attempt: view.attempt,
            fence: view.fence.0,
        }
    }
}

/// Everything the dashboard shows.
#[derive(Debug, Serialize)]
pub(crate) struct DashboardResponse {
    /// Live leases across every node on this store, soonest-expiring last.
    live: Vec<HolderRow>,
    /// Most rows per list: `live` holding this many means there may be
    /// more live turns than listed.
    rows_limit: u32,
    /// Users with a live lease or a recent turn (at most
    /// [`DASHBOARD_MAX_USERS`]), live ones first.
    permits: Vec<PermitRow>,
    /// The sessions with a non-empty queue among those held or with a
    /// recent queued turn (at most [`DASHBOARD_MAX_QUEUES`] looked at).
    queues: Vec<QueueRow>,
    /// Newest first.
    recent_turns: Vec<TurnRow>,
    /// Newest first.
    recent_executions: Vec<ExecutionRow>,
    /// Newest first: the documents' ingestions (seed 003), each a turn of
    /// its document's session; absent when the store has no documents.
    #[serde(skip_serializing_if = "Option::is_none")]
    ingestions: Option<Vec<IngestionView>>,
    /// This server's counters since it started.
    counters: Counters,
    lease_ttl_ms: u64,
    max_turns_per_user: u32,
}

/// The users to show permits for: those holding a lease, then those with
/// recent turns, without repeats, at most [`DASHBOARD_MAX_USERS`].
fn permit_users<'a>(live: &'a [LiveTurn], turns: &'a [TurnView]) -> Vec<&'a UserId> {
    let mut seen = BTreeSet::new();
    live.iter()
        .map(|l| &l.user_id)
        .chain(turns.iter().map(|t| &t.user_id))
        .filter(|user| seen.insert(user.as_str()))
        .take(DASHBOARD_MAX_USERS)
        .collect()
}

/// The sessions whose queue to read: those held, then those with a recent
/// queued turn (a queue with no holder), without repeats, at most
/// [`DASHBOARD_MAX_QUEUES`]. A queue always waits behind a holder or for
/// one of these, so a session with neither has an empty queue.
fn queue_sessions<'a>(live: &'a [LiveTurn], turns: &'a [TurnView]) -> Vec<&'a SessionId> {
    let mut seen = BTreeSet::new();
    live.iter()
        .map(|l| &l.holder.session_id)
        .chain(
            turns
                .iter()
                .filter(|t| t.state == TurnState::Queued)
                .map(|t| &t.session_id),
        )
        .filter(|session| seen.insert(session.as_str()))
        .take(DASHBOARD_MAX_QUEUES)
        .collect()
}

/// Whether `turn` is an orphan: `running` with no live lease. Only judged
/// when `live` is the whole list of live leases (shorter than the row
/// limit); a cut list could miss the turn's holder.
fn is_orphaned(turn: &TurnView, live: &[LiveTurn], live_complete: bool) -> bool {
    live_complete
        && turn.state == TurnState::Running
        && !live.iter().any(|l| l.holder.turn_id == turn.turn_id)
}

/// The store's overview, permits per user and the server's counters.
pub(crate) async fn dashboard(
    State(state): State<AppState>,
) -> Result<Json<DashboardResponse>, ApiError> {
    let store = state.gate().store();
    let overview = store.overview(DASHBOARD_ROWS).await?;
    let mut permits = Vec::new();
    for user_id in permit_users(&overview.live, &overview.recent_turns) {
        let user = store.user(user_id).await?;
        permits.push(PermitRow {
            user_id: user_id.as_str().to_owned(),
            live_turns: user.live_turns,
            max_turns_per_user: user.max_turns_per_user,
        });
    }
    let mut queues = Vec::new();
    for session_id in queue_sessions(&overview.live, &overview.recent_turns) {
        let Some(session) = store.session(session_id).await? else {
            continue;
        };
        if session.queue.is_empty() {
            continue;
        }
        queues.push(QueueRow {
            user_id: session.user_id.as_str().to_owned(),
            session_id: session.session_id.as_str().to_owned(),
            cancel_requested: session.holder.as_ref().is_some_and(|h| h.cancel_requested),
            holder_turn_id: session.holder.map(|h| h.turn_id.as_str().to_owned()),
            queue: session.queue,
        });
    }
    let engine = state.gate().config();
    let live_complete = overview.live.len() < DASHBOARD_ROWS as usize;
    let recent_turns = overview
        .recent_turns
        .into_iter()
        .map(|turn| {
            let orphaned = is_orphaned(&turn, &overview.live, live_complete);
            TurnRow::new(turn, orphaned)
        })
        .collect();
    let ingestions = match state
        .extension::<crate::LedgerMount>()
        .and_then(|mount| mount.documents.as_ref())
    {
        Some(documents) => Some(
            documents
                .recent(DASHBOARD_ROWS as usize)
                .await
                .map_err(crate::documents::api_error)?,
        ),
        None => None,
    };
    Ok(Json(DashboardResponse {
        live: overview.live.into_iter().map(HolderRow::from).collect(),
        rows_limit: DASHBOARD_ROWS,
        permits,
        queues,
        recent_turns,
        recent_executions: overview
            .recent_executions
            .into_iter()
            .map(ExecutionRow::from)
            .collect(),
        ingestions,
        counters: {
            state
                .metrics()
                .set_waiting_begins(state.gate().waiting_begins());
            state.metrics().counters()
        },
        lease_ttl_ms: u64::try_from(engine.lease_ttl.as_millis()).unwrap_or(u64::MAX),
        max_turns_per_user: engine.max_turns_per_user,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use agentgate::model::HolderView;
    use agentgate::{Fence, SessionId, TurnId};

    fn live(user: &str, session: &str) -> LiveTurn {
        LiveTurn {
            user_id: UserId::new(user).unwrap(),
            holder: HolderView {
                session_id: SessionId::new(session).unwrap(),
                turn_id: TurnId::new(format!("turn_{session}")).unwrap(),
                fence: Fence(1),
                lease_expires_in_ms: 1000,
                cancel_requested: false,
            },
        }
    }

    fn turn(session: &str, state: TurnState) -> TurnView {
        TurnView {
            turn_id: TurnId::new(format!("turn_{session}")).unwrap(),
            session_id: SessionId::new(session).unwrap(),
            user_id: UserId::new("alice").unwrap(),
            client_request_id: agentgate::ClientRequestId::new("m1").unwrap(),
            state,
            attempt: 1,
            fence: Fence(1),
            response: None,
            error: None,
            retryable: None,
            pending: None,
            confirmation: None,
            confirmed_by: None,
            cancel_requested_at_ms: None,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    #[test]
    fn a_running_turn_without_a_live_lease_is_orphaned() {
        let holders = vec![live("alice", "a1")];
        // Held: running and live.
        assert!(!is_orphaned(
            &turn("a1", TurnState::Running),
            &holders,
            true
        ));
        // Its session has no live holder: the holder died.
        assert!(is_orphaned(&turn("a2", TurnState::Running), &holders, true));
        // An ended turn is never an orphan.
        assert!(!is_orphaned(
            &turn("a2", TurnState::Succeeded),
            &holders,
            true
        ));
        // A cut list of holders cannot tell.
        assert!(!is_orphaned(
            &turn("a2", TurnState::Running),
            &holders,
            false
        ));
    }

    #[test]
    fn queue_sessions_are_the_held_then_the_queued_distinct_and_bounded() {
        let holders = vec![live("alice", "a1"), live("bob", "b1")];
        let turns = vec![
            turn("q1", TurnState::Queued),
            turn("a1", TurnState::Queued),
            turn("done", TurnState::Succeeded),
            turn("q1", TurnState::Queued),
        ];
        let sessions = queue_sessions(&holders, &turns);
        let names: Vec<&str> = sessions.iter().map(|s| s.as_str()).collect();
        // An ended turn's session with no holder has nothing queued.
        assert_eq!(names, ["a1", "b1", "q1"]);
        let many: Vec<TurnView> = (0..DASHBOARD_MAX_QUEUES + 5)
            .map(|i| turn(&format!("q{i}"), TurnState::Queued))
            .collect();
        assert_eq!(queue_sessions(&[], &many).len(), DASHBOARD_MAX_QUEUES);
    }

    #[test]
    fn permit_users_are_distinct_live_first_and_bounded() {
        let mut holders = vec![live("bob", "b1"), live("alice", "a1"), live("bob", "b2")];
        let users = permit_users(&holders, &[]);
        let names: Vec<&str> = users.iter().map(|u| u.as_str()).collect();
        assert_eq!(names, ["bob", "alice"]);
        holders = (0..DASHBOARD_MAX_USERS + 5)
            .map(|i| live(&format!("u{i}"), &format!("s{i}")))
            .collect();
        assert_eq!(permit_users(&holders, &[]).len(), DASHBOARD_MAX_USERS);
    }
}
