//! The begin step of every SQL store, written once: the retry loop, the
//! one-statement common case tried first ([`BeginTx::begin_new`]), and the
//! full path's decision ([`decide_in`]) applied inside the store's
//! transaction ([`apply`]; both in [`begin_in`]).
//!
//! The store reads the facts where no other begin of the user or the
//! session can change them: PostgreSQL and MySQL lock the user's row and
//! then the session's row (creating either on first use); SQLite holds its
//! single writer ([`BeginSql::lock_and_read`]). This module reads a
//! confirmation's target
//! and its continuation when the decision needs them, asks
//! [`decide_begin`], and applies the answer: a replay reads nothing more,
//! an exhausted turn is failed for good, a start marks a confirmed turn,
//! has the store write the grant's rows ([`BeginSql::write_grant`]).
//!
//! With a lease layer every store's begin is [`layered::begin_layered`]: it
//! decides on a snapshot without locks ([`decide_unlocked`]), acquires the
//! layer's lease, then writes, deciding again under the store's locks and
//! applying the start with that lease already held ([`Lease::Held`]), so
//! no store holds a lock across the layer's round trip. An exhausted turn
//! whose lease the layer still holds is `request_in_flight`, as on every
//! store.

use agentgate_core::decide::{
    decide_begin, reserved_fence, retry_after_ms, BeginDecision, BeginFacts, QueueFacts,
    SessionSnapshot, StartKind, TurnSnapshot, UserLoad,
};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{ClientRequestId, Fence, LeaseToken, SessionId, TurnId, UserId};
use agentgate_core::lease::refuse_if_held;
use agentgate_core::limits::DEAD_CONTINUATION_RETRY;
use agentgate_core::model::{
    BeginCommand, BeginOutcome, ConfirmationContext, Grant, QueuedTurn, TurnView,
};
use serde_json::Value;

use crate::query::{On, Run, Statement};
use crate::rows::{
    count, id, json, prefixed, session_snapshot, Columns, Prefixed, TurnRow, TURN_COLUMNS,
};
use crate::Retry;

pub mod layered;

/// A turn row as a begin reads it: what `decide` needs, what a replay
/// answers, and the `pending` column as stored (a confirmation copies it
/// verbatim to the turn it begins).
#[derive(Clone, Debug)]
pub struct TurnRecord {
    /// What the decision reads.
    pub snapshot: TurnSnapshot,
    /// What a replay answers.
    pub view: TurnView,
    /// The turn's pending action as stored.
    pub pending_text: Option<String>,
}

impl TurnRecord {
    /// The turn in `row` ([`TURN_COLUMNS`]), or `None` when an outer join
    /// found no turn (`turn_id` is NULL).
    ///
    /// # Errors
    /// `corrupt` for a row the engine never writes.
    pub fn read(row: &impl Columns) -> Result<Option<Self>> {
        let Some(turn) = TurnRow::read_optional(row)? else {
            return Ok(None);
        };
        let pending_text = turn.pending.clone();
        Ok(Some(Self {
            snapshot: turn.snapshot()?,
            view: turn.view()?,
            pending_text,
        }))
    }
}

/// What a begin read under its locks.
#[derive(Debug)]
pub struct Facts {
    /// The store's clock.
    pub now_ms: i64,
    /// The user's permits.
    pub load: UserLoad,
    /// The request's own turn, if recorded.
    pub turn: Option<TurnRecord>,
    /// The session's queue.
    pub queue: QueueRead,
}

/// A session's queue as a begin reads it: the columns of
/// [`queue_columns`].
#[derive(Clone, Debug, Default)]
pub struct QueueRead {
    /// The head's turn id.
    pub head: Option<String>,
    /// How many turns are queued.
    pub len: u32,
    /// The highest queue number in use (0: none).
    pub tail: i64,
    /// How many turns the requesting user has queued, in all sessions.
    pub user_len: u32,
}

impl QueueRead {
    /// The queue in a row that selected [`queue_columns`].
    ///
    /// # Errors
    /// `corrupt` for a length outside `u32`, or a queue whose length, head
    /// and tail disagree.
    pub fn read(row: &impl Columns) -> Result<Self> {
        let len = count(row.int_required("queue_len")?)?;
        let head = row.text("queue_head")?;
        let tail = row.int("queue_tail")?;
        // How it compares with `len` is `decide_begin`'s to judge: only
        // on the requester's own session must it be at least `len`.
        let user_len = count(row.int_required("user_queued")?)?;
        match (len, &head, tail) {
            (0, None, None) => Ok(Self {
                user_len,
                ..Self::default()
            }),
            (1.., Some(_), Some(tail)) if tail > 0 => Ok(Self {
                head,
                len,
                tail,
                user_len,
            }),
            _ => Err(Error::corrupt(format!(
                "a session queue of {len} turns with head {head:?} and tail {tail:?}"
            ))),
        }
    }
}

