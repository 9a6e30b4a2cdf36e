//! The begin step: read the snapshot, ask `decide_begin`, apply, in one
//! `BEGIN IMMEDIATE` transaction. The session lease and the user's permit are
//! one row write, so they are taken together or not at all.

use agentgate_core::decide::{
    decide_begin, BeginDecision, BeginFacts, SessionSnapshot, StartKind, TurnSnapshot, UserLoad,
};
use std::time::Duration;

use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{Fence, LeaseToken, TurnId};
use agentgate_core::lease::{refuse_if_held, Acquired, LeaseClaim, LeaseLayer};
use agentgate_core::model::{BeginCommand, BeginOutcome, ConfirmationContext, Grant};
use sqlx::{Row, Sqlite, SqliteConnection, Transaction};

use crate::error::{corrupt, map_sqlx};
use crate::rows::{session_snapshot, turn_snapshot, turn_view, TURN_COLUMNS};
use crate::{SqliteStore, NOW_MS};

pub(crate) async fn now_ms(conn: &mut SqliteConnection) -> Result<i64> {
    sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
}

async fn turn_by_id(conn: &mut SqliteConnection, turn_id: &str) -> Result<Option<TurnSnapshot>> {
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(turn_id)
    .fetch_optional(conn)
    .await
    .map_err(map_sqlx)?;
    row.as_ref().map(turn_snapshot).transpose()
}

/// Everything `decide_begin` reads about this request but the confirmation
/// chain, in one statement: the store's now, the user's load (cap override,
/// live permits, soonest expiry), the session, and the session's turn for
/// this client request. (SQLite evaluates `now` once per statement step.)
struct Snapshot {
    now_ms: i64,
    load: UserLoad,
    session: Option<SessionSnapshot>,
    turn: Option<TurnSnapshot>,
}

async fn snapshot(
    conn: &mut SqliteConnection,
    command: &BeginCommand,
    default_cap: u32,
) -> Result<Snapshot> {
    let row = sqlx::query(&format!(
        "SELECT l.now_ms, l.cap, l.live, l.soonest, \
         s.user_id, s.holder_turn_id, s.lease_expires_at_ms, s.pending_turn_id, \
         s.pending_expires_at_ms, \
         t.turn_id, t.session_id, t.fingerprint, t.state, t.attempt, t.retryable, t.confirmed_by \
         FROM (SELECT {NOW_MS} AS now_ms, \
               (SELECT max_turns FROM ag_users WHERE user_id = ?1) AS cap, \
               COUNT(*) AS live, MIN(lease_expires_at_ms) AS soonest \
               FROM ag_sessions WHERE user_id = ?1 AND lease_expires_at_ms > {NOW_MS}) l \
         LEFT JOIN ag_sessions s ON s.session_id = ?2 \
         LEFT JOIN ag_turns t ON t.session_id = ?2 AND t.client_request_id = ?3"
    ))
    .bind(command.user_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.client_request_id.as_str())
    .fetch_one(conn)
    .await
    .map_err(map_sqlx)?;
    let get = |column: &str| row.try_get::<Option<i64>, _>(column).map_err(map_sqlx);
    let present = |column: &str| {
        row.try_get::<Option<String>, _>(column)
            .map(|v| v.is_some())
            .map_err(map_sqlx)
    };
    let load = UserLoad {
        cap: get("cap")?
            .and_then(|c| u32::try_from(c).ok())
            .unwrap_or(default_cap),
        live: u32::try_from(get("live")?.unwrap_or(0)).unwrap_or(u32::MAX),
        soonest_expiry_ms: get("soonest")?,
    };
    Ok(Snapshot {
        now_ms: get("now_ms")?.unwrap_or_default(),
        load,
        session: if present("user_id")? {
            Some(session_snapshot(&row)?)
        } else {
            None
        },
        turn: if present("turn_id")? {
            Some(turn_snapshot(&row)?)
        } else {
            None
        },
    })
}

