//! agentgate-core: what agentgate *means*, with no I/O.
//!
//! - [`ids`]: validated identifiers (user, session, client request, turn,
//!   execution) and the secret [`ids::LeaseToken`].
//! - [`limits`]: every named limit, with the reason for its number.
//! - [`canonical`]: RFC 8785 canonical JSON, payload fingerprints, args hashes.
//! - [`config`]: the engine's settings (TTL, caps, retention) and their ranges.
//! - [`model`]: the records a store keeps (turn, session, tool execution) and
//!   the views the engine hands out.
//! - [`decide`]: the pure decision logic of the turn protocol (docs/protocol.md §3): given
//!   what the store read, what happens. Every store applies these decisions.
//! - [`store`]: the [`store::Store`] trait every backend implements.
//! - [`lease`]: the [`lease::LeaseLayer`] trait for leases kept outside SQL
//!   (Redis), with fencing still enforced by the SQL store.
//! - [`retry`]: the bounded retry schedule after a transient store conflict.
//! - [`plant`]: planted bugs behind a test-only switch, to prove the suite catches them.
//! - [`error`]: the one error enum of the engine boundary and its [`error::ErrorKind`].
//!
//! Architecture invariant: nothing here opens a socket, a file or reads a
//! clock. Time enters as store-clock milliseconds passed in by a store.
#![forbid(unsafe_code)]

pub mod canonical;
pub mod config;
pub mod dburl;
pub mod decide;
pub mod error;
pub mod ids;
pub mod lease;
pub mod limits;
pub mod model;
pub mod page;
pub mod plant;
pub mod retry;
pub mod store;

pub use error::{Error, ErrorKind, Result};
