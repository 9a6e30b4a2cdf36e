//! The one-statement begin: its conditions against `decide_begin` (no
//! database), and on a server that it writes what the full path writes and,
//! when it falls back, nothing at all.

use agentgate_core::canonical::CanonicalJson;
use agentgate_core::config::Config;
use agentgate_core::decide::{
    decide_begin, BeginDecision, BeginFacts, StartKind, TurnSnapshot, UserLoad,
};
use agentgate_core::error::Result;
use agentgate_core::ids::{ClientRequestId, SessionId, UserId};
use agentgate_core::model::{
    BeginCommand, BeginOutcome, Confirmation, Decision, Ending, LeaseRef, TurnState,
};
use agentgate_core::store::Store;
use agentgate_store_sql::rows::{session_snapshot, Columns};
use serde_json::json;

use crate::steps::Sql;
use crate::PostgresStore;
use agentgate_core::ids::{LeaseToken, TurnId};
use agentgate_store_sql::begin::layered::LayeredBeginSql;
use agentgate_store_sql::begin::{begin_full, BeginTx, Held};
use agentgate_store_sql::query::Run;
use agentgate_store_sql::testing::{layered_grant_falls_back, write_held_start, UnaskedLayer};
use std::sync::Arc;

/// The one-statement begin of `store`.
async fn begin_new(
    store: &PostgresStore,
    command: &BeginCommand,
) -> Result<Option<agentgate_core::model::Grant>> {
    Sql(store).begin_new(command).await
}

/// A session's row as stored, `None` for NULL.
#[derive(Clone, Debug)]
struct Row {
    user_id: &'static str,
    holder_turn_id: Option<&'static str>,
    lease_expires_at_ms: Option<i64>,
    pending_turn_id: Option<&'static str>,
    pending_expires_at_ms: Option<i64>,
}

impl Columns for Row {
    fn text(&self, column: &str) -> Result<Option<String>> {
        let value = match column {
            "user_id" => Some(self.user_id),
            "holder_turn_id" => self.holder_turn_id,
            "pending_turn_id" => self.pending_turn_id,
            other => panic!("no text column {other}"),
        };
        Ok(value.map(str::to_owned))
    }

    fn int(&self, column: &str) -> Result<Option<i64>> {
        Ok(match column {
            "lease_expires_at_ms" => self.lease_expires_at_ms,
            "pending_expires_at_ms" => self.pending_expires_at_ms,
            other => panic!("no integer column {other}"),
        })
    }

    fn flag(&self, column: &str) -> Result<Option<bool>> {
        panic!("no flag column {column}")
    }
}

/// `ag_begin_new`'s grant condition (migration 0006), clause by clause,
/// with the two the caller checks first. `row` is the session's row, `None`
/// when the call creates it.
struct FastFacts<'a> {
    confirmation: bool,
    layer: bool,
    user_id: &'a str,
    row: Option<&'a Row>,
    turn_exists: bool,
    cap: Option<i64>,
    default_cap: u32,
    live: i64,
}

fn fast_path_grants(f: &FastFacts<'_>) -> bool {
    let session_free = f.row.is_none_or(|row| {
        row.user_id == f.user_id && row.holder_turn_id.is_none() && row.pending_turn_id.is_none()
    });
    let cap_valid = f
        .cap
        .is_none_or(|cap| (0..=i64::from(u32::MAX)).contains(&cap));
    !f.confirmation
        && !f.layer
        && session_free
        && cap_valid
        && !f.turn_exists
        && f.live < f.cap.unwrap_or(i64::from(f.default_cap))
}

const NOW_MS: i64 = 1_000_000;
const CALLER: &str = "u0";

fn rows() -> Vec<Option<Row>> {
    let times = [None, Some(NOW_MS - 1), Some(NOW_MS), Some(NOW_MS + 1)];
    let mut all = vec![None];
    for user_id in [CALLER, "u1"] {
        for holder in [None, Some("t-held")] {
            for lease in times {
                for pending in [None, Some("t-pending")] {
                    for pending_expiry in times {
                        all.push(Some(Row {
                            user_id,
                            holder_turn_id: holder,
                            lease_expires_at_ms: lease,
                            pending_turn_id: pending,
                            pending_expires_at_ms: pending_expiry,
                        }));
                    }
                }
            }
        }
    }
    all
}

fn turn(state: TurnState) -> TurnSnapshot {
    TurnSnapshot {
        turn_id: "t-own".to_owned(),
        session_id: "s0".to_owned(),
        fingerprint: "f0".to_owned(),
        state,
        attempt: 1,
        retryable: true,
        confirmed_by: None,
    }
}

