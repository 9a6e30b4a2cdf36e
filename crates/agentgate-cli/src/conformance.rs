//! `agentgate conformance`: certify a user's own store with the suite every
//! built-in store passes (`agentgate_conformance`, linked into the shipping
//! binary on purpose).
//!
//! Each check runs on a fresh scratch store of the user's server
//! (`agentgate_conformance::scratch`), one after another, with a progress
//! line per check on stderr and a pass/fail table on stdout. The scratch
//! databases, Redis keys and temp dir are removed at the end: after a
//! failure too, and after Ctrl-C or SIGTERM (best effort; what is left is
//! named).
//!
//! Exit codes: 0 every check that could run passed, 1 a check failed,
//! 2 the run could not start (bad URL, unreachable server, missing
//! privilege), 130 interrupted by Ctrl-C.

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use agentgate_conformance::holder::Holder;
use agentgate_conformance::registry::{Check, CHECKS};
use agentgate_conformance::run::{run_check, Outcome, Status};
use agentgate_conformance::scratch::Scratch;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// Exit code: a check failed.
const EXIT_FAILED: u8 = 1;
/// Exit code: the run could not start.
const EXIT_CANNOT_START: u8 = 2;
/// Exit code: interrupted (128 + SIGINT).
const EXIT_INTERRUPTED: u8 = 130;

/// The flags of `agentgate conformance` (its help is on `Command::Conformance`).
#[derive(clap::Args)]
pub struct ConformanceArgs {
    /// The store to certify: a SQLite file or directory path
    /// (sqlite://... too), postgres://user@host/db or mysql://user@host/db.
    /// The database named in the URL is only used to connect.
    #[arg(long, required_unless_present = "list")]
    store: Option<String>,
    /// The Redis lease layer to certify with the store: redis://host:port/db
    /// (or rediss://).
    #[arg(long)]
    redis: Option<String>,
    /// Run only the checks whose name contains this; repeat for several.
    #[arg(long, value_name = "SUBSTRING")]
    only: Vec<String>,
    /// Keep the scratch databases, Redis keys and files, for a look after.
    #[arg(long)]
    keep: bool,
    /// Seconds a check may run before it counts as failed.
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    check_timeout: u64,
    /// List the checks with what each proves, and exit.
    #[arg(long)]
    list: bool,
}

