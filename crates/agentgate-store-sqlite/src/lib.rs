//! agentgate's embedded SQLite store: the default, zero-setup backend.
//!
//! - [`SqliteStore`] (this file): opening, pragmas, pools, the schema runner.
//! - `begin`: the begin step (docs/protocol.md §3.1) in one `BEGIN IMMEDIATE` transaction.
//! - `steps`: heartbeat, tool claims and completions, turn endings.
//! - `views`: read-only views and the retention sweeper.
//! - `orphans`: listing orphaned turns and ending them `abandoned`.
//! - `error`: SQLite errors mapped to the engine's portable [`Error`].
//!
//! Every protocol step writes on the writer pool (one connection), so
//! in-process steps queue in FIFO order instead of spinning in SQLite's busy
//! handler, and steps from other processes on the same file wait on the busy
//! timeout. A step that reads before it decides runs in one `BEGIN IMMEDIATE`
//! transaction; a step whose common case is one write (heartbeat, a first
//! tool claim, a tool completion) is one autocommit statement carrying the
//! whole lease check, which SQLite runs as atomically as a transaction; when
//! it changes no row, a read explains the refusal or the step's full
//! transaction does the rarer work (see `steps`). Reads for views and for
//! explaining a refusal use a separate pool; under WAL they never block the
//! writer.
//!
//! Architecture invariant: the decisions come from `agentgate_core::decide`;
//! this crate reads snapshots and applies decisions, nothing more. Time is the
//! SQLite clock (`NOW_MS`), never an app-side clock.
#![forbid(unsafe_code)]

mod begin;
mod error;
mod orphans;
mod rows;
mod run;
mod steps;
mod views;

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentgate_core::config::Config;
use agentgate_core::error::{Error, Result};
use agentgate_core::lease::LeaseLayer;
use agentgate_core::limits::{MAX_STORE_RETRIES, STORE_ACQUIRE_TIMEOUT};
use agentgate_store_sql::tx::Tx;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool};

use crate::error::{is_busy, map_sqlx};

/// The store's clock in SQL: milliseconds since the Unix epoch.
pub(crate) const NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// How long a step waits for another process's write lock on the file before
/// reporting `store_unavailable`. Protocol steps are short (well under 10 ms);
/// five seconds of waiting means the file is wedged, not busy.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Pause before re-opening a file another process is setting up, times the
/// attempt number.
const OPEN_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Reader connections for views. Views are dashboard and GET traffic; four
/// readers keep them from queueing behind each other on a 2-core machine.
const READER_CONNECTIONS: u32 = 4;

/// The schema, in order. Each entry is applied once, in its own transaction.
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../migrations/0001_init.sql")),
    (2, include_str!("../migrations/0002_overview.sql")),
    (3, include_str!("../migrations/0003_orphans.sql")),
    (4, include_str!("../migrations/0004_confirms_pending.sql")),
    (5, include_str!("../migrations/0005_claim_seq.sql")),
    (6, include_str!("../migrations/0006_begin_new.sql")),
    (7, include_str!("../migrations/0007_end_release.sql")),
    (8, include_str!("../migrations/0008_begin_layered.sql")),
    (9, include_str!("../migrations/0009_cancel.sql")),
    (10, include_str!("../migrations/0010_queue.sql")),
    (11, include_str!("../migrations/0011_session_policy.sql")),
    (12, include_str!("../migrations/0012_events.sql")),
    (13, include_str!("../migrations/0013_user_queue.sql")),
];

/// agentgate on an embedded SQLite file.
#[derive(Clone)]
pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
    config: Config,
    /// Where leases and permits live when not in the session rows (Redis).
    /// Fences and every durable record stay here either way.
    leases: Option<Arc<dyn LeaseLayer>>,
    /// Waiting begins' watches on session releases.
    wakeups: agentgate_store_sql::wakeups::Wakeups,
    /// Followers of turns' event logs, by turn id.
    event_wakeups: agentgate_store_sql::wakeups::Wakeups,
    /// Explicit write transactions begun (`BEGIN IMMEDIATE`), for
    /// [`SqliteStore::transactions_begun`].
    transactions: Arc<AtomicU64>,
}

impl SqliteStore {
    /// Opens (creating if missing) the SQLite file at `url`
    /// (`sqlite://path` or `sqlite:path`), in WAL mode with `synchronous=FULL`,
    /// and applies the schema.
    ///
    /// `FULL` syncs the WAL on every commit, so a committed step survives a
    /// power loss, not only a process crash. `NORMAL` (the common WAL choice)
    /// may drop the last commits on power loss, among them a fence increment:
    /// the next grant would then hand out a fence already seen, breaking
    /// docs/protocol.md §4.5 and §4.8. The cost is measured in BENCHMARKS.md.
    ///
    /// # Errors
    /// `invalid_request` for a bad URL or config; `store_unavailable` when the
    /// file cannot be opened or migrated.
    pub async fn open(url: &str, config: Config) -> Result<Self> {
        Self::open_with_leases(url, config, None).await
    }

