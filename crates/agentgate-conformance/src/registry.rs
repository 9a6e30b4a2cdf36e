//! The one list of checks, and the runtime registry built from it.
//!
//! [`for_each_check!`](crate::for_each_check) holds the list: each check's
//! name (its function in [`checks`](crate::checks)), which targets it needs,
//! whether it spawns the holder process, and a one-line description. Both
//! consumers expand from it, so a check added there runs everywhere:
//!
//! - the cargo test targets: [`suite!`](crate::suite),
//!   [`redis_suite!`](crate::redis_suite) and
//!   [`server_clock_suite!`](crate::server_clock_suite) generate one
//!   `#[tokio::test]` per check;
//! - `agentgate conformance`: [`CHECKS`], run one by one by
//!   [`run`](crate::run) against the user's own store.

use std::future::Future;
use std::pin::Pin;

use crate::holder::Holder;
use crate::Target;

/// THE list of conformance checks. To add a check, write its `pub async fn`
/// in `checks/` (taking `&Target`, plus `&Holder` if it spawns the holder
/// process), re-export it from `checks`, and add one line here:
///
/// `name: needs [+ holder], "description";` where `needs` is `any` (every
/// store), `redis` (the Redis lease layer) or `server_clock` (a store with a
/// clock of its own: a database server or Redis).
///
/// Calls `$callback!` (a macro of this crate) with `[$args]` and the list.
#[doc(hidden)]
#[macro_export]
macro_rules! for_each_check {
    ($callback:ident $($arg:tt)*) => {
        $crate::$callback! { [$($arg)*]
            duplicate_storm: any,
                "100 identical begins: 1 starts, 99 are in flight; duplicates replay the answer";
            session_storm: any,
                "100 requests on one session: 1 starts, 99 are session_busy naming the holder";
            user_capacity_storm: any,
                "2x cap sessions of one user: exactly cap start, no lease left by a rejected one";
            a_cut_off_step_leaves_nothing_behind: any,
                "1,200 steps cut off at random await points on a pool of one connection: no transaction left open, every acknowledged write found, each cut step all or nothing as its repeat tells; cut through a Gate, steps run to their end";
            a_cut_statement_never_costs_its_connection: any,
                "steps of every kind cut after each of 0 to 12 pending polls, 8 times over, on a pool of one connection: a write after every cut is answered within 5 s";
            tool_storm: any,
                "100 claims of one tool call: 1 executes, 99 in flight, then the cached result";
            cancel_races_claims_and_ending: any,
                "10 cancel requests race 40 tool claims: claims after it refused, one cancelled ending, replayed";
            cancel_is_learned_by_the_watchdog: any,
                "a cancel from elsewhere reaches the holder by heartbeat, from its own gate at once; dropped, it ends cancelled";
            an_ignored_cancel_is_force_released_after_its_grace: any,
                "a holder that ignores its cancel is force-released by the sweep after the grace, not before; one that stops is kept";
            wait_storm_one_holder_at_a_time: any,
                "20 waiting begins on one session all start, one holder at a time; bounded waiters time out on time";
            interrupt_stops_the_holder_then_starts: any,
                "interrupt stops the holder (own gate at once, another by heartbeat) and starts; a stubborn one is force-released";
            a_release_on_another_node_wakes_a_waiter: any,
                "a waiter on one store handle starts when the holder on another ends (PostgreSQL: woken by NOTIFY)";
            force_release_races_the_ending: any,
                "a force-release fences every later write of the holder; raced with its ending, the turn ends once";
            execution_limit_storm: any,
                "100 first claims one short of the execution limit: exactly 1 executes";
            same_transaction_effect: any,
                "100 bookings with the effect in the claim's SQL transaction: exactly 1 ledger row";
            takeover_fences_the_old_holder: any,
                "a holder that stops heartbeating is taken over after the TTL and fenced out";
            confirmation_race: any,
                "49 messages race an await_confirmation ending: none starts";
            confirmation_flow: any,
                "two concurrent approvals: exactly one continuation starts";
            pending_confirmation_expires: any,
                "a pending confirmation expires after confirmation_ttl";
            watchdog_keeps_a_long_turn: any,
                "a turn running four TTLs keeps its lease through the watchdog alone";
            watchdog_cancels_when_renewal_fails: any,
                "when renewals fail the turn is cancelled while its lease is still live";
            endings_and_restarts: any,
                "retryable failures restart, final failures replay, ended turns refuse more";
            ending_survives_a_store_blip: any,
                "an answer survives refused endings: retried, or handed back with the lease";
            dropped_turn_is_released: any,
                "a turn dropped without an ending frees its session at once";
            retention_sweeper: any,
                "finished records are deleted after result_retention, live ones kept";
            fences_only_grow: any,
                "every fence is higher than every earlier one, across a reopened store";
            bad_input_changes_nothing: any,
                "every bad id, payload, token and reference is refused and writes nothing";
            overview_shows_holders_and_activity: any,
                "the operator overview shows holders and activity, never a lease token";
            concurrent_opens_migrate_once: any,
                "nodes opening a fresh store at once all succeed; the schema migrates once";
            orphan_claim_storm: any,
                "100 recovery workers drain 20 orphans: each claimed once, dead writes refused";
            orphan_filters: any,
                "orphan claims honour the user and age filters";
            exhausted_orphan_ends_failed: any,
                "an orphan whose holders keep dying ends failed when its attempts run out";
            unclaimed_orphan_is_abandoned: any,
                "an unclaimed orphan is ended abandoned by the sweeper after its grace";
            old_writes_in_flight_during_takeover: any,
                "30 rounds: an old holder's writes fire across its lease's expiry while a retry takes over; none lands after the takeover";
            retention_sweeps_expired_turns_and_sessions: any,
                "an expired running turn, an unanswered confirmation and their sessions are swept; the user's permit is freed, a live turn kept";
            confirmation_rejected_and_repeated: any,
                "a rejected confirmation ends the pending turn; the same answer replays, a changed one under the same request id is refused";
            confirmation_races_a_new_message: any,
                "20 rounds of approve, reject and 8 new messages racing: exactly one confirmation starts, new messages are refused typed";
            permit_freed_by_lease_expiry_after_a_crash: any,
                "cap 1: a crashed holder's permit refuses 20 contenders until its TTL, then exactly one is granted";
            execution_pages_walk_every_execution_once: any,
                "120 executions walked at page sizes 50, 7 and 200: each once, in claim order, every page within its row and byte limits";
            sigkilled_holder_is_taken_over_after_ttl: any + holder,
                "a holder process killed with SIGKILL is taken over after the TTL, not before";
            enqueue_storm_runs_each_once_in_order: any,
                "100 enqueues behind a barrier: positions 1..100 once each, the 101st queue_full; the handoffs run each once, in order";
            a_users_queues_are_bounded_across_sessions: any,
                "one user's 250 enqueues at once across 3 held sessions: exactly 200 queued, 50 queue_full, the views list 200";
            supersede_keeps_only_the_newest: any,
                "5 queued, then 10 supersedes at once: one message waits, every other replays superseded; only it runs";
            a_queued_turn_is_cancelled_or_claimed: any,
                "a queued turn's cancel ends it at once; a declined handoff's head is not jumped by a new message or its own tail, and a recovery claim starts it";
            queue_races_cancel_supersede_and_handoff: any,
                "20 rounds each: a handoff races a cancel, a supersede races a repeat and a cancel, a handoff races a supersede; no cancelled turn starts, no corrupt answer, no stranded queue";
            queue_is_not_jumped_interrupted_or_kept: any,
                "a retry of a failed request does not jump a waiting queue; an interrupt never cancels a queued message; superseded turns are swept";
            events_are_fenced_ordered_and_resumable: any,
                "20 batches of 10 events at once: ids 1..200, batches contiguous, bad appends refused; a zombie's event after the takeover refused; followers see 1..201 once each, in order, and the ending; resumes at any cut, and a dropped-and-resumed stream, see exactly the rest";
            an_append_on_another_node_wakes_its_followers: any,
                "an append on node A wakes node B's watch of the turn where the target announces (PostgreSQL, Redis), and node B reads it";
            session_default_policy_applies_to_unnamed_begins: any,
                "a session's default policy: set by its user only; 20 unnamed begins queued by it in order, a named reject still refused; an unnamed begin waits by it; supersede + interrupt asks the holder to stop and runs only the newest";
            a_killed_holders_queue_drains_after_takeover: any + holder,
                "a holder killed with SIGKILL with 5 messages queued: taken over after the TTL, then the queue drains once each, in order";
            redis_loss_is_fenced: redis,
                "Redis forgets a live lease: the old holder's writes are refused by the SQL fence";
            lying_lease_layer_is_refused_by_the_sql_fence: redis,
                "a lease layer that lies cannot let a stale holder write";
            heartbeat_after_an_ending_is_refused_when_the_release_failed: redis,
                "an ended turn's heartbeat is refused even when the Redis release failed";
            skewed_clock_changes_nothing: server_clock + holder,
                "a holder whose clock is a day ahead (faketime) changes no outcome";
        }
    };
}