pub(crate) async fn begin(store: &SqliteStore, command: &BeginCommand) -> Result<BeginOutcome> {
    let mut tx = store.write().await?;
    let outcome = begin_in(store, &mut tx, command).await?;
    if let Err(error) = tx.commit().await {
        if let (Some(layer), BeginOutcome::Started(grant)) = (&store.leases, &outcome) {
            // The grant is not durable: give back the layer's lease at once.
            // A failed give-back only leaves a lease that expires by itself;
            // the caller must still learn why the begin failed: the commit.
            if let Err(release) = layer
                .release(grant.turn_id.as_str(), &grant.lease_token.digest_hex())
                .await
            {
                tracing::warn!(%release, turn_id = %grant.turn_id, "could not give back an undurable lease");
            }
        }
        return Err(map_sqlx(error));
    }
    Ok(outcome)
}

async fn begin_in(
    store: &SqliteStore,
    tx: &mut Transaction<'static, Sqlite>,
    command: &BeginCommand,
) -> Result<BeginOutcome> {
    let Snapshot {
        now_ms: now,
        load,
        session,
        turn,
    } = snapshot(tx, command, store.config.max_turns_per_user).await?;
    let confirms = command.confirmation.as_ref().map(|c| c.turn_id.as_str());
    let confirm_target = match (confirms, &turn) {
        (Some(target), None) => turn_by_id(tx, target).await?,
        _ => None,
    };
    let continuation = match confirm_target
        .as_ref()
        .and_then(|t| t.confirmed_by.as_deref())
    {
        Some(next) => turn_by_id(tx, next).await?,
        None => None,
    };
    let facts = BeginFacts {
        now_ms: now,
        user_id: command.user_id.as_str(),
        session_id: command.session_id.as_str(),
        fingerprint: command.fingerprint.as_hex(),
        confirms,
        session: session.as_ref(),
        turn: turn.as_ref(),
        confirm_target: confirm_target.as_ref(),
        continuation: continuation.as_ref(),
        load,
        resume_only: command.resume_only,
    };
    match decide_begin(&facts) {
        BeginDecision::Reject(error) => Err(error),
        BeginDecision::Replay { turn_id } => replay(tx, &turn_id).await,
        BeginDecision::Exhaust => {
            let turn_id = turn.as_ref().map(|t| t.turn_id.clone()).unwrap_or_default();
            if let Some(layer) = &store.leases {
                refuse_if_held(layer.as_ref(), command.session_id.as_str(), &turn_id).await?;
            }
            sqlx::query(
                "UPDATE ag_turns SET state = 'failed', retryable = 0, \
                 error = '{\"code\":\"attempts_exhausted\"}', updated_at_ms = ?1, ended_at_ms = ?1 \
                 WHERE turn_id = ?2",
            )
            .bind(now)
            .bind(&turn_id)
            .execute(&mut **tx)
            .await
            .map_err(map_sqlx)?;
            replay(tx, &turn_id).await
        }
        BeginDecision::Start { kind, attempt } => {
            let plan = StartPlan {
                existing: turn.as_ref(),
                kind,
                attempt,
                cap: load.cap,
                now,
            };
            start(store, tx, command, plan).await
        }
    }
}

async fn replay(conn: &mut SqliteConnection, turn_id: &str) -> Result<BeginOutcome> {
    let row = sqlx::query(&format!(
        "SELECT {TURN_COLUMNS} FROM ag_turns WHERE turn_id = ?"
    ))
    .bind(turn_id)
    .fetch_one(conn)
    .await
    .map_err(map_sqlx)?;
    Ok(BeginOutcome::Replay(turn_view(&row)?))
}

pub(crate) async fn next_fence(conn: &mut SqliteConnection) -> Result<Fence> {
    let value: i64 =
        sqlx::query_scalar("UPDATE ag_fence SET value = value + 1 WHERE id = 1 RETURNING value")
            .fetch_one(conn)
            .await
            .map_err(map_sqlx)?;
    Ok(Fence(value))
}

/// What `decide_begin` said to start, with what the start needs.
#[derive(Clone, Copy)]
struct StartPlan<'a> {
    existing: Option<&'a TurnSnapshot>,
    kind: StartKind,
    attempt: u32,
    cap: u32,
    now: i64,
}