/// The select-list columns of a session's queue (`queue_len`,
/// `queue_tail`, `queue_head`) and of its user's queued turns in every
/// session (`user_queued`): the session bound at each of the three
/// placeholders `session` names (one `$n` three times, or three `?`), the
/// user at `user`'s, which comes after them.
pub fn queue_columns(session: [&str; 3], user: &str) -> String {
    let [a, b, c] = session;
    format!(
        "(SELECT COUNT(*) FROM ag_turns q WHERE q.session_id = {a} \
           AND q.queue_seq IS NOT NULL) AS queue_len, \
         (SELECT MAX(q.queue_seq) FROM ag_turns q WHERE q.session_id = {b} \
           AND q.queue_seq IS NOT NULL) AS queue_tail, \
         (SELECT q.turn_id FROM ag_turns q WHERE q.session_id = {c} \
           AND q.queue_seq IS NOT NULL ORDER BY q.queue_seq LIMIT 1) AS queue_head, \
         (SELECT COUNT(*) FROM ag_turns q WHERE q.user_id = {user} \
           AND q.queue_seq IS NOT NULL) AS user_queued"
    )
}

/// The session's row, locked, and the facts read after the locks.
#[derive(Debug)]
pub struct Locked {
    /// The session as the decision sees it (`None`: no row yet).
    pub session: Option<SessionSnapshot>,
    /// The newest fence granted on the session.
    pub session_fence: i64,
    /// The clock, the permits and the request's turn.
    pub facts: Facts,
}

/// Where a start's lease comes from.
#[derive(Debug)]
pub enum Lease {
    /// The start takes it in the session's row (no lease layer); the grant
    /// takes the fence.
    Take,
    /// The lease layer already holds it (SQLite acquires before it takes
    /// its single writer): the turn, token and fence it was acquired with,
    /// and what remains of it.
    Held(Held),
}

/// A lease the lease layer holds for a start not yet written.
#[derive(Debug)]
pub struct Held {
    /// The turn the lease was acquired for: the request's existing turn,
    /// or the id the new turn gets.
    pub turn_id: TurnId,
    /// The lease's token.
    pub token: LeaseToken,
    /// The fence it was acquired with, taken before the transaction.
    pub fence: Fence,
    /// What remains of the lease, as the layer answered.
    pub lease_expires_in_ms: i64,
}

/// The rows a start writes, for the dialect's [`BeginSql::write_grant`]:
/// the session's grant (holder, token digest, a fence, the expiry, and the
/// pending confirmation cleared when the start answers it) and the turn
/// under that fence (the request's existing turn restarted, or a new one
/// inserted `running` with `attempt`).
#[derive(Debug)]
pub struct GrantRows<'a> {
    /// The begin.
    pub command: &'a BeginCommand,
    /// The store's clock when the facts were read.
    pub now_ms: i64,
    /// The turn: the request's existing one when `restart`, else new.
    pub turn_id: &'a TurnId,
    /// The request already has this turn, which the start restarts.
    pub restart: bool,
    /// The new lease token's digest.
    pub token_hash: &'a str,
    /// The turn's attempt number.
    pub attempt: u32,
    /// The fence reserved before the transaction, checked newer than the
    /// session's; `None` when the dialect takes it in its grant.
    pub reserved: Option<Fence>,
    /// The session row's lease expiry: `None` with a lease layer, which is
    /// the authority on liveness (the row keeps the holder and the fence).
    pub row_expiry: Option<i64>,
    /// This start answers the session's pending confirmation, which it
    /// clears.
    pub confirming: bool,
    /// The confirmed turn's pending action, as stored, for a new turn.
    pub pending: Option<&'a str>,
}

/// The SQL a store supplies for a begin. Every method runs inside the
/// begin's transaction `tx`.
#[async_trait::async_trait]
pub trait BeginSql: crate::StepTx {
    /// Locks the user's row, then the session's (creating either on first
    /// use, the session bound to the caller), then reads the facts.
    async fn lock_and_read(&self, tx: &mut Self::Conn, command: &BeginCommand) -> Result<Locked>;

