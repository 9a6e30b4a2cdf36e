//! The wire format (docs/protocol.md §10): every request and response body, as the
//! handlers (de)serialise it and as the OpenAPI document describes it.
//!
//! These types exist so the document is generated from exactly what goes on
//! the wire: the engine's own views know nothing of HTTP or OpenAPI, and are
//! converted here field by field. Errors live in [`crate::error`].
//!
//! Architecture invariant: no type here carries a lease token except
//! [`GrantDto`], which is only ever sent to the caller that was granted it.

use std::fmt;

use agentgate::model::{Confirmation, Grant, HolderView, PendingView, QueuedTurn};
use agentgate::{
    ConfirmationContext, Decision, ExecutionView, PreviousOutcome, SessionView, ToolState,
    TurnState, TurnView, UserView,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use crate::schema::{Id, JsonValue};

// ---------------------------------------------------------------- enums

/// Where a turn is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TurnStateDto {
    /// Under a lease (live, or dead and waiting for a takeover).
    Running,
    /// Ended with a response; repeats of the request replay it.
    Succeeded,
    /// Ended with an error; retryable ones restart on a repeat.
    Failed,
    /// Ended waiting for a person to approve or reject `pending`.
    AwaitingConfirmation,
    /// Was awaiting confirmation; a continuation turn took the decision.
    Confirmed,
    /// Orphaned (its lease expired without an ending) and claimed by no one
    /// within the orphan grace: ended by the sweeper, its session released.
    /// A repeat of its request restarts it.
    Abandoned,
    /// Asked to stop and ended so by its holder (or, queued, before it
    /// started); `response` holds what it had produced. Repeats of its
    /// request replay it.
    Cancelled,
    /// Waiting in its session's queue (`on_busy: enqueue`); no lease, no
    /// attempt yet.
    Queued,
    /// Replaced, before it started, by a newer message sent with
    /// `on_busy: supersede`. Repeats of its request replay it.
    Superseded,
}

impl From<TurnState> for TurnStateDto {
    fn from(state: TurnState) -> Self {
        match state {
            TurnState::Running => Self::Running,
            TurnState::Succeeded => Self::Succeeded,
            TurnState::Failed => Self::Failed,
            TurnState::AwaitingConfirmation => Self::AwaitingConfirmation,
            TurnState::Confirmed => Self::Confirmed,
            TurnState::Abandoned => Self::Abandoned,
            TurnState::Cancelled => Self::Cancelled,
            TurnState::Queued => Self::Queued,
            TurnState::Superseded => Self::Superseded,
        }
    }
}

/// Where a tool execution is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolStateDto {
    /// Claimed for execution by the current lease holder.
    Running,
    /// Done; its result is returned to every later claim.
    Succeeded,
    /// Failed; the next claim executes it again.
    Failed,
}

impl From<ToolState> for ToolStateDto {
    fn from(state: ToolState) -> Self {
        match state {
            ToolState::Running => Self::Running,
            ToolState::Succeeded => Self::Succeeded,
            ToolState::Failed => Self::Failed,
        }
    }
}

/// What became of the previous attempt of a tool execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PreviousOutcomeDto {
    /// It reported failure.
    Failed,
    /// Its holder died mid-call: it may or may not have taken effect. Check
    /// downstream with the idempotency key before running it again.
    Unknown,
}

impl From<PreviousOutcome> for PreviousOutcomeDto {
    fn from(outcome: PreviousOutcome) -> Self {
        match outcome {
            PreviousOutcome::Failed => Self::Failed,
            PreviousOutcome::Unknown => Self::Unknown,
        }
    }
}

/// What a begin does when its session is held by another turn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BusyPolicyDto {
    /// Refuse at once: 409 `session_busy` (the default).
    #[default]
    Reject,
    /// Wait up to `wait_ms` for the session to come free, then start.
    Wait,
    /// Ask the running turn to stop (a cancel request), wait up to
    /// `wait_ms` for it to end, then start.
    Interrupt,
    /// Join the session's durable FIFO queue (at most 100 waiting turns):
    /// 202 with the queued turn and its position. The holder's caller
    /// starts it when it ends its turn with `take_next: true`; a recovery
    /// worker (`POST /v1/orphans/claim`) when nobody does.
    Enqueue,
    /// As `enqueue`, and every turn queued before it ends `superseded`
    /// (the newest message replaces the unstarted ones).
    Supersede,
}

impl From<agentgate::BusyPolicy> for BusyPolicyDto {
    fn from(policy: agentgate::BusyPolicy) -> Self {
        match policy {
            agentgate::BusyPolicy::Reject => Self::Reject,
            agentgate::BusyPolicy::Wait => Self::Wait,
            agentgate::BusyPolicy::Interrupt => Self::Interrupt,
            agentgate::BusyPolicy::Enqueue => Self::Enqueue,
            agentgate::BusyPolicy::Supersede => Self::Supersede,
        }
    }
}

