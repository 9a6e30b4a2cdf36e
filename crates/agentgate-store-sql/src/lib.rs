//! The SQL stores' shared steps: what a protocol step does, written once; a
//! store (PostgreSQL, MySQL/MariaDB) supplies its SQL, its locking and its
//! error mapping through a small trait per step.
//!
//! - [`admin`]: a bounded administrative connection to a server.
//! - [`heartbeat`]: a lease's renewal, in the rows or in the lease layer,
//!   over the dialect's [`heartbeat::HeartbeatSql`].
//! - [`lease`]: the caller's lease checked inside a step's transaction,
//!   in the rows or against the lease layer, over the dialect's
//!   [`lease::LeaseSql`].
//! - [`migrate`]: schema migrations applied the same way on every store
//!   ([`apply_migrations!`]).
//! - [`orphans`]: listing orphans (asking the lease layer) and abandoning
//!   one, over the dialect's [`orphans::OrphanSql`].
//! - [`retry`]: the bounded re-run of a step after a transient conflict.
//! - [`begin`]: a begin's decision applied inside the store's transaction
//!   ([`begin::begin_in`]), over the dialect's [`begin::BeginSql`].
//!
//! - [`events`]: a turn's event log: the holder's fenced append, readers'
//!   pages.
//! - [`claim`]: a tool claim, the one-statement first claim and the full
//!   read-decide-write path, over the dialect's [`claim::ClaimSql`].
//! - [`rows`]: the columns every store selects, decoded into core snapshots
//!   and views through the dialect's [`rows::Columns`].
//! - [`store`]: the `Store` trait implemented once for every SQL store
//!   ([`impl_store!`]).
//! - `testing` (feature `testing`): throw-away databases for test suites.
//! - [`tls`]: the TLS rules of a store URL (modes, CA and client files).
//! - [`tool`]: a tool execution's ending (a result, a failure, an effect in
//!   the same transaction), over the dialect's [`tool::ToolEndingSql`].
//! - [`tx`]: a step's transaction that never goes back to the pool open
//!   (a `BEGIN` cut off mid-flight included).
//! - [`views`]: the read-only views and the sweeper's cutoffs, over the
//!   dialect's [`views::ViewSql`].
//! - [`wakeups`]: release notifications for waiting begins, in-process,
//!   fed by this handle's endings and releases (and, on PostgreSQL, by
//!   `LISTEN` from other nodes).
//!
//! Decisions stay in `agentgate_core::decide`; this crate sequences the
//! reads a decision needs and the writes it asks for, so every store makes
//! them in the same order.
#![forbid(unsafe_code)]

pub mod admin;
pub mod begin;
pub mod claim;
pub mod events;
pub mod heartbeat;
pub mod lease;
pub mod migrate;
pub mod orphans;
pub mod query;
pub mod retry;
pub mod rows;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod tool;
pub mod tx;
pub mod views;
pub mod wakeups;

pub use async_trait::async_trait;
pub use retry::Retry;

use agentgate_core::decide::CheckedLease;
use agentgate_core::error::Result;
use agentgate_core::model::LeaseRef;

/// A step's write transaction as a store opens it: the lease checked inside
/// it ([`lease::check_lease`]), the session's row locked where the store
/// locks rows (SQLite's transaction holds its single writer).
#[async_trait::async_trait]
pub trait StepTx: lease::LeaseSql {
    /// Opens a step's write transaction (its lock and idle timeouts set).
    ///
    /// # Errors
    /// The driver's, mapped.
    async fn transaction(&self) -> Result<Self::Tx>;

    /// Opens the transaction and checks the caller's lease in it, locking
    /// the session's row. A lease layer is asked first, before any lock is
    /// taken, so no lock is held across a layer call; the fence check on
    /// the rows still guards every write.
    ///
    /// # Errors
    /// As [`lease::check_lease`], or the driver's.
    async fn open(&self, lease: &LeaseRef) -> Result<(Self::Tx, CheckedLease)> {
        let authority = lease::Authority::ask(self.leases(), lease).await?;
        let mut tx = self.transaction().await?;
        match lease::check_lease(self, Self::conn(&mut tx), lease, &authority, true).await {
            Ok((checked, _)) => Ok((tx, checked)),
            Err(error) => {
                if tx::answered(&error) {
                    Self::abandon(tx);
                }
                Err(error)
            }
        }
    }
}
