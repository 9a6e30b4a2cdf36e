//! The `agentgate` binary. Thin by design: parse flags, set up logging,
//! call the library. One module per subcommand:
//!
//! - `serve`: the HTTP service of docs/protocol.md §10 (`agentgate_server`).
//! - `demo`: a printed scenario proving the invariants on a temp SQLite file.
//! - `conformance`: the conformance suite against the user's own store
//!   (`agentgate_conformance`, linked on purpose), in scratch databases it
//!   removes.
//! - `hold`: holds a lease until killed; the process the conformance suite's
//!   SIGKILL and clock-skew checks (and the demo) kill.
//! - `bench`: turns/s against the store's raw limit (`agentgate_bench`).
#![forbid(unsafe_code)]

mod conformance;
mod demo;
mod serve;

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;

/// What a subcommand fails with: printed once, then exit code 1.
type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// agentgate: concurrency control for AI-agent backends.
#[derive(Parser)]
#[command(name = "agentgate", version, about)]
struct Cli {
    /// Log format on stderr (filter with RUST_LOG, default `info`).
    #[arg(long, env = "AGENTGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP service: begin/heartbeat/tools/end turns over JSON.
    Serve(Box<serve::ServeArgs>),
    /// Show the invariants holding: a duplicate storm, a tool storm, and a
    /// takeover after a worker process is killed with SIGKILL.
    Demo,
    /// Certify a store: run the conformance suite against your own
    /// database (and Redis) in scratch databases it removes afterwards.
    ///
    /// Every check gets a fresh scratch store: a database
    /// `agentgate_conformance_<run>_<n>` on your PostgreSQL or MySQL server
    /// (the URL's user needs the privilege to create databases), or a file
    /// in a temp dir next to your SQLite path; with --redis, keys under
    /// `agentgate-conformance:<run>:`. All are removed at the end, on
    /// failure and Ctrl-C too. Progress goes to stderr, a pass/fail table to
    /// stdout. The SIGKILL and clock-skew checks start `agentgate hold` as
    /// the holder process they kill.
    ///
    /// Exit codes: 0 all passed, 1 a check failed, 2 could not start (bad
    /// URL, unreachable server, missing privilege), 130 interrupted.
    Conformance(conformance::ConformanceArgs),
    /// Hold a lease until killed: the holder process the conformance suite
    /// (and `demo`) starts and kills with SIGKILL.
    ///
    /// Begins a turn as USER on SESSION for REQUEST, claims a tool call,
    /// prints `HOLDING <turn_id> <fence>` on stdout, then keeps the lease
    /// (its watchdog renewing it) until the process is killed. `agentgate
    /// conformance` kills it with SIGKILL (and runs it a day ahead under
    /// faketime) to prove a dead holder's session is taken over after the
    /// lease's TTL, not before. Exits with an error if the lease is refused
    /// or lost.
    Hold(HoldArgs),
    /// Measure turns/s against the store's own raw limit, round trips per
    /// turn, a duplicate-begin storm, scaling and (--via http) memory.
    Bench(agentgate_bench::cli::BenchArgs),
}

/// The arguments of `agentgate hold` (its help is on `Command::Hold`).
#[derive(clap::Args)]
struct HoldArgs {
    /// The store: a SQLite path, postgres://... or mysql://...
    store_url: String,
    /// The Redis lease layer's URL, or `-` for none.
    redis_url: String,
    /// The user the turn belongs to.
    user: String,
    /// The session to hold.
    session: String,
    /// The client request id of the held turn.
    request: String,
    /// The lease's TTL in milliseconds.
    ttl_ms: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    // The PDF parser's child process (`agentgate serve` starts it per
    // upload): it limits its own memory and CPU, so it runs before any
    // runtime or thread exists.
    if std::env::args_os().nth(1).as_deref()
        == Some(std::ffi::OsStr::new(
            agentgate_ingest::isolate::PARSE_SUBCOMMAND,
        ))
    {
        return agentgate_ingest::isolate::child_main();
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a Tokio runtime")
        .block_on(run())
}

async fn run() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        // The bench's subscriber also counts sqlx statements.
        Command::Bench(_) => {
            agentgate_bench::cli::init_tracing(matches!(cli.log_format, LogFormat::Json))
        }
        // The checks provoke failures on purpose; their logs would bury the
        // progress lines. RUST_LOG still turns them on.
        Command::Conformance(_) => {
            if std::env::var_os("RUST_LOG").is_some() {
                init_tracing(cli.log_format);
            }
        }
        _ => init_tracing(cli.log_format),
    }
    let result: Result<(), BoxError> = match cli.command {
        Command::Serve(args) => serve::run(*args).await,
        Command::Demo => demo::run().await,
        Command::Conformance(args) => return conformance::run(args).await,
        Command::Hold(args) => {
            let redis_url = Some(args.redis_url.as_str()).filter(|url| *url != "-");
            agentgate_conformance::holder::hold(
                &args.store_url,
                redis_url,
                &args.user,
                &args.session,
                &args.request,
                std::time::Duration::from_millis(args.ttl_ms),
            )
            .await
        }
        Command::Bench(args) => agentgate_bench::cli::run(args).await.map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("agentgate: error: {error}");
            ExitCode::FAILURE
        }
    }
}
