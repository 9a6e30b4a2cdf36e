//! A begin on a busy session under its [`OnBusy`] policy: `reject` answers
//! at once, `wait` waits for the session to come free, `interrupt` asks the
//! holder to stop first; `enqueue` and `supersede` are one begin the store
//! answers by queueing the request. The decision after each attempt is
//! [`busy_step`]'s; this module only sleeps, watches and asks.
//!
//! A waiter takes a release watch before each attempt
//! ([`Store::watch_releases`]), so an ending between the attempt and the
//! wait wakes it, and it never waits longer than its poll
//! ([`agentgate_core::limits::MAX_BUSY_POLL`], jittered) without trying
//! again: a lease that merely expires, or a release on a node whose
//! notification does not reach this one, is found by the next attempt.
//! Every attempt is the store's one atomic begin, so any number of waiters
//! get at most one holder at a time, and the bound is checked before each
//! wait: a waiter starts or answers `session_busy` within its bound plus
//! one attempt.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use agentgate_core::decide::{
    busy_step, interruptible, session_policy, supersede_interrupts, BusyStep,
};
use agentgate_core::error::Result;
use agentgate_core::ids::{SessionId, TurnId};
use agentgate_core::model::{BeginCommand, BeginOutcome, OnBusy};
use tokio::time::Instant;

use crate::gate::Gate;

/// How a begin under a policy went, for metrics and logs.
#[derive(Clone, Debug, Default)]
pub struct BusyReport {
    /// Begin attempts made (1 when the session was free).
    pub attempts: u32,
    /// Waits a release notification cut short.
    pub woken: u32,
    /// Time spent waiting between attempts.
    pub waited: Duration,
    /// The holder this begin asked to stop (`interrupt`, or `supersede`
    /// with `interrupt`).
    pub interrupted: Option<TurnId>,
    /// The session's default policy this begin followed: it named none and
    /// found the session busy ([`begin_by_session`]).
    pub session_default: Option<OnBusy>,
}

/// A begin's outcome under its policy, and when its last attempt was sent
/// (a watchdog's local deadline counts from there).
pub(crate) struct BusyOutcome {
    pub outcome: BeginOutcome,
    pub report: BusyReport,
    pub requested_at: Instant,
}

/// Somewhere in the upper half of `poll`, so waiters woken together spread
/// out. The randomness is std's per-process hasher keys; nothing here needs
/// more than that.
fn jittered(poll: Duration) -> Duration {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0);
    let fraction = hasher.finish() % 1_000;
    let half = poll / 2;
    half + (poll - half).mul_f64(fraction as f64 / 1_000.0)
}

/// Begins `command` under `on_busy` (see the module docs).
///
/// # Errors
/// The last attempt's error: `session_busy` when the bound ran out, any
/// other begin error at once; `store_unavailable` from a cancel request.
pub(crate) async fn begin(
    gate: &Gate,
    command: &BeginCommand,
    on_busy: OnBusy,
) -> Result<BusyOutcome> {
    let store = gate.store();
    // `enqueue` and `supersede` are the store's: one begin that queues the
    // request when the session is busy (`decide_new`), and no waiting here.
    let queued;
    let command = match on_busy.policy.queue_mode() {
        Some(mode) => {
            queued = command.clone().queued(Some(mode));
            &queued
        }
        None => command,
    };
    let started = Instant::now();
    let mut report = BusyReport::default();
    // Counted in `Gate::waiting_begins` from its first wait until it
    // returns, its attempts between waits included.
    let mut counted = None;
    loop {
        let mut watch = store.watch_releases(&command.session_id);
        let requested_at = Instant::now();
        report.attempts += 1;
        let error = match store.begin(command).await {
            Ok(outcome) => {
                if let BeginOutcome::Queued(queued) = &outcome {
                    interrupt_for(
                        gate,
                        on_busy,
                        &queued.turn_id,
                        &command.session_id,
                        &mut report,
                    )
                    .await?;
                }
                return Ok(BusyOutcome {
                    outcome,
                    report,
                    requested_at,
                });
            }
            Err(error) => error,
        };
        let interrupted = report.interrupted.as_ref().map(TurnId::as_str);
        let poll = match busy_step(&error, on_busy, started.elapsed(), interrupted) {
            BusyStep::Refuse => return Err(error),
            BusyStep::Wait { poll } => poll,
            BusyStep::Interrupt { turn_id, poll } => {
                let turn_id = TurnId::new(turn_id)?;
                // The busy answer may name a queue's head, not a holder: a
                // queued message is never cancelled by an interrupt.
                let running = store
                    .turn(&turn_id)
                    .await?
                    .is_some_and(|view| interruptible(view.state));
                if running {
                    gate.request_cancel(&turn_id).await?;
                    tracing::info!(session_id = %command.session_id, %turn_id, "holder interrupted");
                    report.interrupted = Some(turn_id);
                }
                poll
            }
        };
        let waiting = Instant::now();
        counted.get_or_insert_with(|| gate.waiting_guard());
        if watch.wait(jittered(poll)).await {
            report.woken += 1;
        }
        report.waited += waiting.elapsed();
    }
}

