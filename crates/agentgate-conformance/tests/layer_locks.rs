//! With the Redis lease layer, no store holds a store-wide lock while it
//! waits on Redis (issue 10): a slow or unreachable Redis must not stall
//! every other grant. On SQLite that lock is the single writer; on
//! MySQL/MariaDB it is the fence counter's row, which every grant locks.
//! Nor does a store hold the caller's user and session rows across it
//! (issue 11): a slow Redis must not stall the user's other begins either.
//!
//! The layer here is the real Redis layer wrapped so that, at every call,
//! it tries to take that lock from a second connection without waiting
//! (`BEGIN IMMEDIATE` with no busy timeout; `SELECT … FOR UPDATE NOWAIT`).
//! If the store held it across the call, the attempt fails at once, and the
//! test counts it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use agentgate::{Begun, Config, ErrorKind, Gate, ToolStep};
use agentgate_conformance::targets;
use agentgate_core::error::Result;
use agentgate_core::lease::{Acquired, LeaseClaim, LeaseLayer, LiveLease};
use agentgate_core::model::HolderView;
use agentgate_store_redis::RedisLeases;
use async_trait::async_trait;
use serde_json::json;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};

/// The store-wide lock a probe tries to take.
#[derive(Debug)]
enum Lock {
    /// SQLite's write lock on this file.
    SqliteWriter(std::path::PathBuf),
    /// The fence counter row of the MySQL database at this URL.
    MysqlFence(String),
    /// The test's user and session rows in the PostgreSQL database at
    /// this URL.
    PostgresRows(String),
    /// The same rows in the MySQL database at this URL.
    MysqlRows(String),
}

/// The Redis layer, probing the store-wide lock at every call.
#[derive(Debug)]
struct Probing {
    inner: RedisLeases,
    lock: Lock,
    probes: AtomicU64,
    writer_held: AtomicU64,
}

