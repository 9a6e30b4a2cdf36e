//! agentgate-ledger: the reference app of docs/protocol.md §11 — a ledger agent that books
//! expenses and income from plain language ("中午吃粉花了 35", "taxi 18
//! yesterday") on top of the agentgate engine, in-process, on the engine's
//! own store.
//!
//! What it shows: a double-click, a second tab or a retry never books twice;
//! a ledger entry commits in the same SQL transaction as its tool execution's
//! success mark; a large entry waits for a person's confirmation; a crashed
//! or cancelled turn is retried without paying the model or booking again.
//!
//! Modules:
//! - [`app`]: [`LedgerApp`], the facade a server calls: open, start a message
//!   or a confirmation turn, run it with an event stream, and the UI queries.
//! - `agent`: the agent loop (at most [`limits::MAX_MODEL_ROUNDS`] model
//!   rounds per turn), tool dispatch, confirmation turns.
//! - [`model`]: the [`model::Model`] trait and the tool-calling protocol, the
//!   built-in deterministic [`model::OfflineModel`] and the OpenAI-compatible
//!   [`model::OpenAiModel`].
//! - [`tools`]: the two tools' JSON schemas and argument validation (pure).
//! - [`category`]: the default categories, their synonyms and category
//!   resolution (pure).
//! - [`money`], [`date`]: amounts in integer cents and calendar dates (pure).
//! - [`events`]: [`events::AgentEvent`], what a running turn streams.
//! - [`records`]: the ledger's records and views (entries, replies,
//!   transcripts, totals).
//! - `db`: the app's own tables (categories, entries, chat messages), one SQL
//!   dialect per store kind, and the same-transaction entry insert.
//! - [`config`], [`limits`], [`error`]: settings, named limits, the error type.
//!
//! Architecture invariant: the only writes to the ledger's entries happen
//! inside `Execution::complete_in_tx`, so an entry exists if and only if its
//! `create_transaction` tool execution succeeded. The `UNIQUE` idempotency key
//! on entries is a second line of defence, not the mechanism.
//!
//! Architecture invariant: no HTTP here. The server crate mounts [`LedgerApp`]
//! behind its routes and forwards [`events::AgentEvent`]s as SSE.
#![forbid(unsafe_code)]

mod agent;
pub mod app;
pub mod category;
pub mod config;
pub mod date;
mod db;
pub mod error;
pub mod events;
pub mod limits;
pub mod model;
pub mod money;
pub mod records;
pub mod tools;

pub use app::{
    ConfirmRequest, Handoff, LedgerApp, QueuedMessage, RunningTurn, Started, UserMessage,
};
pub use config::LedgerConfig;
pub use error::{LedgerError, Result};
pub use events::{event_channel, AgentEvent, EventSender};
pub use model::{Model, OfflineModel, OpenAiConfig, OpenAiModel};
pub use records::{
    CategoryTotal, ChatOutcome, Entry, EntryType, NewEntry, Reply, SessionSummary, Totals,
    TranscriptTurn,
};