/// `supersede` with `interrupt`, once its request is queued as
/// `queued_turn_id`: asks the session's running holder to stop, unless it
/// is the queued turn itself ([`supersede_interrupts`]). A repeat of the
/// request asks again, which changes nothing (a cancel request is
/// recorded once).
async fn interrupt_for(
    gate: &Gate,
    on_busy: OnBusy,
    queued_turn_id: &TurnId,
    session_id: &SessionId,
    report: &mut BusyReport,
) -> Result<()> {
    if !on_busy.interrupt {
        return Ok(());
    }
    let store = gate.store();
    let Some(holder) = store
        .session(session_id)
        .await?
        .and_then(|view| view.holder)
    else {
        return Ok(());
    };
    let Some(view) = store.turn(&holder.turn_id).await? else {
        return Ok(());
    };
    let holder_state = Some((view.turn_id.as_str(), view.state));
    if supersede_interrupts(on_busy, queued_turn_id.as_str(), holder_state) {
        gate.request_cancel(&view.turn_id).await?;
        tracing::info!(%session_id, turn_id = %view.turn_id, "holder interrupted by a superseding message");
        report.interrupted = Some(view.turn_id);
    }
    Ok(())
}

/// Begins `command`, which names no policy, under its session's default
/// ([`Store::set_session_policy`]): one plain begin; only when it finds
/// the session busy does this read the session's default and, when one
/// other than `reject` is set ([`session_policy`]), begin again under it.
///
/// # Errors
/// As [`begin`]; the first attempt's `session_busy` when no default applies.
pub(crate) async fn begin_by_session(gate: &Gate, command: &BeginCommand) -> Result<BusyOutcome> {
    let store = gate.store();
    let requested_at = Instant::now();
    let error = match store.begin(command).await {
        Ok(outcome) => {
            return Ok(BusyOutcome {
                outcome,
                report: BusyReport {
                    attempts: 1,
                    ..BusyReport::default()
                },
                requested_at,
            })
        }
        Err(error) => error,
    };
    let session_default = match &error {
        agentgate_core::error::Error::SessionBusy { .. } => store
            .session(&command.session_id)
            .await?
            .and_then(|view| view.default_on_busy),
        _ => None,
    };
    let Some(on_busy) = session_policy(&error, session_default) else {
        return Err(error);
    };
    let mut done = begin(gate, command, on_busy).await?;
    done.report.attempts += 1;
    done.report.session_default = Some(on_busy);
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_in_the_upper_half_of_the_poll() {
        for _ in 0..1_000 {
            let poll = Duration::from_millis(500);
            let jittered = jittered(poll);
            assert!(jittered >= poll / 2 && jittered <= poll, "{jittered:?}");
        }
    }
}
