//! Orphans, written once: listing running turns whose lease is gone without
//! an ending (for recovery workers and the sweeper), and ending one
//! `abandoned`; and an operator's force-release, which ends a session's
//! holder the same way whether its lease is live or not.
//!
//! With the lease in the session row, the store's candidate query already
//! excludes live leases and filters by orphan age. With a lease layer the
//! rows keep no expiry, so every running turn the filter admits is a
//! candidate, the layer is asked whether it still holds it, and the first
//! listing that finds it unheld records the time on the turn (unless a
//! grant came between); its age is counted from then.

use agentgate_core::error::Result;
use agentgate_core::lease::held_by;
use agentgate_core::limits::MAX_ORPHAN_SCAN;
use agentgate_core::model::{IgnoredCancel, Orphan, OrphanFilter};

use agentgate_core::decide::{cancel_ignored, release_target, ABANDONED_ERROR, RELEASED_ERROR};
use agentgate_core::error::Error;
use agentgate_core::ids::{Fence, SessionId, TurnId};

use crate::query::{Arg, On, Run, Statement};
use crate::rows::{id, orphan, Columns};
use crate::{Retry, StepTx};

/// What a store supplies for orphans: the lock that orders an abandon with
/// a concurrent takeover. The statements are written once, here.
#[async_trait::async_trait]
pub trait OrphanSql: StepTx {
    /// Locks the session `$1`'s row as a begin takes it, inside a step's
    /// transaction (PostgreSQL, MySQL: `… FOR UPDATE`); `None` where the
    /// transaction alone orders writers (SQLite: the single writer).
    const LOCK_SESSION: Option<&'static str>;

    /// A statement that announces, inside the transaction that frees it,
    /// that the session `$1` was released, for other nodes' waiting begins
    /// (PostgreSQL: `pg_notify`, sent at commit); `None` where the store
    /// has no notification.
    const ANNOUNCE_RELEASE: Option<&'static str> = None;

    /// Takes the next fence from the store-wide counter inside the open
    /// transaction `conn`.
    async fn next_fence(&self, conn: &mut <Self as Run>::Conn) -> Result<Fence>;
}

/// Opens a write transaction holding the session's row as a begin takes it
/// ([`OrphanSql::LOCK_SESSION`]), so a takeover and the abandon are ordered.
async fn lock_session<S: OrphanSql>(sql: &S, session_id: &str) -> Result<S::Tx> {
    let mut tx = sql.transaction().await?;
    if let Some(lock) = S::LOCK_SESSION {
        let statement = Statement::new(lock).text(session_id);
        sql.fetch_optional(On::Conn(S::conn(&mut tx)), statement)
            .await?;
    }
    Ok(tx)
}

/// When the turn last had a live lease, as far as the rows tell: the
/// session's expiry while the row names it, else the recorded orphan time,
/// else its last grant.
const ORPHANED_SINCE: &str = "CASE WHEN s.holder_turn_id = t.turn_id \
    AND s.lease_expires_at_ms IS NOT NULL THEN s.lease_expires_at_ms \
    ELSE COALESCE(t.orphaned_at_ms, t.updated_at_ms) END";