    /// Opens like [`SqliteStore::open`], keeping leases and permits in
    /// `leases` when given (the Redis lease layer) instead of the session
    /// rows. Durable writes stay conditioned on the session's newest fence.
    ///
    /// # Errors
    /// As [`SqliteStore::open`].
    pub async fn open_with_leases(
        url: &str,
        config: Config,
        leases: Option<Arc<dyn LeaseLayer>>,
    ) -> Result<Self> {
        config.validate()?;
        if url.contains(":memory:") || url.contains("mode=memory") {
            return Err(Error::invalid(
                "an in-memory SQLite database is private to one connection; use a file",
            ));
        }
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| Error::invalid(format!("bad sqlite url: {e}")))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        // Several processes opening a fresh file at once can meet SQLITE_BUSY
        // where SQLite does not wait (switching the file to WAL): retry the
        // whole open, within the same bound as any busy step.
        let mut attempt = 0;
        loop {
            match Self::connect(&options, &config, leases.clone()).await {
                Err(error) if is_busy(&error) && attempt < MAX_STORE_RETRIES => {
                    attempt += 1;
                    tracing::debug!(%error, attempt, "sqlite busy while opening; retrying");
                    tokio::time::sleep(OPEN_RETRY_PAUSE * attempt).await;
                }
                result => return result,
            }
        }
    }

    async fn connect(
        options: &SqliteConnectOptions,
        config: &Config,
        leases: Option<Arc<dyn LeaseLayer>>,
    ) -> Result<Self> {
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(STORE_ACQUIRE_TIMEOUT)
            .connect_with(options.clone())
            .await
            .map_err(map_sqlx)?;
        let reader = SqlitePoolOptions::new()
            .max_connections(READER_CONNECTIONS)
            .acquire_timeout(STORE_ACQUIRE_TIMEOUT)
            .connect_with(options.clone())
            .await
            .map_err(map_sqlx)?;
        let store = Self {
            writer,
            reader,
            config: config.clone(),
            leases,
            wakeups: agentgate_store_sql::wakeups::Wakeups::default(),
            event_wakeups: agentgate_store_sql::wakeups::Wakeups::default(),
            transactions: Arc::default(),
        };
        store.migrate().await?;
        Ok(store)
    }

    /// Begins the write transaction every protocol step runs in. `IMMEDIATE`
    /// takes the write lock up front, so a step that reads then writes never
    /// fails to upgrade its snapshot.
    pub(crate) async fn write(&self) -> Result<Tx<Sqlite>> {
        self.transactions.fetch_add(1, Ordering::Relaxed);
        Tx::begin(&self.writer, "BEGIN IMMEDIATE", AFTER_CUT)
            .await
            .map_err(map_sqlx)
    }

    /// The writer connection outside a transaction, for one autocommit
    /// statement.
    pub(crate) async fn writer_connection(&self) -> Result<PoolConnection<Sqlite>> {
        self.writer.acquire().await.map_err(map_sqlx)
    }

    async fn migrate(&self) -> Result<()> {
        let mut tx = self.write().await?;
        agentgate_store_sql::apply_migrations!(
            &mut *tx,
            MIGRATIONS,
            create = "CREATE TABLE IF NOT EXISTS ag_schema_version (version INTEGER NOT NULL)",
            record = "INSERT INTO ag_schema_version (version) VALUES (?)",
            errors = map_sqlx,
        )?;
        tx.commit().await.map_err(map_sqlx)
    }

    /// How many explicit write transactions (`BEGIN IMMEDIATE … COMMIT` or
    /// `ROLLBACK`) this store has begun. Each is two calls into SQLite beyond
    /// its statements; single-statement steps run without one (autocommit).
    /// For benchmarks that count calls per step.
    pub fn transactions_begun(&self) -> u64 {
        self.transactions.load(Ordering::Relaxed)
    }

    /// The underlying writer pool, for applications that keep their own tables
    /// in the same file (the reference ledger does).
    pub fn pool(&self) -> &SqlitePool {
        &self.writer
    }
}

agentgate_store_sql::raw_sql_fn!(raw_sql, sqlx::SqliteConnection);

/// A SQLite connection whose step was cut off is rolled back and pooled
/// again: the driver's worker keeps its place across a cut.
pub(crate) const AFTER_CUT: agentgate_store_sql::tx::AfterCut<sqlx::Sqlite> =
    agentgate_store_sql::tx::AfterCut::RollBack(raw_sql);

agentgate_store_sql::impl_store!(SqliteStore);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// `PRAGMA synchronous` as SQLite reports it: 2 is `FULL`, 1 `NORMAL`.
    const SYNCHRONOUS_FULL: i64 = 2;

    /// Every connection of both pools syncs each commit: a power loss cannot
    /// drop a committed fence increment. Each pool is drained so that every
    /// one of its connections answers, not just the first.
    #[tokio::test]
    async fn every_connection_syncs_each_commit() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("sync.db").display());
        let store = SqliteStore::open(&url, Config::default()).await.unwrap();
        let mut checked = 0;
        for (pool, size) in [(&store.writer, 1), (&store.reader, READER_CONNECTIONS)] {
            let mut held = Vec::new();
            for _ in 0..size {
                let mut conn = pool.acquire().await.unwrap();
                let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
                assert_eq!(
                    level, SYNCHRONOUS_FULL,
                    "synchronous on a pooled connection"
                );
                checked += 1;
                held.push(conn);
            }
        }
        assert_eq!(checked, 1 + READER_CONNECTIONS);
    }
}
