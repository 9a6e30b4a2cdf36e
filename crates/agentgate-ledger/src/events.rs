//! [`AgentEvent`]: what a running turn streams to its caller (the SSE layer
//! forwards each as one event named by its `type`).
//!
//! Events are best effort: the durable outcome is the turn's record and the
//! transcript, so a reader that went away (or reloads) loses nothing but the
//! live view. The channel holds a whole turn's events, so the turn never
//! waits for a slow reader.

use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::limits::EVENT_BUFFER;
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
