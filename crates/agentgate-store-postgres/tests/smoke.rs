//! Smoke tests of the PostgreSQL store against a real server, each on its
//! own fresh database: the protocol's happy path, the refusals, takeover with
//! fencing, and storms of concurrent begins. The shared conformance suite
//! covers the rest.
//!
//! Without a server these tests print a skip reason and pass, unless
//! `AGENTGATE_REQUIRE_SERVICES=1`.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::config::Config;
use agentgate_core::error::{BoxError, Error, ErrorKind};
use agentgate_core::ids::{ClientRequestId, ExecutionId, SessionId, ToolName, UserId};
use agentgate_core::model::{
    BeginCommand, BeginOutcome, Ending, Grant, LeaseRef, PreviousOutcome, ToolCall, ToolClaim,
    TurnState,
};
use agentgate_core::store::{BoxFuture, Completion, SqlEffect, Store};
use agentgate_store_postgres::{testing, PostgresStore};
use serde_json::{json, Value};
use tokio::sync::Barrier;

// ---- backend-specific part -------------------------------------------------

/// A fresh store on its own database (dropped with the returned guard), or
/// `None` when the server is absent.
async fn open(config: Config) -> Option<(Arc<PostgresStore>, testing::TestDatabase)> {
    let database = testing::TestDatabase::create().await?;
    let store = PostgresStore::open(database.url(), config)
        .await
        .expect("open the store on a fresh database");
    Some((Arc::new(store), database))
}

/// Closes the store's connections, then drops its database.
async fn close(store: Arc<PostgresStore>, database: testing::TestDatabase) {
    store.pool().close().await;
    drop(database);
}

/// An effect that books a ledger row on the store's own connection.
struct Book {
    amount: i64,
    fail: bool,
}

impl SqlEffect for Book {
    fn apply<'a>(
        &'a mut self,
        connection: &'a mut (dyn Any + Send),
    ) -> BoxFuture<'a, Result<Value, BoxError>> {
        Box::pin(async move {
            let conn = connection
                .downcast_mut::<sqlx::PgConnection>()
                .ok_or("not a PgConnection")?;
            let id: i64 =
                sqlx::query_scalar("INSERT INTO ledger (amount) VALUES ($1) RETURNING id")
                    .bind(self.amount)
                    .fetch_one(&mut *conn)
                    .await?;
            if self.fail {
                return Err("refused after writing".into());
            }
            Ok(json!({ "entry": id }))
        })
    }
}

