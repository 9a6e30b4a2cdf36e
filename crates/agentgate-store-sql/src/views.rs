//! The read-only views (never a lease token) and the sweeper's cutoffs,
//! written once: what a view shows, given the rows a store reads.
//!
//! The statements are written here once; a store supplies how to run them
//! and two expressions ([`ViewSql`]). This module also decides what the
//! rows mean. A lease is live when its row's expiry is after the
//! store's clock, or, with an external lease layer, when the layer says so
//! (the rows then keep no expiry). A pending confirmation shows until it
//! expires. A user's cap is its override, else the configured default. An
//! execution page is a keyset page planned by `agentgate_core::page`.

use agentgate_core::config::{check_cap, duration_ms, Config};
use agentgate_core::error::Result;
use agentgate_core::ids::{ClientRequestId, Fence, SessionId, TurnId, UserId};
use agentgate_core::limits::{MAX_OVERVIEW_ROWS, MAX_SESSION_QUEUE};
use agentgate_core::model::{
    BusyPolicy, ExecutionView, HolderView, LiveTurn, OnBusy, Overview, PendingView, QueueEntry,
    SessionView, TurnView, UserView,
};
use agentgate_core::page::{assemble, plan, ExecutionPage, ExecutionPageRequest};

use agentgate_core::error::Error;

use crate::query::{Arg, On, Run, Statement};
use crate::rows::{count, execution_view, id, turn_view, Columns, EXECUTION_COLUMNS, TURN_COLUMNS};

/// The columns a session's view reads, under these names.
pub const SESSION_VIEW_COLUMNS: &str = "user_id, holder_turn_id, fence, lease_expires_at_ms, \
    pending_turn_id, pending_expires_at_ms, busy_policy, busy_wait_ms, busy_interrupt";

/// A session's live holder as its row names it.
#[derive(Debug)]
pub struct HolderRow {
    /// The session.
    pub session_id: String,
    /// The holding turn.
    pub turn_id: String,
    /// The grant's fence.
    pub fence: i64,
    /// The lease's expiry on the store's clock.
    pub expires_at_ms: i64,
}

impl HolderRow {
    /// Decodes `session_id`, `holder_turn_id`, `fence` and
    /// `lease_expires_at_ms` of a row that holds a lease.
    ///
    /// # Errors
    /// As [`Columns`]; `corrupt` for a NULL.
    pub fn read(row: &impl Columns) -> Result<Self> {
        Ok(Self {
            session_id: row.text_required("session_id")?,
            turn_id: row.text_required("holder_turn_id")?,
            fence: row.int_required("fence")?,
            expires_at_ms: row.int_required("lease_expires_at_ms")?,
        })
    }

    fn view(self, now_ms: i64) -> Result<HolderView> {
        Ok(HolderView {
            session_id: id(SessionId::new, self.session_id)?,
            turn_id: id(TurnId::new, self.turn_id)?,
            fence: Fence(self.fence),
            lease_expires_in_ms: self.expires_at_ms - now_ms,
            // Read from the turns by `mark_cancel_requests`, which every
            // view that shows a holder runs.
            cancel_requested: false,
        })
    }
}

/// Sets `cancel_requested` on each holder from its turn's row: one read of
/// at most as many turns as the view shows (a user's cap, the overview's
/// limit), by primary key.
async fn mark_cancel_requests<S: ViewSql>(sql: &S, holders: &mut [&mut HolderView]) -> Result<()> {
    if holders.is_empty() {
        return Ok(());
    }
    let mut statement = Statement::new(
        "SELECT turn_id FROM ag_turns WHERE state = 'running' \
         AND cancel_requested_at_ms IS NOT NULL AND turn_id IN (",
    );
    let placeholders: Vec<String> = holders
        .iter()
        .map(|holder| statement.bind(Arg::Text(holder.turn_id.as_str())))
        .collect();
    statement.push(&format!("{})", placeholders.join(", ")));
    let rows = sql.fetch(On::Read, statement).await?;
    let mut asked = Vec::with_capacity(rows.len());
    for row in &rows {
        asked.push(S::columns(row).text_required("turn_id")?);
    }
    for holder in holders.iter_mut() {
        holder.cancel_requested = asked.iter().any(|turn| turn == holder.turn_id.as_str());
    }
    Ok(())
}

