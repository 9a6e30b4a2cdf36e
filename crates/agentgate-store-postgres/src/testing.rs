//! Throw-away PostgreSQL databases for test suites (this crate's tests, the
//! shared conformance suite, the reference app's): the shared helpers of
//! `agentgate_store_sql::testing` on this server. Found through
//! `AGENTGATE_TEST_POSTGRES_URL` (default [`DEFAULT_ADMIN_URL`]); absent, the helpers skip with
//! a printed reason unless `AGENTGATE_REQUIRE_SERVICES=1`.
//!
//! Not for production use: it creates and drops databases.

agentgate_store_sql::test_server!(
    Postgres,
    name = "PostgreSQL",
    env = "AGENTGATE_TEST_POSTGRES_URL",
    default = "postgres://postgres@127.0.0.1:5432/postgres"
);
