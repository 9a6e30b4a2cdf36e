//! The begin step: lock the user's row, then the session's row, read the
//! snapshot, ask `decide_begin`, apply, in one READ COMMITTED transaction.
//!
//! The user's row lock serialises every begin of one user, so the count of
//! live leases read after it cannot race another grant (the permit). The
//! session's row lock serialises every step on the session, so the
//! `(session_id, client_request_id)` insert never meets a concurrent twin.
//! Both rows are created on first use by the locking upsert itself; a begin
//! that is refused rolls back, so nothing is written.
//!
//! The session lease and the user's permit are one row write (a user's live
//! permits are its sessions with a live lease), so they are taken together or
//! not at all.
//!
//! The fence counter is one row that every grant in the database locks until
//! it commits, so it is taken last, right before the two writes that need
//! it: grants of different users queue on it for two statements and a
//! commit only.
//!
//! With an external lease layer the decision sees no live lease in the rows
//! (they keep no expiry); the layer's atomic acquire decides busy and
//! capacity, and a grant that then fails to commit gives the layer's lease
//! straight back. The fence is then taken before the transaction, in its own
//! autocommit statement on the same connection, so the counter row is never
//! locked across the Redis round trip; the session's row lock keeps every
//! other grant of the session out until this one commits, and a grant that
//! committed between the fence and the lock (its fence is newer) sends this
//! begin round again.
//!
//! Without an external lease layer a begin first tries `fast::begin`: one
//! `CALL` of a stored procedure that takes the same locks in the same
//! order, reads the same facts after them and starts the turn when the
//! facts are the common case (a new turn on a free session of the caller's,
//! below the cap, no confirmation), or writes nothing. Only then does the
//! full path below run; `fast::begin` says why both always agree with
//! `decide_begin`.
//!
//! Round trips: the common case 1 (the `CALL`). The full path: `BEGIN`,
//! user upsert, session upsert, session lock, facts (clock, cap, permit
//! count, the request's turn), then for a start the fence, the session
//! grant and the turn write, and `COMMIT`: nine, plus the declined `CALL`
//! before it (none for a confirmation or with a lease layer, which skip
//! it). A confirmation adds one read of its target (and one more when the
//! target was already confirmed) and one `UPDATE` of it.

use agentgate_core::decide::{SessionSnapshot, StartKind, UserLoad};
use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{Fence, LeaseToken, TurnId};
use agentgate_core::lease::{LeaseClaim, LeaseLayer};
use agentgate_core::model::{BeginCommand, BeginOutcome, ConfirmationContext, Grant};
use serde_json::Value;
use sqlx::{Connection, MySqlConnection};

use crate::error::{corrupt, map_sqlx};
use crate::fast;
use crate::rows::{
    get, json, session_snapshot, turn_record, TurnRecord, SESSION_COLUMNS, TURN_COLUMNS,
};
use crate::steps::Sql;
use crate::{MySqlStore, NOW_MS};
use agentgate_store_sql::begin::{begin_in, give_back, BeginSql, Facts, Locked, Start};
use agentgate_store_sql::query::Run;
use agentgate_store_sql::Retry;

pub(crate) async fn begin(store: &MySqlStore, command: &BeginCommand) -> Result<BeginOutcome> {
    let mut retry = Retry::new();
    loop {
        match begin_once(store, command).await {
            Err(error) => retry.after(error).await?,
            done => return done,
        }
    }
}

async fn begin_once(store: &MySqlStore, command: &BeginCommand) -> Result<BeginOutcome> {
    if let Some(grant) = fast::begin(store, command).await? {
        return Ok(BeginOutcome::Started(grant));
    }
    let mut conn = store.connection().await?;
    let reserved = match &store.leases {
        Some(_) => Some(next_fence(&mut conn).await?),
        None => None,
    };
    let mut tx = conn.begin().await.map_err(map_sqlx)?;
    let (outcome, wrote) = begin_in(&Sql(store), &mut tx, command, reserved).await?;
    if wrote {
        if let Err(error) = tx.commit().await {
            if let BeginOutcome::Started(grant) = &outcome {
                give_back(
                    store.leases.as_deref(),
                    grant.turn_id.as_str(),
                    &grant.lease_token,
                )
                .await;
            }
            return Err(map_sqlx(error));
        }
    }
    // Otherwise dropping `tx` rolls back the no-op lock upserts: a replay or
    // a refusal writes nothing.
    Ok(outcome)
}

