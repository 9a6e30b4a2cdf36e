//! The shared statements ([`agentgate_store_sql::query`]) run on PostgreSQL:
//! numbered placeholders as written, rows read through [`Cols`].

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Postgres};

use crate::error::map_sqlx;
use crate::rows::Cols;
use crate::{PostgresStore, NOW_MS};

/// The store as the shared statements see it.
pub(crate) struct Db<'a>(pub(crate) &'a PostgresStore);

agentgate_store_sql::impl_run!(
    Db,
    db = Postgres,
    conn = PgConnection,
    row = PgRow,
    cols = Cols,
    now = NOW_MS,
    errors = map_sqlx,
    render = agentgate_store_sql::query::numbered,
    pool = |store| &store.pool,
);
