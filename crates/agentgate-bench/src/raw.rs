//! The raw baseline: the least a correct implementation must send the store
//! for the same turn, with the same driver (sqlx, redis-rs), the same pool
//! sizing and the same concurrency as the engine.
//!
//! Four statements per turn, each on its own (autocommit: one implicit
//! transaction per statement), on bench-owned tables in the run's database:
//!
//! 1. lease acquire: `UPDATE bench_leases SET holder = ?, expires_at_ms =
//!    now + ttl WHERE session_id = ? AND (holder IS NULL OR expires_at_ms <
//!    now)` on a pre-inserted row, time on the store's clock;
//! 2. tool-row insert, keyed by the execution key (turn, tool, args hash);
//! 3. tool-row update to `succeeded` with the result;
//! 4. owner-checked release: `UPDATE … SET holder = NULL WHERE session_id = ?
//!    AND holder = ?`.
//!
//! With Redis, the lease is `SET key holder NX PX ttl` and a compare-and-
//! delete script (`EVALSHA`); the two tool writes stay in SQL.
//!
//! The SQLite pool copies the store's: WAL, `synchronous=FULL`, a 5 s busy
//! timeout, one connection. PostgreSQL and MySQL pools have the stores'
//! ten connections.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, Executor, MySqlPool, PgPool, SqlitePool};

use crate::error::{BenchError, Result};
use crate::library::TOOL;
use crate::limits::{POOL_ACQUIRE_TIMEOUT, SERVER_POOL_CONNECTIONS, SQLITE_BUSY_TIMEOUT};
use crate::target::Dialect;
use crate::url::Url;
use crate::workload::{next_request, session_of, timed, TurnLoop, STEPS};

/// The stores' clocks in SQL (each store's `NOW_MS`), so the baseline reads
/// time where the engine does.
const SQLITE_NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";
const POSTGRES_NOW_MS: &str = "floor(extract(epoch from statement_timestamp()) * 1000)::bigint";
const MYSQL_NOW_MS: &str =
    "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

/// The lease a raw turn takes, as long as the engine's default.
const RAW_LEASE_TTL_MS: i64 = 30_000;

/// Compare-and-delete: releases the lease only if `holder` still holds it.
const RELEASE_SCRIPT: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

/// A SQL pool of the store's dialect.
#[derive(Clone, Debug)]
pub(crate) enum SqlPool {
    /// SQLite, one connection.
    Sqlite(SqlitePool),
    /// PostgreSQL.
    Postgres(PgPool),
    /// MySQL or MariaDB.
    MySql(MySqlPool),
}

impl SqlPool {
    /// Opens a pool sized like the store's on `url` (the run's database).
    ///
    /// # Errors
    /// `Sql` when the database cannot be reached.
    pub(crate) async fn open(dialect: Dialect, url: &str) -> Result<Self> {
        Self::open_with(dialect, url, true).await
    }

    /// As [`SqlPool::open`], without sqlx's statement log: for bulk loading,
    /// whose second-long statements would otherwise be logged as slow.
    ///
    /// # Errors
    /// As [`SqlPool::open`].
    pub(crate) async fn open_quiet(dialect: Dialect, url: &str) -> Result<Self> {
        Self::open_with(dialect, url, false).await
    }

    async fn open_with(dialect: Dialect, url: &str, log_statements: bool) -> Result<Self> {
        Ok(match dialect {
            Dialect::Sqlite => {
                let options = SqliteConnectOptions::from_str(url)?
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    .busy_timeout(SQLITE_BUSY_TIMEOUT)
                    .foreign_keys(true);
                let options = quiet(options, log_statements);
                Self::Sqlite(
                    SqlitePoolOptions::new()
                        .max_connections(1)
                        .acquire_timeout(POOL_ACQUIRE_TIMEOUT)
                        .connect_with(options)
                        .await?,
                )
            }
            Dialect::Postgres => Self::Postgres(
                PgPoolOptions::new()
                    .max_connections(SERVER_POOL_CONNECTIONS)
                    .acquire_timeout(POOL_ACQUIRE_TIMEOUT)
                    .test_before_acquire(false)
                    .connect_with(quiet(PgConnectOptions::from_str(url)?, log_statements))
                    .await?,
            ),
            Dialect::MySql => {
                let url = Url::parse(url)?.with_scheme("mysql").to_url_string();
                let options = MySqlConnectOptions::from_str(&url)?
                    .charset("utf8mb4")
                    .timezone(Some(String::from("+00:00")));
                let options = quiet(options, log_statements);
                Self::MySql(
                    MySqlPoolOptions::new()
                        .max_connections(SERVER_POOL_CONNECTIONS)
                        .acquire_timeout(POOL_ACQUIRE_TIMEOUT)
                        .test_before_acquire(false)
                        .connect_with(options)
                        .await?,
                )
            }
        })
    }

    /// The dialect.
    pub(crate) fn dialect(&self) -> Dialect {
        match self {
            Self::Sqlite(_) => Dialect::Sqlite,
            Self::Postgres(_) => Dialect::Postgres,
            Self::MySql(_) => Dialect::MySql,
        }
    }

