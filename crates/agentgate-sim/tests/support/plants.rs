//! Mutation checks: every planted bug of [`agentgate_core::plant`] must be
//! caught by some layer of the suite within CI's budget (issue 31).
//!
//! For each plant in [`Plant::ALL`], the switch is set for the whole
//! process and the layers run in a fixed order, cheapest first, until one
//! fails; a plant no layer catches fails the test:
//!
//! 1. the seeded simulation ([`agentgate_sim::run`]): seeds `1..=`
//!    [`SIM_SEEDS`], each history checked against docs/protocol.md §4, and
//!    what its clients observed;
//! 2. the oracle on SQLite: [`ORACLE_CASES`] steady cases, then
//!    [`ORACLE_EXPIRY_CASES`] across lease expiry, then
//!    [`ORACLE_RETENTION_CASES`] across retention, unshrunk (the real store
//!    against `decide` on the simulated one, and the repeat claim held to
//!    the protocol itself);
//! 3. the conformance checks on SQLite, in the suite's order (those that
//!    spawn a holder process excepted): real concurrency behind barriers,
//!    held to the protocol, not to `decide`;
//! 4. the oracle on PostgreSQL and on MySQL, steady and across expiry,
//!    when their servers are up (with `AGENTGATE_REQUIRE_SERVICES=1` an
//!    absent one fails).
//!
//! A layer that cannot run the planted code is skipped ([`reach`]): the
//! simulation runs no SQL, and SQLite runs no PostgreSQL or MySQL SQL.
//!
//! A plant in `decide` changes both sides of the oracle alike, so only the
//! layers that hold the product to the protocol itself (the simulation's
//! checker, the oracle's repeat-claim rule, the conformance checks) can
//! catch it. The test prints a table: each plant, the layer that caught it,
//! the seed or case, the time, and the first line of what failed.
//!
//! `AGENTGATE_PLANTS=<Name>,<Name>` runs only the plants named (their
//! `Debug` names).
//!
//! The switch is process-wide: this test takes [`SWITCH`] for writing, and
//! every other test of this binary holds it for reading while it runs
//! ([`unplanted`]), so no other test ever runs with a bug planted.