/// What a check needs of the store it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Runs on every store.
    Any,
    /// Needs the Redis lease layer (`--redis`).
    Redis,
    /// Needs a store with a clock of its own: a database server, or Redis.
    ServerClock,
}

impl Needs {
    /// Whether a store with (`redis`) or without the lease layer and with
    /// (`server_clock`) or without a clock of its own meets this need.
    pub fn met(self, redis: bool, server_clock: bool) -> bool {
        match self {
            Self::Any => true,
            Self::Redis => redis,
            Self::ServerClock => server_clock || redis,
        }
    }

    /// Why a store does not meet this need, for a skipped row.
    pub fn unmet_reason(self) -> &'static str {
        match self {
            Self::Any => "",
            Self::Redis => "needs the Redis lease layer (--redis)",
            Self::ServerClock => "needs a store with its own clock (a database server or --redis)",
        }
    }
}

/// A boxed check run. Not `Send`: a check runs on a runtime of its own
/// (`run`), as under `#[tokio::test]`, not as a spawned task.
pub type CheckFuture<'a> = Pin<Box<dyn Future<Output = ()> + 'a>>;

/// One check: it passes when its future completes, fails when it panics.
#[derive(Clone, Copy)]
pub struct Check {
    /// The check's name (its function in `checks`).
    pub name: &'static str,
    /// One line saying what it proves.
    pub description: &'static str,
    /// Which stores it runs on.
    pub needs: Needs,
    /// Whether it spawns the holder process.
    pub spawns_holder: bool,
    /// Runs the check on a fresh target; the holder is used by checks that
    /// spawn one.
    pub run: for<'a> fn(&'a Target, &'a Holder) -> CheckFuture<'a>,
}