impl From<BusyPolicyDto> for agentgate::BusyPolicy {
    fn from(policy: BusyPolicyDto) -> Self {
        match policy {
            BusyPolicyDto::Reject => Self::Reject,
            BusyPolicyDto::Wait => Self::Wait,
            BusyPolicyDto::Interrupt => Self::Interrupt,
            BusyPolicyDto::Enqueue => Self::Enqueue,
            BusyPolicyDto::Supersede => Self::Supersede,
        }
    }
}

/// A person's answer to a pending confirmation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DecisionDto {
    /// Go ahead with the pending action.
    Approve,
    /// Drop it.
    Reject,
}

impl From<Decision> for DecisionDto {
    fn from(decision: Decision) -> Self {
        match decision {
            Decision::Approve => Self::Approve,
            Decision::Reject => Self::Reject,
        }
    }
}

impl From<DecisionDto> for Decision {
    fn from(decision: DecisionDto) -> Self {
        match decision {
            DecisionDto::Approve => Self::Approve,
            DecisionDto::Reject => Self::Reject,
        }
    }
}

// ---------------------------------------------------------------- requests

/// `POST /v1/turns`: begin a turn, or answer a pending confirmation.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BeginRequest {
    /// The account the turn runs for.
    #[schema(value_type = Id)]
    pub user_id: String,
    /// The conversation; bound to its first user.
    #[schema(value_type = Id)]
    pub session_id: String,
    /// The client's id for this message. A repeat with the same payload
    /// replays or conflicts; with another payload it is refused.
    #[schema(value_type = Id)]
    pub client_request_id: String,
    /// The message; any JSON. Absent is the same as `null`.
    #[serde(default)]
    #[schema(value_type = JsonValue)]
    pub payload: Value,
    /// Set to answer a pending confirmation of an earlier turn.
    #[serde(default)]
    pub confirmation: Option<ConfirmationRequest>,
    /// What to do when the session is held by another turn (or has turns
    /// queued): `reject`, `wait`, `interrupt`, `enqueue` or `supersede`.
    /// Absent: the session's default (`PUT /v1/sessions/{id}/policy`),
    /// `reject` when none was set.
    #[serde(default)]
    pub on_busy: Option<BusyPolicyDto>,
    /// How long `wait` and `interrupt` wait at most, in milliseconds
    /// (default 12000, at most 20000). Only with those policies.
    #[serde(default, deserialize_with = "wait_ms")]
    #[schema(minimum = 0, maximum = 20000)]
    pub wait_ms: Option<u64>,
    /// With `supersede` only: also ask the running turn to stop once this
    /// message is queued, so it runs next and soon (a correction typed
    /// mid-reply). Default false.
    #[serde(default)]
    pub interrupt_running: bool,
}

impl BeginRequest {
    /// The policy the begin names, validated; `None` when it names none
    /// (the session's default then applies).
    ///
    /// # Errors
    /// `invalid_request` for a bound or `interrupt_running` the policy
    /// does not take ([`OnBusy::new`], [`OnBusy::interrupting`]), or either
    /// without a policy.
    pub fn on_busy(&self) -> agentgate::Result<Option<agentgate::OnBusy>> {
        on_busy_of(self.on_busy, self.wait_ms, self.interrupt_running)
    }
}

/// A policy, its bound and its interrupt flag as a request names them,
/// validated (`None`: no policy named, and no bound or flag either).
fn on_busy_of(
    policy: Option<BusyPolicyDto>,
    wait_ms: Option<u64>,
    interrupt_running: bool,
) -> agentgate::Result<Option<agentgate::OnBusy>> {
    let Some(policy) = policy else {
        if wait_ms.is_some() || interrupt_running {
            return Err(agentgate::Error::invalid(
                "wait_ms and interrupt_running need an on_busy policy",
            ));
        }
        return Ok(None);
    };
    let on_busy = agentgate::OnBusy::new(policy.into(), wait_ms)?;
    Ok(Some(if interrupt_running {
        on_busy.interrupting()?
    } else {
        on_busy
    }))
}

/// Body of `PUT /v1/sessions/{session_id}/policy`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionPolicyRequest {
    /// The session's user (a session not used yet is bound to it).
    #[schema(value_type = Id)]
    pub user_id: String,
    /// The policy a begin on this session that names none follows.
    pub on_busy: BusyPolicyDto,
    /// As in a begin: only with `wait` and `interrupt`.
    #[serde(default, deserialize_with = "wait_ms")]
    #[schema(minimum = 0, maximum = 20000)]
    pub wait_ms: Option<u64>,
    /// As in a begin: only with `supersede`.
    #[serde(default)]
    pub interrupt_running: bool,
}

impl SessionPolicyRequest {
    /// The policy, validated.
    ///
    /// # Errors
    /// As [`BeginRequest::on_busy`].
    pub fn on_busy(&self) -> agentgate::Result<agentgate::OnBusy> {
        let on_busy = on_busy_of(Some(self.on_busy), self.wait_ms, self.interrupt_running)?;
        Ok(on_busy.expect("a named policy validates to a policy"))
    }
}