    /// Writes [`GrantRows`] (taking the fence unless one was reserved);
    /// returns the fence.
    ///
    /// # Errors
    /// `corrupt` when a row it must write was not.
    async fn write_grant(&self, tx: &mut Self::Conn, rows: &GrantRows<'_>) -> Result<Fence>;
}

/// Writes the grant on the session's row inside the begin's transaction
/// `conn`, for a store that writes it in a statement of its own: `sql_text`
/// sets, on the session `$1` (of the user `$2`), the holder `$3`, the token
/// digest `$4`, the fence `$5`, the lease's expiry in the row `$6` (NULL
/// with a lease layer), `updated_at_ms` `$7`, and clears the pending
/// confirmation when `$8` is 1 (this start confirms it).
///
/// # Errors
/// `corrupt` unless exactly one session row changed; the store's error.
pub async fn grant_session<S: Run>(
    sql: &S,
    conn: &mut S::Conn,
    sql_text: &str,
    rows: &GrantRows<'_>,
    fence: Fence,
) -> Result<()> {
    let statement = Statement::new(sql_text)
        .text(rows.command.session_id.as_str())
        .text(rows.command.user_id.as_str())
        .text(rows.turn_id.as_str())
        .text(rows.token_hash)
        .int(fence.0)
        .opt_int(rows.row_expiry)
        .int(rows.now_ms)
        .int(i64::from(rows.confirming));
    let granted = sql.execute(On::Conn(conn), statement).await?;
    Error::expect_rows(granted, 1, "the session's grant")
}

/// Writes a grant's turn inside the begin's transaction `conn`: the
/// existing turn restarted (`rows.restart`) or the new one inserted,
/// running under `fence`, for a store that writes the session's row in a
/// statement of its own.
///
/// # Errors
/// `corrupt` when no turn row was written; the store's error.
pub async fn write_turn<S: Run>(
    sql: &S,
    conn: &mut S::Conn,
    rows: &GrantRows<'_>,
    fence: Fence,
) -> Result<()> {
    let command = rows.command;
    let statement = if rows.restart {
        Statement::new(
            "UPDATE ag_turns SET state = 'running', attempt = $1, fence = $2, error = NULL, \
             retryable = NULL, updated_at_ms = $3, ended_at_ms = NULL, orphaned_at_ms = NULL, \
             queue_seq = NULL WHERE turn_id = $4",
        )
        .int(i64::from(rows.attempt))
        .int(fence.0)
        .int(rows.now_ms)
        .text(rows.turn_id.as_str())
    } else {
        // The pending action is copied as the canonical text it is stored as.
        let confirmation = command.confirmation.as_ref();
        Statement::new(
            "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint, \
             state, attempt, fence, confirms_pending, confirms_turn_id, decision, created_at_ms, \
             updated_at_ms, payload) \
             VALUES ($1, $2, $3, $4, $5, 'running', $6, $7, $8, $9, $10, $11, $11, $12)",
        )
        .text(rows.turn_id.as_str())
        .text(command.session_id.as_str())
        .text(command.user_id.as_str())
        .text(command.client_request_id.as_str())
        .text(command.fingerprint.as_hex())
        .int(i64::from(rows.attempt))
        .int(fence.0)
        .opt_text(rows.pending)
        .opt_text(confirmation.map(|c| c.turn_id.as_str()))
        .opt_text(confirmation.map(|c| c.decision.as_str()))
        .int(rows.now_ms)
        .text(command.payload.as_str())
    };
    let written = sql.execute(On::Conn(conn), statement).await?;
    Error::expect_rows(written, 1, "the turn's grant")
}

/// A store's one-statement common case of a begin without a lease layer.
#[async_trait::async_trait]
pub trait BeginTx: BeginSql {
    /// The common case as one autocommit statement (a new request on a free
    /// session of the caller's, below the user's cap, no confirmation): it
    /// writes the grant, or nothing when the full path must decide. Its
    /// arguments: `$1` session, `$2` user, `$3` request id, `$4` the new
    /// turn's id, `$5` its token's digest, `$6` the request's fingerprint,
    /// `$7` payload, `$8` the lease TTL in ms, `$9` the default cap.
    fn begin_new_sql() -> String;

    /// The fence the statement's rows say it granted under, `None` when it
    /// wrote nothing.
    ///
    /// # Errors
    /// `corrupt` for rows it never answers.
    fn granted_fence(&self, rows: &[Self::Row]) -> Result<Option<i64>>;

