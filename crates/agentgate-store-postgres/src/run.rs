//! The shared statements ([`agentgate_store_sql::query`]) run on PostgreSQL:
//! numbered placeholders as written, rows read through [`Cols`].

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Postgres};

use crate::error::map_sqlx;
use crate::rows::Cols;
use crate::steps::Sql;
use crate::NOW_MS;

agentgate_store_sql::impl_run!(
    Sql,
    db = Postgres,
    conn = PgConnection,
    row = PgRow,
    cols = Cols,
    now = NOW_MS,
    bigint = "BIGINT",
    errors = map_sqlx,
    render = agentgate_store_sql::query::numbered,
    read = |store| &store.pool,
    write = |store| &store.pool,
    after_cut = crate::AFTER_CUT,
);
