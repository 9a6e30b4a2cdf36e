//! Throw-away PostgreSQL databases for test suites (this crate's tests, the
//! shared conformance suite, the reference app's): the shared helpers of
//! `agentgate_store_sql::testing` on this server. Found through
//! `AGENTGATE_TEST_POSTGRES_URL` (default [`DEFAULT_ADMIN_URL`]); absent, the helpers skip with
//! a printed reason unless `AGENTGATE_REQUIRE_SERVICES=1`.
//!
//! Not for production use: it creates and drops databases.

use sqlx::Connection;

pub use agentgate_store_sql::testing::{DATABASE_PREFIX, REQUIRE_SERVICES_ENV};

/// Where a test server is looked for when the environment does not say.
pub const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The environment variable naming the admin URL.
pub const ADMIN_URL_ENV: &str = "AGENTGATE_TEST_POSTGRES_URL";

/// This server, for the shared helpers.
#[derive(Debug)]
pub struct Postgres;

#[async_trait::async_trait(?Send)]
impl agentgate_store_sql::testing::TestServer for Postgres {
    const NAME: &'static str = "PostgreSQL";
    const ADMIN_URL_ENV: &'static str = ADMIN_URL_ENV;
    const DEFAULT_ADMIN_URL: &'static str = DEFAULT_ADMIN_URL;

    async fn probe(url: &str) -> Result<(), String> {
        let connection = crate::admin::connect(url).await?;
        let _ = connection.close().await;
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
pub type TestDatabase = agentgate_store_sql::testing::TestDatabase<Postgres>;

/// Creates an empty database and returns its URL; `None` (after printing
/// why) when the server is absent.
///
/// # Panics
/// When the server is absent and `AGENTGATE_REQUIRE_SERVICES=1`, or when the
/// server is there but refuses to create a database.
pub async fn fresh_database_url() -> Option<String> {
    agentgate_store_sql::testing::fresh_database_url::<Postgres>().await
}

/// Drops a database made by [`fresh_database_url`] (best effort).
pub async fn drop_database(url: &str) {
    agentgate_store_sql::testing::drop_database::<Postgres>(url).await;
}
