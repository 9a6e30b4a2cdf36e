//! Row decoding: PostgreSQL rows into core snapshots and views.

use agentgate_core::decide::{
    ExecutionSnapshot, HolderSnapshot, PendingSnapshot, SessionSnapshot, TurnSnapshot,
};
use agentgate_core::error::Result;
use agentgate_core::ids::{
    ClientRequestId, ExecutionId, Fence, SessionId, ToolName, TurnId, UserId,
};
use agentgate_core::model::{ConfirmationContext, ExecutionView, ToolState, TurnState, TurnView};
use serde_json::Value;
use sqlx::postgres::PgRow;
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
}

impl agentgate_store_sql::begin::TurnRecord for TurnRecord {
    fn snapshot(&self) -> &TurnSnapshot {
        &self.snapshot
    }

    fn view(&self) -> &TurnView {
        &self.view
    }
}

pub(crate) fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(column).map_err(map_sqlx)
}

/// Parses stored canonical JSON text.
pub(crate) fn json(text: Option<String>) -> Result<Option<Value>> {
    text.map(|t| serde_json::from_str(&t).map_err(|e| corrupt(format!("stored JSON: {e}"))))
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
pub(crate) fn turn_record(row: &PgRow) -> Result<Option<TurnRecord>> {
    if get::<Option<String>>(row, "turn_id")?.is_none() {
        return Ok(None);
    }
    Ok(Some(TurnRecord {
        snapshot: turn_snapshot(row)?,
        view: turn_view(row)?,
    }))
}

fn turn_snapshot(row: &PgRow) -> Result<TurnSnapshot> {
    Ok(TurnSnapshot {
        turn_id: get(row, "turn_id")?,
        session_id: get(row, "session_id")?,
        fingerprint: get(row, "fingerprint")?,
        state: get::<String>(row, "state")?.parse()?,
        attempt: count(get(row, "attempt")?)?,
        retryable: get::<Option<bool>>(row, "retryable")?.unwrap_or(false),
        confirmed_by: get(row, "confirmed_by")?,
    })
}

pub(crate) fn turn_view(row: &PgRow) -> Result<TurnView> {
    let pending = json(get(row, "pending")?)?;
    let confirms: Option<String> = get(row, "confirms_turn_id")?;
    let confirmation = match confirms {
        Some(turn_id) => Some(ConfirmationContext {
            turn_id: id(TurnId::new, turn_id)?,
            decision: get::<Option<String>>(row, "decision")?
                .ok_or_else(|| corrupt("confirmation without decision"))?
                .parse()?,
            pending: pending.clone().unwrap_or(Value::Null),
        }),
        None => None,
    };
    let state: TurnState = get::<String>(row, "state")?.parse()?;
    let failed = state == TurnState::Failed;
    Ok(TurnView {
        turn_id: id(TurnId::new, get(row, "turn_id")?)?,
        session_id: id(SessionId::new, get(row, "session_id")?)?,
        user_id: id(UserId::new, get(row, "user_id")?)?,
        client_request_id: id(ClientRequestId::new, get(row, "client_request_id")?)?,
        state,
        attempt: count(get(row, "attempt")?)?,
        fence: Fence(get(row, "fence")?),
        response: json(get(row, "response")?)?,
        error: json(get(row, "error")?)?,
        retryable: if failed {
            Some(get::<Option<bool>>(row, "retryable")?.unwrap_or(false))
        } else {
            None
        },
        pending: if confirmation.is_some() {
            None
        } else {
            pending
        },
        confirmation,
        confirmed_by: get::<Option<String>>(row, "confirmed_by")?
            .map(|t| id(TurnId::new, t))
            .transpose()?,
        created_at_ms: get(row, "created_at_ms")?,
        updated_at_ms: get(row, "updated_at_ms")?,
    })
}

pub(crate) fn session_snapshot(row: &PgRow) -> Result<SessionSnapshot> {
    let holder = match (
        get::<Option<String>>(row, "holder_turn_id")?,
        get::<Option<i64>>(row, "lease_expires_at_ms")?,
    ) {
        (Some(turn_id), Some(lease_expires_at_ms)) => Some(HolderSnapshot {
            turn_id,
            lease_expires_at_ms,
        }),
        _ => None,
    };
    let pending = match (
        get::<Option<String>>(row, "pending_turn_id")?,
        get::<Option<i64>>(row, "pending_expires_at_ms")?,
    ) {
        (Some(turn_id), Some(expires_at_ms)) => Some(PendingSnapshot {
            turn_id,
            expires_at_ms,
        }),
        _ => None,
    };
    Ok(SessionSnapshot {
        user_id: get(row, "user_id")?,
        holder,
        pending,
    })
}

/// The execution in `row` ([`EXECUTION_COLUMNS`]), or `None` when an outer
/// join found none.
pub(crate) fn execution_snapshot(row: &PgRow) -> Result<Option<ExecutionSnapshot>> {
    let Some(execution_id) = get::<Option<String>>(row, "execution_id")? else {
        return Ok(None);
    };
    Ok(Some(ExecutionSnapshot {
        execution_id,
        state: get::<String>(row, "state")?.parse()?,
        attempt: count(get(row, "attempt")?)?,
        fence: Fence(get(row, "fence")?),
    }))
}

pub(crate) fn execution_view(row: &PgRow) -> Result<ExecutionView> {
    let state: ToolState = get::<String>(row, "state")?.parse()?;
    Ok(ExecutionView {
        execution_id: id(ExecutionId::new, get(row, "execution_id")?)?,
        turn_id: id(TurnId::new, get(row, "turn_id")?)?,
        tool: id(ToolName::new, get(row, "tool")?)?,
        state,
        attempt: count(get(row, "attempt")?)?,
        fence: Fence(get(row, "fence")?),
        result: json(get(row, "result")?)?,
        error: json(get(row, "error")?)?,
    })
}
