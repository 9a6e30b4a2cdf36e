//! The checks. Each takes a fresh [`Target`], attacks one invariant, asserts
//! both the success side and the refusal side, and prints its counts.

mod busy;
mod cancel;
mod confirm_races;
mod confirmation;
mod cut;
mod events;
mod inflight;
mod input;
mod lifecycle;
mod orphans;
mod pages;
mod permits;
pub mod process;
mod queue;
mod redis_loss;
mod retention;
mod session_policy;
mod storms;
mod takeover;
mod tools;
mod watchdog;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use agentgate::{Begun, Config, Error, Gate, Turn};
use tokio::sync::Barrier;

pub use busy::{
    a_release_on_another_node_wakes_a_waiter, force_release_races_the_ending,
    interrupt_stops_the_holder_then_starts, wait_storm_one_holder_at_a_time,
};
pub use cancel::{
    an_ignored_cancel_is_force_released_after_its_grace, cancel_is_learned_by_the_watchdog,
    cancel_races_claims_and_ending,
};
pub use confirm_races::{confirmation_races_a_new_message, confirmation_rejected_and_repeated};
pub use confirmation::{confirmation_flow, confirmation_race, pending_confirmation_expires};
pub use cut::{a_cut_off_step_leaves_nothing_behind, a_cut_statement_never_costs_its_connection};
pub use events::{
    an_append_on_another_node_wakes_its_followers, events_are_fenced_ordered_and_resumable,
};
pub use inflight::old_writes_in_flight_during_takeover;
pub use input::bad_input_changes_nothing;
pub use lifecycle::{
    concurrent_opens_migrate_once, dropped_turn_is_released, ending_survives_a_store_blip,
    endings_and_restarts, overview_shows_holders_and_activity, retention_sweeper,
};
pub use orphans::{
    exhausted_orphan_ends_failed, orphan_claim_storm, orphan_filters, unclaimed_orphan_is_abandoned,
};
pub use pages::execution_pages_walk_every_execution_once;
pub use permits::permit_freed_by_lease_expiry_after_a_crash;
pub use process::{sigkilled_holder_is_taken_over_after_ttl, skewed_clock_changes_nothing};
pub use queue::{
    a_killed_holders_queue_drains_after_takeover, a_queued_turn_is_cancelled_or_claimed,
    a_users_queues_are_bounded_across_sessions, enqueue_storm_runs_each_once_in_order,
    queue_is_not_jumped_interrupted_or_kept, queue_races_cancel_supersede_and_handoff,
    supersede_keeps_only_the_newest,
};
pub use redis_loss::{
    heartbeat_after_an_ending_is_refused_when_the_release_failed,
    lying_lease_layer_is_refused_by_the_sql_fence, redis_loss_is_fenced,
};
pub use retention::retention_sweeps_expired_turns_and_sessions;
pub use session_policy::session_default_policy_applies_to_unnamed_begins;
pub use storms::{duplicate_storm, fences_only_grow, session_storm, user_capacity_storm};
pub use takeover::takeover_fences_the_old_holder;
pub use tools::{execution_limit_storm, same_transaction_effect, tool_storm};
pub use watchdog::{watchdog_cancels_when_renewal_fails, watchdog_keeps_a_long_turn};

use crate::Target;

/// Tasks in every storm: 100, released by a barrier (docs/protocol.md §4).
pub const STORM_TASKS: usize = 100;

/// A short lease for checks that wait for expiry: long enough that a loaded
/// CI machine renews in time, short enough to keep the suite fast.
pub const SHORT_TTL: Duration = Duration::from_millis(800);

/// A begin of `request` (its payload names it) by `user` in `session`.
pub(crate) fn command(user: &str, session: &str, request: &str) -> agentgate::model::BeginCommand {
    agentgate::model::BeginCommand::new(
        agentgate::UserId::new(user).expect("user id"),
        agentgate::SessionId::new(session).expect("session id"),
        agentgate::ClientRequestId::new(request).expect("request id"),
        &serde_json::json!({"text": request}),
        None,
    )
    .expect("command")
}

