//! Throw-away databases for test suites (a store's own tests, the shared
//! conformance suite, the reference app's), so tests run in parallel and
//! repeatedly without seeing each other's rows. Behind the `testing`
//! feature: never in a shipping build.
//!
//! A store names its server through [`TestServer`]; the server is found
//! through the store's environment variable (else its default admin URL), a
//! URL whose database may be used to create others. When the server cannot
//! be reached the helpers print why and return `None` so the caller can
//! skip — unless `AGENTGATE_REQUIRE_SERVICES=1`, in which case they panic:
//! CI must not pass by skipping.

use std::marker::PhantomData;

use agentgate_core::dburl::{redact_password as redact, with_database};

/// The environment variable that turns a missing server into a failure.
pub const REQUIRE_SERVICES_ENV: &str = "AGENTGATE_REQUIRE_SERVICES";

/// Prefix of every database these helpers create, so leftovers of crashed
/// runs are recognisable (`DROP DATABASE` them freely).
pub const DATABASE_PREFIX: &str = "agentgate_t_";

/// A database server tests can make databases on. Its futures need not be
/// `Send` (sqlx's admin statements on a borrowed connection are not, for
/// every lifetime): tests await them in place.
#[async_trait::async_trait(?Send)]
pub trait TestServer: Send + Sync + 'static {
    /// The server's name in messages.
    const NAME: &'static str;
    /// The environment variable naming the admin URL.
    const ADMIN_URL_ENV: &'static str;
    /// Where the server is looked for when the environment does not say.
    const DEFAULT_ADMIN_URL: &'static str;

    /// Connects once to `url` and disconnects, or says why it could not.
    async fn probe(url: &str) -> Result<(), String>;
    /// Creates the empty database `name`.
    async fn create(url: &str, name: &str) -> Result<(), String>;
    /// Drops the database `name`, ending its connections.
    async fn drop(url: &str, name: &str) -> Result<(), String>;
}

fn services_required() -> bool {
    std::env::var(REQUIRE_SERVICES_ENV).is_ok_and(|v| v == "1")
}

fn admin_url<S: TestServer>() -> String {
    std::env::var(S::ADMIN_URL_ENV).unwrap_or_else(|_| S::DEFAULT_ADMIN_URL.to_owned())
}

/// A fresh, random database name with [`DATABASE_PREFIX`].
fn fresh_name() -> String {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).expect("the operating system's random source is available");
    format!("{DATABASE_PREFIX}{}", hex::encode(bytes))
}

/// Creates an empty database and returns its URL; `None` (after printing
/// why) when the server is absent.
///
/// # Panics
/// When the server is absent and `AGENTGATE_REQUIRE_SERVICES=1`, or when the
/// server is there but refuses to create a database.
pub async fn fresh_database_url<S: TestServer>() -> Option<String> {
    let admin = admin_url::<S>();
    if let Err(reason) = S::probe(&admin).await {
        assert!(
            !services_required(),
            "{} is required ({REQUIRE_SERVICES_ENV}=1) but {reason}",
            S::NAME
        );
        eprintln!(
            "skipping: {} not available ({reason}); set {} to point at one",
            S::NAME,
            S::ADMIN_URL_ENV
        );
        return None;
    }
    let name = fresh_name();
    S::create(&admin, &name)
        .await
        .unwrap_or_else(|e| panic!("{} is up but {e}", S::NAME));
    Some(with_database(&admin, &name))
}

/// Drops a database made by [`fresh_database_url`]. Best effort: a failure
/// is printed, not raised, since it only leaves a prefixed database behind.
pub async fn drop_database<S: TestServer>(url: &str) {
    let Some(name) = url
        .split('?')
        .next()
        .and_then(|base| base.rsplit('/').next())
        .filter(|name| name.starts_with(DATABASE_PREFIX))
    else {
        eprintln!("not dropping {}: not a test database", redact(url));
        return;
    };
    if let Err(error) = S::drop(&admin_url::<S>(), name).await {
        eprintln!("could not drop test database {name}: {error}");
    }
}

/// A fresh database that is dropped (best effort) when this value is
/// dropped, even when the test panicked. Keep it alive as long as the store.
#[derive(Debug)]
pub struct TestDatabase<S: TestServer> {
    url: String,
    server: PhantomData<S>,
}

impl<S: TestServer> TestDatabase<S> {
    /// Creates an empty database; `None` (after printing why) when the
    /// server is absent.
    ///
    /// # Panics
    /// As [`fresh_database_url`].
    pub async fn create() -> Option<Self> {
        fresh_database_url::<S>().await.map(|url| Self {
            url,
            server: PhantomData,
        })
    }

