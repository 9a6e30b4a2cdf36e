//! The layered begin's one `CALL` (`ag_begin_layered`, migration 0009) on a
//! server: it writes what the locked path writes with the same held lease,
//! and when it falls back, nothing at all.

use std::sync::Arc;

use agentgate_core::config::Config;
use agentgate_core::ids::{ClientRequestId, LeaseToken, SessionId, TurnId, UserId};
use agentgate_core::model::BeginCommand;
use agentgate_store_sql::begin::layered::LayeredBeginSql;
use agentgate_store_sql::begin::Held;
use agentgate_store_sql::query::Run;
use agentgate_store_sql::testing::{layered_grant_falls_back, write_held_start, UnaskedLayer};
use serde_json::json;

use crate::steps::Sql;
use crate::MySqlStore;

struct Server {
    store: MySqlStore,
    url: String,
}

impl Server {
    /// A store whose lease layer is never asked, so its rows are written as
    /// a layered store's are.
    async fn open_layered() -> Option<Self> {
        let url = crate::testing::fresh_database_url().await?;
        let config = Config {
            max_turns_per_user: 2,
            ..Config::default()
        };
        let store = MySqlStore::open_with_leases(&url, config, Some(Arc::new(UnaskedLayer)))
            .await
            .unwrap_or_else(|e| panic!("open: {e}"));
        Some(Self { store, url })
    }

    async fn close(self) {
        self.store.pool().close().await;
        crate::testing::drop_database(&self.url).await;
    }

    /// Every row of the three tables a begin writes, as text, in key order.
    async fn rows(&self) -> String {
        let mut all = String::new();
        for (table, columns, key) in [
            ("ag_users", "user_id, COALESCE(max_turns, '-')", "user_id"),
            (
                "ag_sessions",
                "session_id, user_id, COALESCE(holder_turn_id, '-'), \
                 COALESCE(lease_token_hash, '-'), fence, COALESCE(lease_expires_at_ms, '-'), \
                 COALESCE(pending_turn_id, '-'), updated_at_ms",
                "session_id",
            ),
            (
                "ag_turns",
                "turn_id, session_id, user_id, client_request_id, state, attempt, fence",
                "turn_id",
            ),
        ] {
            let rows: Vec<String> = sqlx::query_scalar(&format!(
                "SELECT CONVERT(CONCAT_WS(' ', {columns}) USING utf8mb4) FROM {table} ORDER BY {key}"
            ))
            .fetch_all(self.store.pool())
            .await
            .unwrap_or_else(|e| panic!("read {table}: {e}"));
            all.push_str(&format!("{table}: {rows:?}\n"));
        }
        all
    }

    /// A session row and its turn's row as a grant left them, with what
    /// differs between two grants (ids, times, fence, token) replaced by
    /// how they relate.
    async fn grant_rows(&self, session: &str) -> String {
        sqlx::query_scalar(
            "SELECT CONVERT(CONCAT_WS(' ', s.user_id, s.holder_turn_id = t.turn_id, \
               LENGTH(s.lease_token_hash), COALESCE(s.lease_expires_at_ms, '-'), \
               s.pending_turn_id IS NULL, t.fence = s.fence, \
               t.created_at_ms = s.updated_at_ms, t.updated_at_ms = s.updated_at_ms, \
               t.user_id, t.client_request_id, t.fingerprint, t.state, t.attempt, \
               COALESCE(t.response, '-'), COALESCE(t.error, '-'), COALESCE(t.retryable, '-'), \
               COALESCE(t.pending, '-'), COALESCE(t.confirms_turn_id, '-'), \
               COALESCE(t.decision, '-'), COALESCE(t.confirmed_by, '-'), \
               COALESCE(t.ended_at_ms, '-'), t.payload) USING utf8mb4) \
             FROM ag_sessions s JOIN ag_turns t ON t.session_id = s.session_id \
             WHERE s.session_id = ?",
        )
        .bind(session)
        .fetch_one(self.store.pool())
        .await
        .unwrap_or_else(|e| panic!("read the grant of {session}: {e}"))
    }

    /// A lease the layer holds under the next fence of the counter.
    async fn held(&self) -> Held {
        Held {
            turn_id: TurnId::generate(),
            token: LeaseToken::generate(),
            fence: Sql(&self.store)
                .reserve_fence(
                    &mut *Sql(&self.store)
                        .reader()
                        .await
                        .unwrap_or_else(|e| panic!("{e}")),
                )
                .await
                .unwrap_or_else(|e| panic!("fence: {e}")),
            lease_expires_in_ms: 30_000,
        }
    }
}

fn command(user: &str, session: &str, request: &str) -> BeginCommand {
    let make = || {
        BeginCommand::new(
            UserId::new(user)?,
            SessionId::new(session)?,
            ClientRequestId::new(request)?,
            &json!({ "message": request }),
            None,
        )
    };
    make().unwrap_or_else(|e| panic!("valid command: {e}"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"))
}

/// A new request on a free session: the one `CALL` writes exactly the rows
/// the locked path writes with the same held lease (no row expiry, the held
/// fence).
#[test]
fn layered_call_writes_what_the_full_path_writes() {
    runtime().block_on(async {
        let Some(server) = Server::open_layered().await else {
            return;
        };
        let sql = Sql(&server.store);
        let fast = server.held().await;
        let fence = fast.fence;
        let mut conn = sql.reader().await.unwrap_or_else(|e| panic!("{e}"));
        let wrote = sql
            .grant_layered_new(&mut conn, &command("u0", "s-fast", "r0"), &fast)
            .await
            .unwrap_or_else(|e| panic!("layered grant: {e}"));
        assert!(wrote, "a new user's new session fell back");
        let full_command = command("u0", "s-full", "r0");
        let full = server.held().await;
        write_held_start(&sql, &full_command, full).await;
        assert_eq!(
            server.grant_rows("s-fast").await,
            server.grant_rows("s-full").await
        );
        let stored: i64 =
            sqlx::query_scalar("SELECT fence FROM ag_sessions WHERE session_id = 's-fast'")
                .fetch_one(server.store.pool())
                .await
                .unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(stored, fence.0, "the held fence");
        server.close().await;
    });
}

/// Each way the layered `CALL` falls back (the shared cases): it answers
/// `false` and every row of every table is as before.
#[test]
fn layered_call_that_falls_back_writes_nothing() {
    runtime().block_on(async {
        let Some(server) = Server::open_layered().await else {
            return;
        };
        layered_grant_falls_back(&Sql(&server.store), || server.rows()).await;
        server.close().await;
    });
}

/// The cancel request's one `UPDATE` does what `decide::cancel_step`
/// says, in every turn state (the lease layer plays no part in it).
#[test]
fn cancel_request_agrees_with_decide() {
    runtime().block_on(async {
        let Some(server) = Server::open_layered().await else {
            return;
        };
        agentgate_store_sql::testing::cancel_agrees_with_decide(&Sql(&server.store)).await;
        server.close().await;
    });
}
