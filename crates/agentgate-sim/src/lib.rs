//! A deterministic, seeded simulation of agentgate, after TigerBeetle's
//! VOPR and FoundationDB's simulation testing.
//!
//! One `u64` seed drives everything: the scenario (users, caps, sessions,
//! messages, devices, recovery workers, which faults are on), every fault
//! the store wrapper injects, and every client decision. The run is a
//! single-threaded tokio runtime on paused time, so the clock only moves
//! when every task waits on a timer, and the same seed yields the same
//! history, byte for byte.
//!
//! - [`store::SimStore`]: an in-memory [`agentgate_core::store::Store`]
//!   whose every decision is `agentgate_core::decide`'s, like the SQL
//!   stores'; [`store::Mutation`] breaks it on purpose.
//! - [`faults::Faulty`]: outages, lost replies, latency, and holders
//!   partitioned away (crashed, or frozen past their TTL).
//! - [`workload`]: devices, recovery workers and a downstream ledger, all on
//!   the real `agentgate` library.
//! - [`history`] and [`check`]: the record of the run and the
//!   invariants of docs/protocol.md §4 checked over it.

pub mod check;
pub mod faults;
pub mod history;
pub mod rng;
pub mod store;
pub mod workload;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use agentgate::{Config, Gate};

use crate::check::{Counts, ObservedCounts, Violation};
use crate::faults::{FaultRates, Faulty};
use crate::history::{Entry, Fault, History};
use crate::rng::Rng;
use crate::store::{Clock, Mutation, SimStore};
use crate::workload::{Ctx, Ledger, Scenario};

/// The lease TTL every run uses: short, so takeovers happen often.
pub const LEASE_TTL: Duration = Duration::from_secs(1);

/// What one seed did.
#[derive(Debug)]
pub struct Run {
    /// The seed.
    pub seed: u64,
    /// Its scenario.
    pub scenario: Scenario,
    /// Its fault rates.
    pub rates: FaultRates,
    /// The whole history.
    pub history: Vec<Entry>,
    /// Digest of the history: equal for equal runs.
    pub digest: u64,
    /// Faults injected by the store wrapper, by kind.
    pub faults: BTreeMap<Fault, u64>,
    /// The checker's verdict.
    pub verdict: Result<Counts, Violation>,
    /// The verdict of the checks of what clients observed alone (those a
    /// real store is held to as well).
    pub observed: Result<ObservedCounts, Violation>,
    /// Simulated time the run took.
    pub simulated: Duration,
}

impl Run {
    /// The violation with the history entries leading to it, for a report.
    pub fn explain(&self) -> Option<String> {
        let violation = self
            .verdict
            .as_ref()
            .err()
            .or(self.observed.as_ref().err())?;
        let from = violation.index.saturating_sub(25);
        let mut text = format!(
            "seed {} broke an invariant at history entry {}: {}\nscenario: {:?}\nfaults: {:?}\nhistory before it:\n",
            self.seed, violation.index, violation.message, self.scenario, self.rates
        );
        for (i, entry) in self
            .history
            .iter()
            .enumerate()
            .take(violation.index + 1)
            .skip(from)
        {
            text.push_str(&format!(
                "  #{i} t+{}ms {:?}\n",
                entry.at_ms - store::EPOCH_MS,
                entry.event
            ));
        }
        text.push_str(&format!(
            "replay: AGENTGATE_SIM_SEED={} cargo test -p agentgate-sim --test sim\n",
            self.seed
        ));
        Some(text)
    }
}

/// Runs `seed` on a fresh single-threaded runtime with paused time.
///
/// # Panics
/// If the runtime cannot be built.
pub fn run(seed: u64, mutation: Mutation) -> Run {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap_or_else(|e| panic!("a current-thread runtime: {e}"));
    // The library's retry backoff draws jitter; on this thread, from the seed.
    agentgate_core::retry::seed_jitter(Some(seed ^ 0x6a09_e667_f3bc_c908));
    let run = runtime.block_on(simulate(seed, mutation));
    agentgate_core::retry::seed_jitter(None);
    run
}

/// A seed's plan: its scenario, fault rates and store settings, and the
/// generator the run continues with.
#[derive(Debug)]
pub struct Plan {
    /// The seed's generator, past the draws below.
    pub rng: Rng,
    /// The scenario.
    pub scenario: Scenario,
    /// The fault rates.
    pub rates: FaultRates,
    /// The store settings.
    pub config: Config,
    /// The generator of the holders' repeated claims (`Scenario::repeat`),
    /// apart from `rng` so that each seed's scenario and fault rates stay
    /// what they were before claims were repeated.
    pub repeats: Rng,
}

