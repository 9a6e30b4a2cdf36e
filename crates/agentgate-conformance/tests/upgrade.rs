//! Upgrading a store whose database holds rows written under the previous
//! schema (issue 11): on each SQL store, a scratch database gets only the
//! OLD migrations (every file in the store's `migrations/` before the one
//! this test upgrades across, each recorded in `ag_schema_version` exactly as the store records it),
//! then rows the old schema held: a session with a live holder and its
//! running turn, tool executions succeeded, failed and running under that
//! holder, a turn awaiting confirmation with its pending action, a succeeded
//! turn with its response, and a confirmed turn with the continuation that
//! took its decision (written the old way: the carried action in the
//! continuation's `pending`, which that migration moves). Then the
//! store is opened with the current code, which applies the rest, and the
//! rows are used through the `Store` API:
//!
//! - every view (turns, executions, sessions, the user, the overview,
//!   orphans) reads every row, none `corrupt`;
//! - the live holder still holds: another request finds the session busy,
//!   the turn's own repeat is in flight;
//! - once its lease expires the running turn is an orphan, and claiming it
//!   resumes it with a newer fence and attempt 2; the old token then
//!   changes nothing; the new holder finds the succeeded execution cached
//!   and re-executes the failed one (`failed`) and the interrupted one
//!   (`unknown`);
//! - the pending confirmation blocks other requests, and answering it
//!   starts the continuation carrying the pending action;
//! - the succeeded turn replays its stored response;
//! - the old continuation shows the action it carried as its confirmation's
//!   and no pending action of its own.
//!
//! Server-backed stores skip with a printed reason when their server is
//! absent, unless `AGENTGATE_REQUIRE_SERVICES=1`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use agentgate::{Config, Error, Gate};
use agentgate_core::canonical::CanonicalJson;
use agentgate_core::ids::{ClientRequestId, LeaseToken, SessionId, ToolName, TurnId, UserId};
use agentgate_core::model::{
    idempotency_key, BeginCommand, BeginOutcome, Confirmation, Decision, Ending, LeaseRef,
    OrphanFilter, PreviousOutcome, ToolCall, ToolClaim, TurnState,
};
use agentgate_core::store::{all_executions, Completion, Store};
use serde_json::{json, Value};
use sqlx::Connection;

/// The migration of each store this test upgrades across: the rows below
/// are written for the schema before it; the store applies it and every
/// later one. (A later migration that changes what old rows mean deserves
/// old rows of its own here.)
const NEWEST_SQLITE: i64 = 4;
const NEWEST_POSTGRES: i64 = 5;
const NEWEST_MYSQL: i64 = 5;

/// The live holder's lease at insertion: long enough for the checks of a
/// live lease, short enough to wait out.
const OLD_LEASE_MS: i64 = 1_500;
/// How long the test waits for that lease to expire at most.
const EXPIRY_WAIT: Duration = Duration::from_secs(10);
/// The store-wide fence counter in the old database: above every fence in
/// its rows, so a new grant's fence is newer than all of them.
const OLD_FENCE_COUNTER: i64 = 10;
/// The running turn's fence.
const LIVE_FENCE: i64 = 7;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dialect {
    Sqlite,
    Postgres,
    MySql,
}

impl Dialect {
    fn crate_dir(self) -> &'static str {
        match self {
            Self::Sqlite => "agentgate-store-sqlite",
            Self::Postgres => "agentgate-store-postgres",
            Self::MySql => "agentgate-store-mysql",
        }
    }

    /// The migration this test upgrades across.
    fn newest(self) -> i64 {
        match self {
            Self::Sqlite => NEWEST_SQLITE,
            Self::Postgres => NEWEST_POSTGRES,
            Self::MySql => NEWEST_MYSQL,
        }
    }

    /// The version table as each store creates it (its `migrate`).
    fn version_table(self) -> &'static str {
        match self {
            Self::Sqlite => "CREATE TABLE IF NOT EXISTS ag_schema_version (version INTEGER NOT NULL)",
            Self::Postgres => {
                "CREATE TABLE IF NOT EXISTS ag_schema_version (version BIGINT PRIMARY KEY, \
                 applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
            }
            Self::MySql => {
                "CREATE TABLE IF NOT EXISTS ag_schema_version (version BIGINT NOT NULL PRIMARY KEY, \
                 applied_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB"
            }
        }
    }

    /// The store's clock, as its `NOW_MS`.
    fn now_ms(self) -> &'static str {
        match self {
            Self::Sqlite => "SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER)",
            Self::Postgres => "SELECT floor(extract(epoch from statement_timestamp()) * 1000)::bigint",
            Self::MySql => {
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)"
            }
        }
    }

    fn set_fence_counter(self) -> String {
        match self {
            Self::Postgres => format!("SELECT setval('ag_fence_seq', {OLD_FENCE_COUNTER})"),
            Self::Sqlite | Self::MySql => {
                format!("UPDATE ag_fence SET value = {OLD_FENCE_COUNTER} WHERE id = 1")
            }
        }
    }
}