/// A session's row as its view reads it ([`SESSION_VIEW_COLUMNS`] and the
/// clock as `now_ms`).
#[derive(Debug)]
pub struct SessionRow {
    user_id: String,
    holder_turn_id: Option<String>,
    fence: i64,
    lease_expires_at_ms: Option<i64>,
    pending_turn_id: Option<String>,
    pending_expires_at_ms: Option<i64>,
    default_on_busy: Option<OnBusy>,
    now_ms: i64,
}

impl SessionRow {
    /// Decodes the row.
    ///
    /// # Errors
    /// As [`Columns`]; `corrupt` for a NULL the schema forbids.
    pub fn read(row: &impl Columns) -> Result<Self> {
        Ok(Self {
            user_id: row.text_required("user_id")?,
            holder_turn_id: row.text("holder_turn_id")?,
            fence: row.int_required("fence")?,
            lease_expires_at_ms: row.int("lease_expires_at_ms")?,
            pending_turn_id: row.text("pending_turn_id")?,
            pending_expires_at_ms: row.int("pending_expires_at_ms")?,
            default_on_busy: default_on_busy(row)?,
            now_ms: row.int_required("now_ms")?,
        })
    }
}

/// A session row's default busy policy: `None` when never set, else the
/// policy the engine validated when it was set.
///
/// # Errors
/// `corrupt` for a policy, bound or flag the engine never writes.
fn default_on_busy(row: &impl Columns) -> Result<Option<OnBusy>> {
    let Some(policy) = row.text("busy_policy")? else {
        return Ok(None);
    };
    let corrupt = |what: String| Error::corrupt(format!("a session's default busy policy: {what}"));
    let policy: BusyPolicy = policy.parse().map_err(|_| corrupt(format!("`{policy}`")))?;
    let wait_ms = row
        .int("busy_wait_ms")?
        .map(|ms| u64::try_from(ms).map_err(|_| corrupt(format!("wait {ms} ms"))))
        .transpose()?;
    let on_busy = OnBusy::new(policy, wait_ms).map_err(|error| corrupt(error.to_string()))?;
    match row.flag("busy_interrupt")? {
        Some(true) => on_busy
            .interrupting()
            .map(Some)
            .map_err(|error| corrupt(error.to_string())),
        Some(false) => Ok(Some(on_busy)),
        None => Err(corrupt("no interrupt flag".to_owned())),
    }
}

/// Sets a session's default busy policy (creating the session, bound to
/// `user_id`, on first use) and reads its view back. The write is
/// conditioned on the binding, so it never changes another user's
/// session; two first uses at once meet the primary key, and the loser
/// updates on its retry.
///
/// # Errors
/// `not_found` for a session bound to another user; the store's.
pub async fn set_session_policy<S: ViewSql>(
    sql: &S,
    user_id: &UserId,
    session_id: &SessionId,
    on_busy: OnBusy,
) -> Result<SessionView> {
    let policy = on_busy.policy.as_str();
    let wait_ms = i64::try_from(on_busy.wait.as_millis())
        .map_err(|_| Error::invalid("the wait bound is out of range"))?;
    let wait_ms = (on_busy.wait > std::time::Duration::ZERO).then_some(wait_ms);
    let mut retry = crate::Retry::new();
    loop {
        let updated = sql
            .execute(
                On::Write,
                Statement::new(format!(
                    "UPDATE ag_sessions SET busy_policy = $1, busy_wait_ms = $2, \
                     busy_interrupt = ($3 = 1), updated_at_ms = {} \
                     WHERE session_id = $4 AND user_id = $5",
                    S::NOW_MS
                ))
                .text(policy)
                .opt_int(wait_ms)
                .int(i64::from(on_busy.interrupt))
                .text(session_id.as_str())
                .text(user_id.as_str()),
            )
            .await;
        let written = match updated {
            Ok(0) => {
                sql.execute(
                    On::Write,
                    Statement::new(format!(
                        "INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms, \
                           busy_policy, busy_wait_ms, busy_interrupt) \
                         SELECT $1, $2, 0, {}, $3, $4, ($5 = 1) FROM (SELECT 1) AS one \
                         WHERE NOT EXISTS (SELECT 1 FROM ag_sessions WHERE session_id = $1)",
                        S::NOW_MS
                    ))
                    .text(session_id.as_str())
                    .text(user_id.as_str())
                    .text(policy)
                    .opt_int(wait_ms)
                    .int(i64::from(on_busy.interrupt)),
                )
                .await
            }
            done => done,
        };
        match written {
            Ok(0 | 1) => break,
            Ok(n) => {
                return Err(Error::corrupt(format!(
                    "setting session {session_id}'s policy changed {n} rows"
                )))
            }
            Err(error) => retry.after(error).await?,
        }
    }
    match session(sql, session_id).await? {
        // Written, or bound to another user (nothing written): the same
        // answer as any call on another user's session.
        // (A concurrent set of the same session may show instead: the
        // last write wins, as it does for the next begin.)
        Some(view) if view.user_id == *user_id => Ok(view),
        _ => Err(Error::not_found(format!("session {session_id}"))),
    }
}

