//! agentgate's PostgreSQL store: many app nodes sharing one database.
//!
//! - [`PostgresStore`] (this file): opening, the connection pool, the
//!   transaction every step runs in, the schema runner.
//! - `connect`: the URL turned into connect options: `sslmode`,
//!   `sslrootcert`, client certificates, unknown parameters refused.
//! - `begin`: the begin step (docs/protocol.md §3.1): lock the user's row, then the
//!   session's row, read, decide, apply; the common new turn in one
//!   statement (`ag_begin_new`, migration 0006) that falls back to that.
//! - `steps`: heartbeat, tool claims and completions, turn endings.
//! - `lease`: the caller's lease checked under the session's row lock (and
//!   refusals explained), or stated as the condition of a one-statement step.
//! - `views`: read-only views, cap overrides and the retention sweeper.
//! - `rows`: rows decoded into core snapshots and views.
//! - `error`: SQLSTATEs mapped to the engine's portable
//!   [`Error`](agentgate_core::error::Error), and the
//!   bounded retry of a step after a transient conflict.
//! - [`admin`]: creating and dropping whole databases (scratch stores).
//! - `testing` (feature `testing`, and this crate's own tests): fresh
//!   throw-away databases for test suites.
//!
//! A begin, a claim that finds its call's execution, and a completion with a
//! same-transaction effect are each one short READ COMMITTED transaction
//! whose row locks serialise exactly what must be serialised: a begin locks
//! the user's row (`ag_users`), then the session's row; the others lock the
//! session's row only. Lock order is always user → session → turn → tool
//! execution, so steps queue instead of deadlocking; a deadlock,
//! serialization failure, unique violation or lock timeout anyway runs the
//! whole step again, at most `MAX_STORE_RETRIES` times. A heartbeat, a first
//! tool claim, a completion with a result, a tool failure and a turn ending
//! are each one autocommit statement whose condition is the lease check
//! (`steps` says why that is as safe): one round trip. So is the common
//! begin (a new turn on a free session, a permit free, no lease layer): one
//! call of a PL/pgSQL function that takes the begin's locks in the same
//! order and grants only where `decide_begin` would (`begin` maps it),
//! else answers "fall back" having written nothing.
//!
//! With an external lease layer (`open_with_leases`, the Redis layer) the
//! session row keeps the holder and the newest fence but no expiry: the layer
//! is the authority on liveness and permits, and every durable write still
//! requires the SQL rows to agree that the writer's fence is the session's
//! newest, so a holder whose layer lease vanished cannot overwrite a newer
//! turn.
//!
//! Works behind PgBouncer in transaction mode: no session state is relied on
//! (timeouts are `SET LOCAL`, the migration lock is `pg_advisory_xact_lock`).
//! PgBouncer must be 1.21 or newer with `max_prepared_statements` set, since
//! sqlx prepares its statements.
//!
//! Architecture invariant: the decisions come from `agentgate_core::decide`;
//! this crate reads snapshots and applies decisions, nothing more. Time is the
//! PostgreSQL clock (`NOW_MS`), never an app-side clock.
#![forbid(unsafe_code)]

pub mod admin;
mod begin;
mod connect;
mod error;
mod lease;
mod notify;
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
use agentgate_core::error::Result;
use agentgate_core::lease::LeaseLayer;
use agentgate_core::limits::STORE_ACQUIRE_TIMEOUT;
use agentgate_store_sql::tx::Tx;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool, Postgres};

use crate::error::map_sqlx;

/// The store's clock in SQL: milliseconds since the Unix epoch.
///
/// `statement_timestamp()`, not `now()` and not `clock_timestamp()`: `now()`
/// is the start of the transaction, stale by any lock wait earlier in the
/// step, and `clock_timestamp()` changes while one statement runs, so two
/// uses in one statement could disagree about whether a lease is live. The
/// statement's start is one instant per statement, and every step reads it
/// in a statement sent after the statement that took its locks.
pub(crate) const NOW_MS: &str = "floor(extract(epoch from statement_timestamp()) * 1000)::bigint";

