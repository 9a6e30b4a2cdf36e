//! The closed loop every measurement runs: N clients, each on its own
//! session and user, running whole turns back to back until a deadline.
//!
//! A [`TurnLoop`] is one way of running a turn of four steps (the engine
//! through the library, the engine over HTTP, the raw baseline); this module
//! runs any of them concurrently ([`drive`]) or one after another
//! ([`drive_sequential`], for counting), and keeps per-step latencies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::{BenchError, Result};
use crate::stats::Samples;

/// Steps per turn: begin, tool claim, tool completion, ending (or, for the
/// raw baseline, lease acquire, tool insert, tool update, lease release).
pub(crate) const STEPS: usize = 4;

/// Request ids are unique in the whole process, so no two loops on the same
/// store and session ever reuse one (a reuse would replay instead of start).
static NEXT_REQUEST: AtomicU64 = AtomicU64::new(1);

/// A fresh request number.
pub(crate) fn next_request() -> u64 {
    NEXT_REQUEST.fetch_add(1, Ordering::Relaxed)
}

/// The session of client `client`: one conversation per client, reused by
/// every turn it runs, as a chat client would.
pub(crate) fn session_of(client: usize) -> String {
    format!("bench-s{client}")
}

/// The user of client `client`: one per client, so the per-user cap never
/// throttles the loop and every begin still counts the user's permits.
pub(crate) fn user_of(client: usize) -> String {
    format!("bench-u{client}")
}

/// One way of running a whole turn.
#[async_trait]
pub(crate) trait TurnLoop: Send + Sync {
    /// Runs one turn as `client` and records each step's latency.
    ///
    /// # Errors
    /// Anything but success at any step.
    async fn turn(&self, client: usize, timings: &mut [Duration; STEPS]) -> Result<()>;
}

/// What a loop did in one measured slice.
#[derive(Debug, Default)]
pub(crate) struct Sample {
    /// Turns completed.
    pub turns: u64,
    /// From the start until the last client finished its last turn.
    pub elapsed: Duration,
    /// Per-step latencies.
    pub steps: [Samples; STEPS],
}

impl Sample {
    /// Adds another slice of the same loop.
    pub(crate) fn merge(&mut self, other: Sample) {
        self.turns += other.turns;
        self.elapsed += other.elapsed;
        for (mine, theirs) in self.steps.iter_mut().zip(other.steps) {
            mine.extend(theirs);
        }
    }

    /// Completed turns per second.
    pub(crate) fn turns_per_s(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            self.turns as f64 / seconds
        } else {
            0.0
        }
    }
}

/// Runs `clients` clients of `turns` until `duration` has passed; each
/// finishes the turn it is in. The first failure stops every client.
///
/// # Errors
/// The first failed turn.
pub(crate) async fn drive(
    turns: Arc<dyn TurnLoop>,
    clients: usize,
    duration: Duration,
) -> Result<Sample> {
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = JoinSet::new();
    for client in 0..clients {
        let turns = Arc::clone(&turns);
        tasks.spawn(async move {
            let mut sample = Sample::default();
            while Instant::now() < deadline {
                let mut timings = [Duration::ZERO; STEPS];
                turns.turn(client, &mut timings).await?;
                sample.turns += 1;
                for (samples, timing) in sample.steps.iter_mut().zip(timings) {
                    samples.push(timing);
                }
            }
            Ok::<_, BenchError>(sample)
        });
    }
    let mut total = Sample::default();
    while let Some(joined) = tasks.join_next().await {
        let sample =
            joined.map_err(|e| BenchError::unexpected(format!("a client task failed: {e}")))??;
        total.merge(sample);
    }
    total.elapsed = started.elapsed();
    Ok(total)
}

/// Runs `count` turns one after another as client 0.
///
/// # Errors
/// The first failed turn.
pub(crate) async fn drive_sequential(turns: &dyn TurnLoop, count: u32) -> Result<Sample> {
    let started = Instant::now();
    let mut sample = Sample::default();
    for _ in 0..count {
        let mut timings = [Duration::ZERO; STEPS];
        turns.turn(0, &mut timings).await?;
        sample.turns += 1;
        for (samples, timing) in sample.steps.iter_mut().zip(timings) {
            samples.push(timing);
        }
    }
    sample.elapsed = started.elapsed();
    Ok(sample)
}

/// Times one step: runs `step`, stores its duration in `slot`.
pub(crate) async fn timed<T, F>(slot: &mut Duration, step: F) -> T
where
    F: std::future::Future<Output = T>,
{
    let started = Instant::now();
    let value = step.await;
    *slot = started.elapsed();
    value
}