/// What a user's view reads: the cap override, the clock, and the live
/// holders in the rows (empty with a lease layer, whose rows keep no expiry).
#[derive(Debug)]
pub struct UserRows {
    /// The user's cap override.
    pub cap: Option<i64>,
    /// The store's clock.
    pub now_ms: i64,
    /// The sessions whose row lease is live, soonest expiry first.
    pub holders: Vec<HolderRow>,
}

/// What a store's views need beyond running statements: the two
/// expressions its dialect writes its own way. The statements themselves are written once, here.
pub trait ViewSql: Run {
    /// A row's claim number as pages order by it. Where the column is
    /// nullable (SQLite, MySQL: a node of an older release may still insert
    /// during a rolling upgrade) a missing number reads as 0.
    const CLAIM_SEQ: &'static str;

    /// A row's stored result + error bytes, as a `BIGINT`.
    const STORED_BYTES: &'static str;

    /// Sets the user `$1`'s cap override to `$2`, creating the row.
    const SET_CAP: &'static str;

    /// Clears the user `$1`'s cap override. Where the user's row is the
    /// lock every begin of the user takes (PostgreSQL, MySQL) the override
    /// is set to NULL rather than the row deleted; the sweeper drops rows
    /// that carry nothing once the user has no sessions.
    const CLEAR_CAP: &'static str;
}

/// Sets or clears a user's cap override, run again after a transient
/// conflict.
///
/// # Errors
/// `invalid_request` for a cap out of range; the store's error.
pub async fn set_user_cap<S: ViewSql>(sql: &S, user_id: &UserId, cap: Option<u32>) -> Result<()> {
    if let Some(cap) = cap {
        check_cap(cap)?;
    }
    let mut retry = crate::Retry::new();
    loop {
        let statement = match cap {
            Some(cap) => Statement::new(S::SET_CAP)
                .text(user_id.as_str())
                .int(i64::from(cap)),
            None => Statement::new(S::CLEAR_CAP).text(user_id.as_str()),
        };
        match sql.execute(On::Write, statement).await {
            Ok(_) => return Ok(()),
            Err(error) => retry.after(error).await?,
        }
    }
}

/// A turn's view.
///
/// # Errors
/// The store's error; `corrupt` for a row the engine never writes.
pub async fn turn<S: ViewSql>(sql: &S, turn_id: &TurnId) -> Result<Option<TurnView>> {
    let row = sql
        .fetch_optional(
            On::Read,
            Statement::new(format!(
                "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = $1"
            ))
            .text(turn_id.as_str()),
        )
        .await?;
    row.as_ref()
        .map(|row| turn_view(&S::columns(row)))
        .transpose()
}

