//! The reference app's own named limits, each with its reason. The
//! server's limits live in `agentgate_server::limits`, the engine's in
//! `agentgate::limits`.

use std::time::Duration;

/// Longest think time per model round the offline model may be given. The
/// point of the setting is to look like a 2–10 s LLM (docs/protocol.md §11); a minute per
/// round would only make a demo look hung.
pub const MAX_THINK_TIME: Duration = Duration::from_secs(60);

/// Interval of SSE keep-alive comments on a turn's event stream. Besides
/// keeping proxies from closing a quiet stream, each write is how a client
/// that went away is noticed while the model is silent (the `cancel`
/// disconnect policy then fires within about this long).
pub const SSE_KEEP_ALIVE: Duration = Duration::from_secs(1);

/// Rows of each kind (live leases, turns, tool executions) the dashboard
/// shows: a screenful. The store caps any overview at its own limit too.
pub const DASHBOARD_ROWS: u32 = 50;

/// Users whose permits the dashboard reads per refresh, one store read each.
/// The dashboard refreshes every second; this bounds the reads it costs.
pub const DASHBOARD_MAX_USERS: usize = 20;

/// Sessions whose queue the dashboard reads per refresh (the held ones,
/// then those with a recent queued turn), one store read each, like
/// [`DASHBOARD_MAX_USERS`]: the dashboard refreshes every second.
pub const DASHBOARD_MAX_QUEUES: usize = 20;

/// Hits a documents search returns: what a person reads at a glance, and
/// what the agent quotes from.
pub const SEARCH_HITS: usize = 5;

/// Pause between two recovery passes over orphaned ingestions.
pub const INGEST_RECOVERY_INTERVAL: Duration = Duration::from_secs(2);