/// Opens every step's transaction, with its limits, in one round trip:
///
/// - `lock_timeout` 5 s: how long a statement waits for a row lock before
///   failing with `55P03` (then the step is retried). Locks are held for one
///   short step; five seconds of waiting means the holder is wedged, not busy.
/// - `idle_in_transaction_session_timeout` 60 s: how long the transaction may
///   sit idle (the app node sends nothing) before the server ends the
///   connection and releases its row locks. Only a same-transaction side
///   effect leaves a step idle; one that takes a minute has hung, and the
///   session's row must not stay locked forever.
/// - `statement_timeout` 10 s: no statement of a step runs longer; with the
///   lock wait above it is the server's own bound under the step's deadline
///   (`agentgate_core::limits::STORE_STEP_DEADLINE`, which also covers a
///   server that stops answering at all).
///
/// All are `SET LOCAL`, so they end with the transaction (PgBouncer-safe).
const BEGIN_STEP: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '5s'; \
    SET LOCAL idle_in_transaction_session_timeout = '60s'; SET LOCAL statement_timeout = '10s'";

/// [`BEGIN_STEP`]'s `lock_timeout`, for a step that takes its row locks in
/// one autocommit statement and sets it for that statement alone (the
/// one-statement begin).
pub(crate) const STEP_LOCK_TIMEOUT: &str = "5s";

/// Opens the migration transaction. Its lock wait is longer than a step's:
/// another node may be applying the schema, which takes a few seconds at most.
const BEGIN_MIGRATION: &str = "BEGIN; SET LOCAL lock_timeout = '60s'";

/// A pooled connection idle for longer than this is pinged before use. A
/// connection used a moment ago is almost surely alive; one idle for a while
/// may have been cut by a proxy or a server restart. Skipping the ping on
/// busy connections saves a round trip per step.
const PING_AFTER_IDLE: Duration = Duration::from_secs(5);

/// The key of the transaction-scoped advisory lock that serialises schema
/// migrations of one database ("agentgat" in ASCII). Advisory keys are
/// per-database, so stores on different databases do not contend.
const MIGRATION_LOCK_KEY: i64 = 0x6167_656e_7467_6174;

/// The schema, in order. Each entry is applied once, in one transaction
/// (PostgreSQL DDL is transactional) under [`MIGRATION_LOCK_KEY`].
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../migrations/0001_init.sql")),
    (2, include_str!("../migrations/0002_overview.sql")),
    (3, include_str!("../migrations/0003_claim_seq.sql")),
    (4, include_str!("../migrations/0004_orphans.sql")),
    (5, include_str!("../migrations/0005_confirms_pending.sql")),
    (6, include_str!("../migrations/0006_begin_new.sql")),
    (7, include_str!("../migrations/0007_claim_order.sql")),
    (8, include_str!("../migrations/0008_cancel.sql")),
    (9, include_str!("../migrations/0009_begin_layered.sql")),
    (10, include_str!("../migrations/0010_queue.sql")),
    (11, include_str!("../migrations/0011_session_policy.sql")),
    (12, include_str!("../migrations/0012_events.sql")),
    (13, include_str!("../migrations/0013_user_queue.sql")),
];

/// agentgate on a PostgreSQL database.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    config: Config,
    /// Where leases and permits live when not in the session rows (Redis).
    /// Fences and every durable record stay here either way.
    leases: Option<Arc<dyn LeaseLayer>>,
    /// Waiting begins' watches on session releases.
    wakeups: agentgate_store_sql::wakeups::Wakeups,
    /// Followers of turns' event logs, by turn id.
    event_wakeups: agentgate_store_sql::wakeups::Wakeups,
    /// The `LISTEN` task that feeds `wakeups` from other nodes, started by
    /// the first waiting begin.
    listener: notify::Slot,
}