/// Applies `decide::cancel_step` to the turn in one conditional `UPDATE`
/// (no lock, no read first): a queued turn ends `cancelled` and leaves its
/// queue, a running turn not asked before records the request, anything
/// else changes nothing; then reads its view. The statement's `WHERE` is
/// "the step is not `Nothing`", its `CASE`s tell `EndQueued` from
/// `Record`; `testing::cancel_agrees_with_decide` checks it over every
/// state on every store.
///
/// # Errors
/// The store's error; `corrupt` when more than one row changed.
pub async fn request_cancel<S: ViewSql>(sql: &S, turn_id: &TurnId) -> Result<Option<TurnView>> {
    let written = sql
        .execute(
            On::Write,
            // A queued turn has no holder to ask: it leaves its queue and
            // ends `cancelled` here. MySQL assigns left to right, reading
            // the new values: `state` goes last, so every `CASE` reads the
            // old one, as on the other stores.
            Statement::new(format!(
                "UPDATE ag_turns SET cancel_requested_at_ms = {now}, updated_at_ms = {now}, \
                 ended_at_ms = CASE WHEN state = 'queued' THEN {now} ELSE ended_at_ms END, \
                 queue_seq = NULL, \
                 state = CASE WHEN state = 'queued' THEN 'cancelled' ELSE state END \
                 WHERE turn_id = $1 AND (state = 'queued' \
                   OR (state = 'running' AND cancel_requested_at_ms IS NULL))",
                now = S::NOW_MS
            ))
            .text(turn_id.as_str()),
        )
        .await?;
    if written > 1 {
        return Err(Error::corrupt(format!(
            "a cancel request changed {written} turns {turn_id}"
        )));
    }
    turn(sql, turn_id).await
}

/// Ordering keys and stored sizes (`execution_id`, `claim_seq`, result +
/// error bytes) of up to `fetch` executions of the turn after the key
/// `after`, in key order.
async fn execution_keys<S: ViewSql>(
    sql: &S,
    turn_id: &str,
    (after_seq, after_id): (i64, &str),
    fetch: i64,
) -> Result<Vec<(String, i64, i64)>> {
    let seq = S::CLAIM_SEQ;
    let rows = sql
        .fetch(
            On::Read,
            Statement::new(format!(
                "SELECT execution_id, {seq} AS claim_seq, {} AS stored_bytes \
                 FROM ag_tool_executions WHERE turn_id = $1 \
                   AND ({seq} > $2 OR ({seq} = $2 AND execution_id > $3)) \
                 ORDER BY {seq}, execution_id LIMIT $4",
                S::STORED_BYTES
            ))
            .text(turn_id)
            .int(after_seq)
            .text(after_id)
            .int(fetch),
        )
        .await?;
    rows.iter()
        .map(|row| {
            let row = S::columns(row);
            Ok((
                row.text_required("execution_id")?,
                row.int_required("claim_seq")?,
                row.int_required("stored_bytes")?,
            ))
        })
        .collect()
}

/// The executions of the turn after `after` up to and including `through`,
/// at most `limit`, in key order.
async fn execution_rows<S: ViewSql>(
    sql: &S,
    turn_id: &str,
    (after_seq, after_id): (i64, &str),
    (last_seq, last_id): (i64, &str),
    limit: i64,
) -> Result<Vec<ExecutionView>> {
    let seq = S::CLAIM_SEQ;
    let rows = sql
        .fetch(
            On::Read,
            Statement::new(format!(
                "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions WHERE turn_id = $1 \
                   AND ({seq} > $2 OR ({seq} = $2 AND execution_id > $3)) \
                   AND ({seq} < $4 OR ({seq} = $4 AND execution_id <= $5)) \
                 ORDER BY {seq}, execution_id LIMIT $6"
            ))
            .text(turn_id)
            .int(after_seq)
            .text(after_id)
            .int(last_seq)
            .text(last_id)
            .int(limit),
        )
        .await?;
    rows.iter()
        .map(|row| execution_view(&S::columns(row)))
        .collect()
}

