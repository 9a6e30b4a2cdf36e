//! Runs one check of the registry outside the test harness, for `agentgate
//! conformance`, on a thread and runtime of its own: a panic inside the
//! check (its own assertion, or a task it spawned) becomes a failed outcome
//! with the panic's message and place, a skip (`faketime` absent) a skipped
//! one, and a check that does not finish in time a failed one. The counts the check reports are captured for the
//! table instead of printed.
//!
//! One check runs at a time: the capture is process-wide.

use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use crate::holder::Holder;
use crate::registry::Check;
use crate::Target;

/// How one check ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// The check completed: every assertion held.
    Passed,
    /// The check panicked or timed out; the message says where and why.
    Failed(String),
    /// The check could not run here; the reason says why.
    Skipped(String),
    /// The run was interrupted (Ctrl-C) while the check ran.
    Interrupted,
}

/// One check's outcome.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// How it ended.
    pub status: Status,
    /// How long it ran (zero for a check skipped before it started).
    pub elapsed: Duration,
    /// The counts it reported (`key=value ...`), if it got that far.
    pub counts: Option<String>,
}

/// What the running check reported, panicked with, or skipped for.
#[derive(Default)]
struct Captured {
    counts: Option<String>,
    skips: Vec<String>,
    panic: Option<String>,
}

/// `Some` while a check runs under [`run_check`].
static CAPTURE: Mutex<Option<Captured>> = Mutex::new(None);

fn capture() -> MutexGuard<'static, Option<Captured>> {
    // A panic while holding this lock cannot leave the data inconsistent.
    CAPTURE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Hands a check's counts to the running [`run_check`]; `false` (print
/// them) when none runs.
pub(crate) fn captured_report(counts: &str) -> bool {
    match capture().as_mut() {
        Some(captured) => {
            captured.counts = Some(counts.to_owned());
            true
        }
        None => false,
    }
}

/// Hands a check's reason to skip to the running [`run_check`]; `false`
/// (print it) when none runs.
pub(crate) fn captured_skip(reason: &str) -> bool {
    match capture().as_mut() {
        Some(captured) => {
            captured.skips.push(reason.to_owned());
            true
        }
        None => false,
    }
}

/// Keeps the first panic of a running check (message and place) instead of
/// printing it; other panics go to the previous hook.
fn install_panic_hook() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let mut guard = capture();
            let Some(captured) = guard.as_mut() else {
                drop(guard);
                previous(info);
                return;
            };
            if captured.panic.is_none() {
                let message = panic_message(info.payload());
                captured.panic = Some(match info.location() {
                    Some(at) => format!("{message} (at {}:{})", at.file(), at.line()),
                    None => message,
                });
            }
        }));
    });
}

/// A panic payload's message.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked with a non-string payload".to_owned())
}

/// Worker threads of a check's runtime: as the suite's `#[tokio::test]`s.
const WORKER_THREADS: usize = 4;

/// How long a stopped check (timed out, interrupted) has to wind down: its
/// future dropped (holder processes killed), its runtime shut down.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// How a check's thread ended.
enum Ended {
    /// The check's future completed.
    Completed,
    /// The check panicked (the hook captured where).
    Panicked(Box<dyn std::any::Any + Send>),
    /// The check was stopped before it completed.
    Stopped,
    /// No runtime could be built.
    NoRuntime(String),
}

/// Ends the capture even when the run is dropped half-way.
struct Capturing;

impl Drop for Capturing {
    fn drop(&mut self) {
        *capture() = None;
    }
}

