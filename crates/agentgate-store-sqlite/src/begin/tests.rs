//! The one-statement begin against the full path: it writes exactly the
//! rows the full path writes for a new start, in no explicit transaction,
//! and where the full path would not start a new turn it writes nothing.
//! And the one-statement ending: the session released by its trigger.

#![allow(clippy::unwrap_used)]

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::config::Config;
use agentgate_core::ids::{ClientRequestId, SessionId, UserId};
use agentgate_core::model::{BeginCommand, BeginOutcome, Ending, LeaseRef};
use agentgate_core::store::Store;
use serde_json::json;

use super::next_fence;
use crate::steps::Sql;
use crate::SqliteStore;
use agentgate_core::ids::{Fence, LeaseToken, TurnId};
use agentgate_store_sql::begin::layered::LayeredBeginSql;
use agentgate_store_sql::begin::{begin_full, BeginTx, Held};
use agentgate_store_sql::testing::{layered_grant_falls_back, write_held_start, UnaskedLayer};
use std::sync::Arc;

/// The one-statement begin of `store`.
async fn begin_new(
    store: &SqliteStore,
    command: &BeginCommand,
) -> agentgate_core::error::Result<Option<agentgate_core::model::Grant>> {
    Sql(store).begin_new(command).await
}

/// The one-statement layered grant of `store`.
async fn grant_layered_new(
    store: &SqliteStore,
    command: &BeginCommand,
    held: &Held,
) -> agentgate_core::error::Result<bool> {
    let mut conn = store.reader.acquire().await.unwrap();
    Sql(store).grant_layered_new(&mut conn, command, held).await
}

fn command(user: &str, session: &str, request: &str) -> BeginCommand {
    BeginCommand::new(
        UserId::new(user).unwrap(),
        SessionId::new(session).unwrap(),
        ClientRequestId::new(request).unwrap(),
        &json!({ "message": request }),
        None,
    )
    .unwrap()
}

async fn open(dir: &tempfile::TempDir, cap: u32) -> SqliteStore {
    let url = format!("sqlite://{}", dir.path().join("begin.db").display());
    let config = Config {
        max_turns_per_user: cap,
        ..Config::default()
    };
    SqliteStore::open(&url, config).await.unwrap()
}

/// [`open`] with the [`UnaskedLayer`].
async fn open_layered(dir: &tempfile::TempDir, cap: u32) -> SqliteStore {
    let url = format!("sqlite://{}", dir.path().join("layered.db").display());
    let config = Config {
        max_turns_per_user: cap,
        ..Config::default()
    };
    SqliteStore::open_with_leases(&url, config, Some(Arc::new(UnaskedLayer)))
        .await
        .unwrap()
}

/// A session's row and its turn's row as a grant left them, with what
/// differs between two grants (ids, times, fence, token) replaced by how
/// they relate.
async fn grant_rows(store: &SqliteStore, session: &str) -> String {
    sqlx::query_scalar(
        "SELECT concat_ws(' ', s.user_id, s.holder_turn_id = t.turn_id, \
           length(s.lease_token_hash), s.lease_expires_at_ms - s.updated_at_ms, \
           s.pending_turn_id IS NULL, s.pending_expires_at_ms IS NULL, \
           t.fence = s.fence, t.created_at_ms = s.updated_at_ms, t.updated_at_ms = s.updated_at_ms, \
           t.user_id, t.client_request_id, t.fingerprint, t.state, t.attempt, \
           coalesce(t.response, '-'), coalesce(t.error, '-'), coalesce(t.retryable, '-'), \
           coalesce(t.pending, '-'), coalesce(t.confirms_turn_id, '-'), \
           coalesce(t.confirms_pending, '-'), coalesce(t.decision, '-'), \
           coalesce(t.confirmed_by, '-'), coalesce(t.ended_at_ms, '-'), \
           coalesce(t.orphaned_at_ms, '-'), t.payload) \
         FROM ag_sessions s JOIN ag_turns t ON t.session_id = s.session_id \
         WHERE s.session_id = ?",
    )
    .bind(session)
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// Every row of the tables a begin may write, in a fixed order.
async fn all_rows(store: &SqliteStore) -> String {
    let mut all = String::new();
    for (table, key) in [
        ("ag_fence", "id"),
        ("ag_users", "user_id"),
        ("ag_sessions", "session_id"),
        ("ag_turns", "turn_id"),
        ("ag_begin_new", "turn_id"),
        ("ag_begin_layered", "turn_id"),
    ] {
        let columns: Vec<String> =
            sqlx::query_scalar("SELECT name FROM pragma_table_info(?) ORDER BY cid")
                .bind(table)
                .fetch_all(store.pool())
                .await
                .unwrap();
        let rows: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT json_array({}) FROM {table} ORDER BY {key}",
            columns.join(", ")
        ))
        .fetch_all(store.pool())
        .await
        .unwrap_or_else(|e| panic!("read {table}: {e}"));
        all.push_str(&format!("{table}: {rows:?}\n"));
    }
    all
}