/// A session's default busy policy, as set.
#[derive(Debug, Serialize, ToSchema)]
pub struct SessionPolicyDto {
    /// The policy.
    pub on_busy: BusyPolicyDto,
    /// The bound of `wait` and `interrupt`, in milliseconds; `null` for
    /// the others.
    #[schema(required = true)]
    pub wait_ms: Option<u64>,
    /// `supersede` also interrupts the running turn.
    pub interrupt_running: bool,
}

impl From<agentgate::OnBusy> for SessionPolicyDto {
    fn from(on_busy: agentgate::OnBusy) -> Self {
        Self {
            on_busy: BusyPolicyDto::from(on_busy.policy),
            wait_ms: (!on_busy.wait.is_zero())
                .then(|| u64::try_from(on_busy.wait.as_millis()).unwrap_or(u64::MAX)),
            interrupt_running: on_busy.interrupt,
        }
    }
}

impl fmt::Debug for BeginRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The payload is the user's message: keep it out of logs.
        f.debug_struct("BeginRequest")
            .field("user_id", &self.user_id)
            .field("session_id", &self.session_id)
            .field("client_request_id", &self.client_request_id)
            .finish_non_exhaustive()
    }
}

/// The confirmation part of a begin.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConfirmationRequest {
    /// The turn that is awaiting confirmation.
    #[schema(value_type = Id)]
    pub turn_id: String,
    /// Approve or reject its pending action.
    pub decision: DecisionDto,
}

impl ConfirmationRequest {
    /// The engine's confirmation.
    ///
    /// # Errors
    /// `invalid_request` for a malformed turn id.
    pub fn to_engine(&self) -> agentgate::Result<Confirmation> {
        Ok(Confirmation {
            turn_id: agentgate::TurnId::new(self.turn_id.clone())?,
            decision: self.decision.into(),
        })
    }
}

/// `POST /v1/turns/{turn_id}/tools`: claim a tool execution.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimToolRequest {
    /// The tool's name.
    #[schema(value_type = Id)]
    pub tool: String,
    /// The tool's arguments; any JSON. Key order, whitespace and number
    /// spelling do not matter (RFC 8785 canonical form is hashed).
    #[schema(value_type = JsonValue)]
    pub args: Value,
}

/// `POST /v1/turns/{turn_id}/tools/{execution_id}/complete`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteToolRequest {
    /// The tool's result; returned to every later claim of the same call.
    #[schema(value_type = JsonValue)]
    pub result: Value,
}

/// `POST /v1/turns/{turn_id}/tools/{execution_id}/fail`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailToolRequest {
    /// What went wrong; the next claim executes the tool again.
    #[schema(value_type = JsonValue)]
    pub error: Value,
}

/// `POST /v1/turns/{turn_id}/complete`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteTurnRequest {
    /// The turn's answer; repeats of the request replay it.
    #[schema(value_type = JsonValue)]
    pub response: Value,
    /// Start the head of the session's queue for this caller right after
    /// the ending (the answer's `next`). Default false.
    #[serde(default)]
    pub take_next: bool,
}

/// `POST /v1/turns/{turn_id}/fail`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailTurnRequest {
    /// What went wrong.
    #[schema(value_type = JsonValue)]
    pub error: Value,
    /// Whether a repeat of the request restarts the turn (default false: a
    /// repeat replays this failure).
    #[serde(default)]
    pub retryable: bool,
    /// Start the head of the session's queue for this caller right after
    /// the ending (the answer's `next`). Default false.
    #[serde(default)]
    pub take_next: bool,
}

/// `POST /v1/turns/{turn_id}/await-confirmation`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AwaitConfirmationRequest {
    /// What the person is asked to approve; handed to the confirmation turn.
    #[schema(value_type = JsonValue)]
    pub pending: Value,
}

/// Query of the read endpoints.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct OwnerQuery {
    /// When given, a record of any other user is reported as `not_found`,
    /// so one user cannot learn about another's sessions and turns.
    #[param(value_type = Option<Id>)]
    #[serde(default, deserialize_with = "valid_user_id")]
    pub user_id: Option<String>,
}

/// Checks the `user_id` query parameter like any user id, so a malformed
/// one is `invalid_request` as the document says, not a silent `not_found`.
fn valid_user_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let raw = String::deserialize(d)?;
    agentgate::UserId::new(raw.clone()).map_err(serde::de::Error::custom)?;
    Ok(Some(raw))
}

// ---------------------------------------------------------------- responses

