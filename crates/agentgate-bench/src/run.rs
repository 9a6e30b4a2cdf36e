//! The phases of a run, in order:
//!
//! 1. create the run's own store (`target`) and open the engine on it;
//! 2. pre-populate `sessions` finished sessions;
//! 3. count round trips per turn (engine and raw, `counting`);
//! 4. warm every loop up, then measure them in alternating rounds: library,
//!    raw baseline, and (HTTP runs) `agentgate serve`;
//! 5. the duplicate-begin storm (through the chosen `via`);
//! 6. scaling: the chosen loop in one block, populate up to
//!    `scale_sessions`, the same block again;
//! 7. memory (HTTP runs): a fresh `agentgate serve` holding `live_turns`
//!    live turns, its peak RSS;
//! 8. remove the run's store, whatever happened before.

use std::future::Future;
use std::sync::Arc;

use agentgate::{Config, Gate};
use tokio::time::Instant;

use crate::error::{BenchError, Result};
use crate::http::{HttpTurns, RunningServer, ServerSpec};
use crate::library::LibraryTurns;
use crate::limits::{BENCH_SWEEP_INTERVAL, MAX_WARMUP, WARMUP_DIVISOR};
use crate::machine::{load_average, Machine};
use crate::populate::populate;
use crate::progress::Progress;
use crate::raw::{RawTurns, SqlPool};
use crate::report::{EngineSteps, RawSteps, Report, Scaling};
use crate::stats::Samples;
use crate::target::Target;
use crate::workload::{drive, Sample, TurnLoop, STEPS};
use crate::{counting, http, storm, BenchOptions, Via};

/// Runs every measurement of `options` on a store of the run's own, until
/// done or until `stop` completes (then the run's store is still removed).
///
/// # Errors
/// `Options` for options out of range; `Interrupted` when `stop` completed
/// first; any failure of a measured step (see [`BenchError`]); a failure to
/// remove the run's store.
pub async fn run(options: &BenchOptions, stop: impl Future<Output = ()>) -> Result<Report> {
    options.validate()?;
    let target = Target::prepare(options.store.as_deref(), options.redis.as_deref()).await?;
    let progress = Progress::new(options.progress && long_run(options), phases(options));
    let outcome = tokio::select! {
        result = measure(options, &target, &progress) => result,
        () = stop => Err(BenchError::Interrupted),
    };
    progress.finish();
    let cleaned = target.cleanup().await;
    let report = outcome?;
    cleaned?;
    Ok(report)
}

/// Whether a run takes long enough to deserve a progress bar.
fn long_run(options: &BenchOptions) -> bool {
    options.duration.as_secs_f64() * 2.0 > 3.0 || options.scale_sessions >= 100_000
}

fn phases(options: &BenchOptions) -> u64 {
    let scaling = if options.scale_sessions > options.sessions {
        3
    } else {
        0
    };
    let memory = u64::from(options.via == Via::Http && options.live_turns > 0);
    // open, populate, count, warm-up, rounds, storm, scaling, memory,
    // ingestion, wake
    4 + u64::from(options.rounds) + 1 + scaling + memory + 2
}

/// The engine's settings in a bench: the defaults, but the sweeper idle
/// (see [`BENCH_SWEEP_INTERVAL`]).
fn engine_config() -> Config {
    Config {
        sweep_interval: BENCH_SWEEP_INTERVAL,
        ..Config::default()
    }
}

fn engine_steps(steps: &[Samples; STEPS]) -> EngineSteps {
    EngineSteps {
        begin: steps[0].summary(),
        tool_claim: steps[1].summary(),
        tool_complete: steps[2].summary(),
        succeed: steps[3].summary(),
    }
}

fn raw_steps(steps: &[Samples; STEPS]) -> RawSteps {
    RawSteps {
        lease_acquire: steps[0].summary(),
        tool_insert: steps[1].summary(),
        tool_update: steps[2].summary(),
        lease_release: steps[3].summary(),
    }
}

fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 {
        numerator / denominator
    } else {
        0.0
    }
}

/// The loops of the main measurement.
struct Loops {
    library: Arc<dyn TurnLoop>,
    raw: Arc<dyn TurnLoop>,
    http: Option<Arc<dyn TurnLoop>>,
}

/// What the rounds measured.
#[derive(Default)]
struct Measured {
    library: Sample,
    raw: Sample,
    http: Option<Sample>,
}

