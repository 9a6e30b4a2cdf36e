//! The shared statements ([`agentgate_store_sql::query`]) run on SQLite:
//! numbered placeholders as written, a read outside a transaction on the
//! reader pool, a write on the single writer, rows read through [`Cols`].

use sqlx::sqlite::SqliteRow;
use sqlx::{Sqlite, SqliteConnection};

use crate::error::map_sqlx;
use crate::rows::Cols;
use crate::steps::Sql;
use crate::NOW_MS;

agentgate_store_sql::impl_run!(
    Sql,
    db = Sqlite,
    conn = SqliteConnection,
    row = SqliteRow,
    cols = Cols,
    now = NOW_MS,
    bigint = "INTEGER",
    errors = map_sqlx,
    render = agentgate_store_sql::query::numbered,
    read = |store| &store.reader,
    write = |store| &store.writer,
    after_cut = crate::AFTER_CUT,
);
