//! The handlers, one file per group of docs/protocol.md §10:
//!
//! - [`turns`]: begin (and confirmation), heartbeat, the three endings.
//! - [`tools`]: tool claim, completion, failure.
//! - [`events`]: a turn's event log: the holder's append, the SSE follow.
//! - [`views`]: read-only state of a turn, a session, a user.
//! - [`orphans`]: a recovery worker's claim of an orphaned turn.
//! - [`ops`]: `/healthz`, `/metrics`, `/openapi.json`, and the JSON answers
//!   for unknown routes and wrong methods.
//!
//! Handlers drive the store by lease token (`gate.store()`): the remote
//! caller holds the lease and heartbeats it, so no `Turn` guard or watchdog
//! runs here. Each handler is one store step; none holds state between
//! requests. Which routes exist is decided in [`crate::openapi::api_router`].

pub(crate) mod events;
pub(crate) mod ops;
pub(crate) mod orphans;
pub(crate) mod tools;
pub(crate) mod turns;
pub(crate) mod views;
