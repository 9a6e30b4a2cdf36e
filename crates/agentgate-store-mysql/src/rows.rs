//! Row decoding: MySQL rows read through the shared decoding
//! (`agentgate_store_sql::rows`), which owns what each column means.
//!
//! Text is read as bytes and checked as UTF-8: identifiers are VARBINARY,
//! and sqlx refuses to decode binary-flagged columns as strings.

use agentgate_core::decide::{SessionSnapshot, TurnSnapshot};
use agentgate_core::error::{Error, Result};
use agentgate_core::model::{ExecutionView, TurnView};
use agentgate_store_sql::rows::{self, Columns};
use sqlx::mysql::MySqlRow;
use sqlx::Row;

use crate::error::map_sqlx;

pub(crate) use agentgate_store_sql::rows::{
    json, TurnRow, EXECUTION_COLUMNS, SESSION_COLUMNS, TURN_COLUMNS,
};

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
        .map(|b| {
            String::from_utf8(b).map_err(|e| Error::corrupt(format!("{column} is not UTF-8: {e}")))
        })
        .transpose()
}

/// A MySQL row's columns: text as checked bytes, `BIGINT`, `BOOLEAN`
/// (`TINYINT(1)`).
pub(crate) struct Cols<'a>(pub(crate) &'a MySqlRow);

impl Columns for Cols<'_> {
    fn text(&self, column: &str) -> Result<Option<String>> {
        text(self.0, column)
    }

    fn int(&self, column: &str) -> Result<Option<i64>> {
        get(self.0, column)
    }

    fn flag(&self, column: &str) -> Result<Option<bool>> {
        get(self.0, column)
    }
}

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

/// The turn in `row` ([`TURN_COLUMNS`]), or `None` when an outer join found
/// no turn (`turn_id` is NULL).
pub(crate) fn turn_record(row: &MySqlRow) -> Result<Option<TurnRecord>> {
    let Some(turn) = TurnRow::read_optional(&Cols(row))? else {
        return Ok(None);
    };
    Ok(Some(TurnRecord {
        snapshot: turn.snapshot()?,
        pending_text: turn.pending.clone(),
        view: turn.view()?,
    }))
}

pub(crate) fn turn_view(row: &MySqlRow) -> Result<TurnView> {
    rows::turn_view(&Cols(row))
}

pub(crate) fn session_snapshot(row: &MySqlRow) -> Result<SessionSnapshot> {
    rows::session_snapshot(&Cols(row))
}

pub(crate) fn execution_view(row: &MySqlRow) -> Result<ExecutionView> {
    rows::execution_view(&Cols(row))
}