async fn measure_rounds(
    options: &BenchOptions,
    loops: &Loops,
    progress: &Progress,
) -> Result<Measured> {
    let clients = options.concurrency;
    progress.phase("warming up");
    let warmup = (options.duration / WARMUP_DIVISOR).min(MAX_WARMUP);
    drive(Arc::clone(&loops.library), clients, warmup).await?;
    drive(Arc::clone(&loops.raw), clients, warmup).await?;
    if let Some(http) = &loops.http {
        drive(Arc::clone(http), clients, warmup).await?;
    }
    progress.done();
    let slice = options.duration / options.rounds;
    let mut measured = Measured {
        http: loops.http.as_ref().map(|_| Sample::default()),
        ..Measured::default()
    };
    for round in 1..=options.rounds {
        progress.phase(format!("round {round}/{}: library", options.rounds));
        measured
            .library
            .merge(drive(Arc::clone(&loops.library), clients, slice).await?);
        progress.phase(format!("round {round}/{}: raw baseline", options.rounds));
        measured
            .raw
            .merge(drive(Arc::clone(&loops.raw), clients, slice).await?);
        if let (Some(http), Some(sample)) = (&loops.http, measured.http.as_mut()) {
            progress.phase(format!("round {round}/{}: http", options.rounds));
            sample.merge(drive(Arc::clone(http), clients, slice).await?);
        }
        progress.done();
    }
    Ok(measured)
}

async fn measure(options: &BenchOptions, target: &Target, progress: &Progress) -> Result<Report> {
    let mut machine = Machine::read();
    let config = engine_config();
    progress.phase("opening the store");
    let gate = Gate::connect(
        &target.store_url,
        target.redis_url.as_deref(),
        config.clone(),
    )
    .await?;
    let pool = SqlPool::open(target.dialect, &target.store_url).await?;
    let loader = SqlPool::open_quiet(target.dialect, &target.store_url).await?;
    progress.done();

    progress.phase(format!("populating {} sessions", options.sessions));
    populate(&loader, 0, options.sessions, |_| {}).await?;
    progress.done();

    progress.phase("counting round trips");
    let counting::Counted {
        round_trips,
        proxies: _counting_proxies,
    } = counting::count(target, &config, options.count_turns).await?;
    progress.done();

    let redis_raw = target
        .redis_base_url
        .as_deref()
        .zip(target.redis_prefix.as_deref());
    let raw = RawTurns::open(pool.clone(), redis_raw, options.concurrency).await?;
    let spec = ServerSpec {
        store_url: target.store_url.clone(),
        redis_url: target.redis_url.clone(),
        lease_ttl: config.lease_ttl,
        max_turns_per_user: config.max_turns_per_user,
    };
    let server = match options.via {
        Via::Http => Some(RunningServer::start(options.server_binary.as_deref(), &spec).await?),
        Via::Library => None,
    };
    let http_loop = match &server {
        Some(server) => Some(Arc::new(HttpTurns::new(
            http::client(options.concurrency)?,
            server.base.clone(),
        )) as Arc<dyn TurnLoop>),
        None => None,
    };
    let loops = Loops {
        library: Arc::new(LibraryTurns::new(gate.clone())),
        raw: Arc::new(raw),
        http: http_loop,
    };
    let measured = measure_rounds(options, &loops, progress).await?;

    progress.phase(format!("storm of {} duplicate begins", options.storm));
    let storm = match &server {
        Some(server) => storm::over_http(&server.base, options.storm).await?,
        None => storm::library(&gate, options.storm).await?,
    };
    progress.done();

    let via_loop = loops
        .http
        .clone()
        .unwrap_or_else(|| Arc::clone(&loops.library));
    let via_sample = measured.http.as_ref().unwrap_or(&measured.library);
    let scaling = if options.scale_sessions > options.sessions {
        Some(measure_scaling(options, &loader, via_loop, progress).await?)
    } else {
        None
    };
    if let Some(server) = server {
        server.stop().await;
    }

    let memory = match (&options.server_binary, options.via, options.live_turns) {
        (Some(binary), Via::Http, live) if live > 0 => {
            progress.phase(format!("memory with {live} live turns"));
            let memory = http::live_turns_memory(binary, &spec, live).await?;
            progress.done();
            Some(memory)
        }
        _ => None,
    };
    progress.phase(format!("ingesting {} documents", options.ingest_documents));
    let ingestion = crate::ingest::measure(
        &gate,
        &target.store_url,
        &pool,
        options.ingest_documents,
        options.concurrency,
    )
    .await?;
    progress.done();
    progress.phase(format!("wake: {} rounds per mode", options.wake_rounds));
    let wake = crate::wake::measure(target, &config, options.wake_rounds).await?;
    progress.done();
    progress.phase(format!(
        "queue: {} messages per loop",
        options.queue_messages
    ));
    let queue = crate::queue::measure(target, &config, options.queue_messages).await?;
    progress.done();
    progress.phase(format!(
        "events: {} followers of {} events",
        options.event_subscribers, options.event_count
    ));
    let events = crate::events::measure(
        target,
        &config,
        options.event_subscribers,
        options.event_count,
    )
    .await?;
    progress.done();
    pool.close().await;
    loader.close().await;
    drop(loops);
    drop(gate);
    machine.load_end = load_average();

    let library_tps = measured.library.turns_per_s();
    let raw_tps = measured.raw.turns_per_s();
    let via_tps = via_sample.turns_per_s();
    let store = match target.redis_url {
        Some(_) => format!("{}+redis", target.dialect.name()),
        None => target.dialect.name().to_owned(),
    };
    Ok(Report {
        store,
        store_label: target.label.clone(),
        via: options.via,
        concurrency: options.concurrency,
        duration_s: options.duration.as_secs_f64(),
        rounds: options.rounds,
        turns_per_s: via_tps,
        raw_turns_per_s: raw_tps,
        ratio: ratio(via_tps, raw_tps),
        library_turns_per_s: library_tps,
        library_ratio: ratio(library_tps, raw_tps),
        http_to_library: measured
            .http
            .as_ref()
            .map(|http| ratio(http.turns_per_s(), library_tps)),
        round_trips_per_turn: round_trips.engine.round_trips_per_turn,
        raw_round_trips_per_turn: round_trips.raw.round_trips_per_turn,
        round_trips,
        steps: engine_steps(&via_sample.steps),
        library_steps: engine_steps(&measured.library.steps),
        raw_steps: raw_steps(&measured.raw.steps),
        storm_ms: storm.all_answered_ms,
        storm_p99_ms: storm.p99_ms,
        storm_started: storm.started,
        storm,
        scaling_ratio: scaling.map(|s| s.cost_ratio),
        scaling,
        peak_rss_mib: memory.map(|m| m.peak_rss_mib),
        memory,
        ingestion,
        wake,
        queue,
        events,
        machine,
    })
}