use std::panic::AssertUnwindSafe;
use std::sync::{RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use agentgate_conformance::holder::Holder;
use agentgate_conformance::registry::{Needs, CHECKS};
use agentgate_conformance::targets::{self, Target};
use agentgate_core::plant::{self, Plant};
use agentgate_sim::store::Mutation;

use super::{agree, Agreement, Kind};

/// Held for reading by every test of this binary but the plant test.
static SWITCH: RwLock<()> = RwLock::new(());

/// Seeds of the simulation per plant.
const SIM_SEEDS: u64 = 100;
/// The oracle's steady cases per plant and store.
const ORACLE_CASES: u32 = 32;
/// The oracle's expiry cases per plant and store (each sleeps about 1.3 s).
const ORACLE_EXPIRY_CASES: u32 = 8;
/// The oracle's retention cases per plant on SQLite (each sleeps 2–4 s).
const ORACLE_RETENTION_CASES: u32 = 2;
/// The longest one conformance check may run under a plant: a check that
/// hangs is a suite that fails (CI's time limit), caught.
const CHECK_DEADLINE: Duration = Duration::from_secs(120);

/// Keeps every planted bug out while the caller runs.
pub(crate) fn unplanted() -> RwLockReadGuard<'static, ()> {
    SWITCH
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Which layer caught a plant, where, and what it said.
struct Caught {
    layer: String,
    at: String,
    said: String,
}

fn first_line(text: &str) -> String {
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let mut line = line.trim().to_owned();
    if line.len() > 160 {
        let mut cut = 157;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
        line.push_str("...");
    }
    line
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// The first seed whose history the checker (or the clients' own checks)
/// rejects, or that panics.
fn simulation() -> Option<Caught> {
    for seed in 1..=SIM_SEEDS {
        let run = std::panic::catch_unwind(|| agentgate_sim::run(seed, Mutation::None));
        let said = match run {
            Err(payload) => format!("panicked: {}", panic_text(payload.as_ref())),
            Ok(run) => match (&run.verdict, &run.observed) {
                (Err(v), _) | (Ok(_), Err(v)) => v.message.clone(),
                (Ok(_), Ok(_)) => continue,
            },
        };
        return Some(Caught {
            layer: "simulation".to_owned(),
            at: format!("seed {seed}"),
            said: first_line(&said),
        });
    }
    None
}

type Maker = fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<Target>>>>;

/// The oracle's cases on one target, unshrunk.
fn oracle(name: &str, make: Maker, kind: Kind, cases: u32) -> Option<Caught> {
    let agreed = std::panic::catch_unwind(AssertUnwindSafe(|| agree(make, kind, cases, false)));
    let said = match agreed {
        Err(payload) => format!("panicked: {}", panic_text(payload.as_ref())),
        Ok(Agreement::Absent) => {
            assert!(
                std::env::var_os("AGENTGATE_REQUIRE_SERVICES").is_none(),
                "{name}'s server is required (AGENTGATE_REQUIRE_SERVICES) but absent"
            );
            println!("plants: {name} is absent; its oracle layer skipped");
            return None;
        }
        Ok(Agreement::Agreed(_)) => return None,
        Ok(Agreement::Differs(reason)) => reason,
    };
    // "… fails the oracle at case N: step …": the case, then the difference.
    let (at, said) = match said.split_once(": ") {
        Some((head, rest)) if head.contains(" at case ") => (
            head.rsplit_once(" at ").map_or(head, |(_, c)| c).to_owned(),
            rest.to_owned(),
        ),
        _ => ("-".to_owned(), said),
    };
    Some(Caught {
        layer: format!("oracle, {name}{}", kind.label()),
        at,
        said: first_line(&said),
    })
}

/// The first conformance check on SQLite that fails.
fn conformance() -> Option<Caught> {
    // No check below spawns a holder: the program is never run.
    let holder = Holder::new("agentgate-holder-is-not-used");
    for check in CHECKS
        .iter()
        .filter(|c| c.needs == Needs::Any && !c.spawns_holder)
    {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
            runtime.block_on(async {
                let target = targets::sqlite().await.expect("SQLite is always there");
                tokio::time::timeout(CHECK_DEADLINE, (check.run)(&target, &holder)).await
            })
        }));
        runtime.shutdown_timeout(Duration::from_secs(5));
        let said = match ran {
            Ok(Ok(())) => continue,
            Ok(Err(_)) => format!("did not finish within {CHECK_DEADLINE:?}"),
            Err(payload) => panic_text(payload.as_ref()),
        };
        return Some(Caught {
            layer: "conformance, sqlite".to_owned(),
            at: check.name.to_owned(),
            said: first_line(&said),
        });
    }
    None
}

/// Which layers can run a plant's code at all: the simulation runs no
/// SQL, and the oracle and conformance checks on SQLite run no PostgreSQL
/// or MySQL SQL.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// `decide` and the library: every layer.
    Everywhere,
    /// SQL every SQL store shares.
    SqlStores,
    /// One store's own SQL.
    Only(&'static str),
}

fn reach(bug: Plant) -> Reach {
    match bug {
        Plant::SqliteBeginCapOffByOne
        | Plant::SqliteBeginOverHolder
        | Plant::SqliteConfirmationTtlTenfold => Reach::Only("sqlite"),
        Plant::PostgresFastLeaseIgnoresExpiry => Reach::Only("postgres"),
        Plant::MysqlFastLeaseIgnoresExpiry => Reach::Only("mysql"),
        Plant::HeartbeatRenewsExpiredLease => Reach::SqlStores,
        _ => {
            assert_ne!(bug.layer(), plant::Layer::Store, "{bug:?}: say which store");
            Reach::Everywhere
        }
    }
}

