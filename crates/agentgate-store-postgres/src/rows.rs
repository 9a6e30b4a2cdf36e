//! Row decoding: PostgreSQL rows read through the shared decoding
//! (`agentgate_store_sql::rows`), which owns what each column means.

use agentgate_core::decide::SessionSnapshot;
use agentgate_core::error::Result;
use agentgate_core::model::TurnView;
use agentgate_store_sql::rows::{self, Columns};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::error::map_sqlx;

pub(crate) use agentgate_store_sql::rows::{SESSION_COLUMNS, TURN_COLUMNS};

pub(crate) fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(column).map_err(map_sqlx)
}

/// A PostgreSQL row's columns: text, `BIGINT` and `BOOLEAN` as stored.
pub(crate) struct Cols<'a>(pub(crate) &'a PgRow);

impl Columns for Cols<'_> {
    fn text(&self, column: &str) -> Result<Option<String>> {
        get(self.0, column)
    }

    fn int(&self, column: &str) -> Result<Option<i64>> {
        get(self.0, column)
    }

    fn flag(&self, column: &str) -> Result<Option<bool>> {
        get(self.0, column)
    }
}

pub(crate) fn turn_view(row: &PgRow) -> Result<TurnView> {
    rows::turn_view(&Cols(row))
}

pub(crate) fn session_snapshot(row: &PgRow) -> Result<SessionSnapshot> {
    rows::session_snapshot(&Cols(row))
}