/// The user's cap override, the clock and its live row leases, in one
/// statement, so the three agree.
async fn user_rows<S: ViewSql>(sql: &S, user_id: &str) -> Result<UserRows> {
    let now = S::NOW_MS;
    let rows = sql
        .fetch(
            On::Read,
            Statement::new(format!(
                "SELECT (SELECT max_turns FROM ag_users WHERE user_id = $1) AS max_turns, \
                   {now} AS now_ms, s.session_id, s.holder_turn_id, s.fence, s.lease_expires_at_ms \
                 FROM (SELECT 1) AS one LEFT JOIN ag_sessions s \
                   ON s.user_id = $1 AND s.lease_expires_at_ms > {now} \
                 ORDER BY s.lease_expires_at_ms"
            ))
            .text(user_id),
        )
        .await?;
    let first = S::columns(
        rows.first()
            .ok_or_else(|| Error::corrupt("a user's view read no row"))?,
    );
    let mut holders = Vec::with_capacity(rows.len());
    for row in &rows {
        let row = S::columns(row);
        if row.text("session_id")?.is_some() {
            holders.push(HolderRow::read(&row)?);
        }
    }
    Ok(UserRows {
        cap: first.int("max_turns")?,
        now_ms: first.int_required("now_ms")?,
        holders,
    })
}

/// The clock and up to `limit` live row leases (with their user), the
/// latest expiry first.
async fn live_rows<S: ViewSql>(sql: &S, limit: i64) -> Result<(i64, Vec<(String, HolderRow)>)> {
    let now = sql.now_ms().await?;
    let rows = sql
        .fetch(
            On::Read,
            Statement::new(
                "SELECT user_id, session_id, holder_turn_id, fence, lease_expires_at_ms \
                 FROM ag_sessions WHERE lease_expires_at_ms > $1 \
                 ORDER BY lease_expires_at_ms DESC LIMIT $2",
            )
            .int(now)
            .int(limit),
        )
        .await?;
    let rows = rows
        .iter()
        .map(|row| {
            let row = S::columns(row);
            Ok((row.text_required("user_id")?, HolderRow::read(&row)?))
        })
        .collect::<Result<_>>()?;
    Ok((now, rows))
}

/// Up to `limit` sessions whose row names a holder (`user_id`,
/// `session_id`), most recently updated first: with a lease layer, the
/// candidates it is asked about.
async fn holding_sessions<S: ViewSql>(sql: &S, limit: i64) -> Result<Vec<(String, String)>> {
    let rows = sql
        .fetch(
            On::Read,
            Statement::new(
                "SELECT user_id, session_id FROM ag_sessions WHERE holder_turn_id IS NOT NULL \
                 ORDER BY updated_at_ms DESC LIMIT $1",
            )
            .int(limit),
        )
        .await?;
    rows.iter()
        .map(|row| {
            let row = S::columns(row);
            Ok((
                row.text_required("user_id")?,
                row.text_required("session_id")?,
            ))
        })
        .collect()
}

/// Up to `limit` most recently updated turns and executions, newest first;
/// within one store-clock millisecond the newer grant (higher fence) first,
/// then (executions) the later claim.
async fn recent<S: ViewSql>(sql: &S, limit: i64) -> Result<(Vec<TurnView>, Vec<ExecutionView>)> {
    let turns = sql
        .fetch(
            On::Read,
            Statement::new(format!(
                "SELECT {TURN_COLUMNS} FROM ag_turns ORDER BY updated_at_ms DESC, fence DESC LIMIT $1"
            ))
            .int(limit),
        )
        .await?;
    let executions = sql
        .fetch(
            On::Read,
            Statement::new(format!(
                "SELECT {EXECUTION_COLUMNS} FROM ag_tool_executions \
                 ORDER BY updated_at_ms DESC, fence DESC, claim_seq DESC LIMIT $1"
            ))
            .int(limit),
        )
        .await?;
    Ok((
        turns
            .iter()
            .map(|row| turn_view(&S::columns(row)))
            .collect::<Result<_>>()?,
        executions
            .iter()
            .map(|row| execution_view(&S::columns(row)))
            .collect::<Result<_>>()?,
    ))
}

