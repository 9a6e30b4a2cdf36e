//! Row decoding, written once: the columns every SQL store selects, and the
//! core snapshots and views decoded from them.
//!
//! A store reads a column through [`Columns`] (its driver's row, wrapped),
//! which is where the dialects differ: MySQL keeps identifiers as
//! VARBINARY, SQLite keeps booleans as integers. Everything after that —
//! which column means what, what is corrupt — is here. A stored value the
//! schema does not allow is `corrupt`, never a default.

use agentgate_core::canonical::{CanonicalJson, Digest};
use agentgate_core::decide::{
    ExecutionSnapshot, HolderSnapshot, PendingSnapshot, SessionSnapshot, TurnSnapshot,
};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{
    ClientRequestId, ExecutionId, Fence, SessionId, ToolName, TurnId, UserId,
};
use agentgate_core::model::{
    ConfirmationContext, Ending, ExecutionView, Orphan, ToolState, TurnState, TurnView,
};
use serde_json::Value;

/// The columns [`TurnRow::read`] reads, in a SELECT list or a RETURNING
/// clause.
pub const TURN_COLUMNS: &str = "turn_id, session_id, user_id, client_request_id, \
    fingerprint, state, attempt, fence, response, error, retryable, pending, \
    confirms_turn_id, confirms_pending, decision, confirmed_by, created_at_ms, updated_at_ms, \
    cancel_requested_at_ms";

/// The columns [`execution_snapshot`] and [`execution_view`] read.
pub const EXECUTION_COLUMNS: &str =
    "execution_id, turn_id, tool, state, attempt, fence, result, error";

/// The columns [`session_snapshot`] reads.
pub const SESSION_COLUMNS: &str = "user_id, holder_turn_id, lease_expires_at_ms, \
    pending_turn_id, pending_expires_at_ms";

/// One row's columns as a store's driver reads them; NULL is `None`.
pub trait Columns {
    /// A text column.
    ///
    /// # Errors
    /// `store_unavailable` (driver), `corrupt` (not UTF-8).
    fn text(&self, column: &str) -> Result<Option<String>>;

    /// An integer column.
    ///
    /// # Errors
    /// `store_unavailable` (driver).
    fn int(&self, column: &str) -> Result<Option<i64>>;

    /// A boolean column.
    ///
    /// # Errors
    /// `store_unavailable` (driver), `corrupt` (not a boolean).
    fn flag(&self, column: &str) -> Result<Option<bool>>;

    /// A NOT NULL text column.
    ///
    /// # Errors
    /// As [`Columns::text`]; `corrupt` for NULL.
    fn text_required(&self, column: &str) -> Result<String> {
        self.text(column)?
            .ok_or_else(|| Error::corrupt(format!("{column} is NULL")))
    }

    /// A NOT NULL integer column.
    ///
    /// # Errors
    /// As [`Columns::int`]; `corrupt` for NULL.
    fn int_required(&self, column: &str) -> Result<i64> {
        self.int(column)?
            .ok_or_else(|| Error::corrupt(format!("{column} is NULL")))
    }
}

/// The columns of a row that selected them under a prefix (`t_turn_id`),
/// where a join would otherwise give two columns one name.
pub struct Prefixed<'a, C> {
    /// The row.
    pub row: &'a C,
    /// What each wanted column's name starts with in it.
    pub prefix: &'static str,
}

impl<C: Columns> Columns for Prefixed<'_, C> {
    fn text(&self, column: &str) -> Result<Option<String>> {
        self.row.text(&format!("{}{column}", self.prefix))
    }

    fn int(&self, column: &str) -> Result<Option<i64>> {
        self.row.int(&format!("{}{column}", self.prefix))
    }

    fn flag(&self, column: &str) -> Result<Option<bool>> {
        self.row.flag(&format!("{}{column}", self.prefix))
    }
}