/// Measures the chosen loop in one block at `sessions`, populates up to
/// `scale_sessions`, and measures it again in an equal block: the two
/// figures are alike in everything but the store's size.
async fn measure_scaling(
    options: &BenchOptions,
    pool: &SqlPool,
    via_loop: Arc<dyn TurnLoop>,
    progress: &Progress,
) -> Result<Scaling> {
    let warmup = (options.duration / WARMUP_DIVISOR).min(MAX_WARMUP);
    progress.phase(format!("measuring at {} sessions", options.sessions));
    drive(Arc::clone(&via_loop), options.concurrency, warmup).await?;
    let small = drive(Arc::clone(&via_loop), options.concurrency, options.duration).await?;
    progress.done();
    progress.phase(format!(
        "populating up to {} sessions",
        options.scale_sessions
    ));
    let populating = Instant::now();
    populate(pool, options.sessions, options.scale_sessions, |done| {
        progress.phase(format!(
            "populating up to {} sessions: {} added",
            options.scale_sessions, done
        ));
    })
    .await?;
    let populate_s = populating.elapsed().as_secs_f64();
    progress.done();
    progress.phase(format!("measuring at {} sessions", options.scale_sessions));
    drive(Arc::clone(&via_loop), options.concurrency, warmup).await?;
    let large = drive(via_loop, options.concurrency, options.duration).await?;
    progress.done();
    let large_turns_per_s = large.turns_per_s();
    let small_turns_per_s = small.turns_per_s();
    Ok(Scaling {
        small_sessions: options.sessions,
        large_sessions: options.scale_sessions,
        small_turns_per_s,
        large_turns_per_s,
        cost_ratio: ratio(small_turns_per_s, large_turns_per_s),
        populate_s,
    })
}
