//! The queue row (issue 13's `enqueue`): what one worker draining a
//! conversation through the queue costs, against the same messages run as
//! plain begins, in the same run, on the same store.
//!
//! Plain: `messages` turns on one session one after another, each a begin
//! and an ending (the session is free for every begin). Queued: a holder
//! starts, the same number of messages are enqueued behind it (each
//! enqueue's latency is sampled), and the holder's caller drains them:
//! each ending is followed by the handoff of the next (`Gate::take_next`).
//! The figures are turns per second of both loops and their ratio; a
//! handoff is a second begin on the free session, so the drain's turn
//! costs an ending, one read of the queue's head and a begin.

use std::time::Duration;

use agentgate::model::BeginCommand;
use agentgate::{
    Begun, BusyPolicy, ClientRequestId, Config, Gate, OnBusy, SessionId, Turn, UserId,
};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

use crate::error::{BenchError, Result};
use crate::stats::{Samples, StepLatency};
use crate::target::Target;

/// What the queue row measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct QueueRow {
    /// Messages per loop.
    pub messages: usize,
    /// Plain begin → succeed turns per second, one session, sequential.
    pub plain_turns_per_s: f64,
    /// Drained turns per second: ending → handoff → ending.
    pub drained_turns_per_s: f64,
    /// `drained_turns_per_s` ÷ `plain_turns_per_s`.
    pub ratio: f64,
    /// Latency of one `enqueue` behind the holder.
    pub enqueue: StepLatency,
}

fn options(what: &str) -> impl Fn(agentgate::Error) -> BenchError + '_ {
    move |e| BenchError::Options(format!("queue row, {what}: {e}"))
}

fn command(session: &str, request: &str) -> Result<BeginCommand> {
    let id = options("ids");
    BeginCommand::new(
        UserId::new("queue-user").map_err(&id)?,
        SessionId::new(session).map_err(&id)?,
        ClientRequestId::new(request).map_err(&id)?,
        &json!({"text": request}),
        None,
    )
    .map_err(&id)
}

fn started(begun: Begun, what: &str) -> Result<Turn> {
    match begun {
        Begun::Started(turn) => Ok(turn),
        other => Err(BenchError::Options(format!(
            "queue row: {what} did not start: {other:?}"
        ))),
    }
}

async fn succeed(turn: Turn) -> Result<()> {
    turn.succeed(&json!("ok")).await.map_err(|e| e.error)?;
    Ok(())
}

/// `messages` plain turns on one session; their wall time.
async fn plain(gate: &Gate, session: &str, messages: usize) -> Result<Duration> {
    let began = Instant::now();
    for n in 0..messages {
        let turn = started(
            gate.begin_command(&command(session, &format!("p{n}"))?)
                .await?,
            "a plain begin",
        )?;
        succeed(turn).await?;
    }
    Ok(began.elapsed())
}

/// A holder, `messages` enqueued behind it, then the drain; the enqueue
/// latencies and the drain's wall time.
async fn queued(gate: &Gate, session: &str, messages: usize) -> Result<(Samples, Duration)> {
    let holder = started(
        gate.begin_command(&command(session, "holder")?).await?,
        "the holder",
    )?;
    let on_busy = OnBusy::new(BusyPolicy::Enqueue, None).map_err(options("policy"))?;
    let mut enqueues = Samples::default();
    for n in 0..messages {
        let sent = Instant::now();
        let (begun, _) = gate
            .begin_on_busy(&command(session, &format!("q{n}"))?, on_busy)
            .await?;
        enqueues.push(sent.elapsed());
        if !matches!(begun, Begun::Queued(_)) {
            return Err(BenchError::Options(format!(
                "queue row: message {n} was not queued: {begun:?}"
            )));
        }
    }
    let session_id = SessionId::new(session).map_err(options("ids"))?;
    let began = Instant::now();
    succeed(holder).await?;
    let mut drained = 0;
    while let Some(next) = gate.take_next(&session_id).await? {
        succeed(next.turn).await?;
        drained += 1;
    }
    let took = began.elapsed();
    if drained != messages {
        return Err(BenchError::Options(format!(
            "queue row: drained {drained} of {messages} messages"
        )));
    }
    Ok((enqueues, took))
}

fn per_s(turns: usize, took: Duration) -> f64 {
    let secs = took.as_secs_f64();
    if secs > 0.0 {
        turns as f64 / secs
    } else {
        0.0
    }
}

/// Runs the row (`messages` per loop, at most the queue's bound; 0 skips it).
///
/// # Errors
/// Any failure of a begin, an enqueue, an ending or a handoff.
pub(crate) async fn measure(
    target: &Target,
    config: &Config,
    messages: usize,
) -> Result<Option<QueueRow>> {
    if messages == 0 {
        return Ok(None);
    }
    let gate = Gate::connect(
        &target.store_url,
        target.redis_url.as_deref(),
        config.clone(),
    )
    .await?;
    let plain_took = plain(&gate, "queue-plain", messages).await?;
    let (enqueues, drain_took) = queued(&gate, "queue-drain", messages).await?;
    let plain_turns_per_s = per_s(messages, plain_took);
    let drained_turns_per_s = per_s(messages, drain_took);
    Ok(Some(QueueRow {
        messages,
        plain_turns_per_s,
        drained_turns_per_s,
        ratio: if plain_turns_per_s > 0.0 {
            drained_turns_per_s / plain_turns_per_s
        } else {
            0.0
        },
        enqueue: enqueues.summary(),
    }))
}