#[tokio::test]
async fn a_new_start_in_one_statement_writes_what_the_full_path_writes() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, 5).await;
    let transactions = store.transactions_begun();
    let fast = begin_new(&store, &command("ann", "fast", "r1"))
        .await
        .unwrap()
        .expect("a new start on a free session is granted in one statement");
    assert_eq!(
        store.transactions_begun(),
        transactions,
        "no explicit transaction"
    );
    let full = match begin_full(&Sql(&store), &command("ann", "full", "r1"))
        .await
        .unwrap()
    {
        BeginOutcome::Started(grant) => grant,
        other => panic!("the full path starts: {other:?}"),
    };
    assert_eq!(
        grant_rows(&store, "fast").await,
        grant_rows(&store, "full").await
    );
    assert_eq!((fast.attempt, fast.takeover), (full.attempt, full.takeover));
    assert!(
        full.fence.0 > fast.fence.0,
        "fences grow: {fast:?} {full:?}"
    );
    let counter: i64 = sqlx::query_scalar("SELECT value FROM ag_fence")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(counter, full.fence.0, "the counter holds the newest fence");
    // The grant is the session's lease: the store sees the holder.
    let view = store
        .session(&SessionId::new("fast").unwrap())
        .await
        .unwrap()
        .unwrap();
    let holder = view.holder.expect("the fast grant holds the session");
    assert_eq!((holder.turn_id, holder.fence), (fast.turn_id, fast.fence));
}

/// Where `decide_begin` would not answer a new start, the statement inserts
/// nothing and changes no row: a repeat, a held session, another user's
/// session, a user at its cap, a cap row out of range. (A confirmation or a
/// lease layer never tries the statement.)
#[tokio::test]
async fn anything_but_a_new_start_falls_back_having_written_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, 2).await;
    begin_new(&store, &command("bo", "held", "r1"))
        .await
        .unwrap()
        .unwrap();
    begin_new(&store, &command("bo", "other", "r1"))
        .await
        .unwrap()
        .unwrap();
    sqlx::query("INSERT INTO ag_users (user_id, max_turns) VALUES ('huge', 4294967296)")
        .execute(store.pool())
        .await
        .unwrap();
    let before = all_rows(&store).await;
    for (why, user, session, request) in [
        (
            "a repeat of a request, on a free session",
            "bo",
            "free",
            "r1",
        ),
        ("a held session", "bo", "held", "r2"),
        ("another user's session", "cy", "held", "r3"),
        ("the user at its cap", "bo", "third", "r1"),
        ("a cap out of range", "huge", "h1", "r1"),
    ] {
        let answer = begin_new(&store, &command(user, session, request))
            .await
            .unwrap();
        assert!(answer.is_none(), "{why}: {answer:?}");
        assert_eq!(all_rows(&store).await, before, "{why} wrote nothing");
    }
}