    /// The common case in one statement: the grant, or `None` when the full
    /// path must decide, in which case nothing was written. Never tried
    /// with a lease layer or for a confirmation.
    async fn begin_new(&self, command: &BeginCommand) -> Result<Option<Grant>> {
        if self.leases().is_some() || command.confirmation.is_some() {
            return Ok(None);
        }
        let turn_id = TurnId::generate();
        let token = LeaseToken::generate();
        let digest = token.digest_hex();
        let ttl_ms = self.config().lease_ttl_ms();
        let statement = Statement::new(Self::begin_new_sql())
            .text(command.session_id.as_str())
            .text(command.user_id.as_str())
            .text(command.client_request_id.as_str())
            .text(turn_id.as_str())
            .text(&digest)
            .text(command.fingerprint.as_hex())
            .text(command.payload.as_str())
            .int(ttl_ms)
            .int(i64::from(self.config().max_turns_per_user));
        // Read to the end, so the statement runs to completion and its
        // autocommit transaction commits before the grant is handed out.
        let rows = self.fetch(On::Write, statement).await?;
        Ok(self
            .granted_fence(&rows)?
            .map(|fence| Grant::first(command, turn_id, token, Fence(fence), ttl_ms)))
    }
}

/// A begin: with a lease layer the layered one
/// ([`layered::begin_layered`]); without, the common case, else the full
/// path, the whole step run again after a transient conflict, at most
/// `MAX_STORE_RETRIES` times.
///
/// # Errors
/// The decision's refusal, or the store's error.
pub async fn begin<S: BeginTx + layered::LayeredBeginSql>(
    sql: &S,
    command: &BeginCommand,
) -> Result<BeginOutcome> {
    if let Some(layer) = sql.shared_leases() {
        return layered::begin_layered(sql, layer, command).await;
    }
    let mut retry = Retry::new();
    loop {
        let attempt = async {
            if let Some(grant) = sql.begin_new(command).await? {
                return Ok(BeginOutcome::Started(grant));
            }
            begin_full(sql, command).await
        };
        match attempt.await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}

/// The full path without a lease layer: [`begin_in`] in the store's begin
/// transaction, committed when it wrote (a replay or a refusal wrote
/// nothing, and dropping the transaction rolls back its no-op lock
/// upserts). The fence is taken inside the grant.
///
/// # Errors
/// The decision's refusal, or the store's error.
pub async fn begin_full<S: BeginSql>(sql: &S, command: &BeginCommand) -> Result<BeginOutcome> {
    let mut tx = sql.transaction().await?;
    let answer = begin_in(sql, S::conn(&mut tx), command).await;
    commit_if_wrote(sql, tx, answer).await
}

/// Commits `tx` when `answer` says it wrote; otherwise (a replay, a
/// refusal, an error the server answered) gives it up, rolled back.
///
/// # Errors
/// `answer`'s, or the commit's.
pub(crate) async fn commit_if_wrote<S: BeginSql>(
    sql: &S,
    tx: S::Tx,
    answer: Result<(BeginOutcome, bool)>,
) -> Result<BeginOutcome> {
    match answer {
        Ok((outcome, true)) => {
            sql.commit(tx).await?;
            Ok(outcome)
        }
        Ok((outcome, false)) => {
            S::abandon(tx);
            Ok(outcome)
        }
        Err(error) => {
            if crate::tx::answered(&error) {
                S::abandon(tx);
            }
            Err(error)
        }
    }
}

/// A start, applied: a new lease token (or the held one); for a new turn
/// that answers a pending confirmation, the confirmed turn marked and its
/// action carried; the dialect's [`BeginSql::write_grant`]. With a lease
/// layer the lease is always held already ([`layered`]).
async fn start<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    command: &BeginCommand,
    read: &Read,
    (kind, attempt): (StartKind, u32),
    lease: Lease,
) -> Result<Grant> {
    let facts = &read.facts;
    let ttl_ms = sql.config().lease_ttl_ms();
    // Without a lease layer the start takes the lease in the session's row;
    // with one, the layered begin acquired it before (anything else is a
    // bug, caught before a row is written).
    let (token, held, lease_expires_in_ms) = match (lease, sql.leases()) {
        (Lease::Take, None) => (LeaseToken::generate(), None, ttl_ms),
        (Lease::Held(held), Some(_)) => (
            held.token,
            Some((held.turn_id, held.fence)),
            held.lease_expires_in_ms,
        ),
        (Lease::Held(_), None) => return Err(Error::corrupt("a held lease without a lease layer")),
        (Lease::Take, Some(_)) => {
            return Err(Error::corrupt(
                "a start under a lease layer whose lease was not taken first",
            ))
        }
    };
    let reserved = reserved_fence(held.as_ref().map(|(_, fence)| *fence), read.session_fence)?;
    let token_hash = token.digest_hex();
    let confirming = command.confirmation.is_some() && kind == StartKind::New;
    let new_turn_id = || {
        held.as_ref()
            .map_or_else(TurnId::generate, |(turn_id, _)| turn_id.clone())
    };
    let (turn_id, confirmation, pending) = match &facts.turn {
        Some(existing) => {
            if held
                .as_ref()
                .is_some_and(|(turn_id, _)| *turn_id != existing.view.turn_id)
            {
                return Err(Error::corrupt(format!(
                    "a lease held for another turn than {}",
                    existing.view.turn_id
                )));
            }
            (
                existing.view.turn_id.clone(),
                existing.view.confirmation.clone(),
                None,
            )
        }
        None if confirming => {
            let turn_id = new_turn_id();
            let target = read.confirm_target.as_ref();
            let (context, pending) =
                mark_confirmed(sql, tx, command, target, &turn_id, facts.now_ms).await?;
            (turn_id, Some(context), pending)
        }
        None => (new_turn_id(), None, None),
    };
    if kind == StartKind::Dequeue {
        // A cancel of a queued turn takes no session lock: it may have
        // ended the head since the decision read it. Taking the head out of
        // its queue only while it is still queued orders the two (a cancel
        // after this finds it running, and asks it to stop); a cancel
        // before it makes the step decide again, and replay the cancel.
        let dequeued = sql
            .execute(
                On::Conn(tx),
                Statement::new(
                    "UPDATE ag_turns SET queue_seq = NULL \
                     WHERE turn_id = $1 AND state = 'queued' AND queue_seq IS NOT NULL",
                )
                .text(turn_id.as_str()),
            )
            .await?;
        match dequeued {
            1 => {}
            0 => return Err(Error::conflict("begin: the queued turn left its queue")),
            more => Error::expect_rows(more, 1, "the dequeued turn (turn_id is the key)")?,
        }
    }
    let rows = GrantRows {
        command,
        now_ms: facts.now_ms,
        turn_id: &turn_id,
        restart: facts.turn.is_some(),
        token_hash: &token_hash,
        attempt,
        reserved,
        row_expiry: match sql.leases() {
            Some(_) => None,
            None => Some(facts.now_ms + ttl_ms),
        },
        confirming,
        pending: pending.as_deref(),
    };
    let fence = sql.write_grant(tx, &rows).await?;
    if reserved.is_some_and(|reserved| reserved != fence) {
        return Err(Error::corrupt(format!(
            "a grant reserved fence {reserved:?} and wrote {fence:?}"
        )));
    }
    Ok(Grant {
        turn_id,
        session_id: command.session_id.clone(),
        user_id: command.user_id.clone(),
        client_request_id: command.client_request_id.clone(),
        lease_token: token,
        fence,
        attempt,
        takeover: kind == StartKind::Takeover,
        lease_expires_in_ms,
        confirmation,
    })
}

/// Marks the confirmation's target (read under the session's lock, so
/// still as read) `confirmed` by `turn_id`; returns the context the new
/// turn carries and the target's pending action as stored.
async fn mark_confirmed<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    command: &BeginCommand,
    target: Option<&TurnRecord>,
    turn_id: &TurnId,
    now: i64,
) -> Result<(ConfirmationContext, Option<String>)> {
    let confirmation = command
        .confirmation
        .as_ref()
        .ok_or_else(|| Error::corrupt("confirming without a confirmation"))?;
    let updated = sql
        .execute(
            On::Conn(tx),
            Statement::new(
                "UPDATE ag_turns SET state = 'confirmed', confirmed_by = $1, updated_at_ms = $2 \
                 WHERE turn_id = $3 AND state = 'awaiting_confirmation'",
            )
            .text(turn_id.as_str())
            .int(now)
            .text(confirmation.turn_id.as_str()),
        )
        .await?;
    let target = match (updated, target) {
        (1, Some(target)) => target,
        (0, _) => {
            return Err(Error::not_found(format!(
                "pending confirmation of turn {}",
                confirmation.turn_id
            )))
        }
        (updated, target) => {
            return Err(Error::corrupt(format!(
                "confirming turn {} changed {updated} rows (target read: {})",
                confirmation.turn_id,
                target.is_some()
            )))
        }
    };
    let pending = target.pending_text.clone();
    let context = ConfirmationContext {
        turn_id: confirmation.turn_id.clone(),
        decision: confirmation.decision,
        pending: json(pending.clone())?.unwrap_or(Value::Null),
    };
    Ok((context, pending))
}

