//! The records of the turn protocol and the views handed to callers.
//!
//! Commands (`BeginCommand`, `ToolCall`, `Ending`) are validated before a store
//! sees them: ids are checked, JSON is canonical and within limits. Views
//! never contain a lease token; times in views are store-clock milliseconds.

use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical::{CanonicalJson, Digest};
use crate::error::{Error, Result};
use crate::ids::{
    ClientRequestId, ExecutionId, Fence, LeaseToken, SessionId, ToolName, TurnId, UserId,
};

macro_rules! wire_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vdoc])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The name stored and sent on the wire.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }

        impl FromStr for $name {
            type Err = Error;
            fn from_str(text: &str) -> Result<Self> {
                match text {
                    $($text => Ok(Self::$variant),)+
                    other => Err(Error::store(format!(concat!("unknown ", stringify!($name), " {:?} in store"), other))),
                }
            }
        }
    };
}

wire_enum!(
    /// Where a turn is in its life.
    TurnState {
        /// Under a lease (live, or dead and waiting for a takeover).
        Running => "running",
        /// Ended with a response; repeats replay it.
        Succeeded => "succeeded",
        /// Ended with an error; retryable ones restart on a repeat.
        Failed => "failed",
        /// Ended waiting for a person to approve or reject `pending`.
        AwaitingConfirmation => "awaiting_confirmation",
        /// Was awaiting confirmation; a continuation turn took the decision.
        Confirmed => "confirmed",
        /// Orphaned (its lease expired without an ending) and claimed by no
        /// one within the orphan grace: ended by the sweeper, its session
        /// and permit released. A repeat of its request restarts it.
        Abandoned => "abandoned",
        /// Asked to stop, and ended so by its holder, with what it had done
        /// so far; a repeat of its request replays it (a person who stopped
        /// a reply does not want it run again by a retry).
        Cancelled => "cancelled",
        /// Waiting in its session's queue (`on_busy: enqueue`): no lease,
        /// no attempt yet. It starts when it is the head of the queue and
        /// the session is free: handed to the previous holder's caller
        /// ([`crate::store::Store::take_next`]), a repeat of its request,
        /// or a recovery worker's claim.
        Queued => "queued",
        /// Replaced, before it started, by a newer message sent with
        /// `on_busy: supersede`; a repeat of its request replays it.
        Superseded => "superseded",
    }
);

wire_enum!(
    /// Where a tool execution is in its life.
    ToolState {
        /// Claimed for execution by the holder of `fence`.
        Running => "running",
        /// Done; its result is returned to every later claim.
        Succeeded => "succeeded",
        /// Failed; the next claim executes it again.
        Failed => "failed",
    }
);

wire_enum!(
    /// What became of the previous attempt of a tool execution.
    PreviousOutcome {
        /// It reported failure.
        Failed => "failed",
        /// Its holder died mid-call: it may or may not have taken effect.
        Unknown => "unknown",
    }
);

wire_enum!(
    /// A person's answer to a pending confirmation.
    Decision {
        /// Go ahead with the pending action.
        Approve => "approve",
        /// Drop it.
        Reject => "reject",
    }
);

wire_enum!(
    /// What a begin does when its session is held by another turn.
    BusyPolicy {
        /// Refuse at once with `session_busy` (the default).
        Reject => "reject",
        /// Wait, up to a bound, for the session to come free, woken by the
        /// store's release notification, then start.
        Wait => "wait",
        /// Ask the running turn to stop (a cancel request), wait for it to
        /// end, up to a bound, then start.
        Interrupt => "interrupt",
        /// Join the session's durable FIFO queue (bounded,
        /// [`crate::limits::MAX_SESSION_QUEUE`]) and answer at once with the
        /// queued turn and its position.
        Enqueue => "enqueue",
        /// Join the queue as [`BusyPolicy::Enqueue`], and end every turn
        /// queued before it, unstarted, `superseded`.
        Supersede => "supersede",
    }
);

/// What a begin on a busy session asks the store to queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueMode {
    /// Append the turn to the session's queue.
    Enqueue,
    /// Append it, and supersede every turn queued before it.
    Supersede,
}

impl BusyPolicy {
    /// The queue mode this policy asks the store for (`None`: the policy
    /// never queues).
    pub fn queue_mode(self) -> Option<QueueMode> {
        match self {
            Self::Enqueue => Some(QueueMode::Enqueue),
            Self::Supersede => Some(QueueMode::Supersede),
            Self::Reject | Self::Wait | Self::Interrupt => None,
        }
    }
}