/// The session row's lease and pending confirmation, and the turn's
/// `end_release`, as text (`concat_ws` leaves out the pending columns
/// while they are NULL).
async fn session_after_ending(store: &SqliteStore, session: &str) -> String {
    sqlx::query_scalar(
        "SELECT concat_ws(' ', coalesce(s.holder_turn_id, '-'), coalesce(s.lease_token_hash, '-'), \
           coalesce(s.lease_expires_at_ms, '-'), s.pending_turn_id = t.turn_id, \
           s.pending_expires_at_ms - t.updated_at_ms, coalesce(t.end_release, '-'), t.state) \
         FROM ag_sessions s JOIN ag_turns t ON t.session_id = s.session_id \
         WHERE s.session_id = ?",
    )
    .bind(session)
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// A turn's ending is one statement: the turn's update and, through its
/// trigger, the session's release (and the pending confirmation of an
/// ending that awaits one), with no explicit transaction.
#[tokio::test]
async fn an_ending_releases_the_session_in_one_statement() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, 5).await;
    let ttl_ms = agentgate_core::config::duration_ms(store.config.confirmation_ttl);
    for (session, ending, expected) in [
        (
            "done",
            Ending::Succeed {
                response: CanonicalJson::new("response", &json!("ok")).unwrap(),
            },
            "- - - - succeeded".to_owned(),
        ),
        (
            "asks",
            Ending::AwaitConfirmation {
                pending: CanonicalJson::new("pending", &json!({"amount": 3500})).unwrap(),
            },
            format!("- - - 1 {ttl_ms} - awaiting_confirmation"),
        ),
    ] {
        let grant = begin_new(&store, &command("di", session, "r1"))
            .await
            .unwrap()
            .unwrap();
        let lease = LeaseRef {
            turn_id: grant.turn_id.clone(),
            token: grant.lease_token.clone(),
        };
        let transactions = store.transactions_begun();
        let view = store.end_turn(&lease, &ending).await.unwrap();
        assert_eq!(store.transactions_begun(), transactions, "{session}");
        assert_eq!(view.turn_id, grant.turn_id);
        assert_eq!(session_after_ending(&store, session).await, expected);
        // The lease is gone: a second ending is refused and changes nothing.
        let again = store.end_turn(&lease, &ending).await.unwrap_err();
        assert_eq!(again.kind().code(), "lease_lost", "{session}");
        assert_eq!(session_after_ending(&store, session).await, expected);
    }
}

/// A grant whose lease the layer already holds under `fence`.
fn layered(fence: Fence) -> Held {
    Held {
        turn_id: TurnId::generate(),
        token: LeaseToken::generate(),
        fence,
        lease_expires_in_ms: 30_000,
    }
}

/// With a lease layer, the one-statement grant writes exactly the rows the
/// full path writes for a new start (no row expiry: the layer keeps the
/// lease), in no explicit transaction, and leaves the fence counter alone
/// (the fence was taken before the layer was asked).
#[tokio::test]
async fn a_layered_start_in_one_statement_writes_what_the_full_path_writes() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_layered(&dir, 5).await;
    let fast_fence = next_fence(&mut store.writer_connection().await.unwrap())
        .await
        .unwrap();
    let full_fence = next_fence(&mut store.writer_connection().await.unwrap())
        .await
        .unwrap();
    let transactions = store.transactions_begun();
    let wrote = grant_layered_new(&store, &command("lu", "fast", "r1"), &layered(fast_fence))
        .await
        .unwrap();
    assert!(
        wrote,
        "a new request on a free session is written in one statement"
    );
    assert_eq!(
        store.transactions_begun(),
        transactions,
        "no explicit transaction"
    );
    write_held_start(
        &Sql(&store),
        &command("lu", "full", "r1"),
        layered(full_fence),
    )
    .await;
    assert_eq!(
        grant_rows(&store, "fast").await,
        grant_rows(&store, "full").await
    );
    let counter: i64 = sqlx::query_scalar("SELECT value FROM ag_fence")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(
        counter, full_fence.0,
        "the counter is where the fences left it"
    );
    let expiry: Option<i64> =
        sqlx::query_scalar("SELECT lease_expires_at_ms FROM ag_sessions WHERE session_id = 'fast'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(expiry, None, "the layer keeps the lease, not the row");
}

/// Where the full path would not write this start, the one-statement
/// grant inserts nothing and changes no row (the shared cases).
#[tokio::test]
async fn a_layered_grant_falls_back_having_written_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, 2).await;
    layered_grant_falls_back(&Sql(&store), || all_rows(&store)).await;
}

/// The cancel request's one `UPDATE` does what `decide::cancel_step`
/// says, in every turn state.
#[tokio::test]
async fn cancel_request_agrees_with_decide() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, 2).await;
    agentgate_store_sql::testing::cancel_agrees_with_decide(&Sql(&store)).await;
}
