//! Throw-away MySQL/MariaDB databases for test suites (this crate's tests, the
//! shared conformance suite, the reference app's): the shared helpers of
//! `agentgate_store_sql::testing` on this server. Found through
//! `AGENTGATE_TEST_MYSQL_URL` (default [`DEFAULT_ADMIN_URL`]); absent, the helpers skip with
//! a printed reason unless `AGENTGATE_REQUIRE_SERVICES=1`.
//!
//! Not for production use: it creates and drops databases.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use crate::fast::Taken;

agentgate_store_sql::test_server!(
    MySql,
    name = "MySQL/MariaDB",
    env = "AGENTGATE_TEST_MYSQL_URL",
    default = "mysql://root@127.0.0.1:3306/test"
);

/// How often the one-`CALL` fast paths of a begin and of a turn's ending
/// (migration 0006) did the step, or wrote nothing and left it to the full
/// path, on the stores of one database in this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPaths {
    /// Begins started by `ag_begin_fast`.
    pub begins_started: u64,
    /// Begins `ag_begin_fast` declined (the full begin decided them).
    pub begins_declined: u64,
    /// Endings done by `ag_end_turn_fast`.
    pub endings_done: u64,
    /// Endings `ag_end_turn_fast` declined (the full ending decided them).
    pub endings_declined: u64,
}

/// The counts per database name.
static COUNTS: Mutex<BTreeMap<String, FastPaths>> = Mutex::new(BTreeMap::new());

pub(crate) fn count(database: &str, taken: Taken) {
    let mut counts = COUNTS.lock().unwrap_or_else(PoisonError::into_inner);
    let paths = counts.entry(database.to_owned()).or_default();
    let counter = match taken {
        Taken::BeginStarted => &mut paths.begins_started,
        Taken::BeginDeclined => &mut paths.begins_declined,
        Taken::EndEnded => &mut paths.endings_done,
        Taken::EndDeclined => &mut paths.endings_declined,
    };
    *counter += 1;
}

/// The counts so far of the stores opened at `url` (by its database name).
///
/// # Panics
/// When `url` is not a MySQL URL this crate opens.
pub fn fast_paths(url: &str) -> FastPaths {
    let database = database_name(url);
    let counts = COUNTS.lock().unwrap_or_else(PoisonError::into_inner);
    counts.get(&database).copied().unwrap_or_default()
}

/// The database a store at `url` uses, as the counts are keyed.
fn database_name(url: &str) -> String {
    crate::connect::connect_options(url)
        .unwrap_or_else(|e| panic!("{url}: {e}"))
        .get_database()
        .unwrap_or_default()
        .to_owned()
}
