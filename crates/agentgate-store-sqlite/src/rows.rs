//! Row decoding: SQLite rows read through the shared decoding
//! (`agentgate_store_sql::rows`), which owns what each column means.

use agentgate_core::error::{Error, Result};
use agentgate_core::model::TurnView;
use agentgate_store_sql::rows::{self, Columns};
use sqlx::sqlite::SqliteRow;
use sqlx::Row;

use crate::error::map_sqlx;

pub(crate) use agentgate_store_sql::rows::TURN_COLUMNS;

/// A SQLite row's columns: `TEXT`, `INTEGER`, and booleans as `INTEGER` 0/1.
pub(crate) struct Cols<'a>(pub(crate) &'a SqliteRow);

impl Columns for Cols<'_> {
    fn text(&self, column: &str) -> Result<Option<String>> {
        self.0.try_get(column).map_err(map_sqlx)
    }

    fn int(&self, column: &str) -> Result<Option<i64>> {
        self.0.try_get(column).map_err(map_sqlx)
    }

    fn flag(&self, column: &str) -> Result<Option<bool>> {
        match self.int(column)? {
            None => Ok(None),
            Some(0) => Ok(Some(false)),
            Some(1) => Ok(Some(true)),
            Some(other) => Err(Error::corrupt(format!("{column} is {other}, not 0 or 1"))),
        }
    }
}

pub(crate) fn turn_view(row: &SqliteRow) -> Result<TurnView> {
    rows::turn_view(&Cols(row))
}
