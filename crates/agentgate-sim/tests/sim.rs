//! The seeded simulation: many seeds through the real library against the
//! fault-injecting in-memory store, each history checked against docs/protocol.md §4.
//!
//! `AGENTGATE_SIM_SEED=<n>` replays exactly seed `n`;
//! `AGENTGATE_SIM_SEEDS=<count>` runs seeds `1..=count` (default 1,000).

use std::time::Instant;

use agentgate_sim::check::Counts;
use agentgate_sim::history::{Event, Fault};
use agentgate_sim::store::Mutation;
use agentgate_sim::{run, Run};

const DEFAULT_SEEDS: u64 = 1_000;

fn env_u64(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    Some(
        text.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={text:?} is not a number: {e}")),
    )
}

fn fail(run: &Run) -> ! {
    panic!(
        "{}",
        run.explain()
            .unwrap_or_else(|| format!("seed {} failed", run.seed))
    )
}

/// Every seed's history keeps every invariant. Prints what was measured.
#[test]
fn seeds_keep_the_invariants() {
    let seeds: Vec<u64> = match env_u64("AGENTGATE_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (1..=env_u64("AGENTGATE_SIM_SEEDS").unwrap_or(DEFAULT_SEEDS)).collect(),
    };
    let started = Instant::now();
    let mut total = Counts::default();
    let mut faults = std::collections::BTreeMap::<Fault, u64>::new();
    // Store calls by step, and seeds by how many nodes (gates) they ran.
    let mut calls = std::collections::BTreeMap::<&'static str, u64>::new();
    let mut nodes = std::collections::BTreeMap::<u32, u64>::new();
    let (mut crashes, mut pauses, mut entries, mut simulated_ms) = (0u64, 0u64, 0usize, 0u128);
    // Folds every seed's history digest: equal across runs of the same seeds.
    let mut combined = 0u64;
    let (mut observed_writes, mut observed_repeats) = (0u64, 0u64);
    for &seed in &seeds {
        let run = run(seed, Mutation::None);
        let (counts, seen) = match (&run.verdict, &run.observed) {
            (Ok(counts), Ok(seen)) => (*counts, *seen),
            _ => fail(&run),
        };
        observed_writes += seen.writes;
        observed_repeats += seen.repeats;
        total.grants += counts.grants;
        total.takeovers += counts.takeovers;
        total.writes += counts.writes;
        total.effects += counts.effects;
        total.deduplicated += counts.deduplicated;
        total.replays += counts.replays;
        total.successes += counts.successes;
        total.repeats_in_flight += counts.repeats_in_flight;
        total.claims_cached += counts.claims_cached;
        total.cancels += counts.cancels;
        for (fault, n) in &run.faults {
            *faults.entry(*fault).or_default() += n;
        }
        for entry in &run.history {
            match entry.event {
                Event::Client { what: "crash", .. } => crashes += 1,
                Event::Client { what: "pause", .. } => pauses += 1,
                Event::Call { op, .. } => *calls.entry(op).or_default() += 1,
                _ => {}
            }
        }
        *nodes.entry(run.scenario.nodes).or_default() += 1;
        entries += run.history.len();
        combined = combined.rotate_left(5) ^ run.digest;
        if std::env::var_os("AGENTGATE_SIM_PRINT_DIGESTS").is_some() {
            println!("seed {seed} digest {:016x}", run.digest);
        }
        simulated_ms += run.simulated.as_millis();
    }
    let elapsed = started.elapsed();
    println!(
        "simulated {} seeds in {:.1}s wall ({}s simulated, {entries} history entries): \
         {} grants, {} takeovers, {} fenced writes checked, {} turns succeeded, {} replays checked, \
         {} tool effects booked, {} duplicate effect arrivals deduplicated by key, \
         {} repeat claims of a running execution refused tool_in_flight, {} claims after a success cached, \
         {} cancels recorded on running turns (no tool of theirs ran after), \
         {crashes} holder crashes, {pauses} holder pauses past the TTL, store faults {faults:?}; \
         client-observed checks: {observed_writes} writes received, {observed_repeats} repeated answers; \
         combined history digest {combined:016x}",
        seeds.len(),
        elapsed.as_secs_f64(),
        simulated_ms / 1000,
        total.grants,
        total.takeovers,
        total.writes,
        total.successes,
        total.replays,
        total.effects,
        total.deduplicated,
        total.repeats_in_flight,
        total.claims_cached,
        total.cancels,
    );
    println!("store calls by step: {calls:?}; seeds by nodes: {nodes:?}");
    if seeds.len() > 1 {
        assert!(total.takeovers > 0, "no seed took a turn over");
        assert!(
            nodes.keys().any(|n| *n > 1),
            "no seed ran more than one node"
        );
        assert!(crashes > 0 && pauses > 0, "no holder crashed or paused");
        assert!(
            faults.get(&Fault::LostReply).is_some_and(|n| *n > 0),
            "no reply was lost"
        );
        assert!(
            total.repeats_in_flight > 0 && total.claims_cached > 0,
            "no holder repeated a claim of a running or a succeeded execution"
        );
        assert!(
            total.cancels > 0,
            "no cancel was recorded on a running turn"
        );
    }
}