/// Takes the lease and permit in the external layer, both or neither;
/// returns the remaining lease, or the refusal the layer's state implies.
async fn acquire_external(
    layer: &dyn LeaseLayer,
    command: &BeginCommand,
    turn_id: &TurnId,
    token: &LeaseToken,
    fence: Fence,
    ttl_ms: i64,
    plan: &StartPlan<'_>,
) -> Result<i64> {
    let claim = LeaseClaim {
        session_id: command.session_id.as_str(),
        user_id: command.user_id.as_str(),
        turn_id: turn_id.as_str(),
        token_digest: &token.digest_hex(),
        fence,
        ttl_ms,
        cap: plan.cap,
    };
    let retry = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0).max(1));
    match layer.acquire(&claim).await? {
        Acquired::Granted {
            lease_expires_in_ms,
        } => Ok(lease_expires_in_ms),
        Acquired::Busy {
            holder_turn_id,
            expires_in_ms,
        } if holder_turn_id == turn_id.as_str() => Err(Error::RequestInFlight {
            active_turn_id: holder_turn_id,
            retry_after: retry(expires_in_ms),
        }),
        Acquired::Busy {
            holder_turn_id,
            expires_in_ms,
        } => Err(Error::SessionBusy {
            active_turn_id: holder_turn_id,
            retry_after: retry(expires_in_ms),
        }),
        Acquired::AtCapacity {
            soonest_expires_in_ms,
        } => Err(Error::UserAtCapacity {
            cap: plan.cap,
            retry_after: retry(soonest_expires_in_ms),
        }),
    }
}

async fn start(
    store: &SqliteStore,
    tx: &mut Transaction<'static, Sqlite>,
    command: &BeginCommand,
    plan: StartPlan<'_>,
) -> Result<BeginOutcome> {
    let StartPlan {
        existing,
        kind,
        attempt,
        now,
        ..
    } = plan;
    let fence = next_fence(tx).await?;
    let token = LeaseToken::generate();
    let ttl_ms = store.config.lease_ttl_ms();
    let turn_id = match existing {
        Some(turn) => TurnId::new(turn.turn_id.clone())?,
        None => TurnId::generate(),
    };
    // With an external layer the row keeps no expiry: the layer is the
    // authority on liveness; the row keeps the holder and the newest fence.
    let (lease_expires_in_ms, row_expiry) = match &store.leases {
        Some(layer) => {
            let remaining = acquire_external(
                layer.as_ref(),
                command,
                &turn_id,
                &token,
                fence,
                ttl_ms,
                &plan,
            )
            .await?;
            (remaining, None)
        }
        None => (ttl_ms, Some(now + ttl_ms)),
    };
    let written = write_grant(tx, command, &turn_id, &token, fence, row_expiry, &plan).await;
    if let (Err(_), Some(layer)) = (&written, &store.leases) {
        // The grant will roll back: give the layer's lease back now rather
        // than leave the session blocked until the TTL.
        if let Err(error) = layer.release(turn_id.as_str(), &token.digest_hex()).await {
            tracing::warn!(%error, turn_id = %turn_id, "could not release an unwritten grant");
        }
    }
    let confirmation = match written? {
        Written::Inserted(confirmation) => confirmation,
        // A restarted turn keeps the confirmation it was begun with.
        Written::Restarted => match replay(tx, turn_id.as_str()).await? {
            BeginOutcome::Replay(view) => view.confirmation,
            BeginOutcome::Started(_) => unreachable!("replay returns a view"),
        },
    };
    Ok(BeginOutcome::Started(Grant {
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
    }))
}

/// What [`write_grant`] wrote for the turn.
enum Written {
    /// A new turn; a confirmation turn carries its context.
    Inserted(Option<ConfirmationContext>),
    /// An existing turn, restarted under the new fence.
    Restarted,
}

