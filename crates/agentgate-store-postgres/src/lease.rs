//! The caller's lease, checked two ways.
//!
//! - the shared `lease::check_lease` reads the session's row
//!   ([`LeaseSql::read_lease_sql`], locking it when asked) and explains a
//!   refusal: the full read-decide-write path of a step, and the
//!   explanation after a fast path changed no row.
//! - [`condition`] states the same check as a SQL condition on the shared
//!   [`Holder`], so that a step whose decision SQL can express exactly (an
//!   execution's ending, a turn's ending, a first tool claim) is one
//!   statement: the condition is true exactly when `check_lease` would
//!   accept.
//!
//! With an external lease layer both ask the layer first (one layer call) and
//! then require the SQL rows to agree that its fence is the session's newest.

use agentgate_core::plant::{self, Plant};

use crate::steps::Sql;
use crate::NOW_MS;
use agentgate_store_sql::lease::{Holder, LeaseSql, LEASE_COLUMNS};

/// A `WHERE` condition on `ag_sessions s JOIN ag_turns t` (joined on the
/// session) that holds exactly when `$turn` is running and holds a live
/// lease with `holder`'s credential, bound as `$credential`. On the rows:
/// the session names the turn and the token's digest, and its expiry is
/// after the statement's now. With a layer: the layer's fence is the turn's
/// and the session's, so no newer grant exists.
pub(crate) fn condition(holder: &Holder, turn: u8, credential: u8) -> String {
    match holder {
        Holder::Row { .. } => plant::edit(
            Plant::PostgresFastLeaseIgnoresExpiry,
            format!(
                "t.turn_id = ${turn} AND t.state = 'running' AND s.holder_turn_id = ${turn} \
                 AND s.lease_token_hash = ${credential} AND s.lease_expires_at_ms > {NOW_MS}"
            ),
            &format!(" AND s.lease_expires_at_ms > {NOW_MS}"),
            "",
        )
        .into_owned(),
        Holder::Layer { .. } => format!(
            "t.turn_id = ${turn} AND t.state = 'running' AND t.fence = ${credential} \
             AND s.fence = ${credential}"
        ),
    }
}

/// The live lease's fence as a scalar subquery: NULL when [`condition`]
/// does not hold, so `fence = (…)` is then false.
pub(crate) fn live_fence(holder: &Holder, turn: u8, credential: u8) -> String {
    format!(
        "(SELECT s.fence FROM ag_sessions s JOIN ag_turns t ON t.session_id = s.session_id \
         WHERE {})",
        condition(holder, turn, credential)
    )
}

impl LeaseSql for Sql<'_> {
    fn read_lease_sql(lock: bool) -> String {
        format!(
            "SELECT {LEASE_COLUMNS}, {NOW_MS} AS now_ms \
             FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
             WHERE t.turn_id = $1 {}",
            if lock { "FOR UPDATE OF s" } else { "" }
        )
    }
}