/// The layers that can run `bug`'s code, cheapest first, until one
/// catches it.
fn hunt(bug: Plant) -> Option<Caught> {
    let reach = reach(bug);
    let runs = |store: &str| match reach {
        Reach::Everywhere | Reach::SqlStores => true,
        Reach::Only(only) => only == store,
    };
    if reach == Reach::Everywhere {
        if let Some(caught) = simulation() {
            return Some(caught);
        }
    }
    let sqlite: Maker = || Box::pin(targets::sqlite());
    let postgres: Maker = || Box::pin(targets::postgres());
    let mysql: Maker = || Box::pin(targets::mysql());
    let sqlite_oracles = [
        ("sqlite", sqlite, Kind::Steady, ORACLE_CASES),
        ("sqlite", sqlite, Kind::Expiry, ORACLE_EXPIRY_CASES),
        ("sqlite", sqlite, Kind::Retention, ORACLE_RETENTION_CASES),
    ];
    let server_oracles = [
        ("postgres", postgres, Kind::Steady, ORACLE_CASES),
        ("postgres", postgres, Kind::Expiry, ORACLE_EXPIRY_CASES),
        ("mysql", mysql, Kind::Steady, ORACLE_CASES),
        ("mysql", mysql, Kind::Expiry, ORACLE_EXPIRY_CASES),
    ];
    for (name, make, kind, cases) in sqlite_oracles {
        if runs(name) {
            if let Some(caught) = oracle(name, make, kind, cases) {
                return Some(caught);
            }
        }
    }
    if runs("sqlite") {
        if let Some(caught) = conformance() {
            return Some(caught);
        }
    }
    for (name, make, kind, cases) in server_oracles {
        if runs(name) {
            if let Some(caught) = oracle(name, make, kind, cases) {
                return Some(caught);
            }
        }
    }
    None
}

/// Every plant of [`Plant::ALL`] is caught by some layer (see the module
/// documentation); the table says which, where and how fast.
#[test]
fn every_planted_bug_is_caught() {
    let _alone = SWITCH
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut survivors = Vec::new();
    // `AGENTGATE_PLANTS=QueueJump,CapOffByOne` runs only those.
    let only = std::env::var("AGENTGATE_PLANTS").ok();
    let chosen: Vec<Plant> = Plant::ALL
        .iter()
        .copied()
        .filter(|bug| {
            only.as_deref()
                .is_none_or(|names| names.split(',').any(|n| n.trim() == format!("{bug:?}")))
        })
        .collect();
    assert!(
        !chosen.is_empty(),
        "AGENTGATE_PLANTS={only:?} names no plant"
    );
    for &bug in &chosen {
        plant::set(Some(bug));
        let clock = Instant::now();
        let caught = hunt(bug);
        let took = clock.elapsed();
        let stale = plant::stale();
        plant::set(None);
        assert!(
            !stale,
            "{bug:?} no longer applies: a statement it edits was rewritten (agentgate_core::plant::edit)"
        );
        match caught {
            Some(c) => {
                println!(
                    "plants: {bug:?} caught by {} at {} after {:.1}s: {}",
                    c.layer,
                    c.at,
                    took.as_secs_f64(),
                    c.said
                );
                rows.push(format!(
                    "| {} | {:?} | {} | {} | {:.1} s |",
                    bug.describe(),
                    bug.layer(),
                    c.layer,
                    c.at,
                    took.as_secs_f64()
                ));
            }
            None => {
                println!(
                    "plants: {bug:?} SURVIVED every layer ({:.1}s)",
                    took.as_secs_f64()
                );
                survivors.push(bug);
                rows.push(format!(
                    "| {} | {:?} | **survived** | - | {:.1} s |",
                    bug.describe(),
                    bug.layer(),
                    took.as_secs_f64()
                ));
            }
        }
    }
    println!(
        "\n| planted bug | lives in | caught by | at | time |\n|---|---|---|---|---|\n{}\n\n{} plants in {:.1}s",
        rows.join("\n"),
        chosen.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        survivors.is_empty(),
        "planted bugs no layer caught: {survivors:?}"
    );
}
