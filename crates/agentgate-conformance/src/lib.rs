//! agentgate-conformance: the one behaviour suite every store passes.
//!
//! Each check in [`checks`] attacks one invariant of docs/protocol.md §4 with real
//! concurrency (many tasks released by a barrier, a real child process killed
//! with SIGKILL) against a [`Target`]: a fresh, empty store of one backend.
//! A store's test file is one line, `agentgate_conformance::suite!(factory)`,
//! which generates one `#[tokio::test]` per check; every store runs the same
//! checks, unchanged. The shipping binary links the suite on purpose:
//! `agentgate conformance --store URL` runs the same checks against a user's
//! own database server.
//!
//! - [`registry`]: THE list of checks ([`for_each_check!`]), which both the
//!   test macros and the runtime registry [`registry::CHECKS`] expand from.
//! - [`run`]: runs one check of the registry, turning a panic, a skip or a
//!   time-out into an outcome, with the check's counts captured.
//! - [`scratch`]: scratch databases (`agentgate_conformance_<hex>_<n>`),
//!   SQLite temp dirs and Redis key prefixes on a user's servers, one fresh
//!   store per check, all removed at the end.
//! - [`targets`]: fresh stores per backend, and the skip-or-require rule for
//!   servers that are absent (`AGENTGATE_REQUIRE_SERVICES=1` makes absence a
//!   failure).
//! - [`ledger`]: a ledger table written inside a tool's SQL transaction, per
//!   SQL dialect, and its row count.
//! - [`faulty`]: a store wrapper whose writes can be made to fail, to drive
//!   the watchdog.
//! - [`holder`]: the child process that holds a lease until it is killed
//!   (`src/bin/agentgate-holder.rs` for the tests, `agentgate hold` for the
//!   shipping binary), and [`holder::Holder`], how to start it.
//!
//! Every check prints one `conformance <check>: ...` line of counts, so a run
//! shows what was proven, not only that nothing failed.
#![forbid(unsafe_code)]

pub mod checks;
pub mod faulty;
pub mod holder;
pub mod ledger;
pub mod registry;
pub mod run;
pub mod scratch;
pub mod targets;

pub use targets::Target;

/// Generates one test per conformance check that runs on every store, for
/// the store made by `$factory` (an `async fn() -> Option<Target>`; `None`
/// skips with a printed reason). The checks come from
/// [`for_each_check!`](crate::for_each_check), the list `agentgate
/// conformance` runs too.
#[macro_export]
macro_rules! suite {
    ($factory:path) => {
        $crate::for_each_check!(__suite_tests any $factory);
    };
}

/// Generates the Redis-loss checks for a target with the Redis lease layer.
#[macro_export]
macro_rules! redis_suite {
    ($factory:path) => {
        $crate::for_each_check!(__suite_tests redis $factory);
    };
}

/// Generates the checks that need a store with its own clock (a database
/// server or Redis): a node with a skewed wall clock changes no outcome.
#[macro_export]
macro_rules! server_clock_suite {
    ($factory:path) => {
        $crate::for_each_check!(__suite_tests server_clock $factory);
    };
}
