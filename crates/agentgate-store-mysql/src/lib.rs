//! agentgate's MySQL/MariaDB store: many app nodes sharing one database.
//!
//! - [`MySqlStore`] (this file): opening, the connection pool and its session
//!   settings, the transaction every step runs in, the schema runner.
//! - `connect`: the URL turned into connect options: `ssl-mode`, `ssl-ca`,
//!   client certificates, unknown parameters refused.
//! - `begin`: the begin step (docs/protocol.md §3.1): lock the user's row, then the
//!   session's row, read, decide, apply.
//! - `steps`: heartbeat, tool claims and completions, turn endings.
//! - `fast`: the one-round-trip fast paths the steps try first (a first
//!   begin and an ending, each one `CALL` of a stored procedure; a first
//!   claim, a completion with a plain result).
//! - `views`: read-only views, cap overrides and the retention sweeper.
//! - `rows`: rows decoded into core snapshots and views.
//! - `error`: server error numbers mapped to the engine's portable
//!   [`Error`], and the bounded retry of a step after a transient conflict.
//! - [`admin`]: creating and dropping whole databases (scratch stores).
//! - `testing` (feature `testing`, and this crate's own tests): fresh
//!   throw-away databases for test suites.
//!
//! Every protocol step is one short InnoDB transaction at READ COMMITTED
//! (no gap locks, so locking a row that does not exist yet cannot deadlock
//! a concurrent insert). A begin locks the user's row, then the session's
//! row, each with `INSERT … ON DUPLICATE KEY UPDATE` (which creates the row or
//! takes its exclusive lock in one statement, unlike `INSERT IGNORE`, whose
//! shared lock on an existing row deadlocks two upgraders), then the fence
//! counter; every later step locks only the session's row. Lock order is
//! always user → session → fence → turn → tool execution, in the stored
//! procedures of the fast begin and ending too (the claim and completion
//! fast statements lock in their join's order instead; `fast` says why that
//! stays safe). A deadlock, lock wait timeout or duplicate key anyway runs
//! the whole step again, at most `MAX_STORE_RETRIES` times. MySQL has no
//! `UPDATE … RETURNING`, so steps read what they wrote in the same
//! transaction where they need it, or (a fast ending with a lease layer)
//! read the row first and write only if it is still as read.
//!
//! With an external lease layer (`open_with_leases`, the Redis layer) the
//! session row keeps the holder and the newest fence but no expiry: the layer
//! is the authority on liveness and permits, and every durable write still
//! requires the SQL rows to agree that the writer's fence is the session's
//! newest, so a holder whose layer lease vanished cannot overwrite a newer
//! turn.
//!
//! Requires InnoDB and `binlog_format` ROW or MIXED (the defaults), since
//! statement-based binary logging refuses READ COMMITTED writes. The schema
//! includes two stored procedures (migration 0006, the fast begin and
//! ending), so the user that first opens a database needs `CREATE ROUTINE`
//! and `ALTER ROUTINE` beside the table privileges, and a user that only
//! runs steps needs `EXECUTE` on them (MySQL and MariaDB give the creator
//! both by default; the procedures run with their definer's rights).
//!
//! Architecture invariant: the decisions come from `agentgate_core::decide`;
//! this crate reads snapshots and applies decisions, nothing more. Time is the
//! server's clock (`NOW_MS`), never an app-side clock.
#![forbid(unsafe_code)]

pub mod admin;
mod begin;
mod connect;
mod error;
mod fast;
mod orphans;
mod rows;
mod run;
mod steps;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod views;

use std::sync::Arc;
use std::time::Duration;

use agentgate_core::config::Config;
use agentgate_core::error::{Error, Result};
use agentgate_core::lease::LeaseLayer;
use agentgate_core::limits::STORE_ACQUIRE_TIMEOUT;
use agentgate_store_sql::tx::Tx;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{Connection, Executor, MySql, MySqlConnection, MySqlPool};

use crate::connect::connect_options;
use crate::error::map_sqlx;

/// The store's clock in SQL: milliseconds since the Unix epoch.
///
/// `UTC_TIMESTAMP(6)` is the server's clock read once at the start of the
/// statement (like PostgreSQL's `statement_timestamp()`), so every use in one
/// statement agrees, and every step reads it in a statement sent after the
/// statement that took its locks. Unlike `UNIX_TIMESTAMP(CURRENT_TIMESTAMP(6))`
/// it goes through no session time zone (no DST fold to misread) and has no
/// 2038 limit.
pub(crate) const NOW_MS: &str =
    "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