/// The store's migration files, oldest first, with their versions.
fn migrations(dialect: Dialect) -> Vec<(i64, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(dialect.crate_dir())
        .join("migrations");
    let mut files: Vec<(i64, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "sql"))
        .map(|path| {
            let name = path
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            let version: i64 = name
                .split('_')
                .next()
                .and_then(|digits| digits.parse().ok())
                .unwrap_or_else(|| panic!("{name}: a migration file starts with its version"));
            let sql = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
            (version, sql)
        })
        .collect();
    files.sort_by_key(|(version, _)| *version);
    let versions: Vec<i64> = files.iter().map(|(v, _)| *v).collect();
    let expected: Vec<i64> = (1..=versions.len() as i64).collect();
    assert_eq!(
        versions, expected,
        "{dialect:?}: migrations are numbered 1, 2, …"
    );
    assert!(
        versions.contains(&dialect.newest()),
        "{dialect:?}: migration {} is the one this test upgrades across",
        dialect.newest()
    );
    files
}

/// A value bound into an old row.
enum V {
    T(String),
    I(i64),
    B(bool),
}

fn t(text: impl Into<String>) -> V {
    V::T(text.into())
}

/// A raw connection to the scratch database, for the old schema and rows.
enum Db {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
    MySql(sqlx::MySqlConnection),
}

impl Db {
    async fn connect(dialect: Dialect, url: &str) -> Self {
        match dialect {
            Dialect::Sqlite => {
                let options: sqlx::sqlite::SqliteConnectOptions =
                    url.parse().expect("a sqlite url");
                Self::Sqlite(
                    sqlx::SqliteConnection::connect_with(&options.create_if_missing(true))
                        .await
                        .expect("connect sqlite"),
                )
            }
            Dialect::Postgres => Self::Postgres(
                sqlx::PgConnection::connect(url)
                    .await
                    .expect("connect postgres"),
            ),
            Dialect::MySql => Self::MySql(
                sqlx::MySqlConnection::connect(url)
                    .await
                    .expect("connect mysql"),
            ),
        }
    }