/// A granted lease and the turn it runs. Sent only to the caller granted it.
#[derive(Serialize, ToSchema)]
pub struct GrantDto {
    /// The turn.
    pub turn_id: String,
    /// Its session.
    pub session_id: String,
    /// Its user.
    pub user_id: String,
    /// Its request id.
    pub client_request_id: String,
    /// Always `running`.
    pub state: TurnStateDto,
    /// The secret to send as `Lease-Token` on every later call of this turn.
    pub lease_token: String,
    /// This grant's fencing token; strictly higher than any earlier grant.
    pub fence: i64,
    /// 1 for the first start, +1 per takeover or restart.
    pub attempt: u32,
    /// Whether this start took over a running turn whose lease expired: its
    /// tool executions may have run; claim them again to find out.
    pub takeover: bool,
    /// Remaining lease on the store's clock. Heartbeat well before it runs
    /// out (every third of the TTL).
    pub lease_expires_in_ms: i64,
    /// Present on a confirmation turn: the pending action and the decision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<ConfirmationDto>,
}

impl fmt::Debug for GrantDto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrantDto")
            .field("turn_id", &self.turn_id)
            .field("fence", &self.fence)
            .field("lease_token", &"<redacted>")
            .finish_non_exhaustive()
    }
}

impl From<Grant> for GrantDto {
    fn from(grant: Grant) -> Self {
        Self {
            turn_id: grant.turn_id.to_string(),
            session_id: grant.session_id.to_string(),
            user_id: grant.user_id.to_string(),
            client_request_id: grant.client_request_id.to_string(),
            state: TurnStateDto::Running,
            lease_token: grant.lease_token.expose_secret().to_owned(),
            fence: grant.fence.0,
            attempt: grant.attempt,
            takeover: grant.takeover,
            lease_expires_in_ms: grant.lease_expires_in_ms,
            confirmation: grant.confirmation.map(ConfirmationDto::from),
        }
    }
}

/// What a confirmation turn carries over from the turn it answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct ConfirmationDto {
    /// The turn that awaited confirmation.
    pub turn_id: String,
    /// The person's decision.
    pub decision: DecisionDto,
    /// The pending action that turn recorded.
    pub pending: Value,
}

impl From<ConfirmationContext> for ConfirmationDto {
    fn from(context: ConfirmationContext) -> Self {
        Self {
            turn_id: context.turn_id.to_string(),
            decision: context.decision.into(),
            pending: context.pending,
        }
    }
}

/// 201 from `POST /v1/turns`: a lease was granted; run the turn.
#[derive(Debug, Serialize, ToSchema)]
pub struct BeginResponse {
    /// The granted turn.
    pub turn: GrantDto,
}

/// 200 from `POST /v1/turns`: the request already ended; no lease was taken.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplayResponse {
    /// Always true.
    pub replay: bool,
    /// The stored outcome (for a second confirmation: the continuation turn's).
    pub turn: TurnDto,
}

/// A turn as callers see it. Never holds a lease token.
#[derive(Debug, Serialize, ToSchema)]
pub struct TurnDto {
    /// The turn.
    pub turn_id: String,
    /// Its session.
    pub session_id: String,
    /// Its user.
    pub user_id: String,
    /// Its request id.
    pub client_request_id: String,
    /// Its state.
    pub state: TurnStateDto,
    /// Attempts so far.
    pub attempt: u32,
    /// Fence of its latest grant.
    pub fence: i64,
    /// Set when succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response: Option<Value>,
    /// Set when failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    /// Set when failed: whether a repeat restarts it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    /// Set when awaiting or having had a confirmation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending: Option<Value>,
    /// Set on a confirmation turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<ConfirmationDto>,
    /// Set on a confirmed turn: the continuation that took the decision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirmed_by: Option<String>,
    /// Set once a cancel was requested: store-clock ms since the Unix epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cancel_requested_at_ms: Option<i64>,
    /// Store-clock creation time, ms since the Unix epoch.
    pub created_at_ms: i64,
    /// Store-clock time of the latest change, ms since the Unix epoch.
    pub updated_at_ms: i64,
}

impl From<TurnView> for TurnDto {
    fn from(view: TurnView) -> Self {
        Self {
            turn_id: view.turn_id.to_string(),
            session_id: view.session_id.to_string(),
            user_id: view.user_id.to_string(),
            client_request_id: view.client_request_id.to_string(),
            state: view.state.into(),
            attempt: view.attempt,
            fence: view.fence.0,
            response: view.response,
            error: view.error,
            retryable: view.retryable,
            pending: view.pending,
            confirmation: view.confirmation.map(ConfirmationDto::from),
            confirmed_by: view.confirmed_by.map(|id| id.to_string()),
            cancel_requested_at_ms: view.cancel_requested_at_ms,
            created_at_ms: view.created_at_ms,
            updated_at_ms: view.updated_at_ms,
        }
    }
}

/// 200 from a turn ending, and the turn part of `GET /v1/turns/{turn_id}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TurnResponse {
    /// The turn after the call.
    pub turn: TurnDto,
    /// After an ending with `take_next: true`: the head of the session's
    /// queue, started for this caller (absent when nothing was queued, or
    /// the head could not start now and stays queued).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<NextTurnDto>,
}

