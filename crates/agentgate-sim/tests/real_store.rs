//! The simulation's workload against the real SQLite store, on real time:
//! the same seeded clients and faults, held to the checks that need no
//! history from the store (`check::check_observed`): fences never reused and
//! increasing per session, no stale write landing after a newer grant was
//! received, each tool key completed once with the ledger's booking, every
//! answer of a succeeded turn the same, and tool claims as docs/protocol.md
//! §2.4 has them (a holder's repeat of a running claim refused
//! `tool_in_flight`, a claim after a success cached with its result).
//!
//! Real time makes a seed take seconds, so this runs a few seeds
//! (`AGENTGATE_SIM_REAL_SEEDS`, default 5); the simulation covers the many.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentgate_sim::history::History;
use agentgate_sim::store::Clock;
use agentgate_sim::{check, drive, Plan};
use agentgate_store_sqlite::SqliteStore;

#[test]
fn the_workload_on_sqlite_keeps_the_observable_invariants() {
    let seeds = std::env::var("AGENTGATE_SIM_REAL_SEEDS")
        .ok()
        .map_or(5, |n| {
            n.parse::<u64>()
                .unwrap_or_else(|e| panic!("AGENTGATE_SIM_REAL_SEEDS={n:?}: {e}"))
        });
    let started = Instant::now();
    let mut totals = check::ObservedCounts::default();
    for seed in 1..=seeds {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let history = History::default();
        runtime.block_on(async {
            let plan = Plan::of(seed);
            let url = format!("sqlite://{}", dir.path().join("sim.db").display());
            let store = SqliteStore::open(&url, plan.config.clone())
                .await
                .unwrap_or_else(|e| panic!("open {url}: {e}"));
            drive(
                plan,
                Arc::new(store),
                Clock::start(),
                &history,
                Duration::from_millis(200),
            )
            .await;
        });
        let entries = history.entries();
        match check::check_observed(&entries) {
            Ok(counts) => {
                totals.grants += counts.grants;
                totals.writes += counts.writes;
                totals.completions += counts.completions;
                totals.repeats += counts.repeats;
                totals.repeats_in_flight += counts.repeats_in_flight;
                totals.claims_cached += counts.claims_cached;
            }
            Err(violation) => {
                let from = violation.index.saturating_sub(25);
                let before: String = entries[from..=violation.index]
                    .iter()
                    .map(|e| format!("  {e:?}\n"))
                    .collect();
                panic!(
                    "seed {seed} on SQLite broke an invariant at entry {}: {}\n{before}",
                    violation.index, violation.message
                );
            }
        }
    }
    println!(
        "{seeds} seeds on SQLite in {:.1}s: {} grants, {} fenced writes and {} tool completions received, \
         {} repeated answers, {} repeat claims of a running execution refused tool_in_flight, \
         {} claims after a success cached, all consistent",
        started.elapsed().as_secs_f64(),
        totals.grants,
        totals.writes,
        totals.completions,
        totals.repeats,
        totals.repeats_in_flight,
        totals.claims_cached
    );
    assert!(
        totals.grants > 0 && totals.writes > 0,
        "the workload did nothing"
    );
}