impl PostgresStore {
    /// Connects to the database at `url` (`postgres://user@host:port/db`,
    /// also `postgresql://`), and applies the schema, waiting for another
    /// node that is applying it at the same moment.
    ///
    /// TLS as in libpq: `?sslmode=verify-full&sslrootcert=/path/ca.pem`
    /// (also `sslcert` and `sslkey` for a client certificate); the `connect`
    /// module lists the rules. TLS needs the crate's `tls` feature.
    ///
    /// # Errors
    /// `invalid_request` for a bad URL (an unknown parameter, a bad
    /// `sslmode`, an unreadable TLS file) or config; `store_unavailable` when
    /// the server cannot be reached within the acquire timeout or the schema
    /// cannot be applied.
    pub async fn open(url: &str, config: Config) -> Result<Self> {
        Self::open_with_leases(url, config, None).await
    }

    /// Opens like [`PostgresStore::open`], keeping leases and permits in
    /// `leases` when given (the Redis lease layer) instead of the session
    /// rows. Durable writes stay conditioned on the session's newest fence.
    ///
    /// # Errors
    /// As [`PostgresStore::open`].
    pub async fn open_with_leases(
        url: &str,
        config: Config,
        leases: Option<Arc<dyn LeaseLayer>>,
    ) -> Result<Self> {
        config.validate()?;
        let options = connect::connect_options(url)?.application_name("agentgate");
        let pool = PgPoolOptions::new()
            .max_connections(config.store_connections)
            .acquire_timeout(STORE_ACQUIRE_TIMEOUT)
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
        let store = Self {
            pool,
            config,
            leases,
            wakeups: agentgate_store_sql::wakeups::Wakeups::default(),
            event_wakeups: agentgate_store_sql::wakeups::Wakeups::default(),
            listener: notify::Slot::default(),
        };
        store.migrate().await?;
        Ok(store)
    }

    /// Opens the transaction a protocol step runs in, with its lock and idle
    /// timeouts, in one round trip.
    pub(crate) async fn transaction(&self) -> Result<Tx<Postgres>> {
        Tx::begin(&self.pool, BEGIN_STEP, AFTER_CUT)
            .await
            .map_err(map_sqlx)
    }

    async fn migrate(&self) -> Result<()> {
        let mut tx = Tx::begin(&self.pool, BEGIN_MIGRATION, AFTER_CUT)
            .await
            .map_err(map_sqlx)?;
        // Lock first: two nodes creating the version table at once would
        // otherwise race on the catalog (a unique violation in pg_type).
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATION_LOCK_KEY)
            .execute(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        agentgate_store_sql::apply_migrations!(
            &mut *tx,
            MIGRATIONS,
            create = "CREATE TABLE IF NOT EXISTS ag_schema_version (version BIGINT PRIMARY KEY, \
                      applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
            record = "INSERT INTO ag_schema_version (version) VALUES ($1)",
            errors = map_sqlx,
        )?;
        tx.commit().await.map_err(map_sqlx)
    }

    /// The connection pool, for applications that keep their own tables in
    /// the same database (the reference ledger does).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

agentgate_store_sql::raw_sql_fn!(raw_sql, sqlx::PgConnection);

/// A PostgreSQL connection whose step was cut off is rolled back and
/// pooled again: the driver keeps its place in the protocol across a cut.
pub(crate) const AFTER_CUT: agentgate_store_sql::tx::AfterCut<sqlx::Postgres> =
    agentgate_store_sql::tx::AfterCut::RollBack(raw_sql);

agentgate_store_sql::impl_store!(
    PostgresStore,
    listen = crate::notify::listen,
    announce = crate::notify::announce_events
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_one_statement_begin_waits_for_locks_as_long_as_a_step() {
        assert!(BEGIN_STEP.contains(&format!("SET LOCAL lock_timeout = '{STEP_LOCK_TIMEOUT}'")));
    }
}
