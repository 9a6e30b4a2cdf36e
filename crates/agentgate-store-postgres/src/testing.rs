//! Throw-away databases for test suites (this crate's smoke tests and the
//! shared conformance suite), so tests run in parallel and repeatedly
//! without seeing each other's rows.
//!
//! The server is found through `AGENTGATE_TEST_POSTGRES_URL` (default
//! [`DEFAULT_ADMIN_URL`]), a URL whose database may be used to create others.
//! When the server cannot be reached the helpers print why and return `None`
//! so the caller can skip — unless `AGENTGATE_REQUIRE_SERVICES=1`, in which
//! case they panic: CI must not pass by skipping.
//!
//! Not for production use: it creates and drops databases.

use agentgate_core::dburl::{redact_password as redact, with_database};

use sqlx::Connection;

/// Where a test server is looked for when the environment does not say.
pub const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The environment variable naming the admin URL.
pub const ADMIN_URL_ENV: &str = "AGENTGATE_TEST_POSTGRES_URL";

/// The environment variable that turns a missing server into a failure.
pub const REQUIRE_SERVICES_ENV: &str = "AGENTGATE_REQUIRE_SERVICES";

/// Prefix of every database these helpers create, so leftovers of crashed
/// runs are recognisable (`DROP DATABASE` them freely).
pub const DATABASE_PREFIX: &str = "agentgate_t_";

fn services_required() -> bool {
    std::env::var(REQUIRE_SERVICES_ENV).is_ok_and(|v| v == "1")
}

fn admin_url() -> String {
    std::env::var(ADMIN_URL_ENV).unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned())
}

/// Reports an absent server: a skip, or a panic when services are required.
fn absent(reason: &str) -> Option<String> {
    assert!(
        !services_required(),
        "PostgreSQL is required ({REQUIRE_SERVICES_ENV}=1) but {reason}"
    );
    eprintln!("skipping: PostgreSQL not available ({reason}); set {ADMIN_URL_ENV} to point at one");
    None
}

async fn connect_admin() -> Result<(), String> {
    let connection = crate::admin::connect(&admin_url()).await?;
    let _ = connection.close().await;
    Ok(())
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
pub async fn fresh_database_url() -> Option<String> {
    if let Err(reason) = connect_admin().await {
        return absent(&reason);
    }
    let name = fresh_name();
    crate::admin::create_database(&admin_url(), &name)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL is up but {e}"));
    Some(with_database(&admin_url(), &name))
}

/// Drops a database made by [`fresh_database_url`], ending its open
/// connections. Best effort: a failure is printed, not raised, since it
/// only leaves a prefixed database behind.
pub async fn drop_database(url: &str) {
    let Some(name) = url
        .split('?')
        .next()
        .and_then(|base| base.rsplit('/').next())
        .filter(|name| name.starts_with(DATABASE_PREFIX))
    else {
        eprintln!("not dropping {}: not a test database", redact(url));
        return;
    };
    if let Err(error) = crate::admin::drop_database(&admin_url(), name).await {
        eprintln!("could not drop test database {name}: {error}");
    }
}

/// A fresh database that is dropped (best effort) when this value is
/// dropped, even when the test panicked. Keep it alive as long as the store.
#[derive(Debug)]
pub struct TestDatabase {
    url: String,
}

impl TestDatabase {
    /// Creates an empty database; `None` (after printing why) when the
    /// server is absent.
    ///
    /// # Panics
    /// As [`fresh_database_url`].
    pub async fn create() -> Option<Self> {
        fresh_database_url().await.map(|url| Self { url })
    }

    /// The database's URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for TestDatabase {
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
                    Ok(runtime) => runtime.block_on(drop_database(&url)),
                    Err(error) => eprintln!("could not drop a test database: {error}"),
                }
            });
        let _ = dropper.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_is_replaced_and_query_kept() {
        assert_eq!(
            with_database("postgres://u@h:5432/postgres", "x"),
            "postgres://u@h:5432/x"
        );
        assert_eq!(
            with_database("postgres://u@h/postgres?sslmode=disable", "x"),
            "postgres://u@h/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u@h/db");
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }

    #[test]
    fn names_are_prefixed_and_distinct() {
        let (a, b) = (fresh_name(), fresh_name());
        assert!(a.starts_with(DATABASE_PREFIX));
        assert_ne!(a, b);
    }
}