    async fn raw(&mut self, sql: &str) {
        let done = match self {
            Self::Sqlite(c) => sqlx::raw_sql(sql).execute(c).await.map(|_| ()),
            Self::Postgres(c) => sqlx::raw_sql(sql).execute(c).await.map(|_| ()),
            Self::MySql(c) => sqlx::raw_sql(sql).execute(c).await.map(|_| ()),
        };
        done.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn now_ms(&mut self, dialect: Dialect) -> i64 {
        let sql = dialect.now_ms();
        let now = match self {
            Self::Sqlite(c) => sqlx::query_scalar(sql).fetch_one(c).await,
            Self::Postgres(c) => sqlx::query_scalar(sql).fetch_one(c).await,
            Self::MySql(c) => sqlx::query_scalar(sql).fetch_one(c).await,
        };
        now.unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Inserts one row: `values` by column name.
    async fn insert(&mut self, table: &str, values: Vec<(&str, V)>) {
        let columns: Vec<&str> = values.iter().map(|(c, _)| *c).collect();
        let marks: Vec<String> = match self {
            Self::Postgres(_) => (1..=values.len()).map(|n| format!("${n}")).collect(),
            _ => vec!["?".to_owned(); values.len()],
        };
        let sql = format!(
            "INSERT INTO {table} ({}) VALUES ({})",
            columns.join(", "),
            marks.join(", ")
        );
        macro_rules! bind_all {
            ($conn:expr) => {{
                let mut query = sqlx::query(&sql);
                for (_, value) in values {
                    query = match value {
                        V::T(text) => query.bind(text),
                        V::I(n) => query.bind(n),
                        V::B(b) => query.bind(b),
                    };
                }
                query.execute($conn).await.map(|_| ())
            }};
        }
        let done = match self {
            Self::Sqlite(c) => bind_all!(c),
            Self::Postgres(c) => bind_all!(c),
            Self::MySql(c) => bind_all!(c),
        };
        done.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn close(self) {
        let _ = match self {
            Self::Sqlite(c) => c.close().await,
            Self::Postgres(c) => c.close().await,
            Self::MySql(c) => c.close().await,
        };
    }
}

fn valid<T>(made: agentgate::Result<T>) -> T {
    made.unwrap_or_else(|e| panic!("the test makes valid ids and JSON: {e}"))
}

fn canonical(value: &Value) -> String {
    valid(CanonicalJson::new("value", value))
        .as_str()
        .to_owned()
}

/// The ids and requests of the old rows.
struct Old {
    user: UserId,
    token: LeaseToken,
    live_begin: BeginCommand,
    done_begin: BeginCommand,
    awaiting_session: SessionId,
    cached: ToolCall,
    failed: ToolCall,
    interrupted: ToolCall,
}

const LIVE_TURN: &str = "turn_old_live";
const AWAITING_TURN: &str = "turn_old_awaiting";
const DONE_TURN: &str = "turn_old_done";
const CONFIRMED_TURN: &str = "turn_old_confirmed";
const CONTINUATION_TURN: &str = "turn_old_continuation";

fn pending_action() -> Value {
    json!({ "action": "pay", "amount": 500 })
}

fn carried_action() -> Value {
    json!({ "action": "refund", "amount": 20 })
}

fn old_ids() -> Old {
    let user = valid(UserId::new("old-user"));
    let command = |session: &str, request: &str, payload: Value| {
        valid(BeginCommand::new(
            user.clone(),
            valid(SessionId::new(session)),
            valid(ClientRequestId::new(request)),
            &payload,
            None,
        ))
    };
    let call = |tool: &str, args: Value| valid(ToolCall::new(valid(ToolName::new(tool)), &args));
    Old {
        user: user.clone(),
        token: valid(LeaseToken::parse("lt_old_live_holder_token")),
        live_begin: command("old-live", "r-live", json!({ "message": "book lunch 35" })),
        done_begin: command("old-done", "r-done", json!({ "message": "taxi 18" })),
        awaiting_session: valid(SessionId::new("old-awaiting")),
        cached: call("create_transaction", json!({ "amount": 35 })),
        failed: call("list_categories", json!({ "type": "expense" })),
        interrupted: call("send_email", json!({ "to": "a@example.com" })),
    }
}

/// Writes the old rows, in the old schema, on the store's clock.
#[allow(clippy::too_many_lines)]
async fn write_old_rows(db: &mut Db, dialect: Dialect, old: &Old) {
    let now = db.now_ms(dialect).await;
    db.raw(&dialect.set_fence_counter()).await;
    let user = || t(old.user.as_str());
    db.insert(
        "ag_users",
        vec![("user_id", user()), ("max_turns", V::I(4))],
    )
    .await;
    // The live holder: session, running turn, its executions.
    let live_turn = valid(TurnId::new(LIVE_TURN));
    db.insert(
        "ag_sessions",
        vec![
            ("session_id", t(old.live_begin.session_id.as_str())),
            ("user_id", user()),
            ("holder_turn_id", t(LIVE_TURN)),
            ("lease_token_hash", t(old.token.digest_hex())),
            ("fence", V::I(LIVE_FENCE)),
            ("lease_expires_at_ms", V::I(now + OLD_LEASE_MS)),
            ("updated_at_ms", V::I(now)),
        ],
    )
    .await;
    db.insert(
        "ag_turns",
        vec![
            ("turn_id", t(LIVE_TURN)),
            ("session_id", t(old.live_begin.session_id.as_str())),
            ("user_id", user()),
            (
                "client_request_id",
                t(old.live_begin.client_request_id.as_str()),
            ),
            ("fingerprint", t(old.live_begin.fingerprint.as_hex())),
            ("payload", t(old.live_begin.payload.as_str())),
            ("state", t("running")),
            ("attempt", V::I(1)),
            ("fence", V::I(LIVE_FENCE)),
            ("created_at_ms", V::I(now - 5_000)),
            ("updated_at_ms", V::I(now)),
        ],
    )
    .await;
    let executions = [
        (
            "exec_old_cached",
            &old.cached,
            "succeeded",
            Some(json!({ "booked": 35 })),
            None,
        ),
        (
            "exec_old_failed",
            &old.failed,
            "failed",
            None,
            Some(json!({ "code": "timeout" })),
        ),
        (
            "exec_old_interrupted",
            &old.interrupted,
            "running",
            None,
            None,
        ),
    ];
    for (k, (id, call, state, result, error)) in executions.into_iter().enumerate() {
        let at = now - 4_000 + i64::try_from(k).expect("three executions");
        let mut row = vec![
            ("execution_id", t(id)),
            ("turn_id", t(LIVE_TURN)),
            ("tool", t(call.tool.as_str())),
            ("args_hash", t(call.args_hash.as_hex())),
            ("idempotency_key", t(idempotency_key(&live_turn, call))),
            ("state", t(state)),
            ("attempt", V::I(1)),
            ("fence", V::I(LIVE_FENCE)),
            ("created_at_ms", V::I(at)),
            ("updated_at_ms", V::I(at)),
        ];
        if let Some(result) = result {
            row.push(("result", t(canonical(&result))));
        }
        if let Some(error) = error {
            row.push(("error", t(canonical(&error))));
        }
        db.insert("ag_tool_executions", row).await;
    }
    // A turn awaiting confirmation, and its session's pending confirmation.
    db.insert(
        "ag_sessions",
        vec![
            ("session_id", t(old.awaiting_session.as_str())),
            ("user_id", user()),
            ("fence", V::I(5)),
            ("pending_turn_id", t(AWAITING_TURN)),
            ("pending_expires_at_ms", V::I(now + 3_600_000)),
            ("updated_at_ms", V::I(now - 1_000)),
        ],
    )
    .await;
    let awaiting_begin = valid(BeginCommand::new(
        old.user.clone(),
        old.awaiting_session.clone(),
        valid(ClientRequestId::new("r-awaiting")),
        &json!({ "message": "rent 500" }),
        None,
    ));
    db.insert(
        "ag_turns",
        vec![
            ("turn_id", t(AWAITING_TURN)),
            ("session_id", t(old.awaiting_session.as_str())),
            ("user_id", user()),
            ("client_request_id", t("r-awaiting")),
            ("fingerprint", t(awaiting_begin.fingerprint.as_hex())),
            ("payload", t(awaiting_begin.payload.as_str())),
            ("state", t("awaiting_confirmation")),
            ("attempt", V::I(1)),
            ("fence", V::I(5)),
            ("pending", t(canonical(&pending_action()))),
            ("created_at_ms", V::I(now - 2_000)),
            ("updated_at_ms", V::I(now - 1_000)),
            ("ended_at_ms", V::I(now - 1_000)),
        ],
    )
    .await;
    // A succeeded turn with its stored response.
    db.insert(
        "ag_sessions",
        vec![
            ("session_id", t(old.done_begin.session_id.as_str())),
            ("user_id", user()),
            ("fence", V::I(4)),
            ("updated_at_ms", V::I(now - 3_000)),
        ],
    )
    .await;
    db.insert(
        "ag_turns",
        vec![
            ("turn_id", t(DONE_TURN)),
            ("session_id", t(old.done_begin.session_id.as_str())),
            ("user_id", user()),
            (
                "client_request_id",
                t(old.done_begin.client_request_id.as_str()),
            ),
            ("fingerprint", t(old.done_begin.fingerprint.as_hex())),
            ("payload", t(old.done_begin.payload.as_str())),
            ("state", t("succeeded")),
            ("attempt", V::I(1)),
            ("fence", V::I(4)),
            (
                "response",
                t(canonical(&json!({ "reply": "booked taxi 18" }))),
            ),
            ("created_at_ms", V::I(now - 4_000)),
            ("updated_at_ms", V::I(now - 3_000)),
            ("ended_at_ms", V::I(now - 3_000)),
        ],
    )
    .await;
    // A confirmed turn and its continuation, written the old way: the
    // continuation's `pending` holds the action it carries.
    db.insert(
        "ag_sessions",
        vec![
            ("session_id", t("old-confirmed")),
            ("user_id", user()),
            ("fence", V::I(3)),
            ("updated_at_ms", V::I(now - 6_000)),
        ],
    )
    .await;
    let turn = |id: &str, request: &str, state: &str, fence: i64, at: i64| {
        vec![
            ("turn_id", t(id)),
            ("session_id", t("old-confirmed")),
            ("user_id", user()),
            ("client_request_id", t(request)),
            ("fingerprint", t("0".repeat(64))),
            ("payload", t("null")),
            ("state", t(state)),
            ("attempt", V::I(1)),
            ("fence", V::I(fence)),
            ("created_at_ms", V::I(at)),
            ("updated_at_ms", V::I(at)),
            ("ended_at_ms", V::I(at)),
        ]
    };
    let mut confirmed = turn(CONFIRMED_TURN, "r-confirmed", "confirmed", 2, now - 8_000);
    confirmed.push(("pending", t(canonical(&carried_action()))));
    confirmed.push(("confirmed_by", t(CONTINUATION_TURN)));
    db.insert("ag_turns", confirmed).await;
    let mut continuation = turn(
        CONTINUATION_TURN,
        "r-continuation",
        "succeeded",
        3,
        now - 6_000,
    );
    continuation.push(("pending", t(canonical(&carried_action()))));
    continuation.push(("confirms_turn_id", t(CONFIRMED_TURN)));
    continuation.push(("decision", t("approve")));
    continuation.push(("response", t(canonical(&json!({ "reply": "refunded" })))));
    continuation.push(("retryable", V::B(false)));
    db.insert("ag_turns", continuation).await;
}

/// Applies the old migrations and rows to the empty database at `url`.
async fn old_database(dialect: Dialect, url: &str, old: &Old) {
    let files = migrations(dialect);
    let across = dialect.newest();
    let old_files: Vec<_> = files.iter().filter(|(v, _)| *v < across).collect();
    let mut db = Db::connect(dialect, url).await;
    db.raw(dialect.version_table()).await;
    for (version, sql) in old_files {
        db.raw(sql).await;
        db.raw(&format!(
            "INSERT INTO ag_schema_version (version) VALUES ({version})"
        ))
        .await;
    }
    write_old_rows(&mut db, dialect, old).await;
    db.close().await;
}

fn turn_id(id: &str) -> TurnId {
    valid(TurnId::new(id))
}

/// Every view reads every old row: none is `corrupt`, none missing; the
/// running turn's executions are in `states`.
async fn views_read_everything(store: &dyn Store, old: &Old, states: [&str; 3]) {
    for id in [
        LIVE_TURN,
        AWAITING_TURN,
        DONE_TURN,
        CONFIRMED_TURN,
        CONTINUATION_TURN,
    ] {
        let view = store
            .turn(&turn_id(id))
            .await
            .unwrap_or_else(|e| panic!("turn {id}: {e}"));
        assert!(view.is_some(), "turn {id} survives the upgrade");
        all_executions(store, &turn_id(id))
            .await
            .unwrap_or_else(|e| panic!("executions of {id}: {e}"));
    }
    let executions = all_executions(store, &turn_id(LIVE_TURN))
        .await
        .expect("read");
    let read: Vec<&str> = executions.iter().map(|e| e.state.as_str()).collect();
    assert_eq!(read, states, "{executions:?}");
    for session in ["old-live", "old-awaiting", "old-done", "old-confirmed"] {
        let view = store
            .session(&valid(SessionId::new(session)))
            .await
            .unwrap_or_else(|e| panic!("session {session}: {e}"));
        assert!(view.is_some(), "session {session} survives the upgrade");
    }
    let user = store.user(&old.user).await.expect("the user view reads");
    assert_eq!(user.max_turns_per_user, 4, "the cap override survives");
    let overview = store.overview(200).await.expect("the overview reads");
    assert!(overview.recent_turns.len() >= 5, "{overview:?}");
    store
        .orphans(&OrphanFilter::default(), 128)
        .await
        .expect("the orphan listing reads");
}

/// The live holder still holds until its lease expires.
async fn live_holder_holds(store: &dyn Store, old: &Old) {
    let session = store
        .session(&old.live_begin.session_id)
        .await
        .expect("read")
        .expect("the session exists");
    let holder = session.holder.expect("the old holder is live");
    assert_eq!(holder.turn_id.as_str(), LIVE_TURN);
    assert_eq!(holder.fence.0, LIVE_FENCE);
    let other = valid(BeginCommand::new(
        old.user.clone(),
        old.live_begin.session_id.clone(),
        valid(ClientRequestId::new("r-other")),
        &json!({ "message": "another" }),
        None,
    ));
    match store.begin(&other).await {
        Err(Error::SessionBusy { active_turn_id, .. }) => assert_eq!(active_turn_id, LIVE_TURN),
        other => panic!("another request on a held session: {other:?}"),
    }
    match store.begin(&old.live_begin).await {
        Err(Error::RequestInFlight { active_turn_id, .. }) => {
            assert_eq!(active_turn_id, LIVE_TURN);
        }
        other => panic!("the running turn's own repeat: {other:?}"),
    }
}

/// After the old lease expires: the orphan is claimed with a newer fence,
/// the old token is refused, and its tool journal is honoured.
async fn orphan_resumes(store: &dyn Store, old: &Old) {
    let filter = OrphanFilter {
        turn_ids: vec![turn_id(LIVE_TURN)],
        ..OrphanFilter::default()
    };
    let started = Instant::now();
    let claimed = loop {
        if let Some(claimed) = store.claim_orphan(&filter).await.expect("claim") {
            break claimed;
        }
        assert!(
            started.elapsed() < EXPIRY_WAIT,
            "the old lease never expired into an orphan"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let grant = &claimed.grant;
    assert_eq!(grant.turn_id.as_str(), LIVE_TURN);
    assert!(grant.takeover, "{grant:?}");
    assert_eq!(grant.attempt, 2);
    assert!(
        grant.fence.0 > OLD_FENCE_COUNTER,
        "a fence newer than every old one: {}",
        grant.fence.0
    );
    assert_eq!(claimed.payload, json!({ "message": "book lunch 35" }));
    assert_eq!(claimed.journal.len(), 3, "{:?}", claimed.journal);
    let stale = LeaseRef {
        turn_id: turn_id(LIVE_TURN),
        token: old.token.clone(),
    };
    match store.heartbeat(&stale).await {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("the old holder's heartbeat after the takeover: {other:?}"),
    }
    let lease = LeaseRef {
        turn_id: grant.turn_id.clone(),
        token: grant.lease_token.clone(),
    };
    match store.claim_tool(&lease, &old.cached).await.expect("claim") {
        ToolClaim::Cached { result, .. } => assert_eq!(result, json!({ "booked": 35 })),
        other => panic!("the succeeded execution: {other:?}"),
    }
    for (call, previous) in [
        (&old.failed, PreviousOutcome::Failed),
        (&old.interrupted, PreviousOutcome::Unknown),
    ] {
        match store.claim_tool(&lease, call).await.expect("claim") {
            ToolClaim::Execute {
                execution_id,
                attempt,
                previous_outcome,
                idempotency_key: key,
            } => {
                assert_eq!(attempt, 2);
                assert_eq!(previous_outcome, Some(previous));
                assert_eq!(
                    key,
                    idempotency_key(&grant.turn_id, call),
                    "the key is stable"
                );
                let result = valid(CanonicalJson::new("result", &json!({ "ok": true })));
                store
                    .complete_tool(&lease, &execution_id, Completion::Result(result))
                    .await
                    .expect("complete");
            }
            other => panic!("{}: {other:?}", call.tool),
        }
    }
    let response = valid(CanonicalJson::new(
        "response",
        &json!({ "reply": "resumed" }),
    ));
    let ended = store
        .end_turn(&lease, &Ending::Succeed { response })
        .await
        .expect("end the resumed turn");
    assert_eq!(ended.state, TurnState::Succeeded);
}

/// The pending confirmation blocks, then its answer starts the continuation.
async fn confirmation_answers(store: &dyn Store, old: &Old) {
    let other = valid(BeginCommand::new(
        old.user.clone(),
        old.awaiting_session.clone(),
        valid(ClientRequestId::new("r-new")),
        &json!({ "message": "something else" }),
        None,
    ));
    match store.begin(&other).await {
        Err(Error::AwaitingConfirmation {
            pending_turn_id, ..
        }) => assert_eq!(pending_turn_id, AWAITING_TURN),
        other => panic!("a new message while a confirmation is pending: {other:?}"),
    }
    let answer = valid(BeginCommand::new(
        old.user.clone(),
        old.awaiting_session.clone(),
        valid(ClientRequestId::new("r-approve")),
        &json!({ "answer": "yes" }),
        Some(Confirmation {
            turn_id: turn_id(AWAITING_TURN),
            decision: Decision::Approve,
        }),
    ));
    let grant = match store.begin(&answer).await {
        Ok(BeginOutcome::Started(grant)) => grant,
        other => panic!("answering the old pending confirmation: {other:?}"),
    };
    let confirmation = grant
        .confirmation
        .clone()
        .expect("the continuation carries it");
    assert_eq!(confirmation.turn_id.as_str(), AWAITING_TURN);
    assert_eq!(confirmation.decision, Decision::Approve);
    assert_eq!(confirmation.pending, pending_action());
    assert!(grant.fence.0 > OLD_FENCE_COUNTER);
    let confirmed = store
        .turn(&turn_id(AWAITING_TURN))
        .await
        .expect("read")
        .expect("exists");
    assert_eq!(confirmed.state, TurnState::Confirmed);
    assert_eq!(confirmed.confirmed_by.as_ref(), Some(&grant.turn_id));
}

/// The succeeded turn replays; the old continuation reads the new way.
async fn old_endings_read(store: &dyn Store, old: &Old) {
    match store.begin(&old.done_begin).await {
        Ok(BeginOutcome::Replay(view)) => {
            assert_eq!(view.turn_id.as_str(), DONE_TURN);
            assert_eq!(view.state, TurnState::Succeeded);
            assert_eq!(view.response, Some(json!({ "reply": "booked taxi 18" })));
        }
        other => panic!("a repeat of the old succeeded request: {other:?}"),
    }
    let continuation = store
        .turn(&turn_id(CONTINUATION_TURN))
        .await
        .expect("read")
        .expect("exists");
    let confirmation = continuation
        .confirmation
        .expect("the continuation keeps its confirmation");
    assert_eq!(confirmation.turn_id.as_str(), CONFIRMED_TURN);
    assert_eq!(confirmation.pending, carried_action());
    assert_eq!(
        continuation.pending, None,
        "the carried action is not the continuation's own pending action"
    );
}

async fn upgrade(dialect: Dialect, url: &str) {
    let old = old_ids();
    old_database(dialect, url, &old).await;
    let gate = Gate::connect(url, None, Config::default())
        .await
        .unwrap_or_else(|e| panic!("{dialect:?}: the current code opens the old database: {e}"));
    let store = gate.store().as_ref();
    views_read_everything(store, &old, ["succeeded", "failed", "running"]).await;
    live_holder_holds(store, &old).await;
    confirmation_answers(store, &old).await;
    old_endings_read(store, &old).await;
    orphan_resumes(store, &old).await;
    views_read_everything(store, &old, ["succeeded"; 3]).await;
}

#[tokio::test]
async fn sqlite_upgrade_keeps_old_rows_usable() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let url = format!("sqlite://{}", dir.path().join("agentgate.db").display());
    upgrade(Dialect::Sqlite, &url).await;
}

#[tokio::test]
async fn postgres_upgrade_keeps_old_rows_usable() {
    let Some(database) = agentgate_store_postgres::testing::TestDatabase::create().await else {
        return;
    };
    upgrade(Dialect::Postgres, database.url()).await;
}

#[tokio::test]
async fn mysql_upgrade_keeps_old_rows_usable() {
    let Some(database) = agentgate_store_mysql::testing::TestDatabase::create().await else {
        return;
    };
    upgrade(Dialect::MySql, database.url()).await;
}
