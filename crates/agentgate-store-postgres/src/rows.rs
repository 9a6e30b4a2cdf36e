//! Row decoding: PostgreSQL rows read through the shared decoding
//! (`agentgate_store_sql::rows`), which owns what each column means.

use agentgate_core::decide::{SessionSnapshot, TurnSnapshot};
use agentgate_core::error::Result;
use agentgate_core::model::TurnView;
use agentgate_store_sql::rows::{self, Columns, TurnRow};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::error::map_sqlx;

pub(crate) use agentgate_store_sql::rows::{json, SESSION_COLUMNS, TURN_COLUMNS};

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

/// The turn in `row` ([`TURN_COLUMNS`]), or `None` when an outer join found
/// no turn (`turn_id` is NULL).
pub(crate) fn turn_record(row: &PgRow) -> Result<Option<TurnRecord>> {
    let Some(turn) = TurnRow::read_optional(&Cols(row))? else {
        return Ok(None);
    };
    Ok(Some(TurnRecord {
        snapshot: turn.snapshot()?,
        view: turn.view()?,
    }))
}

pub(crate) fn turn_view(row: &PgRow) -> Result<TurnView> {
    rows::turn_view(&Cols(row))
}

pub(crate) fn session_snapshot(row: &PgRow) -> Result<SessionSnapshot> {
    rows::session_snapshot(&Cols(row))
}