#[async_trait::async_trait]
impl BeginSql for Sql<'_> {
    type Record = TurnRecord;

    fn record(row: &<Self as Run>::Row) -> Result<Option<TurnRecord>> {
        turn_record(row)
    }

    async fn lock_and_read(
        &self,
        tx: &mut MySqlConnection,
        command: &BeginCommand,
    ) -> Result<Locked<TurnRecord>> {
        lock_user(tx, command.user_id.as_str()).await?;
        let (session, session_fence) = lock_session(tx, command).await?;
        let facts = read_facts(tx, command, self.0.config.max_turns_per_user).await?;
        Ok(Locked {
            session,
            session_fence,
            facts,
        })
    }

    async fn start(
        &self,
        tx: &mut MySqlConnection,
        command: &BeginCommand,
        facts: &Facts<TurnRecord>,
        confirm_target: Option<&TurnRecord>,
        start: Start,
    ) -> Result<Grant> {
        self::start(
            self.0,
            tx,
            command,
            facts,
            confirm_target,
            (start.kind, start.attempt, start.fence),
        )
        .await
    }
}

/// Locks the user's row, creating it on first use. A duplicate key under
/// `ON DUPLICATE KEY UPDATE` takes an exclusive lock on the existing row.
async fn lock_user(conn: &mut MySqlConnection, user_id: &str) -> Result<()> {
    sqlx::query(
        "INSERT INTO ag_users (user_id) VALUES (?) \
         ON DUPLICATE KEY UPDATE max_turns = max_turns",
    )
    .bind(user_id)
    .execute(conn)
    .await
    .map_err(map_sqlx)?;
    Ok(())
}

