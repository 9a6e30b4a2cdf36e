//! Row decoding: MySQL rows read through the shared decoding
//! (`agentgate_store_sql::rows`), which owns what each column means.
//!
//! Text is read as bytes and checked as UTF-8: identifiers are VARBINARY,
//! and sqlx refuses to decode binary-flagged columns as strings.

use agentgate_core::decide::SessionSnapshot;
use agentgate_core::error::{Error, Result};
use agentgate_core::model::TurnView;
use agentgate_store_sql::rows::{self, Columns};
use sqlx::mysql::MySqlRow;
use sqlx::Row;

use crate::error::map_sqlx;

pub(crate) use agentgate_store_sql::rows::{TurnRow, SESSION_COLUMNS, TURN_COLUMNS};

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

pub(crate) fn turn_view(row: &MySqlRow) -> Result<TurnView> {
    rows::turn_view(&Cols(row))
}

pub(crate) fn session_snapshot(row: &MySqlRow) -> Result<SessionSnapshot> {
    rows::session_snapshot(&Cols(row))
}

/// A row of a stored procedure's result set, its columns found by their
/// place in a known list. sqlx names the columns of a prepared statement's
/// first result set from what the prepare announced, and a `CALL` announces
/// none, so such a row has values but no names.
pub(crate) struct Positional<'a> {
    row: &'a MySqlRow,
    /// The list the procedure selects, in order (a `*_COLUMNS` constant).
    columns: &'static str,
}

impl<'a> Positional<'a> {
    /// `row`, selected as `columns`; `corrupt` when the counts differ (the
    /// procedure and the list drifted apart).
    pub(crate) fn new(row: &'a MySqlRow, columns: &'static str) -> Result<Self> {
        let expected = columns.split(',').count();
        if row.len() != expected {
            return Err(Error::corrupt(format!(
                "a procedure returned {} columns, {expected} expected",
                row.len()
            )));
        }
        Ok(Self { row, columns })
    }

    fn index(&self, column: &str) -> Result<usize> {
        self.columns
            .split(',')
            .position(|name| name.trim() == column)
            .ok_or_else(|| Error::corrupt(format!("no column {column} in a procedure's row")))
    }

    fn get<'r, T>(&'r self, column: &str) -> Result<T>
    where
        T: sqlx::Decode<'r, sqlx::MySql> + sqlx::Type<sqlx::MySql>,
    {
        self.row.try_get(self.index(column)?).map_err(map_sqlx)
    }
}

impl Columns for Positional<'_> {
    fn text(&self, column: &str) -> Result<Option<String>> {
        let bytes: Option<Vec<u8>> = self.get(column)?;
        bytes
            .map(|b| {
                String::from_utf8(b)
                    .map_err(|e| Error::corrupt(format!("{column} is not UTF-8: {e}")))
            })
            .transpose()
    }

    fn int(&self, column: &str) -> Result<Option<i64>> {
        self.get(column)
    }

    fn flag(&self, column: &str) -> Result<Option<bool>> {
        self.get(column)
    }
}