/// Session settings of every pooled connection, sent once per connection:
///
/// - READ COMMITTED: each statement reads the newest committed rows (a begin
///   counts permits after taking its locks and sees every earlier grant), and
///   InnoDB takes no gap locks, which would deadlock concurrent inserts.
/// - `innodb_lock_wait_timeout` 5 s (default 50 s): locks are held for one
///   short step; five seconds of waiting means the holder is wedged, not
///   busy. The step is then retried within its bound.
/// - MariaDB only (the `/*M! */` comment is skipped by MySQL):
///   `idle_transaction_timeout` 60 s: a transaction idle that long (only a
///   same-transaction side effect leaves a step idle, and one that takes a
///   minute has hung) is ended with its connection, so the session's row
///   does not stay locked forever; `max_statement_time` 10 s: no statement
///   (a procedure's included) runs longer. MySQL's own `max_execution_time`
///   bounds `SELECT`s alone, so there the step's deadline
///   (`agentgate_core::limits::STORE_STEP_DEADLINE`) is the bound, as it is
///   for a server that stops answering at all.
const SESSION_SETTINGS: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; \
    SET SESSION innodb_lock_wait_timeout = 5 \
    /*M!, idle_transaction_timeout = 60, max_statement_time = 10 */";

/// A pooled connection idle for longer than this is pinged before use. A
/// connection used a moment ago is almost surely alive; one idle for a while
/// may have been cut by a proxy or a server restart. Skipping the ping on
/// busy connections saves a round trip per step.
const PING_AFTER_IDLE: Duration = Duration::from_secs(5);

/// How long a node waits for another node's schema migration. Creating the
/// tables takes well under a second; thirty seconds means the other node is
/// stuck, and opening fails instead of waiting forever.
const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// The schema, in order. MySQL DDL is not transactional: each migration is
/// idempotent and runs under the named lock `GET_LOCK`, which serialises the
/// nodes that open the same database at once.
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../migrations/0001_init.sql")),
    (2, include_str!("../migrations/0002_overview.sql")),
    (3, include_str!("../migrations/0003_orphans.sql")),
    (4, include_str!("../migrations/0004_id_chars.sql")),
    (5, include_str!("../migrations/0005_confirms_pending.sql")),
    (6, include_str!("../migrations/0006_fast_procedures.sql")),
    (7, include_str!("../migrations/0007_claim_seq.sql")),
    (8, include_str!("../migrations/0008_cancel.sql")),
    (9, include_str!("../migrations/0009_begin_layered.sql")),
    (10, include_str!("../migrations/0010_queue.sql")),
    (11, include_str!("../migrations/0011_session_policy.sql")),
    (12, include_str!("../migrations/0012_events.sql")),
    (13, include_str!("../migrations/0013_user_queue.sql")),
];

/// agentgate on a MySQL or MariaDB database.
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    config: Config,
    /// Where leases and permits live when not in the session rows (Redis).
    /// Fences and every durable record stay here either way.
    leases: Option<Arc<dyn LeaseLayer>>,
    /// Waiting begins' watches on session releases.
    wakeups: agentgate_store_sql::wakeups::Wakeups,
    /// Followers of turns' event logs, by turn id.
    event_wakeups: agentgate_store_sql::wakeups::Wakeups,
    /// The database's name, which the test suites' path counts are kept by.
    #[cfg(any(test, feature = "testing"))]
    database: String,
}

impl MySqlStore {
    /// Connects to the database at `url` (`mysql://user:password@host:port/db`,
    /// also `mariadb://`), and applies the schema, waiting for another node
    /// that is applying it at the same moment.
    ///
    /// TLS as in the MySQL client: `?ssl-mode=VERIFY_IDENTITY&ssl-ca=/path/ca.pem`
    /// (also `ssl-cert` and `ssl-key` for a client certificate); the
    /// `connect` module lists the rules. TLS needs the crate's `tls` feature.
    ///
    /// # Errors
    /// `invalid_request` for a bad URL (an unknown parameter, a bad
    /// `ssl-mode`, an unreadable TLS file) or config; `store_unavailable` when
    /// the server cannot be reached within the acquire timeout or the schema
    /// cannot be applied.
    pub async fn open(url: &str, config: Config) -> Result<Self> {
        Self::open_with_leases(url, config, None).await
    }

