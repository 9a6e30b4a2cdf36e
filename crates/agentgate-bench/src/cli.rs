//! `agentgate bench`: its flags, its tracing set-up (which carries the
//! statement counter), and printing the report. The `agentgate` binary only
//! dispatches here.

use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

use crate::error::{BenchError, Result};
use crate::{count, BenchOptions, Via};

/// Flags of `agentgate bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Store server or file: sqlite (a temp file; the default),
    /// sqlite://PATH (a new file, removed after), postgres://…/DB or
    /// mysql://…/DB (a server to connect to: the bench creates its own
    /// database `agentgate_bench_<random>` there and drops it after).
    #[arg(long)]
    store: Option<String>,
    /// Redis lease layer (redis://host:port/db); the bench uses its own key
    /// prefix and deletes its keys after.
    #[arg(long)]
    redis: Option<String>,
    /// How the turn loop reaches the engine.
    #[arg(long, value_enum, default_value_t = Via::Library)]
    via: Via,
    /// Concurrent clients, each on its own session and user.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Measured seconds per loop (engine, raw baseline, and HTTP on --via http).
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Alternating rounds the measured time is split into.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Finished sessions pre-populated before the main measurement.
    #[arg(long, default_value_t = 10_000)]
    sessions: u64,
    /// Sessions pre-populated for the scaling measurement (0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    scale_sessions: u64,
    /// Concurrent duplicate begins in the contention storm.
    #[arg(long, default_value_t = 1_000)]
    storm: usize,
    /// Turns held live at once for the memory figure (--via http; 0 skips it).
    #[arg(long, default_value_t = 10_000)]
    live_turns: usize,
    /// Sequential turns whose round trips are counted.
    #[arg(long, default_value_t = 200)]
    count_turns: u32,
    /// Documents of the ingestion row, per loop (0 skips it; no row on MySQL).
    #[arg(long, default_value_t = 20)]
    ingest_documents: usize,
    /// Rounds per mode of the wake row (a waiting begin after the holder
    /// ends, same node and another node; 0 skips it).
    #[arg(long, default_value_t = 20)]
    wake_rounds: usize,
    /// Messages per loop of the queue row (a conversation drained through
    /// enqueue and the endings' handoffs, against plain begins; 0 skips it;
    /// at most the session queue's bound, 100).
    #[arg(long, default_value_t = 100)]
    queue_messages: usize,
    /// Followers of one turn in the events row (each event's delivery to
    /// every follower, memory and store connections; 0 skips it).
    #[arg(long, default_value_t = 1_000)]
    event_subscribers: usize,
    /// Events the events row appends, one at a time.
    #[arg(long, default_value_t = 100)]
    event_count: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

impl BenchArgs {
    fn into_options(self) -> Result<BenchOptions> {
        if !self.duration.is_finite() || self.duration <= 0.0 {
            return Err(BenchError::Options("duration must be above 0".to_owned()));
        }
        let duration = Duration::try_from_secs_f64(self.duration)
            .map_err(|e| BenchError::Options(format!("duration: {e}")))?;
        Ok(BenchOptions {
            store: self.store,
            redis: self.redis,
            via: self.via,
            concurrency: self.concurrency,
            duration,
            rounds: self.rounds,
            sessions: self.sessions,
            scale_sessions: self.scale_sessions,
            storm: self.storm,
            live_turns: self.live_turns,
            count_turns: self.count_turns,
            ingest_documents: self.ingest_documents,
            wake_rounds: self.wake_rounds,
            queue_messages: self.queue_messages,
            event_subscribers: self.event_subscribers,
            event_count: self.event_count,
            // This very binary is `agentgate serve` for HTTP runs.
            server_binary: std::env::current_exe().ok(),
            progress: true,
        })
    }
}

/// Installs the global tracing subscriber of a bench: logs on stderr
/// (filter with `RUST_LOG`, default `warn`, so the engine's own logs do not
/// drown the progress bar) and the statement counter of [`count::layer`].
pub fn init_tracing(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let registry = tracing_subscriber::registry().with(count::layer());
    let installed = if json {
        registry.with(logs.json().with_filter(filter)).try_init()
    } else {
        registry.with(logs.with_filter(filter)).try_init()
    };
    if installed.is_ok() {
        count::mark_installed();
    }
}

/// Runs `agentgate bench` until done or Ctrl-C, and prints the report on
/// stdout.
///
/// # Errors
/// As [`crate::run()`]; `Io` when stdout cannot be written.
pub async fn run(args: BenchArgs) -> Result<()> {
    let json = args.json;
    let options = args.into_options()?;
    let interrupted = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let report = crate::run(&options, interrupted).await?;
    let text = if json {
        serde_json::to_string(&report)
            .map_err(|e| BenchError::unexpected(format!("cannot render the report: {e}")))?
    } else {
        report.to_text()
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}").map_err(|e| BenchError::io("cannot write stdout", e))?;
    stdout
        .flush()
        .map_err(|e| BenchError::io("cannot write stdout", e))
}
