//! The layered begin (`agentgate_store_sql::begin::layered`) where its
//! lease and its rows part: a lease the layer holds for a turn whose row is
//! never written, and a begin dropped between its acquire and its write.

use std::sync::Arc;
use std::time::Duration;

use agentgate::{Config, ErrorKind, Gate};
use agentgate_conformance::targets::{self, Target};
use agentgate_core::error::Result;
use agentgate_core::ids::{ClientRequestId, Fence, SessionId, UserId};
use agentgate_core::lease::{Acquired, LeaseClaim, LeaseLayer, LiveLease};
use agentgate_core::model::{BeginCommand, HolderView};
use agentgate_store_redis::RedisLeases;
use async_trait::async_trait;
use serde_json::json;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, SqliteConnection};
use tokio::sync::Mutex;

/// How long a test waits for a lease to be given back in the background:
/// a bound on the wait, not a measured time.
const GIVE_BACK_WAIT: Duration = Duration::from_secs(5);

fn command(user: &str, session: &str, request: &str) -> BeginCommand {
    BeginCommand::new(
        UserId::new(user).expect("a user id"),
        SessionId::new(session).expect("a session id"),
        ClientRequestId::new(request).expect("a request id"),
        &json!({ "text": request }),
        None,
    )
    .expect("a command")
}

/// A lease the layer holds for a turn whose row no begin ever writes (its
/// begin died between the acquire and the write): a begin on the session
/// is answered `session_busy`, the layer's answer, after a bounded number
/// of rounds waiting for the row, not a `conflict` once the whole retry
/// budget ran out.
async fn unwritten_holder_is_session_busy(target: Option<Target>) {
    let Some(target) = target else {
        return;
    };
    let redis = target.redis_url.clone().expect("a layered target");
    let layer = RedisLeases::open(&redis).await.expect("redis opens");
    let gate = target.gate(Config::default()).await;
    let ghost = command("u-ghost", "s-ghost", "r-ghost");
    let claim = LeaseClaim::for_begin(&ghost, "turn_never_written", "digest", Fence(1), 30_000, 5);
    assert!(
        matches!(layer.acquire(&claim).await, Ok(Acquired::Granted { .. })),
        "the ghost's lease is taken"
    );
    let answer = gate
        .begin("u-ghost", "s-ghost", "r-1", &json!({ "text": "hi" }))
        .await;
    match answer {
        Err(error) => assert_eq!(
            error.kind(),
            ErrorKind::SessionBusy,
            "{}: {error}",
            target.name
        ),
        Ok(begun) => panic!("{}: began under another lease: {begun:?}", target.name),
    }
}

#[tokio::test]
async fn sqlite_unwritten_holder_is_session_busy() {
    unwritten_holder_is_session_busy(targets::sqlite_redis().await).await;
}

#[tokio::test]
async fn postgres_unwritten_holder_is_session_busy() {
    unwritten_holder_is_session_busy(targets::postgres_redis().await).await;
}

#[tokio::test]
async fn mysql_unwritten_holder_is_session_busy() {
    unwritten_holder_is_session_busy(targets::mysql_redis().await).await;
}

/// The Redis layer, which after each acquire takes SQLite's write lock
/// from a connection of its own, so the begin that acquired waits for the
/// writer to write its grant.
#[derive(Debug)]
struct BlockWriterAfterAcquire {
    inner: RedisLeases,
    file: std::path::PathBuf,
    /// The blocking connection, and whether the acquire granted.
    blocker: Mutex<Option<(SqliteConnection, bool)>>,
}

#[async_trait]
impl LeaseLayer for BlockWriterAfterAcquire {
    async fn acquire(&self, claim: &LeaseClaim<'_>) -> Result<Acquired> {
        let acquired = self.inner.acquire(claim).await?;
        let mut conn = SqliteConnectOptions::new()
            .filename(&self.file)
            .connect()
            .await
            .expect("a blocking connection opens");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut conn)
            .await
            .expect("the blocker takes the write lock");
        let granted = matches!(acquired, Acquired::Granted { .. });
        *self.blocker.lock().await = Some((conn, granted));
        Ok(acquired)
    }
    async fn renew(&self, turn_id: &str, token_digest: &str, ttl_ms: i64) -> Result<Option<i64>> {
        self.inner.renew(turn_id, token_digest, ttl_ms).await
    }
    async fn holds(&self, turn_id: &str, token_digest: &str) -> Result<Option<LiveLease>> {
        self.inner.holds(turn_id, token_digest).await
    }
    async fn release(&self, turn_id: &str, token_digest: &str) -> Result<()> {
        self.inner.release(turn_id, token_digest).await
    }
    async fn revoke(&self, turn_id: &str) -> Result<()> {
        self.inner.revoke(turn_id).await
    }
    async fn holder(&self, session_id: &str) -> Result<Option<HolderView>> {
        self.inner.holder(session_id).await
    }
    async fn user_holders(&self, user_id: &str) -> Result<Vec<HolderView>> {
        self.inner.user_holders(user_id).await
    }
}

/// A begin dropped after the layer granted its lease and before its grant
/// was written (its caller gone: here a timeout while the write waits for
/// SQLite's writer) gives the lease back in the background, so the session
/// is not held by nobody until the lease's TTL (30 s) runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_dropped_after_its_acquire_gives_its_lease_back() {
    let Some(redis) = targets::redis_url().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("dropped.db");
    let layer = Arc::new(BlockWriterAfterAcquire {
        inner: RedisLeases::open(&redis).await.expect("redis opens"),
        file: file.clone(),
        blocker: Mutex::new(None),
    });
    let url = format!("sqlite://{}", file.display());
    let gate = Gate::connect_with_layer(
        &url,
        Arc::clone(&layer) as Arc<dyn LeaseLayer>,
        Config::default(),
    )
    .await
    .expect("the store opens");
    let payload = json!({ "text": "hi" });
    let begin = gate.begin("u-drop", "s-drop", "r-1", &payload);
    assert!(
        tokio::time::timeout(Duration::from_millis(500), begin)
            .await
            .is_err(),
        "the begin waits for the writer the blocker holds"
    );
    let (mut blocker, granted) = layer
        .blocker
        .lock()
        .await
        .take()
        .expect("the layer was asked");
    assert!(granted, "the dropped begin's lease was granted");
    sqlx::query("ROLLBACK")
        .execute(&mut blocker)
        .await
        .expect("the blocker lets go");
    let given_back = async {
        while layer
            .inner
            .holder("s-drop")
            .await
            .expect("redis answers")
            .is_some()
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert!(
        tokio::time::timeout(GIVE_BACK_WAIT, given_back)
            .await
            .is_ok(),
        "the dropped begin's lease was given back"
    );
}
