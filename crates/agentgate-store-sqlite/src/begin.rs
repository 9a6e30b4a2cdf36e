//! The begin step: read the snapshot, ask `decide_begin`, apply, in one
//! `BEGIN IMMEDIATE` transaction. The session lease and the user's permit are
//! one row write, so they are taken together or not at all.
//!
//! The common case is one autocommit statement ([`begin_new`]): a request
//! with no turn yet and no confirmation, on a free session of the caller (or
//! a new one), by a user below its cap, without a lease layer. It inserts a
//! request row into `ag_begin_new` only when its `WHERE` holds, and that
//! table's trigger (migration 0006) writes what [`write_grant`] and
//! `insert_turn` write for a new turn: the fence counter, the session's
//! grant, the turn. The single writer makes the statement's reads and its
//! trigger's writes one atomic step. It grants only when `decide_begin`
//! would answer `Start { New, attempt 1 }` on the same facts; otherwise it
//! inserts nothing, writes nothing, and the full path below decides. It
//! never refuses. The conditions are PostgreSQL's `ag_begin_new`'s, checked
//! against `decide_begin` over every combination of the facts by
//! `agentgate-store-postgres`'s `fast_path_implies_a_new_start`:
//!
//! | the statement checks | fact `decide_begin` reads | why it starts |
//! |---|---|---|
//! | the command has no confirmation (checked here) | `confirms: None` | with no turn, `(None, None)` goes straight to `gate_start(New, 1)` |
//! | no lease layer (checked here) | leases in the rows | the row expiry is the lease, as read in the statement |
//! | no turn for `(session_id, client_request_id)` | `turn: None` | no replay, restart, takeover or exhaustion |
//! | no session row of another user | `session.user_id == user_id` | no `not_found` |
//! | no holder on the session row (`holder_turn_id IS NULL`) | `session.holder: None` | no `session_busy` (an expired holder falls back) |
//! | no pending confirmation (`pending_turn_id IS NULL`) | `session.pending: None` | no `awaiting_confirmation` (an expired one falls back) |
//! | the cap (the user row's, else the configured default) is in `0..=u32::MAX` | `UserLoad::read` succeeds | no `corrupt` |
//! | live leases of the user `<` cap | `load.live < load.cap` | no `user_at_capacity` |
//!
//! Calls into SQLite: the common case is the one statement; anything else is
//! that statement (inserting nothing) and then the full path.
//!
//! With an external lease layer (Redis) the single writer never waits on the
//! layer: the begin decides on a reader snapshot, takes a fence (one
//! autocommit statement), acquires the layer's lease and permit with it, and
//! only then writes the grant. The grant is written only if the same start
//! still holds, the session's fence is still below the new one (fences grow
//! per session) and the layer's lease has not lapsed on this process's clock
//! meanwhile; otherwise the layer's lease is given back and the begin decides
//! afresh, at most `MAX_STORE_RETRIES` times. A new request's grant is one
//! autocommit statement ([`grant_layered_new`], migration 0008) whose `WHERE`
//! is that check; anything else takes the writer to decide again and write.

use agentgate_core::decide::{
    decide_begin, layer_acquired, BeginDecision, BeginFacts, SessionSnapshot, StartKind,
    TurnSnapshot, UserLoad,
};
use std::time::Instant;

use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{Fence, LeaseToken, TurnId};
use agentgate_core::lease::{refuse_if_held, Acquired, LeaseClaim, LeaseLayer};
use agentgate_core::limits::MAX_STORE_RETRIES;
use agentgate_core::model::{BeginCommand, BeginOutcome, ConfirmationContext, Grant};
use agentgate_core::retry::backoff;
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
    /// The session's newest fence (0 before its first grant).
    session_fence: i64,
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
         s.pending_expires_at_ms, s.fence AS session_fence, \
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
    let load = UserLoad::read(
        get("cap")?,
        default_cap,
        get("live")?.ok_or_else(|| corrupt("the user's live-session count is NULL"))?,
        get("soonest")?,
    )?;
    Ok(Snapshot {
        now_ms: get("now_ms")?.ok_or_else(|| corrupt("the store's clock read NULL"))?,
        load,
        session: if present("user_id")? {
            Some(session_snapshot(&row)?)
        } else {
            None
        },
        // 0 before the session's first grant: every fence is above it.
        session_fence: match get("session_fence")? {
            Some(fence) => fence,
            None if present("user_id")? => return Err(corrupt("a session without a fence")),
            None => 0,
        },
        turn: if present("turn_id")? {
            Some(turn_snapshot(&row)?)
        } else {
            None
        },
    })
}