/// One turn by id, inside the begin's transaction.
async fn turn_by_id<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    turn_id: &str,
) -> Result<Option<TurnRecord>> {
    let statement = Statement::new(format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = $1"
    ))
    .text(turn_id);
    match sql.fetch_optional(On::Conn(tx), statement).await? {
        Some(row) => TurnRecord::read(&S::columns(&row)),
        None => Ok(None),
    }
}

/// Fails a turn that used all its attempts, for good; its view after.
///
/// # Errors
/// The store's; `corrupt` when the turn's row is not there to fail.
pub async fn exhaust<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    turn_id: &str,
    now: i64,
) -> Result<TurnView> {
    let failed = sql
        .execute(
            On::Conn(tx),
            Statement::new(
                "UPDATE ag_turns SET state = 'failed', retryable = FALSE, \
                 error = '{\"code\":\"attempts_exhausted\"}', updated_at_ms = $1, ended_at_ms = $1 \
                 WHERE turn_id = $2",
            )
            .int(now)
            .text(turn_id),
        )
        .await?;
    Error::expect_rows(failed, 1, "the exhausted turn")?;
    let turn = turn_by_id(sql, tx, turn_id)
        .await?
        .ok_or_else(|| Error::corrupt(format!("turn {turn_id} vanished while it was failed")))?;
    Ok(turn.view)
}