/// A begin's policy for a busy session, with its bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnBusy {
    /// What to do.
    pub policy: BusyPolicy,
    /// How long `wait` and `interrupt` wait at most; zero for `reject`.
    pub wait: std::time::Duration,
    /// `supersede` only: also ask the running turn to stop once this
    /// request is queued, so the newest message runs next and soon (a
    /// correction typed mid-reply).
    pub interrupt: bool,
}

impl OnBusy {
    /// Refuse a busy session at once.
    pub const REJECT: Self = Self {
        policy: BusyPolicy::Reject,
        wait: std::time::Duration::ZERO,
        interrupt: false,
    };

    /// Validates a policy and its bound: `wait_ms` defaults to
    /// [`crate::limits::DEFAULT_BUSY_WAIT`] for `wait` and `interrupt`.
    ///
    /// # Errors
    /// `invalid_request` for a bound over
    /// [`crate::limits::MAX_BUSY_WAIT`], or any bound with `reject`.
    pub fn new(policy: BusyPolicy, wait_ms: Option<u64>) -> Result<Self> {
        let max = crate::limits::MAX_BUSY_WAIT;
        let wait = match (policy, wait_ms) {
            (BusyPolicy::Reject | BusyPolicy::Enqueue | BusyPolicy::Supersede, None) => {
                std::time::Duration::ZERO
            }
            (BusyPolicy::Reject | BusyPolicy::Enqueue | BusyPolicy::Supersede, Some(_)) => {
                return Err(Error::invalid(format!(
                    "wait_ms applies to the wait and interrupt policies, not {}",
                    policy.as_str()
                )))
            }
            (_, None) => crate::limits::DEFAULT_BUSY_WAIT,
            (_, Some(ms)) if u128::from(ms) > max.as_millis() => {
                return Err(Error::invalid(format!(
                    "wait_ms is {ms}, the limit is {}",
                    max.as_millis()
                )))
            }
            (_, Some(ms)) => std::time::Duration::from_millis(ms),
        };
        Ok(Self {
            policy,
            wait,
            interrupt: false,
        })
    }

    /// This `supersede` policy, also interrupting the running turn.
    ///
    /// # Errors
    /// `invalid_request` for any other policy: `interrupt` stops the
    /// holder by itself, and the others never stop a running turn.
    pub fn interrupting(self) -> Result<Self> {
        if self.policy != BusyPolicy::Supersede {
            return Err(Error::invalid(format!(
                "interrupt_running applies to the supersede policy, not {}",
                self.policy.as_str()
            )));
        }
        Ok(Self {
            interrupt: true,
            ..self
        })
    }
}

impl Default for OnBusy {
    fn default() -> Self {
        Self::REJECT
    }
}

/// A begin that answers a pending confirmation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Confirmation {
    /// The turn that is awaiting confirmation.
    pub turn_id: TurnId,
    /// Approve or reject.
    pub decision: Decision,
}

/// A validated request to begin a turn.
#[derive(Clone, Debug)]
pub struct BeginCommand {
    /// Who the turn runs for.
    pub user_id: UserId,
    /// The conversation.
    pub session_id: SessionId,
    /// The client's id for this message.
    pub client_request_id: ClientRequestId,
    /// The message, canonical.
    pub payload: CanonicalJson,
    /// Set when this begin answers a pending confirmation.
    pub confirmation: Option<Confirmation>,
    /// SHA-256 over payload and confirmation: a repeat must match it.
    pub fingerprint: Digest,
    /// Set by a recovery worker's claim ([`Orphan::resume_command`]): the
    /// begin may only take over a turn that is still `running`; a turn that
    /// ended meanwhile (even retryably, or `abandoned`) replays instead of
    /// restarting, so a stale orphan list never re-runs an ended turn.
    pub resume_only: bool,
    /// Set by a begin under `on_busy: enqueue` or `supersede`: a busy
    /// session queues the request instead of refusing it.
    pub queue: Option<QueueMode>,
}

impl BeginCommand {
    /// The same begin, queued when its session is busy.
    #[must_use]
    pub fn queued(mut self, queue: Option<QueueMode>) -> Self {
        self.queue = queue;
        self
    }

