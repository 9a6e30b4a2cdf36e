//! The records of the turn protocol and the views handed to callers.
//!
//! Commands (`BeginCommand`, `ToolCall`, `Ending`) are validated before a store
//! sees them: ids are checked, JSON is canonical and within limits. Views
//! never contain a lease token; times in views are store-clock milliseconds.
//!
//! Split by concern: [`states`] (the wire enums and busy policies), [`begin`]
//! (the begin's command and answers), [`events`] (a turn's event log),
//! [`tools`] (tool calls and claims), [`ending`], [`views`] (what callers
//! read) and [`orphans`] (recovery). Everything is re-exported here, so
//! `agentgate_core::model::X` names each. How a record is laid out in SQL
//! columns belongs to the SQL stores (`agentgate_store_sql`), not here.

use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical::{CanonicalJson, Digest};
use crate::error::{Error, Result};
use crate::ids::{
    ClientRequestId, ExecutionId, Fence, LeaseToken, SessionId, ToolName, TurnId, UserId,
};

mod begin;
mod ending;
mod events;
mod orphans;
mod states;
mod tools;
mod views;

pub use begin::*;
pub use ending::*;
pub use events::*;
pub use orphans::*;
pub use states::*;
pub use tools::*;
pub use views::*;

#[cfg(test)]
mod tests;
