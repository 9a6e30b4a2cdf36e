//! Pre-populating the store's own tables with finished sessions and turns,
//! fast: one `INSERT … SELECT` per [`POPULATE_CHUNK_ROWS`] rows from a
//! generated series (a recursive CTE on SQLite, `generate_series` on
//! PostgreSQL, a cross join of digits on MySQL/MariaDB, whose recursive CTEs
//! are capped at 1,000 rows by default).
//!
//! Row `i` is session `scale-s<i>` of user `scale-u<i/10>` with no lease and
//! one succeeded turn `scale-t<i>`: what a store looks like after a day of
//! traffic. PostgreSQL and MySQL also get the users' `ag_users` rows (their
//! begin locks one); SQLite keeps only cap overrides there. The columns are
//! those of each store's `migrations/0001_init.sql`.
//!
//! Afterwards PostgreSQL tables are `VACUUM (ANALYZE)`d and MySQL tables
//! `ANALYZE`d, as autovacuum and InnoDB's persistent statistics would do by
//! themselves after a bulk load (here before, not during, the measurement);
//! SQLite is left as the store leaves it (it never runs `ANALYZE`).

use crate::error::Result;
use crate::limits::{POPULATE_CHUNK_ROWS, SESSIONS_PER_USER};
use crate::raw::SqlPool;

/// A 64-hex fingerprint for the synthetic turns.
const FINGERPRINT: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Numbers `?` + 0 ..= 99,999 as `n`, on MySQL: five digit tables crossed.
const MYSQL_NUMBERS: &str = "(SELECT ? + d0.d + 10 * d1.d + 100 * d2.d + 1000 * d3.d \
     + 10000 * d4.d AS n FROM \
     (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 \
      UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) d0 \
     CROSS JOIN (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 \
      UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) d1 \
     CROSS JOIN (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 \
      UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) d2 \
     CROSS JOIN (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 \
      UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) d3 \
     CROSS JOIN (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 \
      UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) d4) numbers";

/// The statements that insert rows `from..to`, binding `(from, to)` in order.
fn statements(pool: &SqlPool) -> Vec<String> {
    let spu = SESSIONS_PER_USER;
    match pool {
        SqlPool::Sqlite(_) => {
            let numbers =
                "WITH RECURSIVE n(i) AS (SELECT ?1 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?2)";
            let now = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";
            vec![
                format!(
                    "INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms) {numbers} \
                     SELECT 'scale-s' || i, 'scale-u' || (i / {spu}), 0, {now} FROM n"
                ),
                format!(
                    "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, \
                     fingerprint, state, attempt, fence, response, created_at_ms, updated_at_ms, \
                     ended_at_ms) {numbers} \
                     SELECT 'scale-t' || i, 'scale-s' || i, 'scale-u' || (i / {spu}), 'r1', \
                     '{FINGERPRINT}', 'succeeded', 1, 0, '{{}}', {now}, {now}, {now} FROM n"
                ),
            ]
        }
        SqlPool::Postgres(_) => {
            let numbers = "generate_series($1::bigint, $2::bigint - 1) AS g(i)";
            let now = "floor(extract(epoch from statement_timestamp()) * 1000)::bigint";
            vec![
                format!(
                    "INSERT INTO ag_users (user_id) SELECT DISTINCT 'scale-u' || (i / {spu}) \
                     FROM {numbers} ON CONFLICT DO NOTHING"
                ),
                format!(
                    "INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms) \
                     SELECT 'scale-s' || i, 'scale-u' || (i / {spu}), 0, {now} FROM {numbers}"
                ),
                format!(
                    "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, \
                     fingerprint, state, attempt, fence, response, created_at_ms, updated_at_ms, \
                     ended_at_ms) \
                     SELECT 'scale-t' || i, 'scale-s' || i, 'scale-u' || (i / {spu}), 'r1', \
                     '{FINGERPRINT}', 'succeeded', 1, 0, '{{}}', {now}, {now}, {now} FROM {numbers}"
                ),
            ]
        }
        SqlPool::MySql(_) => {
            let now =
                "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";
            vec![
                format!(
                    "INSERT IGNORE INTO ag_users (user_id) SELECT DISTINCT \
                     CONCAT('scale-u', n DIV {spu}) FROM {MYSQL_NUMBERS} WHERE n < ?"
                ),
                format!(
                    "INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms) \
                     SELECT CONCAT('scale-s', n), CONCAT('scale-u', n DIV {spu}), 0, {now} \
                     FROM {MYSQL_NUMBERS} WHERE n < ?"
                ),
                format!(
                    "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, \
                     fingerprint, state, attempt, fence, response, created_at_ms, updated_at_ms, \
                     ended_at_ms) \
                     SELECT CONCAT('scale-t', n), CONCAT('scale-s', n), CONCAT('scale-u', n DIV {spu}), \
                     'r1', '{FINGERPRINT}', 'succeeded', 1, 0, '{{}}', {now}, {now}, {now} \
                     FROM {MYSQL_NUMBERS} WHERE n < ?"
                ),
            ]
        }
    }
}

/// Inserts rows `from..to` (see the module docs), calling `progress` with
/// the rows done after each chunk; then refreshes planner statistics.
///
/// # Errors
/// `Sql`.
pub(crate) async fn populate(
    pool: &SqlPool,
    from: u64,
    to: u64,
    mut progress: impl FnMut(u64),
) -> Result<()> {
    let statements = statements(pool);
    let mut start = from;
    while start < to {
        let end = to.min(start + POPULATE_CHUNK_ROWS);
        // SQLite and PostgreSQL bind (start, end); the two binds are i64.
        let (start_i, end_i) = (to_i64(start), to_i64(end));
        for sql in &statements {
            match pool {
                SqlPool::Sqlite(p) => {
                    sqlx::query(sql)
                        .bind(start_i)
                        .bind(end_i)
                        .execute(p)
                        .await?;
                }
                SqlPool::Postgres(p) => {
                    sqlx::query(sql)
                        .bind(start_i)
                        .bind(end_i)
                        .execute(p)
                        .await?;
                }
                SqlPool::MySql(p) => {
                    sqlx::query(sql)
                        .bind(start_i)
                        .bind(end_i)
                        .execute(p)
                        .await?;
                }
            }
        }
        progress(end - from);
        start = end;
    }
    match pool {
        SqlPool::Sqlite(_) => {}
        // VACUUM as well: PostgreSQL's autovacuum vacuums a table after a
        // bulk insert by itself, and would otherwise do it in the middle of
        // the measurement that follows.
        SqlPool::Postgres(_) => {
            pool.batch("VACUUM (ANALYZE) ag_users, ag_sessions, ag_turns")
                .await?
        }
        SqlPool::MySql(_) => {
            pool.batch("ANALYZE TABLE ag_users, ag_sessions, ag_turns")
                .await?
        }
    }
    Ok(())
}

fn to_i64(value: u64) -> i64 {
    // Bounded by limits::MAX_SESSIONS, far below i64::MAX.
    i64::try_from(value).unwrap_or(i64::MAX)
}