/// Every combination of the facts the table in the module docs names:
/// wherever the one statement would grant, `decide_begin` on the same facts
/// answers `Start { New, attempt 1 }`. Both sides of the condition occur.
#[test]
fn fast_path_implies_a_new_start() {
    let turns = [
        None,
        Some(turn(TurnState::Running)),
        Some(turn(TurnState::Failed)),
        Some(turn(TurnState::Succeeded)),
    ];
    let caps = [
        None,
        Some(-1),
        Some(0),
        Some(1),
        Some(2),
        Some(i64::from(u32::MAX) + 1),
    ];
    let (mut granted, mut fell_back) = (0u32, 0u32);
    for row in rows() {
        for turn in &turns {
            for cap in caps {
                for default_cap in [1, 2] {
                    for live in 0..=3 {
                        for confirmation in [false, true] {
                            for layer in [false, true] {
                                for resume_only in [false, true] {
                                    let fast = FastFacts {
                                        confirmation,
                                        layer,
                                        user_id: CALLER,
                                        row: row.as_ref(),
                                        turn_exists: turn.is_some(),
                                        cap,
                                        default_cap,
                                        live,
                                    };
                                    if !fast_path_grants(&fast) {
                                        fell_back += 1;
                                        continue;
                                    }
                                    granted += 1;
                                    let decision = decide(&fast, turn.as_ref(), resume_only);
                                    assert!(
                                        matches!(
                                            decision,
                                            Some(BeginDecision::Start { kind: StartKind::New, attempt: 1 })
                                        ),
                                        "the one statement grants on {row:?}, cap {cap:?}/{default_cap}, \
                                         live {live}, but decide answers {decision:?}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(
        granted > 0 && fell_back > 0,
        "granted {granted}, fell back {fell_back}"
    );
}

/// What the full path decides on the same facts, reading them as it does
/// (the shared row decoding, `UserLoad::read`); `None` when reading them
/// fails (a corrupt cap).
fn decide(
    fast: &FastFacts<'_>,
    turn: Option<&TurnSnapshot>,
    resume_only: bool,
) -> Option<BeginDecision> {
    // A new row is what the locking upsert creates: the caller's, free.
    let new_row = Row {
        user_id: CALLER,
        holder_turn_id: None,
        lease_expires_at_ms: None,
        pending_turn_id: None,
        pending_expires_at_ms: None,
    };
    let session = session_snapshot(fast.row.unwrap_or(&new_row)).ok()?;
    let load: UserLoad = UserLoad::read(fast.cap, fast.default_cap, fast.live, None).ok()?;
    Some(decide_begin(&BeginFacts {
        now_ms: NOW_MS,
        user_id: fast.user_id,
        session_id: "s0",
        fingerprint: "f0",
        confirms: fast.confirmation.then_some("t-pending"),
        session: Some(&session),
        turn,
        confirm_target: None,
        continuation: None,
        load,
        resume_only,
        // The one-call begin falls back whenever a turn is queued
        // (migration 0010), so its cases are those of an empty queue.
        queue: agentgate_core::decide::QueueFacts::default(),
        enqueue: None,
    }))
}

// On a server.

struct Server {
    store: PostgresStore,
    url: String,
}

impl Server {
    async fn open() -> Option<Self> {
        let url = crate::testing::fresh_database_url().await?;
        let config = Config {
            max_turns_per_user: 2,
            ..Config::default()
        };
        let store = PostgresStore::open(&url, config)
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
        for (table, key) in [
            ("ag_users", "user_id"),
            ("ag_sessions", "session_id"),
            ("ag_turns", "turn_id"),
        ] {
            let rows: Vec<String> =
                sqlx::query_scalar(&format!("SELECT t::text FROM {table} t ORDER BY {key}"))
                    .fetch_all(self.store.pool())
                    .await
                    .unwrap_or_else(|e| panic!("read {table}: {e}"));
            all.push_str(&format!("{table}: {rows:?}\n"));
        }
        all
    }
}

fn command(user: &str, session: &str, request: &str) -> BeginCommand {
    command_confirming(user, session, request, None)
}

fn command_confirming(
    user: &str,
    session: &str,
    request: &str,
    confirmation: Option<Confirmation>,
) -> BeginCommand {
    let make = || {
        BeginCommand::new(
            UserId::new(user)?,
            SessionId::new(session)?,
            ClientRequestId::new(request)?,
            &json!({ "message": request }),
            confirmation,
        )
    };
    make().unwrap_or_else(|e| panic!("valid command: {e}"))
}

/// A session row and its turn's row as the begin left them, with what
/// differs between two grants (ids, times, fence, token) replaced by how
/// they relate: the expiry one TTL after the grant's instant, the turn's
/// fence the session's, its times the grant's.
async fn grant_rows(server: &Server, session: &str) -> String {
    let row: (String,) = sqlx::query_as(
        "SELECT concat_ws(' ', s.user_id, s.holder_turn_id = t.turn_id, \
           length(s.lease_token_hash), s.lease_expires_at_ms - s.updated_at_ms, \
           s.pending_turn_id IS NULL, s.pending_expires_at_ms IS NULL, \
           t.fence = s.fence, t.created_at_ms = s.updated_at_ms, t.updated_at_ms = s.updated_at_ms, \
           t.user_id, t.client_request_id, t.fingerprint, t.state, t.attempt, \
           coalesce(t.response, '-'), coalesce(t.error, '-'), coalesce(t.retryable::text, '-'), \
           coalesce(t.pending, '-'), coalesce(t.confirms_turn_id, '-'), \
           coalesce(t.confirms_pending, '-'), coalesce(t.decision, '-'), \
           coalesce(t.confirmed_by, '-'), coalesce(t.ended_at_ms::text, '-'), \
           coalesce(t.orphaned_at_ms::text, '-'), t.payload) \
         FROM ag_sessions s JOIN ag_turns t ON t.session_id = s.session_id \
         WHERE s.session_id = $1",
    )
    .bind(session)
    .fetch_one(server.store.pool())
    .await
    .unwrap_or_else(|e| panic!("read the grant of {session}: {e}"));
    row.0
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"))
}

/// A new turn, a new user and session: one statement grants, and its rows
/// read like the full path's grant of the same request on another session.
#[test]
fn one_statement_grants_what_the_full_path_grants() {
    runtime().block_on(async {
        let Some(server) = Server::open().await else {
            return;
        };
        let fast = begin_new(&server.store, &command("u0", "s-fast", "r0"))
            .await
            .unwrap_or_else(|e| panic!("fast begin: {e}"))
            .unwrap_or_else(|| panic!("a new user's new session fell back"));
        assert_eq!((fast.attempt, fast.takeover), (1, false));
        assert!(fast.confirmation.is_none());
        let full = match begin_full(&Sql(&server.store), &command("u0", "s-full", "r0")).await {
            Ok(BeginOutcome::Started(grant)) => grant,
            other => panic!("full begin: {other:?}"),
        };
        assert!(full.fence > fast.fence, "fences come from one sequence");
        assert_eq!(fast.lease_expires_in_ms, full.lease_expires_in_ms);
        assert_eq!(
            grant_rows(&server, "s-fast").await,
            grant_rows(&server, "s-full").await
        );
        // The lease it grants is the session's: the next step accepts it.
        let lease = LeaseRef {
            turn_id: fast.turn_id.clone(),
            token: fast.lease_token.clone(),
        };
        let status = server
            .store
            .heartbeat(&lease)
            .await
            .unwrap_or_else(|e| panic!("heartbeat: {e}"));
        assert!(status.lease_expires_in_ms > 0);
        // A free session of the caller's, ended before: one statement again.
        end(&server, &lease, succeed()).await;
        let again = begin_new(&server.store, &command("u0", "s-fast", "r1"))
            .await
            .unwrap_or_else(|e| panic!("fast begin: {e}"));
        assert!(again.is_some_and(|g| g.fence > full.fence));
        server.close().await;
    });
}

fn succeed() -> Ending {
    Ending::Succeed {
        response: CanonicalJson::new("response", &json!({ "reply": 1 }))
            .unwrap_or_else(|e| panic!("{e}")),
    }
}

async fn end(server: &Server, lease: &LeaseRef, ending: Ending) {
    server
        .store
        .end_turn(lease, &ending)
        .await
        .unwrap_or_else(|e| panic!("end: {e}"));
}

/// Each way the one statement falls back, including after creating the
/// user's or the session's row for its locks: it answers `None` and every
/// row of every table is as before.
#[test]
fn one_statement_that_falls_back_writes_nothing() {
    runtime().block_on(async {
        let Some(server) = Server::open().await else {
            return;
        };
        let store = &server.store;
        let held = begin_new(store, &command("u0", "s0", "r0"))
            .await
            .unwrap_or_else(|e| panic!("fast begin: {e}"))
            .unwrap_or_else(|| panic!("a new session fell back"));
        let falls_back = |command: BeginCommand, why: &'static str| {
            let server = &server;
            async move {
                let before = server.rows().await;
                let answer = begin_new(&server.store, &command)
                    .await
                    .unwrap_or_else(|e| panic!("{why}: {e}"));
                assert!(answer.is_none(), "{why}: granted {answer:?}");
                assert_eq!(server.rows().await, before, "{why}: rows changed");
            }
        };
        falls_back(command("u1", "s0", "r9"), "another user's session").await;
        falls_back(command("u0", "s0", "r1"), "a held session").await;
        falls_back(command("u0", "s0", "r0"), "the request's own turn").await;
        store
            .set_user_cap(
                &UserId::new("u0").unwrap_or_else(|e| panic!("{e}")),
                Some(1),
            )
            .await
            .unwrap_or_else(|e| panic!("cap: {e}"));
        falls_back(
            command("u0", "s-new", "r0"),
            "at capacity, a new session row",
        )
        .await;
        let lease = LeaseRef {
            turn_id: held.turn_id.clone(),
            token: held.lease_token.clone(),
        };
        let pending = CanonicalJson::new("pending", &json!({ "action": 1 }))
            .unwrap_or_else(|e| panic!("{e}"));
        end(&server, &lease, Ending::AwaitConfirmation { pending }).await;
        falls_back(command("u0", "s0", "r2"), "a pending confirmation").await;
        let confirming = command_confirming(
            "u0",
            "s0",
            "r3",
            Some(Confirmation {
                turn_id: held.turn_id.clone(),
                decision: Decision::Approve,
            }),
        );
        falls_back(confirming, "a confirmation").await;
        // A first use refused only under the locks, after creating both
        // rows: a default cap of 0, which no configuration allows, so the
        // function is called directly.
        let before = server.rows().await;
        let fence: Option<i64> = sqlx::query_scalar(
            "SELECT ag_begin_new('s-first', 'u-first', 'r0', 't-first', 'digest', \
             'fingerprint', '{}', 1000, 0, '5s')",
        )
        .fetch_one(store.pool())
        .await
        .unwrap_or_else(|e| panic!("first use at a cap of 0: {e}"));
        assert_eq!(fence, None, "granted at a cap of 0");
        assert_eq!(
            server.rows().await,
            before,
            "a first use at a cap of 0: rows changed"
        );
        server.close().await;
    });
}

// The layered begin's one statement (`ag_begin_layered`, migration 0009).

/// A store whose lease layer is never asked, so its rows are written as a
/// layered store's are.
async fn open_layered() -> Option<Server> {
    let url = crate::testing::fresh_database_url().await?;
    let config = Config {
        max_turns_per_user: 2,
        ..Config::default()
    };
    let store = PostgresStore::open_with_leases(&url, config, Some(Arc::new(UnaskedLayer)))
        .await
        .unwrap_or_else(|e| panic!("open: {e}"));
    Some(Server { store, url })
}

/// A lease the layer holds under the next fence of the sequence.
async fn held(server: &Server) -> Held {
    Held {
        turn_id: TurnId::generate(),
        token: LeaseToken::generate(),
        fence: Sql(&server.store)
            .reserve_fence(
                &mut *server
                    .store
                    .pool()
                    .acquire()
                    .await
                    .unwrap_or_else(|e| panic!("{e}")),
            )
            .await
            .unwrap_or_else(|e| panic!("fence: {e}")),
        lease_expires_in_ms: 30_000,
    }
}

/// A new request on a free session: the one statement writes exactly the
/// rows the locked path writes with the same held lease (no row expiry, the
/// held fence), and the lease is the session's.
#[test]
fn layered_one_statement_writes_what_the_full_path_writes() {
    runtime().block_on(async {
        let Some(server) = open_layered().await else {
            return;
        };
        let sql = Sql(&server.store);
        let fast = held(&server).await;
        let fence = fast.fence;
        let mut conn = sql.reader().await.unwrap_or_else(|e| panic!("{e}"));
        let wrote = sql
            .grant_layered_new(&mut conn, &command("u0", "s-fast", "r0"), &fast)
            .await
            .unwrap_or_else(|e| panic!("layered grant: {e}"));
        assert!(wrote, "a new user's new session fell back");
        let full = held(&server).await;
        write_held_start(&Sql(&server.store), &command("u0", "s-full", "r0"), full).await;
        assert_eq!(
            grant_rows(&server, "s-fast").await,
            grant_rows(&server, "s-full").await
        );
        let (stored, expiry): (i64, Option<i64>) = sqlx::query_as(
            "SELECT fence, lease_expires_at_ms FROM ag_sessions WHERE session_id = 's-fast'",
        )
        .fetch_one(server.store.pool())
        .await
        .unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(stored, fence.0, "the held fence");
        assert_eq!(expiry, None, "the layer keeps the lease, not the row");
        server.close().await;
    });
}

/// Each way the layered one statement falls back (the shared cases): it
/// answers `false` and every row of every table is as before.
#[test]
fn layered_one_statement_that_falls_back_writes_nothing() {
    runtime().block_on(async {
        let Some(server) = open_layered().await else {
            return;
        };
        layered_grant_falls_back(&Sql(&server.store), || server.rows()).await;
        server.close().await;
    });
}

/// The cancel request's one `UPDATE` does what `decide::cancel_step`
/// says, in every turn state.
#[test]
fn cancel_request_agrees_with_decide() {
    runtime().block_on(async {
        let Some(server) = Server::open().await else {
            return;
        };
        agentgate_store_sql::testing::cancel_agrees_with_decide(&Sql(&server.store)).await;
        server.close().await;
    });
}
