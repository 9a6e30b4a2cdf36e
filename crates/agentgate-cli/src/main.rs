//! The `agentgate` binary. Thin by design: parse flags, set up logging,
//! call the library. One module per subcommand:
//!
//! - `serve`: the HTTP service of SPEC §5 (`agentgate_server`).
//! - `demo`: a printed scenario proving the invariants on a temp SQLite file.
//! - `hold` (hidden): holds a lease until killed; the demo's kill scenario.
//! - `bench`: turns/s against the store's raw limit (`agentgate_bench`).
#![forbid(unsafe_code)]

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
    Serve(serve::ServeArgs),
    /// Show the invariants holding: a duplicate storm, a tool storm, and a
    /// takeover after a worker process is killed with SIGKILL.
    Demo,
    /// Hold a lease until killed (used by `demo`).
    #[command(hide = true)]
    Hold {
        /// <store_url> <redis_url or -> <user> <session> <request> <ttl_ms>
        args: Vec<String>,
    },
    /// Measure turns/s against the store's own raw limit, round trips per
    /// turn, a duplicate-begin storm, scaling and (--via http) memory.
    Bench(agentgate_bench::cli::BenchArgs),
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

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        // The bench's subscriber also counts sqlx statements.
        Command::Bench(_) => {
            agentgate_bench::cli::init_tracing(matches!(cli.log_format, LogFormat::Json))
        }
        _ => init_tracing(cli.log_format),
    }
    let result: Result<(), BoxError> = match cli.command {
        Command::Serve(args) => serve::run(args).await,
        Command::Demo => demo::run().await,
        Command::Hold { args } => agentgate_conformance::holder::hold_from_args(&args).await,
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