    /// Validates a begin. The fingerprint covers the payload and the
    /// confirmation, so the same request id with another decision is a mismatch.
    ///
    /// # Errors
    /// `invalid_request` when the payload is over the JSON limits or not
    /// I-JSON (an integer beyond ±(2^53−1)).
    pub fn new(
        user_id: UserId,
        session_id: SessionId,
        client_request_id: ClientRequestId,
        payload: &Value,
        confirmation: Option<Confirmation>,
    ) -> Result<Self> {
        crate::canonical::check_i_json("payload", payload)?;
        // The limits are the payload's own: checked on it, not on the
        // wrapper the fingerprint hashes (one level deeper, a few bytes
        // longer), which made a payload exactly at the depth limit fail.
        let canonical = CanonicalJson::new("payload", payload)?;
        let fingerprint = crate::canonical::digest_unchecked(
            &serde_json::json!({ "payload": payload, "confirmation": confirmation }),
        )?;
        let payload = canonical;
        Ok(Self {
            user_id,
            session_id,
            client_request_id,
            payload,
            confirmation,
            fingerprint,
            resume_only: false,
            queue: None,
        })
    }
}

/// The proof a post-grant call carries: which turn, and its secret token.
#[derive(Clone, Debug)]
pub struct LeaseRef {
    /// The turn the lease was granted to.
    pub turn_id: TurnId,
    /// The lease's secret.
    pub token: LeaseToken,
}

/// What a confirmation turn carries over from the turn it answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfirmationContext {
    /// The turn that awaited confirmation.
    pub turn_id: TurnId,
    /// The person's decision.
    pub decision: Decision,
    /// The pending action that turn recorded.
    pub pending: Value,
}

/// A granted lease on a session, with the turn it runs.
#[derive(Clone, Debug)]
pub struct Grant {
    /// The turn.
    pub turn_id: TurnId,
    /// Its session.
    pub session_id: SessionId,
    /// Its user.
    pub user_id: UserId,
    /// Its request id.
    pub client_request_id: ClientRequestId,
    /// The secret; only the holder ever sees it.
    pub lease_token: LeaseToken,
    /// This grant's fence.
    pub fence: Fence,
    /// 1 for the first start, +1 per takeover or restart.
    pub attempt: u32,
    /// Whether this start took over a running turn whose lease expired.
    pub takeover: bool,
    /// Remaining lease on the store's clock when granted.
    pub lease_expires_in_ms: i64,
    /// Present on a confirmation turn.
    pub confirmation: Option<ConfirmationContext>,
}

impl Grant {
    /// The grant of a new turn's first attempt (no takeover, no
    /// confirmation) under `fence`, for a lease of `lease_ttl_ms`: what a
    /// store's one-statement begin hands out.
    pub fn first(
        command: &BeginCommand,
        turn_id: TurnId,
        lease_token: LeaseToken,
        fence: Fence,
        lease_ttl_ms: i64,
    ) -> Self {
        Self {
            turn_id,
            session_id: command.session_id.clone(),
            user_id: command.user_id.clone(),
            client_request_id: command.client_request_id.clone(),
            lease_token,
            fence,
            attempt: 1,
            takeover: false,
            lease_expires_in_ms: lease_ttl_ms,
            confirmation: None,
        }
    }
}

/// What `begin` did.
#[derive(Clone, Debug)]
pub enum BeginOutcome {
    /// A lease was granted; run the turn.
    Started(Grant),
    /// The request already ended; here is its stored outcome. No lease taken.
    Replay(TurnView),
    /// The request waits in its session's queue (queued now, or by an
    /// earlier begin of the same request). No lease taken.
    Queued(QueuedTurn),
}

/// A turn waiting in its session's queue, as a begin answers it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedTurn {
    /// The queued turn.
    pub turn_id: TurnId,
    /// Its session.
    pub session_id: SessionId,
    /// Its user.
    pub user_id: UserId,
    /// Its request id.
    pub client_request_id: ClientRequestId,
    /// 1 for the head of the queue, gap-free behind it.
    pub position: u32,
    /// Store-clock time it was queued, ms since the Unix epoch.
    pub enqueued_at_ms: i64,
    /// When to look again: the holder's remaining lease (the queue moves
    /// at the latest then), at least 1 ms.
    #[serde(skip)]
    pub retry_after: std::time::Duration,
}

/// An event a turn's holder appends to the turn's log (docs/protocol.md §9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewEvent {
    /// Its name: an SSE `event:` token ([`NewEvent::new`] checks it).
    pub name: String,
    /// Its data, canonical JSON (I-JSON, as every payload).
    pub data: CanonicalJson,
}

