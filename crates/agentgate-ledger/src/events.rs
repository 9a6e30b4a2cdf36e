//! [`AgentEvent`]: what a running turn streams to its caller (the SSE layer
//! forwards each as one event named by its `type`).
//!
//! Live events are best effort: the durable outcome is the turn's record
//! and the transcript. Everything before the ending is also teed into the
//! turn's event log in the engine (`tee`), so a reader that went away (a
//! reload, a second tab, another node) follows it again from the log. The
//! channels hold a whole turn's events, so the turn never waits for a slow
//! reader or a slow append (it waits for the log only at its ending).

use agentgate::Turn;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::limits::{EVENT_BUFFER, LOG_APPEND_PAUSE, LOG_APPEND_TRIES};
use crate::records::{ChatOutcome, NewEntry};

/// One step of a running turn.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum AgentEvent {
    /// The turn holds its lease and starts working.
    Started {
        /// The turn.
        turn_id: String,
        /// 1 for the first start, +1 per takeover or restart.
        attempt: u32,
        /// Whether this start took over a crashed holder's turn.
        takeover: bool,
    },
    /// A piece of the model's text.
    Delta {
        /// The text to append.
        text: String,
    },
    /// The model asked for a tool.
    ToolCall {
        /// The model's id for the call.
        call_id: String,
        /// The tool.
        name: String,
        /// Its arguments as the model sent them.
        args: Value,
    },
    /// A tool's answer, as fed back to the model.
    ToolResult {
        /// The model's id for the call.
        call_id: String,
        /// The tool.
        name: String,
        /// The result (`{"ok": true, ...}`) or error (`{"ok": false, "error": ...}`).
        result: Value,
        /// Whether it was returned from the engine's record of an earlier
        /// attempt instead of being run.
        cached: bool,
    },
    /// The turn ended waiting for the person to approve `pending`; the page
    /// shows an approve / reject card for it.
    AwaitingConfirmation {
        /// The turn a confirmation must name.
        turn_id: String,
        /// The entries waiting.
        pending: Vec<NewEntry>,
        /// The assistant's text.
        text: String,
    },
    /// The turn ended; this is its outcome.
    Final {
        /// The outcome, as a replay would return it.
        outcome: ChatOutcome,
    },
    /// The turn stopped with an error.
    Error {
        /// A stable code (`model_unavailable`, `cancelled`, `lease_lost`, …).
        code: String,
        /// For a person.
        message: String,
        /// Whether sending the same request again may succeed.
        retryable: bool,
    },
}

impl AgentEvent {
    /// The event's name (its `type`), as an SSE `event:` field.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Started { .. } => "started",
            Self::Delta { .. } => "delta",
            Self::ToolCall { .. } => "tool_call",
            Self::ToolResult { .. } => "tool_result",
            Self::AwaitingConfirmation { .. } => "awaiting_confirmation",
            Self::Final { .. } => "final",
            Self::Error { .. } => "error",
        }
    }
}

/// The sending half of a turn's event stream.
pub type EventSender = mpsc::Sender<AgentEvent>;

/// A channel sized for one turn's events.
pub fn event_channel() -> (EventSender, mpsc::Receiver<AgentEvent>) {
    mpsc::channel(EVENT_BUFFER)
}

/// Sends without waiting: a full or closed channel drops the event (see
/// the module docs for why that loses nothing durable).
pub(crate) fn emit(events: Option<&EventSender>, event: AgentEvent) {
    let Some(events) = events else { return };
    if let Err(mpsc::error::TrySendError::Full(event)) = events.try_send(event) {
        tracing::warn!(event = event.name(), "event channel full; event dropped");
    }
}

/// Tees a turn's events: each goes to `live` (the caller's stream, if any)
/// and into the turn's durable event log in the engine
/// ([`Turn::emit_all`]), where any reader on any node follows it and a
/// reader that dropped resumes with the last id it saw (the page after a
/// reload, a second tab, a page whose node died).
///
/// Returns the sender the turn's work emits to and the pump to run beside
/// that work. The pump forwards each event live at once and hands it to
/// its appender, which appends what gathered meanwhile in one step (one
/// store round trip per batch, not per delta): a slow append delays the
/// log, never the live stream. The pump ends when the sender is dropped
/// and everything is logged, so the turn ends after its log is complete
/// (an append after the ending would be refused). An append the store
/// could not take (`store_unavailable`) is tried again
/// [`LOG_APPEND_TRIES`] times in all; a refused one (the lease was lost,
/// so a zombie's events never appear; or the log's bound) stops the
/// logging, not the turn or its live stream.
pub(crate) fn tee<'a>(
    turn: &'a Turn,
    live: Option<&'a EventSender>,
) -> (EventSender, impl std::future::Future<Output = ()> + 'a) {
    let (sender, mut receiver) = event_channel();
    let (to_log, mut logged) = event_channel();
    let forward = async move {
        while let Some(event) = receiver.recv().await {
            emit(live, event.clone());
            // Bounded like the turn's own channel; full only if the log is
            // a whole turn behind, and then the work's own sends drop.
            if to_log.send(event).await.is_err() {
                break;
            }
        }
    };
    let append_all = async move {
        let mut logging = true;
        let mut batch = Vec::with_capacity(EVENT_BUFFER);
        while let Some(first) = logged.recv().await {
            batch.push(first);
            while batch.len() < EVENT_BUFFER {
                match logged.try_recv() {
                    Ok(event) => batch.push(event),
                    Err(_) => break,
                }
            }
            if logging {
                logging = append(turn, &batch).await;
            }
            batch.clear();
        }
    };
    let pump = async move {
        tokio::join!(forward, append_all);
    };
    (sender, pump)
}

/// Appends `batch` to the turn's log; false when the log refused it (or
/// the store stayed unavailable through every try).
async fn append(turn: &Turn, batch: &[AgentEvent]) -> bool {
    let encoded = match batch
        .iter()
        .map(|event| serde_json::to_value(event).map(|data| (event.name(), data)))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(encoded) => encoded,
        Err(error) => {
            tracing::error!(turn_id = %turn.id(), %error, "cannot encode an agent event; the turn's log stops here");
            return false;
        }
    };
    let refs: Vec<(&str, &Value)> = encoded.iter().map(|(name, data)| (*name, data)).collect();
    let mut pause = LOG_APPEND_PAUSE;
    for tries_left in (0..LOG_APPEND_TRIES).rev() {
        match turn.emit_all(&refs).await {
            Ok(_) => return true,
            Err(error)
                if error.kind() == agentgate::ErrorKind::StoreUnavailable && tries_left > 0 =>
            {
                tracing::debug!(turn_id = %turn.id(), %error, "the turn's event log is unavailable; trying again");
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            Err(error) => {
                tracing::warn!(turn_id = %turn.id(), %error, "the turn's event log refused an append; live events only from here");
                return false;
            }
        }
    }
    false
}