/// The running turns `filter` admits, as orphan candidates with their
/// orphan time, longest-orphaned first, at most `limit`. With leases in the
/// rows only turns without a live row lease, orphaned at least
/// `filter.min_orphaned_ms`, qualify; with a layer every running turn does,
/// and the layer is asked afterwards.
async fn candidates<S: OrphanSql>(
    sql: &S,
    filter: &OrphanFilter,
    limit: u32,
    now: i64,
) -> Result<Vec<Orphan>> {
    let mut statement = Statement::new(format!(
        "SELECT t.turn_id, t.session_id, t.user_id, t.client_request_id, t.fingerprint, \
         t.payload, t.fence, t.attempt, {ORPHANED_SINCE} AS orphaned_since_ms, \
         CAST(CASE WHEN COALESCE(s.fence, 0) > t.fence THEN 1 ELSE 0 END AS {}) AS superseded \
         FROM ag_turns t LEFT JOIN ag_sessions s ON s.session_id = t.session_id \
         WHERE t.state = 'running'",
        S::BIGINT
    ));
    if sql.leases().is_none() {
        let min_age = i64::try_from(filter.min_orphaned_ms).unwrap_or(i64::MAX);
        let live_after = statement.bind(Arg::Int(now));
        let since = statement.bind(Arg::Int(now.saturating_sub(min_age)));
        statement.push(&format!(
            " AND NOT (s.holder_turn_id IS NOT NULL AND s.holder_turn_id = t.turn_id \
             AND COALESCE(s.lease_expires_at_ms, 0) > {live_after}) \
             AND {ORPHANED_SINCE} <= {since}"
        ));
    }
    filtered(&mut statement, filter);
    let limit = statement.bind(Arg::Int(i64::from(limit)));
    statement.push(&format!(
        " ORDER BY orphaned_since_ms, t.turn_id LIMIT {limit}"
    ));
    let rows = sql.fetch(On::Read, statement).await?;
    rows.iter()
        .map(|row| orphan(&S::columns(row), now))
        .collect()
}

/// Narrows a statement over turns `t` to the users and turns `filter`
/// names (none named: all).
fn filtered<'a>(statement: &mut Statement<'a>, filter: &'a OrphanFilter) {
    for (column, ids) in [
        (
            "t.user_id",
            filter
                .user_ids
                .iter()
                .map(|u| u.as_str())
                .collect::<Vec<_>>(),
        ),
        (
            "t.turn_id",
            filter.turn_ids.iter().map(|t| t.as_str()).collect(),
        ),
    ] {
        if ids.is_empty() {
            continue;
        }
        let placeholders: Vec<String> = ids
            .into_iter()
            .map(|id| statement.bind(Arg::Text(id)))
            .collect();
        statement.push(&format!(" AND {column} IN ({})", placeholders.join(", ")));
    }
}

/// First seen unheld: records since when on the turn, unless a grant came
/// between (the turn no longer runs under the orphan's fence); the recorded
/// time.
async fn stamp_orphaned<S: OrphanSql>(sql: &S, orphan: &Orphan) -> Result<Option<i64>> {
    sql.execute(
        On::Write,
        Statement::new(format!(
            "UPDATE ag_turns SET orphaned_at_ms = COALESCE(orphaned_at_ms, {}) \
             WHERE turn_id = $1 AND state = 'running' AND fence = $2",
            S::NOW_MS
        ))
        .text(orphan.turn_id.as_str())
        .int(orphan.fence.0),
    )
    .await?;
    let row = sql
        .fetch_optional(
            On::Read,
            Statement::new(
                "SELECT orphaned_at_ms FROM ag_turns \
                 WHERE turn_id = $1 AND state = 'running' AND fence = $2",
            )
            .text(orphan.turn_id.as_str())
            .int(orphan.fence.0),
        )
        .await?;
    match row {
        Some(row) => S::columns(&row).int("orphaned_at_ms"),
        None => Ok(None),
    }
}

/// Announces the release of `session_id` inside `tx`, where the store can.
async fn announce<S: OrphanSql>(sql: &S, tx: &mut S::Tx, session_id: &str) -> Result<()> {
    if let Some(statement) = S::ANNOUNCE_RELEASE {
        sql.fetch_optional(
            On::Conn(S::conn(tx)),
            Statement::new(statement).text(session_id),
        )
        .await?;
    }
    Ok(())
}