/// `columns` (a list such as [`TURN_COLUMNS`]) of table `alias`, each
/// selected as `prefix` + its name, for [`Prefixed`].
#[must_use]
pub fn prefixed(columns: &str, alias: &str, prefix: &str) -> String {
    columns
        .split(',')
        .map(str::trim)
        .map(|column| format!("{alias}.{column} AS {prefix}{column}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses stored canonical JSON text.
///
/// # Errors
/// `corrupt` when it is not JSON.
pub fn json(stored: Option<String>) -> Result<Option<Value>> {
    stored
        .map(|t| serde_json::from_str(&t).map_err(|e| Error::corrupt(format!("stored JSON: {e}"))))
        .transpose()
}

/// A stored count or attempt number as `u32`.
///
/// # Errors
/// `corrupt` outside `u32`.
pub fn count(value: i64) -> Result<u32> {
    u32::try_from(value).map_err(|_| Error::corrupt(format!("count {value}")))
}

/// A stored id, validated like any input.
///
/// # Errors
/// `corrupt` when the engine would not have accepted it.
pub fn id<T>(make: fn(String) -> Result<T>, value: String) -> Result<T> {
    make(value).map_err(|e| Error::corrupt(format!("stored id: {e}")))
}

/// The columns of a turn's row as stored ([`TURN_COLUMNS`]), so a step that
/// wrote some of them without reading them back (a fast ending) can apply
/// its own `SET` to a row read before it and get the same view as a
/// read-back.
#[derive(Clone, Debug)]
pub struct TurnRow {
    #[allow(missing_docs)]
    pub turn_id: String,
    #[allow(missing_docs)]
    pub session_id: String,
    #[allow(missing_docs)]
    pub user_id: String,
    #[allow(missing_docs)]
    pub client_request_id: String,
    #[allow(missing_docs)]
    pub fingerprint: String,
    #[allow(missing_docs)]
    pub state: String,
    #[allow(missing_docs)]
    pub attempt: i64,
    #[allow(missing_docs)]
    pub fence: i64,
    #[allow(missing_docs)]
    pub response: Option<String>,
    #[allow(missing_docs)]
    pub error: Option<String>,
    #[allow(missing_docs)]
    pub retryable: Option<bool>,
    /// The turn's own pending action, once it awaited confirmation (a
    /// confirmation copies it verbatim to the turn it begins).
    pub pending: Option<String>,
    #[allow(missing_docs)]
    pub confirms_turn_id: Option<String>,
    /// The action carried from the confirmed turn, for a turn a
    /// confirmation began.
    pub confirms_pending: Option<String>,
    #[allow(missing_docs)]
    pub decision: Option<String>,
    #[allow(missing_docs)]
    pub confirmed_by: Option<String>,
    #[allow(missing_docs)]
    pub created_at_ms: i64,
    #[allow(missing_docs)]
    pub updated_at_ms: i64,
    /// When a cancel was requested, if one was.
    pub cancel_requested_at_ms: Option<i64>,
}

impl TurnRow {
    /// Reads [`TURN_COLUMNS`]; `None` when an outer join found no turn
    /// (`turn_id` is NULL).
    ///
    /// # Errors
    /// As [`Columns`].
    pub fn read_optional(row: &impl Columns) -> Result<Option<Self>> {
        if row.text("turn_id")?.is_none() {
            return Ok(None);
        }
        Self::read(row).map(Some)
    }

    /// Reads [`TURN_COLUMNS`].
    ///
    /// # Errors
    /// As [`Columns`]; `corrupt` for a NULL in a NOT NULL column.
    pub fn read(row: &impl Columns) -> Result<Self> {
        Ok(Self {
            turn_id: row.text_required("turn_id")?,
            session_id: row.text_required("session_id")?,
            user_id: row.text_required("user_id")?,
            client_request_id: row.text_required("client_request_id")?,
            fingerprint: row.text_required("fingerprint")?,
            state: row.text_required("state")?,
            attempt: row.int_required("attempt")?,
            fence: row.int_required("fence")?,
            response: row.text("response")?,
            error: row.text("error")?,
            retryable: row.flag("retryable")?,
            pending: row.text("pending")?,
            confirms_turn_id: row.text("confirms_turn_id")?,
            confirms_pending: row.text("confirms_pending")?,
            decision: row.text("decision")?,
            confirmed_by: row.text("confirmed_by")?,
            created_at_ms: row.int_required("created_at_ms")?,
            updated_at_ms: row.int_required("updated_at_ms")?,
            cancel_requested_at_ms: row.int("cancel_requested_at_ms")?,
        })
    }

    /// What `decide` reads.
    ///
    /// # Errors
    /// `corrupt` for a state or attempt the engine never writes.
    pub fn snapshot(&self) -> Result<TurnSnapshot> {
        Ok(TurnSnapshot {
            turn_id: self.turn_id.clone(),
            session_id: self.session_id.clone(),
            fingerprint: self.fingerprint.clone(),
            state: self.state.parse()?,
            attempt: count(self.attempt)?,
            retryable: self.retryable.unwrap_or(false),
            confirmed_by: self.confirmed_by.clone(),
        })
    }

    /// The view callers see.
    ///
    /// # Errors
    /// `corrupt` for a value the engine never writes.
    pub fn view(self) -> Result<TurnView> {
        let confirmation = match self.confirms_turn_id {
            Some(turn_id) => Some(ConfirmationContext {
                turn_id: id(TurnId::new, turn_id)?,
                decision: self
                    .decision
                    .ok_or_else(|| Error::corrupt("confirmation without decision"))?
                    .parse()?,
                pending: json(self.confirms_pending)?
                    .ok_or_else(|| Error::corrupt("confirmation without its action"))?,
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
            pending: json(self.pending)?,
            confirmation,
            confirmed_by: self.confirmed_by.map(|t| id(TurnId::new, t)).transpose()?,
            cancel_requested_at_ms: self.cancel_requested_at_ms,
            created_at_ms: self.created_at_ms,
            updated_at_ms: self.updated_at_ms,
        })
    }
}

/// What `decide` reads of a turn, from a row that selects only those
/// columns: `turn_id`, `session_id`, `fingerprint`, `state`, `attempt`,
/// `retryable`, `confirmed_by`.
///
/// # Errors
/// As [`Columns`]; `corrupt` for a state or attempt the engine never writes.
pub fn turn_snapshot(row: &impl Columns) -> Result<TurnSnapshot> {
    Ok(TurnSnapshot {
        turn_id: row.text_required("turn_id")?,
        session_id: row.text_required("session_id")?,
        fingerprint: row.text_required("fingerprint")?,
        state: row.text_required("state")?.parse()?,
        attempt: count(row.int_required("attempt")?)?,
        retryable: row.flag("retryable")?.unwrap_or(false),
        confirmed_by: row.text("confirmed_by")?,
    })
}

/// The turn's view from a row of [`TURN_COLUMNS`].
///
/// # Errors
/// As [`TurnRow::read`] and [`TurnRow::view`].
pub fn turn_view(row: &impl Columns) -> Result<TurnView> {
    TurnRow::read(row)?.view()
}

/// The session as `decide` reads it, from a row of [`SESSION_COLUMNS`].
///
/// # Errors
/// As [`Columns`].
pub fn session_snapshot(row: &impl Columns) -> Result<SessionSnapshot> {
    let holder = match (row.text("holder_turn_id")?, row.int("lease_expires_at_ms")?) {
        (Some(turn_id), Some(lease_expires_at_ms)) => Some(HolderSnapshot {
            turn_id,
            lease_expires_at_ms,
        }),
        _ => None,
    };
    let pending = match (
        row.text("pending_turn_id")?,
        row.int("pending_expires_at_ms")?,
    ) {
        (Some(turn_id), Some(expires_at_ms)) => Some(PendingSnapshot {
            turn_id,
            expires_at_ms,
        }),
        _ => None,
    };
    Ok(SessionSnapshot {
        user_id: row.text_required("user_id")?,
        holder,
        pending,
    })
}

/// The execution in a row of [`EXECUTION_COLUMNS`], or `None` when an outer
/// join found none.
///
/// # Errors
/// As [`Columns`]; `corrupt` for a state or attempt the engine never writes.
pub fn execution_snapshot(row: &impl Columns) -> Result<Option<ExecutionSnapshot>> {
    let Some(execution_id) = row.text("execution_id")? else {
        return Ok(None);
    };
    Ok(Some(ExecutionSnapshot {
        execution_id,
        state: row.text_required("state")?.parse()?,
        attempt: count(row.int_required("attempt")?)?,
        fence: Fence(row.int_required("fence")?),
    }))
}

/// The execution's view from a row of [`EXECUTION_COLUMNS`].
///
/// # Errors
/// As [`Columns`]; `corrupt` for a value the engine never writes.
pub fn execution_view(row: &impl Columns) -> Result<ExecutionView> {
    let state: ToolState = row.text_required("state")?.parse()?;
    Ok(ExecutionView {
        execution_id: id(ExecutionId::new, row.text_required("execution_id")?)?,
        turn_id: id(TurnId::new, row.text_required("turn_id")?)?,
        tool: id(ToolName::new, row.text_required("tool")?)?,
        state,
        attempt: count(row.int_required("attempt")?)?,
        fence: Fence(row.int_required("fence")?),
        result: json(row.text("result")?)?,
        error: json(row.text("error")?)?,
    })
}

/// An orphan candidate from an orphan listing's row: the turn's ids,
/// fingerprint, payload, fence and attempt, `orphaned_since_ms` (when its
/// lease was last live as far as the rows tell) and `superseded` (0 or 1: a
/// newer grant of the session exists).
///
/// # Errors
/// As [`Columns`]; `corrupt` for a value the engine never writes.
pub fn orphan(row: &impl Columns, now_ms: i64) -> Result<Orphan> {
    let since = row.int_required("orphaned_since_ms")?;
    Ok(Orphan {
        turn_id: id(TurnId::new, row.text_required("turn_id")?)?,
        session_id: id(SessionId::new, row.text_required("session_id")?)?,
        user_id: id(UserId::new, row.text_required("user_id")?)?,
        client_request_id: id(
            ClientRequestId::new,
            row.text_required("client_request_id")?,
        )?,
        fingerprint: Digest::from_hex(row.text_required("fingerprint")?),
        payload: row.text("payload")?.map(CanonicalJson::from_stored),
        fence: Fence(row.int_required("fence")?),
        attempt: count(row.int_required("attempt")?)?,
        orphaned_since_ms: since,
        orphaned_for_ms: now_ms - since,
        superseded: match row.int_required("superseded")? {
            0 => false,
            1 => true,
            other => return Err(Error::corrupt(format!("superseded is {other}"))),
        },
    })
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

/// The columns `ending` writes on its turn row.
pub fn ending_columns(ending: &Ending) -> EndingColumns<'_> {
    let none = EndingColumns {
        state: "",
        response: None,
        error: None,
        retryable: None,
        pending: None,
    };
    match ending {
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

#[cfg(test)]
mod ending_tests {
    use agentgate_core::canonical::CanonicalJson;
    use agentgate_core::model::Ending;
    use serde_json::json;

    use super::{ending_columns, EndingColumns};

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
            ending_columns(&ok),
            EndingColumns {
                state: "succeeded",
                response: Some(r#"{"ok":1}"#),
                error: None,
                retryable: None,
                pending: None,
            }
        );
        assert_eq!(
            ending_columns(&failed),
            EndingColumns {
                state: "failed",
                response: None,
                error: Some(r#"{"code":"x"}"#),
                retryable: Some(true),
                pending: None,
            }
        );
        assert_eq!(
            ending_columns(&waiting),
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