/// Event names a turn's stream itself sends (`GET /v1/turns/{id}/events`
/// ends with `end`, or `error` when the read fails), so no appended event
/// may take them: a reader could not tell a holder's `end` from the
/// stream's.
pub const RESERVED_EVENT_NAMES: [&str; 2] = ["end", "error"];

impl NewEvent {
    /// Validates an event: a name of 1 to
    /// [`crate::limits::MAX_EVENT_NAME_BYTES`] bytes of ASCII letters,
    /// digits, `_`, `-`, `.` or `:` (it becomes an SSE line, so nothing
    /// that could end one), not one of [`RESERVED_EVENT_NAMES`], and data of at most
    /// [`crate::limits::MAX_EVENT_DATA_BYTES`] canonical bytes.
    ///
    /// # Errors
    /// `invalid_request` for a bad name, data that is not I-JSON, or data
    /// over its limit.
    pub fn new(name: &str, data: &serde_json::Value) -> Result<Self> {
        let max = crate::limits::MAX_EVENT_NAME_BYTES;
        let token = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
        if name.is_empty() || name.len() > max || !name.chars().all(token) {
            return Err(Error::invalid(format!(
                "an event name is 1 to {max} letters, digits, '_', '-', '.' or ':'"
            )));
        }
        if RESERVED_EVENT_NAMES.contains(&name) {
            return Err(Error::invalid(format!(
                "the event name {name:?} is reserved: the stream itself sends it"
            )));
        }
        let data = CanonicalJson::new("event data", data)?;
        let limit = crate::limits::MAX_EVENT_DATA_BYTES;
        if data.as_str().len() > limit {
            return Err(Error::invalid(format!(
                "event data is {} bytes, the limit is {limit}",
                data.as_str().len()
            )));
        }
        Ok(Self {
            name: name.to_owned(),
            data,
        })
    }

    /// The bytes it counts against its turn's limit.
    pub fn size(&self) -> u64 {
        (self.name.len() + self.data.as_str().len()) as u64
    }
}

/// An event of a turn's log, as readers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnEvent {
    /// Its id: 1 for the turn's first event, then one more each; never
    /// reused, so a reader resumes after the last id it saw.
    pub event_id: u64,
    /// The attempt of the turn whose holder appended it (a takeover's
    /// events carry the new attempt).
    pub attempt: u32,
    /// Its name.
    pub name: String,
    /// Its data, canonical JSON text.
    pub data: String,
}

/// A page of a turn's events after an id, with the turn's state read
/// before them: when that state is an ending, no event follows the page's
/// last one unless the page was full.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventPage {
    /// The turn's state, read before the events.
    pub state: TurnState,
    /// Its attempt, read with the state.
    pub attempt: u32,
    /// The events after the asked id, in id order, at most the page size.
    pub events: Vec<TurnEvent>,
}

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

/// A validated tool call: the execution key within a turn.
#[derive(Clone, Debug)]
pub struct ToolCall {
    /// The tool.
    pub tool: ToolName,
    /// SHA-256 of the canonical args.
    pub args_hash: Digest,
}

impl ToolCall {
    /// Validates a tool call and hashes its args.
    ///
    /// # Errors
    /// `invalid_request` when the args are over the JSON limits or not
    /// I-JSON (an integer beyond ±(2^53−1)).
    pub fn new(tool: ToolName, args: &Value) -> Result<Self> {
        crate::canonical::check_i_json("args", args)?;
        Ok(Self {
            tool,
            args_hash: crate::canonical::digest("args", args)?,
        })
    }
}

/// The answer to a tool claim.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolClaim {
    /// Run the tool, then complete or fail the execution.
    Execute {
        /// The execution.
        execution_id: ExecutionId,
        /// Stable across attempts: forward it downstream for deduplication.
        idempotency_key: String,
        /// 1 for the first claim, +1 per re-execution.
        attempt: u32,
        /// Set when an earlier attempt failed or died mid-call.
        previous_outcome: Option<PreviousOutcome>,
    },
    /// Already succeeded: here is its stored result. Do not run it.
    Cached {
        /// The execution.
        execution_id: ExecutionId,
        /// The stored result.
        result: Value,
    },
}