    /// Opens like [`MySqlStore::open`], keeping leases and permits in
    /// `leases` when given (the Redis lease layer) instead of the session
    /// rows. Durable writes stay conditioned on the session's newest fence.
    ///
    /// # Errors
    /// As [`MySqlStore::open`].
    pub async fn open_with_leases(
        url: &str,
        config: Config,
        leases: Option<Arc<dyn LeaseLayer>>,
    ) -> Result<Self> {
        config.validate()?;
        let options = connect_options(url)?;
        migrate(&options).await?;
        #[cfg(any(test, feature = "testing"))]
        let database = options.get_database().unwrap_or_default().to_owned();
        let pool = MySqlPoolOptions::new()
            .max_connections(config.store_connections)
            .acquire_timeout(STORE_ACQUIRE_TIMEOUT)
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    // No arguments: sent as one text query, both statements.
                    conn.execute(SESSION_SETTINGS).await?;
                    Ok(())
                })
            })
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for >= PING_AFTER_IDLE {
                        conn.ping().await?;
                    }
                    Ok(true)
                })
            })
            .connect_with(options)
            .await
            .map_err(map_sqlx)?;
        Ok(Self {
            pool,
            config,
            leases,
            wakeups: agentgate_store_sql::wakeups::Wakeups::default(),
            event_wakeups: agentgate_store_sql::wakeups::Wakeups::default(),
            #[cfg(any(test, feature = "testing"))]
            database,
        })
    }

    /// Opens the transaction a protocol step runs in.
    pub(crate) async fn transaction(&self) -> Result<Tx<MySql>> {
        Tx::begin(&self.pool, "BEGIN", AFTER_CUT)
            .await
            .map_err(map_sqlx)
    }

    /// A pooled connection for statements outside a transaction; give it
    /// back with `release` once they were answered (dropped instead, it is
    /// closed: see [`AFTER_CUT`]).
    pub(crate) async fn held(&self) -> Result<agentgate_store_sql::tx::Held<sqlx::MySql>> {
        agentgate_store_sql::tx::Held::acquire(&self.pool, AFTER_CUT)
            .await
            .map_err(map_sqlx)
    }

    /// The connection pool, for applications that keep their own tables in
    /// the same database (the reference ledger does).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }
}

/// Applies the pending migrations on a connection of its own, under a named
/// lock scoped to the database. The lock belongs to the connection, so it is
/// released when the connection closes, whatever happened.
async fn migrate(options: &MySqlConnectOptions) -> Result<()> {
    let mut conn = tokio::time::timeout(
        STORE_ACQUIRE_TIMEOUT,
        MySqlConnection::connect_with(options),
    )
    .await
    .map_err(|_| Error::store("timed out connecting to MySQL"))?
    .map_err(map_sqlx)?;
    let outcome = migrate_on(&mut conn).await;
    // Closing releases the named lock even if RELEASE_LOCK was never reached.
    let _ = conn.close().await;
    outcome
}

async fn migrate_on(conn: &mut MySqlConnection) -> Result<()> {
    let locked: Option<i64> = sqlx::query_scalar(
        "SELECT GET_LOCK(LEFT(CONCAT('agentgate_migrate.', COALESCE(DATABASE(), '')), 64), ?)",
    )
    .bind(MIGRATION_LOCK_TIMEOUT.as_secs())
    .fetch_one(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    if locked != Some(1) {
        return Err(Error::store(format!(
            "another node held the schema migration lock for {MIGRATION_LOCK_TIMEOUT:?}"
        )));
    }
    agentgate_store_sql::apply_migrations!(
        &mut *conn,
        MIGRATIONS,
        create =
            "CREATE TABLE IF NOT EXISTS ag_schema_version (version BIGINT NOT NULL PRIMARY KEY, \
                  applied_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB",
        record = "INSERT IGNORE INTO ag_schema_version (version) VALUES (?)",
        errors = map_sqlx,
    )?;
    sqlx::query(
        "SELECT RELEASE_LOCK(LEFT(CONCAT('agentgate_migrate.', COALESCE(DATABASE(), '')), 64))",
    )
    .execute(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    Ok(())
}

/// A MySQL connection dropped inside its transaction or statement is
/// closed, never pooled again, unless its step gave it up with every
/// statement answered (`Tx::abandon`, `Held::release`): sqlx's MySQL driver
/// can lose its place in the protocol when cut mid-statement (see
/// `agentgate_store_sql::tx`).
pub(crate) const AFTER_CUT: agentgate_store_sql::tx::AfterCut<sqlx::MySql> =
    agentgate_store_sql::tx::AfterCut::Close;

agentgate_store_sql::impl_store!(MySqlStore);