/// The configuration most checks use.
pub fn config() -> Config {
    Config::default()
}

/// The configuration of checks that wait for a lease to expire.
pub fn short_ttl() -> Config {
    Config {
        lease_ttl: SHORT_TTL,
        ..Config::default()
    }
}

/// Runs `n` copies of `task` released together by a barrier; returns their
/// results in task order.
pub async fn storm<T, F, Fut>(n: usize, task: F) -> Vec<T>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let barrier = Arc::clone(&barrier);
            let work = task(i);
            tokio::spawn(async move {
                barrier.wait().await;
                work.await
            })
        })
        .collect();
    let mut results = Vec::with_capacity(n);
    for handle in handles {
        results.push(handle.await.expect("storm task panicked"));
    }
    results
}

/// The outcome class of a begin: `started`, `replay` or an error code.
pub fn outcome(result: &Result<Begun, Error>) -> String {
    match result {
        Ok(Begun::Started(_)) => "started".into(),
        Ok(Begun::Replay(_)) => "replay".into(),
        Ok(Begun::Queued(_)) => "queued".into(),
        Err(error) => error.kind().code().into(),
    }
}

/// Counts outcome classes.
pub fn tally<'a>(classes: impl IntoIterator<Item = &'a str>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for class in classes {
        *counts.entry(class.to_owned()).or_insert(0) += 1;
    }
    counts
}

/// Takes the started turns out of begin results.
pub fn started(results: Vec<Result<Begun, Error>>) -> (Vec<Turn>, Vec<Result<Begun, Error>>) {
    let mut turns = Vec::new();
    let mut rest = Vec::new();
    for result in results {
        match result {
            Ok(Begun::Started(turn)) => turns.push(turn),
            other => rest.push(other),
        }
    }
    (turns, rest)
}

/// Whether `target` tells other nodes of releases and new events:
/// PostgreSQL by `NOTIFY`, any store with the Redis layer by its pub/sub.
pub fn announces_across_nodes(target: &Target) -> bool {
    target.store_url.starts_with("postgres") || target.redis_url.is_some()
}

/// Begins and expects a start.
///
/// # Panics
/// When the begin does not start a turn.
pub async fn must_start(gate: &Gate, user: &str, session: &str, request: &str) -> Turn {
    match gate
        .begin(
            user,
            session,
            request,
            &serde_json::json!({"text": request}),
        )
        .await
    {
        Ok(Begun::Started(turn)) => turn,
        other => panic!(
            "expected a start of {session}/{request}, got {:?}",
            other.map(|_| ())
        ),
    }
}

/// Polls `begin` every 25 ms until it starts, for at most `limit`.
///
/// # Panics
/// When it does not start within `limit`.
pub async fn start_within(
    gate: &Gate,
    user: &str,
    session: &str,
    request: &str,
    limit: Duration,
) -> Turn {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match gate
            .begin(
                user,
                session,
                request,
                &serde_json::json!({"text": request}),
            )
            .await
        {
            Ok(Begun::Started(turn)) => return turn,
            Ok(Begun::Replay(view)) => panic!("expected a start, got a replay of {view:?}"),
            Ok(Begun::Queued(queued)) => panic!("expected a start, got queued: {queued:?}"),
            Err(error) if error.kind().is_retryable() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(error) => panic!("no start of {session}/{request} within {limit:?}: {error}"),
        }
    }
}

/// Prints one line of counts for a check (or, under `agentgate
/// conformance`, hands the counts to its table).
pub fn report(target: &Target, check: &str, counts: &BTreeMap<String, usize>) {
    let shown: Vec<String> = counts.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let shown = shown.join(" ");
    if !crate::run::captured_report(&shown) {
        println!("conformance {} {check}: {shown}", target.name);
    }
}