    /// Runs `sql` (no arguments, possibly several statements) once.
    ///
    /// # Errors
    /// `Sql`.
    pub(crate) async fn batch(&self, sql: &str) -> Result<()> {
        match self {
            Self::Sqlite(pool) => pool.execute(sqlx::raw_sql(sql)).await.map(drop)?,
            Self::Postgres(pool) => pool.execute(sqlx::raw_sql(sql)).await.map(drop)?,
            Self::MySql(pool) => pool.execute(sqlx::raw_sql(sql)).await.map(drop)?,
        }
        Ok(())
    }

    /// Closes the pool.
    pub(crate) async fn close(&self) {
        match self {
            Self::Sqlite(pool) => pool.close().await,
            Self::Postgres(pool) => pool.close().await,
            Self::MySql(pool) => pool.close().await,
        }
    }
}

/// `options` without the statement log unless `log_statements`.
fn quiet<O: ConnectOptions>(options: O, log_statements: bool) -> O {
    if log_statements {
        options
    } else {
        options.disable_statement_logging()
    }
}

/// The bench-owned tables of the baseline, per dialect.
fn schema(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Sqlite => {
            "CREATE TABLE IF NOT EXISTS bench_leases (session_id TEXT PRIMARY KEY, \
             holder TEXT, expires_at_ms INTEGER); \
             CREATE TABLE IF NOT EXISTS bench_tools (execution_key TEXT PRIMARY KEY, \
             session_id TEXT NOT NULL, holder TEXT NOT NULL, state TEXT NOT NULL, \
             result TEXT, updated_at_ms INTEGER NOT NULL);"
        }
        Dialect::Postgres => {
            "CREATE TABLE IF NOT EXISTS bench_leases (session_id TEXT COLLATE \"C\" PRIMARY KEY, \
             holder TEXT COLLATE \"C\", expires_at_ms BIGINT); \
             CREATE TABLE IF NOT EXISTS bench_tools (execution_key TEXT COLLATE \"C\" PRIMARY KEY, \
             session_id TEXT COLLATE \"C\" NOT NULL, holder TEXT COLLATE \"C\" NOT NULL, \
             state TEXT NOT NULL, result TEXT, updated_at_ms BIGINT NOT NULL);"
        }
        Dialect::MySql => {
            "CREATE TABLE IF NOT EXISTS bench_leases (session_id VARBINARY(128) NOT NULL PRIMARY KEY, \
             holder VARBINARY(128) NULL, expires_at_ms BIGINT NULL) ENGINE = InnoDB; \
             CREATE TABLE IF NOT EXISTS bench_tools (execution_key VARBINARY(255) NOT NULL PRIMARY KEY, \
             session_id VARBINARY(128) NOT NULL, holder VARBINARY(128) NOT NULL, \
             state VARCHAR(32) NOT NULL, result MEDIUMTEXT NULL, updated_at_ms BIGINT NOT NULL) \
             ENGINE = InnoDB;"
        }
    }
}

/// The four statements in a dialect, in step order.
struct Statements {
    acquire: String,
    insert: String,
    update: String,
    release: String,
}

impl Statements {
    fn of(dialect: Dialect) -> Self {
        // MySQL placeholders are positional `?`: every statement below uses
        // each placeholder once, in bind order.
        let (now, [a, b, c]) = match dialect {
            Dialect::Sqlite => (SQLITE_NOW_MS, ["?1", "?2", "?3"]),
            Dialect::Postgres => (POSTGRES_NOW_MS, ["$1", "$2", "$3"]),
            Dialect::MySql => (MYSQL_NOW_MS, ["?", "?", "?"]),
        };
        Self {
            // holder, ttl_ms, session_id
            acquire: format!(
                "UPDATE bench_leases SET holder = {a}, expires_at_ms = {now} + {b} \
                 WHERE session_id = {c} AND (holder IS NULL OR expires_at_ms < {now})"
            ),
            // execution_key, session_id, holder
            insert: format!(
                "INSERT INTO bench_tools (execution_key, session_id, holder, state, updated_at_ms) \
                 VALUES ({a}, {b}, {c}, 'running', {now})"
            ),
            // result, execution_key
            update: format!(
                "UPDATE bench_tools SET state = 'succeeded', result = {a}, updated_at_ms = {now} \
                 WHERE execution_key = {b} AND state = 'running'"
            ),
            // session_id, holder
            release: format!(
                "UPDATE bench_leases SET holder = NULL, expires_at_ms = NULL \
                 WHERE session_id = {a} AND holder = {b}"
            ),
        }
    }
}

/// Rows changed by one statement, whatever the dialect.
macro_rules! affected {
    ($pool:expr, $sql:expr, $($bind:expr),+) => {
        match $pool {
            SqlPool::Sqlite(pool) => sqlx::query($sql)$(.bind($bind))+.execute(pool).await?.rows_affected(),
            SqlPool::Postgres(pool) => sqlx::query($sql)$(.bind($bind))+.execute(pool).await?.rows_affected(),
            SqlPool::MySql(pool) => sqlx::query($sql)$(.bind($bind))+.execute(pool).await?.rows_affected(),
        }
    };
}