/// How a turn ends.
#[derive(Clone, Debug)]
pub enum Ending {
    /// With a response that repeats replay.
    Succeed {
        /// The response.
        response: CanonicalJson,
    },
    /// With an error; `retryable` lets a repeat restart it.
    Fail {
        /// The error.
        error: CanonicalJson,
        /// Whether a repeat of the request restarts the turn.
        retryable: bool,
    },
    /// Waiting for a person to approve `pending`.
    AwaitConfirmation {
        /// What the person is asked to approve.
        pending: CanonicalJson,
    },
    /// Stopped at a cancel request, with what it had produced so far
    /// (stored as its response, replayed to a repeat).
    Cancel {
        /// The partial response.
        partial: CanonicalJson,
    },
}

/// How a tool execution ends: the state it ends in, and the value its
/// column keeps, as every SQL store stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecutionEnding<'a> {
    /// Succeeded with this result (the `result` column).
    Succeeded(&'a CanonicalJson),
    /// Failed with this error (the `error` column).
    Failed(&'a CanonicalJson),
}

impl<'a> ExecutionEnding<'a> {
    /// The state it ends in, the column its value goes to, and the value.
    pub fn columns(self) -> (&'static str, &'static str, &'a CanonicalJson) {
        match self {
            Self::Succeeded(result) => ("succeeded", "result", result),
            Self::Failed(error) => ("failed", "error", error),
        }
    }
}

/// The columns an ending writes on its turn row, as every SQL store stores
/// them (one mapping, not one per store).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndingColumns<'a> {
    /// The turn's new state, as stored.
    pub state: &'static str,
    /// The response, for a success.
    pub response: Option<&'a str>,
    /// The error, for a failure.
    pub error: Option<&'a str>,
    /// Whether a repeat restarts it, for a failure.
    pub retryable: Option<bool>,
    /// The action awaiting a person, for a pending confirmation.
    pub pending: Option<&'a str>,
}

impl Ending {
    /// The columns this ending writes.
    pub fn columns(&self) -> EndingColumns<'_> {
        let none = EndingColumns {
            state: "",
            response: None,
            error: None,
            retryable: None,
            pending: None,
        };
        match self {
            Ending::Succeed { response } => EndingColumns {
                state: TurnState::Succeeded.as_str(),
                response: Some(response.as_str()),
                ..none
            },
            Ending::Fail { error, retryable } => EndingColumns {
                state: TurnState::Failed.as_str(),
                error: Some(error.as_str()),
                retryable: Some(*retryable),
                ..none
            },
            Ending::AwaitConfirmation { pending } => EndingColumns {
                state: TurnState::AwaitingConfirmation.as_str(),
                pending: Some(pending.as_str()),
                ..none
            },
            Ending::Cancel { partial } => EndingColumns {
                state: TurnState::Cancelled.as_str(),
                response: Some(partial.as_str()),
                ..none
            },
        }
    }
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

/// The idempotency key handed to a tool for an execution: stable across
/// attempts and takeovers because it derives from the execution's key.
pub fn idempotency_key(turn_id: &TurnId, call: &ToolCall) -> String {
    use sha2::{Digest as _, Sha256};
    let mut hasher = Sha256::new();
    for part in [
        turn_id.as_str(),
        call.tool.as_str(),
        call.args_hash.as_hex(),
    ] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    format!("agk_{}", hex::encode(&hasher.finalize()[..16]))
}

/// Which orphans a recovery worker takes. The default takes any orphan.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrphanFilter {
    /// Only orphans whose lease has been dead at least this long (store
    /// clock). A worker that wants the client's own retry to come first
    /// waits a few seconds here.
    #[serde(default)]
    pub min_orphaned_ms: u64,
    /// Only orphans of these users (empty: every user); at most
    /// [`crate::limits::MAX_ORPHAN_FILTER_IDS`].
    #[serde(default)]
    pub user_ids: Vec<UserId>,
    /// Only these turns (empty: any turn); at most
    /// [`crate::limits::MAX_ORPHAN_FILTER_IDS`]. An application sharing the
    /// store with other callers resumes only the turns it started.
    #[serde(default)]
    pub turn_ids: Vec<TurnId>,
}