/// Writes a grant: the session row (holder, token digest, fence, expiry)
/// and the turn row (inserted, or restarted under the new fence).
async fn write_grant(
    tx: &mut Transaction<'static, Sqlite>,
    command: &BeginCommand,
    turn_id: &TurnId,
    token: &LeaseToken,
    fence: Fence,
    row_expiry: Option<i64>,
    plan: &StartPlan<'_>,
) -> Result<Written> {
    let StartPlan {
        existing,
        kind,
        attempt,
        now,
        ..
    } = *plan;
    let confirming = command.confirmation.is_some() && kind == StartKind::New;
    sqlx::query(
        "INSERT INTO ag_sessions (session_id, user_id, holder_turn_id, lease_token_hash, fence, \
         lease_expires_at_ms, updated_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
         ON CONFLICT (session_id) DO UPDATE SET holder_turn_id = ?3, lease_token_hash = ?4, \
         fence = ?5, lease_expires_at_ms = ?6, updated_at_ms = ?7, \
         pending_turn_id = CASE WHEN ?8 THEN NULL ELSE pending_turn_id END, \
         pending_expires_at_ms = CASE WHEN ?8 THEN NULL ELSE pending_expires_at_ms END",
    )
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .bind(turn_id.as_str())
    .bind(token.digest_hex())
    .bind(fence.0)
    .bind(row_expiry)
    .bind(now)
    .bind(confirming)
    .execute(&mut **tx)
    .await
    .map_err(map_sqlx)?;
    if existing.is_some() {
        sqlx::query(
            "UPDATE ag_turns SET state = 'running', attempt = ?1, fence = ?2, error = NULL, \
             retryable = NULL, updated_at_ms = ?3, ended_at_ms = NULL, orphaned_at_ms = NULL \
             WHERE turn_id = ?4",
        )
        .bind(attempt)
        .bind(fence.0)
        .bind(now)
        .bind(turn_id.as_str())
        .execute(&mut **tx)
        .await
        .map_err(map_sqlx)?;
        Ok(Written::Restarted)
    } else {
        insert_turn(tx, command, turn_id, fence, now)
            .await
            .map(Written::Inserted)
    }
}

async fn insert_turn(
    tx: &mut Transaction<'static, Sqlite>,
    command: &BeginCommand,
    turn_id: &TurnId,
    fence: Fence,
    now: i64,
) -> Result<Option<ConfirmationContext>> {
    // A confirmation turn carries the pending action and the decision; the
    // pending turn becomes `confirmed` in the same transaction.
    let (pending, decision) = match &command.confirmation {
        Some(confirmation) => {
            let confirmed: Option<Option<String>> = sqlx::query_scalar(
                "UPDATE ag_turns SET state = 'confirmed', confirmed_by = ?1, updated_at_ms = ?2 \
                 WHERE turn_id = ?3 AND state = 'awaiting_confirmation' RETURNING pending",
            )
            .bind(turn_id.as_str())
            .bind(now)
            .bind(confirmation.turn_id.as_str())
            .fetch_optional(&mut **tx)
            .await
            .map_err(map_sqlx)?;
            let Some(pending) = confirmed else {
                return Err(Error::not_found(format!(
                    "pending confirmation of turn {}",
                    confirmation.turn_id
                )));
            };
            (pending, Some(confirmation.decision.as_str()))
        }
        None => (None, None),
    };
    sqlx::query(
        "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint, \
         state, attempt, fence, pending, confirms_turn_id, decision, created_at_ms, updated_at_ms, \
         payload) VALUES (?1, ?2, ?3, ?4, ?5, 'running', 1, ?6, ?7, ?8, ?9, ?10, ?10, ?11)",
    )
    .bind(turn_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .bind(command.client_request_id.as_str())
    .bind(command.fingerprint.as_hex())
    .bind(fence.0)
    .bind(pending.as_deref())
    .bind(command.confirmation.as_ref().map(|c| c.turn_id.as_str()))
    .bind(decision)
    .bind(now)
    .bind(command.payload.as_str())
    .execute(&mut **tx)
    .await
    .map_err(map_sqlx)?;
    command
        .confirmation
        .as_ref()
        .map(|confirmation| {
            Ok(ConfirmationContext {
                turn_id: confirmation.turn_id.clone(),
                decision: confirmation.decision,
                pending: match pending.as_deref() {
                    Some(text) => serde_json::from_str(text)
                        .map_err(|e| corrupt(format!("stored pending: {e}")))?,
                    None => serde_json::Value::Null,
                },
            })
        })
        .transpose()
}
