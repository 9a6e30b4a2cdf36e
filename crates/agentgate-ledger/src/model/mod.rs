//! The [`Model`] trait: the tool-calling protocol between the agent loop and
//! a language model, shaped like OpenAI's chat completions (the lingua franca
//! of tool calling) so both implementations speak it the same way.
//!
//! A round: the agent sends the conversation so far and the tools; the model
//! answers with text and/or tool calls; the agent runs the calls, appends one
//! `tool` message per call, and asks again. On the last round the model is
//! told tools are off (`allow_tools: false`) and must answer in text.
//!
//! - [`OfflineModel`] (`offline`, `parse`): built in, deterministic, no network.
//! - [`OpenAiModel`] (`openai`): any OpenAI-compatible endpoint.

mod offline;
mod openai;
mod parse;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::tools::ToolSpec;

pub use offline::OfflineModel;
pub use openai::{OpenAiConfig, OpenAiModel, API_KEY_ENV};
pub use parse::{parse_message, ParsedEntry};

/// One message of the conversation a model sees.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum Message {
    /// Instructions.
    System {
        /// The instructions.
        content: String,
    },
    /// What the person wrote.
    User {
        /// The text.
        content: String,
    },
    /// What the model answered in an earlier round.
    Assistant {
        /// Its text (may be empty when it only called tools).
        content: String,
        /// Its tool calls.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCallRequest>,
    },
    /// A tool's answer to one call.
    Tool {
        /// The call it answers.
        tool_call_id: String,
        /// The tool's name.
        name: String,
        /// The result as JSON text.
        content: String,
    },
}

/// A tool call the model asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCallRequest {
    /// The model's id for the call; the tool message answering it repeats it.
    pub id: String,
    /// The tool.
    pub name: String,
    /// The arguments (a JSON string the model sent that does not parse is
    /// kept as a string, and validation tells the model so).
    pub arguments: Value,
}

/// One round's question to the model.
#[derive(Clone, Copy, Debug)]
pub struct ModelRequest<'a> {
    /// The conversation so far, oldest first.
    pub messages: &'a [Message],
    /// The tools it may call.
    pub tools: &'a [ToolSpec],
    /// `false` on the last round: answer in text, call nothing.
    pub allow_tools: bool,
}

/// One round's answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelReply {
    /// Text for the person (may be empty when it calls tools).
    pub text: String,
    /// The tools to call, in order.
    #[serde(default)]
    pub tool_calls: Vec<ToolCallRequest>,
}

/// Receives the model's text as it is produced.
pub type DeltaSink<'a> = &'a (dyn Fn(&str) + Send + Sync);

/// Why a model round failed (after the model's own retries).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// No answer within the request timeout.
    #[error("model request timed out after {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The endpoint answered with an error status.
    #[error("model endpoint answered {status}: {body}")]
    Status {
        /// HTTP status.
        status: u16,
        /// The start of its body.
        body: String,
    },
    /// The endpoint could not be reached.
    #[error("model endpoint unreachable: {0}")]
    Transport(String),
    /// The endpoint answered something that is not a chat completion.
    #[error("model response malformed: {0}")]
    Protocol(String),
    /// The model is not set up correctly (bad URL, header).
    #[error("model misconfigured: {0}")]
    Config(String),
    /// The turn was cancelled while the model was thinking.
    #[error("model round cancelled")]
    Cancelled,
}

/// A language model that speaks the tool-calling protocol.
#[async_trait]
pub trait Model: Send + Sync + std::fmt::Debug {
    /// A short name for logs and the dashboard (`offline`, `gpt-4o-mini`).
    fn name(&self) -> &str;

    /// Answers one round, streaming its text to `deltas` as it goes.
    ///
    /// # Errors
    /// A [`ModelError`] when the round could not be answered.
    async fn complete(
        &self,
        request: ModelRequest<'_>,
        deltas: DeltaSink<'_>,
    ) -> Result<ModelReply, ModelError>;
}