impl std::fmt::Debug for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Check")
            .field("name", &self.name)
            .field("needs", &self.needs)
            .finish_non_exhaustive()
    }
}

/// Every check, in the order of the list.
pub static CHECKS: &[Check] = crate::for_each_check!(__registry);

/// Builds [`CHECKS`] from the list.
#[doc(hidden)]
#[macro_export]
macro_rules! __registry {
    ([] $($name:ident : $needs:ident $(+ $holder:ident)?, $description:literal;)*) => {
        &[$(
            $crate::registry::Check {
                name: stringify!($name),
                description: $description,
                needs: $crate::__needs!($needs),
                spawns_holder: $crate::__spawns_holder!($($holder)?),
                run: {
                    fn run<'a>(
                        target: &'a $crate::Target,
                        holder: &'a $crate::holder::Holder,
                    ) -> $crate::registry::CheckFuture<'a> {
                        Box::pin($crate::__call_check!($name, target, holder $(, $holder)?))
                    }
                    run
                },
            },
        )*]
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __needs {
    (any) => {
        $crate::registry::Needs::Any
    };
    (redis) => {
        $crate::registry::Needs::Redis
    };
    (server_clock) => {
        $crate::registry::Needs::ServerClock
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __spawns_holder {
    () => {
        false
    };
    (holder) => {
        true
    };
}

/// The call of one check on `$target` (and `$holder` when it spawns one).
#[doc(hidden)]
#[macro_export]
macro_rules! __call_check {
    ($name:ident, $target:expr, $holder:expr) => {{
        let _ = $holder;
        $crate::checks::$name($target)
    }};
    ($name:ident, $target:expr, $holder:expr, holder) => {
        $crate::checks::$name($target, $holder)
    };
}

/// The test targets: one `#[tokio::test]` per check of the list whose need
/// is `$wanted`, on the targets made by `$factory`.
#[doc(hidden)]
#[macro_export]
macro_rules! __suite_tests {
    ([$wanted:ident $factory:path] $($name:ident : $needs:ident $(+ $holder:ident)?, $description:literal;)*) => {
        $( $crate::__suite_test!($wanted $needs $factory, $name $(, $holder)?); )*
    };
}

/// One test when the check's need is the wanted one, else nothing.
#[doc(hidden)]
#[macro_export]
macro_rules! __suite_test {
    (any any $($rest:tt)*) => {
        $crate::__test_fn!($($rest)*);
    };
    (redis redis $($rest:tt)*) => {
        $crate::__test_fn!($($rest)*);
    };
    (server_clock server_clock $($rest:tt)*) => {
        $crate::__test_fn!($($rest)*);
    };
    ($wanted:ident $needs:ident $($rest:tt)*) => {};
}

#[doc(hidden)]
#[macro_export]
macro_rules! __test_fn {
    ($factory:path, $name:ident $(, $holder:ident)?) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let Some(target) = $factory().await else {
                return;
            };
            let holder = $crate::__test_holder!($($holder)?);
            $crate::__call_check!($name, &target, &holder $(, $holder)?).await;
        }
    };
}

/// The holder of a test target: this crate's `agentgate-holder` binary
/// (only the checks that spawn one name it, so other crates' tests need not
/// build it).
#[doc(hidden)]
#[macro_export]
macro_rules! __test_holder {
    () => {
        ()
    };
    (holder) => {
        $crate::holder::Holder::new(env!("CARGO_BIN_EXE_agentgate-holder"))
    };
}

/// The checks that can run on a store with (`redis`) or without the Redis
/// lease layer and with or without a clock of its own, and the rest.
pub fn partition(redis: bool, server_clock: bool) -> (Vec<&'static Check>, Vec<&'static Check>) {
    CHECKS
        .iter()
        .partition(|check| check.needs.met(redis, server_clock))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_described() {
        let mut names: Vec<&str> = CHECKS.iter().map(|c| c.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CHECKS.len(), "a check is listed twice");
        assert!(CHECKS.iter().all(|c| !c.description.is_empty()));
    }

    #[test]
    fn holder_checks_are_marked() {
        let holders: Vec<&str> = CHECKS
            .iter()
            .filter(|c| c.spawns_holder)
            .map(|c| c.name)
            .collect();
        assert_eq!(
            holders,
            [
                "sigkilled_holder_is_taken_over_after_ttl",
                "a_killed_holders_queue_drains_after_takeover",
                "skewed_clock_changes_nothing"
            ]
        );
    }
}
