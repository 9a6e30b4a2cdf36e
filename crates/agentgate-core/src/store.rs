//! The [`Store`] trait: the atomic steps of the turn protocol.
//!
//! Each method is one atomic step in the backend (one SQL transaction, or one
//! Redis script plus one SQL transaction). Every method after `begin` is
//! conditioned on the caller's lease token and fence; a caller whose lease is
//! gone gets `lease_lost` and changes nothing. Expiry is judged on the store's
//! clock only.
//!
//! Architecture invariant: a store applies [`crate::decide`]'s decisions; it
//! does not make protocol decisions of its own.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;

use async_trait::async_trait;
use serde_json::Value;

use crate::canonical::CanonicalJson;
use crate::config::Config;
use crate::error::{BoxError, Result};
use crate::ids::{ExecutionId, SessionId, TurnId, UserId};
use crate::model::{
    BeginCommand, BeginOutcome, Ending, ExecutionView, LeaseRef, Overview, SessionView,
    SweepReport, ToolCall, ToolClaim, TurnView, UserView,
};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A side effect that runs inside the SQL transaction that marks a tool
/// execution succeeded: both commit or neither does.
///
/// `connection` is the store's native connection with the transaction open
/// (`sqlx::SqliteConnection`, `sqlx::PgConnection`, `sqlx::MySqlConnection`),
/// passed as `Any` so this crate knows no driver; the `agentgate` library
/// wraps it in a typed enum. The returned value becomes the stored result.
pub trait SqlEffect: Send {
    /// Applies the effect on `connection`.
    fn apply<'a>(
        &'a mut self,
        connection: &'a mut (dyn Any + Send),
    ) -> BoxFuture<'a, std::result::Result<Value, BoxError>>;
}

/// How a tool execution completes.
pub enum Completion<'a> {
    /// With a result computed outside the store.
    Result(CanonicalJson),
    /// With a side effect run in the same SQL transaction as the success mark.
    Effect(&'a mut dyn SqlEffect),
}

/// Lease state after a heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseStatus {
    /// Remaining lease on the store's clock.
    pub lease_expires_in_ms: i64,
}

/// A backend that keeps agentgate's records and leases.
#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// The settings this store was opened with.
    fn config(&self) -> &Config;

    /// Begins a turn: SPEC §4's table, atomically.
    ///
    /// # Errors
    /// `payload_mismatch`, `request_in_flight`, `awaiting_confirmation`,
    /// `session_busy`, `user_at_capacity`, `not_found` (another user's
    /// session, or no such pending confirmation), `store_unavailable`.
    async fn begin(&self, command: &BeginCommand) -> Result<BeginOutcome>;

    /// Renews the session lease, the permit and the turn together.
    ///
    /// # Errors
    /// `lease_lost`, `not_found`, `store_unavailable`.
    async fn heartbeat(&self, lease: &LeaseRef) -> Result<LeaseStatus>;

    /// Claims a tool execution for the lease holder.
    ///
    /// # Errors
    /// `lease_lost`, `tool_in_flight`, `attempts_exhausted`, `not_found`,
    /// `store_unavailable`.
    async fn claim_tool(&self, lease: &LeaseRef, call: &ToolCall) -> Result<ToolClaim>;

    /// Marks a claimed execution succeeded, running `completion`'s effect in
    /// the same transaction when given. Returns the stored result.
    ///
    /// # Errors
    /// `lease_lost` (also when the execution was re-claimed by a newer lease
    /// or is not running), `not_found`, `effect_failed` (rolled back),
    /// `invalid_request` (result over limits), `store_unavailable`.
    async fn complete_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        completion: Completion<'_>,
    ) -> Result<Value>;

    /// Marks a claimed execution failed; the next claim executes it again.
    ///
    /// # Errors
    /// As [`Store::complete_tool`].
    async fn fail_tool(
        &self,
        lease: &LeaseRef,
        execution_id: &ExecutionId,
        error: &CanonicalJson,
    ) -> Result<()>;

    /// Ends the turn and releases its session lease and permit atomically.
    ///
    /// # Errors
    /// `lease_lost`, `not_found`, `store_unavailable`.
    async fn end_turn(&self, lease: &LeaseRef, ending: &Ending) -> Result<TurnView>;

    /// A turn's view.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn turn(&self, turn_id: &TurnId) -> Result<Option<TurnView>>;

    /// A turn's tool executions, oldest first.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn executions(&self, turn_id: &TurnId) -> Result<Vec<ExecutionView>>;

    /// A session's view.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn session(&self, session_id: &SessionId) -> Result<Option<SessionView>>;

    /// A user's view: cap in force and live holders.
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn user(&self, user_id: &UserId) -> Result<UserView>;

    /// Sets (or with `None` clears) a user's cap override.
    ///
    /// # Errors
    /// `invalid_request` for a cap out of range, `store_unavailable`.
    async fn set_user_cap(&self, user_id: &UserId, cap: Option<u32>) -> Result<()>;

    /// Live leases and the latest turns and tool executions, at most `limit`
    /// of each (capped at [`crate::limits::MAX_OVERVIEW_ROWS`]).
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn overview(&self, limit: u32) -> Result<Overview>;

    /// Deletes up to `config().sweep_batch` records that ended more than
    /// `result_retention` ago (store clock).
    ///
    /// # Errors
    /// `store_unavailable`.
    async fn sweep(&self) -> Result<SweepReport>;
}
