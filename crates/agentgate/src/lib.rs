//! agentgate: concurrency control for AI-agent backends.
//!
//! Wrap every turn (one user message → an LLM loop → tool calls) in
//! [`Gate::begin`] and every side-effecting tool call in [`Turn::tool`], and
//! get, on the store you already run: one turn per conversation at a time, at
//! most N turns per user, replay of a retried request's stored answer, tool
//! side effects booked exactly once, and fenced takeover of a crashed worker's
//! conversation when its lease expires.
//!
//! ```no_run
//! # async fn demo() -> agentgate::Result<()> {
//! use agentgate::{Begun, Config, Gate, ToolStep};
//! use serde_json::json;
//!
//! let gate = Gate::open("sqlite://agentgate.db", Config::default()).await?;
//! match gate.begin("alice", "chat-1", "msg-1", &json!({"text": "taxi 18"})).await? {
//!     Begun::Replay(done) => println!("already answered: {:?}", done.response),
//!     // Only with `on_busy: enqueue`/`supersede` (`Gate::begin_on_busy`),
//!     // or a repeat of a message queued that way.
//!     Begun::Queued(queued) => println!("queued at position {}", queued.position),
//!     Begun::Started(turn) => {
//!         let args = json!({"amount": 18, "category": "transport"});
//!         let booked = match turn.tool("create_transaction", &args).await? {
//!             ToolStep::Cached(result) => result,
//!             ToolStep::Execute(execution) => execution.complete(&json!({"id": 7})).await?,
//!         };
//!         turn.succeed(&json!({"text": "booked", "entry": booked})).await?;
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! Modules:
//! - [`gate`]: [`Gate`], opening a store by URL, beginning turns, the sweeper.
//! - [`busy`]: a begin on a busy session under its policy (`reject`,
//!   `wait`, `interrupt`).
//! - [`turn`]: the [`Turn`] guard, its watchdog and cancellation signal, tools
//!   and endings.
//! - [`events`]: following a turn's event log ([`Gate::follow`]), one
//!   shared feed per followed turn on a node.
//! - [`to_end`]: [`RunToEnd`], every store step run to its end in a task
//!   of its own, whoever stops waiting for it, within a deadline.
//! - [`effect`]: [`SqlTx`], running a tool's side effect in the same SQL
//!   transaction as its success mark.
//!
//! The engine's terms, errors and limits are re-exported from
//! `agentgate_core`.
#![forbid(unsafe_code)]

pub mod busy;
pub mod effect;
pub mod events;
pub mod gate;
pub mod to_end;
pub mod turn;
mod watchdog;

pub use agentgate_core::config::Config;
pub use agentgate_core::error::{BoxError, Error, ErrorKind, Result};
pub use agentgate_core::ids::{
    ClientRequestId, ExecutionId, Fence, SessionId, ToolName, TurnId, UserId,
};
pub use agentgate_core::model::{
    BusyPolicy, ConfirmationContext, Decision, ExecutionView, JournalEntry, JournalOutcome, OnBusy,
    OrphanFilter, PreviousOutcome, SessionView, ToolState, TurnState, TurnView, UserView,
};
pub use agentgate_core::{canonical, limits, model, page, store};
pub use busy::BusyReport;
pub use effect::SqlTx;
pub use gate::{Begun, Gate, Recovered};
pub use to_end::RunToEnd;
pub use turn::{EndError, Execution, ToolPolicy, ToolStep, Turn, Verifier};