/// What a begin read and what `decide_begin` answered on it.
#[derive(Debug)]
pub struct Decided {
    /// The answer.
    pub decision: BeginDecision,
    /// What it was given.
    pub read: Read,
}

/// What a begin read: the facts and the confirmation chain they name.
#[derive(Debug)]
pub struct Read {
    /// The newest fence granted on the session (0 before its first grant).
    pub session_fence: i64,
    /// The session as the decision saw it.
    pub session: Option<SessionSnapshot>,
    /// The clock, the permits and the request's turn.
    pub facts: Facts,
    /// The turn the command confirms, when it has no turn of its own yet.
    confirm_target: Option<TurnRecord>,
    /// The turn that already answered that confirmation, if any.
    continuation: Option<TurnRecord>,
}

/// Reads the facts on `conn` ([`BeginSql::lock_and_read`]) and the
/// confirmation chain they name, and asks [`decide_begin`].
///
/// # Errors
/// The store's.
pub async fn decide_in<S: BeginSql>(
    sql: &S,
    conn: &mut S::Conn,
    command: &BeginCommand,
) -> Result<Decided> {
    let locked = sql.lock_and_read(conn, command).await?;
    decide_on(sql, conn, command, locked).await
}

/// [`decide_in`] on facts read without locks ([`read_unlocked`]): a guess
/// that a layered begin makes before it asks the lease layer, and checks
/// again where no other begin can change the facts.
///
/// # Errors
/// The store's.
pub async fn decide_unlocked<S: BeginSql>(
    sql: &S,
    conn: &mut S::Conn,
    command: &BeginCommand,
) -> Result<Decided> {
    let locked = read_unlocked(sql, conn, command).await?;
    decide_on(sql, conn, command, locked).await
}

/// Everything `decide_begin` reads about a request but the confirmation
/// chain, in one statement that takes no lock: the store's clock (one
/// reading per statement on every store), the user's load (cap override, live permits, soonest expiry),
/// the session (`None`: no row) and its newest fence, and the request's
/// turn (its columns under the prefix `t_`). SQLite reads it under its
/// single writer; every store reads it for a layered begin's first guess.
///
/// # Errors
/// The store's; `corrupt` for a session without a fence.
pub async fn read_unlocked<S: Run>(
    sql: &S,
    conn: &mut S::Conn,
    command: &BeginCommand,
) -> Result<Locked> {
    let now = S::NOW_MS;
    let statement = Statement::new(format!(
        "SELECT l.now_ms, l.cap, l.live, l.soonest, \
         s.user_id, s.holder_turn_id, s.lease_expires_at_ms, s.pending_turn_id, \
         s.pending_expires_at_ms, s.fence AS session_fence, {turn}, {queue} \
         FROM (SELECT {now} AS now_ms, \
                 (SELECT max_turns FROM ag_users WHERE user_id = $1) AS cap, \
                 COUNT(*) AS live, MIN(lease_expires_at_ms) AS soonest \
               FROM ag_sessions WHERE user_id = $1 AND lease_expires_at_ms > {now}) l \
         LEFT JOIN ag_sessions s ON s.session_id = $2 \
         LEFT JOIN ag_turns t ON t.session_id = $2 AND t.client_request_id = $3",
        turn = prefixed(TURN_COLUMNS, "t", "t_"),
        queue = queue_columns(["$2"; 3], "$1"),
    ))
    .text(command.user_id.as_str())
    .text(command.session_id.as_str())
    .text(command.client_request_id.as_str());
    let row = sql.fetch_one(On::Conn(conn), statement).await?;
    let row = S::columns(&row);
    let session = match row.text("user_id")? {
        Some(_) => Some(session_snapshot(&row)?),
        None => None,
    };
    let session_fence = match (row.int("session_fence")?, &session) {
        (Some(fence), Some(_)) => fence,
        (None, Some(_)) => return Err(Error::corrupt("a session without a fence")),
        // 0 before the session's first grant: every fence is above it.
        (_, None) => 0,
    };
    Ok(Locked {
        session,
        session_fence,
        facts: Facts {
            now_ms: row.int_required("now_ms")?,
            load: UserLoad::read(
                row.int("cap")?,
                sql.config().max_turns_per_user,
                row.int_required("live")?,
                row.int("soonest")?,
            )?,
            turn: TurnRecord::read(&Prefixed {
                row: &row,
                prefix: "t_",
            })?,
            queue: QueueRead::read(&row)?,
        },
    })
}