/// One transaction holding the session's row first, as a begin does, so a
/// concurrent takeover and this step are ordered: the turn ends only if it
/// still runs under the orphan's fence with no live row lease (a takeover
/// changes the fence), and the session is released only if it still names
/// the turn.
async fn abandon_once<S: OrphanSql>(sql: &S, orphan: &Orphan) -> Result<bool> {
    let mut tx = lock_session(sql, orphan.session_id.as_str()).await?;
    let row = sql
        .fetch_one(
            On::Conn(S::conn(&mut tx)),
            Statement::new(format!("SELECT {} AS now_ms", S::NOW_MS)),
        )
        .await?;
    let now = S::columns(&row).int_required("now_ms")?;
    let ended = sql
        .execute(
            On::Conn(S::conn(&mut tx)),
            Statement::new(
                "UPDATE ag_turns SET state = 'abandoned', error = $3, retryable = NULL, \
                 updated_at_ms = $4, ended_at_ms = $4, orphaned_at_ms = NULL \
                 WHERE turn_id = $1 AND state = 'running' AND fence = $2 AND NOT EXISTS ( \
                 SELECT 1 FROM ag_sessions s WHERE s.session_id = ag_turns.session_id \
                 AND s.holder_turn_id = ag_turns.turn_id AND s.lease_expires_at_ms > $4)",
            )
            .text(orphan.turn_id.as_str())
            .int(orphan.fence.0)
            .text(ABANDONED_ERROR)
            .int(now),
        )
        .await?;
    if ended == 0 {
        return Ok(false);
    }
    Error::expect_rows(ended, 1, "the abandoned turn (turn_id is the primary key)")?;
    sql.execute(
        On::Conn(S::conn(&mut tx)),
        Statement::new(
            "UPDATE ag_sessions SET holder_turn_id = NULL, lease_token_hash = NULL, \
             lease_expires_at_ms = NULL, updated_at_ms = $3 \
             WHERE session_id = $1 AND holder_turn_id = $2",
        )
        .text(orphan.session_id.as_str())
        .text(orphan.turn_id.as_str())
        .int(now),
    )
    .await?;
    announce(sql, &mut tx, orphan.session_id.as_str()).await?;
    sql.commit(tx).await?;
    Ok(true)
}

/// The orphans `filter` admits, at most `limit` (and [`MAX_ORPHAN_SCAN`]).
///
/// # Errors
/// `invalid_request` for a filter outside its limits; `store_unavailable`.
pub async fn list<S: OrphanSql>(sql: &S, filter: &OrphanFilter, limit: u32) -> Result<Vec<Orphan>> {
    filter.validate()?;
    let limit = limit.min(MAX_ORPHAN_SCAN);
    let now = sql.now_ms().await?;
    let found = candidates(sql, filter, limit, now).await?;
    let Some(layer) = sql.leases() else {
        return Ok(found);
    };
    let min_age = i64::try_from(filter.min_orphaned_ms).unwrap_or(i64::MAX);
    let mut orphans = Vec::with_capacity(found.len());
    for mut orphan in found {
        if held_by(layer, orphan.session_id.as_str(), orphan.turn_id.as_str()).await? {
            continue;
        }
        let Some(since) = stamp_orphaned(sql, &orphan).await? else {
            continue;
        };
        orphan.orphaned_since_ms = since;
        orphan.orphaned_for_ms = now.saturating_sub(since).max(0);
        if orphan.orphaned_for_ms >= min_age {
            orphans.push(orphan);
        }
    }
    Ok(orphans)
}

