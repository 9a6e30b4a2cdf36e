//! Row decoding: MySQL rows into core snapshots and views.
//!
//! Text is read as bytes and checked as UTF-8: identifiers are VARBINARY,
//! and sqlx refuses to decode binary-flagged columns as strings.

use agentgate_core::decide::{
    ExecutionSnapshot, HolderSnapshot, PendingSnapshot, SessionSnapshot, TurnSnapshot,
};
use agentgate_core::error::Result;
use agentgate_core::ids::{
    ClientRequestId, ExecutionId, Fence, SessionId, ToolName, TurnId, UserId,
};
use agentgate_core::model::{ConfirmationContext, ExecutionView, ToolState, TurnState, TurnView};
use serde_json::Value;
use sqlx::mysql::MySqlRow;
use sqlx::Row;

use crate::error::{corrupt, map_sqlx};

/// The columns [`turn_record`] reads, in a SELECT list or a RETURNING clause.
pub(crate) const TURN_COLUMNS: &str = "turn_id, session_id, user_id, client_request_id, \
    fingerprint, state, attempt, fence, response, error, retryable, pending, \
    confirms_turn_id, decision, confirmed_by, created_at_ms, updated_at_ms";

/// The columns [`execution_snapshot`] and [`execution_view`] read.
pub(crate) const EXECUTION_COLUMNS: &str =
    "execution_id, turn_id, tool, state, attempt, fence, result, error";

/// The columns [`session_snapshot`] reads.
pub(crate) const SESSION_COLUMNS: &str = "user_id, holder_turn_id, lease_expires_at_ms, \
    pending_turn_id, pending_expires_at_ms";

/// A turn row read inside a step: what `decide` needs and what callers see.
#[derive(Debug)]
pub(crate) struct TurnRecord {
    pub snapshot: TurnSnapshot,
    pub view: TurnView,
    /// The `pending` column as stored (a confirmation copies it verbatim).
    pub pending_text: Option<String>,
}

impl agentgate_store_sql::begin::TurnRecord for TurnRecord {
    fn snapshot(&self) -> &TurnSnapshot {
        &self.snapshot
    }

    fn view(&self) -> &TurnView {
        &self.view
    }
}

pub(crate) fn get<'r, T>(row: &'r MySqlRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, sqlx::MySql> + sqlx::Type<sqlx::MySql>,
{
    row.try_get(column).map_err(map_sqlx)
}

/// A text column (VARBINARY, CHAR or TEXT), NULL as `None`.
pub(crate) fn text(row: &MySqlRow, column: &str) -> Result<Option<String>> {
    let bytes: Option<Vec<u8>> = get(row, column)?;
    bytes
        .map(|b| String::from_utf8(b).map_err(|e| corrupt(format!("{column} is not UTF-8: {e}"))))
        .transpose()
}

/// A NOT NULL text column.
pub(crate) fn text_required(row: &MySqlRow, column: &str) -> Result<String> {
    text(row, column)?.ok_or_else(|| corrupt(format!("{column} is NULL")))
}

/// Parses stored canonical JSON text.
pub(crate) fn json(stored: Option<String>) -> Result<Option<Value>> {
    stored
        .map(|t| serde_json::from_str(&t).map_err(|e| corrupt(format!("stored JSON: {e}"))))
        .transpose()
}

/// A stored count or attempt number as `u32`.
pub(crate) fn count(value: i64) -> Result<u32> {
    u32::try_from(value).map_err(|_| corrupt(format!("count {value}")))
}

/// A stored id, validated like any input.
pub(crate) fn id<T>(make: fn(String) -> Result<T>, value: String) -> Result<T> {
    make(value).map_err(|e| corrupt(format!("stored id: {e}")))
}

/// The turn in `row` ([`TURN_COLUMNS`]), or `None` when an outer join found
/// no turn (`turn_id` is NULL).
pub(crate) fn turn_record(row: &MySqlRow) -> Result<Option<TurnRecord>> {
    if text(row, "turn_id")?.is_none() {
        return Ok(None);
    }
    Ok(Some(TurnRecord {
        snapshot: turn_snapshot(row)?,
        view: turn_view(row)?,
        pending_text: text(row, "pending")?,
    }))
}

fn turn_snapshot(row: &MySqlRow) -> Result<TurnSnapshot> {
    Ok(TurnSnapshot {
        turn_id: text_required(row, "turn_id")?,
        session_id: text_required(row, "session_id")?,
        fingerprint: text_required(row, "fingerprint")?,
        state: text_required(row, "state")?.parse()?,
        attempt: count(get(row, "attempt")?)?,
        retryable: get::<Option<bool>>(row, "retryable")?.unwrap_or(false),
        confirmed_by: text(row, "confirmed_by")?,
    })
}

pub(crate) fn turn_view(row: &MySqlRow) -> Result<TurnView> {
    TurnRow::read(row)?.view()
}