/// The queued turn an ending handed to its caller: a lease like a begin's,
/// and the message to run.
#[derive(Debug, Serialize, ToSchema)]
pub struct NextTurnDto {
    /// The lease on the next turn, as a begin grants it.
    pub turn: GrantDto,
    /// The queued message's payload.
    #[schema(value_type = JsonValue)]
    pub payload: Value,
}

/// 202 from `POST /v1/turns` with `on_busy: enqueue` or `supersede` (or a
/// repeat of a queued request): the request waits in its session's queue.
#[derive(Debug, Serialize, ToSchema)]
pub struct QueuedResponse {
    /// Always true.
    pub queued: bool,
    /// The queued turn.
    pub turn: QueuedDto,
}

/// A turn waiting in its session's queue.
#[derive(Debug, Serialize, ToSchema)]
pub struct QueuedDto {
    /// The turn.
    pub turn_id: String,
    /// Its session.
    pub session_id: String,
    /// Its user.
    pub user_id: String,
    /// Its request id.
    pub client_request_id: String,
    /// Always `queued`.
    pub state: TurnStateDto,
    /// 1 for the head of the queue, gap-free behind it.
    pub position: u32,
    /// Store-clock time it was queued, ms since the Unix epoch.
    pub enqueued_at_ms: i64,
    /// When to look again (`GET /v1/turns/{turn_id}`, or a repeat): the
    /// holder's remaining lease, at least 1.
    pub retry_after_ms: u64,
}

impl From<QueuedTurn> for QueuedDto {
    fn from(queued: QueuedTurn) -> Self {
        Self {
            turn_id: queued.turn_id.to_string(),
            session_id: queued.session_id.to_string(),
            user_id: queued.user_id.to_string(),
            client_request_id: queued.client_request_id.to_string(),
            state: TurnStateDto::Queued,
            position: queued.position,
            enqueued_at_ms: queued.enqueued_at_ms,
            retry_after_ms: u64::try_from(queued.retry_after.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// One waiting turn of a session's queue.
#[derive(Debug, Serialize, ToSchema)]
pub struct QueueEntryDto {
    /// The queued turn (`POST /v1/turns/{turn_id}/cancel` removes it).
    pub turn_id: String,
    /// Its request id.
    pub client_request_id: String,
    /// 1 for the head, gap-free behind it.
    pub position: u32,
    /// Store-clock time it was queued, ms since the Unix epoch.
    pub enqueued_at_ms: i64,
}

/// 200 from `GET /v1/turns/{turn_id}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TurnStateResponse {
    /// The turn.
    pub turn: TurnDto,
    /// `true` when the turn is `running` but no live lease holds it: its
    /// holder died without an ending. A repeat of its request, or a recovery
    /// worker (`POST /v1/orphans/claim`), takes it over; unclaimed past the
    /// orphan grace it ends `abandoned`.
    pub orphaned: bool,
    /// `true` when the turn is `awaiting_confirmation` but its pending
    /// confirmation expired (`--confirmation-ttl-ms`): nothing will run, and
    /// an answer to it is refused 409 `confirmation_expired`.
    pub confirmation_expired: bool,
    /// The first page of its tool executions, oldest first: at most
    /// 50 (`DEFAULT_EXECUTION_PAGE`) and at most 4 MiB
    /// (`MAX_EXECUTION_PAGE_BYTES`) of results and errors.
    pub executions: Vec<ExecutionDto>,
    /// Where the next page starts: pass it as `after` to
    /// `GET /v1/turns/{turn_id}/executions`; `null` when this page is the last.
    pub executions_next: Option<String>,
}

/// Query of `GET /v1/turns/{turn_id}/executions`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExecutionPageQuery {
    /// As on the other read endpoints: a turn of any other user is
    /// reported as `not_found`.
    #[param(value_type = Option<Id>)]
    #[serde(default, deserialize_with = "valid_user_id")]
    pub user_id: Option<String>,
    /// The `executions_next` of the previous page; absent for the first.
    /// Treat it as opaque; its form (`<claim number>.<execution id>`) is stated so a
    /// schema-valid value is one the server can read. One that names no
    /// execution of the turn simply starts after where it would sort.
    #[param(
        pattern = r"^(?:[0-9]{1,3}|1000)\.exec_[^\u0000-\u001F\u007F-\u009F]{0,123}$",
        max_length = 133
    )]
    pub after: Option<String>,
    /// Most executions on the page (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
}

/// 200 from `GET /v1/turns/{turn_id}/executions`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecutionPageResponse {
    /// The page, oldest first: at most `limit` executions and at most
    /// 4 MiB (`MAX_EXECUTION_PAGE_BYTES`) of results and errors, but at
    /// least one execution when any follows `after`.
    pub executions: Vec<ExecutionDto>,
    /// Where the next page starts; `null` when this page is the last.
    pub executions_next: Option<String>,
}