/// The tail of [`decide_in`]: the confirmation chain `locked` names, and
/// the decision.
pub(crate) async fn decide_on<S: BeginSql>(
    sql: &S,
    conn: &mut S::Conn,
    command: &BeginCommand,
    locked: Locked,
) -> Result<Decided> {
    let Locked {
        session,
        session_fence,
        facts,
    } = locked;
    let confirms = command.confirmation.as_ref().map(|c| c.turn_id.as_str());
    let confirm_target = match (confirms, &facts.turn) {
        (Some(target), None) => turn_by_id(sql, conn, target).await?,
        _ => None,
    };
    let continuation = match confirm_target
        .as_ref()
        .and_then(|t| t.snapshot.confirmed_by.as_deref())
    {
        Some(next) => turn_by_id(sql, conn, next).await?,
        None => None,
    };
    let decision = decide_begin(&BeginFacts {
        now_ms: facts.now_ms,
        user_id: command.user_id.as_str(),
        session_id: command.session_id.as_str(),
        fingerprint: command.fingerprint.as_hex(),
        confirms,
        session: session.as_ref(),
        turn: facts.turn.as_ref().map(|t| &t.snapshot),
        confirm_target: confirm_target.as_ref().map(|t| &t.snapshot),
        continuation: continuation.as_ref().map(|t| &t.snapshot),
        load: facts.load,
        resume_only: command.resume_only,
        queue: QueueFacts {
            head: facts.queue.head.as_deref(),
            len: facts.queue.len,
            user_len: facts.queue.user_len,
        },
        enqueue: command.queue,
    });
    Ok(Decided {
        decision,
        read: Read {
            session_fence,
            session,
            facts,
            confirm_target,
            continuation,
        },
    })
}

/// The view a [`BeginDecision::Replay`] of `turn_id` answers: a turn
/// [`decide_in`] already read, else read on `conn`.
///
/// # Errors
/// The store's; `corrupt` when the turn is gone.
pub async fn replay<S: BeginSql>(
    sql: &S,
    conn: &mut S::Conn,
    read: &Read,
    turn_id: &str,
) -> Result<TurnView> {
    let known = [&read.facts.turn, &read.continuation]
        .into_iter()
        .flatten()
        .find(|t| t.view.turn_id.as_str() == turn_id);
    match known {
        Some(turn) => Ok(turn.view.clone()),
        None => Ok(turn_by_id(sql, conn, turn_id)
            .await?
            .ok_or_else(|| Error::corrupt(format!("replayed turn {turn_id} vanished")))?
            .view),
    }
}

/// Applies `decided` inside `tx`; the flag says whether it wrote anything
/// (a replay or a refusal writes nothing, so the caller rolls back).
///
/// # Errors
/// The decision's refusal, or the store's error.
pub async fn apply<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    command: &BeginCommand,
    Decided { decision, read }: Decided,
    lease: Lease,
) -> Result<(BeginOutcome, bool)> {
    match decision {
        BeginDecision::Reject(error) => Err(error),
        BeginDecision::Replay { turn_id } => Ok((
            BeginOutcome::Replay(replay(sql, tx, &read, &turn_id).await?),
            false,
        )),
        BeginDecision::Exhaust => {
            let turn_id = read
                .facts
                .turn
                .as_ref()
                .map(|t| t.snapshot.turn_id.as_str())
                .ok_or_else(|| Error::corrupt("exhausting a begin that has no turn"))?;
            if let Some(layer) = sql.leases() {
                refuse_if_held(layer, command.session_id.as_str(), turn_id).await?;
            }
            let view = exhaust(sql, tx, turn_id, read.facts.now_ms).await?;
            Ok((BeginOutcome::Replay(view), true))
        }
        BeginDecision::Start { kind, attempt } => {
            let grant = start(sql, tx, command, &read, (kind, attempt), lease).await?;
            Ok((BeginOutcome::Started(grant), true))
        }
        BeginDecision::Enqueue { supersede } => {
            let queued = enqueue(sql, tx, command, &read, supersede).await?;
            Ok((BeginOutcome::Queued(queued), true))
        }
        BeginDecision::Queued { turn_id } => {
            // A cancel takes no session lock: the turn may have left its
            // queue since the decision; decide again.
            let queued = queued_turn(sql, tx, &turn_id, queue_retry(&read))
                .await?
                .ok_or_else(|| Error::conflict(format!("queued turn {turn_id} left its queue")))?;
            Ok((BeginOutcome::Queued(queued), false))
        }
    }
}

