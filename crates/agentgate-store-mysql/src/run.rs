//! The shared statements ([`agentgate_store_sql::query`]) run on MySQL:
//! numbered placeholders rendered as `?` in order, rows read through
//! [`Cols`].

use sqlx::mysql::MySqlRow;
use sqlx::{MySql, MySqlConnection};

use crate::error::map_sqlx;
use crate::rows::Cols;
use crate::steps::Sql;
use crate::NOW_MS;

agentgate_store_sql::impl_run!(
    Sql,
    db = MySql,
    conn = MySqlConnection,
    row = MySqlRow,
    cols = Cols,
    now = NOW_MS,
    bigint = "SIGNED",
    errors = map_sqlx,
    render = agentgate_store_sql::query::positional,
    read = |store| &store.pool,
    write = |store| &store.pool,
    after_cut = crate::AFTER_CUT,
);
