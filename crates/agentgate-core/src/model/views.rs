//! The views handed to callers: turns, sessions, users, executions, the
//! operator overview and the sweep's report. Never a lease token.

use super::*;

/// One entry of a session's queue, as the session view lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueEntry {
    /// The queued turn.
    pub turn_id: TurnId,
    /// Its request id.
    pub client_request_id: ClientRequestId,
    /// 1 for the head, gap-free behind it.
    pub position: u32,
    /// Store-clock time it was queued, ms since the Unix epoch.
    pub enqueued_at_ms: i64,
}

/// A turn as callers see it. Never holds a lease token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TurnView {
    /// The turn.
    pub turn_id: TurnId,
    /// Its session.
    pub session_id: SessionId,
    /// Its user.
    pub user_id: UserId,
    /// Its request id.
    pub client_request_id: ClientRequestId,
    /// Its state.
    pub state: TurnState,
    /// Attempts so far.
    pub attempt: u32,
    /// Fence of its latest grant.
    pub fence: Fence,
    /// Set when succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response: Option<Value>,
    /// Set when failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    /// Set when failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    /// Set when awaiting or having had a confirmation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending: Option<Value>,
    /// Set on a confirmation turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<ConfirmationContext>,
    /// Set on a confirmed turn: the continuation that took the decision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirmed_by: Option<TurnId>,
    /// Store-clock time a cancel was requested, ms since the Unix epoch:
    /// the holder learns it on its next heartbeat and tool claim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cancel_requested_at_ms: Option<i64>,
    /// Store-clock creation time, ms since the Unix epoch.
    pub created_at_ms: i64,
    /// Store-clock time of the latest change, ms since the Unix epoch.
    pub updated_at_ms: i64,
}

/// A session's live lease holder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HolderView {
    /// The session held.
    pub session_id: SessionId,
    /// The turn holding it.
    pub turn_id: TurnId,
    /// The holder's fence.
    pub fence: Fence,
    /// Remaining lease on the store's clock.
    pub lease_expires_in_ms: i64,
    /// Whether the holding turn was asked to stop
    /// ([`crate::store::Store::request_cancel`]) and has not ended yet.
    pub cancel_requested: bool,
}

/// A session's pending confirmation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingView {
    /// The turn awaiting confirmation.
    pub turn_id: TurnId,
    /// Remaining time before it expires, on the store's clock.
    pub expires_in_ms: i64,
}

/// A session as callers see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionView {
    /// The session.
    pub session_id: SessionId,
    /// The user it is bound to.
    pub user_id: UserId,
    /// The live holder, if any.
    pub holder: Option<HolderView>,
    /// The live pending confirmation, if any.
    pub pending_confirmation: Option<PendingView>,
    /// Latest fence granted on this session.
    pub fence: Fence,
    /// The turns waiting in the session's queue, head first (at most
    /// [`crate::limits::MAX_SESSION_QUEUE`]).
    pub queue: Vec<QueueEntry>,
    /// The session's default busy policy, for begins that name none
    /// (`None`: never set, which means `reject`).
    #[serde(skip)]
    pub default_on_busy: Option<OnBusy>,
}

/// A user as callers see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UserView {
    /// The user.
    pub user_id: UserId,
    /// The cap in force: the override, else the default.
    pub max_turns_per_user: u32,
    /// Live leases (permits in use).
    pub live_turns: u32,
    /// The live holders.
    pub holders: Vec<HolderView>,
}

/// A tool execution as callers see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecutionView {
    /// The execution.
    pub execution_id: ExecutionId,
    /// Its turn.
    pub turn_id: TurnId,
    /// Its tool.
    pub tool: ToolName,
    /// Its state.
    pub state: ToolState,
    /// Attempts so far.
    pub attempt: u32,
    /// Fence of the holder that claimed it last.
    pub fence: Fence,
    /// Set when succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Set when failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
}

/// A live lease as an operator sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LiveTurn {
    /// The user whose permit it takes.
    pub user_id: UserId,
    /// The lease and its holder.
    #[serde(flatten)]
    pub holder: HolderView,
}

/// What an operator's dashboard shows: live holders and the latest activity.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Overview {
    /// Live leases, soonest-expiring last.
    pub live: Vec<LiveTurn>,
    /// Turns by latest change, newest first.
    pub recent_turns: Vec<TurnView>,
    /// Tool executions by latest change, newest first.
    pub recent_executions: Vec<ExecutionView>,
}

/// A running turn that was asked to stop and has not ended within the
/// cancel grace ([`crate::config::Config::cancel_grace`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IgnoredCancel {
    /// The session it holds, or held until its lease lapsed.
    pub session_id: SessionId,
    /// The turn.
    pub turn_id: TurnId,
}

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    /// Orphaned turns ended `abandoned` (their grace ran out unclaimed).
    pub abandoned: u64,
    /// Running turns force-released because they were asked to stop and
    /// did not end within the cancel grace.
    pub released: u64,
    /// Turns deleted.
    pub turns: u64,
    /// Tool executions deleted.
    pub executions: u64,
    /// Turn events deleted (with their turns).
    pub events: u64,
    /// Idle sessions deleted.
    pub sessions: u64,
}

impl SweepReport {
    /// A store's deletions (a store's sweep abandons and releases nothing:
    /// the gate's sweeper does, and adds its counts).
    pub fn deleted(turns: u64, executions: u64, events: u64, sessions: u64) -> Self {
        Self {
            turns,
            executions,
            events,
            sessions,
            ..Self::default()
        }
    }
}
