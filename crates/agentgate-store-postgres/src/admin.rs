//! Creating and dropping whole databases on a server, for tools that need a
//! fresh, empty store: `agentgate conformance` (scratch databases on a
//! user's server) and the test suites (behind the `testing` feature).
//!
//! Each call opens one connection to `url` (a URL whose database is only used
//! to connect), under [`CONNECT_TIMEOUT`], and closes it. Errors are one line
//! for a person, with the password redacted and, where the server refused
//! for lack of a privilege, the privilege to grant.

use std::str::FromStr;

use agentgate_core::dburl::redact_password as redact;
use agentgate_store_sql::admin::reach;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

pub use agentgate_store_sql::admin::CONNECT_TIMEOUT;

/// SQLSTATE `insufficient_privilege`.
const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// SQLSTATE `syntax_error`: `DROP DATABASE … WITH (FORCE)` on a server
/// before PostgreSQL 13.
const SYNTAX_ERROR: &str = "42601";

/// Connects to `url`, or says why not (unreachable, refused, no answer
/// within [`CONNECT_TIMEOUT`]).
pub async fn connect(url: &str) -> Result<PgConnection, String> {
    let options = PgConnectOptions::from_str(url)
        .map_err(|e| format!("bad PostgreSQL URL {}: {e}", redact(url)))?
        .disable_statement_logging();
    reach(url, PgConnection::connect_with(&options)).await
}

fn sql_state(error: &sqlx::Error) -> Option<String> {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
}

/// Creates the empty database `name` (a plain identifier the caller made).
pub async fn create_database(url: &str, name: &str) -> Result<(), String> {
    let mut admin = connect(url).await?;
    let created = sqlx::raw_sql(&format!("CREATE DATABASE \"{name}\""))
        .execute(&mut admin)
        .await;
    let _ = admin.close().await;
    created.map(drop).map_err(|error| {
        if sql_state(&error).as_deref() == Some(INSUFFICIENT_PRIVILEGE) {
            format!(
                "the user of {} may not create databases ({error}); grant it with \
                 ALTER ROLE <user> CREATEDB",
                redact(url)
            )
        } else {
            format!("CREATE DATABASE {name} failed: {error}")
        }
    })
}

/// Drops the database `name` if it exists, ending the connections still on
/// it (a pooled connection being returned would otherwise hold the drop).
pub async fn drop_database(url: &str, name: &str) -> Result<(), String> {
    let mut admin = connect(url).await?;
    let forced = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
        .execute(&mut admin)
        .await;
    let dropped = match forced {
        Ok(_) => Ok(()),
        Err(error) if sql_state(&error).as_deref() == Some(SYNTAX_ERROR) => {
            let _ = sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = $1 AND pid <> pg_backend_pid()",
            )
            .bind(name)
            .execute(&mut admin)
            .await;
            sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS \"{name}\""))
                .execute(&mut admin)
                .await
                .map(drop)
                .map_err(|e| format!("DROP DATABASE {name} failed: {e}"))
        }
        Err(error) => Err(format!("DROP DATABASE {name} failed: {error}")),
    };
    let _ = admin.close().await;
    dropped
}