pub(crate) async fn begin(store: &SqliteStore, command: &BeginCommand) -> Result<BeginOutcome> {
    if let Some(layer) = &store.leases {
        return begin_layered(store, layer.as_ref(), command).await;
    }
    if let Some(grant) = begin_new(store, command).await? {
        return Ok(BeginOutcome::Started(grant));
    }
    begin_full(store, command).await
}

/// The full path without a lease layer: snapshot, `decide_begin`, apply, in
/// one write transaction.
async fn begin_full(store: &SqliteStore, command: &BeginCommand) -> Result<BeginOutcome> {
    let mut tx = store.write().await?;
    let decided = decide_in(&mut tx, command, store.config.max_turns_per_user).await?;
    let outcome = match decided.decision {
        BeginDecision::Reject(error) => return Err(error),
        BeginDecision::Replay { turn_id } => replay(&mut tx, &turn_id).await?,
        BeginDecision::Exhaust => exhaust(&mut tx, &decided).await?,
        BeginDecision::Start { kind, attempt } => {
            let fence = next_fence(&mut tx).await?;
            let turn_id = match &decided.turn {
                Some(turn) => TurnId::new(turn.turn_id.clone())?,
                None => TurnId::generate(),
            };
            let ttl_ms = store.config.lease_ttl_ms();
            let plan = StartPlan {
                existing: decided.turn.as_ref(),
                kind,
                attempt,
                now: decided.now,
            };
            let grant = Granted {
                turn_id,
                token: LeaseToken::generate(),
                fence,
                row_expiry: Some(decided.now + ttl_ms),
                lease_expires_in_ms: ttl_ms,
            };
            start(&mut tx, command, plan, grant).await?
        }
    };
    tx.commit().await.map_err(map_sqlx)?;
    Ok(outcome)
}