impl Plan {
    /// Draws the plan of `seed`.
    pub fn of(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut scenario = Scenario::draw(&mut rng);
        let pick = |rng: &mut Rng, options: &[u32]| {
            options[usize::try_from(rng.range(0, options.len() as u64 - 1)).unwrap_or(0)]
        };
        let rates = FaultRates {
            unavailable: pick(&mut rng, &[0, 20, 80]),
            lost_reply: pick(&mut rng, &[0, 20, 80]),
            latency: pick(&mut rng, &[0, 200, 500]),
            max_latency_ms: u64::from(pick(&mut rng, &[5, 50, 300])),
        };
        let mut repeats = Rng::new(seed ^ 0x243f_6a88_85a3_08d3);
        scenario.repeat = pick(&mut repeats, &[0, 150, 400]);
        scenario.cancel = pick(&mut repeats, &[0, 100, 300]);
        scenario.nodes = pick(&mut repeats, &[1, 2, 3]);
        let config = Config {
            lease_ttl: LEASE_TTL,
            max_turns_per_user: scenario.cap,
            confirmation_ttl: Duration::from_secs(10),
            result_retention: Duration::from_secs(3600),
            sweep_interval: Duration::from_millis(500),
            orphan_grace: Duration::from_secs(3),
            ..Config::default()
        };
        Self {
            rng,
            scenario,
            rates,
            config,
            repeats,
        }
    }
}

/// Drives `plan`'s clients through the library against `store` wrapped in
/// the fault injector, until every device is done, then waits `settle`
/// (for leases to run out and the sweeper to abandon orphans). Returns the
/// faults injected.
pub async fn drive(
    plan: Plan,
    store: Arc<dyn agentgate::store::Store>,
    clock: Clock,
    history: &History,
    settle: Duration,
) -> BTreeMap<Fault, u64> {
    let Plan {
        mut rng,
        scenario,
        rates,
        repeats,
        ..
    } = plan;
    let faulty = Arc::new(Faulty::new(
        store,
        clock,
        history.clone(),
        rates,
        rng.fork(),
    ));
    let gates = (0..scenario.nodes.max(1))
        .map(|_| Gate::with_store(Arc::clone(&faulty) as Arc<dyn agentgate::store::Store>))
        .collect();
    let ctx = Arc::new(Ctx {
        gates,
        faulty: Arc::clone(&faulty),
        ledger: Ledger::default(),
        history: history.clone(),
        clock,
        scenario: scenario.clone(),
        stop: workload::Stop::default(),
        repeats: std::sync::Mutex::new(repeats),
    });
    let mut devices = Vec::new();
    let mut node = 0..;
    for u in 0..scenario.users {
        for s in 0..scenario.sessions_per_user {
            for _ in 0..scenario.devices {
                devices.push(tokio::spawn(workload::device(
                    Arc::clone(&ctx),
                    rng.fork(),
                    format!("user{u}"),
                    format!("u{u}s{s}"),
                    node.next().unwrap_or(0),
                )));
            }
        }
    }
    let workers: Vec<_> = (0..scenario.workers)
        .map(|w| tokio::spawn(workload::worker(Arc::clone(&ctx), rng.fork(), w as usize)))
        .collect();
    for device in devices {
        if let Err(error) = device.await {
            std::panic::resume_unwind(error.into_panic());
        }
    }
    ctx.stop.set();
    for worker in workers {
        if let Err(error) = worker.await {
            std::panic::resume_unwind(error.into_panic());
        }
    }
    tokio::time::sleep(settle).await;
    drop(ctx);
    faulty.counts()
}

async fn simulate(seed: u64, mutation: Mutation) -> Run {
    let plan = Plan::of(seed);
    let (scenario, rates) = (plan.scenario.clone(), plan.rates);
    let clock = Clock::start();
    let history = History::default();
    let store = Arc::new(SimStore::new(
        plan.config.clone(),
        clock,
        history.clone(),
        mutation,
    ));
    let faults = drive(
        plan,
        Arc::clone(&store) as Arc<dyn agentgate::store::Store>,
        clock,
        &history,
        // Leases run out and the sweeper abandons what no one resumed (TTL
        // 1 s + orphan grace 3 s + sweeps every 0.5 s, some failing).
        Duration::from_secs(8),
    )
    .await;
    store.quiesce();
    let simulated =
        Duration::from_millis(u64::try_from(clock.now_ms() - store::EPOCH_MS).unwrap_or(0));
    let entries = history.entries();
    let digest = history::digest(&entries);
    let verdict = check::check(&entries);
    let observed = check::check_observed(&entries);
    Run {
        seed,
        scenario,
        rates,
        digest,
        faults,
        verdict,
        observed,
        history: entries,
        simulated,
    }
}
