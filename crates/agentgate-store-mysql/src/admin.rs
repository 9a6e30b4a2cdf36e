//! Creating and dropping whole databases on a server, for tools that need a
//! fresh, empty store: `agentgate conformance` (scratch databases on a
//! user's server) and the test suites (behind the `testing` feature).
//!
//! Each call opens one connection to `url` (a URL whose database is only used
//! to connect), under [`CONNECT_TIMEOUT`], and closes it. Errors are one line
//! for a person, with the password redacted and, where the server refused
//! for lack of a privilege, the privilege to grant.

use agentgate_core::dburl::redact_password as redact;
use agentgate_store_sql::admin::reach;
use sqlx::mysql::MySqlDatabaseError;
use sqlx::{ConnectOptions, Connection, MySqlConnection};

pub use agentgate_store_sql::admin::CONNECT_TIMEOUT;

/// How long a drop waits for a metadata lock still held on the database,
/// instead of the server's default of a year.
const DROP_LOCK_WAIT_SECONDS: u32 = 10;

/// Server errors that mean "this user may not": 1044 (database access
/// denied), 1045 (access denied), 1142 (command denied), 1227 (a privilege
/// is needed).
const DENIED: &[u16] = &[1044, 1045, 1142, 1227];

/// Connects to `url` (TLS options as the store reads them), or says why not
/// (unreachable, refused, no answer within [`CONNECT_TIMEOUT`]).
pub async fn connect(url: &str) -> Result<MySqlConnection, String> {
    let options = crate::connect_options(url)
        .map_err(|e| format!("bad MySQL URL {}: {e}", redact(url)))?
        .disable_statement_logging();
    reach(url, MySqlConnection::connect_with(&options)).await
}

/// Creates the empty database `name` (a plain identifier the caller made),
/// in utf8mb4 with binary collation, as the store's migrations expect.
pub async fn create_database(url: &str, name: &str) -> Result<(), String> {
    let mut admin = connect(url).await?;
    let created = sqlx::raw_sql(&format!(
        "CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
    ))
    .execute(&mut admin)
    .await;
    let _ = admin.close().await;
    created.map(drop).map_err(|error| {
        let denied = error
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
            .is_some_and(|e| DENIED.contains(&e.number()));
        if denied {
            format!(
                "the user of {} may not create databases ({error}); grant it with \
                 GRANT ALL ON `<prefix>%`.* TO <user>",
                redact(url)
            )
        } else {
            format!("CREATE DATABASE {name} failed: {error}")
        }
    })
}

/// Drops the database `name` if it exists. Like PostgreSQL's `WITH
/// (FORCE)`, it first ends the connections still on it (a pooled connection
/// being returned may still sit in its last transaction), whose metadata
/// locks would hold the drop.
pub async fn drop_database(url: &str, name: &str) -> Result<(), String> {
    let mut admin = connect(url).await?;
    let holders: Result<Vec<i64>, _> = sqlx::query_scalar(
        "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST \
         WHERE DB = ? AND ID <> CONNECTION_ID()",
    )
    .bind(name)
    .fetch_all(&mut admin)
    .await;
    match holders {
        Ok(holders) => {
            for id in holders {
                let _ = sqlx::raw_sql(&format!("KILL CONNECTION {id}"))
                    .execute(&mut admin)
                    .await;
            }
        }
        // Without the list the drop is still tried; it may wait on a lock.
        Err(error) => tracing::warn!(%error, database = name, "could not list its connections"),
    }
    let statement = format!(
        "SET SESSION lock_wait_timeout = {DROP_LOCK_WAIT_SECONDS}; DROP DATABASE IF EXISTS `{name}`"
    );
    let dropped = sqlx::raw_sql(&statement)
        .execute(&mut admin)
        .await
        .map(drop)
        .map_err(|e| format!("DROP DATABASE {name} failed: {e}"));
    let _ = admin.close().await;
    dropped
}
