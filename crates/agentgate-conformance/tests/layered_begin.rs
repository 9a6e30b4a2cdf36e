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

/// The layer that blocks SQLite's writer once it granted a lease, on the
/// file `file`, and a `begin` of `u-drop`'s message `r-1` on `s-drop`.
async fn blocking_layer(redis: &str, file: &std::path::Path) -> Arc<BlockWriterAfterAcquire> {
    Arc::new(BlockWriterAfterAcquire {
        inner: RedisLeases::open(redis).await.expect("redis opens"),
        file: file.to_owned(),
        blocker: Mutex::new(None),
    })
}

/// Lets SQLite's writer go once the dropped begin was granted its lease.
async fn let_the_writer_go(layer: &BlockWriterAfterAcquire) {
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
}

/// On the bare store (no [`Gate`], so nothing runs a step to its end): a
/// begin dropped after the layer granted its lease and before its grant
/// was written (its caller gone: here a timeout while the write waits for
/// SQLite's writer) gives the lease back in the background, so the session
/// is not held by nobody until the lease's TTL (30 s) runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_begin_dropped_after_its_acquire_gives_its_lease_back() {
    let Some(redis) = targets::redis_url().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("dropped.db");
    let layer = blocking_layer(&redis, &file).await;
    let url = format!("sqlite://{}", file.display());
    let store = agentgate::gate::open_bare_store_with_layer(
        &url,
        Arc::clone(&layer) as Arc<dyn LeaseLayer>,
        Config::default(),
    )
    .await
    .expect("the store opens");
    let command = command("u-drop", "s-drop", "r-1");
    assert!(
        tokio::time::timeout(Duration::from_millis(500), store.begin(&command))
            .await
            .is_err(),
        "the begin waits for the writer the blocker holds"
    );
    let_the_writer_go(&layer).await;
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

/// Through a [`Gate`], the same begin whose caller stopped waiting runs to
/// its end (docs/protocol.md §4.7): once the writer is free its turn is written and
/// holds the lease, and a repeat of the message is told it is in flight
/// (409 `request_in_flight`), not granted a second turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_begin_whose_caller_stopped_waiting_runs_to_its_end() {
    let Some(redis) = targets::redis_url().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("dropped.db");
    let layer = blocking_layer(&redis, &file).await;
    let url = format!("sqlite://{}", file.display());
    let gate = Gate::connect_with_layer(
        &url,
        Arc::clone(&layer) as Arc<dyn LeaseLayer>,
        Config::default(),
    )
    .await
    .expect("the store opens");
    let payload = json!({ "text": "hi" });
    assert!(
        tokio::time::timeout(
            Duration::from_millis(500),
            gate.begin("u-drop", "s-drop", "r-1", &payload)
        )
        .await
        .is_err(),
        "the begin waits for the writer the blocker holds"
    );
    let_the_writer_go(&layer).await;
    let written = async {
        while gate.steps_in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert!(
        tokio::time::timeout(GIVE_BACK_WAIT, written).await.is_ok(),
        "the abandoned begin ended"
    );
    let holder = layer
        .inner
        .holder("s-drop")
        .await
        .expect("redis answers")
        .expect("the written turn holds the lease");
    let repeat = gate
        .begin("u-drop", "s-drop", "r-1", &payload)
        .await
        .expect_err("the message is in flight");
    assert_eq!(repeat.kind(), ErrorKind::RequestInFlight, "{repeat}");
    let stored = gate
        .store()
        .turn(&holder.turn_id)
        .await
        .expect("the store answers")
        .expect("the holder's turn is stored");
    assert_eq!(stored.state, agentgate::TurnState::Running);
}