    /// The database's URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl<S: TestServer> Drop for TestDatabase<S> {
    fn drop(&mut self) {
        let url = std::mem::take(&mut self.url);
        // Drop may run inside a runtime, which cannot block on itself: drop
        // the database from a thread with a small runtime of its own.
        let dropper =
            std::thread::spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(drop_database::<S>(&url)),
                    Err(error) => eprintln!("could not drop a test database: {error}"),
                }
            });
        let _ = dropper.join();
    }
}

/// Writes a store crate's `testing` module body for its server: the
/// server's [`TestServer`] (named `$server`, probing, creating and dropping
/// through the crate's `admin::{connect, create_database, drop_database}`),
/// its `ADMIN_URL_ENV` and `DEFAULT_ADMIN_URL`, a `TestDatabase`, and
/// `fresh_database_url` / `drop_database` on it.
// `crate::admin` here means the store crate that invokes the macro.
#[allow(clippy::crate_in_macro_def)]
#[macro_export]
macro_rules! test_server {
    ($server:ident, name = $name:literal, env = $env:literal, default = $default:literal) => {
        pub use $crate::testing::{DATABASE_PREFIX, REQUIRE_SERVICES_ENV};

        /// Where a test server is looked for when the environment does not say.
        pub const DEFAULT_ADMIN_URL: &str = $default;

        /// The environment variable naming the admin URL.
        pub const ADMIN_URL_ENV: &str = $env;

        /// This server, for the shared helpers.
        #[derive(Debug)]
        pub struct $server;

        #[$crate::async_trait(?Send)]
        impl $crate::testing::TestServer for $server {
            const NAME: &'static str = $name;
            const ADMIN_URL_ENV: &'static str = ADMIN_URL_ENV;
            const DEFAULT_ADMIN_URL: &'static str = DEFAULT_ADMIN_URL;

            async fn probe(url: &str) -> Result<(), String> {
                let connection = crate::admin::connect(url).await?;
                let _ = ::sqlx::Connection::close(connection).await;
                Ok(())
            }

            async fn create(url: &str, name: &str) -> Result<(), String> {
                crate::admin::create_database(url, name).await
            }

            async fn drop(url: &str, name: &str) -> Result<(), String> {
                crate::admin::drop_database(url, name).await
            }
        }

        /// A fresh database, dropped (best effort) with this value.
        pub type TestDatabase = $crate::testing::TestDatabase<$server>;

        /// Creates an empty database and returns its URL; `None` (after
        /// printing why) when the server is absent.
        ///
        /// # Panics
        /// When the server is absent and `AGENTGATE_REQUIRE_SERVICES=1`, or
        /// when the server is there but refuses to create a database.
        pub async fn fresh_database_url() -> Option<String> {
            $crate::testing::fresh_database_url::<$server>().await
        }

        /// Drops a database made by [`fresh_database_url`] (best effort).
        pub async fn drop_database(url: &str) {
            $crate::testing::drop_database::<$server>(url).await;
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_prefixed_and_distinct() {
        let (a, b) = (fresh_name(), fresh_name());
        assert!(a.starts_with(DATABASE_PREFIX));
        assert_ne!(a, b);
    }
}

/// A lease layer that is never asked: a store opened with it writes its
/// rows as a layered store does (no row expiry), and every call to it is a
/// `corrupt` error naming the call. A start applied with its lease already
/// held ([`crate::begin::Lease::Held`]) must not ask the layer: no store
/// holds its locks across the layer's round trip.
#[derive(Debug)]
pub struct UnaskedLayer;

fn asked(what: &str) -> agentgate_core::error::Error {
    agentgate_core::error::Error::corrupt(format!("the layer was asked to {what}"))
}

#[async_trait::async_trait]
impl agentgate_core::lease::LeaseLayer for UnaskedLayer {
    async fn acquire(
        &self,
        _: &agentgate_core::lease::LeaseClaim<'_>,
    ) -> agentgate_core::error::Result<agentgate_core::lease::Acquired> {
        Err(asked("acquire"))
    }

    async fn renew(&self, _: &str, _: &str, _: i64) -> agentgate_core::error::Result<Option<i64>> {
        Err(asked("renew"))
    }

    async fn holds(
        &self,
        _: &str,
        _: &str,
    ) -> agentgate_core::error::Result<Option<agentgate_core::lease::LiveLease>> {
        Err(asked("check a lease"))
    }

    async fn release(&self, _: &str, _: &str) -> agentgate_core::error::Result<()> {
        Err(asked("release"))
    }

    async fn revoke(&self, _: &str) -> agentgate_core::error::Result<()> {
        Err(asked("revoke"))
    }

    async fn holder(
        &self,
        _: &str,
    ) -> agentgate_core::error::Result<Option<agentgate_core::model::HolderView>> {
        Err(asked("name a holder"))
    }

    async fn user_holders(
        &self,
        _: &str,
    ) -> agentgate_core::error::Result<Vec<agentgate_core::model::HolderView>> {
        Err(asked("list holders"))
    }
}

/// What every store's one-statement layered grant
/// ([`crate::begin::layered::LayeredBeginSql::grant_layered_new`]) must fall
/// back on, writing nothing: another user's session, a held session, the
/// request's own turn, a pending confirmation, a session whose fence is not
/// below the held one, a user at its cap (on a new session row, so the
/// statement's first-use rows must go again) and a cap out of range. On a
/// store whose cap for users without their own is 2. `rows` reads every row
/// of the tables a begin writes, as text; it must read the same before and
/// after each refusal.
///
/// # Panics
/// When a case grants or changes a row, or the store fails.
pub async fn layered_grant_falls_back<S, R>(sql: &S, rows: impl Fn() -> R)
where
    S: crate::begin::layered::LayeredBeginSql,
    R: std::future::Future<Output = String>,
{
    use crate::query::{On, Statement};
    use agentgate_core::ids::{ClientRequestId, LeaseToken, SessionId, TurnId, UserId};
    use agentgate_core::model::BeginCommand;

    let command = |user: &str, session: &str, request: &str| {
        let make = || {
            BeginCommand::new(
                UserId::new(user)?,
                SessionId::new(session)?,
                ClientRequestId::new(request)?,
                &serde_json::json!({ "message": request }),
                None,
            )
        };
        make().unwrap_or_else(|e| panic!("valid command: {e}"))
    };
    let mut conn = sql
        .reader()
        .await
        .unwrap_or_else(|e| panic!("connection: {e}"));
    let mut held = async || crate::begin::Held {
        turn_id: TurnId::generate(),
        token: LeaseToken::generate(),
        fence: sql
            .reserve_fence(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("fence: {e}")),
        lease_expires_in_ms: 30_000,
    };
    let first = held().await;
    let newest = held().await;
    assert!(
        sql.grant_layered_new(&mut conn, &command("u0", "s0", "r0"), &first)
            .await
            .unwrap_or_else(|e| panic!("layered grant: {e}")),
        "a new user's new session fell back"
    );
    for statement in [
        "INSERT INTO ag_users (user_id, max_turns) VALUES ('capped', 0)",
        "INSERT INTO ag_users (user_id, max_turns) VALUES ('huge', 4294967296)",
        "INSERT INTO ag_sessions (session_id, user_id, fence, pending_turn_id, \
           pending_expires_at_ms, updated_at_ms) VALUES ('asks', 'u0', 1, 'turn_x', 1, 1)",
        "INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms) \
           VALUES ('ahead', 'u0', 1000000, 1)",
    ] {
        sql.execute(On::Write, Statement::new(statement))
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    for (why, user, session, request) in [
        ("another user's session", "u1", "s0", "r9"),
        ("a held session", "u0", "s0", "r1"),
        ("the request's own turn", "u0", "s0", "r0"),
        ("a pending confirmation", "u0", "asks", "r0"),
        (
            "a session fence not below the held one",
            "u0",
            "ahead",
            "r0",
        ),
        (
            "the user at its cap, a new session row",
            "capped",
            "c0",
            "r0",
        ),
        ("a cap out of range, a new session row", "huge", "h0", "r0"),
    ] {
        let before = rows().await;
        let wrote = sql
            .grant_layered_new(&mut conn, &command(user, session, request), &newest)
            .await
            .unwrap_or_else(|e| panic!("{why}: {e}"));
        assert!(!wrote, "{why}: granted");
        assert_eq!(rows().await, before, "{why}: rows changed");
    }
}

/// The layered begin's locked path as it runs when the one-statement grant
/// falls back: in the store's begin transaction, decide (which must start)
/// and apply the start with `held`, then commit. For tests comparing the
/// rows it writes with the one statement's.
///
/// # Panics
/// When the decision is not a start, or the store fails.
pub async fn write_held_start<S: crate::begin::BeginSql>(
    sql: &S,
    command: &agentgate_core::model::BeginCommand,
    held: crate::begin::Held,
) {
    use crate::begin::{apply, decide_in, Lease};
    use agentgate_core::decide::BeginDecision;

    let mut tx = sql
        .transaction()
        .await
        .unwrap_or_else(|e| panic!("open: {e}"));
    let decided = decide_in(sql, S::conn(&mut tx), command)
        .await
        .unwrap_or_else(|e| panic!("decide: {e}"));
    assert!(
        matches!(decided.decision, BeginDecision::Start { .. }),
        "the locked path starts: {:?}",
        decided.decision
    );
    apply(sql, S::conn(&mut tx), command, decided, Lease::Held(held))
        .await
        .unwrap_or_else(|e| panic!("apply: {e}"));
    sql.commit(tx)
        .await
        .unwrap_or_else(|e| panic!("commit: {e}"));
}

/// The cancel request's one `UPDATE` (`views::request_cancel`) against
/// `decide::cancel_step`, over every turn state, asked before or not: a row
/// in each is written directly, the request is made, and what changed (its
/// state, whether the request's time was recorded and kept, its queue
/// place, its end time) is what the decision says, and nothing else.
pub async fn cancel_agrees_with_decide<S: crate::views::ViewSql>(sql: &S) {
    use crate::query::{On, Statement};
    use crate::rows::Columns;
    use agentgate_core::decide::{cancel_step, CancelStep};
    use agentgate_core::ids::TurnId;
    use agentgate_core::model::TurnState;

    let mut checked = 0;
    for (n, &state) in TurnState::ALL.iter().enumerate() {
        for asked_before in [false, true] {
            let turn_id = TurnId::generate();
            let queue_seq = (state == TurnState::Queued).then_some(1);
            let asked_at = asked_before.then_some(5);
            sql.execute(
                On::Write,
                Statement::new(
                    "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, \
                     fingerprint, state, attempt, fence, created_at_ms, updated_at_ms, \
                     queue_seq, cancel_requested_at_ms) \
                     VALUES ($1, $2, 'cancel-user', $3, 'f', $4, 1, 1, 1, 1, $5, $6)",
                )
                .text(turn_id.as_str())
                .text(&format!("cancel-s{n}-{asked_before}"))
                .text(&format!("r{n}"))
                .text(state.as_str())
                .opt_int(queue_seq)
                .opt_int(asked_at),
            )
            .await
            .unwrap_or_else(|e| panic!("insert a {state:?} turn: {e}"));
            let view = crate::views::request_cancel(sql, &turn_id)
                .await
                .unwrap_or_else(|e| panic!("cancel a {state:?} turn: {e}"))
                .unwrap_or_else(|| panic!("the {state:?} turn is there"));
            let row = sql
                .fetch_optional(
                    On::Read,
                    Statement::new(
                        "SELECT queue_seq, cancel_requested_at_ms, ended_at_ms, updated_at_ms \
                         FROM ag_turns WHERE turn_id = $1",
                    )
                    .text(turn_id.as_str()),
                )
                .await
                .unwrap_or_else(|e| panic!("read the {state:?} turn: {e}"))
                .unwrap_or_else(|| panic!("the {state:?} turn is there"));
            let row = S::columns(&row);
            let int = |name: &str| {
                row.int(name)
                    .unwrap_or_else(|e| panic!("{name} of the {state:?} turn: {e}"))
            };
            let (queue_seq_now, asked_now, ended, updated) = (
                int("queue_seq"),
                int("cancel_requested_at_ms"),
                int("ended_at_ms"),
                int("updated_at_ms"),
            );
            let case = format!("{state:?}, asked before: {asked_before}");
            match cancel_step(state, asked_before) {
                CancelStep::EndQueued => {
                    assert_eq!(view.state, TurnState::Cancelled, "{case}");
                    assert_eq!(queue_seq_now, None, "{case}: left its queue");
                    assert!(asked_now.is_some() && ended.is_some(), "{case}: {view:?}");
                    assert!(updated > Some(1), "{case}");
                }
                CancelStep::Record => {
                    assert_eq!(view.state, state, "{case}");
                    assert!(asked_now.is_some_and(|at| at > 5), "{case}: recorded now");
                    assert_eq!(ended, None, "{case}");
                    assert!(updated > Some(1), "{case}");
                }
                CancelStep::Nothing => {
                    assert_eq!(view.state, state, "{case}");
                    assert_eq!(asked_now, asked_at, "{case}: unchanged");
                    assert_eq!(queue_seq_now, queue_seq, "{case}: unchanged");
                    assert_eq!((ended, updated), (None, Some(1)), "{case}: nothing written");
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, TurnState::ALL.len() * 2);
}
