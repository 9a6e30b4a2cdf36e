//! agentgate-conformance: the one behaviour suite every store passes.
//!
//! Each check in [`checks`] attacks one invariant of SPEC §3 with real
//! concurrency (many tasks released by a barrier, a real child process killed
//! with SIGKILL) against a [`Target`]: a fresh, empty store of one backend.
//! A store's test file is one line, `agentgate_conformance::suite!(factory)`,
//! which generates one `#[tokio::test]` per check; every store runs the same
//! checks, unchanged.
//!
//! - [`targets`]: fresh stores per backend, and the skip-or-require rule for
//!   servers that are absent (`AGENTGATE_REQUIRE_SERVICES=1` makes absence a
//!   failure).
//! - [`ledger`]: a ledger table written inside a tool's SQL transaction, per
//!   SQL dialect, and its row count.
//! - [`faulty`]: a store wrapper whose writes can be made to fail, to drive
//!   the watchdog.
//! - [`holder`]: the child process that holds a lease until it is killed
//!   (`src/bin/agentgate-holder.rs`, and `agentgate hold`).
//!
//! Every check prints one `conformance <check>: ...` line of counts, so a run
//! shows what was proven, not only that nothing failed.
#![forbid(unsafe_code)]

pub mod checks;
pub mod faulty;
pub mod holder;
pub mod ledger;
pub mod targets;

pub use targets::Target;

/// Generates one test per conformance check for the store made by `$factory`
/// (an `async fn() -> Option<Target>`; `None` skips with a printed reason).
#[macro_export]
macro_rules! suite {
    ($factory:path) => {
        $crate::suite!(@checks $factory;
            duplicate_storm,
            session_storm,
            user_capacity_storm,
            tool_storm,
            execution_limit_storm,
            same_transaction_effect,
            takeover_fences_the_old_holder,
            confirmation_race,
            confirmation_flow,
            pending_confirmation_expires,
            watchdog_keeps_a_long_turn,
            watchdog_cancels_when_renewal_fails,
            endings_and_restarts,
            ending_survives_a_store_blip,
            dropped_turn_is_released,
            retention_sweeper,
            fences_only_grow,
            bad_input_changes_nothing,
            overview_shows_holders_and_activity,
            concurrent_opens_migrate_once,
            orphan_claim_storm,
            orphan_filters,
            exhausted_orphan_ends_failed,
            unclaimed_orphan_is_abandoned,
            old_writes_in_flight_during_takeover,
            retention_sweeps_expired_turns_and_sessions,
            confirmation_rejected_and_repeated,
            confirmation_races_a_new_message,
            permit_freed_by_lease_expiry_after_a_crash,
            execution_pages_walk_every_execution_once,
        );

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn sigkilled_holder_is_taken_over_after_ttl() {
            let Some(target) = $factory().await else { return };
            $crate::checks::process::sigkilled_holder_is_taken_over_after_ttl(
                &target,
                env!("CARGO_BIN_EXE_agentgate-holder"),
            )
            .await;
        }
    };
    (@checks $factory:path; $($check:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                let Some(target) = $factory().await else { return };
                $crate::checks::$check(&target).await;
            }
        )+
    };
}

/// Generates the Redis-loss checks for a target with the Redis lease layer.
#[macro_export]
macro_rules! redis_suite {
    ($factory:path) => {
        $crate::suite!(@checks $factory;
            redis_loss_is_fenced,
            lying_lease_layer_is_refused_by_the_sql_fence,
            heartbeat_after_an_ending_is_refused_when_the_release_failed,
        );
    };
}

/// Generates the checks that need a store with its own clock (a database
/// server or Redis): a node with a skewed wall clock changes no outcome.
#[macro_export]
macro_rules! server_clock_suite {
    ($factory:path) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn skewed_clock_changes_nothing() {
            let Some(target) = $factory().await else {
                return;
            };
            $crate::checks::process::skewed_clock_changes_nothing(
                &target,
                env!("CARGO_BIN_EXE_agentgate-holder"),
            )
            .await;
        }
    };
}