/// Locks the session's row, creating it bound to the caller on first use. A
/// fresh row (no holder, no pending confirmation, the caller's user) decides
/// exactly like no row at all, and is rolled back unless the begin starts.
async fn lock_session(
    conn: &mut MySqlConnection,
    command: &BeginCommand,
) -> Result<(SessionSnapshot, i64)> {
    sqlx::query(&format!(
        "INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms) \
         VALUES (?, ?, 0, {NOW_MS}) ON DUPLICATE KEY UPDATE user_id = user_id"
    ))
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .execute(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let row = sqlx::query(&format!(
        "SELECT {SESSION_COLUMNS}, fence FROM ag_sessions WHERE session_id = ? FOR UPDATE"
    ))
    .bind(command.session_id.as_str())
    .fetch_one(conn)
    .await
    .map_err(map_sqlx)?;
    Ok((session_snapshot(&row)?, get(&row, "fence")?))
}

/// Reads the clock, the cap override, the user's live permits and the
/// request's turn in one statement, sent after the locks are held so it sees
/// every grant that committed before them.
async fn read_facts(
    conn: &mut MySqlConnection,
    command: &BeginCommand,
    default_cap: u32,
) -> Result<Facts<TurnRecord>> {
    let row = sqlx::query(&format!(
        "SELECT {NOW_MS} AS now_ms, (SELECT max_turns FROM ag_users WHERE user_id = ?) AS cap, \
         permits.live, permits.soonest, {TURN_COLUMNS} \
         FROM (SELECT COUNT(*) AS live, MIN(lease_expires_at_ms) AS soonest FROM ag_sessions \
               WHERE user_id = ? AND lease_expires_at_ms > {NOW_MS}) AS permits \
         LEFT JOIN ag_turns ON ag_turns.session_id = ? AND ag_turns.client_request_id = ?"
    ))
    .bind(command.user_id.as_str())
    .bind(command.user_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.client_request_id.as_str())
    .fetch_one(conn)
    .await
    .map_err(map_sqlx)?;
    Ok(Facts {
        now_ms: get(&row, "now_ms")?,
        load: UserLoad::read(
            get(&row, "cap")?,
            default_cap,
            get(&row, "live")?,
            get(&row, "soonest")?,
        )?,
        turn: turn_record(&row)?,
    })
}

/// Takes the next fence: inside a transaction the counter row's exclusive
/// lock is held until the grant commits (in autocommit, for that statement
/// only), and `LAST_INSERT_ID(expr)` hands the new value back in the
/// same round trip.
pub(crate) async fn next_fence(conn: &mut MySqlConnection) -> Result<Fence> {
    let done = sqlx::query("UPDATE ag_fence SET value = LAST_INSERT_ID(value + 1) WHERE id = 1")
        .execute(conn)
        .await
        .map_err(map_sqlx)?;
    let value = i64::try_from(done.last_insert_id()).unwrap_or(0);
    if done.rows_affected() != 1 || value <= 0 {
        return Err(corrupt("the fence counter row is missing"));
    }
    Ok(Fence(value))
}

async fn start(
    store: &MySqlStore,
    tx: &mut MySqlConnection,
    command: &BeginCommand,
    facts: &Facts<TurnRecord>,
    target: Option<&TurnRecord>,
    (kind, attempt, reserved): (StartKind, u32, Option<Fence>),
) -> Result<Grant> {
    let now = facts.now_ms;
    let token = LeaseToken::generate();
    let ttl_ms = store.config.lease_ttl_ms();
    // A new turn that answers a pending confirmation: the pending turn
    // becomes `confirmed` in this transaction and the new one carries its
    // pending action and the decision.
    let confirming = command.confirmation.is_some() && kind == StartKind::New;
    let (turn_id, confirmation, pending) = match &facts.turn {
        Some(existing) => (
            existing.view.turn_id.clone(),
            existing.view.confirmation.clone(),
            None,
        ),
        None => {
            let turn_id = TurnId::generate();
            if confirming {
                let (confirmation, pending) =
                    mark_confirmed(tx, command, target, &turn_id, now).await?;
                (turn_id, Some(confirmation), pending)
            } else {
                (turn_id, None, None)
            }
        }
    };
    let fence = match reserved {
        Some(fence) => fence,
        None => next_fence(tx).await?,
    };
    grant_session(store, tx, command, &turn_id, &token, fence, now, confirming).await?;
    let lease_expires_in_ms = match &store.leases {
        Some(layer) => {
            let digest = token.digest_hex();
            let claim = LeaseClaim::for_begin(
                command,
                turn_id.as_str(),
                &digest,
                fence,
                ttl_ms,
                facts.load.cap,
            );
            acquire_external(layer.as_ref(), &claim).await?
        }
        None => ttl_ms,
    };
    if let Err(error) = write_turn(tx, command, facts, &turn_id, attempt, fence, pending).await {
        give_back(store.leases.as_deref(), turn_id.as_str(), &token).await;
        return Err(error);
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

/// Writes the grant on the session's row: holder, token digest, expiry,
/// fence, and a cleared pending confirmation when this start confirms it.
#[allow(clippy::too_many_arguments)] // one row's columns, each a different thing
async fn grant_session(
    store: &MySqlStore,
    tx: &mut MySqlConnection,
    command: &BeginCommand,
    turn_id: &TurnId,
    token: &LeaseToken,
    fence: Fence,
    now: i64,
    confirming: bool,
) -> Result<()> {
    // With an external layer the row keeps no expiry: the layer is the
    // authority on liveness; the row keeps the holder and the newest fence.
    let row_expiry = match store.leases {
        Some(_) => None,
        None => Some(now + store.config.lease_ttl_ms()),
    };
    sqlx::query(
        "UPDATE ag_sessions SET holder_turn_id = ?, lease_token_hash = ?, fence = ?, \
         lease_expires_at_ms = ?, updated_at_ms = ?, \
         pending_turn_id = IF(?, NULL, pending_turn_id), \
         pending_expires_at_ms = IF(?, NULL, pending_expires_at_ms) \
         WHERE session_id = ?",
    )
    .bind(turn_id.as_str())
    .bind(token.digest_hex())
    .bind(fence.0)
    .bind(row_expiry)
    .bind(now)
    .bind(confirming)
    .bind(confirming)
    .bind(command.session_id.as_str())
    .execute(tx)
    .await
    .map_err(map_sqlx)?;
    Ok(())
}

/// Takes the lease and permit in the external layer, both or neither;
/// returns the remaining lease, or the refusal the layer's state implies.
async fn acquire_external(layer: &dyn LeaseLayer, claim: &LeaseClaim<'_>) -> Result<i64> {
    agentgate_core::decide::layer_acquired(layer.acquire(claim).await?, claim.turn_id, claim.cap)
}

/// Restarts the existing turn or inserts the new one under `fence`.
async fn write_turn(
    tx: &mut MySqlConnection,
    command: &BeginCommand,
    facts: &Facts<TurnRecord>,
    turn_id: &TurnId,
    attempt: u32,
    fence: Fence,
    pending: Option<String>,
) -> Result<()> {
    let now = facts.now_ms;
    let written = if facts.turn.is_some() {
        sqlx::query(
            "UPDATE ag_turns SET state = 'running', attempt = ?, fence = ?, error = NULL, \
             retryable = NULL, updated_at_ms = ?, ended_at_ms = NULL, orphaned_at_ms = NULL \
             WHERE turn_id = ?",
        )
        .bind(i64::from(attempt))
        .bind(fence.0)
        .bind(now)
        .bind(turn_id.as_str())
        .execute(&mut *tx)
        .await
    } else {
        insert_turn(tx, command, turn_id, fence, now, pending).await
    };
    if written.map_err(map_sqlx)?.rows_affected() != 1 {
        return Err(corrupt(format!("turn {turn_id} was not written")));
    }
    Ok(())
}

/// Marks the confirmation's target (read under the session lock, so still
/// as read) `confirmed` by `turn_id`; returns the context the new turn
/// carries and the target's pending action as stored.
async fn mark_confirmed(
    tx: &mut MySqlConnection,
    command: &BeginCommand,
    target: Option<&TurnRecord>,
    turn_id: &TurnId,
    now: i64,
) -> Result<(ConfirmationContext, Option<String>)> {
    let confirmation = command
        .confirmation
        .as_ref()
        .ok_or_else(|| corrupt("confirming without a confirmation"))?;
    let updated = sqlx::query(
        "UPDATE ag_turns SET state = 'confirmed', confirmed_by = ?, updated_at_ms = ? \
         WHERE turn_id = ? AND state = 'awaiting_confirmation'",
    )
    .bind(turn_id.as_str())
    .bind(now)
    .bind(confirmation.turn_id.as_str())
    .execute(&mut *tx)
    .await
    .map_err(map_sqlx)?;
    let Some(target) = target.filter(|_| updated.rows_affected() == 1) else {
        return Err(Error::not_found(format!(
            "pending confirmation of turn {}",
            confirmation.turn_id
        )));
    };
    let pending = target.pending_text.clone();
    let context = ConfirmationContext {
        turn_id: confirmation.turn_id.clone(),
        decision: confirmation.decision,
        pending: json(pending.clone())?.unwrap_or(Value::Null),
    };
    Ok((context, pending))
}

async fn insert_turn(
    tx: &mut MySqlConnection,
    command: &BeginCommand,
    turn_id: &TurnId,
    fence: Fence,
    now: i64,
    pending: Option<String>,
) -> std::result::Result<sqlx::mysql::MySqlQueryResult, sqlx::Error> {
    // The pending action is copied as the canonical text it is stored as.
    let confirmation = command.confirmation.as_ref();
    sqlx::query(
        "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint, \
         state, attempt, fence, confirms_pending, confirms_turn_id, decision, created_at_ms, updated_at_ms, \
         payload) VALUES (?, ?, ?, ?, ?, 'running', 1, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(turn_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .bind(command.client_request_id.as_str())
    .bind(command.fingerprint.as_hex())
    .bind(fence.0)
    .bind(pending)
    .bind(confirmation.map(|c| c.turn_id.as_str()))
    .bind(confirmation.map(|c| c.decision.as_str()))
    .bind(now)
    .bind(now)
    .bind(command.payload.as_str())
    .execute(tx)
    .await
}