/// The columns of a turn's view as stored, so a step that wrote some of them
/// without reading them back (a fast ending) can apply its own `SET` to a row
/// read before it and get the same view as a read-back.
#[derive(Debug)]
pub(crate) struct TurnRow {
    pub turn_id: String,
    pub session_id: String,
    pub user_id: String,
    pub client_request_id: String,
    pub state: String,
    pub attempt: i64,
    pub fence: i64,
    pub response: Option<String>,
    pub error: Option<String>,
    pub retryable: Option<bool>,
    pub pending: Option<String>,
    pub confirms_turn_id: Option<String>,
    pub decision: Option<String>,
    pub confirmed_by: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl TurnRow {
    /// Reads [`TURN_COLUMNS`] from `row`.
    pub(crate) fn read(row: &MySqlRow) -> Result<Self> {
        Ok(Self {
            turn_id: text_required(row, "turn_id")?,
            session_id: text_required(row, "session_id")?,
            user_id: text_required(row, "user_id")?,
            client_request_id: text_required(row, "client_request_id")?,
            state: text_required(row, "state")?,
            attempt: get(row, "attempt")?,
            fence: get(row, "fence")?,
            response: text(row, "response")?,
            error: text(row, "error")?,
            retryable: get(row, "retryable")?,
            pending: text(row, "pending")?,
            confirms_turn_id: text(row, "confirms_turn_id")?,
            decision: text(row, "decision")?,
            confirmed_by: text(row, "confirmed_by")?,
            created_at_ms: get(row, "created_at_ms")?,
            updated_at_ms: get(row, "updated_at_ms")?,
        })
    }

    /// The view callers see.
    pub(crate) fn view(self) -> Result<TurnView> {
        let pending = json(self.pending)?;
        let confirmation = match self.confirms_turn_id {
            Some(turn_id) => Some(ConfirmationContext {
                turn_id: id(TurnId::new, turn_id)?,
                decision: self
                    .decision
                    .ok_or_else(|| corrupt("confirmation without decision"))?
                    .parse()?,
                pending: pending.clone().unwrap_or(Value::Null),
            }),
            None => None,
        };
        let state: TurnState = self.state.parse()?;
        let failed = state == TurnState::Failed;
        Ok(TurnView {
            turn_id: id(TurnId::new, self.turn_id)?,
            session_id: id(SessionId::new, self.session_id)?,
            user_id: id(UserId::new, self.user_id)?,
            client_request_id: id(ClientRequestId::new, self.client_request_id)?,
            state,
            attempt: count(self.attempt)?,
            fence: Fence(self.fence),
            response: json(self.response)?,
            error: json(self.error)?,
            retryable: failed.then_some(self.retryable.unwrap_or(false)),
            pending: if confirmation.is_some() {
                None
            } else {
                pending
            },
            confirmation,
            confirmed_by: self.confirmed_by.map(|t| id(TurnId::new, t)).transpose()?,
            created_at_ms: self.created_at_ms,
            updated_at_ms: self.updated_at_ms,
        })
    }
}

pub(crate) fn session_snapshot(row: &MySqlRow) -> Result<SessionSnapshot> {
    let holder = match (
        text(row, "holder_turn_id")?,
        get::<Option<i64>>(row, "lease_expires_at_ms")?,
    ) {
        (Some(turn_id), Some(lease_expires_at_ms)) => Some(HolderSnapshot {
            turn_id,
            lease_expires_at_ms,
        }),
        _ => None,
    };
    let pending = match (
        text(row, "pending_turn_id")?,
        get::<Option<i64>>(row, "pending_expires_at_ms")?,
    ) {
        (Some(turn_id), Some(expires_at_ms)) => Some(PendingSnapshot {
            turn_id,
            expires_at_ms,
        }),
        _ => None,
    };
    Ok(SessionSnapshot {
        user_id: text_required(row, "user_id")?,
        holder,
        pending,
    })
}

/// The execution in `row` ([`EXECUTION_COLUMNS`]), or `None` when an outer
/// join found none.
pub(crate) fn execution_snapshot(row: &MySqlRow) -> Result<Option<ExecutionSnapshot>> {
    let Some(execution_id) = text(row, "execution_id")? else {
        return Ok(None);
    };
    Ok(Some(ExecutionSnapshot {
        execution_id,
        state: text_required(row, "state")?.parse()?,
        attempt: count(get(row, "attempt")?)?,
        fence: Fence(get(row, "fence")?),
    }))
}

pub(crate) fn execution_view(row: &MySqlRow) -> Result<ExecutionView> {
    let state: ToolState = text_required(row, "state")?.parse()?;
    Ok(ExecutionView {
        execution_id: id(ExecutionId::new, text_required(row, "execution_id")?)?,
        turn_id: id(TurnId::new, text_required(row, "turn_id")?)?,
        tool: id(ToolName::new, text_required(row, "tool")?)?,
        state,
        attempt: count(get(row, "attempt")?)?,
        fence: Fence(get(row, "fence")?),
        result: json(text(row, "result")?)?,
        error: json(text(row, "error")?)?,
    })
}