/// 200 from a heartbeat.
#[derive(Debug, Serialize, ToSchema)]
pub struct HeartbeatResponse {
    /// Remaining lease on the store's clock after the renewal.
    pub lease_expires_in_ms: i64,
    /// `true` once the turn was asked to stop (`POST /v1/turns/{id}/cancel`):
    /// stop working and end it with `POST /v1/turns/{id}/end-cancelled`.
    pub cancel_requested: bool,
}

/// Body of `POST /v1/turns/{turn_id}/end-cancelled`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EndCancelledRequest {
    /// What the turn had produced when it stopped (say, the reply so far);
    /// stored as its response and replayed to repeats. Default `null`.
    #[serde(default)]
    #[schema(value_type = Option<JsonValue>)]
    pub partial: Value,
    /// Start the head of the session's queue for this caller right after
    /// the ending (the answer's `next`). Default false.
    #[serde(default)]
    pub take_next: bool,
}

/// A claimed execution the caller must now run.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecuteDto {
    /// The execution; complete or fail it when the tool returns.
    pub execution_id: String,
    /// Stable across attempts and takeovers: forward it downstream so the
    /// effect is deduplicated there.
    pub idempotency_key: String,
    /// 1 for the first claim, +1 per re-execution.
    pub attempt: u32,
    /// `null` on a first claim; `failed` after a reported failure; `unknown`
    /// when the previous holder died mid-call and the effect may have
    /// happened (check with the idempotency key before running it again).
    #[schema(required = true)]
    pub previous_outcome: Option<PreviousOutcomeDto>,
}

/// 201 from a tool claim: run the tool.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecuteResponse {
    /// Always true.
    pub execute: bool,
    /// The claimed execution.
    pub execution: ExecuteDto,
}

/// A tool execution that has ended.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecutionResultDto {
    /// The execution.
    pub execution_id: String,
    /// `succeeded` or `failed`.
    pub state: ToolStateDto,
    /// The stored result, when succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
}

/// 200 from a tool claim (`execute: false`: the stored result, do not run
/// the tool) and from a tool completion or failure.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecutionResultResponse {
    /// False on a claim: the tool already succeeded. Absent on completions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub execute: Option<bool>,
    /// The execution.
    pub execution: ExecutionResultDto,
}

/// A tool execution as callers see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecutionDto {
    /// The execution.
    pub execution_id: String,
    /// Its turn.
    pub turn_id: String,
    /// Its tool.
    pub tool: String,
    /// Its state.
    pub state: ToolStateDto,
    /// Attempts so far.
    pub attempt: u32,
    /// Fence of the holder that claimed it last.
    pub fence: i64,
    /// Set when succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Set when failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
}

impl From<ExecutionView> for ExecutionDto {
    fn from(view: ExecutionView) -> Self {
        Self {
            execution_id: view.execution_id.to_string(),
            turn_id: view.turn_id.to_string(),
            tool: view.tool.to_string(),
            state: view.state.into(),
            attempt: view.attempt,
            fence: view.fence.0,
            result: view.result,
            error: view.error,
        }
    }
}

/// A session's live lease holder.
#[derive(Debug, Serialize, ToSchema)]
pub struct HolderDto {
    /// The session held.
    pub session_id: String,
    /// The turn holding it.
    pub turn_id: String,
    /// The holder's fence.
    pub fence: i64,
    /// Remaining lease on the store's clock.
    pub lease_expires_in_ms: i64,
    /// `true` once the holding turn was asked to stop
    /// (`POST /v1/turns/{id}/cancel`, or an `interrupt`): its holder is to
    /// end it, else it is force-released after the cancel grace.
    pub cancel_requested: bool,
}

impl From<HolderView> for HolderDto {
    fn from(view: HolderView) -> Self {
        Self {
            session_id: view.session_id.to_string(),
            turn_id: view.turn_id.to_string(),
            fence: view.fence.0,
            lease_expires_in_ms: view.lease_expires_in_ms,
            cancel_requested: view.cancel_requested,
        }
    }
}

/// A session's pending confirmation.
#[derive(Debug, Serialize, ToSchema)]
pub struct PendingDto {
    /// The turn awaiting confirmation.
    pub turn_id: String,
    /// Remaining time before it expires, on the store's clock.
    pub expires_in_ms: i64,
}

impl From<PendingView> for PendingDto {
    fn from(view: PendingView) -> Self {
        Self {
            turn_id: view.turn_id.to_string(),
            expires_in_ms: view.expires_in_ms,
        }
    }
}

/// A session as callers see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct SessionDto {
    /// The session.
    pub session_id: String,
    /// The user it is bound to.
    pub user_id: String,
    /// The live holder, if any.
    #[schema(required = true)]
    pub holder: Option<HolderDto>,
    /// The live pending confirmation, if any.
    #[schema(required = true)]
    pub pending_confirmation: Option<PendingDto>,
    /// Latest fence granted on this session.
    pub fence: i64,
    /// The turns waiting in its queue, head first (at most 100).
    pub queue: Vec<QueueEntryDto>,
    /// Its default busy policy (`PUT /v1/sessions/{id}/policy`); `null`
    /// when never set, which means `reject`.
    #[schema(required = true)]
    pub default_policy: Option<SessionPolicyDto>,
}