/// When a queued request should look again: the holder's remaining lease
/// as the decision read it (the queue moves at the latest then), else
/// [`DEAD_CONTINUATION_RETRY`] (a free session whose head is about to be
/// taken, or a lease kept by the layer).
pub(crate) fn queue_retry(read: &Read) -> std::time::Duration {
    let now = read.facts.now_ms;
    read.session
        .as_ref()
        .and_then(|s| s.live_holder(now))
        .map_or(DEAD_CONTINUATION_RETRY, |h| {
            retry_after_ms(h.lease_expires_at_ms - now)
        })
}

/// Queues the request behind the session's queue, read under the
/// session's lock (after ending every queued turn `superseded` first when
/// it `supersede`s them); its place in the queue.
///
/// # Errors
/// The store's; `corrupt` when the queue is not the one the decision read.
async fn enqueue<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    command: &BeginCommand,
    read: &Read,
    supersede: bool,
) -> Result<QueuedTurn> {
    let now = read.facts.now_ms;
    let queue = &read.facts.queue;
    if supersede {
        let superseded = sql
            .execute(
                On::Conn(tx),
                Statement::new(
                    "UPDATE ag_turns SET state = 'superseded', queue_seq = NULL, \
                     updated_at_ms = $1, ended_at_ms = $1 \
                     WHERE session_id = $2 AND queue_seq IS NOT NULL",
                )
                .int(now)
                .text(command.session_id.as_str()),
            )
            .await?;
        // Only a cancel (which takes no session lock) can have taken a
        // queued turn out since the queue was read; nothing can add one.
        if superseded > u64::from(queue.len) {
            return Err(Error::corrupt(format!(
                "superseding a queue of {} changed {superseded} rows",
                queue.len
            )));
        }
    }
    let turn_id = TurnId::generate();
    let inserted = sql
        .execute(
            On::Conn(tx),
            Statement::new(
                "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, \
                 fingerprint, state, attempt, fence, created_at_ms, updated_at_ms, payload, \
                 queue_seq) VALUES ($1, $2, $3, $4, $5, 'queued', 0, 0, $6, $6, $7, $8)",
            )
            .text(turn_id.as_str())
            .text(command.session_id.as_str())
            .text(command.user_id.as_str())
            .text(command.client_request_id.as_str())
            .text(command.fingerprint.as_hex())
            .int(now)
            .text(command.payload.as_str())
            .int(queue.tail + 1),
        )
        .await?;
    Error::expect_rows(inserted, 1, "the queued turn")?;
    let position = if supersede { 1 } else { queue.len + 1 };
    Ok(QueuedTurn {
        turn_id,
        session_id: command.session_id.clone(),
        user_id: command.user_id.clone(),
        client_request_id: command.client_request_id.clone(),
        position,
        enqueued_at_ms: now,
        retry_after: queue_retry(read),
    })
}

/// A queued turn and its place in its session's queue, read on `conn`;
/// `None` when the turn is not queued (any more).
///
/// # Errors
/// The store's; `corrupt` for a row the engine never writes.
pub async fn queued_turn<S: Run>(
    sql: &S,
    conn: &mut S::Conn,
    turn_id: &str,
    retry_after: std::time::Duration,
) -> Result<Option<QueuedTurn>> {
    let row = sql
        .fetch_optional(
            On::Conn(conn),
            Statement::new(
                "SELECT t.session_id, t.user_id, t.client_request_id, t.created_at_ms, \
                 (SELECT COUNT(*) FROM ag_turns q WHERE q.session_id = t.session_id \
                   AND q.queue_seq IS NOT NULL AND q.queue_seq <= t.queue_seq) AS position \
                 FROM ag_turns t WHERE t.turn_id = $1 AND t.queue_seq IS NOT NULL",
            )
            .text(turn_id),
        )
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let row = S::columns(&row);
    let position = count(row.int_required("position")?)?;
    if position == 0 {
        return Err(Error::corrupt(format!(
            "queued turn {turn_id} at position 0"
        )));
    }
    Ok(Some(QueuedTurn {
        turn_id: id(TurnId::new, turn_id.to_owned())?,
        session_id: id(SessionId::new, row.text_required("session_id")?)?,
        user_id: id(UserId::new, row.text_required("user_id")?)?,
        client_request_id: id(
            ClientRequestId::new,
            row.text_required("client_request_id")?,
        )?,
        position,
        enqueued_at_ms: row.int_required("created_at_ms")?,
        retry_after,
    }))
}

/// Runs one begin without a lease layer inside `tx`: [`decide_in`], then
/// [`apply`] with the lease taken in the session's row.
///
/// # Errors
/// The decision's refusal, or the store's error.
pub async fn begin_in<S: BeginSql>(
    sql: &S,
    tx: &mut S::Conn,
    command: &BeginCommand,
) -> Result<(BeginOutcome, bool)> {
    let decided = decide_in(sql, tx, command).await?;
    apply(sql, tx, command, decided, Lease::Take).await
}