/// SIGINT (Ctrl-C) and SIGTERM, listened for from the start of the run.
struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    fn listen() -> std::io::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Completes at the next signal.
    async fn next(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// One row of the table.
struct Row {
    check: &'static Check,
    outcome: Outcome,
}

/// Runs the command; the exit code says how it went.
pub async fn run(args: ConformanceArgs) -> ExitCode {
    let selected: Vec<&'static Check> = CHECKS
        .iter()
        .filter(|check| args.only.is_empty() || args.only.iter().any(|o| check.name.contains(o)))
        .collect();
    if args.list {
        let width = name_width(&selected);
        for check in &selected {
            println!("{:<width$}  {}", check.name, check.description);
        }
        return ExitCode::SUCCESS;
    }
    if selected.is_empty() {
        return cannot_start(&format!(
            "no check name contains {:?} (see agentgate conformance --list)",
            args.only
        ));
    }
    let Some(store) = args.store.as_deref() else {
        return cannot_start("--store is required");
    };
    let holder = match std::env::current_exe() {
        Ok(exe) => Holder::new(exe)
            .with_args(["hold"])
            .with_env("RUST_LOG", "off"),
        Err(error) => return cannot_start(&format!("cannot find this executable: {error}")),
    };
    let scratch = match Scratch::open(store, args.redis.as_deref()).await {
        Ok(scratch) => scratch,
        Err(error) => return cannot_start(&error),
    };
    eprintln!(
        "agentgate conformance: {} check{} on {}: {}",
        selected.len(),
        if selected.len() == 1 { "" } else { "s" },
        scratch.backend(),
        scratch.describe()
    );

    let limit = Duration::from_secs(args.check_timeout);
    let started = Instant::now();
    let mut rows = Vec::with_capacity(selected.len());
    let mut interrupted = false;
    // Listen from the start, so a Ctrl-C between two checks is seen too.
    let mut signals = match Signals::listen() {
        Ok(signals) => signals,
        Err(error) => return cannot_start(&format!("cannot listen for Ctrl-C: {error}")),
    };
    let digits = selected.len().to_string().len();
    for (index, check) in selected.iter().enumerate() {
        eprint!(
            "[{:>digits$}/{}] {} … ",
            index + 1,
            selected.len(),
            check.name
        );
        let _ = std::io::stderr().flush();
        let outcome = run_one(&scratch, check, &holder, limit, args.keep, signals.next()).await;
        eprintln!("{}", progress(&outcome));
        if outcome.status == Status::Interrupted {
            interrupted = true;
            break;
        }
        rows.push(Row { check, outcome });
    }
    let elapsed = started.elapsed();

    let left = if args.keep {
        let kept = scratch.keep();
        eprintln!("kept (--keep): {}", kept.join(", "));
        Vec::new()
    } else {
        tokio::select! {
            left = scratch.cleanup() => left,
            () = signals.next() => {
                vec![format!(
                    "cleanup interrupted: some of {} may be left",
                    scratch.keep().join(", ")
                )]
            }
        }
    };
    for item in &left {
        eprintln!("agentgate conformance: could not remove {item}; remove it by hand");
    }

    print!("{}", table(&rows, scratch.backend(), elapsed, interrupted));
    let failed = rows
        .iter()
        .any(|row| matches!(row.outcome.status, Status::Failed(_)));
    if interrupted {
        ExitCode::from(EXIT_INTERRUPTED)
    } else if failed {
        ExitCode::from(EXIT_FAILED)
    } else {
        ExitCode::SUCCESS
    }
}

/// Runs one check on a fresh scratch store, or skips it when the store
/// cannot serve it, and drops its scratch database after.
async fn run_one(
    scratch: &Scratch,
    check: &'static Check,
    holder: &Holder,
    limit: Duration,
    keep: bool,
    interrupt: impl std::future::Future<Output = ()>,
) -> Outcome {
    if !check
        .needs
        .met(scratch.has_redis(), scratch.has_server_clock())
    {
        return Outcome {
            status: Status::Skipped(check.needs.unmet_reason().to_owned()),
            elapsed: Duration::ZERO,
            counts: None,
        };
    }
    let target = match scratch.target().await {
        Ok(target) => target,
        Err(error) => {
            return Outcome {
                status: Status::Failed(format!("could not make its scratch store: {error}")),
                elapsed: Duration::ZERO,
                counts: None,
            }
        }
    };
    let store_url = target.store_url.clone();
    let outcome = run_check(check, target, holder.clone(), limit, interrupt).await;
    if !keep {
        if let Err(error) = scratch.release(&store_url).await {
            eprint!("(its scratch database stays until the end: {error}) ");
        }
    }
    outcome
}

/// The end of a progress line: `ok (1.2 s) counts...`.
fn progress(outcome: &Outcome) -> String {
    let seconds = outcome.elapsed.as_secs_f64();
    match &outcome.status {
        Status::Passed => match &outcome.counts {
            Some(counts) => format!("ok ({seconds:.1} s) {counts}"),
            None => format!("ok ({seconds:.1} s)"),
        },
        Status::Failed(message) => {
            let first = message.lines().next().unwrap_or_default();
            format!("FAILED ({seconds:.1} s) {first}")
        }
        Status::Skipped(reason) => format!("skipped: {reason}"),
        Status::Interrupted => "interrupted".to_owned(),
    }
}

fn name_width(checks: &[&Check]) -> usize {
    checks
        .iter()
        .map(|c| c.name.len())
        .max()
        .unwrap_or(0)
        .max("CHECK".len())
}

/// The pass/fail table, failure messages under their rows, and a summary.
fn table(rows: &[Row], backend: &str, elapsed: Duration, interrupted: bool) -> String {
    let checks: Vec<&Check> = rows.iter().map(|row| row.check).collect();
    let width = name_width(&checks);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<width$}  {:<7}  {:>8}  DETAIL",
        "CHECK", "RESULT", "TIME"
    );
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for row in rows {
        let time = format!("{:.1} s", row.outcome.elapsed.as_secs_f64());
        let (result, detail, time) = match &row.outcome.status {
            Status::Passed => {
                passed += 1;
                ("ok", row.outcome.counts.clone().unwrap_or_default(), time)
            }
            Status::Failed(_) => {
                failed += 1;
                ("FAILED", String::new(), time)
            }
            Status::Skipped(reason) => {
                skipped += 1;
                ("skipped", reason.clone(), "-".to_owned())
            }
            Status::Interrupted => ("stopped", String::new(), time),
        };
        let _ = writeln!(
            out,
            "{:<width$}  {result:<7}  {time:>8}  {detail}",
            row.check.name
        );
        if let Status::Failed(message) = &row.outcome.status {
            for line in message.lines() {
                let _ = writeln!(out, "    {line}");
            }
        }
    }
    let _ = writeln!(
        out,
        "{backend}: {passed} passed, {failed} failed, {skipped} skipped of {} checks in {:.1} s{}",
        rows.len(),
        elapsed.as_secs_f64(),
        if interrupted { " (interrupted)" } else { "" }
    );
    out
}

/// Prints why the run could not start; exit code 2.
fn cannot_start(why: &str) -> ExitCode {
    eprintln!("agentgate conformance: cannot start: {why}");
    ExitCode::from(EXIT_CANNOT_START)
}