/// A keyset page of a turn's executions in two reads: the ordering keys and
/// sizes of up to limit + 1 rows after the cursor (no result is read), then
/// the full rows of the ones the page takes, so a page never reads more
/// results than it returns.
///
/// # Errors
/// The store's error; the page's own limits.
pub async fn executions<S: ViewSql>(
    sql: &S,
    turn_id: &TurnId,
    page: &ExecutionPageRequest,
) -> Result<ExecutionPage> {
    let after = page
        .after
        .as_ref()
        .map_or((i64::MIN, ""), |c| (c.claim_seq, c.execution_id.as_str()));
    let keyed = execution_keys(sql, turn_id.as_str(), after, i64::from(page.fetch())).await?;
    let (keys, more) = plan(keyed, page)?;
    let Some(last) = keys.last() else {
        return Ok(ExecutionPage::default());
    };
    let through = (last.claim_seq, last.execution_id.as_str());
    let limit = i64::try_from(keys.len()).expect("a page's length fits in i64");
    let rows = execution_rows(sql, turn_id.as_str(), after, through, limit).await?;
    assemble(rows, &keys, more, page)
}

/// A session's view: its holder (asked of the layer when there is one), its
/// pending confirmation while it lasts, its newest fence.
///
/// # Errors
/// The store's or the layer's error; `corrupt` for a row the engine never
/// writes.
pub async fn session<S: ViewSql>(sql: &S, session_id: &SessionId) -> Result<Option<SessionView>> {
    let row = sql
        .fetch_optional(
            On::Read,
            Statement::new(format!(
                "SELECT {SESSION_VIEW_COLUMNS}, {} AS now_ms FROM ag_sessions WHERE session_id = $1",
                S::NOW_MS
            ))
            .text(session_id.as_str()),
        )
        .await?;
    let Some(row) = row
        .as_ref()
        .map(|row| SessionRow::read(&S::columns(row)))
        .transpose()?
    else {
        return Ok(None);
    };
    let now = row.now_ms;
    let holder = match (sql.leases(), row.holder_turn_id, row.lease_expires_at_ms) {
        (Some(layer), _, _) => layer.holder(session_id.as_str()).await?,
        (None, Some(turn_id), Some(expires_at_ms)) if expires_at_ms > now => Some(
            HolderRow {
                session_id: session_id.as_str().to_owned(),
                turn_id,
                fence: row.fence,
                expires_at_ms,
            }
            .view(now)?,
        ),
        _ => None,
    };
    let mut holder = holder;
    if let Some(holder) = holder.as_mut() {
        mark_cancel_requests(sql, &mut [holder]).await?;
    }
    let pending_confirmation = match (row.pending_turn_id, row.pending_expires_at_ms) {
        (Some(turn_id), Some(expires)) if expires > now => Some(PendingView {
            turn_id: id(TurnId::new, turn_id)?,
            expires_in_ms: expires - now,
        }),
        _ => None,
    };
    Ok(Some(SessionView {
        session_id: session_id.clone(),
        user_id: id(UserId::new, row.user_id)?,
        holder,
        pending_confirmation,
        fence: Fence(row.fence),
        queue: queue(sql, session_id).await?,
        default_on_busy: row.default_on_busy,
    }))
}

/// A session's queue, head first, in one statement (the positions are of
/// one snapshot), at most [`MAX_SESSION_QUEUE`] entries: the bound every
/// enqueue keeps.
///
/// # Errors
/// The store's; `corrupt` for a queue over its bound.
async fn queue<S: ViewSql>(sql: &S, session_id: &SessionId) -> Result<Vec<QueueEntry>> {
    let rows = sql
        .fetch(
            On::Read,
            Statement::new(
                "SELECT turn_id, client_request_id, created_at_ms FROM ag_turns \
                 WHERE session_id = $1 AND queue_seq IS NOT NULL ORDER BY queue_seq LIMIT $2",
            )
            .text(session_id.as_str())
            .int(i64::from(MAX_SESSION_QUEUE) + 1),
        )
        .await?;
    if rows.len() > MAX_SESSION_QUEUE as usize {
        return Err(Error::corrupt(format!(
            "session {session_id} has more than {MAX_SESSION_QUEUE} queued turns"
        )));
    }
    rows.iter()
        .zip(1..)
        .map(|(row, position)| {
            let row = S::columns(row);
            Ok(QueueEntry {
                turn_id: id(TurnId::new, row.text_required("turn_id")?)?,
                client_request_id: id(
                    ClientRequestId::new,
                    row.text_required("client_request_id")?,
                )?,
                position,
                enqueued_at_ms: row.int_required("created_at_ms")?,
            })
        })
        .collect()
}