/// The lease in Redis.
#[derive(Clone)]
struct RedisLease {
    connection: ConnectionManager,
    prefix: String,
    release: redis::Script,
}

/// The raw baseline's turn loop.
pub(crate) struct RawTurns {
    sql: SqlPool,
    redis: Option<RedisLease>,
    statements: Statements,
    result: String,
}

impl std::fmt::Debug for RawTurns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawTurns")
            .field("dialect", &self.sql.dialect())
            .field("redis", &self.redis.is_some())
            .finish_non_exhaustive()
    }
}

impl RawTurns {
    /// Creates the baseline's tables and one lease row per client on `sql`,
    /// and, with `redis` (`(url, key prefix)`), connects the Redis lease.
    ///
    /// # Errors
    /// `Sql`, `Redis`.
    pub(crate) async fn open(
        sql: SqlPool,
        redis: Option<(&str, &str)>,
        clients: usize,
    ) -> Result<Self> {
        let dialect = sql.dialect();
        sql.batch(schema(dialect)).await?;
        insert_lease_rows(&sql, clients).await?;
        let redis = match redis {
            Some((url, prefix)) => {
                let client = redis::Client::open(url)?;
                Some(RedisLease {
                    connection: ConnectionManager::new(client).await?,
                    prefix: prefix.to_owned(),
                    release: redis::Script::new(RELEASE_SCRIPT),
                })
            }
            None => None,
        };
        Ok(Self {
            statements: Statements::of(dialect),
            sql,
            redis,
            result: serde_json::json!({"entry_id": 7, "amount": "18.00"}).to_string(),
        })
    }

    async fn acquire(&self, session: &str, holder: &str) -> Result<bool> {
        if let Some(redis) = &self.redis {
            let key = format!("{}raw:{session}", redis.prefix);
            let answer: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(holder)
                .arg("NX")
                .arg("PX")
                .arg(RAW_LEASE_TTL_MS)
                .query_async(&mut redis.connection.clone())
                .await?;
            return Ok(answer.is_some());
        }
        let sql = self.statements.acquire.as_str();
        Ok(affected!(&self.sql, sql, holder, RAW_LEASE_TTL_MS, session) == 1)
    }

    async fn release(&self, session: &str, holder: &str) -> Result<bool> {
        if let Some(redis) = &self.redis {
            let key = format!("{}raw:{session}", redis.prefix);
            let deleted: i64 = redis
                .release
                .key(key)
                .arg(holder)
                .invoke_async(&mut redis.connection.clone())
                .await?;
            return Ok(deleted == 1);
        }
        let sql = self.statements.release.as_str();
        Ok(affected!(&self.sql, sql, session, holder) == 1)
    }
}

async fn insert_lease_rows(sql: &SqlPool, clients: usize) -> Result<()> {
    for client in 0..clients {
        let session = session_of(client);
        match sql {
            SqlPool::Sqlite(pool) => {
                sqlx::query("INSERT OR IGNORE INTO bench_leases (session_id) VALUES (?1)")
                    .bind(&session)
                    .execute(pool)
                    .await?;
            }
            SqlPool::Postgres(pool) => {
                sqlx::query(
                    "INSERT INTO bench_leases (session_id) VALUES ($1) ON CONFLICT DO NOTHING",
                )
                .bind(&session)
                .execute(pool)
                .await?;
            }
            SqlPool::MySql(pool) => {
                sqlx::query("INSERT IGNORE INTO bench_leases (session_id) VALUES (?)")
                    .bind(&session)
                    .execute(pool)
                    .await?;
            }
        }
    }
    Ok(())
}

/// 128 random bits as hex: the raw lease's holder token.
fn holder_token() -> Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| BenchError::io("no randomness", std::io::Error::other(e.to_string())))?;
    Ok(hex::encode(bytes))
}

#[async_trait]
impl TurnLoop for RawTurns {
    async fn turn(&self, client: usize, timings: &mut [Duration; STEPS]) -> Result<()> {
        let [acquire_ms, insert_ms, update_ms, release_ms] = timings;
        let session = session_of(client);
        let holder = holder_token()?;
        let execution_key = format!("r{}:{TOOL}:{holder}", next_request());
        if !timed(acquire_ms, self.acquire(&session, &holder)).await? {
            return Err(BenchError::unexpected(format!(
                "raw lease on {session} was not free"
            )));
        }
        let insert = self.statements.insert.as_str();
        let inserted = timed(insert_ms, async {
            Ok::<_, BenchError>(affected!(
                &self.sql,
                insert,
                &execution_key,
                &session,
                &holder
            ))
        })
        .await?;
        let update = self.statements.update.as_str();
        let updated = timed(update_ms, async {
            Ok::<_, BenchError>(affected!(&self.sql, update, &self.result, &execution_key))
        })
        .await?;
        if inserted != 1 || updated != 1 {
            return Err(BenchError::unexpected("raw tool row not written once"));
        }
        if !timed(release_ms, self.release(&session, &holder)).await? {
            return Err(BenchError::unexpected(format!(
                "raw lease on {session} was not held at release"
            )));
        }
        Ok(())
    }
}