/// Runs `check` on `target` for at most `limit`, or until `interrupt`
/// completes (then the outcome is [`Status::Interrupted`]).
///
/// The check runs on a thread with a multi-thread runtime of its own, as
/// under `#[tokio::test]`: a panic anywhere in it is caught, and stopping it
/// drops its future (killing any holder process it spawned, `kill_on_drop`)
/// and shuts its runtime down, ending every task it spawned.
pub async fn run_check(
    check: &Check,
    target: Target,
    holder: Holder,
    limit: Duration,
    interrupt: impl std::future::Future<Output = ()>,
) -> Outcome {
    install_panic_hook();
    *capture() = Some(Captured::default());
    let capturing = Capturing;
    let run = check.run;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (done, mut ended) = tokio::sync::oneshot::channel::<Ended>();
    let started = Instant::now();
    let thread = std::thread::Builder::new()
        .name(format!("check {}", check.name))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(WORKER_THREADS)
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    let _ = done.send(Ended::NoRuntime(error.to_string()));
                    return;
                }
            };
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                runtime.block_on(async {
                    tokio::select! {
                        () = run(&target, &holder) => Ended::Completed,
                        _ = stopped => Ended::Stopped,
                    }
                })
            }));
            runtime.shutdown_timeout(STOP_GRACE);
            let _ = done.send(result.unwrap_or_else(Ended::Panicked));
        });
    if let Err(error) = thread {
        return Outcome {
            status: Status::Failed(format!("could not start its thread: {error}")),
            elapsed: Duration::ZERO,
            counts: None,
        };
    }
    let mut interrupted = false;
    let finished = tokio::select! {
        ended = &mut ended => Some(ended.ok()),
        () = tokio::time::sleep(limit) => None,
        () = interrupt => {
            interrupted = true;
            None
        }
    };
    let elapsed = started.elapsed();
    let finished = match finished {
        Some(ended) => ended,
        None => {
            drop(stop);
            tokio::time::timeout(STOP_GRACE * 2, ended)
                .await
                .ok()
                .and_then(Result::ok)
        }
    };
    let captured = capture().take().unwrap_or_default();
    drop(capturing);
    let status = if interrupted {
        Status::Interrupted
    } else {
        match finished {
            Some(Ended::Completed) if captured.skips.is_empty() => Status::Passed,
            Some(Ended::Completed) => Status::Skipped(captured.skips.join("; ")),
            Some(Ended::Panicked(payload)) => {
                Status::Failed(captured.panic.unwrap_or_else(|| panic_message(&*payload)))
            }
            Some(Ended::NoRuntime(error)) => {
                Status::Failed(format!("could not build its runtime: {error}"))
            }
            Some(Ended::Stopped) | None => Status::Failed(format!(
                "did not finish within {} s{}",
                limit.as_secs(),
                captured
                    .panic
                    .map(|p| format!(" (a task of it panicked: {p})"))
                    .unwrap_or_default()
            )),
        }
    };
    Outcome {
        status,
        elapsed,
        counts: captured.counts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{CheckFuture, Needs};

    fn fails<'a>(_: &'a Target, _: &'a Holder) -> CheckFuture<'a> {
        Box::pin(async {
            let numbers = [1, 2];
            assert_eq!(numbers[0], 2, "one is not two");
        })
    }

    fn passes<'a>(target: &'a Target, _: &'a Holder) -> CheckFuture<'a> {
        Box::pin(async move {
            crate::checks::report(target, "passes", &[("seen".to_owned(), 3)].into());
        })
    }

    fn sleeps<'a>(_: &'a Target, _: &'a Holder) -> CheckFuture<'a> {
        Box::pin(tokio::time::sleep(Duration::from_secs(600)))
    }

    fn check(run: for<'a> fn(&'a Target, &'a Holder) -> CheckFuture<'a>) -> Check {
        Check {
            name: "test",
            description: "test",
            needs: Needs::Any,
            spawns_holder: false,
            run,
        }
    }

    fn target() -> Target {
        Target::new("test", "sqlite://unused".to_owned(), None)
    }

    // One test, since the capture is process-wide: runs do not overlap.
    #[tokio::test]
    async fn panics_become_failures_and_counts_are_captured() {
        let holder = Holder::new("unused");
        let never = std::future::pending::<()>;
        let failed = run_check(
            &check(fails),
            target(),
            holder.clone(),
            Duration::from_secs(5),
            never(),
        )
        .await;
        let Status::Failed(message) = failed.status else {
            panic!("a panic is a failure: {failed:?}");
        };
        assert!(message.contains("one is not two"), "{message}");
        assert!(message.contains("run.rs:"), "the place is kept: {message}");

        let passed = run_check(
            &check(passes),
            target(),
            holder.clone(),
            Duration::from_secs(5),
            never(),
        )
        .await;
        assert_eq!(passed.status, Status::Passed);
        assert_eq!(passed.counts.as_deref(), Some("seen=3"));
        assert!(capture().is_none(), "the capture ends with the run");

        let slow = run_check(
            &check(sleeps),
            target(),
            holder.clone(),
            Duration::from_millis(100),
            never(),
        )
        .await;
        assert!(
            matches!(&slow.status, Status::Failed(m) if m.contains("did not finish")),
            "{slow:?}"
        );

        let interrupted = run_check(
            &check(sleeps),
            target(),
            holder,
            Duration::from_secs(60),
            tokio::time::sleep(Duration::from_millis(100)),
        )
        .await;
        assert_eq!(interrupted.status, Status::Interrupted);
        assert!(interrupted.elapsed < Duration::from_secs(10));
    }
}