async fn create_ledger(store: &PostgresStore) {
    sqlx::query("CREATE TABLE ledger (id BIGSERIAL PRIMARY KEY, amount BIGINT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("create the ledger table");
}

async fn ledger_rows(store: &PostgresStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
        .fetch_one(store.pool())
        .await
        .expect("count ledger rows")
}

// ---- shared part -------------------------------------------------------------

fn command(user: &str, session: &str, request: &str, payload: &Value) -> BeginCommand {
    BeginCommand::new(
        UserId::new(user).expect("valid user"),
        SessionId::new(session).expect("valid session"),
        ClientRequestId::new(request).expect("valid request id"),
        payload,
        None,
    )
    .expect("valid command")
}

fn lease(grant: &Grant) -> LeaseRef {
    LeaseRef {
        turn_id: grant.turn_id.clone(),
        token: grant.lease_token.clone(),
    }
}

fn started(outcome: BeginOutcome) -> Grant {
    match outcome {
        BeginOutcome::Started(grant) => grant,
        BeginOutcome::Replay(view) => panic!("expected a start, got a replay of {view:?}"),
    }
}

fn call(tool: &str, args: &Value) -> ToolCall {
    ToolCall::new(ToolName::new(tool).expect("valid tool"), args).expect("valid call")
}

fn canonical(value: &Value) -> CanonicalJson {
    CanonicalJson::new("test", value).expect("canonical")
}

fn execution_id(claim: &ToolClaim) -> ExecutionId {
    match claim {
        ToolClaim::Execute { execution_id, .. } | ToolClaim::Cached { execution_id, .. } => {
            execution_id.clone()
        }
    }
}

fn kind<T: std::fmt::Debug>(result: Result<T, Error>) -> ErrorKind {
    result.expect_err("expected a refusal").kind()
}

#[tokio::test]
async fn begin_tool_complete_succeed_replay() {
    let Some((store, database)) = open(Config::default()).await else {
        return;
    };
    let begin = command("alice", "chat-1", "msg-1", &json!({"text": "taxi 18"}));
    let grant = started(store.begin(&begin).await.expect("begin"));
    assert_eq!(grant.attempt, 1);
    assert!(!grant.takeover);
    assert!(grant.fence.0 > 0);
    let lease = lease(&grant);
    store.heartbeat(&lease).await.expect("heartbeat");

    let booking = call("create_transaction", &json!({"amount": 18}));
    let claim = store.claim_tool(&lease, &booking).await.expect("claim");
    let ToolClaim::Execute {
        attempt,
        previous_outcome,
        ref idempotency_key,
        ..
    } = claim
    else {
        panic!("expected execute, got {claim:?}");
    };
    assert_eq!((attempt, previous_outcome), (1, None));
    assert!(idempotency_key.starts_with("agk_"));
    let id = execution_id(&claim);
    assert_eq!(
        kind(store.claim_tool(&lease, &booking).await),
        ErrorKind::ToolInFlight
    );
    let result = json!({"id": 7});
    let stored = store
        .complete_tool(&lease, &id, Completion::Result(canonical(&result)))
        .await
        .expect("complete");
    assert_eq!(stored, result);
    assert_eq!(
        store.claim_tool(&lease, &booking).await.expect("cached"),
        ToolClaim::Cached {
            execution_id: id.clone(),
            result: result.clone()
        }
    );
    assert_eq!(
        kind(
            store
                .complete_tool(&lease, &id, Completion::Result(canonical(&result)))
                .await
        ),
        ErrorKind::LeaseLost
    );

    let response = json!({"text": "booked"});
    let view = store
        .end_turn(
            &lease,
            &Ending::Succeed {
                response: canonical(&response),
            },
        )
        .await
        .expect("succeed");
    assert_eq!(view.state, TurnState::Succeeded);
    assert_eq!(view.response.as_ref(), Some(&response));
    assert_eq!(
        kind(store.heartbeat(&lease).await),
        ErrorKind::LeaseLost,
        "an ended turn's lease is gone"
    );

    match store.begin(&begin).await.expect("repeat") {
        BeginOutcome::Replay(view) => {
            assert_eq!(view.turn_id, grant.turn_id);
            assert_eq!(view.response, Some(response));
        }
        BeginOutcome::Started(_) => panic!("a succeeded request must replay"),
    }
    let other_payload = command("alice", "chat-1", "msg-1", &json!({"text": "taxi 19"}));
    assert_eq!(
        kind(store.begin(&other_payload).await),
        ErrorKind::PayloadMismatch
    );
    let session = store
        .session(&begin.session_id)
        .await
        .expect("session view")
        .expect("session exists");
    assert!(session.holder.is_none());
    assert_eq!(session.fence, grant.fence);
    let executions = store.executions(&grant.turn_id).await.expect("executions");
    assert_eq!(executions.len(), 1);
    assert_eq!(executions[0].result, Some(result));
    close(store, database).await;
}

#[tokio::test]
async fn same_transaction_effect_commits_or_rolls_back_with_the_mark() {
    let Some((store, database)) = open(Config::default()).await else {
        return;
    };
    create_ledger(&store).await;
    let grant = started(
        store
            .begin(&command("alice", "chat-1", "msg-1", &json!(1)))
            .await
            .expect("begin"),
    );
    let lease = lease(&grant);
    let booking = call("create_transaction", &json!({"amount": 35}));
    let id = execution_id(&store.claim_tool(&lease, &booking).await.expect("claim"));

    let mut failing = Book {
        amount: 35,
        fail: true,
    };
    assert_eq!(
        kind(
            store
                .complete_tool(&lease, &id, Completion::Effect(&mut failing))
                .await
        ),
        ErrorKind::Effect
    );
    assert_eq!(ledger_rows(&store).await, 0, "a failed effect rolls back");

    let mut booking_effect = Book {
        amount: 35,
        fail: false,
    };
    let stored = store
        .complete_tool(&lease, &id, Completion::Effect(&mut booking_effect))
        .await
        .expect("complete with effect");
    assert!(stored.get("entry").is_some());
    assert_eq!(ledger_rows(&store).await, 1);
    let again = store.claim_tool(&lease, &booking).await.expect("cached");
    assert!(matches!(again, ToolClaim::Cached { result, .. } if result == stored));
    close(store, database).await;
}

#[tokio::test]
async fn a_second_message_gets_session_busy() {
    let Some((store, database)) = open(Config::default()).await else {
        return;
    };
    let first = started(
        store
            .begin(&command("alice", "chat-1", "msg-1", &json!(1)))
            .await
            .expect("begin"),
    );
    let refused = store
        .begin(&command("alice", "chat-1", "msg-2", &json!(2)))
        .await
        .expect_err("session is held");
    assert_eq!(refused.kind(), ErrorKind::SessionBusy);
    assert_eq!(refused.active_turn_id(), Some(first.turn_id.as_str()));
    assert!(refused.retry_after().is_some_and(|d| d > Duration::ZERO));
    // The repeat of the running request is in flight, not busy.
    assert_eq!(
        kind(
            store
                .begin(&command("alice", "chat-1", "msg-1", &json!(1)))
                .await
        ),
        ErrorKind::RequestInFlight
    );
    // Another user cannot see, let alone use, alice's session.
    assert_eq!(
        kind(
            store
                .begin(&command("mallory", "chat-1", "msg-9", &json!(9)))
                .await
        ),
        ErrorKind::NotFound
    );
    store
        .end_turn(
            &lease(&first),
            &Ending::Fail {
                error: canonical(&json!("boom")),
                retryable: false,
            },
        )
        .await
        .expect("fail the turn");
    let second = started(
        store
            .begin(&command("alice", "chat-1", "msg-2", &json!(2)))
            .await
            .expect("free after the first ended"),
    );
    assert!(second.fence > first.fence);
    close(store, database).await;
}

#[tokio::test]
async fn a_user_at_capacity_gets_no_permit() {
    let config = Config {
        max_turns_per_user: 2,
        ..Config::default()
    };
    let Some((store, database)) = open(config).await else {
        return;
    };
    let mut grants = Vec::new();
    for session in ["s1", "s2"] {
        grants.push(started(
            store
                .begin(&command("bob", session, "m", &json!(0)))
                .await
                .expect("within the cap"),
        ));
    }
    let refused = store
        .begin(&command("bob", "s3", "m", &json!(0)))
        .await
        .expect_err("over the cap");
    assert!(matches!(refused, Error::UserAtCapacity { cap: 2, .. }));
    assert!(
        store
            .session(&SessionId::new("s3").expect("valid"))
            .await
            .expect("view")
            .is_none(),
        "a refused begin writes nothing"
    );
    // Another user is not affected.
    started(
        store
            .begin(&command("carol", "s9", "m", &json!(0)))
            .await
            .expect("carol has her own permits"),
    );
    let bob = UserId::new("bob").expect("valid");
    store.set_user_cap(&bob, Some(3)).await.expect("raise cap");
    grants.push(started(
        store
            .begin(&command("bob", "s3", "m", &json!(0)))
            .await
            .expect("within the raised cap"),
    ));
    let view = store.user(&bob).await.expect("user view");
    assert_eq!((view.max_turns_per_user, view.live_turns), (3, 3));
    assert_eq!(view.holders.len(), 3);
    store.set_user_cap(&bob, None).await.expect("clear cap");
    assert_eq!(
        kind(store.begin(&command("bob", "s4", "m", &json!(0))).await),
        ErrorKind::UserAtCapacity
    );
    store
        .end_turn(
            &lease(&grants[0]),
            &Ending::Succeed {
                response: canonical(&json!("ok")),
            },
        )
        .await
        .expect("end one");
    // Three live, default cap two: still over.
    assert_eq!(
        kind(store.begin(&command("bob", "s4", "m", &json!(0))).await),
        ErrorKind::UserAtCapacity
    );
    close(store, database).await;
}

#[tokio::test]
async fn takeover_after_ttl_fences_out_the_old_holder() {
    let config = Config {
        lease_ttl: Duration::from_millis(300),
        ..Config::default()
    };
    let Some((store, database)) = open(config).await else {
        return;
    };
    let begin = command("alice", "chat-1", "msg-1", &json!(1));
    let old = started(store.begin(&begin).await.expect("begin"));
    let old_lease = lease(&old);
    let booking = call("create_transaction", &json!({"amount": 1}));
    let old_claim = store.claim_tool(&old_lease, &booking).await.expect("claim");
    assert_eq!(
        kind(store.begin(&begin).await),
        ErrorKind::RequestInFlight,
        "live lease"
    );
    // The old holder stops renewing (a crash); its lease runs out on the
    // store's clock. 300 ms TTL, 500 ms wait: a 200 ms margin.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let new = started(store.begin(&begin).await.expect("takeover"));
    assert!(new.takeover);
    assert_eq!(new.attempt, 2);
    assert_eq!(new.turn_id, old.turn_id);
    assert!(new.fence > old.fence);
    let new_lease = lease(&new);

    assert_eq!(
        kind(store.heartbeat(&old_lease).await),
        ErrorKind::LeaseLost
    );
    assert_eq!(
        kind(store.claim_tool(&old_lease, &booking).await),
        ErrorKind::LeaseLost
    );
    assert_eq!(
        kind(
            store
                .complete_tool(
                    &old_lease,
                    &execution_id(&old_claim),
                    Completion::Result(canonical(&json!("late")))
                )
                .await
        ),
        ErrorKind::LeaseLost
    );
    assert_eq!(
        kind(
            store
                .end_turn(
                    &old_lease,
                    &Ending::Succeed {
                        response: canonical(&json!("late"))
                    }
                )
                .await
        ),
        ErrorKind::LeaseLost
    );
    let forged = LeaseRef {
        turn_id: new.turn_id.clone(),
        token: old.lease_token.clone(),
    };
    assert_eq!(kind(store.heartbeat(&forged).await), ErrorKind::LeaseLost);

    // The tool the dead holder claimed may have run: the new holder is told.
    let reclaim = store
        .claim_tool(&new_lease, &booking)
        .await
        .expect("reclaim");
    assert!(matches!(
        reclaim,
        ToolClaim::Execute {
            attempt: 2,
            previous_outcome: Some(PreviousOutcome::Unknown),
            ..
        }
    ));
    assert_eq!(execution_id(&reclaim), execution_id(&old_claim));
    store
        .heartbeat(&new_lease)
        .await
        .expect("new holder renews");
    let view = store
        .end_turn(
            &new_lease,
            &Ending::Succeed {
                response: canonical(&json!("done")),
            },
        )
        .await
        .expect("new holder ends");
    assert_eq!((view.state, view.attempt), (TurnState::Succeeded, 2));
    close(store, database).await;
}

/// Runs `tasks` begins at once behind a barrier; returns the grants and the
/// refusals' kinds.
async fn storm(
    store: &Arc<PostgresStore>,
    tasks: usize,
    make: impl Fn(usize) -> BeginCommand,
) -> (Vec<Grant>, Vec<ErrorKind>) {
    let barrier = Arc::new(Barrier::new(tasks));
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let (store, barrier, begin) = (Arc::clone(store), Arc::clone(&barrier), make(i));
            tokio::spawn(async move {
                barrier.wait().await;
                store.begin(&begin).await
            })
        })
        .collect();
    let (mut grants, mut refusals) = (Vec::new(), Vec::new());
    for handle in handles {
        match handle.await.expect("task ran") {
            Ok(outcome) => grants.push(started(outcome)),
            Err(error) => refusals.push(error.kind()),
        }
    }
    (grants, refusals)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_storm_starts_exactly_one() {
    let Some((store, database)) = open(Config::default()).await else {
        return;
    };
    let (grants, refusals) = storm(&store, 50, |_| {
        command("alice", "chat-1", "msg-1", &json!({"text": "hi"}))
    })
    .await;
    assert_eq!(grants.len(), 1, "refusals: {refusals:?}");
    assert!(
        refusals.iter().all(|k| *k == ErrorKind::RequestInFlight),
        "{refusals:?}"
    );
    close(store, database).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_storm_starts_exactly_one() {
    let Some((store, database)) = open(Config::default()).await else {
        return;
    };
    let (grants, refusals) = storm(&store, 50, |i| {
        command("alice", "chat-1", &format!("msg-{i}"), &json!(i))
    })
    .await;
    assert_eq!(grants.len(), 1, "refusals: {refusals:?}");
    assert!(
        refusals.iter().all(|k| *k == ErrorKind::SessionBusy),
        "{refusals:?}"
    );
    close(store, database).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn permit_storm_starts_exactly_the_cap() {
    let Some((store, database)) = open(Config::default()).await else {
        return;
    };
    let (grants, refusals) = storm(&store, 50, |i| {
        command("alice", &format!("chat-{i}"), "msg", &json!(i))
    })
    .await;
    assert_eq!(grants.len(), 5, "refusals: {refusals:?}");
    assert!(
        refusals.iter().all(|k| *k == ErrorKind::UserAtCapacity),
        "{refusals:?}"
    );
    let fences: std::collections::BTreeSet<_> = grants.iter().map(|g| g.fence).collect();
    assert_eq!(fences.len(), 5, "fences are never reused");
    close(store, database).await;
}

#[tokio::test]
async fn two_nodes_migrating_at_once_both_open() {
    let Some(database) = testing::TestDatabase::create().await else {
        return;
    };
    let (a, b) = tokio::join!(
        PostgresStore::open(database.url(), Config::default()),
        PostgresStore::open(database.url(), Config::default())
    );
    let (a, b) = (a.expect("node a"), b.expect("node b"));
    let grant = started(
        a.begin(&command("alice", "chat-1", "msg-1", &json!(1)))
            .await
            .expect("begin on a"),
    );
    assert_eq!(
        kind(
            b.begin(&command("alice", "chat-1", "msg-2", &json!(2)))
                .await
        ),
        ErrorKind::SessionBusy,
        "node b sees node a's lease"
    );
    b.heartbeat(&lease(&grant)).await.expect("any node renews");
    a.pool().close().await;
    close(Arc::new(b), database).await;
}

#[tokio::test]
async fn sweep_deletes_what_retention_expired() {
    let config = Config {
        result_retention: Duration::from_secs(1),
        ..Config::default()
    };
    let Some((store, database)) = open(config).await else {
        return;
    };
    let grant = started(
        store
            .begin(&command("alice", "chat-1", "msg-1", &json!(1)))
            .await
            .expect("begin"),
    );
    let ended = lease(&grant);
    let claim = store
        .claim_tool(&ended, &call("t", &json!(1)))
        .await
        .expect("claim");
    store
        .complete_tool(
            &ended,
            &execution_id(&claim),
            Completion::Result(canonical(&json!(1))),
        )
        .await
        .expect("complete");
    store
        .end_turn(
            &ended,
            &Ending::Succeed {
                response: canonical(&json!("ok")),
            },
        )
        .await
        .expect("end");
    let live = started(
        store
            .begin(&command("alice", "chat-2", "msg-1", &json!(1)))
            .await
            .expect("a running turn"),
    );
    assert_eq!(
        store.sweep().await.expect("early sweep").turns,
        0,
        "kept for the retention"
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    store.heartbeat(&lease(&live)).await.expect("still live");
    let report = store.sweep().await.expect("sweep");
    assert_eq!(
        (report.turns, report.executions, report.sessions),
        (1, 1, 1)
    );
    assert!(store.turn(&grant.turn_id).await.expect("view").is_none());
    assert!(store.turn(&live.turn_id).await.expect("view").is_some());
    close(store, database).await;
}