impl OrphanFilter {
    /// Checks the filter against its limits.
    ///
    /// # Errors
    /// `invalid_request` for too many users or an age over the longest lease
    /// retention.
    pub fn validate(&self) -> Result<()> {
        use crate::limits::{MAX_ORPHAN_FILTER_IDS, MAX_RETENTION};
        for (what, count) in [
            ("users", self.user_ids.len()),
            ("turns", self.turn_ids.len()),
        ] {
            if count > MAX_ORPHAN_FILTER_IDS {
                return Err(Error::invalid(format!(
                    "an orphan filter names {count} {what}, the limit is {MAX_ORPHAN_FILTER_IDS}"
                )));
            }
        }
        if u128::from(self.min_orphaned_ms) > MAX_RETENTION.as_millis() {
            return Err(Error::invalid(format!(
                "min_orphaned_ms is {}, the limit is {}",
                self.min_orphaned_ms,
                MAX_RETENTION.as_millis()
            )));
        }
        Ok(())
    }
}

/// A running turn whose lease is gone without an ending, as a store lists
/// it: what a recovery worker needs to take it over and resume it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Orphan {
    /// The turn.
    pub turn_id: TurnId,
    /// Its session.
    pub session_id: SessionId,
    /// Its user.
    pub user_id: UserId,
    /// Its request id.
    pub client_request_id: ClientRequestId,
    /// Its payload fingerprint: the takeover is a repeat of the request.
    pub fingerprint: Digest,
    /// The request's payload, canonical (`None` for a turn recorded before
    /// payloads were kept).
    pub payload: Option<CanonicalJson>,
    /// The fence of the grant that died.
    pub fence: Fence,
    /// Attempts so far.
    pub attempt: u32,
    /// Since when the turn has had no live lease (store clock, ms since the
    /// epoch): the lease's expiry, or when a sweep first saw it unheld where
    /// the lease layer keeps no expiry.
    pub orphaned_since_ms: i64,
    /// How long that was before the store's now when listed.
    pub orphaned_for_ms: i64,
    /// A newer grant holds (or held) its session: the person moved on to
    /// another message. Recovery workers leave it (resuming it would answer
    /// an older message after a newer one); its own client's repeat may
    /// still restart it, and the sweeper abandons it after the grace.
    pub superseded: bool,
}

impl Orphan {
    /// The begin that takes this orphan over: a repeat of its own request,
    /// so the store decides it exactly as docs/protocol.md §3.1 decides a client's retry.
    pub fn resume_command(&self) -> BeginCommand {
        BeginCommand {
            user_id: self.user_id.clone(),
            session_id: self.session_id.clone(),
            client_request_id: self.client_request_id.clone(),
            payload: self
                .payload
                .clone()
                .unwrap_or_else(|| CanonicalJson::from_stored("null")),
            confirmation: None,
            fingerprint: self.fingerprint.clone(),
            resume_only: true,
            queue: None,
        }
    }
}

/// What became of a tool execution of a claimed orphan, as its journal says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum JournalOutcome {
    /// Done; a claim of the same call returns this result without running it.
    Succeeded {
        /// The stored result.
        result: Value,
    },
    /// Reported failure; a claim runs it again.
    Failed {
        /// The stored error.
        error: Value,
    },
    /// Its holder died mid-call: it may or may not have taken effect. A
    /// claim runs it again with `previous_outcome: "unknown"`.
    Unknown,
}

/// One tool execution of a claimed orphan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// The execution.
    pub execution_id: ExecutionId,
    /// Its tool.
    pub tool: ToolName,
    /// Attempts so far.
    pub attempt: u32,
    /// What became of it.
    #[serde(flatten)]
    pub outcome: JournalOutcome,
}

impl JournalEntry {
    /// The journal entry of an execution read after the takeover.
    ///
    /// # Errors
    /// `store_unavailable` (corrupt) for a succeeded execution without a
    /// result.
    pub fn from_view(view: ExecutionView) -> Result<Self> {
        let outcome = match view.state {
            ToolState::Succeeded => JournalOutcome::Succeeded {
                result: view
                    .result
                    .ok_or_else(|| Error::corrupt("a succeeded execution has no result"))?,
            },
            ToolState::Failed => JournalOutcome::Failed {
                error: view.error.unwrap_or(Value::Null),
            },
            ToolState::Running => JournalOutcome::Unknown,
        };
        Ok(Self {
            execution_id: view.execution_id,
            tool: view.tool,
            attempt: view.attempt,
            outcome,
        })
    }
}

