//! Orphans: a turn whose holder stopped without an ending, what recovery
//! workers list, and what a claim of one hands over.

use super::*;

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