/// The common case in one autocommit statement (the module docs list when
/// it grants): the grant, or `None` when the full path must decide, in
/// which case nothing was written.
async fn begin_new(store: &SqliteStore, command: &BeginCommand) -> Result<Option<Grant>> {
    if store.leases.is_some() || command.confirmation.is_some() {
        return Ok(None);
    }
    let turn_id = TurnId::generate();
    let token = LeaseToken::generate();
    let ttl_ms = store.config.lease_ttl_ms();
    // Read to the end (`fetch_all`), so the statement runs to completion and
    // its autocommit transaction commits before the grant is handed out.
    let granted: Vec<i64> = sqlx::query_scalar(&format!(
        "INSERT INTO ag_begin_new (turn_id, session_id, user_id, client_request_id, token_hash, \
           fingerprint, payload, fence, now_ms, lease_expires_at_ms) \
         SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, f.value + 1, c.now_ms, c.now_ms + ?8 \
         FROM ag_fence f, (SELECT {NOW_MS} AS now_ms, \
                 COALESCE((SELECT max_turns FROM ag_users WHERE user_id = ?3), ?9) AS cap) c \
         WHERE f.id = 1 \
           AND NOT EXISTS (SELECT 1 FROM ag_turns \
                           WHERE session_id = ?2 AND client_request_id = ?4) \
           AND NOT EXISTS (SELECT 1 FROM ag_sessions WHERE session_id = ?2 \
                           AND (user_id <> ?3 OR holder_turn_id IS NOT NULL \
                                OR pending_turn_id IS NOT NULL)) \
           AND c.cap BETWEEN 0 AND {cap_max} \
           AND (SELECT COUNT(*) FROM ag_sessions \
                WHERE user_id = ?3 AND lease_expires_at_ms > c.now_ms) < c.cap \
         RETURNING fence",
        cap_max = u32::MAX
    ))
    .bind(turn_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .bind(command.client_request_id.as_str())
    .bind(token.digest_hex())
    .bind(command.fingerprint.as_hex())
    .bind(command.payload.as_str())
    .bind(ttl_ms)
    .bind(i64::from(store.config.max_turns_per_user))
    .fetch_all(&store.writer)
    .await
    .map_err(map_sqlx)?;
    let fence = match granted.as_slice() {
        [] => return Ok(None),
        [fence] => *fence,
        more => {
            return Err(corrupt(format!(
                "a one-statement begin granted {}",
                more.len()
            )))
        }
    };
    Ok(Some(Grant::first(
        command,
        turn_id,
        token,
        Fence(fence),
        ttl_ms,
    )))
}

/// The begin with an external lease layer: see the module documentation.
async fn begin_layered(
    store: &SqliteStore,
    layer: &dyn LeaseLayer,
    command: &BeginCommand,
) -> Result<BeginOutcome> {
    let cap = store.config.max_turns_per_user;
    for round in 0..MAX_STORE_RETRIES {
        if round > 0 {
            tokio::time::sleep(backoff(round)).await;
        }
        let seen = {
            let mut conn = store.reader().await?;
            decide_in(&mut conn, command, cap).await?
        };
        let seen_turn = seen.turn.as_ref().map(|t| t.turn_id.clone());
        match seen.decision {
            // A refusal or a replay read from one committed snapshot is as
            // true as one read under the writer.
            BeginDecision::Reject(error) => return Err(error),
            BeginDecision::Replay { turn_id } => {
                let mut conn = store.reader().await?;
                return replay(&mut conn, &turn_id).await;
            }
            BeginDecision::Exhaust => {
                // A turn whose lease is live in the layer is in flight, not
                // exhausted; ask before taking the writer. No new lease can
                // appear for it meanwhile: its attempts are used up.
                let turn_id = seen_turn
                    .as_deref()
                    .ok_or_else(|| corrupt("exhausting a begin that has no turn"))?;
                refuse_if_held(layer, command.session_id.as_str(), turn_id).await?;
                let mut tx = store.write().await?;
                let decided = decide_in(&mut tx, command, cap).await?;
                if !matches!(decided.decision, BeginDecision::Exhaust) {
                    continue;
                }
                let outcome = exhaust(&mut tx, &decided).await?;
                tx.commit().await.map_err(map_sqlx)?;
                return Ok(outcome);
            }
            BeginDecision::Start { .. } => {
                // The fence is durable before the layer or the caller sees it.
                let fence = {
                    let mut writer = store.writer_connection().await?;
                    next_fence(&mut writer).await?
                };
                let turn_id = match &seen_turn {
                    Some(turn_id) => TurnId::new(turn_id.clone())?,
                    None => TurnId::generate(),
                };
                let token = LeaseToken::generate();
                let digest = token.digest_hex();
                let claim = LeaseClaim::for_begin(
                    command,
                    turn_id.as_str(),
                    &digest,
                    fence,
                    store.config.lease_ttl_ms(),
                    seen.load.cap,
                );
                let asked = Instant::now();
                let acquired = layer.acquire(&claim).await?;
                if let Acquired::Busy { holder_turn_id, .. } = &acquired {
                    // The holder's grant may be newer than the snapshot this
                    // begin decided on (a twin of this request, or the turn
                    // that answered the same confirmation): the answer is
                    // the one `decide` gives on a snapshot that shows it.
                    // Decide again once its row is written.
                    if holder_turn_id != claim.turn_id
                        && fence_of(store, holder_turn_id)
                            .await?
                            .is_none_or(|holder| holder > seen.session_fence)
                    {
                        continue;
                    }
                }
                let remaining = layer_acquired(acquired, claim.turn_id, claim.cap)?;
                let granted = Granted {
                    turn_id,
                    token,
                    fence,
                    row_expiry: None,
                    lease_expires_in_ms: remaining,
                };
                match write_layered(store, command, &seen_turn, granted, asked).await {
                    Ok(Some(outcome)) => return Ok(outcome),
                    // The state moved between the snapshot and the writer:
                    // the lease went back to the layer; decide afresh.
                    Ok(None) => continue,
                    Err(error) => return Err(error),
                }
            }
        }
    }
    Err(Error::conflict(
        "begin: the session's state kept changing while its lease was being taken",
    ))
}

/// The fence of `turn_id`'s latest grant, if its row is written.
async fn fence_of(store: &SqliteStore, turn_id: &str) -> Result<Option<i64>> {
    let mut conn = store.reader().await?;
    sqlx::query_scalar("SELECT fence FROM ag_turns WHERE turn_id = ?")
        .bind(turn_id)
        .fetch_optional(&mut *conn)
        .await
        .map_err(map_sqlx)
}

/// Under the writer: decides again and writes the grant the layer already
/// holds, if the same start still holds. Gives the layer's lease back when
/// it writes nothing (`Ok(None)`: decide afresh) or fails to commit.
async fn write_layered(
    store: &SqliteStore,
    command: &BeginCommand,
    seen_turn: &Option<String>,
    granted: Granted,
    asked: Instant,
) -> Result<Option<BeginOutcome>> {
    let layer = store
        .leases
        .as_deref()
        .ok_or_else(|| corrupt("a layered begin without a lease layer"))?;
    let (turn_id, digest) = (granted.turn_id.to_string(), granted.token.digest_hex());
    let written = async {
        let lapsed =
            u128::try_from(granted.lease_expires_in_ms).unwrap_or(0) <= asked.elapsed().as_millis();
        if lapsed {
            return Ok(None);
        }
        if seen_turn.is_none()
            && command.confirmation.is_none()
            && grant_layered_new(store, command, &granted).await?
        {
            let Granted {
                turn_id,
                token,
                fence,
                lease_expires_in_ms,
                ..
            } = granted;
            return Ok(Some(BeginOutcome::Started(Grant::first(
                command,
                turn_id,
                token,
                fence,
                lease_expires_in_ms,
            ))));
        }
        let mut tx = store.write().await?;
        let decided = decide_in(&mut tx, command, store.config.max_turns_per_user).await?;
        let same_turn = decided.turn.as_ref().map(|t| &t.turn_id) == seen_turn.as_ref();
        let lapsed =
            u128::try_from(granted.lease_expires_in_ms).unwrap_or(0) <= asked.elapsed().as_millis();
        let BeginDecision::Start { kind, attempt } = decided.decision else {
            return Ok(None);
        };
        if !same_turn || decided.session_fence >= granted.fence.0 || lapsed {
            return Ok(None);
        }
        let plan = StartPlan {
            existing: decided.turn.as_ref(),
            kind,
            attempt,
            now: decided.now,
        };
        let outcome = start(&mut tx, command, plan, granted).await?;
        tx.commit().await.map_err(map_sqlx)?;
        Ok(Some(outcome))
    }
    .await;
    if !matches!(written, Ok(Some(_))) {
        // Nothing durable holds this lease: give it back now rather than
        // leave the session blocked until the TTL. A failed give-back only
        // leaves a lease that expires by itself; the caller still learns
        // what happened to the begin.
        if let Err(release) = layer.release(&turn_id, &digest).await {
            tracing::warn!(%release, %turn_id, "could not give back an unwritten grant");
        }
    }
    written
}

/// With a lease layer, the common grant in one autocommit statement: a new
/// request, no confirmation (both checked by the caller), the layer's lease
/// already held under `granted.fence`. It inserts a request row into
/// `ag_begin_layered`, whose trigger (migration 0008) writes what [`start`]
/// writes for a new turn with no row expiry, only when the full path under
/// the writer would write that start:
///
/// | the statement checks | what [`write_layered`]'s full path reads | why it writes this start |
/// |---|---|---|
/// | no turn for `(session_id, client_request_id)` | `turn: None`, the snapshot's (none) | the same turn, and `decide_begin` has no replay, restart, takeover or exhaustion |
/// | no session row of another user | `session.user_id == user_id` | no `not_found` |
/// | no holder named on the session row | `session.holder: None` | no `session_busy` |
/// | no pending confirmation | `session.pending: None` | no `awaiting_confirmation` |
/// | the session's fence is below `granted.fence` | `session_fence < fence` | no newer grant came between the fence and the write |
/// | the cap is in `0..=u32::MAX`, the rows' live leases below it | `UserLoad::read`, `load.live < load.cap` | no `corrupt`, no `user_at_capacity` |
///
/// `true` when it wrote the grant; `false` when it wrote nothing and the
/// full path must decide.
async fn grant_layered_new(
    store: &SqliteStore,
    command: &BeginCommand,
    granted: &Granted,
) -> Result<bool> {
    // Read to the end (`fetch_all`), so the statement runs to completion and
    // its autocommit transaction commits before the grant is handed out.
    let written: Vec<i64> = sqlx::query_scalar(&format!(
        "INSERT INTO ag_begin_layered (turn_id, session_id, user_id, client_request_id, \
           token_hash, fingerprint, payload, fence, now_ms) \
         SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, c.now_ms \
         FROM (SELECT {NOW_MS} AS now_ms, \
                 COALESCE((SELECT max_turns FROM ag_users WHERE user_id = ?3), ?9) AS cap) c \
         WHERE NOT EXISTS (SELECT 1 FROM ag_turns \
                           WHERE session_id = ?2 AND client_request_id = ?4) \
           AND NOT EXISTS (SELECT 1 FROM ag_sessions WHERE session_id = ?2 \
                           AND (user_id <> ?3 OR holder_turn_id IS NOT NULL \
                                OR pending_turn_id IS NOT NULL OR fence >= ?8)) \
           AND c.cap BETWEEN 0 AND {cap_max} \
           AND (SELECT COUNT(*) FROM ag_sessions \
                WHERE user_id = ?3 AND lease_expires_at_ms > c.now_ms) < c.cap \
         RETURNING fence",
        cap_max = u32::MAX
    ))
    .bind(granted.turn_id.as_str())
    .bind(command.session_id.as_str())
    .bind(command.user_id.as_str())
    .bind(command.client_request_id.as_str())
    .bind(granted.token.digest_hex())
    .bind(command.fingerprint.as_hex())
    .bind(command.payload.as_str())
    .bind(granted.fence.0)
    .bind(i64::from(store.config.max_turns_per_user))
    .fetch_all(&store.writer)
    .await
    .map_err(map_sqlx)?;
    match written.as_slice() {
        [] => Ok(false),
        [fence] if *fence == granted.fence.0 => Ok(true),
        other => Err(corrupt(format!(
            "a one-statement layered grant under fence {} wrote {other:?}",
            granted.fence.0
        ))),
    }
}

/// What a begin decided, with the facts a start or an exhaustion needs.
struct Decided {
    decision: BeginDecision,
    now: i64,
    load: UserLoad,
    session_fence: i64,
    turn: Option<TurnSnapshot>,
}

/// Reads the snapshot (and the confirmation chain it names) and asks
/// `decide_begin`.
async fn decide_in(
    conn: &mut SqliteConnection,
    command: &BeginCommand,
    default_cap: u32,
) -> Result<Decided> {
    let Snapshot {
        now_ms: now,
        load,
        session,
        session_fence,
        turn,
    } = snapshot(conn, command, default_cap).await?;
    let confirms = command.confirmation.as_ref().map(|c| c.turn_id.as_str());
    let confirm_target = match (confirms, &turn) {
        (Some(target), None) => turn_by_id(conn, target).await?,
        _ => None,
    };
    let continuation = match confirm_target
        .as_ref()
        .and_then(|t| t.confirmed_by.as_deref())
    {
        Some(next) => turn_by_id(conn, next).await?,
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
    let decision = decide_begin(&facts);
    Ok(Decided {
        decision,
        now,
        load,
        session_fence,
        turn,
    })
}

/// Records a turn that used all its attempts as failed for good, then
/// replays it.
async fn exhaust(tx: &mut Transaction<'static, Sqlite>, decided: &Decided) -> Result<BeginOutcome> {
    let turn_id = decided
        .turn
        .as_ref()
        .map(|t| t.turn_id.clone())
        .ok_or_else(|| corrupt("exhausting a begin that has no turn"))?;
    let done = sqlx::query(
        "UPDATE ag_turns SET state = 'failed', retryable = 0, \
         error = '{\"code\":\"attempts_exhausted\"}', updated_at_ms = ?1, ended_at_ms = ?1 \
         WHERE turn_id = ?2",
    )
    .bind(decided.now)
    .bind(&turn_id)
    .execute(&mut **tx)
    .await
    .map_err(map_sqlx)?;
    Error::expect_rows(done.rows_affected(), 1, "failing an exhausted turn")?;
    replay(tx, &turn_id).await
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
    now: i64,
}

/// A grant's lease: taken in the session row (`row_expiry`), or already
/// held in the external layer (`row_expiry` is `None`).
struct Granted {
    turn_id: TurnId,
    token: LeaseToken,
    fence: Fence,
    row_expiry: Option<i64>,
    lease_expires_in_ms: i64,
}

/// Writes the grant and returns it.
async fn start(
    tx: &mut Transaction<'static, Sqlite>,
    command: &BeginCommand,
    plan: StartPlan<'_>,
    granted: Granted,
) -> Result<BeginOutcome> {
    let Granted {
        turn_id,
        token,
        fence,
        row_expiry,
        lease_expires_in_ms,
    } = granted;
    let confirmation =
        match write_grant(tx, command, &turn_id, &token, fence, row_expiry, &plan).await? {
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
        attempt: plan.attempt,
        takeover: plan.kind == StartKind::Takeover,
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
    let granted = sqlx::query(
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
    Error::expect_rows(granted.rows_affected(), 1, "the session's grant")?;
    if existing.is_some() {
        let restarted = sqlx::query(
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
        Error::expect_rows(restarted.rows_affected(), 1, "restarting the turn")?;
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
    let inserted = sqlx::query(
        "INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint, \
         state, attempt, fence, confirms_pending, confirms_turn_id, decision, created_at_ms, updated_at_ms, \
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
    Error::expect_rows(inserted.rows_affected(), 1, "the new turn")?;
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

#[cfg(test)]
mod tests;