/// An orphan taken over by a recovery worker: a live lease on it, and what
/// resuming it needs.
#[derive(Clone, Debug)]
pub struct ClaimedOrphan {
    /// The new lease: a fresh token, a higher fence, `attempt + 1`,
    /// `takeover: true` (or a restart, if it was abandoned meanwhile).
    pub grant: Grant,
    /// The original request's payload (`null` if the turn predates kept
    /// payloads).
    pub payload: Value,
    /// The turn's tool executions, oldest first: all of them, or the first
    /// page ([`crate::store::Store::claim_orphan_first_page`]).
    pub journal: Vec<JournalEntry>,
    /// Where the journal's next page starts (`Store::executions`); `None`
    /// when `journal` is whole.
    pub journal_next: Option<crate::page::ExecutionCursor>,
    /// How long the turn had been without a live lease when claimed.
    pub orphaned_for_ms: i64,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::limits::{MAX_JSON_BYTES, MAX_JSON_DEPTH};

    #[test]
    fn the_streams_own_event_names_are_reserved() {
        for name in RESERVED_EVENT_NAMES {
            let refused = NewEvent::new(name, &json!({})).unwrap_err();
            assert!(refused.to_string().contains("reserved"), "{refused}");
        }
        assert!(NewEvent::new("ending", &json!({})).is_ok());
        assert!(NewEvent::new("token", &json!({})).is_ok());
    }

    fn begin(payload: &Value) -> Result<BeginCommand> {
        BeginCommand::new(
            UserId::new("u").unwrap(),
            SessionId::new("s").unwrap(),
            ClientRequestId::new("r").unwrap(),
            payload,
            None,
        )
    }

    #[test]
    fn a_payload_at_the_json_limits_begins_and_one_past_them_does_not() {
        // The fingerprint wraps the payload in an object; the limits must
        // apply to the payload alone (schema fuzzing found 63 levels
        // accepted where 64 were documented).
        let nested = |levels: usize| (0..levels).fold(json!(1), |inner, _| json!([inner]));
        assert!(begin(&nested(MAX_JSON_DEPTH)).is_ok());
        let deep = begin(&nested(MAX_JSON_DEPTH + 1)).unwrap_err();
        assert_eq!(deep.kind(), crate::ErrorKind::InvalidRequest);
        // A string of n bytes is n + 2 canonical bytes.
        assert!(begin(&json!("a".repeat(MAX_JSON_BYTES - 2))).is_ok());
        let large = begin(&json!("a".repeat(MAX_JSON_BYTES - 1))).unwrap_err();
        assert_eq!(large.kind(), crate::ErrorKind::InvalidRequest);
    }

    #[test]
    fn the_fingerprint_is_the_digest_of_payload_and_confirmation_as_before() {
        // Stored turns keep their fingerprints: a repeat after an upgrade
        // must still match.
        let payload = json!({"text": "记账", "n": [1, 2.5]});
        let command = begin(&payload).unwrap();
        let wrapped = json!({"payload": payload, "confirmation": null});
        assert_eq!(
            command.fingerprint,
            crate::canonical::digest("payload", &wrapped).unwrap()
        );
        assert_eq!(
            command.fingerprint.as_hex(),
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
                r#"{"confirmation":null,"payload":{"n":[1,2.5],"text":"记账"}}"#.as_bytes()
            ))
        );
    }

    fn canonical(value: serde_json::Value) -> CanonicalJson {
        CanonicalJson::new("test", &value).expect("canonical")
    }

    #[test]
    fn each_ending_writes_its_state_and_only_its_own_columns() {
        let ok = Ending::Succeed {
            response: canonical(json!({"ok": 1})),
        };
        let failed = Ending::Fail {
            error: canonical(json!({"code": "x"})),
            retryable: true,
        };
        let waiting = Ending::AwaitConfirmation {
            pending: canonical(json!({"refund": 5})),
        };
        assert_eq!(
            ok.columns(),
            EndingColumns {
                state: "succeeded",
                response: Some(r#"{"ok":1}"#),
                error: None,
                retryable: None,
                pending: None,
            }
        );
        assert_eq!(
            failed.columns(),
            EndingColumns {
                state: "failed",
                response: None,
                error: Some(r#"{"code":"x"}"#),
                retryable: Some(true),
                pending: None,
            }
        );
        assert_eq!(
            waiting.columns(),
            EndingColumns {
                state: "awaiting_confirmation",
                response: None,
                error: None,
                retryable: None,
                pending: Some(r#"{"refund":5}"#),
            }
        );
    }
}