/// The same seed twice gives the same history, entry for entry, for the
/// first 100 seeds and a large one.
#[test]
fn a_seed_replays_exactly() {
    let seeds: Vec<u64> = match env_u64("AGENTGATE_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (1..=100).chain([1_000_003]).collect(),
    };
    for seed in seeds {
        let first = run(seed, Mutation::None);
        let second = run(seed, Mutation::None);
        if let Some(at) = (0..first.history.len().max(second.history.len()))
            .find(|&i| first.history.get(i) != second.history.get(i))
        {
            let from = at.saturating_sub(12);
            let show = |run: &Run| {
                run.history[from..(at + 3).min(run.history.len())]
                    .iter()
                    .map(|e| format!("  {e:?}\n"))
                    .collect::<String>()
            };
            panic!(
                "seed {seed}: histories differ from entry {at}\nfirst run:\n{}second run:\n{}",
                show(&first),
                show(&second)
            );
        }
        assert_eq!(
            first.digest, second.digest,
            "seed {seed}: history digests differ"
        );
        assert_eq!(
            first.history, second.history,
            "seed {seed}: histories differ"
        );
        if seed % 50 == 0 || seed > 100 {
            println!(
                "seed {seed}: {} entries, digest {:016x}, twice",
                first.history.len(),
                first.digest
            );
        }
    }
}

/// The first seed (of at most `limit`) whose history the checker rejects
/// under `mutation`.
fn first_caught(mutation: Mutation, limit: u64) -> Option<Run> {
    (1..=limit)
        .map(|seed| run(seed, mutation))
        .find(|run| run.verdict.is_err())
}

/// A store that grants over a live holder is caught: the checker can fail.
#[test]
fn the_checker_catches_a_grant_over_a_live_holder() {
    let caught = first_caught(Mutation::GrantOverLiveHolder, 300)
        .expect("no seed in 300 exposed a store granting over a live holder");
    let message = &caught.verdict.as_ref().unwrap_err().message;
    println!("{}", caught.explain().unwrap_or_default());
    assert!(message.contains("two live holders"), "{message}");
}

/// A store that completes tools without the fence check is caught.
#[test]
fn the_checker_catches_an_unfenced_tool_completion() {
    let caught = first_caught(Mutation::CompleteWithoutFence, 300)
        .expect("no seed in 300 exposed a store completing tools without the fence");
    let message = &caught.verdict.as_ref().unwrap_err().message;
    println!("caught at seed {}: {message}", caught.seed);
    assert!(message.contains("complete_tool"), "{message}");
}

/// A store that appends a zombie's events (no lease check) is caught: a
/// frozen holder's progress after its takeover lands without a live lease.
#[test]
fn the_checker_catches_a_zombies_event() {
    let caught = first_caught(Mutation::AppendWithoutLease, 300)
        .expect("no seed in 300 exposed a store appending events without a lease");
    let message = &caught.verdict.as_ref().unwrap_err().message;
    println!("caught at seed {}: {message}", caught.seed);
    assert!(message.contains("append_events"), "{message}");
}

/// The checks of what clients observed alone (the ones the real stores are
/// held to, `tests/real_store.rs`) catch the unfenced completion too.
#[test]
fn the_observed_checks_catch_an_unfenced_tool_completion() {
    let caught = (1..=300)
        .map(|seed| run(seed, Mutation::CompleteWithoutFence))
        .find(|run| run.observed.is_err())
        .expect("no seed in 300 exposed the unfenced completion to the observed checks");
    let message = &caught.observed.as_ref().unwrap_err().message;
    println!("caught at seed {}: {message}", caught.seed);
    assert!(
        message.contains("complete_tool") || message.contains("completed twice"),
        "{message}"
    );
}

/// A store whose takeover keeps the old fence is caught.
#[test]
fn the_checker_catches_a_reused_fence() {
    let caught = first_caught(Mutation::ReuseFenceOnTakeover, 300)
        .expect("no seed in 300 exposed a takeover reusing its fence");
    let message = &caught.verdict.as_ref().unwrap_err().message;
    println!("caught at seed {}: {message}", caught.seed);
    assert!(
        message.contains("counter went back") || message.contains("does not exceed"),
        "{message}"
    );
}

/// A store that does not count the user's permits is caught.
#[test]
fn the_checker_catches_a_permit_overrun() {
    let caught = first_caught(Mutation::IgnorePermits, 300)
        .expect("no seed in 300 exposed a store ignoring permits");
    let message = &caught.verdict.as_ref().unwrap_err().message;
    println!("caught at seed {}: {message}", caught.seed);
    assert!(message.contains("the cap is"), "{message}");
}

/// A store answering a holder's repeat claim of a call it is still running
/// (same lease) with execute again, instead of `tool_in_flight`, is caught,
/// by the full checker and by the checks a real store is held to.
#[test]
fn the_checker_catches_a_holder_running_its_own_claim_twice() {
    let caught = first_caught(Mutation::RerunOwnClaim, 300)
        .expect("no seed in 300 exposed a store running a holder's repeat claim again");
    let message = &caught.verdict.as_ref().unwrap_err().message;
    println!("caught at seed {}: {message}", caught.seed);
    assert!(
        message.contains("answered execute twice under one lease"),
        "{message}"
    );
    let message = &caught.observed.as_ref().unwrap_err().message;
    assert!(
        message.contains("answered execute twice under one lease"),
        "{message}"
    );
}