/// The heads of session queues, as turns to start by a repeat of their own
/// request ([`Orphan::resume_command`]): of `session` alone when given,
/// whatever its state (its caller just ended the holder and takes the
/// next turn); else of every session whose row names no holder (ended,
/// abandoned or released: a holder whose lease merely expired is an
/// orphan, claimed first) and has been free for `filter.min_orphaned_ms`,
/// longest-free first. The begin decides whether a head may start.
///
/// # Errors
/// `invalid_request` for a filter over its limits; the store's.
pub async fn queue_heads<S: OrphanSql>(
    sql: &S,
    session: Option<&SessionId>,
    filter: &OrphanFilter,
    limit: u32,
) -> Result<Vec<Orphan>> {
    filter.validate()?;
    let limit = limit.min(MAX_ORPHAN_SCAN);
    let now = sql.now_ms().await?;
    let mut statement = Statement::new(format!(
        "SELECT t.turn_id, t.session_id, t.user_id, t.client_request_id, t.fingerprint, \
         t.payload, t.fence, t.attempt, s.updated_at_ms AS orphaned_since_ms, \
         CAST(0 AS {}) AS superseded \
         FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
         WHERE t.queue_seq IS NOT NULL AND t.queue_seq = (SELECT MIN(q.queue_seq) \
           FROM ag_turns q WHERE q.session_id = t.session_id AND q.queue_seq IS NOT NULL)",
        S::BIGINT
    ));
    match session {
        Some(session) => {
            let session = statement.bind(Arg::Text(session.as_str()));
            statement.push(&format!(" AND t.session_id = {session}"));
        }
        None => {
            let min_age = i64::try_from(filter.min_orphaned_ms).unwrap_or(i64::MAX);
            let since = statement.bind(Arg::Int(now.saturating_sub(min_age)));
            statement.push(&format!(
                " AND s.holder_turn_id IS NULL AND s.updated_at_ms <= {since}"
            ));
        }
    }
    filtered(&mut statement, filter);
    let limit = statement.bind(Arg::Int(i64::from(limit)));
    statement.push(&format!(
        " ORDER BY s.updated_at_ms, t.turn_id LIMIT {limit}"
    ));
    let rows = sql.fetch(On::Read, statement).await?;
    rows.iter()
        .map(|row| orphan(&S::columns(row), now))
        .collect()
}