/// A user's view: its cap and its live holders.
///
/// # Errors
/// The store's or the layer's error; `corrupt` for a stored cap outside
/// `u32`.
pub async fn user<S: ViewSql>(sql: &S, user_id: &UserId) -> Result<UserView> {
    let rows = user_rows(sql, user_id.as_str()).await?;
    let mut holders = match sql.leases() {
        Some(layer) => layer.user_holders(user_id.as_str()).await?,
        None => rows
            .holders
            .into_iter()
            .map(|holder| holder.view(rows.now_ms))
            .collect::<Result<Vec<_>>>()?,
    };
    mark_cancel_requests(sql, &mut holders.iter_mut().collect::<Vec<_>>()).await?;
    let live_turns = u32::try_from(holders.len()).expect("holders are bounded by the user's cap");
    Ok(UserView {
        user_id: user_id.clone(),
        max_turns_per_user: match rows.cap {
            Some(cap) => count(cap)?,
            None => sql.config().max_turns_per_user,
        },
        live_turns,
        holders,
    })
}

/// The dashboard's overview: live holders, the latest turns and executions,
/// at most [`MAX_OVERVIEW_ROWS`] of each.
///
/// # Errors
/// The store's or the layer's error.
pub async fn overview<S: ViewSql>(sql: &S, limit: u32) -> Result<Overview> {
    let limit = i64::from(limit.min(MAX_OVERVIEW_ROWS));
    let live = match sql.leases() {
        Some(layer) => {
            // The rows name the last holder; the layer says who is live.
            let mut live = Vec::new();
            for (user_id, session_id) in holding_sessions(sql, limit).await? {
                if let Some(holder) = layer.holder(&session_id).await? {
                    live.push(LiveTurn {
                        user_id: id(UserId::new, user_id)?,
                        holder,
                    });
                }
            }
            live
        }
        None => {
            let (now, rows) = live_rows(sql, limit).await?;
            rows.into_iter()
                .map(|(user_id, holder)| {
                    Ok(LiveTurn {
                        user_id: id(UserId::new, user_id)?,
                        holder: holder.view(now)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        }
    };
    let mut live = live;
    mark_cancel_requests(
        sql,
        &mut live
            .iter_mut()
            .map(|turn| &mut turn.holder)
            .collect::<Vec<_>>(),
    )
    .await?;
    let (recent_turns, recent_executions) = recent(sql, limit).await?;
    Ok(Overview {
        live,
        recent_turns,
        recent_executions,
    })
}

/// What a sweep may delete, from the store's clock: rows ended before
/// `cutoff` (the results' retention), turns awaiting a confirmation once it
/// expired before that too (`pending_cutoff`), at most `batch` of each.
#[derive(Clone, Copy, Debug)]
pub struct Cutoffs {
    /// The store's clock.
    pub now_ms: i64,
    /// Ended before this: past retention.
    pub cutoff_ms: i64,
    /// Awaiting since before this: its confirmation expired past retention.
    pub pending_cutoff_ms: i64,
    /// Rows per statement.
    pub batch: i64,
}

impl Cutoffs {
    /// The cutoffs at `now_ms` under `config`.
    pub fn new(now_ms: i64, config: &Config) -> Self {
        let cutoff_ms = now_ms - duration_ms(config.result_retention);
        Self {
            now_ms,
            cutoff_ms,
            pending_cutoff_ms: cutoff_ms - duration_ms(config.confirmation_ttl),
            batch: i64::from(config.sweep_batch),
        }
    }
}
