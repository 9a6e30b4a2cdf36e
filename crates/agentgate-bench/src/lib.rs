//! agentgate-bench: how close agentgate gets to its store's own limit.
//!
//! `agentgate bench` (the CLI's `bench` subcommand) parses flags into
//! [`BenchOptions`] and calls [`run`], which returns one [`Report`]. Every
//! figure is measured in the same run, on the same store, as a ratio against
//! a raw baseline, because absolute numbers on a shared machine are noise.
//!
//! - [`run()`] (`run.rs`): the phases of a run, in order.
//! - [`cli`]: the `bench` subcommand's flags and its tracing set-up.
//! - `target`: the run's own SQLite file, database or Redis key prefix, and
//!   their removal.
//! - `workload`: the closed loop of N clients running whole turns with any
//!   turn loop: `library` (the engine through `Gate`), `http` (through
//!   `agentgate serve`, and its memory), `raw` (the raw baseline).
//! - [`count`] and `counting`: round trips per turn, counted (sqlx
//!   statement events, SQLite transaction hooks, a wire-counting proxy).
//! - `storm`: concurrent duplicate begins of one request.
//! - `wake`: how soon a waiting begin starts after the holder ends, against
//!   the store's raw notification.
//! - `queue`: a conversation drained through `enqueue` and the endings'
//!   handoffs, against the same messages as plain begins.
//! - `populate`: bulk rows in the store's own tables, for scaling.
//! - [`report`]: the result, as JSON or text; `stats`: percentiles;
//!   `machine`: what it ran on; `progress`: the bar on stderr.
//! - [`limits`]: every named limit of the bench.
//!
//! Architecture invariant: the bench measures the engine through its public
//! surfaces only (`Gate`, the `Store` trait, the HTTP contract); it never
//! reaches into a store's code, and it writes only to a database, file or
//! key prefix it created for the run.
#![forbid(unsafe_code)]

pub mod cli;
pub mod count;
mod counting;
mod error;
mod events;
mod http;
mod ingest;
mod library;
pub mod limits;
mod machine;
mod populate;
mod progress;
mod queue;
mod raw;
pub mod report;
mod run;
mod stats;
mod storm;
mod target;
mod url;
mod wake;
mod workload;

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

pub use counting::{PassCount, RoundTrips};
pub use error::{BenchError, Result};
pub use machine::Machine;
pub use report::Report;
pub use run::run;
pub use stats::StepLatency;
pub use storm::StormReport;

/// How the turn loop reaches the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// In process, through `agentgate::Gate`.
    Library,
    /// Through `agentgate serve` over loopback HTTP.
    Http,
}

/// What to measure, and how hard.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The store URL; `None` (or `sqlite`) for a temp SQLite file.
    pub store: Option<String>,
    /// The Redis lease layer's URL.
    pub redis: Option<String>,
    /// Library or HTTP.
    pub via: Via,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Measured time per loop.
    pub duration: Duration,
    /// The measured time is split into this many alternating rounds of every
    /// loop, so a load spike from elsewhere hits all loops alike.
    pub rounds: u32,
    /// Sessions pre-populated before the main measurement.
    pub sessions: u64,
    /// Sessions pre-populated for the scaling measurement (0: skip it).
    pub scale_sessions: u64,
    /// Duplicate begins in the storm.
    pub storm: usize,
    /// Turns held live for the memory figure of HTTP runs (0: skip it).
    pub live_turns: usize,
    /// Turns of the round-trip counting pass.
    pub count_turns: u32,
    /// Documents of the ingestion row, per loop (0: skip it).
    pub ingest_documents: usize,
    /// Rounds of the wake row, per mode (0: skip it).
    pub wake_rounds: usize,
    /// Messages per loop of the queue row (0: skip it; at most the
    /// session queue's bound).
    pub queue_messages: usize,
    /// Followers of one turn in the events row (0: skip it).
    pub event_subscribers: usize,
    /// Events the events row appends.
    pub event_count: usize,
    /// The `agentgate` binary for HTTP runs; without it, the server runs in
    /// this process and its memory is not measured.
    pub server_binary: Option<PathBuf>,
    /// Draw a progress bar on stderr (when it is a terminal and the run is
    /// longer than a few seconds).
    pub progress: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            store: None,
            redis: None,
            via: Via::Library,
            concurrency: 16,
            duration: Duration::from_secs(10),
            rounds: 3,
            sessions: 10_000,
            scale_sessions: 1_000_000,
            storm: 1_000,
            live_turns: 10_000,
            count_turns: 200,
            ingest_documents: 20,
            wake_rounds: 20,
            queue_messages: 100,
            event_subscribers: 1_000,
            event_count: 100,
            server_binary: None,
            progress: true,
        }
    }
}

impl BenchOptions {
    /// Checks every option against its limit.
    ///
    /// # Errors
    /// `Options` naming the first option out of range.
    pub fn validate(&self) -> Result<()> {
        let check = |ok: bool, message: String| {
            if ok {
                Ok(())
            } else {
                Err(BenchError::Options(message))
            }
        };
        check(
            (1..=limits::MAX_CONCURRENCY).contains(&self.concurrency),
            format!("concurrency must be 1..={}", limits::MAX_CONCURRENCY),
        )?;
        check(
            !self.duration.is_zero() && self.duration <= limits::MAX_DURATION,
            format!(
                "duration must be above 0 and at most {} s",
                limits::MAX_DURATION.as_secs()
            ),
        )?;
        check(
            (1..=limits::MAX_ROUNDS).contains(&self.rounds),
            format!("rounds must be 1..={}", limits::MAX_ROUNDS),
        )?;
        check(
            self.sessions <= limits::MAX_SESSIONS && self.scale_sessions <= limits::MAX_SESSIONS,
            format!("sessions must be at most {}", limits::MAX_SESSIONS),
        )?;
        check(
            (1..=limits::MAX_STORM).contains(&self.storm),
            format!("storm must be 1..={}", limits::MAX_STORM),
        )?;
        check(
            self.live_turns <= limits::MAX_LIVE_TURNS,
            format!("live turns must be at most {}", limits::MAX_LIVE_TURNS),
        )?;
        check(
            (1..=limits::MAX_COUNT_TURNS).contains(&self.count_turns),
            format!("count turns must be 1..={}", limits::MAX_COUNT_TURNS),
        )?;
        check(
            self.ingest_documents <= limits::MAX_INGEST_DOCUMENTS,
            format!(
                "ingest documents must be at most {}",
                limits::MAX_INGEST_DOCUMENTS
            ),
        )?;
        check(
            self.queue_messages <= agentgate::limits::MAX_SESSION_QUEUE as usize,
            format!(
                "queue messages must be at most the session queue's bound, {}",
                agentgate::limits::MAX_SESSION_QUEUE
            ),
        )?;
        check(
            self.event_subscribers <= limits::MAX_EVENT_SUBSCRIBERS
                && self.event_count as u64 <= agentgate::limits::MAX_TURN_EVENTS,
            format!(
                "event subscribers must be at most {} and event count at most {}",
                limits::MAX_EVENT_SUBSCRIBERS,
                agentgate::limits::MAX_TURN_EVENTS
            ),
        )?;
        check(
            self.wake_rounds <= limits::MAX_WAKE_ROUNDS,
            format!("wake rounds must be at most {}", limits::MAX_WAKE_ROUNDS),
        )
    }
}