impl Probing {
    async fn probe(&self) {
        self.probes.fetch_add(1, Ordering::Relaxed);
        let held = match &self.lock {
            Lock::SqliteWriter(file) => sqlite_writer_held(file).await,
            Lock::MysqlFence(url) => mysql_fence_held(url).await,
            Lock::PostgresRows(url) => postgres_rows_held(url).await,
            Lock::MysqlRows(url) => mysql_rows_held(url).await,
        };
        if held {
            self.writer_held.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Tries `BEGIN IMMEDIATE` on a fresh connection with no busy timeout: it
/// fails at once if any connection holds the write lock.
async fn sqlite_writer_held(file: &std::path::Path) -> bool {
    {
        let mut conn = SqliteConnectOptions::new()
            .filename(file)
            .busy_timeout(std::time::Duration::ZERO)
            .connect()
            .await
            .expect("a probe connection opens");
        let held = match sqlx::query("BEGIN IMMEDIATE").execute(&mut conn).await {
            Ok(_) => {
                sqlx::query("ROLLBACK")
                    .execute(&mut conn)
                    .await
                    .expect("the probe rolls back");
                false
            }
            Err(error) => {
                let busy = error
                    .as_database_error()
                    .and_then(|e| e.code())
                    .is_some_and(|code| code == "5" || code == "517");
                assert!(busy, "the probe failed for another reason: {error}");
                true
            }
        };
        conn.close().await.expect("the probe closes");
        held
    }
}

/// Tries to lock the fence counter's row without waiting: MariaDB and
/// MySQL 8 refuse at once (lock wait error) if another transaction holds it.
async fn mysql_fence_held(url: &str) -> bool {
    let mut conn = sqlx::MySqlConnection::connect(url)
        .await
        .expect("a probe connection opens");
    let mut tx = conn.begin().await.expect("the probe begins");
    let held = match sqlx::query("SELECT value FROM ag_fence WHERE id = 1 FOR UPDATE NOWAIT")
        .fetch_optional(&mut *tx)
        .await
    {
        Ok(row) => {
            assert!(row.is_some(), "the fence counter row exists");
            false
        }
        Err(error) => {
            let code = error.as_database_error().and_then(|e| e.code());
            // 1205 lock wait timeout / 3572 NOWAIT (MySQL 8); MariaDB reports
            // NOWAIT as a lock wait timeout too.
            assert!(
                matches!(code.as_deref(), Some("HY000" | "40001" | "41000")),
                "the probe failed for another reason: {error}"
            );
            true
        }
    };
    tx.rollback().await.expect("the probe rolls back");
    conn.close().await.expect("the probe closes");
    held
}

/// The rows of [`no_lock_is_held_across_a_layer_call`]'s user and sessions.
const ROWS: [&str; 2] = [
    "SELECT 1 FROM ag_users WHERE user_id = 'u-1' FOR UPDATE NOWAIT",
    "SELECT 1 FROM ag_sessions WHERE session_id IN ('s-1', 's-2') FOR UPDATE NOWAIT",
];

/// Tries to lock the test's user and session rows without waiting:
/// PostgreSQL refuses at once (`55P03`) if another transaction holds one.
async fn postgres_rows_held(url: &str) -> bool {
    let mut conn = sqlx::PgConnection::connect(url)
        .await
        .expect("a probe connection opens");
    let mut held = false;
    for statement in ROWS {
        let mut tx = conn.begin().await.expect("the probe begins");
        if let Err(error) = sqlx::query(statement).fetch_all(&mut *tx).await {
            let code = error.as_database_error().and_then(|e| e.code());
            assert_eq!(
                code.as_deref(),
                Some("55P03"),
                "the probe failed for another reason: {error}"
            );
            held = true;
        }
        tx.rollback().await.expect("the probe rolls back");
    }
    conn.close().await.expect("the probe closes");
    held
}

/// [`postgres_rows_held`] on MySQL/MariaDB (lock wait errors as in
/// [`mysql_fence_held`]).
async fn mysql_rows_held(url: &str) -> bool {
    let mut conn = sqlx::MySqlConnection::connect(url)
        .await
        .expect("a probe connection opens");
    let mut held = false;
    for statement in ROWS {
        let mut tx = conn.begin().await.expect("the probe begins");
        if let Err(error) = sqlx::query(statement).fetch_all(&mut *tx).await {
            let code = error.as_database_error().and_then(|e| e.code());
            assert!(
                matches!(code.as_deref(), Some("HY000" | "40001" | "41000")),
                "the probe failed for another reason: {error}"
            );
            held = true;
        }
        tx.rollback().await.expect("the probe rolls back");
    }
    conn.close().await.expect("the probe closes");
    held
}

#[async_trait]
impl LeaseLayer for Probing {
    async fn acquire(&self, claim: &LeaseClaim<'_>) -> Result<Acquired> {
        self.probe().await;
        self.inner.acquire(claim).await
    }
    async fn renew(&self, turn_id: &str, token_digest: &str, ttl_ms: i64) -> Result<Option<i64>> {
        self.probe().await;
        self.inner.renew(turn_id, token_digest, ttl_ms).await
    }
    async fn holds(&self, turn_id: &str, token_digest: &str) -> Result<Option<LiveLease>> {
        self.probe().await;
        self.inner.holds(turn_id, token_digest).await
    }
    async fn release(&self, turn_id: &str, token_digest: &str) -> Result<()> {
        self.probe().await;
        self.inner.release(turn_id, token_digest).await
    }
    async fn revoke(&self, turn_id: &str) -> Result<()> {
        self.probe().await;
        self.inner.revoke(turn_id).await
    }
    async fn holder(&self, session_id: &str) -> Result<Option<HolderView>> {
        self.probe().await;
        self.inner.holder(session_id).await
    }
    async fn user_holders(&self, user_id: &str) -> Result<Vec<HolderView>> {
        self.probe().await;
        self.inner.user_holders(user_id).await
    }
}

/// Drives every step that asks the layer, one at a time, so a probe that
/// finds the write lock taken can only have found the calling step's own:
/// a begin that starts, a duplicate refused in flight, a second session
/// refused at the user's cap (1), a heartbeat, a tool claim and completion,
/// a retryable failure and the repeat that restarts it, an ending, and a
/// replay. At every layer call the write lock was free.
async fn no_lock_is_held_across_a_layer_call(url: &str, lock: Lock) {
    let Some(redis) = targets::redis_url().await else {
        return;
    };
    let name = format!("{lock:?}");
    let layer = Arc::new(Probing {
        inner: RedisLeases::open(&redis).await.expect("redis opens"),
        lock,
        probes: AtomicU64::new(0),
        writer_held: AtomicU64::new(0),
    });
    let config = Config {
        max_turns_per_user: 1,
        ..Config::default()
    };
    let gate = Gate::connect_with_layer(url, Arc::clone(&layer) as Arc<dyn LeaseLayer>, config)
        .await
        .expect("the store opens");
    let payload = json!({"text": "hi"});
    let refused = |begun: agentgate::Result<Begun>, kind: ErrorKind| match begun {
        Err(error) => assert_eq!(error.kind(), kind, "{error}"),
        Ok(_) => panic!("expected {kind:?}"),
    };

    let Begun::Started(turn) = gate
        .begin("u-1", "s-1", "r-1", &payload)
        .await
        .expect("begins")
    else {
        panic!("a new request starts");
    };
    refused(
        gate.begin("u-1", "s-1", "r-1", &payload).await,
        ErrorKind::RequestInFlight,
    );
    refused(
        gate.begin("u-1", "s-2", "r-2", &payload).await,
        ErrorKind::UserAtCapacity,
    );
    turn.heartbeat().await.expect("the holder heartbeats");
    let ToolStep::Execute(execution) = turn.tool("book", &json!({"n": 1})).await.expect("claims")
    else {
        panic!("a first claim executes");
    };
    execution
        .complete(&json!({"booked": 1}))
        .await
        .expect("completes");
    turn.fail(&json!({"code": "model_timeout"}), true)
        .await
        .expect("fails retryably");
    let Begun::Started(again) = gate
        .begin("u-1", "s-1", "r-1", &payload)
        .await
        .expect("restarts")
    else {
        panic!("a repeat of a retryable failure restarts");
    };
    assert_eq!(again.attempt(), 2, "the restart is attempt 2");
    let ToolStep::Cached(cached) = again.tool("book", &json!({"n": 1})).await.expect("claims")
    else {
        panic!("the completed tool is cached across attempts");
    };
    assert_eq!(cached, json!({"booked": 1}));
    again.succeed(&json!({"ok": true})).await.expect("ends");
    let Begun::Replay(view) = gate
        .begin("u-1", "s-1", "r-1", &payload)
        .await
        .expect("replays")
    else {
        panic!("an ended request replays");
    };
    assert_eq!(view.response, Some(json!({"ok": true})));

    let probes = layer.probes.load(Ordering::Relaxed);
    let held = layer.writer_held.load(Ordering::Relaxed);
    println!("{name} + redis: {probes} layer calls probed, {held} with the lock held");
    assert!(probes >= 9, "every step asked the layer ({probes} calls)");
    assert_eq!(
        held, 0,
        "no layer call was made while the store-wide lock was held"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writer_is_never_held_across_a_redis_call() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("writer.db");
    let url = format!("sqlite://{}", file.display());
    no_lock_is_held_across_a_layer_call(&url, Lock::SqliteWriter(file)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_fence_row_is_never_locked_across_a_redis_call() {
    let Some(target) = targets::mysql().await else {
        return;
    };
    let url = target.store_url.clone();
    no_lock_is_held_across_a_layer_call(&url, Lock::MysqlFence(url.clone())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_user_and_session_rows_are_never_locked_across_a_redis_call() {
    let Some(target) = targets::postgres().await else {
        return;
    };
    let url = target.store_url.clone();
    no_lock_is_held_across_a_layer_call(&url, Lock::PostgresRows(url.clone())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_user_and_session_rows_are_never_locked_across_a_redis_call() {
    let Some(target) = targets::mysql().await else {
        return;
    };
    let url = target.store_url.clone();
    no_lock_is_held_across_a_layer_call(&url, Lock::MysqlRows(url.clone())).await;
}