/// Ends `orphan` `abandoned` unless its lease is live again (in the layer or
/// the rows) or a takeover changed its fence; whether it did.
///
/// # Errors
/// `store_unavailable`.
pub async fn abandon<S: OrphanSql>(sql: &S, orphan: &Orphan) -> Result<bool> {
    if let Some(layer) = sql.leases() {
        if held_by(layer, orphan.session_id.as_str(), orphan.turn_id.as_str()).await? {
            return Ok(false);
        }
    }
    let mut retry = Retry::new();
    loop {
        match abandon_once(sql, orphan).await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}

/// One transaction holding the session's row first, as a begin does: the
/// holder the row names (live or expired) ends `abandoned`, and the session
/// is freed with a new fence, so the old holder's lease check fails on
/// every store (its token no longer names the row's holder; with a layer,
/// its layer fence is no longer the session's newest). The released turn.
async fn force_release_once<S: OrphanSql>(
    sql: &S,
    session_id: &str,
    only: Option<&str>,
) -> Result<Option<String>> {
    let mut tx = lock_session(sql, session_id).await?;
    let row = sql
        .fetch_optional(
            On::Conn(S::conn(&mut tx)),
            Statement::new(format!(
                "SELECT s.holder_turn_id, t.state, {} AS now_ms FROM ag_sessions s \
                 LEFT JOIN ag_turns t ON t.turn_id = s.holder_turn_id WHERE s.session_id = $1",
                S::NOW_MS
            ))
            .text(session_id),
        )
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let row = S::columns(&row);
    let holder = row.text("holder_turn_id")?;
    let state = row.text("state")?;
    let now = row.int_required("now_ms")?;
    let Some(turn_id) = release_target(holder.as_deref(), state.as_deref(), only)? else {
        return Ok(None);
    };
    let fence = sql.next_fence(S::conn(&mut tx)).await?;
    let ended = sql
        .execute(
            On::Conn(S::conn(&mut tx)),
            Statement::new(
                "UPDATE ag_turns SET state = 'abandoned', error = $2, retryable = NULL, \
                 updated_at_ms = $3, ended_at_ms = $3, orphaned_at_ms = NULL \
                 WHERE turn_id = $1 AND state = 'running'",
            )
            .text(turn_id)
            .text(RELEASED_ERROR)
            .int(now),
        )
        .await?;
    Error::expect_rows(ended, 1, "the released turn (read running under the lock)")?;
    let freed = sql
        .execute(
            On::Conn(S::conn(&mut tx)),
            Statement::new(
                "UPDATE ag_sessions SET holder_turn_id = NULL, lease_token_hash = NULL, \
                 lease_expires_at_ms = NULL, fence = $3, updated_at_ms = $4 \
                 WHERE session_id = $1 AND holder_turn_id = $2",
            )
            .text(session_id)
            .text(turn_id)
            .int(fence.0)
            .int(now),
        )
        .await?;
    Error::expect_rows(freed, 1, "the released session (read under the lock)")?;
    let turn_id = turn_id.to_owned();
    announce(sql, &mut tx, session_id).await?;
    sql.commit(tx).await?;
    Ok(Some(turn_id))
}

/// An operator's force-release of `session_id` (see
/// [`agentgate_core::store::Store::force_release`]): the released turn, or
/// `None` when the session has no holder. With a lease layer the holder's
/// lease is revoked there after the SQL step, which alone already refuses
/// its writes.
///
/// # Errors
/// `store_unavailable`; `corrupt` for a holder that is not a running turn.
pub async fn force_release<S: OrphanSql>(
    sql: &S,
    session_id: &SessionId,
    only: Option<&TurnId>,
) -> Result<Option<TurnId>> {
    let mut retry = Retry::new();
    let only = only.map(TurnId::as_str);
    let released = loop {
        match force_release_once(sql, session_id.as_str(), only).await {
            Err(error) => retry.after(error).await?,
            Ok(released) => break released,
        }
    };
    let Some(turn_id) = released else {
        return Ok(None);
    };
    if let Some(layer) = sql.leases() {
        layer.revoke(&turn_id).await?;
    }
    Ok(Some(TurnId::new(turn_id).map_err(|e| {
        Error::corrupt(format!("the released holder's id: {e}"))
    })?))
}

/// The running turns asked to stop at least the cancel grace ago that
/// their session's row still names as holder, the longest-asked first, at
/// most `limit` (see [`agentgate_core::store::Store::ignored_cancels`]). A
/// turn whose session passed to another message (its lease lapsed) is an
/// orphan, not the sweep's to release here: listing it would crowd out the
/// ones that are. The scan reads running turns only (the
/// `(state, updated_at_ms)` index): live work, not history.
///
/// # Errors
/// `store_unavailable`; `corrupt` for a stored id that is not one.
pub async fn ignored_cancels<S: Run>(sql: &S, limit: u32) -> Result<Vec<IgnoredCancel>> {
    let grace_ms = sql.config().cancel_grace_ms();
    let statement = Statement::new(format!(
        "SELECT t.session_id, t.turn_id, t.cancel_requested_at_ms, {now} AS now_ms \
         FROM ag_turns t JOIN ag_sessions s ON s.session_id = t.session_id \
         AND s.holder_turn_id = t.turn_id \
         WHERE t.state = 'running' AND t.cancel_requested_at_ms IS NOT NULL \
         AND t.cancel_requested_at_ms <= {now} - $1 \
         ORDER BY t.cancel_requested_at_ms, t.turn_id LIMIT $2",
        now = S::NOW_MS
    ))
    .int(grace_ms)
    .int(i64::from(limit.min(MAX_ORPHAN_SCAN)));
    let rows = sql.fetch(On::Read, statement).await?;
    let mut ignored = Vec::with_capacity(rows.len());
    for row in &rows {
        let row = S::columns(row);
        let requested = row.int_required("cancel_requested_at_ms")?;
        if !cancel_ignored(requested, row.int_required("now_ms")?, grace_ms) {
            continue;
        }
        ignored.push(IgnoredCancel {
            session_id: id(SessionId::new, row.text_required("session_id")?)?,
            turn_id: id(TurnId::new, row.text_required("turn_id")?)?,
        });
    }
    Ok(ignored)
}