impl From<SessionView> for SessionDto {
    fn from(view: SessionView) -> Self {
        Self {
            session_id: view.session_id.to_string(),
            user_id: view.user_id.to_string(),
            holder: view.holder.map(HolderDto::from),
            pending_confirmation: view.pending_confirmation.map(PendingDto::from),
            fence: view.fence.0,
            queue: view
                .queue
                .into_iter()
                .map(|entry| QueueEntryDto {
                    turn_id: entry.turn_id.to_string(),
                    client_request_id: entry.client_request_id.to_string(),
                    position: entry.position,
                    enqueued_at_ms: entry.enqueued_at_ms,
                })
                .collect(),
            default_policy: view.default_on_busy.map(SessionPolicyDto::from),
        }
    }
}

/// 200 from `GET /v1/sessions/{session_id}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct SessionResponse {
    /// The session.
    pub session: SessionDto,
}

/// Answer of `POST /v1/sessions/{session_id}/release`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReleaseResponse {
    /// The turn that held the session, now ended `abandoned` (error code
    /// `released`); `null` when the session had no holder.
    pub released: Option<TurnDto>,
}

/// A user as callers see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct UserDto {
    /// The user.
    pub user_id: String,
    /// The cap in force: the user's override, else the server default.
    pub max_turns_per_user: u32,
    /// Live leases (permits in use).
    pub live_turns: u32,
    /// The live holders.
    pub holders: Vec<HolderDto>,
}

impl From<UserView> for UserDto {
    fn from(view: UserView) -> Self {
        Self {
            user_id: view.user_id.to_string(),
            max_turns_per_user: view.max_turns_per_user,
            live_turns: view.live_turns,
            holders: view.holders.into_iter().map(HolderDto::from).collect(),
        }
    }
}

/// 200 from `GET /v1/users/{user_id}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct UserResponse {
    /// The user.
    pub user: UserDto,
}

/// `GET /healthz` and `GET /readyz`: 200 when every dependency is up, 503
/// (with `Retry-After` and `error`) when one is down.
#[derive(Debug, Serialize, ToSchema)]
pub struct HealthResponse {
    /// `ok` (200) when every dependency is up, else `unavailable` (503).
    pub status: String,
    /// Each dependency by name: `store` always, `redis` when the Redis
    /// lease layer is configured.
    pub dependencies: std::collections::BTreeMap<String, DependencyHealth>,
    /// On a 503: the usual error, `store_unavailable` naming what is down,
    /// with `retry_after_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<crate::error::ErrorDetail>,
}

/// One dependency's state.
#[derive(Debug, Serialize, ToSchema)]
pub struct DependencyHealth {
    /// `up` or `down`.
    pub status: String,
    /// How long its probe took, in milliseconds.
    pub latency_ms: u32,
    /// When down: `error` (it answered with an error) or `timeout` (it did
    /// not answer within the probe timeout).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

// ---------------------------------------------------------------- orphans

/// Body of `POST /v1/orphans/claim`; every field optional.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimOrphanRequest {
    /// Only orphans whose lease has been dead at least this long, so a
    /// client's own retry comes first (0: any orphan).
    #[serde(default, deserialize_with = "min_orphaned_ms")]
    #[schema(minimum = 0, maximum = 2_592_000_000_u64)]
    pub min_orphaned_ms: u64,
    /// Only orphans of these users (absent or empty: any user); at most 100.
    #[serde(default)]
    #[schema(value_type = Vec<Id>, max_items = 100)]
    pub user_ids: Vec<String>,
    /// Only these turns (absent or empty: any turn); at most 100. A service
    /// sharing the store resumes only the turns it started.
    #[serde(default)]
    #[schema(value_type = Vec<Id>, max_items = 100)]
    pub turn_ids: Vec<String>,
}

/// A non-negative integer as JSON Schema's `integer` means it: any number
/// with no fractional part, so `17088.0` is `17088` (serde's `u64` refuses
/// it). The range is checked by the engine.
fn whole(field: &str, number: &serde_json::Number) -> Result<u64, String> {
    if let Some(whole) = number.as_u64() {
        return Ok(whole);
    }
    match number.as_f64() {
        // Below 2^53 (I-JSON has refused anything larger), so exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(float) if float.fract() == 0.0 && float >= 0.0 => Ok(float as u64),
        _ => Err(format!(
            "{field} is {number}, not a non-negative whole number"
        )),
    }
}

/// `min_orphaned_ms` by [`whole`].
fn min_orphaned_ms<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    whole("min_orphaned_ms", &serde_json::Number::deserialize(d)?).map_err(serde::de::Error::custom)
}

/// `wait_ms` by [`whole`]; `null` is absent.
fn wait_ms<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<serde_json::Number>::deserialize(d)?
        .map(|number| whole("wait_ms", &number))
        .transpose()
        .map_err(serde::de::Error::custom)
}

/// What became of one tool execution of a claimed orphan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JournalOutcomeDto {
    /// Done: a claim of the same call returns `result` without running it.
    Succeeded,
    /// Reported failure: a claim runs it again.
    Failed,
    /// Its holder died mid-call; it may have taken effect. A claim runs it
    /// again with `previous_outcome: "unknown"`: reconcile before acting.
    Unknown,
}

/// One tool execution of a claimed orphan.
#[derive(Debug, Serialize, ToSchema)]
pub struct JournalEntryDto {
    /// The execution.
    pub execution_id: String,
    /// Its tool.
    pub tool: String,
    /// Attempts so far.
    pub attempt: u32,
    /// What became of it.
    pub outcome: JournalOutcomeDto,
    /// For `succeeded`: the stored result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// For `failed`: the stored error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
}

impl From<agentgate::JournalEntry> for JournalEntryDto {
    fn from(entry: agentgate::JournalEntry) -> Self {
        use agentgate::JournalOutcome;
        let (outcome, result, error) = match entry.outcome {
            JournalOutcome::Succeeded { result } => {
                (JournalOutcomeDto::Succeeded, Some(result), None)
            }
            JournalOutcome::Failed { error } => (JournalOutcomeDto::Failed, None, Some(error)),
            JournalOutcome::Unknown => (JournalOutcomeDto::Unknown, None, None),
        };
        Self {
            execution_id: entry.execution_id.to_string(),
            tool: entry.tool.to_string(),
            attempt: entry.attempt,
            outcome,
            result,
            error,
        }
    }
}

/// 201 from `POST /v1/orphans/claim`: the orphan, taken over.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClaimOrphanResponse {
    /// The new lease (`takeover: true`, higher fence, `attempt + 1`); use its
    /// `lease_token` like a begin's.
    pub turn: GrantDto,
    /// The original request's payload, to resume from.
    pub payload: Value,
    /// The turn's tool executions before the takeover, oldest first: the
    /// first page (at most 50, and at most 4 MiB of results, but always
    /// one when there is one).
    pub journal: Vec<JournalEntryDto>,
    /// The cursor of the journal's next page, for `GET
    /// /v1/turns/{turn_id}/executions?after=`; `null` when `journal` is
    /// whole.
    pub journal_next: Option<String>,
    /// How long the turn had been without a live lease.
    pub orphaned_for_ms: i64,
}

/// One event of `POST /v1/turns/{turn_id}/events`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EventDto {
    /// Its name, the SSE `event:` of its readers: 1 to 64 ASCII letters,
    /// digits, `_`, `-`, `.` or `:`; not `end` or `error`, which the stream
    /// itself sends (400 `invalid_request`).
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.:-]{1,64}$")]
    pub event: String,
    /// Its data: any JSON (I-JSON), at most 64 KiB canonical.
    #[schema(value_type = JsonValue)]
    pub data: Value,
}

/// Body of `POST /v1/turns/{turn_id}/events`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AppendEventsRequest {
    /// The events, in order: 1 to 500.
    #[schema(min_items = 1, max_items = 500)]
    pub events: Vec<EventDto>,
}

impl AppendEventsRequest {
    /// The engine's events.
    ///
    /// # Errors
    /// `invalid_request` for a bad name or data (the batch's own bounds are
    /// the store step's).
    pub fn to_engine(&self) -> agentgate::Result<Vec<agentgate::model::NewEvent>> {
        if self.events.len() > agentgate::limits::MAX_EVENT_BATCH {
            return Err(agentgate::Error::invalid(format!(
                "an append carries at most {} events",
                agentgate::limits::MAX_EVENT_BATCH
            )));
        }
        self.events
            .iter()
            .map(|event| agentgate::model::NewEvent::new(&event.event, &event.data))
            .collect()
    }
}

/// 200 from `POST /v1/turns/{turn_id}/events`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AppendEventsResponse {
    /// The id of the last event appended.
    pub last_event_id: u64,
}

/// What a follower's going away does to the turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnDisconnectDto {
    /// Nothing: the turn runs on (the default).
    Continue,
    /// Ask the turn to stop (a cancel request) when this stream's client
    /// goes away before the end.
    Cancel,
}

/// Query of `GET /v1/turns/{turn_id}/events`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Resume after this event id (0: from the first), at most 20,000
    /// (`MAX_TURN_EVENTS`: no turn has an event past it; more is 400).
    /// `Last-Event-ID` wins when both are sent.
    #[serde(default)]
    #[param(minimum = 0, maximum = 20_000)]
    pub after: Option<u64>,
    /// As for the other reads: a turn of another user is `not_found`.
    #[param(value_type = Option<Id>)]
    #[serde(default, deserialize_with = "valid_user_id")]
    pub user_id: Option<String>,
    /// `continue` (default) or `cancel`.
    #[serde(default)]
    #[param(inline)]
    pub on_disconnect: Option<OnDisconnectDto>,
}
